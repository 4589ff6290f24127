"""The tiny world: tokenizer, chat prompts, problems, corpus formats and rates, model, cache."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import torch

from marlow.prompts.chat import chat_prompt_ids
from marlow.rewards.math import last_boxed
from marlow.tiny import mathgen
from marlow.tiny.corpus import (
    BAD_STRATEGY,
    MAKERS,
    STRATEGIES,
    CorpusConfig,
    critique,
    examples,
    expected_generator_accuracy,
    make_example,
)
from marlow.tiny.model import SCALES, build_model, get_scale
from marlow.tiny.pretrain import encode, load_tiny, pretrain_tiny
from marlow.tiny.tokenizer import CHARACTERS, build_tokenizer

STRATEGY_LINE = re.compile(r"STRATEGY\s*(\d+)\s*:\s*(.+)")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def corpus_sample():
    return list(itertools.islice(examples(CorpusConfig(), seed=3), 3000))


# ---- tokenizer and chat template --------------------------------------------------------


def test_every_corpus_character_round_trips_as_one_token(tok, corpus_sample):
    text = "".join(CHARACTERS)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    used = set("".join(e.prompt + e.completion for e in corpus_sample))
    assert used <= set(CHARACTERS)
    for e in corpus_sample[:200]:
        ids = tok(e.completion, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(e.completion) and tok.decode(ids) == e.completion


def test_chat_template_exact_string(tok):
    messages = [{"role": "user", "content": "Q: 2+3"}]
    text = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == "<|im_start|>user\nQ: 2+3<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_gen == "<|im_start|>user\nQ: 2+3<|im_end|>\n"
    ids = chat_prompt_ids(tok, "Q: 2+3")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_unknown_characters_encode(tok):
    assert tok.decode(tok("a\té", add_special_tokens=False)["input_ids"]) == "a ?"


def test_tokenizer_save_load_keeps_padding_side_and_template(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.padding_side == "left"
    assert again.chat_template == tok.chat_template
    assert chat_prompt_ids(again, "Q: 12*3") == chat_prompt_ids(tok, "Q: 12*3")


def test_training_prompt_ids_are_the_sampler_prompt_ids(tok, corpus_sample):
    batch = corpus_sample[:50]
    for e, (p_ids, c_ids) in zip(batch, encode(tok, batch), strict=True):
        assert p_ids == chat_prompt_ids(tok, e.prompt)
        assert c_ids[-1] == tok.eos_token_id
        assert tok.decode(c_ids, skip_special_tokens=True) == e.completion


# ---- problems ---------------------------------------------------------------------------


def test_reference_working_and_systematic_slips():
    assert (
        mathgen.reference_working("23*4+7")
        == "23*4: 3*4=12, 2*4+1=9; 92+7: 2+7=9, 9+0=9; \\boxed{99}"
    )
    assert mathgen.reference_working("52-17") == "52-17: 12-7=5, 5-1-1=3; \\boxed{35}"
    assert mathgen.reference_working("100-7") == "100-7: 10-7=3, 10-0-1=9, 1-0-1=0; \\boxed{93}"
    assert mathgen.evaluate("7+3*12") == 43 and mathgen.evaluate("7+3*12", "left") == 120
    assert mathgen.work("7+3*12", order="left")[-1].result == 120
    forgot = mathgen.column_block(52, "-", 17, forget=True)
    assert forgot.text() == "52-17: 12-7=5, 5-1=4" and forgot.result == 45
    assert mathgen.bug_of(23, "*", 4) == 82 and mathgen.bug_of(47, "*", 6) == 242
    assert mathgen.bug_of(52, "-", 12) is None and mathgen.bug_of(5, "+", 7) is None
    shown = mathgen.column_block(47, "*", 6, explicit=True)
    assert shown.text() == "47*6: 7*6+0=42, 4*6+4=28" and shown.ok


def test_column_working_is_right_everywhere():
    for p in itertools.islice(mathgen.train_problems(seed=11), 3000):
        assert mathgen.work(p.prompt)[-1].result == int(p.answer) == mathgen.evaluate(p.prompt)
        left = mathgen.work(p.prompt, order="left")[-1].result
        assert left == mathgen.evaluate(p.prompt, "left")


def test_splits_are_disjoint_and_seeded():
    val = mathgen.val_problems(1000)
    assert len({p.prompt for p in val}) == 1000
    assert all(mathgen.is_val(p.prompt) for p in val)
    assert mathgen.val_problems(300) == val[:300]
    train = list(itertools.islice(mathgen.train_problems(seed=1), 5000))
    assert not {p.prompt for p in train} & {p.prompt for p in val}
    assert train[:20] == list(itertools.islice(mathgen.train_problems(seed=1), 20))
    assert train[:20] != list(itertools.islice(mathgen.train_problems(seed=2), 20))
    for p in val[:200]:
        assert int(p.answer) == eval(p.prompt) >= 0  # noqa: S307 (our own digits and + - *)


# ---- corpus -----------------------------------------------------------------------------


def _check_format(role: str, completion: str) -> None:
    box = last_boxed(completion)
    if role in ("generator", "worker", "synthesizer"):
        assert box is not None and re.fullmatch(r"-?\d+", box), completion
    elif role == "evaluator":
        assert box in ("Correct", "Incorrect"), completion
    elif role == "aggregator":
        assert box in ("1", "2", "3") and completion == f"\\boxed{{{box}}}", completion
    else:
        lines = completion.splitlines()
        assert 1 <= len(lines) <= 3, completion
        for i, line in enumerate(lines, 1):
            m = STRATEGY_LINE.fullmatch(line)
            assert m and int(m.group(1)) == i, completion
            assert m.group(2) in (*STRATEGIES, BAD_STRATEGY)


@pytest.mark.parametrize("key", list(MAKERS))
def test_every_role_parses_with_the_workflow_formats(key):
    role, variant = key.split("/")
    rng = random.Random(0)
    for problem in itertools.islice(mathgen.train_problems(seed=5), 300):
        e = make_example(role, variant, problem, rng, CorpusConfig())
        _check_format(role, e.completion)
        assert len(e.completion) <= 130 and len(e.prompt) <= 400


def test_generator_error_rate_matches_config():
    problems = list(itertools.islice(mathgen.train_problems(seed=9), 5000))
    for cfg in (CorpusConfig(borrow_bug=0.0, carry_bug=0.0, gen_error=0.3), CorpusConfig()):
        rng = random.Random(1)
        wrong = [not make_example("generator", "answer", p, rng, cfg).correct for p in problems]
        expected = 1 - sum(expected_generator_accuracy(p.prompt, cfg) for p in problems) / 5000
        assert abs(sum(wrong) / 5000 - expected) < 0.03, (sum(wrong) / 5000, expected)
    assert abs(expected - 0.47) < 0.1  # the default sits in the middle: headroom both ways


def test_systematic_slips_dominate_their_kind():
    """Greedy headroom: on borrow subtractions most corpus answers are the buggy ones."""
    cfg = CorpusConfig()
    rng = random.Random(2)
    problem = mathgen.make_problem("52-17", 2)
    answers = [
        make_example("generator", "answer", problem, rng, cfg).completion for _ in range(2000)
    ]
    share = sum(a == "52-17: 12-7=5, 5-1=4; \\boxed{45}" for a in answers) / 2000
    assert abs(share - cfg.borrow_bug * (1 - cfg.gen_error)) < 0.04
    assert share > sum(a.endswith("\\boxed{35}") for a in answers) / 2000


def test_critique_names_the_first_bad_column():
    sure = CorpusConfig(eval_noise=0.0, eval_bug_blind=0.0, eval_fix_noise=0.0)
    rng = random.Random(0)
    buggy = [mathgen.column_block(52, "-", 17, forget=True)]
    assert critique(buggy, rng, sure)[0] == "5-1=4 bad, 5-1-1=3; \\boxed{Incorrect}"
    right = mathgen.work("23*4+7")
    assert critique(right, rng, sure) == ("ok; \\boxed{Correct}", None)
    blind = CorpusConfig(eval_noise=0.0, eval_bug_blind=1.0)
    assert critique(buggy, rng, blind)[0] == "ok; \\boxed{Correct}"


def test_selectors_checking_beats_majority():
    """A selector that checks the working beats the majority on the same candidate sets."""
    problems = list(itertools.islice(mathgen.train_problems(seed=4), 1500))
    rates = {}
    for name, cfg in {
        "check": CorpusConfig(select_check=1.0, select_majority=0.0),
        "majority": CorpusConfig(select_check=0.0, select_majority=1.0),
    }.items():
        rng = random.Random(7)  # same candidate draws for both policies
        picks = [make_example("aggregator", "select", p, rng, cfg).correct for p in problems]
        rates[name] = sum(picks) / len(picks)
    assert rates["check"] > rates["majority"] + 0.1


def test_bad_corpus_config_is_refused():
    with pytest.raises(ValueError, match="gen_error"):
        CorpusConfig(gen_error=1.5)
    with pytest.raises(ValueError, match="weights"):
        CorpusConfig(weights={"critic/shout": 1.0})


# ---- model and cache --------------------------------------------------------------------


def test_bad_scale_name_lists_valid_ones():
    with pytest.raises(ValueError, match="tiny-s, tiny-m, tiny-l"):
        get_scale("tiny-xl")
    with pytest.raises(ValueError, match="tiny-s"):
        pretrain_tiny("huge", steps=1)


def test_scales_grow(tok):
    sizes = [sum(p.numel() for p in build_model(s, len(tok)).parameters()) for s in SCALES]
    assert sizes == sorted(sizes) and 350_000 < sizes[0] < 450_000


def test_model_save_reload_identical_logits(tok, tmp_path):
    model = build_model("tiny-s", len(tok), seed=1).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = load_tiny(tmp_path)
    ids = torch.tensor([chat_prompt_ids(tok, "Q: 23*4+7")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert tok2.padding_side == "left"


def test_pretrain_caches_by_key(tmp_path, monkeypatch):
    messages: list[str] = []
    path = pretrain_tiny("tiny-s", steps=3, cache_dir=tmp_path, log=messages.append)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["steps"] == 3 and meta["task"] == "math" and path.name.startswith("tiny-s-")
    assert meta["final_loss"] > 0 and "greedy_generator_accuracy" not in meta  # not measured here
    from marlow.worlds import tinyeval

    monkeypatch.setattr(tinyeval, "REPORT_PROBLEMS", 8)
    assert tinyeval.greedy_report(path) == {"accuracy": 0.0, "problems": 8.0}  # 3 steps: no skill
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    import marlow.tiny.pretrain as pretrain

    def boom(*args, **kwargs):
        raise AssertionError("retrained on a cache hit")

    monkeypatch.setattr(pretrain, "_train", boom)
    assert pretrain_tiny("tiny-s", steps=3, cache_dir=tmp_path) == path
    monkeypatch.setenv("MARLOW_CACHE", str(tmp_path))
    assert pretrain_tiny("tiny-s", steps=3) == path
    with pytest.raises(AssertionError):  # another key is another folder
        pretrain_tiny("tiny-s", steps=3, cache_dir=tmp_path, seed=1)
    model, tok = load_tiny(path)
    assert tok.padding_side == "left" and not model.training
