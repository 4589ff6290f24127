"""Answering a file of questions (``marlow answer RUN --input in.jsonl --out out.jsonl``).

Each row's question is its ``field`` column (default: the task's prompt column,
:func:`marlow.tasks.loaders.prompt_column`). Rows go through the workflow ``batch`` at a time
(every stage of a batch in one request list to the engine), and each row is written back as it
was with ``answer`` added (and ``turns`` with ``trace``), in input order. A row that is not a JSON
object, lacks the field as text (:func:`marlow.tasks.loaders.column_text`, as training reads a
prompt: a number is read as its text; a list, a mapping or a lone surrogate escape is
``not_text``), or holds characters the model cannot read (a tiny model: ``outside_vocabulary``,
as training skips such rows) is skipped and counted by reason, never written with a made-up
answer. A UTF-8 byte-order mark opening the file is no part of its first row. The output goes to a ``.partial`` sibling, renamed into place when every batch is done,
so an existing file is never half-overwritten; an existing output is refused without
``overwrite``.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from marlow.serving.trained import TrainedWorkflow
from marlow.tasks.loaders import SkippedRow, column_text


@dataclass
class FileReport:
    read: int = 0
    answered: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> rows


def check_paths(source: Path, out: Path, overwrite: bool) -> None:
    """Refuse, in one line, a ``source`` that is no file and an ``out`` that cannot be written
    (a folder, under a file, or a file already there without ``overwrite``): ValueError,
    FileNotFoundError or FileExistsError. ``marlow answer`` asks before it loads a model."""
    if source.is_dir():
        raise ValueError(f"--input {source} is a folder; give a JSON-lines file")
    if not source.is_file():
        raise FileNotFoundError(f"--input {source} does not exist")
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give the path of the answers' file")
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ValueError(f"--out {out}: {blocked} is a file, not a folder; give a file path")
    if out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} exists; pass --overwrite to replace it")


def answer_file(
    workflow: TrainedWorkflow,
    source: Path,
    out: Path,
    *,
    field: str,
    batch: int = 64,
    trace: bool = False,
    overwrite: bool = False,
    temperature: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> FileReport:
    """Answer every row of ``source`` into ``out`` (module docstring); ``progress(done, total)``
    after each batch."""
    check_paths(source, out, overwrite)
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    report = FileReport()
    rows: list[tuple[dict, str]] = []  # (row, its question)
    try:
        # "\n" only: a JSON string may hold U+2028, which splitlines() would split at
        lines = source.read_text(encoding="utf-8-sig").split("\n")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"--input {source}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
            f"{err.start}); give a JSON-lines file"
        ) from None
    for line in lines:
        if not line.strip():
            continue
        report.read += 1
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            report.skipped["bad_json"] += 1
            continue
        try:
            question = column_text(row, field)
        except SkippedRow as skipped:
            report.skipped[skipped.reason] += 1
            continue
        if workflow.unreadable(question):
            report.skipped["outside_vocabulary"] += 1
        else:
            rows.append((row, question))
    out = out.absolute()  # a tool stage may change the working directory while rows answer
    partial = out.with_name(out.name + ".partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with partial.open("w", encoding="utf-8") as f:
            for start in range(0, len(rows), batch):
                chunk = rows[start : start + batch]
                answers = workflow.answer(
                    [question for _, question in chunk], trace=trace, temperature=temperature
                )
                for (row, _), a in zip(chunk, answers, strict=True):
                    written = {**row, "answer": a.text}
                    if trace:
                        written["turns"] = a.turns
                    f.write(json.dumps(written) + "\n")
                report.answered += len(chunk)
                if progress is not None:
                    progress(report.answered, len(rows))
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return report
