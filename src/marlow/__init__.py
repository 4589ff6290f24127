"""marlow: train multi-agent LLM workflows end to end with GRPO, compare shared and isolated
policies, and explain each run per role.

From Python (``marlow.api``): ``marlow.train(config, **settings)`` trains a cell and returns a
``Run``; ``marlow.load_run(path)`` reads a run folder (config, metrics table, checkpoints,
adapters, evals); ``marlow.evaluate(target, **settings)`` evaluates a checkpoint or a base model;
``marlow.load_workflow(path)`` loads a trained workflow once, and ``.answer(question)`` answers.
They are imported on first use, so that ``import marlow`` stays light.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads (torch's CPU kernels) that wait for each other spin for 1,000 turns, not
# libgomp's 300,000, before they sleep. Read once, when torch loads its OpenMP library, so it is
# set here, before marlow imports torch; a user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY stands.
# Alone on a machine a run keeps its speed; two runs sharing its cores each take about twice
# as long, where with the long spin each took 5-11x (bench/contention.py;
# docs/how-to/train.md#two-runs-on-one-machine). Spinning changes no number a run computes.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"

__version__ = "0.1.0"
__all__ = ["Metrics", "Run", "evaluate", "load_run", "load_workflow", "make_config", "train"]

if TYPE_CHECKING:
    from marlow.api import Metrics, Run, evaluate, load_run, load_workflow, make_config, train


def __getattr__(name: str) -> Any:
    if name in __all__:
        from marlow import api

        return getattr(api, name)
    raise AttributeError(f"module 'marlow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
