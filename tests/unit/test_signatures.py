"""Trajectory signatures on small fixed texts, expected values worked out by hand."""

from __future__ import annotations

import math

import pytest

from marlow.diagnostics.signatures import (
    SIGNATURES,
    evaluator_class,
    latest_signatures,
    read_signatures,
    trajectory_signatures,
    write_signatures,
)
from marlow.types import Episode, Turn
from marlow.workflows import build_workflow, workflow_names

EXACT = {"rel": 1e-9, "abs": 1e-12}
KIND = {r: k for w in workflow_names() for r, k in build_workflow(w).kinds.items()}
"""The built-in roles' kinds (signatures read a turn's kind); any other role answers."""


def turn(role: str, text: str, k: int = 5, slot: int = 0, rnd: int = 0, cut: bool = False) -> Turn:
    """A turn of ``k`` tokens; ``cut`` marks it truncated (finish reason ``length``)."""
    finish = "length" if cut else "stop"
    kind = KIND.get(role, "answer")
    return Turn(role, slot, rnd, "a", "", [], list(range(k)), [0.0] * k, finish, text, kind=kind)


def ep(*turns: Turn, pid: str = "p") -> Episode:
    return Episode(pid, 0, 0, list(turns))


def sig_of(role: str, *texts: str, k: int = 5) -> dict[str, float]:
    """Signatures of ``role`` over one single-turn episode per text."""
    return trajectory_signatures([ep(turn(role, t, k)) for t in texts])[role]


def test_length_percentiles_and_truncation():
    eps = [
        ep(turn("generator", "x", 10), turn("generator", "x", 100, cut=True)),
        ep(
            turn("generator", "x", 30),
            turn("generator", "x", 20),
            turn("generator", "x", 40, cut=True),
        ),
    ]
    s = trajectory_signatures(eps)["generator"]
    # sorted lengths 10 20 30 40 100: mean 200/5 = 40; p50 at rank 0.5*4 = 2 -> 30;
    # p95 at rank 0.95*4 = 3.8 -> 40 + 0.8*(100-40) = 88; 2 of 5 truncated.
    assert s["n_turns"] == 5.0
    assert s["length_mean"] == pytest.approx(40.0, **EXACT)
    assert s["length_p50"] == pytest.approx(30.0, **EXACT)
    assert s["length_p95"] == pytest.approx(88.0, **EXACT)
    assert s["truncation_rate"] == pytest.approx(0.4, **EXACT)


def test_boxed_rate_counts_only_parseable_boxes():
    s = sig_of(
        "generator",
        r"so \boxed{5}",  # yes
        r"\boxed 7",  # yes: unbraced form with a space
        r"\boxed{}",  # no: empty
        r"\boxed{  }",  # no: blank
        r"\boxed{3",  # no: never closes
        "the answer is 5",  # no box
    )
    assert s["boxed_rate"] == pytest.approx(2 / 6, **EXACT)


@pytest.mark.parametrize(
    "text",
    [
        "Wait, that is off.",
        "HMM. Let us see",
        "Alternatively: add first",
        "so actually 5",
        "Let me\nreconsider the carry",
        "On  second thought, 4",
        "That is not correct.",
        "this is WRONG",
    ],
)
def test_hedging_phrases_count(text):
    assert sig_of("generator", text)["hedge_rate"] == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "await the result",
        "waiting for it",
        "actually_x = 3",
        "hmmm",
        "x2wait",
        r"\boxed{Incorrect}",
        "letme reconsider",
        "not correctly placed",
        "this is wrongly signed",
    ],
)
def test_non_hedges_do_not_count(text):
    assert sig_of("generator", text)["hedge_rate"] == 0.0


def test_hedge_rate_is_a_fraction_of_turns():
    # 1 of 4 turns hedges (twice, still one turn): 0.25
    s = sig_of("generator", "wait, hmm", "await", "fine", "ok")
    assert s["hedge_rate"] == pytest.approx(0.25, **EXACT)


