"""Synthetic integer arithmetic for the tiny world: problems, splits and a reference solver.

Problems are bare expressions (the ``{problem}`` field of the prompts), in three levels:

* level 1: ``a+b`` with 1-2 digit operands;
* level 2: ``a-b`` (``a`` < 200, ``b`` < 100, result >= 0) and ``a*b`` (2-digit times 1-digit,
  either order);
* level 3: two operations with precedence: ``a*b+c``, ``a*b-c``, ``a+b*c``, ``a+b-c``, ``a-b+c``.

Every intermediate and final result is a non-negative integer below 1000.

The split is a pure function of the problem text (a stable hash, :mod:`marlow.tiny.splits`): a
problem is either in the validation split or in the training stream, never both, whatever the
seeds.

The solver writes WORKING: one block per operation, each block the operation's columns from the
units up, carries and borrows written as explicit terms, then ``\boxed{answer}``::

    23*4+7  ->  23*4: 3*4=12, 2*4+1=9; 92+7: 2+7=9, 9+0=9; \boxed{99}
    52-17   ->  52-17: 12-7=5, 5-1-1=3; \boxed{35}

Why columns: a 0.4M-parameter model learns single-digit facts plus a carry quickly, but learns
whole-number sums (``57+48=105``) several times slower (bench: 96 % vs 27 % on 2-digit addition
after the same 700 steps). Every step is checkable on its own, and the two systematic slips of
the corpus are natural ones: a forgotten borrow (``5-1=4`` for ``5-1-1=3``) and a forgotten
carry (``2*4=8`` for ``2*4+1=9``). A block's result is assembled from its written columns, and a
later block starts from that result, so a slip propagates consistently.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from marlow.tiny.splits import Split, text_hash
from marlow.types import Problem

LEVEL_WEIGHTS: dict[int, float] = {1: 0.3, 2: 0.4, 3: 0.3}
VAL_BUCKETS = 10  # one problem text in ten (by hash) belongs to the validation split
MAX_VAL = 5000  # val_problems refuses more (the level-1 and level-2 pools would run dry)

Order = Literal["precedence", "left"]


def apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"operator {op!r} is unknown; valid: + - *")


@dataclass(frozen=True)
class Column:
    """One written column step, e.g. ``2*4+1=9``; ``value`` is what was written after ``=``."""

    text: str
    value: int


@dataclass(frozen=True)
class Block:
    """One operation ``a op b`` worked in columns; ``result`` is assembled from the columns."""

    a: int
    op: str
    b: int
    columns: tuple[Column, ...]
    result: int

    @property
    def lhs(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def true(self) -> int:
        return apply(self.a, self.op, self.b)

    @property
    def ok(self) -> bool:
        return self.result == self.true

    def text(self) -> str:
        return f"{self.lhs}: " + ", ".join(c.text for c in self.columns)


Edit = Callable[[int, int], int]
"""``edit(column_index, right_value) -> written value``: where the corpus puts a slip."""


def _digits(n: int) -> list[int]:
    return [int(d) for d in reversed(str(n))]  # least significant first


def column_block(
    a: int,
    op: str,
    b: int,
    *,
    forget: bool = False,
    explicit: bool = False,
    edit: Edit | None = None,
) -> Block:
    """Work ``a op b`` in columns. ``forget``: drop every carry (``*``) or borrow (``-``) term
    (the systematic slip; addition never forgets). ``explicit``: write zero carries too
    (``7+8+0=15``), the "show carries" style. A subtraction with a negative result or a product
    of two multi-digit numbers is written as one direct step."""
    x, y = (b, a) if op == "*" and b >= 10 else (a, b)  # a product's 1-digit factor goes in y
    if (op == "-" and a < b) or (op == "*" and y >= 10):
        value = apply(a, op, b)
        value = edit(0, value) if edit else value
        return Block(a, op, b, (Column(f"{a}{op}{b}={value}", value),), value)
    dx, dy = _digits(x), _digits(y) if op != "*" else [y]
    cols: list[Column] = []
    low: list[int] = []  # written digits below the top column
    carry = 0  # carry (+, *) or borrow (-) from the column below, as the working uses it
    n = len(dx) if op == "*" else max(len(dx), len(dy))
    for i in range(n):
        d = dx[i] if i < len(dx) else 0
        e = dy[0] if op == "*" else (dy[i] if i < len(dy) else 0)
        used = 0 if forget and op != "+" else carry
        tail = f"{'-' if op == '-' else '+'}{used}" if used or explicit else ""
        if op == "-":
            top = d + 10 if d - used < e else d
            text, value = f"{top}-{e}{tail}", top - e - used
            nxt = 1 if d - used < e else 0
        else:
            text, value = f"{d}{op}{e}{tail}", apply(d, op, e) + used
            nxt = value // 10
        if edit is not None:
            value = edit(i, value)
            if op != "-":
                nxt = value // 10
        cols.append(Column(f"{text}={value}", value))
        if i < n - 1:
            low.append(value % 10)
        carry = nxt
    if op == "-":
        result = int("".join(str(v) for v in reversed([*low, cols[-1].value])))
    else:
        result = int(str(cols[-1].value) + "".join(str(v) for v in reversed(low)))
    return Block(a, op, b, tuple(cols), result)


def parse(text: str) -> tuple[list[int], list[str]]:
    """``"23*4+7"`` -> ``([23, 4, 7], ["*", "+"])``."""
    nums: list[int] = []
    ops: list[str] = []
    digits = ""
    for ch in text.replace(" ", ""):
        if ch.isdigit():
            digits += ch
        elif ch in "+-*" and digits:
            nums.append(int(digits))
            ops.append(ch)
            digits = ""
        else:
            raise ValueError(f"not a tiny arithmetic expression: {text!r}")
    if not digits:
        raise ValueError(f"not a tiny arithmetic expression: {text!r}")
    nums.append(int(digits))
    return nums, ops


def _reduce(text: str, order: Order, do: Callable[[int, str, int], int]) -> int:
    """Evaluate ``text`` calling ``do(a, op, b)`` for each operation, in working order:
    ``*`` first then left to right (``precedence``), or strictly left to right (``left``)."""
    nums, ops = parse(text)
    if order == "precedence":
        while "*" in ops:
            k = ops.index("*")
            nums[k : k + 2] = [do(nums[k], "*", nums[k + 1])]
            del ops[k]
    value = nums[0]
    for op, b in zip(ops, nums[1:], strict=True):
        value = do(value, op, b)
    return value


BlockWriter = Callable[[int, int, str, int], Block]
"""``write(block_index, a, op, b) -> Block``; the reference writes :func:`column_block`."""


def work(
    text: str, *, order: Order = "precedence", write: BlockWriter | None = None
) -> list[Block]:
    """The blocks that evaluate ``text`` (``order="left"`` ignores precedence: wrong for
    ``a+b*c``). Each block starts from the previous block's written result."""
    blocks: list[Block] = []

    def do(a: int, op: str, b: int) -> int:
        block = write(len(blocks), a, op, b) if write else column_block(a, op, b)
        blocks.append(block)
        return block.result

    _reduce(text, order, do)
    return blocks


