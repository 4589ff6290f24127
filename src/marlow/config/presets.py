"""Run presets, and where each of the faithful presets' choices comes from.

A preset is a nested dict of config settings (``preset: NAME`` in a config), merged under the
run's file and overrides by :func:`marlow.config.resolve`; under :data:`PER_TASK` it may add
settings for one ``task.name``. Pure data: this module imports nothing of marlow, so that the
config's loading (which validates the settings) and the model loader can read it.

Two presets reproduce the study:

* ``paper``: its text (Table 7 and §A.7). Every field's default *is* its Table 7 value, so the
  preset only names the model and its bfloat16 base weights, and sizes the rollout batch and the
  micro-batch for the study's GPUs (:data:`_STUDY_CARDS`).
* ``official``: its released code (github.com/XHMY/marl-llm-workflows with its verl fork), on
  every point where that code and the text disagree or the text is silent; each such point is
  a config switch, listed in :data:`SWITCHES` with both sources. ``marlow diff-presets paper
  official`` prints the table from these two places (:func:`marlow.config.preset_diff`).

Switches the official preset cannot set, because their values are data sources or differ per
dataset or workflow: ``task.hub_config`` (``en`` with ``task.dataset=dapo``: DAPO-Math-17k-Processed's
English problems), ``task.holdout`` (0.1 of DAPO, 1000 of DeepCoder), ``task.val_source``
(AIME-2025 for math), ``task.runtime_filter`` (the official code's runtime-results file, which
keeps only the code tests that passed a runtime check) and ``rollout.max_prompt_tokens`` (Table
7's prompt caps: 30720 Eval-Opt math, 20480 Voting and Orch-Workers math, 10240 code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PER_TASK = "per_task"  # the key of a preset's per-task overlays (not a config field)

# The study's hardware (§A.8): one node of two GPUs per cell, an 80 GB H100 for 1.7B and 4B, a
# 48 GB L40S for 0.6B, with the micro-batch tokens set per scale and card. marlow's data parallel
# puts the whole run on each GPU, so these two memory settings (neither changes the algorithm) are
# sized with `marlow plan` to fit each card for every model the study trained: at the preset's
# 5,120 new tokens and plan's 1,024-token prompt, Qwen3-0.6B peaks at 33.8 GiB of 48 (its
# rollout's KV cache), 1.7B at 36.8 GiB and 4B at 51.9 GiB of 80 (tests/e2e/test_cli_plan.py).
# Table 7 does not give them; the default 256 sequences fit none of the three (a KV cache of
# 168-216 GiB). A 4B turn of 6,144 tokens is scored whole whatever micro_tokens says. On these
# cards grpo.activation_checkpointing auto keeps every layer's activations of those 6,144 tokens
# (0.6B 9.0 GiB, 1.7B 14.3, 4B 27.7: under each rollout's KV cache, so the peak is unchanged).
_STUDY_CARDS = {"rollout": {"max_batch": 48}, "grpo": {"micro_tokens": 6144}}
_PAPER_MODEL = {"dtype": "bfloat16", "model": {"name": "Qwen/Qwen3-1.7B"}, **_STUDY_CARDS}

# The tiny world's: what trains on a CPU in minutes (the studies under docs/results ran with it).
# Per-role credit: with the paper's broadcast credit Voting gained +3 points in 24 steps, with
# role credit +8.
_TINY: dict[str, Any] = {
    "steps": 24,
    "val_every": 8,
    "ckpt_every": 8,
    "model": {"name": "tiny-s"},
    "task": {"val_size": 500},
    "rollout": {"temperature": 0.7, "max_new_tokens": 96},
    "grpo": {"batch_problems": 16, "group_size": 8, "minibatch_turns": 64, "credit": "role"},
    "optim": {"lr": 1e-3, "warmup_steps": 3, "grad_clip": 1.0},
    "policy": {"lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.0},
    PER_TASK: {
        # The tiny code world: 200 validation problems (grading runs every program in the
        # sandbox, ~20 ms of a core each); a tiny code answer is at most ~100 characters, a
        # synthesizer's ~120, so 128 new tokens.
        "code": {"task": {"val_size": 200}, "rollout": {"max_new_tokens": 128}},
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    # The paper's text. Response caps are per (workflow, task): the default 5120 is math's; set
    # rollout.max_new_tokens to 2048 for code.
    "paper": dict(_PAPER_MODEL),
    # The official code: the paper preset with every switch of SWITCHES at its official value.
    "official": {
        **_PAPER_MODEL,
        "grpo": {
            **_STUDY_CARDS["grpo"],
            "minibatch_unit": "prompts",
            "advantage_scope": "trajectory",
            "clip_ratio_c": 3.0,
        },
        "optim": {"schedule_stepping": "shared-uncapped"},
        "workflow": {
            "parse": "first-match",
            "rounds_count": "judge-calls",
            "workers": "parsed",
            "context": "conversation",
            "prompts": "official",
        },
        "task": {"format_penalty": 0.0, "split_rule": "permutation", "split_seed": 42},
        PER_TASK: {
            "code": {
                "task": {
                    "code_reward": "all_pass",
                    "code_block": "last-block",
                    "code_timeout_s": 3.0,
                }
            },
        },
    },
    "tiny": _TINY,
    # The quickstart's: the tiny preset on a tiny-s world pre-trained with half the tokens of the
    # full recipe (8 examples x 4800 steps instead of 64 x 1200, which reached the same greedy
    # accuracy, 0.545 on 200 problems), for 12 steps with 1 warm-up step, so that a cold quickstart
    # fits 5 minutes on 2 cores. 12 steps, not 8: over three seeds on two kernel sets the best
    # Voting cell gained +4.6 to +9.0 points in 8 steps and +8.2 to +9.8 in 12, where the curves
    # were still rising at step 8 (measured: docs/benchmarks/quickstart.md). It validates at steps 0
    # and 12 only: a middle validation cost every trained cell a third of its validation time, which
    # held to AVX2 put the cold quickstart over 2 minutes (121.5 s), and every trained Voting cell
    # of 3 seeds x 3 kernel settings peaked at step 12 (the single-agent control of seed 2 peaked at
    # step 6: 0.512, then 0.498; the same page). Code runs as under the tiny preset (its own world,
    # full recipe).
    "quickstart": {
        **_TINY,
        "steps": 12,
        "val_every": 12,
        "ckpt_every": 6,
        "model": {"name": "tiny-s", "pretrain_batch": 8, "pretrain_steps": 4800},
        "optim": {**_TINY["optim"], "warmup_steps": 1},
        PER_TASK: {
            "code": {
                **_TINY[PER_TASK]["code"],
                "steps": _TINY["steps"],
                "val_every": _TINY["val_every"],
                "ckpt_every": _TINY["ckpt_every"],
                "model": {"pretrain_batch": None, "pretrain_steps": None},
                "optim": _TINY["optim"],
            }
        },
    },
}
"""Every run preset, in one place: a preset's settings, and under :data:`PER_TASK` the settings
it adds for one ``task.name`` (merged over its own, under the run's file and overrides)."""


@dataclass(frozen=True)
class Switch:
    """One config field on which the study's text and its official code differ."""

    key: str  # dotted config field
    what: str
    paper: str  # where the paper's value comes from
    official: str  # where the official code's value comes from (a file of that repository)


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "grpo.minibatch_unit",
        "what the PPO mini-batch size of 64 counts",
        "Table 7 (PPO mini-batch size 64; the unit is not stated, read as turns)",
        "rllm/trainer/config/multi_agent_ppo_trainer.yaml (ppo_mini_batch_size: 64 prompts; "
        "verl multiplies by n = 8: 512 turns per update)",
    ),
    Switch(
        "optim.schedule_stepping",
        "how the cosine schedule advances under several adapters",
        "Table 7 (cosine with 15 warmup steps over 500 steps)",
        "inferred from the verl fork: one scheduler stepped in every per-role update call, "
        "verl's cosine not capped past the end",
    ),
    Switch(
        "grpo.advantage_scope",
        "the group a reward is normalised in",
        "§3 (the relative advantage within each problem's group of n rollouts)",
        "rllm/engine/agent_workflow_engine.py (group id: task id and trajectory name, one item "
        "per turn)",
    ),
    Switch(
        "workflow.parse",
        "how a verdict or a selection is read",
        "§A.7 (the terminal \\boxed{} expression)",
        "examples/math_reasoning/voting_math_workflow.py (first \\boxed{N}, else the first "
        "digit 1-9), evaluator_optimizer_math_workflow.py (first \\boxed{Correct|Incorrect})",
    ),
    Switch(
        "workflow.rounds_count",
        "what Eval-Opt's round count counts",
        "Table 7 (Eval-Opt revision rounds: math 3, code 2)",
        "rllm/workflows/evaluator_optimizer_workflow.py (max_iterations counts evaluator calls: "
        "G E G E G E; the evaluator also reviews the last revision)",
    ),
    Switch(
        "workflow.context",
        "what an Eval-Opt call sees",
        "§3.1 (the evaluator reviews the answer; the generator revises with the critique)",
        "rllm/workflows/evaluator_optimizer_workflow.py (share_conversation_history: the first "
        "prompt and every earlier output as assistant turns, then the call's own prompt)",
    ),
    Switch(
        "workflow.prompts",
        "the chat prompt set (marlow/prompts/sets/)",
        "§3.1 and Appendix A (what each role is asked to do; marlow's own wording)",
        "examples/math_reasoning/prompt.json, examples/deepcoder/prompt.json (the reviser is "
        "told to use a different approach; the evaluator reviews the solution above; at most "
        "n strategies), rewritten in marlow's words",
    ),
    Switch(
        "workflow.workers",
        "how many Orch-Workers workers run",
        "Table 7 (Orch-Workers worker proposals per problem: 3)",
        "examples/math_reasoning/orchestrator_workers_math_workflow.py (parse_proposals: one "
        "worker per parsed strategy, at most 3)",
    ),
    Switch(
        "grpo.clip_ratio_c",
        "dual-clip of negative advantages",
        "Table 7 (PPO clip; no dual-clip named)",
        "rllm/trainer/config/_generated_agent_ppo_trainer.yaml (clip_ratio_c: 3.0)",
    ),
    Switch(
        "task.format_penalty",
        "reward of a math answer without a parseable box",
        "§A.7 (a small format-error penalty; marlow: -0.1)",
        "rllm/rewards/reward_types.py (format_error_reward: 0.0)",
    ),
    Switch(
        "task.split_rule",
        "how a dataset is split into train and held-out problems",
        "Table 3 (validation on 1412 dapo_math problems: a 10 % held-out split; the rule is not "
        "stated; marlow: by id hash)",
        "examples/math_reasoning/prepare_dapo_math_data.py (datasets' train_test_split, "
        "test_size 0.1), examples/deepcoder/prepare_deepcoder_data.py (shuffle, the first 1000 "
        "held out)",
    ),
    Switch(
        "task.split_seed",
        "the seed of that split",
        "not stated (marlow: 0)",
        "the same two files (seed=42)",
    ),
    Switch(
        "task.code_reward",
        "code reward: pass rate or all tests",
        "§A.7 (the fraction of tests that pass)",
        "rllm/rewards/code_reward.py (all_passed: 1 only when every test passes)",
    ),
    Switch(
        "task.code_block",
        "which code of a completion runs",
        "§A.7 (the terminal Python code block)",
        "rllm/rewards/code_reward.py (extract_code_from_model: the last fenced block, none: 0)",
    ),
    Switch(
        "task.code_timeout_s",
        "seconds per hidden test",
        "§A.7 (a per-test execution timeout; value not stated; marlow: 6)",
        "rllm/rewards/batch_code_executor.py (per_test_timeout: 3)",
    ),
)
"""Every field on which ``paper`` and ``official`` differ, with the source of each value."""
