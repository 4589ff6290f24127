"""Prompt templates per (style, task, role, variant).

Two styles share one code path:

* ``chat``: instructions in plain English for real chat models (Qwen3 and the like). The text goes
  through the tokenizer's chat template with thinking disabled.
* ``tiny``: terse prompts for the tiny world. The tiny model is pre-trained on exactly these
  prompts (``marlow.tiny.corpus`` renders its examples through :func:`render`), so a change here
  changes what the tiny model was taught: the corpus hash includes this module's templates of
  the task the model is pre-trained for (math keys cover the math templates only).

This is the prompt *library*: a workflow file's stage names one of its templates as
``ROLE/VARIANT`` (``generator/revise``), or uses a template of its own
(:mod:`marlow.workflows.schema`). The library is read-only, so that no workflow, registered or
declared, can change what the tiny world's cache key hashes.

Templates are ``str.format`` strings. Their fields are what the workflow file's stage reads
(``reads: {answer: last.generator}``), the problem and the workflow's parameters: the built-in
files give ``problem``, ``answer`` (the latest generator output), ``critique`` (the latest
evaluator output), ``candidates`` (the generator outputs, numbered ``1) ...``), ``strategy``
(the strategy of this worker slot), ``solutions`` (the worker outputs, numbered), ``n`` (how
many candidates / strategies).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

STYLES = ("chat", "tiny")

# (task, role, variant) -> template. A workflow names the variant its stage uses.
_CHAT: dict[tuple[str, str, str], str] = {
    ("math", "generator", "answer"): (
        "Solve the following math problem. Reason step by step, then put the final answer "
        "in \\boxed{{}}.\n\n{problem}"
    ),
    ("math", "generator", "revise"): (
        "Solve the following math problem. Reason step by step, then put the final answer "
        "in \\boxed{{}}.\n\n{problem}\n\nYour previous solution:\n{answer}\n\n"
        "A reviewer judged it incorrect:\n{critique}\n\n"
        "Write a corrected solution and put the final answer in \\boxed{{}}."
    ),
    ("math", "evaluator", "review"): (
        "You are reviewing a solution to a math problem.\n\nProblem:\n{problem}\n\n"
        "Solution:\n{answer}\n\nCheck the solution. Write a short critique naming any error, "
        "then end with \\boxed{{Correct}} or \\boxed{{Incorrect}}."
    ),
    ("math", "aggregator", "select"): (
        "Several candidate solutions to a math problem follow.\n\nProblem:\n{problem}\n\n"
        "{candidates}\n\nCheck the candidates and select the one that is correct. "
        "Reply only with its number in \\boxed{{}}, for example \\boxed{{1}}."
    ),
    ("math", "orchestrator", "plan"): (
        "Plan how to solve the following math problem. Propose {n} different strategies, one "
        "per line, each starting with 'STRATEGY i:' (i = 1..{n}). Do not solve it.\n\n{problem}"
    ),
    ("math", "worker", "solve"): (
        "Solve the following math problem using the given strategy. Reason step by step, then "
        "put the final answer in \\boxed{{}}.\n\n{problem}\n\nStrategy: {strategy}"
    ),
    ("math", "synthesizer", "conclude"): (
        "Several workers solved a math problem.\n\nProblem:\n{problem}\n\n{solutions}\n\n"
        "Compare their solutions, decide which answer is right, and write the final answer "
        "in \\boxed{{}}."
    ),
    ("code", "generator", "answer"): (
        "Write a Python solution to the following problem. Put the complete program in one "
        "```python fenced block.\n\n{problem}"
    ),
    ("code", "generator", "revise"): (
        "Write a Python solution to the following problem. Put the complete program in one "
        "```python fenced block.\n\n{problem}\n\nYour previous solution:\n{answer}\n\n"
        "A reviewer judged it incorrect:\n{critique}\n\n"
        "Write a corrected program in one ```python fenced block."
    ),
    ("code", "evaluator", "review"): (
        "You are reviewing a solution to a programming problem.\n\nProblem:\n{problem}\n\n"
        "Solution:\n{answer}\n\nCheck the code. Write a short critique naming any bug, "
        "then end with \\boxed{{Correct}} or \\boxed{{Incorrect}}."
    ),
    ("code", "aggregator", "select"): (
        "Several candidate solutions to a programming problem follow.\n\nProblem:\n{problem}"
        "\n\n{candidates}\n\nCheck the candidates and select the one that is correct. "
        "Reply only with its number in \\boxed{{}}, for example \\boxed{{1}}."
    ),
    ("code", "orchestrator", "plan"): (
        "Plan how to solve the following programming problem. Propose {n} different "
        "strategies, one per line, each starting with 'STRATEGY i:' (i = 1..{n}). Do not write "
        "the code.\n\n{problem}"
    ),
    ("code", "worker", "solve"): (
        "Write a Python solution to the following problem using the given strategy. Put the "
        "complete program in one ```python fenced block.\n\n{problem}\n\nStrategy: {strategy}"
    ),
    ("code", "synthesizer", "conclude"): (
        "Several workers wrote solutions to a programming problem.\n\nProblem:\n{problem}"
        "\n\n{solutions}\n\nCompare their solutions, decide which is right, and write the "
        "final program in one ```python fenced block."
    ),
}

# The tiny world's templates: short, because the tiny model reads characters.
_TINY: dict[tuple[str, str, str], str] = {
    ("math", "generator", "answer"): "Q: {problem}",
    ("math", "generator", "revise"): "Q: {problem}\nA: {answer}\nC: {critique}\nFix:",
    ("math", "evaluator", "review"): "Q: {problem}\nA: {answer}\nCheck:",
    ("math", "aggregator", "select"): "Q: {problem}\n{candidates}\nPick:",
    ("math", "orchestrator", "plan"): "Q: {problem}\nPlan {n}:",
    ("math", "worker", "solve"): "Q: {problem}\nS: {strategy}\nSolve:",
    ("math", "synthesizer", "conclude"): "Q: {problem}\n{solutions}\nFinal:",
    # code: the same shapes; the code world pre-trains its own model (marlow.tiny.pretrain)
    ("code", "generator", "answer"): "P: {problem}",
    ("code", "generator", "revise"): "P: {problem}\nA: {answer}\nC: {critique}\nFix:",
    ("code", "evaluator", "review"): "P: {problem}\nA: {answer}\nCheck:",
    ("code", "aggregator", "select"): "P: {problem}\n{candidates}\nPick:",
    ("code", "orchestrator", "plan"): "P: {problem}\nPlan {n}:",
    ("code", "worker", "solve"): "P: {problem}\nS: {strategy}\nSolve:",
    ("code", "synthesizer", "conclude"): "P: {problem}\n{solutions}\nFinal:",
}

TEMPLATES: Mapping[str, Mapping[tuple[str, str, str], str]] = MappingProxyType(
    {"chat": MappingProxyType(_CHAT), "tiny": MappingProxyType(_TINY)}
)

GENERIC_STRATEGY = {"chat": "Solve it directly, step by step.", "tiny": "direct"}
"""Filled in for each strategy the orchestrator did not provide (counted as a fallback)."""


def template(style: str, task: str, role: str, variant: str) -> str:
    """The template for (style, task, role, variant), with an error that lists what exists."""
    if style not in TEMPLATES:
        raise ValueError(f"prompt style {style!r} is unknown; valid: {', '.join(STYLES)}")
    table = TEMPLATES[style]
    key = (task, role, variant)
    if key not in table:
        known = ", ".join(f"{t}/{r}/{v}" for t, r, v in sorted(table))
        raise ValueError(f"no {style} prompt for {task}/{role}/{variant}; known: {known}")
    return table[key]


def fill(text: str, fields: Mapping[str, object], label: str) -> str:
    """Fill a template; a missing field names the template (``label``) and the field."""
    try:
        return text.format_map(fields)
    except KeyError as err:
        raise ValueError(
            f"prompt {label} needs field {err.args[0]!r}; given: {', '.join(sorted(fields))}"
        ) from None


def render(style: str, task: str, role: str, variant: str, fields: Mapping[str, object]) -> str:
    """Fill the library template (style, task, role, variant)."""
    return fill(template(style, task, role, variant), fields, f"{style}/{task}/{role}/{variant}")


def numbered(texts: list[str], style: str) -> str:
    """Candidates or solutions as a numbered list. The tiny style folds each onto one line."""
    if style == "tiny":
        return "\n".join(f"{i}) {t.strip().replace(chr(10), '; ')}" for i, t in enumerate(texts, 1))
    return "\n\n".join(f"Candidate {i}:\n{t.strip()}" for i, t in enumerate(texts, 1))
