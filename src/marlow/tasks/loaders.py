"""Loaders for real datasets: rows from a local file or the Hugging Face hub -> ``list[Problem]``.

``load(name, source, ...)`` (or one of ``load_gsm8k`` ... ``load_deepcoder``) returns
``(problems, report)``; the ``LoadReport`` counts rows read, kept and skipped by reason. ``split``
makes a seeded, fixed train/validation split.

Sources. ``source`` is a path to a ``.jsonl``, ``.jsonl.gz`` or ``.parquet`` file (parquet through
``pyarrow``), or a hub id ``owner/name`` read with ``datasets.load_dataset`` (imported lazily;
``config`` and ``split`` are passed through). A string that exists on disk, or ends in a known
suffix, is a file; otherwise a string of the form ``owner/name`` is a hub id; anything else is an
error. Missing ``pyarrow``/``datasets`` -> one line naming the extra:
``pip install 'marlow[data]'``.

Datasets (``Problem.answer`` is the gold for math; code keeps its tests in ``meta["tests"]``, in a
form ``marlow.rewards.code.parse_tests`` accepts):

* ``gsm8k``: ``question`` -> prompt; the gold is the text after the *last* ``####`` of ``answer``,
  stripped, with commas removed. The worked solution (before ``####``) is kept in
  ``meta["solution"]``.
* ``math500``: ``problem`` -> prompt, ``answer`` -> answer; meta keeps ``level``, ``subject``,
  ``unique_id`` and ``solution`` when present.
* ``humaneval``: ``prompt`` is the prompt as is (the function signature and docstring); answer is
  ``""``; meta has ``entry_point``, ``test``, ``canonical_solution``, ``task_id``,
  ``visible_tests`` (the docstring's examples: :func:`visible_examples`; absent without any) and
  ``tests = {"check": test, "entry_point": entry_point, "prompt": prompt}`` (the code reward's
  check-harness form; the prompt's helpers run on the trusted side).
* ``dapo``: the processed form (``open-r1/DAPO-Math-17k-Processed``): ``prompt`` (text) and
  ``solution`` (the ground truth). Also accepted, so the raw BytedTsinghua rows load too: a
  ``prompt`` that is a list of chat messages (the first ``user`` message's content is used) and
  ``reward_model.ground_truth`` when ``solution`` is absent. Prompt text is used as is (its own
  "Answer:" instruction included). Duplicates are exact matches of the stripped prompt text; the
  first occurrence is kept, later ones are counted under ``duplicate_prompt``.
* ``deepcoder`` (``agentica-org/DeepCoder-Preview-Dataset``), ``subset`` one of
  ``primeintellect``, ``taco``, ``lcbv5``, ``codeforces``: ``problem`` -> prompt; ``tests`` is
  JSON text (or already decoded). Tests are normalised to either ``{"inputs", "outputs"[,
  "fn_name"]}`` (taco's own form) or a list of ``{"input", "output", "testtype": "stdin" |
  "functional"[, "fn_name"]}`` rows (primeintellect's ``type: stdin_stdout | function_call``,
  lcbv5's ``testtype``, codeforces' plain input/output rows); a function name missing from a test
  is taken from the row's ``metadata.func_name``/``fn_name``. ``starter_code`` and ``metadata`` go
  to meta; the prompt is the problem text only (the workflow decides how to show starter code).
  Rows whose tests are empty go under ``empty_tests``; tests that are not JSON, have an unknown
  shape, or that ``parse_tests`` rejects go under ``unparseable_tests``. Never raises for a row.

* ``custom`` (:func:`load_columns`): a file of one's own columns for a task graded by the
  user's reward; the caller names the prompt, answer and id columns.

Choices the spec leaves open:

* Ids are ``<dataset>/<native id>`` where the data has one (MATH-500 ``unique_id``, HumanEval
  ``task_id``, DAPO ``extra_info.index``), else ``<dataset>/<row number in the source>`` (0-based,
  counted over all rows read, so skipping a row does not renumber the others). DeepCoder ids are
  ``deepcoder/<subset>/<row>``. A repeated id is skipped under ``duplicate_id``.
* Skip reasons: ``blank_line`` (a jsonl line of whitespace; not a row: not in ``rows_read``),
  ``bad_json`` (a jsonl line that is not a JSON object), ``not_utf8`` (a jsonl line whose bytes
  are not UTF-8; the other lines still load), ``missing_field:<name>`` (absent, null, or blank
  text), ``not_text:<name>`` (a list or a mapping, such as chat messages, or text with a lone
  surrogate escape, which no tokenizer reads; a number is read as its text), ``no_gold_marker`` (GSM8K), ``duplicate_prompt``,
  ``duplicate_id``, ``empty_tests``, ``unparseable_tests``, ``no_passing_tests``,
  ``outside_vocabulary`` (custom, on the tiny world).
* ``strict=True`` turns the first skipped row into a ``DatasetError`` naming its line (or table
  row) and id; by default rows are skipped and counted, the summary naming the first
  :data:`SHOWN` of each reason. A source with no rows, or where *no* row could be kept, is a wrong file:
  ``DatasetError`` naming the first skip reason, the fields the dataset needs and the fields found.
* ``limit`` caps the number of *kept* problems (reading stops there).
* ``split(problems, val_size, seed)``: each problem's key is ``sha256(f"{seed}:{id}")``; the
  ``val_size`` smallest keys are validation, the rest train. Both lists are returned in key order,
  so the result depends on the ids and the seed only, never on the input order. ``val_size`` is
  an int in ``[0, len(problems)]``; repeated ids are an error (the split could not be disjoint).
* ``permutation_split`` is the other rule (``task.split_rule=permutation``, the official code's):
  the ``datasets`` library's seeded permutation of the rows (``LoadReport.positions``), so a
  skipped row leaves a gap on its own side instead of shifting every other row.
* ``runtime_filter`` (DeepCoder): a runtime-results file; a row keeps the tests it marks
  ``passed``, a row it names with none passing is skipped under ``no_passing_tests`` and leaves
  the rows a split permutes, as the official data preparation filters its table before the
  shuffle.
* Every error is a ``DatasetError`` (a ``ValueError``) whose message is one line.
"""

