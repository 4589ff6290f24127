"""Reports of grid results folders: ``marlow report DIR`` is :func:`build_report`.

* :mod:`~marlow.report.results`: read the folder, one :class:`CellRun` per finished cell, with
  ``runstats`` and the detectors computed once;
* :mod:`~marlow.report.tables` (Table 1, delta vs base, paired test, instability) and
  :mod:`~marlow.report.runtables` (Table 2, signatures, detector verdicts);
* :mod:`~marlow.report.significance`: mean / sd / n over seeds, the sign-flip permutation test, the
  within-seed slope with its stratified permutation test, and the detectable effect;
* :mod:`~marlow.report.evidence`: the detectors judged on labelled events, the claims C1-C4 and
  the mitigations; :mod:`~marlow.report.dose`: the dose-response over a role's slot count;
* :mod:`~marlow.report.figures`: the PNG figures; :mod:`~marlow.report.html`: page and CSV;
* :mod:`~marlow.report.build`: everything computed, then written atomically;
* :mod:`~marlow.report.inspect`: ``marlow inspect RUN``, the report of one run folder.
"""

from marlow.report.build import Report, build_report, make_report
from marlow.report.results import CellId, CellRun, GridRuns, load_results
from marlow.report.significance import paired_test, sign_flip_p, summarize
from marlow.report.tables import Table

__all__ = [
    "CellId",
    "CellRun",
    "Report",
    "GridRuns",
    "Table",
    "build_report",
    "load_results",
    "make_report",
    "paired_test",
    "sign_flip_p",
    "summarize",
]
