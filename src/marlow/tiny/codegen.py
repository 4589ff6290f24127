"""Synthetic code problems for the tiny world: statements, reference programs, hidden tests.

A problem is a one-line statement (the ``{problem}`` field of the prompts) in ten FAMILIES. Seven
come in the DeepCoder function-call format (``fn_name``, inputs = argument lists, outputs by
value), three are stdin/stdout programs (inputs and outputs are strings)::

    lin   f(x) = 3x+7                    def f(x):\\n    return 3*x+7
    par   g(x) = 4(x-2)                  def g(x):\\n    return 4*(x-2)
    sq    h(x) = x^2+5                   def h(x):\\n    return x**2+5
    div   f(x) = floor(x/4)+1            def f(x):\\n    return x//4+1
    sum   f(n) = sum 3i, i=1..n          def f(n):\\n    return sum(3*i for i in range(1, n+1))
    two   f(a,b) = ab+3                  def f(a, b):\\n    return a*b+3
    cnt   f(a,b) = count a..b            def f(a, b):\\n    return b-a+1
    io1   read x; print 2x+5             x = int(input())\\nprint(2*x+5)
    io2   read a b; print ab+3           a, b = map(int, input().split())\\nprint(a*b+3)
    ion   read n, then n ints; print max input()\\nprint(max(map(int, input().split())))

Every family but ``lin``, ``two`` and ``io1`` has one SYSTEMATIC slip, the classic bug of its
kind, which the corpus (``marlow.tiny.codecorpus``) writes more often than not:

    par   precedence: 4*x-2            sq   XOR for power: x^2+5     div  true division: x/4+1
    sum   range end off by one: range(1, n)                          cnt  count off by one: b-a
    io2   input parsing: a = int(input()) / b = int(input()) on a one-line input (a crash)
    ion   the count line not skipped: the list is read from the first line

Random slips (TYPOS) change one constant by one, or use the wrong aggregate. Every slip fails at
least one hidden test (checked when the problem is built); a ``div`` slip passes the tests whose
input is a multiple of the divisor, so its reward is partial.

Hidden tests (4 per problem) and the slips are pure functions of the statement text, as is the
split: a statement is in the validation split iff its stable hash says so (one in ten), so
validation and training never share a problem, whatever the seeds. The reference programs are
written here and run in-process (they are ours, not model output) to compute expected outputs.
"""

from __future__ import annotations

import contextlib
import io
import random
from dataclasses import dataclass
from typing import Any

from marlow.tiny.splits import Split, text_hash
from marlow.types import Problem

FAMILY_WEIGHTS: dict[str, float] = {
    "lin": 0.11,
    "par": 0.11,
    "sq": 0.10,
    "div": 0.10,
    "sum": 0.10,
    "two": 0.10,
    "cnt": 0.06,
    "io1": 0.10,
    "io2": 0.11,
    "ion": 0.11,
}
SLIP_KINDS = {
    "par": "precedence",
    "sq": "xor_power",
    "div": "true_division",
    "sum": "range_end",
    "cnt": "count_off_by_one",
    "io2": "input_parsing",
    "ion": "header_line",
}
"""The systematic slip of each family that has one."""
FN_NAMES = ("f", "g", "h", "calc", "solve")
N_TESTS = 4
VAL_BUCKETS = 10
MAX_VAL = 1000  # the validation pool holds about 1,200 statements; distinct draws slow past it
FENCE = "```python\n{code}\n```"


@dataclass(frozen=True)
class Spec:
    """One problem before its tests: statement, reference program and its slips."""

    family: str
    text: str  # the statement
    fn_name: str | None  # None: a stdin/stdout program
    right: str  # the reference program (no fences)
    bug: str | None  # the family's systematic slip, or None
    typos: tuple[str, ...]  # random slips, each a complete wrong program


def fence(code: str) -> str:
    """A completion holding ``code`` as one fenced python block."""
    return FENCE.format(code=code)


