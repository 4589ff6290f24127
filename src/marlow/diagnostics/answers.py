"""Every validation's answers, kept so that a run can be graded again with another reward
without generating anything (``marlow rescore``).

At each validation the trainer writes ``RUN/val_answers/step_NNNNNN.jsonl.gz``: one line per
validation episode, in problem order, with the problem's id, the episode's final answer, the
texts of its answer turns (the candidates pass@N and majority voting read; under per-role credit
what those turns are trained on), its reward (null when it had none) and whether it was correct.
Gzipped: answers are text and compress several times. Written atomically; a resumed run removes
those of the steps it redoes, as it does signatures.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

from marlow.fileio import DamagedFileError, write_bytes
from marlow.types import Episode

FOLDER = "val_answers"


def answers_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / FOLDER


def write_answers(run_dir: str | Path, step: int, episodes: list[Episode]) -> Path:
    """Write step ``step``'s validation episodes (module docstring); returns the file."""
    lines = []
    for ep in episodes:
        row = {
            "problem": ep.problem_id,
            "final": ep.final_answer,
            "answers": [t.completion_text for t in ep.turns if t.kind == "answer"],
            "reward": ep.reward if math.isfinite(ep.reward) else None,
            "correct": bool(ep.correct),
        }
        lines.append(json.dumps(row))
    data = gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0)
    return write_bytes(answers_dir(run_dir) / f"step_{step:06d}.jsonl.gz", data)


ROW = ("problem", "final", "answers", "reward", "correct")
"""The fields of a row, as :func:`write_answers` writes them."""


def _is_row(row: Any) -> bool:
    return (
        isinstance(row, dict)
        and row.keys() >= set(ROW)
        and isinstance(row["answers"], list)
        and isinstance(row["correct"], bool)
        and (row["reward"] is None or isinstance(row["reward"], (int, float)))
    )


def read_answers(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """step -> that validation's rows, in step order ({} when none are stored)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(answers_dir(run_dir).glob("step_*.jsonl.gz")):
        try:
            text = gzip.decompress(path.read_bytes()).decode()
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except (OSError, EOFError, ValueError) as err:
            raise DamagedFileError(f"{path}: not a readable answers file ({err})") from None
        bad = next((n for n, row in enumerate(rows, 1) if not _is_row(row)), None)
        if bad is not None:
            raise DamagedFileError(
                f"{path}: row {bad} is not an answer's record ({', '.join(ROW)}); the file is "
                "damaged"
            )
        out[int(path.name[len("step_") :].split(".")[0])] = rows
    return out


def remove_after(run_dir: str | Path, step: int) -> None:
    """Remove the answers of validations after ``step`` (a resumed run redoes them)."""
    for path in answers_dir(run_dir).glob("step_*.jsonl.gz"):
        if int(path.name[len("step_") :].split(".")[0]) > step:
            path.unlink()
