r"""The math grader: extraction, equivalence, the math-verify worker and its time bound,
and conformance on real data (every MATH-500 / GSM8K gold answer grades correct against itself,
and a value-changing perturbation of it grades wrong)."""

from __future__ import annotations

import json
import pickle
import re
import threading
from functools import partial
from pathlib import Path

import pytest

from marlow.rewards import FORMAT_PENALTY, _verify_pool, grade_math, grade_math_batch, last_boxed
from marlow.rewards import math as rmath
from tests.conftest import DATA

P = FORMAT_PENALTY
MATH500 = DATA / "math500_test.jsonl"
GSM8K = DATA / "gsm8k_test.jsonl"

# (completion, gold, expected grade)
EQUAL = [
    # integers: the fast path
    (r"\boxed{42}", "42", 1.0),
    (r"The answer is \boxed{ 42 }.", "42", 1.0),
    (r"\boxed{+42}", "42", 1.0),
    (r"\boxed{042}", "42", 1.0),
    (r"\boxed{-0}", "0", 1.0),
    (r"\boxed{-17}", " -17 ", 1.0),
    # extraction forms
    (r"\boxed 42", "42", 1.0),
    (r"so $\boxed 7$", "7", 1.0),
    (r"\boxed 7.", "7", 1.0),
    (r"\boxed \pi", r"\pi", 1.0),
    (r"\fbox{12}", "12", 1.0),
    (r"\boxed{\boxed{12}}", "12", 1.0),
    (r"first \boxed{3} then \boxed{12}", "12", 1.0),
    (r"\boxed {12}", "12", 1.0),
    (r"\boxed{3} and then \boxed{4", "3", 1.0),
    (r"\boxed{5}}}}", "5", 1.0),
    (r"{{{\boxed{5}", "5", 1.0),
    (r"\boxed{1}" "\n" r"\boxed{2}", "2", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    # fractions and decimals
    (r"\boxed{\frac{1}{2}}", r"\frac12", 1.0),
    (r"\boxed{\dfrac{1}{2}}", "1/2", 1.0),
    (r"\boxed{\tfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{.5}", "0.50", 1.0),
    (r"\boxed{2/4}", r"\frac12", 1.0),
    (r"\boxed{-\frac{3}{2}}", "-1.5", 1.0),
    (r"\boxed{\frac{-3}{2}}", r"-\frac32", 1.0),
    (r"\boxed{\frac{10}{4}}", r"\frac52", 1.0),
    (r"\boxed{ \frac 5 9 }", r"\frac{5}{9}", 1.0),
    (r"\boxed{\frac9{19}}", r"\frac{9}{19}", 1.0),
    (r"\boxed{\displaystyle \frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{5.0}", "5", 1.0),
    (r"\boxed{5.}", "5", 1.0),
    (r"\boxed{0.333333}", r"\frac13", 1.0),
    (r"\boxed{\frac{3}{2}}", r"1\frac{1}{2}", 1.0),
    # thousands separators
    (r"\boxed{10{,}000}", "10000", 1.0),
    (r"\boxed{10,000}", "10000", 1.0),
    (r"\boxed{1450000}", "1,450,000", 1.0),
    (r"\boxed{10,\!080}", "10080", 1.0),
    (r"\boxed{10\,000}", "10000", 1.0),
    (r"\boxed{11,\! 111,\! 111,\! 100}", "11111111100", 1.0),
    (r"\boxed{1{,}000{,}000}", "10^6", 1.0),
    # wrappers, units, degrees, percent
    (r"\boxed{\$18}", "18", 1.0),
    (r"\boxed{\$18.90}", "18.9", 1.0),
    (r"\boxed{\$32,\!348}", "32348", 1.0),
    (r"\boxed{18 \text{ dollars}}", "18", 1.0),
    (r"\boxed{18 dollars}", "18", 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{5 \text{m}}", "5", 1.0),
    (r"\boxed{864 \mbox{ inches}^2}", "864", 1.0),
    (r"\boxed{15\mbox{ cm}^2}", "15", 1.0),
    (r"\boxed{5.4 \text{ cents}}", "5.4", 1.0),
    (r"\boxed{\text{5}}", "5", 1.0),
    (r"$\boxed{$5$}$", "5", 1.0),
    (r"\boxed{30^\circ}", "30", 1.0),
    (r"\boxed{30^{\circ}}", "30", 1.0),
    (r"\boxed{30°}", r"30^\circ", 1.0),
    (r"\boxed{\frac{270}{7}\text{ degrees}}", r"\frac{270}7\text{ degrees}", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{50\%}", "0.5", 1.0),
    (r"\boxed{25}", r"25\%", 1.0),
    (r"\boxed{20\%}", r"\frac{1}{5}", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{5}", "x=5", 1.0),
    (r"\boxed{3+4\mathrm{i}}", "3+4i", 1.0),
    # symbolic forms (math-verify path)
    (r"\boxed{\sqrt{2}}", r"\sqrt2", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{3}}", r"\frac{1}{\sqrt{3}}", 1.0),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt2}{2}", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\sqrt[3]{8}}", "2", 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{2\pi}", r"2 \pi", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0),
    (r"\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    (r"\boxed{-5i + 6}", "6 - 5i", 1.0),
    (r"\boxed{2x+3}", "y = 2x + 3", 1.0),
    (r"\boxed{x \in [-2,7]}", "[-2,7]", 1.0),
    # tuples, intervals, sets, matrices
    (r"\boxed{(1,2)}", "(1, 2)", 1.0),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", 1.0),
    (r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"\boxed{[0, \frac12)}", "[0,0.5)", 1.0),
    (r"\boxed{(-\infty, 2) \cup (3, \infty)}", r"(-\infty,2)\cup(3,\infty)", 1.0),
    (r"\boxed{1,-2}", "-2, 1", 1.0),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1.0),
    # words and choices
    (r"\boxed{\text{(C)}}", "C", 1.0),
    (r"\boxed{(C)}", r"\text{(C)}", 1.0),
    (r"\boxed{\text{even}}", "Even", 1.0),
    (r"\boxed{Evelyn}", r"\text{Evelyn}", 1.0),
    (r"\boxed{\textbf{ellipse}}", r"\text{ellipse}", 1.0),
]

UNEQUAL = [
    (r"\boxed{41}", "42", 0.0),
    (r"\boxed{-42}", "42", 0.0),
    (r"\boxed{420}", "42", 0.0),
    (r"\boxed{3}", "3.5", 0.0),
    (r"\boxed{0.5}", r"\frac{1}{3}", 0.0),
    (r"\boxed{1/2}", "2/1", 0.0),
    (r"\boxed{-\frac{3}{2}}", r"\frac32", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{10,001}", "10000", 0.0),
    (r"\boxed{1,000}", "1", 0.0),
    (r"\boxed{5\text{ cm}}", "6", 0.0),
    (r"\boxed{30^\circ}", "60", 0.0),
    (r"\boxed{50\%}", "0.05", 0.0),
    (r"\boxed{x=6}", "5", 0.0),
    (r"\boxed{2 \pi}", "2", 0.0),
    (r"\boxed{\sqrt{2}}", r"\sqrt{3}", 0.0),
    (r"\boxed{2\pi}", r"\pi", 0.0),
    (r"\boxed{6.28}", r"2\pi", 0.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    (r"\boxed{x^2+1}", "(x+1)^2", 0.0),
    (r"\boxed{6+5i}", "6-5i", 0.0),
    (r"\boxed{x}", "y", 0.0),
    (r"\boxed{\frac{1}{0}}", "1", 0.0),
    (r"\boxed{(1,2)}", "(2,1)", 0.0),
    (r"\boxed{(1,2)}", "(1,2,3)", 0.0),
    (r"\boxed{[0,1)}", "[0,1]", 0.0),
    (r"\boxed{(2,\infty)}", r"[2,\infty)", 0.0),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}", 0.0),
    (r"\boxed{\text{(C)}}", "D", 0.0),
    (r"\boxed{\text{odd}}", "even", 0.0),
    (r"\boxed{Evelyn}", "Navin", 0.0),
    (r"\boxed{nylevE}", r"\text{Evelyn}", 0.0),  # math-verify alone reads both as products
    (r"\boxed{???}", "5", 0.0),  # a box, not understood: wrong, not a format error
    (r"\boxed{\text{}}", "5", 0.0),
    (r"\boxed \frac12", r"\frac12", 0.0),  # one token only: `\frac`
    (r"\boxed{5}", "", 0.0),
    (r"\boxed{1}" "\n" r"\boxed{2}", "1", 0.0),
]

MALFORMED = [
    ("", "5", P),
    ("no box here, the answer is 5", "5", P),
    (r"\boxed{}", "5", P),
    (r"\boxed{   }", "5", P),
    (r"\boxed{5", "5", P),
    (r"\boxed{\frac{1}{2}", r"\frac12", P),
    (r"\boxed5", "5", P),
    (r"\boxedx{5}", "5", P),
    (r"the answer is \boxed", "5", P),
    (r"\boxed" + "{" * 1000, "5", P),
    ("5", "5", P),
]

CASES = EQUAL + UNEQUAL + MALFORMED


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 100
    assert {e for _, _, e in CASES} == {1.0, 0.0, P}


@pytest.mark.parametrize(("completion", "gold", "expected"), CASES)
def test_grade_table(completion: str, gold: str, expected: float) -> None:
    assert grade_math(completion, gold) == expected


def test_batch_matches_single() -> None:
    comps, golds, expected = zip(*CASES, strict=True)
    assert grade_math_batch(list(comps), list(golds)) == list(expected)
    assert grade_math_batch([], []) == []
    with pytest.raises(ValueError):
        grade_math_batch(["a"], [])


def test_format_penalty_is_configurable_and_only_for_missing_boxes() -> None:
    assert grade_math("nothing", "5", -0.5) == -0.5
    assert grade_math("nothing", "5", format_penalty=0.0) == 0.0
    assert grade_math_batch(["nothing", r"\boxed{4}"], ["5", "5"], -0.25) == [-0.25, 0.0]
    assert grade_math(r"\boxed{4}", "5", -0.5) == 0.0


def test_odd_input_types_do_not_raise() -> None:
    assert grade_math(None, "5") == P  # type: ignore[arg-type]
    assert grade_math(r"\boxed{42}", 42) == 1.0  # type: ignore[arg-type]
    assert grade_math(r"\boxed{42}", 43) == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "box"),
    [
        (r"\boxed{5}", "5"),
        (r"a \boxed{1} b \boxed{2} c", "2"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{\boxed{7}}", "7"),
        (r"\fbox{x+1}", "x+1"),
        (r"\boxed{1} \fbox{2}", "2"),
        (r"\fbox{1} \boxed{2}", "2"),
        (r"\boxed{3} \boxed{4", "3"),
        (r"\boxed 5", "5"),
        (r"\boxed   -12, done", "-12"),
        (r"$\boxed \pi$", r"\pi"),
        (r"\boxed{A} then \boxed B.", "B"),
        (r"\boxed{ }", " "),
        (r"\boxed{}", ""),
        ("nothing", None),
        (r"\boxed5", None),
        (r"\boxedx", None),
        (r"\boxed{5", None),
    ],
)
def test_last_boxed(text: str, box: str | None) -> None:
    assert last_boxed(text) == box


def test_last_boxed_is_linear_on_unclosed_boxes() -> None:
    """100,000 unclosed boxes: quadratic scanning would take minutes."""
    assert last_boxed(r"\boxed{" * 100_000) is None
    assert last_boxed(r"\boxed{1}" + r"\boxed{" * 100_000) == "1"


# ----------------------------------------------------------------------------- time bound

ADVERSARIAL = [
    (r"\boxed{9^{9^{9^{9}}}}", "5"),
    (r"\boxed{10^{10^{10^{10}}}}", "7"),
    (r"\boxed{2^{2^{2^{2^{2^{2}}}}}}", "2"),
    (r"\boxed{(10^{10^{10}})!}", "3"),
    (r"\boxed{5}", "9^{9^{9^{9}}}"),
    (r"\boxed{" + "1+" * 3000 + "1}", "2"),
    (r"\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}", "2"),
    (r"\boxed{0." + "3" * 5000 + "}", r"\frac13"),
]


@pytest.mark.parametrize(("completion", "gold"), ADVERSARIAL)
def test_adversarial_inputs_return_wrong(completion: str, gold: str) -> None:
    assert grade_math(completion, gold, timeout_s=0.5) == 0.0


def test_adversarial_default_bound() -> None:
    """The default bound (no timeout_s) also returns, with 0.0."""
    assert grade_math(r"\boxed{9^{9^{9^{9}}}}", "5") == 0.0


def test_huge_integers_take_the_fast_path() -> None:
    big = "9" * 100_000  # int() would refuse it (max str digits); we compare digit strings
    assert grade_math(rf"\boxed{{{big}}}", big) == 1.0
    assert grade_math(rf"\boxed{{{big}}}", big[:-1] + "8") == 0.0
    assert grade_math(rf"\boxed{{-{big}}}", big) == 0.0


def test_timeout_in_batch_does_not_spoil_neighbours() -> None:
    comps = [r"\boxed{\sqrt{8}}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\frac{\pi}{2}}", r"\boxed{1}"]
    golds = [r"2\sqrt2", "5", r"\pi/2", "1"]
    assert grade_math_batch(comps, golds, timeout_s=0.5) == [1.0, 0.0, 1.0, 1.0]


def test_hung_worker_is_killed_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the worker's soft timer pushed past the hard deadline, only the kill can stop a
    runaway computation; the answer is 0.0 and the next answer gets a fresh worker."""
    assert grade_math(r"\boxed{\sqrt{4}}", "2") == 1.0  # a worker is up
    before = _verify_pool.stats()
    monkeypatch.setattr(_verify_pool, "SOFT_FRACTION", 50.0)
    assert grade_math(r"\boxed{9^{9^{9^{9}}}}", "5", timeout_s=0.5) == 0.0
    after = _verify_pool.stats()
    assert after["killed"] == before["killed"] + 1
    monkeypatch.setattr(_verify_pool, "SOFT_FRACTION", 0.8)
    assert grade_math(r"\boxed{\sqrt{9}}", "3") == 1.0
    assert _verify_pool.stats()["started"] == after["started"] + 1


def test_works_off_the_main_thread() -> None:
    """math-verify's own signal timeouts fail outside the main thread; ours must not."""
    out: list[float] = []
    t = threading.Thread(
        target=lambda: out.extend(
            [grade_math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}"), grade_math(r"\boxed{\pi}", "3")]
        )
    )
    t.start()
    t.join(timeout=60)
    assert out == [1.0, 0.0]


def test_worker_restarts_after_shutdown() -> None:
    _verify_pool.shutdown()
    assert grade_math(r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt2}") == 1.0


def test_pickles() -> None:
    for fn in (grade_math, grade_math_batch, partial(grade_math, format_penalty=-1.0)):
        clone = pickle.loads(pickle.dumps(fn))
        assert clone is fn or clone.func is grade_math  # type: ignore[union-attr]
    clone = pickle.loads(pickle.dumps(partial(grade_math, format_penalty=-1.0)))
    assert clone("nothing", "1") == -1.0


# ----------------------------------------------------------------------------- real data


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def perturb(answer: str) -> str:
    """A value-changing edit: append a 7 to the first digit run (5 -> 57, 0.15 -> 07.15,
    \\frac{1}{2} -> \\frac{17}{2}, 52_8 -> 527_8); without digits, add a letter to the first
    \\text{} word, or else put a factor 2 in front (\\pi -> 2\\pi, p - q -> 2p - q)."""
    m = re.search(r"\d+", answer)
    if m:
        return answer[: m.end()] + "7" + answer[m.end() :]
    m = re.search(r"\\text\{[^{}]*\}", answer)
    if m:
        return answer[: m.end() - 1] + "q" + answer[m.end() - 1 :]
    return "2" + answer


TEMPLATES = [
    "So the final answer is $\\boxed{%s}$.",
    "\\[\n\\boxed{%s}\n\\]",
    "Answer: \\boxed{ %s }",
    "We get \\fbox{%s}",
]


def test_perturb_changes_value() -> None:
    assert perturb("5") == "57"
    assert perturb(r"\frac{1}{2}") == r"\frac{17}{2}"
    assert perturb(r"\text{Evelyn}") == r"\text{Evelynq}"
    assert perturb(r"\pi") == r"2\pi"


def test_math500_answers_grade_correct_against_themselves() -> None:
    golds = [r["answer"] for r in _rows(MATH500)]
    assert len(golds) == 500
    for template in TEMPLATES:
        scores = grade_math_batch([template % a for a in golds], golds)
        bad = [(a, s) for a, s in zip(golds, scores, strict=True) if s != 1.0]
        assert not bad, (template, bad)
    # Rewritten but equal: \dfrac for \frac, every space removed.
    variants = [a.replace("\\frac", "\\dfrac").replace(" ", "") for a in golds]
    scores = grade_math_batch([f"\\boxed{{{v}}}" for v in variants], golds)
    assert [a for a, s in zip(golds, scores, strict=True) if s != 1.0] == []


def test_math500_answers_pass_math_verify_against_themselves() -> None:
    """The normaliser decides self-grades by string equality; check the math-verify path on its
    own agrees for every non-integer answer (so it never rejects a right answer it is given)."""
    golds = [r["answer"] for r in _rows(MATH500) if not re.fullmatch(r"-?\d+", r["answer"])]
    results = _verify_pool.verify_pairs([(a, a) for a in golds], rmath.DEFAULT_TIMEOUT_S)
    assert [a for a, r in zip(golds, results, strict=True) if r != "true"] == []


def test_math500_perturbed_answers_grade_wrong() -> None:
    golds = [r["answer"] for r in _rows(MATH500)]
    perturbed = [perturb(a) for a in golds]
    assert all(p != a for p, a in zip(perturbed, golds, strict=True))
    scores = grade_math_batch([f"\\boxed{{{p}}}" for p in perturbed], golds)
    agree = [(a, p) for a, p, s in zip(golds, perturbed, scores, strict=True) if s != 0.0]
    assert agree == []


def _gsm8k_golds() -> list[str]:
    return [r["answer"].split("####")[-1].strip() for r in _rows(GSM8K)]


def test_gsm8k_golds_grade_correct_against_themselves() -> None:
    golds = _gsm8k_golds()
    assert len(golds) == 1319
    forms = [*TEMPLATES, "The total is \\boxed{\\$%s}.", "\\boxed{%s \\text{ dollars}}"]
    for template in forms:
        scores = grade_math_batch([template % g for g in golds], golds)
        assert [g for g, s in zip(golds, scores, strict=True) if s != 1.0] == [], template
    plain = [g.replace(",", "") for g in golds]  # 1,450,000 -> 1450000
    scores = grade_math_batch([f"\\boxed{{{p}}}" for p in plain], golds)
    assert [g for g, s in zip(golds, scores, strict=True) if s != 1.0] == []


def test_gsm8k_perturbed_golds_grade_wrong() -> None:
    golds = _gsm8k_golds()
    negated = [g[1:] if g.startswith("-") else f"-{g}" for g in golds]
    negated = [n if n.strip("-0,") else "1" for n in negated]  # -0 is 0: use 1 instead
    for perturbed in ([perturb(g) for g in golds], negated):
        scores = grade_math_batch([f"\\boxed{{{p}}}" for p in perturbed], golds)
        assert [g for g, s in zip(golds, scores, strict=True) if s != 0.0] == []


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


PARENT = r"""
import sys
from marlow.rewards import _verify_pool, grade_math
assert grade_math(r"\boxed{\sqrt{4}}", "2") == 1.0
print(_verify_pool._worker.proc.pid, flush=True)
_verify_pool.SOFT_FRACTION = 50.0  # the worker's own timer will not save it
grade_math(r"\boxed{9^{9^{9^{9}}}}", "5", timeout_s=3.0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_worker_dies_when_parent_is_killed_mid_answer() -> None:
    """The parent is SIGKILLed while the worker is stuck in a runaway computation: the worker's
    CPU backstop (hard deadline + 10 s) must end it; it must not compute forever."""
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(1.0)
        assert _alive(worker_pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(worker_pid)