def test_slot_jaccard_within_episode_then_over_episodes():
    a = ep(
        turn("generator", "a b c d", slot=0),  # {abc, bcd}
        turn("generator", "a b c e", slot=1),  # {abc, bce}
        turn("generator", "x y", slot=2),  # {} (2 words)
        turn("aggregator", r"\boxed{1}"),
    )
    # pairs: (0,1) 1/3; (0,2) 0/2 = 0; (1,2) 0 -> episode mean 1/9
    b = ep(turn("generator", "p q", slot=0), turn("generator", "r", slot=1))  # both empty: skipped
    c = ep(turn("generator", "a b c", slot=0), turn("generator", "a b c", slot=1))  # 1
    sigs = trajectory_signatures([a, b, c])
    # over episodes a and c (b has no counted pair): (1/9 + 1) / 2 = 5/9
    assert sigs["generator"]["slot_jaccard_3gram"] == pytest.approx(5 / 9, **EXACT)
    assert "slot_jaccard_3gram" not in sigs["aggregator"]  # one slot


def test_slot_jaccard_keeps_case_and_pairs_only_within_a_round():
    # case kept: {A b c} vs {a b c} share nothing -> 0
    s = trajectory_signatures([ep(turn("w", "A b c", slot=0), turn("w", "a b c", slot=1))])
    assert s["w"]["slot_jaccard_3gram"] == 0.0
    # Eval-Opt revisions: same slot, rounds 0 and 1, identical texts: not slots, no key
    revisions = ep(turn("generator", "a b c", rnd=0), turn("generator", "a b c", rnd=1))
    assert "slot_jaccard_3gram" not in trajectory_signatures([revisions])["generator"]


def test_slot_jaccard_is_nan_when_every_pair_is_skipped():
    s = trajectory_signatures([ep(turn("w", "a b", slot=0), turn("w", "", slot=1))])
    assert math.isnan(s["w"]["slot_jaccard_3gram"])


def test_aggregator_terse_rate():
    eps = [
        ep(turn("aggregator", r"\boxed{2}", 30)),  # terse
        ep(turn("aggregator", r"\boxed{2}", 31)),  # one token too long
        ep(turn("aggregator", "2", 5)),  # no box
        ep(turn("aggregator", r"pick \boxed{1}", 1)),  # terse
    ]
    assert trajectory_signatures(eps)["aggregator"]["terse_rate"] == pytest.approx(0.5, **EXACT)
    assert sig_of("aggregator", r"\boxed{2}", k=31)["terse_rate"] == 0.0
    assert "terse_rate" not in sig_of("generator", r"\boxed{2}", k=3)


FENCE3 = "```python\nx = 1\ny = 2\nprint(x + y)\n```\n\\boxed{Correct}"
FENCE2 = "```\nx = 1\ny = 2\n```\n\\boxed{Correct}"


@pytest.mark.parametrize(
    ("text", "k", "expected"),
    [
        (FENCE3, 40, "python_code_fence"),
        ("```\nx = 1\n\nprint(x)\n```", 40, "python_code_fence"),  # blank body line counts
        ("```py\na\nb\nc", 300, "python_code_fence"),  # unclosed: runs to the end
        (FENCE2, 10, "other"),  # 2 body lines; a fence, so not a stamp either
        # inline ticks open nothing (else lines 2-4 would be a 3-line block closed by line 5)
        ("```x = 1```\nlooks\nfine\nto me\n```\n\\boxed{Correct}", 10, "other"),
        (r"Looks right. \boxed{Incorrect}", 200, "bare_stamp"),
        (r"\boxed{Correct}", 201, "other"),  # too long for a stamp
        (r"\boxed{maybe}", 5, "other"),  # not a verdict
    ],
)
def test_evaluator_class(text, k, expected):
    assert evaluator_class(turn("evaluator", text, k)) == expected


def test_evaluator_class_rates_and_verdict_parse_rate():
    eps = [
        ep(turn("evaluator", FENCE3, 40)),  # fence, verdict parsed
        ep(turn("evaluator", FENCE2, 10)),  # other, verdict parsed
        ep(turn("evaluator", r"ok \boxed{incorrect}", 200)),  # stamp, parsed (any case)
        ep(turn("evaluator", r"\boxed{Correct}", 201)),  # other, parsed
        ep(turn("evaluator", r"\boxed{maybe}", 5)),  # other, unparsed
        ep(turn("evaluator", "```py\na\nb\nc", 300)),  # fence, unparsed
    ]
    s = trajectory_signatures(eps)["evaluator"]
    assert s["class_python_code_fence"] == pytest.approx(2 / 6, **EXACT)
    assert s["class_bare_stamp"] == pytest.approx(1 / 6, **EXACT)
    assert s["class_other"] == pytest.approx(3 / 6, **EXACT)
    assert s["verdict_parse_rate"] == pytest.approx(4 / 6, **EXACT)