def evaluate(text: str, order: Order = "precedence") -> int:
    """The true value of ``text``."""
    return _reduce(text, order, apply)


def boxed(value: object) -> str:
    return f"\\boxed{{{value}}}"


def format_working(blocks: list[Block]) -> str:
    """``23*4: 3*4=12, 2*4+1=9; 92+7: 2+7=9, 9+0=9; \\boxed{99}``."""
    return "; ".join([*(b.text() for b in blocks), boxed(blocks[-1].result)])


def reference_working(text: str) -> str:
    """The correct working of a problem."""
    return format_working(work(text))


def bug_of(a: int, op: str, b: int) -> int | None:
    """The result with every carry / borrow forgotten, or None when that changes nothing."""
    if op == "+":
        return None
    wrong = column_block(a, op, b, forget=True).result
    return wrong if wrong != apply(a, op, b) else None


def first_bad_column(block: Block) -> tuple[int, Column] | None:
    """(index, written column) of the first column that differs from the right working of the
    block's own operands; None when every column is right."""
    right = column_block(block.a, block.op, block.b)
    for i, (c, r) in enumerate(zip(block.columns, right.columns, strict=False)):
        if c.text != r.text:
            return i, c
    return None


# ---- problems and splits -----------------------------------------------------------------


def _mul(rng: random.Random) -> str:
    x, y = rng.randint(10, 99), rng.randint(2, 9)
    return f"{x}*{y}" if rng.random() < 0.7 else f"{y}*{x}"


def sample_text(rng: random.Random, level: int | None = None) -> tuple[int, str]:
    """(level, expression) drawn from the problem distribution."""
    if level is None:
        level = rng.choices(list(LEVEL_WEIGHTS), weights=list(LEVEL_WEIGHTS.values()))[0]
    if level == 1:
        return 1, f"{rng.randint(1, 99)}+{rng.randint(1, 99)}"
    if level == 2:
        if rng.random() < 0.5:
            a = rng.randint(10, 199)
            return 2, f"{a}-{rng.randint(1, min(a, 99))}"
        return 2, _mul(rng)
    if level != 3:
        raise ValueError(f"problem level {level} is unknown; valid: 1, 2, 3")
    form = rng.choice(("a*b+c", "a*b-c", "a+b*c", "a+b-c", "a-b+c"))
    if form == "a*b+c":
        return 3, f"{_mul(rng)}+{rng.randint(1, 99)}"
    if form == "a*b-c":
        m = _mul(rng)
        return 3, f"{m}-{rng.randint(1, min(99, evaluate(m)))}"
    if form == "a+b*c":
        return 3, f"{rng.randint(1, 99)}+{rng.randint(10, 99)}*{rng.randint(2, 9)}"
    if form == "a+b-c":
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        return 3, f"{a}+{b}-{rng.randint(1, min(99, a + b))}"
    a = rng.randint(10, 99)
    return 3, f"{a}-{rng.randint(1, a)}+{rng.randint(1, 99)}"


def make_problem(text: str, level: int) -> Problem:
    pid = f"tm{level}-{text_hash(text):016x}"
    return Problem(id=pid, prompt=text, answer=str(evaluate(text)), meta={"level": level})


SPLIT = Split(
    "math",
    "marlow-tiny",
    draw=sample_text,  # (level, text)
    text=lambda drawn: drawn[1],
    make=lambda drawn: make_problem(drawn[1], drawn[0]),
    buckets=VAL_BUCKETS,
    max_val=MAX_VAL,
)
is_val = SPLIT.is_val
train_problems = SPLIT.train
val_problems = SPLIT.val
