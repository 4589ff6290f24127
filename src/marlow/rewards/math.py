r"""Math outcome reward: the last boxed answer, graded against the gold answer.

``grade_math(completion, gold)`` -> 1.0 correct, 0.0 parsed but wrong, ``format_penalty``
(default -0.1) when the completion has no parseable box. ``grade_math_batch`` grades many pairs
with one trip to the math-verify worker. Both are module-level functions, so they pickle.

Grading runs in three tiers, cheapest first; the first tier that can decide, decides:

1. **Integer fast path.** Both the box and the gold are plain integers (``[+-]?\d+``): compare
   them (as digit strings, so a 10,000-digit answer is not slower). No sympy, no subprocess.
2. **Normaliser** (pure string/``Fraction`` work, microseconds, cannot hang). Both sides are
   cleaned (below) and compared; it decides when the cleaned strings are equal, when both are
   exact numbers, when both are tuples/intervals of numbers with the same brackets, when both
   are plain words or multiple-choice letters. Anything else is undecided.
3. **math-verify** (``math_verify.parse`` + ``verify``, symbolic/numeric equivalence through
   sympy) for whatever the normaliser leaves undecided, run in a separate worker process (see
   ``_verify_pool``) because its signal-based timeouts only work in a main thread, and because a
   sympy computation stuck in C code can only be stopped by killing its process.

Choices the spec leaves open, made here:

* **Extraction.** The answer is the content of the last ``\boxed{...}`` or ``\fbox{...}`` with
  balanced braces (``\{``/``\}`` count as braces too, they are balanced in valid LaTeX); "last"
  means the head that starts last, so ``\boxed{\boxed{5}}`` gives ``5``; a box that never closes
  is skipped in favour of an earlier one. Whitespace between the head and ``{`` is allowed. The
  unbraced form ``\boxed 5`` (head, at least one space, one token) is read too: the token is a
  single control word (``\boxed \pi``) or a run of characters up to whitespace, ``$``, ``{``,
  ``}`` or ``\``, with trailing ``.``, ``,``, ``;``, ``:`` dropped (sentence punctuation).
  ``\boxed5`` without a space is not read.
* **Unparseable = format penalty** when there is no box at all, or the box is empty/blank, or the
  completion is not a string. A box whose content cannot be understood (``\boxed{???}``) is a
  parsed answer, so it grades 0.0, not the penalty.
* **Cleaning** (applied to the box and the gold alike): ``$`` delimiters and ``\$`` dollar signs
  dropped; ``\left``/``\right``, ``\displaystyle``, spacing commands (``\!``, ``\,``, ``\;``,
  ``\:``, ``\ ``, ``~``, ``\quad``) dropped; all whitespace is insignificant (so ``1 2`` reads
  as ``12``); ``\dfrac``/``\tfrac`` read as ``\frac``, ``\frac12`` as ``\frac{1}{2}``,
  ``\sqrt2`` as ``\sqrt{2}``; trailing sentence ``.`` dropped; a leading ``x =`` is dropped when
  what follows is a number.
* **Thousands separators**: ``10,000``, ``10{,}000``, ``10,\!000`` and ``10\,000`` are ten
  thousand, when the whole answer is a number with groups of exactly three digits. So
  ``1,000`` is never read as the pair (1, 0); ``1,2`` stays a list.
* **Units**: a trailing ``\text{...}``/``\mbox{...}``/``\mathrm{...}`` made of letters (with an
  optional power, ``\mbox{ inches}^2``) after something containing a digit is dropped (but a
  one-letter group glued to the number, ``4\mathrm{i}``, is kept), and so are plain trailing
  words of 2+ letters after a plain number (``18 dollars``; not ``2 pi``). Units are never
  converted: ``1 m`` equals ``1``, and equals ``1 cm`` too.
* **Degrees**: ``^\circ``, ``^{\circ}``, ``°`` and ``\degree`` are dropped, so ``30^\circ``
  equals ``30``. Radians are not converted (``\frac{\pi}{6}`` is not ``30^\circ``).
* **Percent**: a trailing ``\%``/``%`` is dropped; a percent answer equals both its number and
  its number / 100 (``50\%`` equals ``50`` and ``0.5``).
* **Numbers** are compared exactly as fractions (``0.5`` = ``1/2`` = ``\frac{1}{2}`` =
  ``\frac{2}{4}``). Exception: a terminating decimal against a fraction whose decimal does not
  terminate (``0.333`` vs ``\frac13``) is left to math-verify, which accepts agreement to 6
  decimal places. Number strings over 400 characters are never converted (compared as text).
* **Words and letters**: two plain words (after ``\text{}`` unwrapping, at least one of 3+
  letters) are compared as words, case-insensitively (``\text{Even}`` = ``even``; math-verify
  would read ``Evelyn`` as the product E*v*e*l*y*n and accept any anagram). Shorter letter
  strings (``ab``) may be products of variables and go to math-verify. ``(C)``, ``\text{(C)}``
  and ``C`` are the same multiple-choice letter.
* **math-verify usage**: both sides are passed as ``\boxed{<raw content>}`` to ``parse`` with its
  default extraction config; ``verify(gold, pred)`` with its defaults (``float_rounding=6``,
  ``strict=True``). Its own signal timeouts are disabled; ours replace them. Parsed strings
  (golds and answers) are cached in the worker, up to 2,048 of them. Answers (or golds) longer than ``MAX_VERIFY_CHARS`` (2,000) characters are
  not sent to math-verify: they are decided by the normaliser alone (equal or 0.0).
* **Time bound**: ``DEFAULT_TIMEOUT_S`` = 2.0 s of wall clock per answer on the math-verify path
  (configurable per call with ``timeout_s=``). Inside the worker a soft timer (80 % of it)
  interrupts Python-level work cleanly; at 100 % the parent kills the worker (SIGKILL) and a fresh
  one is started on the next request. **A timeout grades 0.0**, never the format penalty, never
  an exception. The one-time worker start (interpreter + sympy import, ~1 s) is bounded
  separately (60 s) and not charged to the answer; if the worker cannot start, math-verify-path
  answers grade 0.0 and the start is retried after 30 s. Concurrent callers share the one worker
  in turn (a lock), so a thread may wait for other threads' answers before its own bound starts.
* **Worker lifetime**: one worker process per grading process (never a pool: one core is
  enough and the machine is shared), started lazily, killed at exit; it exits by itself when its
  stdin closes (parent gone), and if the parent dies while the worker is stuck in C code, a
  per-request CPU-time limit (hard deadline + 10 s) makes the kernel end it. A forked child
  starts its own worker instead of sharing the parent's pipes.
* **API**: ``grade_math`` keeps its positional signature; ``timeout_s`` is a new keyword-only
  argument. ``normalize_answer`` (the canonical string, used as a voting key) and ``last_boxed``
  stay public.
* **Robustness**: ``grade_math`` never raises for any input (a non-string completion is a
  format error, a non-string gold is converted with ``str()``, an internal error grades 0.0);
  ``grade_math_batch`` raises ValueError only when the two sequences differ in length.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from marlow.parsers.box import balanced, last_boxed
from marlow.rewards import _verify_pool

FORMAT_PENALTY = -0.1
DEFAULT_TIMEOUT_S = 2.0
MAX_VERIFY_CHARS = 2000
_MAX_NUMBER_CHARS = 400  # longer "numbers" are compared as strings, never converted

# ----------------------------------------------------------------------------- extraction
# the box rule (last_boxed) is marlow.parsers.box's: the role parsers read boxes too

# ----------------------------------------------------------------------------- normaliser

_TEXT_CMD = r"\\(?:text|textrm|textbf|textit|textnormal|mathrm|mathbf|mathit|mbox)"
_TEXT_GROUP = re.compile(_TEXT_CMD + r"\s*\{([^{}]*)\}")
_UNIT_CMD = r"\\(?:text|textrm|textnormal|mathrm|mbox)"
_TRAILING_UNIT = re.compile(
    r"(?P<gap>\s*)" + _UNIT_CMD + r"\s*\{(?P<unit>\s*[A-Za-z][A-Za-z .]*)\}"
    r"(?:\s*\^\s*(?:\d|\{\s*\d\s*\}))?\s*$"
)
_PLAIN_NUMBER = r"[+-]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:/\d+)?"
_TRAILING_WORDS = re.compile(rf"^(?P<head>{_PLAIN_NUMBER})\s+(?P<words>[A-Za-z ]+?)(?:\^\d)?$")
_NOT_UNITS = {"pi", "i", "e"}
_SPACING = re.compile(r"\\\\|\\[ ,;:!]|\\q?quad(?![A-Za-z])|~")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|displaystyle|big|Big|bigl|bigr|Bigl|Bigr)(?![A-Za-z])")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ(?![A-Za-z])|°|\\degree(?![A-Za-z])")
_INT = re.compile(r"[+-]?\d+")
_DEC = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_ASSIGN = re.compile(r"^[A-Za-z]=(.+)$")
_CHOICE = re.compile(r"^\(([A-Za-z])\)$")
_WORD = re.compile(r"[A-Za-z]+")
_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_SLASH = re.compile(rf"\(?({_NUM})\)?/\(?({_NUM})\)?")
_FRAC = re.compile(rf"([+-]?)\\frac\{{({_NUM})\}}\{{({_NUM})\}}")


class _Clean:
    """A cleaned answer: canonical string, and its exact value when it is a plain number."""

    __slots__ = ("s", "value", "decimal", "percent")

    def __init__(self, s: str, value: Fraction | None, decimal: bool, percent: bool) -> None:
        self.s, self.value, self.decimal, self.percent = s, value, decimal, percent


def _braced_args(s: str, cmd: str, n_args: int) -> str:
    """Rewrite ``\\cmd`` arguments given as single characters (``\\frac12``) to braces."""
    out: list[str] = []
    i = 0
    while True:
        at = s.find(cmd, i)
        if at == -1 or (at + len(cmd) < len(s) and s[at + len(cmd)].isalpha()):
            if at == -1:
                out.append(s[i:])
                return "".join(out)
            out.append(s[i : at + len(cmd)])
            i = at + len(cmd)
            continue
        out.append(s[i : at + len(cmd)])
        j = at + len(cmd)
        for _ in range(n_args):
            if j >= len(s):
                break
            if s[j] == "{":
                inner = balanced(s, j)
                if inner is None:
                    break
                out.append("{" + inner + "}")
                j += len(inner) + 2
            elif s[j] == "[" and cmd == "\\sqrt":  # \sqrt[3]{x}: keep the index, then the arg
                close = s.find("]", j)
                if close == -1:
                    break
                out.append(s[j : close + 1])
                j = close + 1
                continue
            elif s[j] == "\\":
                m = re.match(r"\\[A-Za-z]+", s[j:])
                tok = m.group() if m else s[j : j + 2]
                out.append("{" + tok + "}")
                j += len(tok)
            else:
                out.append("{" + s[j] + "}")
                j += 1
        i = j


def _clean(text: str) -> _Clean:
    s = text.strip()
    s = s.replace("\\$", "").replace("$", "")
    s = _SPACING.sub(lambda m: m.group() if m.group() == "\\\\" else " ", s)
    s = _LEFT_RIGHT.sub("", s)
    s = s.replace("{,}", ",")
    s = _DEGREES.sub("", s)
    s = s.strip().rstrip(".").strip()
    percent = False
    for pct in ("\\%", "%"):
        if s.endswith(pct):
            s, percent = s[: -len(pct)].strip(), True
            break
    s = _drop_text_unit(s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):  # nested \text{\textbf{x}}
        s = _TEXT_GROUP.sub(r"\1", s)
    s = s.strip()
    m = _TRAILING_WORDS.match(s)
    if m and all(len(w) >= 2 and w.lower() not in _NOT_UNITS for w in m.group("words").split()):
        s = m.group("head")
    s = re.sub(r"\s+", "", s)
    s = _braced_args(s, "\\frac", 2)
    s = _braced_args(s, "\\sqrt", 1)
    s = s.rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    m = _ASSIGN.match(s)
    if m and _number(m.group(1))[0] is not None:
        s = m.group(1)
    m = _CHOICE.match(s)
    if m:
        s = m.group(1)
    value, decimal = _number(s)
    return _Clean(s, value, decimal, percent)


def _drop_text_unit(s: str) -> str:
    """``5.4 \\text{ cents}`` -> ``5.4``: a trailing text group of letters after something with
    a digit. A one-letter group glued to the number (``4\\mathrm{i}``) is not a unit."""
    m = _TRAILING_UNIT.search(s)
    if m is None:
        return s
    head = s[: m.start()].strip()
    unit = m.group("unit")
    glued = not m.group("gap") and not unit[0].isspace()
    if not any(ch.isdigit() for ch in head) or (glued and len(unit.strip()) < 2):
        return s
    return head


def _number(s: str) -> tuple[Fraction | None, bool]:
    """Exact value of an integer, decimal, ``a/b`` or ``\\frac{a}{b}``; and whether it was
    written with a decimal point. (None, False) for anything else."""
    if len(s) > _MAX_NUMBER_CHARS:
        return None, False
    try:
        if _INT.fullmatch(s):
            return Fraction(int(s)), False
        if _DEC.fullmatch(s):
            return Fraction(s), True
        m = _SLASH.fullmatch(s)
        sign = ""
        if not m:
            m2 = _FRAC.fullmatch(s)
            if not m2:
                return None, False
            sign, num, den = m2.groups()
        else:
            num, den = m.groups()
        den_v = Fraction(den)
        if den_v == 0:
            return None, False
        value = Fraction(num) / den_v
        return (-value if sign == "-" else value), ("." in num or "." in den)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None, False


def normalize_answer(text: str) -> str:
    """A canonical string for an answer (used as a voting key): wrappers, spacing, units and
    number formatting removed; plain numbers as their exact value (``0.5`` -> ``1/2``)."""
    c = _clean(text)
    return str(c.value) if c.value is not None else c.s


def _terminates(x: Fraction) -> bool:
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _numbers_decide(a: _Clean, b: _Clean) -> float | None:
    assert a.value is not None and b.value is not None
    if a.value == b.value:
        return 1.0
    if a.percent != b.percent:
        pct, other = (a, b) if a.percent else (b, a)
        if pct.value / 100 == other.value:
            return 1.0
    for x, y in ((a, b), (b, a)):  # 0.333 vs 1/3: let math-verify's rounding decide
        if x.decimal and not y.decimal and not _terminates(y.value):
            return None
    return 0.0


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside any bracket."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _tuple_numbers(s: str) -> tuple[str, list[_Clean]] | None:
    """``(1,2)``, ``[0,\\frac12)`` ... as (brackets, cleaned numbers); None if not all numbers."""
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]":
        return None
    items = _split_top(s[1:-1])
    if len(items) < 2:
        return None
    cleaned = [_clean(x) for x in items]
    if any(c.value is None for c in cleaned):
        return None
    return s[0] + s[-1], cleaned


def _decide(pred: _Clean, gold: _Clean) -> float | None:
    """1.0 / 0.0 when the normaliser can tell, None when math-verify must."""
    if not gold.s:
        return 0.0
    if pred.s == gold.s and pred.percent == gold.percent:
        return 1.0
    if pred.value is not None and gold.value is not None:
        return _numbers_decide(pred, gold)
    if pred.s == gold.s:  # same number, only one side marked %: equal by the percent rule
        return 1.0
    # Two plain words (one of 3+ letters; "ab" may be a product of variables): text answers.
    words = _WORD.fullmatch(pred.s) and _WORD.fullmatch(gold.s)
    if words and max(len(pred.s), len(gold.s)) >= 3:
        return 1.0 if pred.s.lower() == gold.s.lower() else 0.0
    pt, gt = _tuple_numbers(pred.s), _tuple_numbers(gold.s)
    if pt is not None and gt is not None and pt[0] == gt[0]:
        if len(pt[1]) != len(gt[1]):
            return 0.0
        verdicts = [_numbers_decide(x, y) for x, y in zip(pt[1], gt[1], strict=True)]
        if all(v == 1.0 for v in verdicts):
            return 1.0
        if any(v == 0.0 for v in verdicts):
            return 0.0
    if len(pred.s) > MAX_VERIFY_CHARS or len(gold.s) > MAX_VERIFY_CHARS:
        return 0.0
    return None


# ----------------------------------------------------------------------------- grading


def _int_equal(a: str, b: str) -> bool:
    """Equality of two ``[+-]?\\d+`` strings without converting them (no size limit)."""
    sa, da = (a[0], a[1:]) if a[0] in "+-" else ("+", a)
    sb, db = (b[0], b[1:]) if b[0] in "+-" else ("+", b)
    da, db = da.lstrip("0") or "0", db.lstrip("0") or "0"
    if da == "0" and db == "0":
        return True
    return da == db and (sa == "-") == (sb == "-")


def _first_pass(completion: object, gold: object) -> tuple[float | None, str, str, str]:
    """(score or None, path, pred, gold): path is 'format', 'int', 'normalise' or 'verify'."""
    boxed = last_boxed(completion) if isinstance(completion, str) else None
    if boxed is None or not boxed.strip():
        return None, "format", "", ""
    gold_s = gold if isinstance(gold, str) else str(gold)
    p, g = boxed.strip(), gold_s.strip()
    if _INT.fullmatch(p) and _INT.fullmatch(g):
        return (1.0 if _int_equal(p, g) else 0.0), "int", p, g
    verdict = _decide(_clean(p), _clean(g))
    if verdict is not None:
        return verdict, "normalise", p, g
    if len(p) > MAX_VERIFY_CHARS or len(g) > MAX_VERIFY_CHARS:
        return 0.0, "normalise", p, g
    return None, "verify", p, g


def _grade_paths(
    completions: Sequence[object],
    golds: Sequence[object],
    format_penalty: float,
    timeout_s: float | None,
) -> list[tuple[float, str]]:
    """(score, path) for each pair; the workhorse of both public functions and the bench."""
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
    bound = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    out: list[tuple[float, str]] = []
    todo: list[int] = []
    pairs: list[tuple[str, str]] = []
    for i, (c, g) in enumerate(zip(completions, golds, strict=True)):
        try:
            score, path, p, gs = _first_pass(c, g)
        except Exception:  # noqa: BLE001 - a grader bug must not stop training
            score, path, p, gs = 0.0, "error", "", ""
        if path == "format":
            score = format_penalty
        elif score is None:
            todo.append(i)
            pairs.append((p, gs))
            score = 0.0
        out.append((score, path))
    if pairs:
        results = _verify_pool.verify_pairs(pairs, bound)
        for i, r in zip(todo, results, strict=True):
            out[i] = (1.0 if r == "true" else 0.0, "verify" if r in ("true", "false") else r)
    return out


def grade_math(
    completion: str,
    gold: str,
    format_penalty: float = FORMAT_PENALTY,
    *,
    timeout_s: float | None = None,
) -> float:
    """1.0 if the last boxed answer of ``completion`` equals ``gold``, 0.0 if it differs (or
    math-verify times out), ``format_penalty`` if there is no parseable box. ``timeout_s``:
    wall-clock bound for the math-verify path (default ``DEFAULT_TIMEOUT_S``)."""
    return _grade_paths([completion], [gold], format_penalty, timeout_s)[0][0]


def grade_math_batch(
    completions: Sequence[str],
    golds: Sequence[str],
    format_penalty: float = FORMAT_PENALTY,
    *,
    timeout_s: float | None = None,
) -> list[float]:
    """``grade_math`` for each ``(completion, gold)`` pair, in order. Raises ValueError only if
    the two sequences differ in length."""
    return [score for score, _ in _grade_paths(completions, golds, format_penalty, timeout_s)]