def workers(n: int) -> list[Turn]:
    return [turn("worker", "w", slot=i) for i in range(n)]


def test_strategy_openers_and_diversity():
    e1 = ep(
        turn(
            "orchestrator",
            "STRATEGY 1: Use column addition carefully\n"  # "use column addition"
            "STRATEGY 2: check the inverse first\n"  # "check the inverse"
            "STRATEGY 3: use  Column addition again",  # "use column addition" (again)
        ),
        *workers(3),
    )
    e2 = ep(
        turn(
            "orchestrator",
            "STRATEGY 1: Guess\n"  # "guess" (one word)
            "STRATEGY 4: out of range\n"  # index 4 > n = 3: not parsed
            "STRATEGY 2: check the inverse twice",  # "check the inverse"
        ),
        *workers(3),
    )
    # n = 2 worker slots: index 3 is out of range, nothing parsed
    e3 = ep(turn("orchestrator", "STRATEGY 3: brand new idea"), *workers(2))
    s = trajectory_signatures([e1, e2, e3])["orchestrator"]
    # parsed 3 + 2 + 0 = 5; openers {use column addition, check the inverse, guess} = 3
    assert s["strategy_openers_unique"] == 3.0
    assert s["strategy_diversity"] == pytest.approx(3 / 5, **EXACT)
    # told n = 3, e3's strategy counts: 4 unique of 6
    s = trajectory_signatures([e1, e2, e3], n_strategies=3)["orchestrator"]
    assert s["strategy_openers_unique"] == 4.0
    assert s["strategy_diversity"] == pytest.approx(4 / 6, **EXACT)


def test_strategies_need_a_count_and_diversity_is_nan_without_any():
    lone = ep(turn("orchestrator", "STRATEGY 1: a b c"))
    with pytest.raises(ValueError, match="n_strategies"):
        trajectory_signatures([lone])
    assert trajectory_signatures([lone], n_strategies=1)["orchestrator"]["strategy_diversity"] == 1
    s = trajectory_signatures([ep(turn("orchestrator", "no plan"), *workers(3))])["orchestrator"]
    assert s["strategy_openers_unique"] == 0.0
    assert math.isnan(s["strategy_diversity"])


def test_every_present_role_gets_an_entry_with_its_own_keys_only():
    sigs = trajectory_signatures(
        [ep(turn("orchestrator", "STRATEGY 1: x"), *workers(1), turn("synthesizer", "s"))]
    )
    assert list(sigs) == ["orchestrator", "worker", "synthesizer"]
    assert sigs["worker"]["n_turns"] == 1.0
    assert "strategy_diversity" not in sigs["synthesizer"]
    assert "class_other" not in sigs["orchestrator"]
    assert trajectory_signatures([]) == {}


def test_write_read_round_trip(tmp_path):
    a = {"generator": {"length_mean": 12.5, "slot_jaccard_3gram": math.nan}}
    b = {"aggregator": {"terse_rate": 0.25}}
    assert read_signatures(tmp_path) == {} and latest_signatures(tmp_path) is None
    path = write_signatures(tmp_path, 12, b)
    write_signatures(tmp_path, 3, a)
    assert path == tmp_path / "signatures" / "step_000012.json"
    (tmp_path / "signatures" / "step_000099.json.tmp").write_text("{broken")  # half-written
    (tmp_path / "signatures" / "notes.txt").write_text("x")
    stored = read_signatures(tmp_path)
    assert list(stored) == [3, 12]
    assert stored[12] == b
    assert stored[3]["generator"]["length_mean"] == 12.5
    assert math.isnan(stored[3]["generator"]["slot_jaccard_3gram"])
    assert latest_signatures(tmp_path) == (12, b)
    assert sorted(p.name for p in (tmp_path / "signatures").iterdir()) == [
        "notes.txt",
        "step_000003.json",
        "step_000012.json",
        "step_000099.json.tmp",
    ]  # no .tmp of our own left behind
    with pytest.raises(ValueError, match="step"):
        write_signatures(tmp_path, -1, b)


def test_every_signature_a_role_can_have_is_described():
    every_kind = ep(
        turn("orchestrator", "STRATEGY 1: try"), *workers(2), turn("evaluator", "Correct"),
        turn("aggregator", "\\boxed{1}"), turn("synthesizer", "s"),
    )  # fmt: skip
    names = {k for sig in trajectory_signatures([every_kind]).values() for k in sig}
    assert names == set(SIGNATURES)
