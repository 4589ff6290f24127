"""Outcome rewards: math grading, and code run in a sandbox."""

from marlow.rewards.code import CodeScore, code_details, extract_code, score_code, score_code_batch
from marlow.rewards.math import (
    DEFAULT_TIMEOUT_S,
    FORMAT_PENALTY,
    grade_math,
    grade_math_batch,
    last_boxed,
    normalize_answer,
)
from marlow.rewards.sandbox import (
    Isolation,
    Job,
    Limits,
    RunResult,
    SandboxUnavailable,
    isolation_in_force,
    run_many,
    run_program,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FORMAT_PENALTY",
    "CodeScore",
    "Isolation",
    "Job",
    "Limits",
    "RunResult",
    "SandboxUnavailable",
    "code_details",
    "extract_code",
    "grade_math",
    "grade_math_batch",
    "isolation_in_force",
    "last_boxed",
    "normalize_answer",
    "run_many",
    "run_program",
    "score_code",
    "score_code_batch",
]