from __future__ import annotations

import ast
import codecs
import gzip
import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marlow.config import CODE_DATASETS, DEEPCODER_SUBSETS, MATH_DATASETS
from marlow.rewards.code import parse_tests
from marlow.types import Problem, unicode_text

DATASETS = (*MATH_DATASETS, *CODE_DATASETS)
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
EXTRA_HINT = "pip install 'marlow[data]'"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DatasetError(ValueError):
    """A bad source, dataset name, or row (strict mode). The message is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass
class LoadReport:
    dataset: str
    source: str
    rows_read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    # Each kept problem's place in the rows a split permutes (the source's rows in order, less
    # those a runtime filter drops), and how many such rows were read: ``permutation_split``.
    positions: list[int] = field(default_factory=list)
    n_positions: int = 0
    where: dict[str, list[str]] = field(default_factory=dict)  # reason -> the first rows skipped

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, reason: str, where: str) -> None:
        """Count a row skipped for ``reason``; the first :data:`SHOWN` say where it was."""
        self.skipped[reason] += 1
        shown = self.where.setdefault(reason, [])
        if len(shown) < SHOWN:
            shown.append(where)

    def summary(self) -> str:
        def reason(k: str) -> str:
            at = self.where.get(k, [])
            more = ", ..." if self.skipped[k] > len(at) else ""
            return f"{k}={self.skipped[k]}" + (f" ({', '.join(at)}{more})" if at else "")

        why = ", ".join(reason(k) for k in sorted(self.skipped)) or "none"
        read = f"read {self.rows_read}, kept {self.kept}, skipped {why}"
        return f"{self.dataset} from {self.source}: {read}"


SHOWN = 3
"""Skipped rows a data line locates per reason (``line 12 (id sum-0011)``)."""
BLANK = object()
"""What reading yields for a blank line of a jsonl file: counted under ``blank_line``."""
NOT_UTF8 = object()
"""What reading yields for a jsonl line whose bytes are not UTF-8: counted under ``not_utf8``."""


class SkippedRow(Exception):  # noqa: N818 - control flow: a row skipped, and why
    """A row left out of a dataset, for ``reason`` (a key of :attr:`LoadReport.skipped`)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ----------------------------------------------------------------------------- reading rows