def _typos(template: str, k: int | None, c: int | None) -> tuple[str, ...]:
    """``template`` (``{K}``/``{C}`` fields) with one constant off by one, never the right one."""
    out = []
    if k is not None:
        out += [template.format(K=k + d, C=c) for d in (1, -1) if k + d >= 2]
    if c is not None:
        out += [template.format(K=k, C=c + d) for d in (1, -1) if c + d >= 1]
    return tuple(out)


def _fn(name: str, args: str, body: str) -> str:
    return f"def {name}({args}):\n    return {body}"


def _spec_fn(
    family: str, text: str, name: str, args: str, body: str, bug: str | None, k, c
) -> Spec:
    """A function-call spec; ``body``/``bug`` are templates with ``{K}``/``{C}``."""
    right = _fn(name, args, body.format(K=k, C=c))
    wrong = _fn(name, args, bug.format(K=k, C=c)) if bug else None
    typos = tuple(_fn(name, args, b) for b in _typos(body, k, c))
    return Spec(family, text, name, right, wrong, typos)


def _lin(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "lin"
    text = f"{name}(x) = {k}x{op}{c}"
    return _spec_fn(family, text, name, "x", f"{{K}}*x{op}{{C}}", None, k, c)


def _par(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "par"
    c = rng.randint(1, 9)
    text = f"{name}(x) = {k}(x{op}{c})"
    return _spec_fn(family, text, name, "x", f"{{K}}*(x{op}{{C}})", f"{{K}}*x{op}{{C}}", k, c)


def _sq(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "sq"
    text = f"{name}(x) = x^2{op}{c}"
    return _spec_fn(family, text, name, "x", f"x**2{op}{{C}}", f"x^2{op}{{C}}", None, c)


def _div(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "div"
    text = f"{name}(x) = floor(x/{k}){op}{c}"
    return _spec_fn(family, text, name, "x", f"x//{{K}}{op}{{C}}", f"x/{{K}}{op}{{C}}", k, c)


def _sum(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "sum"
    form = rng.choice(("Ki", "i+C", "i"))
    term, tk, tc = {
        "Ki": (f"{k}i", "{K}*i", (k, None)),
        "i+C": (f"i+{c}", "i+{C}", (None, c)),
        "i": ("i", "i", (None, None)),
    }[form]
    text = f"{name}(n) = sum {term}, i=1..n"
    body = f"sum({tk} for i in range(1, n+1))"
    bug = f"sum({tk} for i in range(1, n))"
    spec = _spec_fn(family, text, name, "n", body, bug, *tc)
    if not spec.typos:  # plain i: the range start is the typo
        typo = _fn(name, "n", "sum(i for i in range(2, n+1))")
        spec = Spec(family, text, name, spec.right, spec.bug, (typo,))
    return spec


def _two(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "two"
    form = rng.choice(("Ka+b", "a+Kb", "ab+C", "a-b+C", "Ka-b"))
    shown = form.replace("K", str(k)).replace("C", str(c))
    body = {
        "Ka+b": "{K}*a+b",
        "a+Kb": "a+{K}*b",
        "ab+C": "a*b+{C}",
        "a-b+C": "a-b+{C}",
        "Ka-b": "{K}*a-b",
    }[form]
    kk, cc = (k if "K" in form else None), (c if "C" in form else None)
    return _spec_fn(family, f"{name}(a,b) = {shown}", name, "a, b", body, None, kk, cc)


def _cnt(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "cnt"
    if rng.random() < 0.5:
        text = f"{name}(a,b) = count a..b"
        spec = _spec_fn(family, text, name, "a, b", "b-a+1", "b-a", None, None)
        return Spec(family, text, name, spec.right, spec.bug, (_fn(name, "a, b", "b-a+2"),))
    text = f"{name}(a,b) = {k}*count a..b"
    return _spec_fn(family, text, name, "a, b", "{K}*(b-a+1)", "{K}*(b-a)", k, None)


def _io1(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "io1"
    text = f"read x; print {k}x{op}{c}"
    tpl = "x = int(input())\nprint({K}*x" + op + "{C})"
    return Spec(family, text, None, tpl.format(K=k, C=c), None, _typos(tpl, k, c))


def _io2(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "io2"
    form = rng.choice(("ab+C", "a+b+C", "Ka+b", "a-b+C"))
    shown = form.replace("K", str(k)).replace("C", str(c))
    expr = {"ab+C": "a*b+{C}", "a+b+C": "a+b+{C}", "Ka+b": "{K}*a+b", "a-b+C": "a-b+{C}"}[form]
    kk, cc = (k if "K" in form else None), (c if "C" in form else None)
    head = "a, b = map(int, input().split())\n"
    tpl = head + f"print({expr})"
    bug = f"a = int(input())\nb = int(input())\nprint({expr})"
    right, wrong = tpl.format(K=kk, C=cc), bug.format(K=kk, C=cc)
    return Spec(family, f"read a b; print {shown}", None, right, wrong, _typos(tpl, kk, cc))


def _ion(rng: random.Random, name: str, k: int, c: int, op: str) -> Spec:
    family = "ion"
    agg = rng.choice(("sum", "max", "min"))
    plus = rng.random() < 0.5
    shown = f"{agg}+{c}" if plus else agg
    tail = "+{C}" if plus else ""
    read = f"{{A}}(map(int, input().split())){tail}"
    right = f"input()\nprint({read})"
    bug = f"print({read})"
    typos = [right.format(A=a, C=c) for a in ("sum", "max", "min") if a != agg]
    if plus:
        typos += [right.format(A=agg, C=c + d) for d in (1, -1) if c + d >= 1]
    text = f"read n, then n ints; print {shown}"
    return Spec(family, text, None, right.format(A=agg, C=c), bug.format(A=agg, C=c), tuple(typos))


_FAMILIES = {
    "lin": _lin,
    "par": _par,
    "sq": _sq,
    "div": _div,
    "sum": _sum,
    "two": _two,
    "cnt": _cnt,
    "io1": _io1,
    "io2": _io2,
    "ion": _ion,
}
"""One statement sampler per family: (rng, name, k, c, op) -> Spec."""


def sample_spec(rng: random.Random, family: str | None = None) -> Spec:
    """A statement of ``family`` (or one drawn by :data:`FAMILY_WEIGHTS`)."""
    if family is None:
        family = rng.choices(list(FAMILY_WEIGHTS), weights=list(FAMILY_WEIGHTS.values()))[0]
    if family not in _FAMILIES:
        raise ValueError(f"code family {family!r} is unknown; valid: {', '.join(FAMILY_WEIGHTS)}")
    name = rng.choice(FN_NAMES)
    k, c, op = rng.randint(2, 9), rng.randint(1, 50), rng.choice("+-")
    return _FAMILIES[family](rng, name, k, c, op)


# ---- running OUR programs in-process (expected outputs, slip checks) ---------------------


def run_reference(code: str, fn_name: str | None, test_input: Any) -> Any:
    """Output of a program written by this module (never model output): the return value of
    ``fn_name(*test_input)``, or the stdout of the program on ``test_input``. Raises on a crash."""
    ns: dict[str, Any] = {"__name__": "solution" if fn_name else "__main__"}
    if fn_name is not None:
        exec(compile(code, "reference.py", "exec"), ns)
        return ns[fn_name](*test_input)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ns["input"] = _line_reader(test_input)  # the reference programs only call input()
        exec(compile(code, "reference.py", "exec"), ns)
    return out.getvalue()


def _line_reader(text: str):
    lines = iter(text.splitlines())

    def read() -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError("EOF when reading a line") from None

    return read


def _passes(code: str, spec: Spec, inputs: list, outputs: list) -> list[bool]:
    out = []
    for i, o in zip(inputs, outputs, strict=True):
        try:
            got = run_reference(code, spec.fn_name, i)
        except Exception:
            out.append(False)
            continue
        if spec.fn_name is None:
            out.append(got.split() == o.split())
        else:
            out.append(got == o and type(got) is type(o))
    return out


def _inputs(spec: Spec, rng: random.Random) -> list:
    f = spec.family
    if f in ("lin", "par", "sq"):
        return [[x] for x in rng.sample(range(0, 21), N_TESTS)]
    if f == "div":
        return [[x] for x in rng.sample(range(1, 60), N_TESTS)]
    if f == "sum":
        return [[n] for n in rng.sample(range(1, 13), N_TESTS)]
    if f == "two":
        return [[rng.randint(0, 20), rng.randint(0, 20)] for _ in range(N_TESTS)]
    if f == "cnt":
        pairs = []
        for _ in range(N_TESTS):
            a = rng.randint(0, 20)
            pairs.append([a, a + rng.randint(0, 15)])
        return pairs
    if f == "io1":
        return [f"{x}\n" for x in rng.sample(range(0, 30), N_TESTS)]
    if f == "io2":
        return [f"{rng.randint(0, 20)} {rng.randint(0, 20)}\n" for _ in range(N_TESTS)]
    rows = []
    for _ in range(N_TESTS):
        n = rng.randint(2, 5)
        rows.append(f"{n}\n" + " ".join(str(rng.randint(0, 30)) for _ in range(n)) + "\n")
    return rows


def build_tests(spec: Spec) -> dict[str, Any]:
    """The hidden tests of ``spec`` (a pure function of its text), drawn until the systematic
    slip and every typo fail at least one of them."""
    rng = random.Random(f"marlow-tiny-code-tests-{text_hash(spec.text)}")
    wrongs = [w for w in (spec.bug, *spec.typos) if w is not None]
    for _ in range(100):
        inputs = _inputs(spec, rng)
        outputs = [run_reference(spec.right, spec.fn_name, i) for i in inputs]
        if all(not all(_passes(w, spec, inputs, outputs)) for w in wrongs):
            break
    else:
        raise RuntimeError(f"no distinguishing tests for {spec.text!r}")  # never seen
    if spec.fn_name is None:
        return {"inputs": inputs, "outputs": outputs}
    return {"fn_name": spec.fn_name, "inputs": inputs, "outputs": outputs}


VISIBLE_TESTS = 2
"""Visible tests per problem: examples a tool may run the program on (never the hidden ones)."""


def build_visible_tests(spec: Spec, hidden: dict[str, Any]) -> dict[str, Any]:
    """:data:`VISIBLE_TESTS` examples of ``spec`` (a pure function of its text, drawn apart from
    the hidden tests' draws), none with a hidden test's input, in the hidden tests' format."""
    rng = random.Random(f"marlow-tiny-code-visible-{text_hash(spec.text)}")
    inputs: list = []
    for _ in range(20):
        for x in _inputs(spec, rng):
            if x not in hidden["inputs"] and x not in inputs and len(inputs) < VISIBLE_TESTS:
                inputs.append(x)
    outputs = [run_reference(spec.right, spec.fn_name, i) for i in inputs]
    return {
        **{k: v for k, v in hidden.items() if k == "fn_name"},
        "inputs": inputs,
        "outputs": outputs,
    }


def make_problem(spec: Spec) -> Problem:
    """The ``Problem`` of a spec: tests in ``meta["tests"]`` (``marlow.rewards.code`` formats),
    examples a tool may show in ``meta["visible_tests"]``, the reference and its slips in ``meta`` for the corpus; ``answer`` is empty (no gold text)."""
    tests = build_tests(spec)
    meta = {
        "family": spec.family,
        "tests": tests,
        "visible_tests": build_visible_tests(spec, tests),
        "reference": spec.right,
        "bug": spec.bug,
        "typos": list(spec.typos),
        "fn_name": spec.fn_name,
    }
    return Problem(
        id=f"tc-{spec.family}-{text_hash(spec.text):016x}", prompt=spec.text, answer="", meta=meta
    )


def spec_of(problem: Problem) -> Spec:
    """The spec back from a problem made by :func:`make_problem`."""
    m = problem.meta
    return Spec(
        m["family"], problem.prompt, m["fn_name"], m["reference"], m["bug"], tuple(m["typos"])
    )


SPLIT = Split(
    "code",
    "marlow-tiny-code",
    draw=sample_spec,
    text=lambda spec: spec.text,
    make=make_problem,
    buckets=VAL_BUCKETS,
    max_val=MAX_VAL,
    salt="code:",
)
is_val = SPLIT.is_val
train_problems = SPLIT.train
val_problems = SPLIT.val
