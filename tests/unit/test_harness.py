"""The trusted harness: plain data across the boundary, and nothing of the tests inside it."""

from __future__ import annotations

import math
import uuid

import pytest

from marlow.rewards._serve import to_literal
from marlow.rewards.code import code_details, score_code_batch
from marlow.rewards.harness import _literal_calls, from_literal


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(10**30),
        1.5,
        math.inf,
        -math.inf,
        "a'\"\n\u00e9\udc80",
        b"\x00\xff",
        [1, [2, (3,)]],
        (),
        (1,),
        {1: "a", "b": [None], (1, 2): {3}},
        set(),
    ],
)
def test_plain_data_round_trips_with_exact_types(value):
    back = from_literal(to_literal(value))
    assert back == value and type(back) is type(value)


def test_subclasses_are_sent_as_their_base_type_and_others_refused():
    class S(str):
        def __eq__(self, other):
            return True

        __hash__ = str.__hash__

    assert type(from_literal(to_literal(S("x")))) is str
    assert from_literal(to_literal(S("x"))) != "y"
    for bad in (object(), 1j, float("nan"), [1, iter([])], {1: object()}):
        with pytest.raises((TypeError, ValueError)):
            to_literal(bad)


@pytest.mark.parametrize(
    "text",
    ["1j", "[1, 2j]", "(" * 300 + ")" * 300, "__import__('os')", "{'a': [1, {2: 3j}]}"],
)
def test_from_literal_refuses_what_is_not_plain(text):
    with pytest.raises((ValueError, SyntaxError, RecursionError, MemoryError)):
        from_literal(text)


def test_literal_calls_in_source_order():
    test = (
        "def check(c):\n    assert abs(c(1.5) - 0.5) < 1e-6\n    assert c([1, 2], k=3)\n"
        "    x = 4\n    assert c(x) == 2\n    assert f(-2, 'a') == 1\n    assert c(True)\n"
    )
    assert _literal_calls(test, "f") == ([1.5], [-2, "a"], [True])


def test_expected_values_never_enter_the_sandbox():
    """A program that searches everything it can reach (objects, frames, files, its own
    process) for the expected values of each test form reports on stderr what it found."""
    secret = f"EXPECTED-{uuid.uuid4().hex}"
    snoop = (
        "import gc, os, re, sys\n"
        "def _snoop():\n"
        "    seen = [repr(o) for o in gc.get_objects() if isinstance(o, (str, bytes, dict))]\n"
        "    f = sys._getframe()\n"
        "    while f is not None:\n"
        "        seen.append(repr(f.f_locals))\n"
        "        f = f.f_back\n"
        "    for root in ('/work', '/tmp', '/proc/self'):\n"
        "        for d, _, fs in os.walk(root):\n"
        "            for n in fs:\n"
        "                try:\n"
        "                    seen.append(open(os.path.join(d, n), 'rb').read(1 << 16).decode('latin-1'))\n"
        "                except Exception:\n"
        "                    pass\n"
        "    hit = any(re.search('EXPECTED-[0-9a-f]{32}', s) for s in seen)\n"
        "    os.write(2, b'FOUND\\n' if hit else b'CLEAN\\n')\n"
    )
    check = {
        "check": f"def check(candidate):\n    assert candidate(1) == {secret!r}\n",
        "entry_point": "f",
        "prompt": "",
    }
    call = {"fn_name": "f", "inputs": [[1], [2]], "outputs": [secret, secret]}
    stdin = {"inputs": ["1\n", "2\n"], "outputs": [secret, secret]}
    items = [
        (f"```python\n{snoop}def f(x):\n    _snoop()\n    return 'no'\n```", check),
        (f"```python\n{snoop}def f(x):\n    _snoop()\n    return 'no'\n```", call),
        (f"```python\n{snoop}_snoop()\nprint('no')\n```", stdin),
    ]
    for suite in (False, True):
        scores = score_code_batch(items, suite=suite, max_workers=2)
        for score in scores:
            for test in score.tests:
                assert "CLEAN" in test.run.stderr and "FOUND" not in test.run.stderr
    # The probe can fail: given the value in an argument, it finds it.
    leak = code_details(items[1][0], {"fn_name": "f", "inputs": [[secret]], "outputs": [1]})
    assert "FOUND" in leak.tests[0].run.stderr


def test_values_that_break_the_trusted_side_are_wrong_answers_not_sandbox_errors():
    """What comes back is the program's choice: a comparison it breaks, or a malformed answer
    line, is a wrong answer for that test (never an error of the grader, never cached apart)."""
    tests = {"fn_name": "f", "inputs": [[1], [2]], "outputs": [0.5, {"1": 2}]}
    programs = {
        "int too big for a float": "def f(x):\n    return 10 ** 400",
        "tuple and bytes dict keys": "def f(x):\n    return {(1, 2): 3, b'k': 1}",
        "answer line with a huge request number": (
            "import os\ndef f(x):\n    for fd in range(1, 64):\n        try:\n"
            "            os.write(fd, b'9' * 5000 + b' ok 0.5\\n')\n        except OSError:\n"
            "            pass\n    return 0"
        ),
    }
    for suite in (False, True):
        scores = score_code_batch(
            [(f"```python\n{p}\n```", tests) for p in programs.values()], suite=suite
        )
        for name, score in zip(programs, scores, strict=True):
            assert (name, score.reward, score.sandbox_error) == (name, 0.0, None)
    honest = "def f(x):\n    return 0.5 if x == 1 else {1: 2}"
    assert score_code_batch([(f"```python\n{honest}\n```", tests)])[0].reward == 1.0


def test_every_ast_parse_of_the_harness_holds_its_lock(monkeypatch):
    """CPython 3.11's AST conversion is not safe in concurrent threads (gh-106905: a spurious
    "AST constructor recursion depth mismatch" once failed a canonical HumanEval solution): the
    harness, which grades in threads, parses under one lock."""
    import ast

    from marlow.rewards import harness

    seen = []
    for name in ("parse", "literal_eval"):
        real = getattr(ast, name)

        def checked(*args, _real=real, **kwargs):
            seen.append(harness._AST.locked())
            return _real(*args, **kwargs)

        monkeypatch.setattr(ast, name, checked)
    harness._literal_calls.cache_clear()
    harness._literal_calls("def check(f):\n    assert f(1, [2]) == 3\n", "f")
    harness.from_literal("[1, (2, 'x')]")
    assert seen and all(seen)