def read_rows(
    source: str | Path, *, config: str | None = None, split: str = "train"
) -> Iterator[tuple[str, Any]]:
    """(where, row) of a local file or hub dataset: ``where`` is ``line N`` of a jsonl file (from
    1, as an editor numbers it) or ``row N`` of a table (from 1); a jsonl line that is not a JSON
    object yields None, a blank one :data:`BLANK`, one whose bytes are not UTF-8
    :data:`NOT_UTF8`. A UTF-8 byte-order mark opening the file is no part of its first line."""
    path = Path(source)
    text = str(source)
    if path.exists() or text.endswith(FILE_SUFFIXES):
        return _read_file(path)
    if isinstance(source, str) and _HUB_ID.match(text):
        return ((f"row {i + 1}", row) for i, row in enumerate(_read_hub(text, config, split)))
    raise DatasetError(
        f"source {text!r} is neither an existing file ({', '.join(FILE_SUFFIXES)}) "
        "nor a hub id 'owner/name'"
    )


def _read_file(path: Path) -> Iterator[tuple[str, Any]]:
    name = path.name
    if not name.endswith(FILE_SUFFIXES):
        raise DatasetError(
            f"{path}: unsupported file type; valid suffixes: {', '.join(FILE_SUFFIXES)}"
        )
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    if name.endswith(".parquet"):
        return ((f"row {i + 1}", row) for i, row in enumerate(_read_parquet(path)))
    return _read_jsonl(path)


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"reading {path.name} needs pyarrow: {EXTRA_HINT}") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a corrupt/non-parquet file
        raise DatasetError(f"{path}: not a readable parquet file ({_first_line(e)})") from None


_WIDE_MARKS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)
"""The byte-order marks of encodings other than UTF-8 a file may open with (UTF-32's first:
UTF-16's little-endian mark opens UTF-32's)."""


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
        for mark, name in _WIDE_MARKS:
            if head.startswith(mark):
                raise DatasetError(
                    f"{path}: the file is {name} text (its byte-order mark says so); jsonl is read "
                    "as UTF-8: save it as UTF-8"
                )
        # bytes that are not UTF-8 decode to lone surrogates, and cost that line only
        with opener(path, "rt", encoding="utf-8-sig", errors="surrogateescape") as f:
            for number, line in enumerate(f, start=1):
                where = f"line {number}"
                if not line.strip():
                    yield where, BLANK
                    continue
                if not unicode_text(line):
                    yield where, NOT_UTF8
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                yield where, row if isinstance(row, dict) else None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"{path}: not a readable jsonl file ({_first_line(e)})") from None


def _read_hub(hub_id: str, config: str | None, split: str) -> Iterator[dict]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"loading hub id {hub_id!r} needs `datasets`: {EXTRA_HINT}") from None
    try:
        ds = datasets.load_dataset(hub_id, name=config, split=split)
    except Exception as e:  # offline, unknown id/config/split, ...: all one line
        raise DatasetError(
            f"could not load hub dataset {hub_id!r} (config={config}, split={split}): "
            f"{_first_line(e)}"
        ) from None
    return iter(ds)


def _located(where: str, row: Any, needs: tuple[str, ...]) -> str:
    """``where`` with the row's id where it has one (an ``id`` column, or the first of ``needs``
    naming an id), so that a user finds it: ``line 301 (id sum-0300)``."""
    if isinstance(row, dict):
        for key in ("id", *(k for k in needs if "id" in k)):
            value = row.get(key)
            if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
                return f"{where} (id {str(value)[:40]})"
    return where


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0].strip() if lines else ''}"[:300]


# ----------------------------------------------------------------------------- row helpers


