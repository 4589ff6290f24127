"""The evidence a grid's report weighs: what happened in each run, whether the detectors saw
it coming, and whether the study's claims hold at this scale.

* :mod:`~marlow.report.evidence.labels`: each trained cell labelled after the fact (terminal
  cliff, gradient amplification, SP role capture) by rules over its finished series;
* :mod:`~marlow.report.evidence.detection`: the online detectors tuned and scored against those
  labels (precision, recall, lead), on seeds apart;
* :mod:`~marlow.report.evidence.claims`: the study's claims C1-C4 with effects, intervals,
  sign-flip tests and verdicts, and the mitigations measured on the unstable cells.
"""

from marlow.report.evidence.claims import ALPHA, claims_table, mitigation_table
from marlow.report.evidence.detection import DETECTORS, TUNE_GRID, detector_evaluation, tune
from marlow.report.evidence.labels import (
    LABELS,
    Label,
    grad_norm_ratios,
    label_amplification,
    label_capture,
    label_cliff,
)

__all__ = [
    "ALPHA",
    "DETECTORS",
    "LABELS",
    "TUNE_GRID",
    "Label",
    "claims_table",
    "detector_evaluation",
    "grad_norm_ratios",
    "label_amplification",
    "label_capture",
    "label_cliff",
    "mitigation_table",
    "tune",
]
