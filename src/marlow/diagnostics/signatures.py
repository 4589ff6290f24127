r"""Trajectory signatures: per-role shape statistics of a set of episodes.

``trajectory_signatures(episodes)`` -> ``{role: {name: value}}``, one entry per role that has at
least one turn (roles in order of first appearance). Pure: no I/O, no model. ``write_signatures``
/ ``read_signatures`` / ``latest_signatures`` store them as ``run_dir/signatures/step_NNNNNN.json``.

Every role gets ``n_turns``, ``length_mean``, ``length_p50``, ``length_p95``, ``truncation_rate``,
``boxed_rate`` and ``hedge_rate``; roles with several slots get ``slot_jaccard_3gram``; roles
of kind select, judge and plan (the aggregator, evaluator and orchestrator of the built-ins) get
their own (below), by their turns' ``kind``, never their name. Rates are fractions of the role's
turns (every turn of every episode, all rounds and slots pooled).

Choices the spec leaves open, made here:

* **Length** is ``len(turn.completion_ids)``, the sampled tokens (with the stop token when one
  was hit). p50/p95 use numpy's default percentile (linear interpolation between the closest
  ranks, ``np.percentile(x, q)``). Truncated = ``turn.truncated`` (finish reason ``length``).
* **Parseable box**: ``marlow.rewards.math.last_boxed`` finds a box and its content is not blank,
  the same rule that separates "parsed" from "format penalty" in the math reward.
* **Hedging**: a turn hedges when this regular expression matches, case-insensitively:
  ``(?<!\w)(wait|alternatively|actually|hmm|let me reconsider|on second thought|not correct|
  this is wrong)(?!\w)``, where each space of a phrase matches any run of whitespace (newlines
  too) and ``\w`` is a Unicode letter, digit or underscore. So "Wait," and "HMM" count;
  "await", "waiting", "hmmm", "actually_x" and "incorrect" do not.
* **Slot 3-gram Jaccard**: words are ``text.split()`` (whitespace-split, case and punctuation
  kept); a turn's set holds its consecutive word triples, so a turn of fewer than 3 words has the
  empty set. Pairs are the unordered pairs of turns of one role in the same round of one episode
  (Eval-Opt's revisions are rounds, not slots, so they never pair). A pair of two empty sets is
  skipped (undefined); one empty set against a non-empty one scores 0. The episode's value is the
  mean over its counted pairs (all rounds pooled); episodes with no counted pair are skipped; the
  signature is the mean over the remaining episodes, NaN when none remain. The key is present
  only for roles with >= 2 turns in one round of some episode.
* **Aggregator** ``terse_rate``: turns with ``len(completion_ids) <= 30`` and a parseable box.
* **Evaluator classes**, first match wins, so the three sum to 1:
  ``class_python_code_fence``: a fenced block of >= 3 body lines, whatever its language tag. A
  fence opens at a line that, stripped, starts with three or more backticks and has no backtick in
  the rest (the info string, as in CommonMark); it closes at the next line that, stripped, is only
  backticks (3+); body lines are all lines in between, blank ones included; an unclosed block
  runs to the end of the text (a truncated code dump still counts). Only backtick fences count.
  ``class_bare_stamp``: ``len(completion_ids) <= 200``, a verdict that the workflows' own parser
  (``marlow.parsers.verdict_of``) reads as Correct or Incorrect, and no three backticks anywhere in the text.
  ``class_other``: the rest. ``verdict_parse_rate``: turns where ``verdict_of`` is not None.
* **Orchestrator** strategies are read by the workflows' own parser ``strategies_of(text, n)``
  with ``n`` = the number of distinct answer-kind slots of the same episode (Orch-Workers' workers:
  it always runs ``n``), or ``n_strategies`` when given; an episode without them raises when
  ``n_strategies`` is not given. Parsed strategies are the non-None ones (an empty strategy
  string is parsed). An opener is the first 3 words (``split()``, fewer if the strategy is
  shorter), lower-cased, joined by one space, punctuation kept. ``strategy_openers_unique`` is
  the number of distinct openers over all episodes; ``strategy_diversity`` = that / strategies
  parsed, NaN when no strategy was parsed.
* **Parsers**: verdicts and strategies are read by ``marlow.parsers``, the module the workflows
  act on too (so a signature counts what the workflow saw); diagnostics import it, never the
  workflows themselves, which sit above them.
* **Storage**: one JSON file per step, the signatures dict itself (NaN written as ``NaN``, which
  Python's json reads back), written atomically (``marlow.fileio``). ``latest_signatures``
  returns ``(step, signatures)`` of the highest step, or None.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path

import numpy as np

from marlow.fileio import DamagedFileError, read_json_object, write_json
from marlow.parsers import strategies_of, verdict_of
from marlow.rewards.math import last_boxed
from marlow.types import Episode, Turn

Signatures = dict[str, dict[str, float]]  # role -> signature name -> value

SIGNATURES = {
    "n_turns": "the role's turns in the episodes the signatures were taken on (every round and "
    "slot: a 3-slot generator has 3 per episode)",
    "length_mean": "mean sampled tokens of a turn",
    "length_p50": "median sampled tokens of a turn",
    "length_p95": "95th percentile of a turn's sampled tokens",
    "truncation_rate": "share of turns cut at rollout.max_new_tokens",
    "boxed_rate": "share of turns with a parseable `\\boxed{}` answer",
    "hedge_rate": "share of turns with a hedging word (wait, actually, hmm, ...)",
    "slot_jaccard_3gram": "roles with several slots: how alike same-round turns are (mean "
    "pairwise word 3-gram Jaccard, 1 = identical)",
    "terse_rate": "select roles (aggregator): share of turns of at most 30 tokens with a box",
    "class_python_code_fence": "judge roles (evaluator): share of turns holding a code block",
    "class_bare_stamp": "judge roles: share of short turns that only give a verdict",
    "class_other": "judge roles: share of the other turns",
    "verdict_parse_rate": "judge roles: share of turns whose verdict the workflow could read",
    "strategy_openers_unique": "plan roles (orchestrator): distinct first three words of the "
    "strategies",
    "strategy_diversity": "plan roles: distinct openers over strategies parsed",
}
"""Every signature a role can have, with what it measures (the metrics reference shows them)."""

TERSE_MAX_TOKENS = 30
STAMP_MAX_TOKENS = 200
FENCE_MIN_BODY_LINES = 3
HEDGES = (
    "wait",
    "alternatively",
    "actually",
    "hmm",
    "let me reconsider",
    "on second thought",
    "not correct",
    "this is wrong",
)
_HEDGE = re.compile(
    r"(?<!\w)(?:" + "|".join(h.replace(" ", r"\s+") for h in HEDGES) + r")(?!\w)", re.IGNORECASE
)
_STEP_FILE = re.compile(r"step_(\d+)\.json")


def has_box(text: str) -> bool:
    """A parseable ``\\boxed{}``: one exists and its content is not blank."""
    return bool((last_boxed(text) or "").strip())


def hedges(text: str) -> bool:
    """The text holds one of ``HEDGES`` as a whole word or phrase (see the module docstring)."""
    return _HEDGE.search(text) is not None


def word_3grams(text: str) -> set[tuple[str, str, str]]:
    """Consecutive whitespace-split word triples; empty for fewer than 3 words."""
    w = text.split()
    return set(zip(w, w[1:], w[2:], strict=False))


def fence_body_lines(text: str) -> list[int]:
    """Body line count of each backtick-fenced block, in order (an unclosed one runs to the end)."""
    blocks: list[int] = []
    body: int | None = None  # None: outside a block
    for line in text.splitlines():
        s = line.strip()
        if body is None:
            if s.startswith("```") and "`" not in s.lstrip("`"):
                body = 0
        elif s.startswith("```") and not s.strip("`"):
            blocks.append(body)
            body = None
        else:
            body += 1
    if body is not None:
        blocks.append(body)
    return blocks


def evaluator_class(turn: Turn) -> str:
    """``python_code_fence``, ``bare_stamp`` or ``other`` (first match wins)."""
    text = turn.completion_text
    if any(n >= FENCE_MIN_BODY_LINES for n in fence_body_lines(text)):
        return "python_code_fence"
    stamp = len(turn.completion_ids) <= STAMP_MAX_TOKENS and verdict_of(text) is not None
    return "bare_stamp" if stamp and "```" not in text else "other"


def strategy_opener(strategy: str) -> str:
    """The lower-cased first 3 words of a strategy, joined by one space."""
    return " ".join(strategy.lower().split()[:3])


def _rate(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags)


def _common(turns: Sequence[Turn]) -> dict[str, float]:
    lengths = np.array([len(t.completion_ids) for t in turns], dtype=np.float64)  # (T,)
    texts = [t.completion_text for t in turns]
    return {
        "n_turns": float(len(turns)),
        "length_mean": float(lengths.mean()),
        "length_p50": float(np.percentile(lengths, 50)),
        "length_p95": float(np.percentile(lengths, 95)),
        "truncation_rate": _rate([t.truncated for t in turns]),
        "boxed_rate": _rate([has_box(x) for x in texts]),
        "hedge_rate": _rate([hedges(x) for x in texts]),
    }


def slot_jaccard(episodes: Sequence[Episode], role: str) -> float | None:
    """Mean pairwise 3-gram Jaccard among same-round turns of ``role`` (within the episode, then
    over episodes); None when no episode has two such turns, NaN when every pair was skipped."""
    per_episode: list[float] = []
    multi_slot = False
    for ep in episodes:
        by_round: dict[int, list[set]] = {}
        for t in ep.turns:
            if t.role == role:
                by_round.setdefault(t.round, []).append(word_3grams(t.completion_text))
        scores: list[float] = []
        for grams in by_round.values():
            multi_slot |= len(grams) >= 2
            for a, b in combinations(grams, 2):
                if a or b:  # both empty: undefined, skipped
                    scores.append(len(a & b) / len(a | b))
        if scores:
            per_episode.append(sum(scores) / len(scores))
    if not multi_slot:
        return None
    return sum(per_episode) / len(per_episode) if per_episode else math.nan


def strategy_signatures(
    episodes: Sequence[Episode], n_strategies: int | None = None
) -> dict[str, float]:
    """``strategy_openers_unique`` and ``strategy_diversity`` of the orchestrator turns."""
    if n_strategies is not None and n_strategies < 1:
        raise ValueError(
            f"n_strategies must be >= 1 (or None: count worker slots), got {n_strategies}"
        )
    openers: set[str] = set()
    parsed = 0
    for ep in episodes:
        n = n_strategies
        if n is None:
            n = len({t.slot for t in ep.turns if t.kind == "answer"})
        for t in ep.turns:
            if t.kind != "plan":
                continue
            if n == 0:
                raise ValueError(
                    f"episode {ep.problem_id!r} has orchestrator turns but no worker turns to "
                    "count strategies from; pass n_strategies"
                )
            found = [s for s in strategies_of(t.completion_text, n) if s is not None]
            parsed += len(found)
            openers.update(strategy_opener(s) for s in found)
    return {
        "strategy_openers_unique": float(len(openers)),
        "strategy_diversity": len(openers) / parsed if parsed else math.nan,
    }


def trajectory_signatures(
    episodes: Sequence[Episode], *, n_strategies: int | None = None
) -> Signatures:
    """Per-role signatures of ``episodes``; see the module docstring for each rule.

    ``n_strategies`` overrides the number of strategies the orchestrator was asked for (by
    default, each episode's count of distinct worker slots)."""
    by_role: dict[str, list[Turn]] = {}
    for ep in episodes:
        for t in ep.turns:
            by_role.setdefault(t.role, []).append(t)
    out: Signatures = {}
    for role, turns in by_role.items():
        sig = _common(turns)
        jac = slot_jaccard(episodes, role)
        if jac is not None:
            sig["slot_jaccard_3gram"] = jac
        kind = turns[0].kind  # a role's turns share its kind (marlow.workflows.schema.KINDS)
        if kind == "select":
            sig["terse_rate"] = _rate(
                [
                    len(t.completion_ids) <= TERSE_MAX_TOKENS and has_box(t.completion_text)
                    for t in turns
                ]
            )
        elif kind == "judge":
            classes = [evaluator_class(t) for t in turns]
            for name in ("python_code_fence", "bare_stamp", "other"):
                sig[f"class_{name}"] = _rate([c == name for c in classes])
            sig["verdict_parse_rate"] = _rate(
                [verdict_of(t.completion_text) is not None for t in turns]
            )
        elif kind == "plan":
            sig.update(strategy_signatures(episodes, n_strategies))
        out[role] = sig
    return out


def signatures_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "signatures"


def write_signatures(run_dir: str | Path, step: int, sigs: Signatures) -> Path:
    """Write ``run_dir/signatures/step_{step:06d}.json`` atomically; returns its path."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    final = write_json(signatures_dir(run_dir) / f"step_{step:06d}.json", sigs, sort_keys=True)
    return final


def read_signatures(run_dir: str | Path) -> dict[int, Signatures]:
    """step -> signatures of every stored step, in step order ({} when none are stored)."""
    folder = signatures_dir(run_dir)
    if not folder.is_dir():
        return {}
    found: dict[int, Signatures] = {}
    for p in folder.iterdir():
        m = _STEP_FILE.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = _signatures(p)
    return dict(sorted(found.items()))


def _signatures(path: Path) -> Signatures:
    """The signatures a step's file holds (role -> name -> number or null); else
    :class:`~marlow.fileio.DamagedFileError`."""
    sigs = read_json_object(path)
    for role, values in sigs.items():
        if not isinstance(values, dict) or not all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
            for v in values.values()
        ):
            raise DamagedFileError(
                f"{path}: role {role!r:.40} has no mapping of signature names to numbers; the "
                "file is damaged"
            )
    return sigs


def latest_signatures(run_dir: str | Path) -> tuple[int, Signatures] | None:
    """(step, signatures) of the highest stored step, or None when none are stored."""
    stored = read_signatures(run_dir)
    if not stored:
        return None
    step = max(stored)
    return step, stored[step]