def column_text(row: dict, key: str) -> str:
    """The text of ``row``'s column ``key`` (a number is read as its text); raises
    :class:`SkippedRow`: ``missing_field:KEY`` where it is absent, null or blank, ``not_text:KEY``
    where it is a list or a mapping (chat messages, say) or not valid unicode (a lone surrogate
    escape, which no tokenizer reads)."""
    return _as_text(row.get(key), key)


def _as_text(value: Any, key: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise SkippedRow(f"missing_field:{key}")
    if isinstance(value, list | dict | tuple) or not unicode_text(str(value)):
        raise SkippedRow(f"not_text:{key}")
    return value if isinstance(value, str) else str(value)


def _maybe_json(v: Any) -> Any:
    if isinstance(v, str | bytes):
        s = v.strip() if isinstance(v, str) else v
        if not s:
            return None
        return json.loads(s)
    return v


# ----------------------------------------------------------------------------- per dataset


def _gsm8k(row: dict, i: int) -> Problem:
    question, answer = column_text(row, "question"), column_text(row, "answer")
    if "####" not in answer:
        raise SkippedRow("no_gold_marker")
    solution, gold = answer.rsplit("####", 1)
    gold = gold.strip().replace(",", "")
    if not gold:
        raise SkippedRow("no_gold_marker")
    return Problem(f"gsm8k/{i}", question, gold, {"solution": solution.strip()})


def _math500(row: dict, i: int) -> Problem:
    problem, answer = column_text(row, "problem"), column_text(row, "answer").strip()
    meta = {k: row[k] for k in ("level", "subject", "unique_id", "solution") if k in row}
    uid = row.get("unique_id")
    return Problem(f"math500/{uid if uid else i}", problem, answer, meta)


_EXAMPLE = re.compile(r"^\s*(?:>>>\s*)?(?P<call>\w+\(.*\))\s*(?:==|➞|=>|->)\s*(?P<out>.+)$")


def visible_examples(prompt: str, entry: str) -> dict | None:
    """A HumanEval prompt's docstring examples as function-call tests (the code reward's format:
    ``fn_name``, ``inputs``, ``outputs``): ``>>> f(args)`` with the value on the next line, or
    ``f(args) == value`` (also ``➞``, ``=>``, ``->``) on one line; each argument and value a
    Python literal, each value kept as its JSON. These are what a solver may see, never the
    hidden ``test`` (a few HumanEval docstrings show a wrong value, e.g. HumanEval/47's median:
    the canonical solution fails those); None when the prompt shows none that parse."""
    lines = prompt.splitlines()
    inputs, outputs = [], []
    for i, line in enumerate(lines):
        text = line.strip()
        call, out = None, None
        if text.startswith(">>>") and i + 1 < len(lines):
            call, out = text[3:].strip(), lines[i + 1].strip()
        match = _EXAMPLE.match(text)
        if match:
            call, out = match["call"], match["out"].strip().rstrip(".")
        if not call or not out or out.startswith(">>>"):
            continue
        try:
            node = ast.parse(call, mode="eval").body
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id != entry or node.keywords:
                continue
            args = [ast.literal_eval(a) for a in node.args]
            # as JSON, the code reward's form of an expected value (a tuple is a list there)
            value = json.dumps(ast.literal_eval(out), allow_nan=False)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            continue
        if args not in inputs:
            inputs.append(args)
            outputs.append(value)
    if not inputs:
        return None
    return {"fn_name": entry, "inputs": inputs, "outputs": outputs}


def _humaneval(row: dict, i: int) -> Problem:
    prompt, entry, test = (
        column_text(row, "prompt"),
        column_text(row, "entry_point"),
        column_text(row, "test"),
    )
    canonical = row.get("canonical_solution") or ""
    task_id = row.get("task_id") or f"HumanEval/{i}"
    meta = {
        "task_id": task_id,
        "entry_point": entry,
        "test": test,
        "canonical_solution": canonical,
        "tests": {"check": test, "entry_point": entry, "prompt": prompt},
    }
    visible = visible_examples(prompt, entry)
    if visible is not None:
        meta["visible_tests"] = visible
    return Problem(f"humaneval/{task_id}", prompt, "", meta)


def _dapo(row: dict, i: int) -> Problem:
    prompt = row.get("prompt")
    if isinstance(prompt, list):  # raw form: chat messages
        users = [m for m in prompt if isinstance(m, dict) and m.get("role", "user") == "user"]
        prompt = users[0].get("content") if users else None
    prompt = _as_text(prompt, "prompt")
    answer = row.get("solution")
    if answer is None and isinstance(row.get("reward_model"), dict):
        answer = row["reward_model"].get("ground_truth")
    answer = _as_text(answer, "solution")
    extra = row.get("extra_info")
    idx = extra.get("index") if isinstance(extra, dict) else None
    meta = {k: row[k] for k in ("data_source", "ability") if k in row}
    return Problem(f"dapo/{idx if idx not in (None, '') else i}", prompt, str(answer).strip(), meta)


def _deepcoder_tests(raw: Any, metadata: dict) -> Any:
    """Normalise DeepCoder tests (module docstring); raises ``SkippedRow``."""
    try:
        tests = _maybe_json(raw)
    except ValueError:
        raise SkippedRow("unparseable_tests") from None
    if not tests:
        raise SkippedRow("empty_tests")
    default_fn = metadata.get("func_name") or metadata.get("fn_name") or ""
    if isinstance(tests, dict):
        if "inputs" not in tests and "outputs" not in tests:
            raise SkippedRow("unparseable_tests")
        out = {"inputs": tests.get("inputs"), "outputs": tests.get("outputs")}
        fn = tests.get("fn_name") or default_fn
        if fn:
            out["fn_name"] = fn
    elif isinstance(tests, list):
        out = []
        for t in tests:
            if not isinstance(t, dict) or "input" not in t or "output" not in t:
                raise SkippedRow("unparseable_tests")
            kind = t.get("testtype") or t.get("type") or ""
            tmeta = _maybe_json(t.get("metadata")) or {}
            fn = t.get("fn_name") or (tmeta.get("func_name") if isinstance(tmeta, dict) else None)
            functional = kind in ("functional", "function_call") or (not kind and fn)
            row = {"input": t["input"], "output": t["output"]}
            if functional:
                row.update(testtype="functional", fn_name=fn or default_fn)
                if not row["fn_name"]:
                    raise SkippedRow("unparseable_tests")
            else:
                row["testtype"] = "stdin"
            out.append(row)
    else:
        raise SkippedRow("unparseable_tests")
    try:
        cases = parse_tests(out)
    except (ValueError, TypeError, KeyError):
        raise SkippedRow("unparseable_tests") from None
    if not cases:
        raise SkippedRow("empty_tests")
    return out


def _deepcoder(subset: str) -> Callable[[dict, int], Problem]:
    def convert(row: dict, i: int) -> Problem:
        problem = column_text(row, "problem")
        if "tests" not in row or row["tests"] is None:
            raise SkippedRow("missing_field:tests")
        try:
            metadata = _maybe_json(row.get("metadata")) or {}
        except ValueError:
            metadata = {}
        if not isinstance(metadata, dict):
            metadata = {}
        tests = _deepcoder_tests(row["tests"], metadata)
        meta = {"subset": subset, "tests": tests, "metadata": metadata}
        if row.get("starter_code"):
            meta["starter_code"] = row["starter_code"]
        return Problem(f"deepcoder/{subset}/{i}", problem, "", meta)

    return convert


# field names each dataset needs, for wrong-file messages
_FIELDS = {
    "gsm8k": ("question", "answer"),
    "math500": ("problem", "answer"),
    "humaneval": ("prompt", "entry_point", "test"),
    "dapo": ("prompt", "solution"),
    "deepcoder": ("problem", "tests"),
}


_HINTS = {
    "not_text": "a list, a mapping (chat messages?) or a lone surrogate escape, where the column "
    "must hold the problem's text",
    "not_utf8": "the file's bytes are not UTF-8 text; save it as UTF-8",
}
"""What a skip reason means, said where no row of a source could be loaded for it."""


def _run(
    dataset: str,
    source: str | Path,
    convert: Callable[[dict, int], Problem],
    *,
    config: str | None,
    split: str,
    strict: bool,
    limit: int | None,
    dedup_prompts: bool = False,
    prefilter: Callable[[dict, int], dict] | None = None,
    needs: tuple[str, ...] | None = None,
) -> tuple[list[Problem], LoadReport]:
    needs = needs if needs is not None else _FIELDS[dataset]
    report = LoadReport(dataset, str(source))
    problems: list[Problem] = []
    seen_ids: set[str] = set()
    seen_prompts: set[str] = set()
    keys: set[str] = set()
    i = -1  # the row's number among the source's rows (blank lines are none)
    for where, row in read_rows(source, config=config, split=split):
        if limit is not None and len(problems) >= limit:
            break
        if row is BLANK:
            report.skip("blank_line", where)
            continue
        i += 1
        report.rows_read += 1
        try:
            if row is NOT_UTF8:
                raise SkippedRow("not_utf8")
            if row is None:
                raise SkippedRow("bad_json")
            keys.update(row)
            if prefilter is not None:
                row = prefilter(row, i)  # raises SkippedRow: the row leaves the dataset itself
            position = report.n_positions
            report.n_positions += 1
            p = convert(row, i)
            if dedup_prompts:
                key = p.prompt.strip()
                if key in seen_prompts:
                    raise SkippedRow("duplicate_prompt")
                seen_prompts.add(key)
            if p.id in seen_ids:
                raise SkippedRow("duplicate_id")
        except SkippedRow as s:
            located = _located(where, row, needs)
            if strict:
                raise DatasetError(
                    f"{source}: {located} of {dataset} rejected ({s.reason}); "
                    f"{dataset} rows need fields: {', '.join(needs)}"
                ) from None
            report.skip(s.reason, located)
            continue
        seen_ids.add(p.id)
        problems.append(p)
        report.positions.append(position)
    report.kept = len(problems)
    if report.rows_read == 0 and limit != 0:
        raise DatasetError(f"{source}: no rows to load as {dataset}")
    if not problems and limit != 0:
        reason = report.skipped.most_common(1)[0][0]
        hint = _HINTS.get(reason.partition(":")[0])
        raise DatasetError(
            f"{source}: no row could be loaded as {dataset} (most rows: {reason}"
            f"{f': {hint}' if hint else ''}); "
            f"{dataset} rows need fields: {', '.join(needs)}; "
            f"found: {', '.join(sorted(keys)) or 'none'}"
        )
    return problems, report


def load_gsm8k(source, *, split="test", strict=False, limit=None):
    return _run("gsm8k", source, _gsm8k, config="main", split=split, strict=strict, limit=limit)


def load_math500(source, *, split="test", strict=False, limit=None):
    return _run("math500", source, _math500, config=None, split=split, strict=strict, limit=limit)


def load_humaneval(source, *, split="test", strict=False, limit=None):
    return _run(
        "humaneval", source, _humaneval, config=None, split=split, strict=strict, limit=limit
    )


def load_dapo(source, *, config="all", split="train", strict=False, limit=None):
    return _run(
        "dapo",
        source,
        _dapo,
        config=config,
        split=split,
        strict=strict,
        limit=limit,
        dedup_prompts=True,
    )


def load_deepcoder(
    source, *, subset: str, split="train", strict=False, limit=None, runtime_filter=None
):
    """``runtime_filter``: the path of a runtime-results file (:func:`runtime_results`); each
    row keeps only the tests it marks ``passed``, and a row left with none leaves the dataset
    (counted under ``no_passing_tests``), as in the official code's data preparation."""
    if subset not in DEEPCODER_SUBSETS:
        raise DatasetError(
            f"unknown deepcoder subset {subset!r}; valid subsets: {', '.join(DEEPCODER_SUBSETS)}"
        )
    keep = None if runtime_filter is None else _passing_tests(runtime_results(runtime_filter))
    return _run(
        "deepcoder",
        source,
        _deepcoder(subset),
        config=subset,
        split=split,
        strict=strict,
        limit=limit,
        prefilter=keep,
    )


def runtime_results(path: str | Path) -> dict[str, dict[str, str]]:
    """A runtime-results file: JSON ``{row: {test: {"status": ...}}}`` (row and test are 0-based
    indices, as strings; the official code's ``coding_dataset_filtering/runtime_results.json``),
    read as ``{row: {test: status}}``. A file that is not of that shape is a DatasetError."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DatasetError(
            f"task.runtime_filter {path}: not a readable JSON file ({err})"
        ) from None
    shape = "{row: {test: {status: ...}}}"
    if not isinstance(data, dict):
        raise DatasetError(f"task.runtime_filter {path}: expected {shape}")
    out: dict[str, dict[str, str]] = {}
    for row, tests in data.items():
        if not isinstance(tests, dict) or not all(isinstance(t, dict) for t in tests.values()):
            raise DatasetError(f"task.runtime_filter {path}: row {row} is not {shape}")
        out[str(row)] = {str(k): str(t.get("status")) for k, t in tests.items()}
    return out


def _passing_tests(results: dict[str, dict[str, str]]) -> Callable[[dict, int], dict]:
    """The runtime filter as a row pre-filter. A row the results do not name is kept whole; a
    named row keeps the tests (by index in its test list) marked ``passed``. TACO's
    ``{"inputs", "outputs"}`` form keeps the passing input/output pairs."""

    def keep(row: dict, i: int) -> dict:
        marks = results.get(str(i))
        if marks is None:
            return row
        try:
            tests = _maybe_json(row.get("tests"))
        except ValueError:
            return row  # the converter counts it as unparseable
        passed = [k for k in range(_n_tests(tests)) if marks.get(str(k)) == "passed"]
        if not passed:
            raise SkippedRow("no_passing_tests")
        if isinstance(tests, dict):
            kept = {**tests, **{f: [tests[f][k] for k in passed] for f in ("inputs", "outputs")}}
        else:
            kept = [tests[k] for k in passed]
        return {**row, "tests": kept}

    return keep


def load_columns(
    source: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str | None = None,
    id_field: str | None = None,
    vocabulary: str | None = None,
    outside: Counter | None = None,
    reserved: tuple[str, ...] = (),
    split: str = "train",
    strict: bool = False,
    limit: int | None = None,
) -> tuple[list[Problem], LoadReport]:
    """A file of one's own columns (a custom task): ``prompt_field`` -> the prompt, the
    ``answer_field`` (if any) -> the gold answer, ``id_field`` (or ``id`` when the row has one,
    else the first 16 hex digits of the sha256 of the row's JSON) -> the id. Every column but
    the prompt's is kept in ``meta["columns"]`` for the reward; a column named in ``reserved``
    (the reward's own keywords) is an error. With ``vocabulary`` (the tiny world's characters)
    a prompt holding any other character is skipped as ``outside_vocabulary`` and its
    characters counted in ``outside``, never replaced."""
    allowed = set(vocabulary) if vocabulary is not None else None

    def convert(row: dict, i: int) -> Problem:
        clash = [k for k in reserved if k in row and k != prompt_field]
        if clash:
            raise DatasetError(
                f"{source}: column {clash[0]!r} has the name of a keyword marlow passes to the "
                f"reward ({', '.join(reserved)}); rename the column"
            )
        prompt = column_text(row, prompt_field)
        answer = column_text(row, answer_field) if answer_field is not None else ""
        if id_field is not None:
            native = column_text(row, id_field)
        elif row.get("id") not in (None, ""):
            native = column_text(row, "id")
        else:
            blob = json.dumps(row, sort_keys=True, default=str).encode()
            native = hashlib.sha256(blob).hexdigest()[:16]
        if allowed is not None:
            strange = sorted({c for c in prompt if c not in allowed})
            if strange:
                if outside is not None:
                    outside.update(strange)
                raise SkippedRow("outside_vocabulary")
        columns = {k: v for k, v in row.items() if k != prompt_field}
        return Problem(str(native), prompt, answer.strip(), {"columns": columns})

    needs = tuple(f for f in (prompt_field, answer_field, id_field) if f is not None)
    return _run(
        "custom",
        source,
        convert,
        config=None,
        split=split,
        strict=strict,
        limit=limit,
        needs=needs,
    )


def prompt_column(dataset: str | None, prompt_field: str | None) -> str:
    """The column a task's prompts come from: a custom task's ``prompt_field`` (default
    ``prompt``), a built-in dataset's own (``question`` for gsm8k, ...), else ``prompt``."""
    if prompt_field is not None:
        return prompt_field
    return _FIELDS[dataset][0] if dataset in _FIELDS else "prompt"


def _n_tests(tests: Any) -> int:
    if isinstance(tests, dict):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if isinstance(inputs, list) and isinstance(outputs, list):
            return min(len(inputs), len(outputs))
        return 0
    return len(tests) if isinstance(tests, list) else 0


_LOADERS = {
    "gsm8k": load_gsm8k,
    "math500": load_math500,
    "humaneval": load_humaneval,
    "dapo": load_dapo,
    "deepcoder": load_deepcoder,
}


def load(name: str, source: str | Path, **kwargs: Any) -> tuple[list[Problem], LoadReport]:
    """Load dataset ``name`` (one of ``DATASETS``) from ``source``; see the module docstring."""
    if name not in _LOADERS:
        raise DatasetError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if name == "deepcoder" and "subset" not in kwargs:
        raise DatasetError(
            f"deepcoder needs a subset; valid subsets: {', '.join(DEEPCODER_SUBSETS)}"
        )
    return _LOADERS[name](source, **kwargs)


# ----------------------------------------------------------------------------- split


def held_out_count(holdout: float | int, n: int) -> int:
    """How many of ``n`` rows ``holdout`` holds out: a fraction in (0, 1) rounds up (as the
    ``datasets`` library's ``train_test_split`` does), an int is a count."""
    if isinstance(holdout, float):
        if not 0.0 < holdout < 1.0:
            raise DatasetError(f"task.holdout as a fraction must be in (0, 1), got {holdout}")
        return math.ceil(holdout * n)
    return holdout


def permutation_split(
    problems: list[Problem], positions: list[int], n: int, holdout: float | int, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """(train, held out) the way the ``datasets`` library splits a table of ``n`` rows (its
    ``train_test_split(test_size=holdout, seed=seed)``, and ``shuffle(seed)`` then the first
    ``holdout`` rows): the rows of ``numpy.random.default_rng(seed).permutation(n)``, the first
    ``held_out_count(holdout, n)`` held out, in that order. ``positions[i]`` is problem i's row
    (``LoadReport.positions``); a row marlow skipped is simply absent from its side."""
    import numpy as np

    n_held = held_out_count(holdout, n)
    if not 0 <= n_held < n:
        raise DatasetError(f"task.holdout holds out {n_held} of {n} rows; leave some for training")
    at = dict(zip(positions, problems, strict=True))
    order = [int(r) for r in np.random.default_rng(seed).permutation(n)]
    held = [at[r] for r in order[:n_held] if r in at]
    return [at[r] for r in order[n_held:] if r in at], held


def split(problems: list[Problem], val_size: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, val): a disjoint split fixed by the ids and the seed, not the input order."""
    if isinstance(val_size, bool) or not isinstance(val_size, int):
        raise DatasetError(f"val_size must be an int, got {type(val_size).__name__}")
    if not 0 <= val_size <= len(problems):
        raise DatasetError(f"val_size must be in [0, {len(problems)}], got {val_size}")
    ids = Counter(p.id for p in problems)
    dup = [i for i, n in ids.items() if n > 1]
    if dup:
        raise DatasetError(f"split needs unique problem ids; repeated: {dup[0]!r}")

    def key(p: Problem) -> tuple[str, str]:
        return hashlib.sha256(f"{seed}:{p.id}".encode()).hexdigest(), p.id

    ordered = sorted(problems, key=key)
    return ordered[val_size:], ordered[:val_size]
