"""The run config's schema: every section and field, with its type, default, bounds and
description, validated once (pydantic). How a config is assembled from a preset, a file and
overrides: :mod:`marlow.config.loading`.

Choices the paper does not fix, made here and recorded in each run's config:

* ``optim.weight_decay`` 0.01 and AdamW betas (0.9, 0.999): verl's actor defaults.
* ``rollout.val_temperature`` defaults to the training temperature (verl's default is greedy, but
  greedy voters are identical copies and would make Voting's validation meaningless). Every
  validation of a run samples with one fixed seed, so checkpoints are compared on the same draws
  as far as their policies agree. Validation uses n = 1.
* The cosine schedule decays to 0 at ``steps`` and stays there past it.
* ``device`` is checked here for its form only (``auto``, ``cpu``, ``cuda``, ``cuda:N``,
  ``mps``): a config written on a GPU machine stays readable on a laptop (``marlow report``,
  ``inspect``). Whether the device exists is checked where the run starts, before anything is
  loaded or written (:func:`marlow.models.resolve_device`).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from marlow.choices import (
    AdvantageScope,
    BuiltinTask,
    CodeBlockRule,
    ParseRule,
    RoutingKind,
    SandboxRequire,
    ScheduleStepping,
    TaskFamily,
    World,
)

BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
"""The bounds a field may declare, as a user reads them."""


class ConfigError(ValueError):
    """A config problem, in one line that names the field and the valid choices."""


def _on_off(value: Any) -> Any:
    """YAML reads ``on`` and ``off`` as booleans (``grpo.fold_lora=off`` on the command line):
    for a switch they are its ``on`` and ``off``."""
    return ("on" if value else "off") if isinstance(value, bool) else value


MICRO_TOKENS_OFF_CUDA = 8192
"""``grpo.micro_tokens=auto`` off CUDA, and wherever no card sized it (an ``auto`` handed straight
to the scoring functions): on a 2-core CPU, 8,192 and 4,096 gave the same update and 65,536 a
third slower (``bench/micro_tokens.py``: large buffers cost more to allocate and touch there
than their arithmetic). A trainer on CUDA sizes it to the card
(:func:`marlow.plan.auto_micro_tokens`)."""

Switch = Annotated[Literal["auto", "on", "off"], BeforeValidator(_on_off)]
"""A setting that is ``auto`` (marlow decides, its description says how), ``on`` or ``off``."""


class _Section(BaseModel):
    # Non-finite numbers (nan, inf) are refused in every float field: an inf learning rate
    # would train one step of non-finite adapters before anything noticed.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """The base model: a tiny scale marlow ships or pre-trains, or a Hugging Face model."""

    name: str = Field(
        "tiny-s", description="a tiny scale (tiny-s, tiny-m, tiny-l) or an HF id/path"
    )
    pretrain_steps: int | None = Field(
        None, ge=1, description="tiny scales: override pretraining steps"
    )
    pretrain_batch: int | None = Field(
        None, ge=1, description="tiny scales: examples per pretraining step (default 64)"
    )
    world: World = Field(
        "auto",
        description="tiny scales: auto (the world marlow ships for this recipe, else pre-train it "
        "into the cache), shipped (a shipped world or an error), rebuild (pre-train it on this "
        "machine into the cache, never the shipped one)",
    )

    @field_validator("name")
    @classmethod
    def _named(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("is empty; valid: tiny-s, tiny-m, tiny-l, a hub id or a folder")
        return v


BUILTIN_TASKS: tuple[str, ...] = get_args(BuiltinTask)
"""The tasks marlow grades itself; ``custom`` is a task of one's own file and reward."""
MATH_DATASETS = ("gsm8k", "math500", "dapo")
CODE_DATASETS = ("humaneval", "deepcoder")
DEEPCODER_SUBSETS = ("primeintellect", "taco", "lcbv5", "codeforces")
"""The DeepCoder configurations ``task.subset`` names (the loader in ``marlow.tasks`` reads these)."""


class TaskConfig(_Section):
    """The task: its problems (a built-in dataset or a file of your own), their split into
    training and validation, and how an answer is graded."""

    name: str = Field(
        "math",
        description="math or code (marlow's own data formats and graders), custom (your own "
        "file and reward: task.source, task.prompt_field, task.reward; the default when "
        "task.reward is set), or a task an installed package publishes (marlow tasks)",
    )
    family: TaskFamily | None = Field(
        None,
        description="which templates of the prompt set the roles read, and on a tiny model which "
        "tiny world: math, code or general (chat models only); None: the task's own (custom: "
        "general on a chat model, math on a tiny one)",
    )
    source: str = Field("tiny", description="tiny, or a .jsonl/.jsonl.gz/.parquet path or hub id")
    dataset: str | None = Field(
        None,
        description="the source's format: gsm8k, math500 or dapo (math); humaneval or "
        "deepcoder (code)",
    )
    subset: str | None = Field(
        None, description=f"deepcoder only: one of {', '.join(DEEPCODER_SUBSETS)}"
    )
    hub_config: str | None = Field(
        None,
        description="dapo only: the hub dataset's config (None: all; the official code: en, "
        "the English problems)",
    )
    split_seed: int = Field(0, description="seed of the fixed train/validation split of a dataset")
    split_rule: Literal["hash", "permutation"] = Field(
        "hash",
        description="how a dataset is split: hash (by each problem id's hash with split_seed; "
        "independent of row order) or permutation (the datasets library's train_test_split / "
        "shuffle: numpy's permutation of the rows under split_seed, the first held out; the "
        "official code, seed 42)",
    )
    holdout: int | float | None = Field(
        None,
        description="the problems held out of training: a count, or a fraction in (0, 1) "
        "rounded up (the official code: 0.1 of DAPO, 1000 of DeepCoder); None: val_size, or "
        "none when val_source is set; validation is the held-out part's first val_size unless "
        "val_source is set",
    )
    runtime_filter: str | None = Field(
        None,
        description="deepcoder only: a runtime-results JSON ({row: {test: {status}}}); each "
        "row keeps the tests marked passed, a row with none leaves the dataset (the official "
        "code's coding_dataset_filtering/runtime_results.json)",
    )
    val_source: str | None = Field(
        None,
        description="validate on this file or hub id instead of a split of task.source (its "
        "first val_size problems; the official code: AIME-2025 for math), read as val_dataset; "
        "the training source is then used whole",
    )
    val_dataset: str | None = Field(None, description="the format of val_source (as dataset)")
    val_size: int = Field(
        500, ge=1, description="validation problems: the held-out part's (or val_source's) first"
    )
    format_penalty: float = Field(-0.1, le=0.0, description="math: reward of an unboxed answer")
    code_timeout_s: float | None = Field(
        None, gt=0.0, description="code: seconds per hidden test; None: 2 (tiny), 6 (datasets)"
    )
    code_reward: Literal["pass_rate", "all_pass"] = Field(
        "pass_rate",
        description="code: the fraction of hidden tests passed (the paper's text), or 1 only "
        "when all pass (the official code)",
    )
    code_block: CodeBlockRule = Field(
        "fallback",
        description="code: which code runs: fallback (the last python block, else the last "
        "block, else the whole completion if it parses) or last-block (the last fenced block, "
        "none: 0; the official code)",
    )
    strict: bool = Field(
        False,
        description="a dataset row the loader would skip (bad JSON, a missing field, a "
        "duplicate...) is an error instead of a counted skip",
    )
    prompt_field: str | None = Field(
        None, description="custom: the column whose text fills {problem}; None: prompt"
    )
    answer_field: str | None = Field(
        None, description="custom: the column holding the gold answer (optional)"
    )
    id_field: str | None = Field(
        None,
        description="custom: the column holding each row's id; None: id when the file has it, "
        "else a hash of the row",
    )
    reward: str | None = Field(
        None,
        description="custom: the reward function, package.module:function or "
        "path/to/file.py:function (docs/tasks.md)",
    )
    reward_form: Literal["trl", "verl"] = Field(
        "trl",
        description="custom: the reward's contract: trl (f(prompts, completions, **columns) -> "
        "list of float or None, sync or async) or verl (compute_score(data_source, "
        "solution_str, ground_truth, extra_info), per item)",
    )
    reward_timeout_s: float = Field(
        60.0, gt=0.0, description="custom: seconds one reward call may take; longer: no reward"
    )
    reward_max_missing: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="custom: the share of a step's episodes without a reward (None, NaN, an "
        "error, a timeout) above which the run stops",
    )
    correct_threshold: float = Field(
        1.0,
        description="an episode is correct (accuracy, pass@N, majority, a verdict's credit) "
        "when its reward is at least this (the built-in graders give 1.0 for a right answer)",
    )

    @property
    def custom(self) -> bool:
        """Whether the task is one's own data and reward (``custom``, or an installed task)."""
        return self.name not in BUILTIN_TASKS

    def family_for(self, tiny: bool) -> str:
        """The template family (and tiny world) of this task on a tiny model or a chat model."""
        if self.family is not None:
            return self.family
        if self.custom:
            return "math" if tiny else "general"
        return self.name

    @model_validator(mode="after")
    def _dataset_fits_source(self) -> TaskConfig:
        if self.custom:
            return self._custom_fits()
        custom_only = ("prompt_field", "answer_field", "id_field", "reward")
        given = [k for k in custom_only if getattr(self, k) is not None]
        if given:
            raise ValueError(
                f"task.{given[0]} is for task.name custom (your own file and reward); task.name "
                f"is {self.name}, which reads its own formats (task.dataset)"
            )
        if self.family not in (None, self.name):
            raise ValueError(
                f"task.family is {self.family} but task.name is {self.name}; valid: "
                f"{self.name}, or task.name custom"
            )
        valid = MATH_DATASETS if self.name == "math" else CODE_DATASETS
        if self.source == "tiny":
            if self.dataset is not None:
                raise ValueError(
                    "task.dataset is only for a file or hub source; task.source is tiny"
                )
            from marlow.tiny import codegen, mathgen  # stdlib only: config stays light

            most = (codegen if self.name == "code" else mathgen).MAX_VAL
            if self.val_size > most:
                raise ValueError(
                    f"task.val_size is {self.val_size}; the tiny {self.name} world has at most "
                    f"{most} validation problems"
                )
        elif self.dataset not in valid:
            raise ValueError(
                f"task.dataset is {self.dataset!r} for task {self.name} and source "
                f"{self.source!r}; valid: {', '.join(valid)}"
            )
        if self.dataset == "deepcoder" and self.subset not in DEEPCODER_SUBSETS:
            raise ValueError(
                f"task.subset is {self.subset!r} for deepcoder; valid: "
                f"{', '.join(DEEPCODER_SUBSETS)}"
            )
        if self.subset is not None and self.dataset != "deepcoder":
            raise ValueError("task.subset is only for task.dataset deepcoder")
        if self.hub_config is not None and self.dataset != "dapo":
            raise ValueError("task.hub_config is only for task.dataset dapo")
        if self.runtime_filter is not None and self.dataset != "deepcoder":
            raise ValueError("task.runtime_filter is only for task.dataset deepcoder")
        if self.holdout is not None and self.source == "tiny":
            raise ValueError("task.holdout is only for a dataset source; task.source is tiny")
        self._check_holdout()
        if self.val_source is None and self.val_dataset is not None:
            raise ValueError("task.val_dataset is only read with task.val_source")
        if self.val_source is not None:
            if self.source == "tiny":
                raise ValueError("task.val_source needs a dataset source; task.source is tiny")
            if self.val_dataset not in valid or self.val_dataset == "deepcoder":
                choices = [d for d in valid if d != "deepcoder"]
                raise ValueError(
                    f"task.val_dataset is {self.val_dataset!r} for val_source "
                    f"{self.val_source!r}; valid: {', '.join(choices)}"
                )
        return self

    def _custom_fits(self) -> TaskConfig:
        if self.reward is None:
            raise ValueError(
                f"task.name is {self.name} but task.reward is not set; valid: "
                "package.module:function or path/to/file.py:function"
            )
        if self.source == "tiny":
            raise ValueError(
                f"task.name is {self.name} but task.source is tiny; give your data: a .jsonl, "
                ".jsonl.gz or .parquet file, or a hub id"
            )
        builtin_only = ("dataset", "subset", "hub_config", "runtime_filter", "val_dataset")
        given = [k for k in builtin_only if getattr(self, k) is not None]
        if given:
            raise ValueError(
                f"task.{given[0]} is for the built-in math and code tasks; a custom task reads "
                "its columns (task.prompt_field, task.answer_field, task.id_field)"
            )
        self._check_holdout()
        return self

    def _check_holdout(self) -> None:
        if isinstance(self.holdout, float) and not 0.0 < self.holdout < 1.0:
            raise ValueError(f"task.holdout is {self.holdout}; a fraction must be in (0, 1)")
        if isinstance(self.holdout, int) and self.holdout < 1:
            raise ValueError(f"task.holdout is {self.holdout}; a count must be >= 1")


class WorkflowConfig(_Section):
    """The workflow the roles run: which one, its count parameters, and how its prompts and
    verdicts are read.

    The name and parameters are checked against the workflow registry where workflows are built
    (:func:`marlow.workflows.validate.check_run_config`, run before anything is loaded or written),
    not here: config stays below the workflows layer."""

    name: str = Field(
        "voting",
        description="a built-in workflow (single, eval_opt, voting, orch_workers; marlow "
        "workflows lists them) or the path of a workflow file (.yaml, docs/workflows.md)",
    )
    params: dict[str, int] = Field(default_factory=dict, description="e.g. {n: 3} or {rounds: 3}")
    rounds_count: Literal["revisions", "judge-calls"] = Field(
        "revisions",
        description="what a repeat count counts: revisions (Eval-Opt rounds 3: G E G E G E G) "
        "or judge-calls (the official code: G E G E G E, the last verdict trained; "
        "marlow.workflows.load.ROUNDS_COUNTS)",
    )
    workers: Literal["fixed", "parsed"] = Field(
        "fixed",
        description="Orch-Workers: fixed (always n workers; a missing strategy gets a generic "
        "one) or parsed (one worker per strategy the official code's parser finds, 1..n)",
    )
    context: Literal["latest", "conversation"] = Field(
        "latest",
        description="what a call sees: latest (its own prompt, whose reads carry the latest "
        "answer and critique) or conversation (the episode's chat so far first, in a workflow "
        "whose file allows it: Eval-Opt, the official code's shared history)",
    )
    prompts: str = Field(
        "marlow",
        description="the chat prompt set: marlow, official (the official code's protocol in "
        "marlow's words) or the path of a prompt-set file (.yaml, marlow/prompts/sets/); a tiny "
        "model always reads the tiny set it was pre-trained on",
    )
    parse: ParseRule = Field(
        "last-box",
        description="how a verdict or a selection is read: last-box (the last \\boxed{}) or "
        "first-match (the official code's first match, marlow.parsers.PARSE_RULES)",
    )
    tool_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="the most seconds one call of a tool stage may take; a call past it gives "
        "the next role a line saying so, and is counted",
    )


class PolicyConfig(_Section):
    """Which LoRA adapter each role samples and trains (one per role, one shared, a map),
    and the adapters' shape."""

    routing: RoutingKind = Field(
        "ip",
        description="which LoRA adapter each role samples and trains: ip (one per role), sp (one "
        "shared by every role), map (policy.role_map's), base (none: the base model, no "
        "training)",
    )
    role_map: dict[str, str] | None = Field(
        None,
        description="routing map: role -> adapter name, naming every role of the workflow (roles "
        "given one name share that adapter)",
    )
    lora_rank: int = Field(64, ge=1, description="LoRA rank r of every adapter (paper: 64)")
    lora_alpha: int = Field(
        32, ge=1, description="LoRA alpha; the update is scaled by alpha / rank (paper: 32)"
    )
    lora_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="dropout on the LoRA input while training (paper: 0)"
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="the base's modules that get LoRA: all-linear (every linear layer but the "
        "output head), or a list of module names (e.g. [q_proj, v_proj])",
    )

    @model_validator(mode="after")
    def _map_needs_role_map(self) -> PolicyConfig:
        if self.routing == "map" and not self.role_map:
            raise ValueError(
                "policy.routing is 'map' but policy.role_map is empty; give role -> adapter "
                "(e.g. {generator: gen, aggregator: __base__}) or use routing sp, ip or base"
            )
        if self.routing != "map" and self.role_map:
            raise ValueError(
                f"policy.role_map is only read with policy.routing=map (routing is "
                f"{self.routing!r}); valid: drop role_map, or set policy.routing=map"
            )
        return self


class VLLMConfig(_Section):
    """The vLLM engine, used when rollout.backend is vllm.

    :mod:`marlow.rollout.vllm` reads it."""

    kv_cache_gib: float = Field(
        1.0,
        gt=0.0,
        description="memory for vLLM's KV cache, in GiB (CPU RAM on the CPU build, GPU memory on "
        "CUDA); it must hold at least one max_model_len sequence",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="the longest prompt + completion vLLM serves; None: the base model's "
        "max_position_embeddings",
    )
    max_lora_rank: int | None = Field(
        None,
        ge=1,
        description="the largest LoRA rank vLLM reserves for; None: the smallest of vLLM's "
        "sizes (8, 16, 32, 64, 128, 256, 320, 512) that holds policy.lora_rank",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one engine spans (CUDA only)")
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="CPU build only: cores 0..N-1 run the engine's OpenMP threads; None: every "
        "core (the trainer waits while the engine samples; vLLM's own choice would leave one "
        "core idle)",
    )
    enforce_eager: bool | None = Field(
        None,
        description="run the model without torch.compile / CUDA graphs; None: eager on the CPU "
        "(compiling costs minutes of start-up there), compiled on CUDA",
    )


class RolloutConfig(_Section):
    """How episodes are sampled: the backend, temperatures, token limits, batching and the
    sampler's speed switches."""

    backend: str = Field(
        "hf",
        description="hf: marlow's own sampling loop over the training model; vllm: a vLLM "
        "engine in its own processes, serving every adapter per request (make install-vllm; "
        "pip install vllm on CUDA); or a backend registered with "
        "marlow.rollout.register_backend (checked when a run starts)",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    temperature: float = Field(
        0.7, gt=0.0, description="sampling temperature of the training rollouts (paper: 0.7)"
    )
    val_temperature: float | None = Field(
        None, ge=0.0, description="None: the training temperature; 0: greedy"
    )
    max_new_tokens: int = Field(
        5120, ge=1, description="the most tokens one turn may sample; a longer turn is cut there"
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="an episode whose next call's prompt is longer ends there (its later "
        "stages do not run; counted prompt_cap); None: no cap (Table 7's per-workflow caps: "
        "e.g. 20480 for Voting math)",
    )
    max_batch: int = Field(
        256, ge=1, description="the most sequences one sampling call of the engine holds at once"
    )
    merge_lora: Switch = Field(
        "auto",
        description="sample each adapter with its LoRA folded into a copy of the base weights "
        "(one matmul per layer instead of three), through marlow's lean forward on Qwen3 "
        "bases (marlow.rollout.lean: the same logits with less Python); auto: on for a float32 "
        "base on the CPU, off elsewhere (the copy costs GPU memory; bfloat16 rounds the sum)",
    )
    compile: Switch = Field(
        "auto",
        description="the sampler's decode step at fixed shapes (a static KV cache, batches "
        "padded to a few sizes), its layers through torch.compile and on CUDA the step replayed "
        "from CUDA graphs, its attention by SDPA over the cache's columns (masked), on Qwen3 "
        "bases (marlow.rollout.lean); auto: on for CUDA, off on the "
        "CPU (bench/lean_lora.py: there the compilation costs more than it saves in a run's "
        "calls)",
    )
    refill: Switch = Field(
        "auto",
        description="the hf backend, in a sampling call of more rows than max_batch on Qwen3 "
        "bases (marlow.rollout.lean): rows that stop make room for the waiting ones (prefilled "
        "into their places) instead of each batch of max_batch running until its longest row "
        "ends; the same distribution, but call-seeded rows then draw other random numbers; "
        "auto: on where the decode step is compiled (CUDA by default), off elsewhere, which "
        "keeps the shipped quickstart's figures (bench/refill.py measures both ways; vLLM "
        "batches continuously itself)",
    )
    seeding: Literal["auto", "call", "request"] = Field(
        "auto",
        description="call: a stage's samples come from one generator in request order; request: "
        "each request has its own seed, so a sample does not depend on its batch or rank (data "
        "parallel runs need it; the same run on one process then samples the same tokens); "
        "auto: request under several processes (torchrun), call otherwise; a run records the "
        "value it resolved to (marlow.training.distributed.resolve_seeding)",
    )


class GRPOConfig(_Section):
    """The GRPO update: batch and group sizes, clipping, the loss and its aggregation,
    mini-batches, credit and advantages."""

    batch_problems: int = Field(64, ge=1, description="B: problems per step (paper: 64)")
    group_size: int = Field(8, ge=2, description="n: episodes per problem (paper: 8)")
    clip_low: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="the importance ratio is clipped below at 1 - clip_low (paper: 0.2)",
    )
    clip_high: float = Field(
        0.28,
        ge=0.0,
        description="the importance ratio is clipped above at 1 + clip_high (paper: 0.28, "
        "DAPO's clip-higher)",
    )
    aggregation: str = Field(
        "seq-mean-token-mean",
        description="how per-token losses become one loss: seq-mean-token-mean (each turn's "
        "token mean, averaged over turns), token-mean (over every token of the mini-batch) or "
        "seq-mean-token-sum (each turn's token sum, averaged over turns)",
    )
    minibatch_turns: int = Field(
        64,
        ge=1,
        description="M: the mini-batch of one optimizer update (paper: 64), counted in "
        "minibatch_unit",
    )
    minibatch_unit: Literal["turns", "prompts"] = Field(
        "turns",
        description="turns: an update takes M turns (marlow); prompts: M prompts' worth, "
        "M x group_size turns (verl's ppo_mini_batch_size, the official code: 512 turns)",
    )
    epochs: int = Field(
        1, ge=1, description="passes over a step's rollouts, each in mini-batches (paper: 1)"
    )
    eps: float = Field(
        1e-6, ge=0.0, description="added to the group std, not the variance (verl: 1e-6)"
    )
    policy_loss: str = Field(
        "ppo-clip",
        description="the per-token policy loss, by name (marlow.algo.policy_loss): ppo-clip "
        "(PPO's clipped surrogate with clip-higher, the truncated importance weight and the KL "
        "anchor when set); register_policy_loss adds one",
    )
    clip_ratio_c: float | None = Field(
        None,
        gt=1.0,
        description="dual-clip (Ye et al. 2020; verl's clip_ratio_c, 3.0 there): for A < 0 the "
        "per-token loss is capped at c * |A|; None: off",
    )
    credit: Literal["broadcast", "role"] = Field(
        "broadcast",
        description="broadcast: every turn gets the episode reward (paper); role: each "
        "turn its own (marlow.workflows.role_rewards), normalised per slot",
    )
    advantage_scope: AdvantageScope = Field(
        "problem",
        description="the group a reward is normalised in: problem, (problem, role) or (problem, "
        "role, slot, round); under credit=role, problem and slot coincide (a turn's own "
        "reward is compared with its slot's); trajectory: one item per turn, grouped per "
        "(problem, trajectory name), the official code's (marlow.algo.turn_advantages)",
    )
    same_role_weighting: bool = Field(
        False, description="scale each turn by 1/N for N same-role slots"
    )
    role_weights: dict[str, float] = Field(
        default_factory=dict, description="credit: multiply a role's advantages (default 1)"
    )
    rollout_correction: Literal["off", "truncate"] = Field(
        "off",
        description="truncate: weigh each token's surrogate by min(pi_old / pi_sampler, "
        "rollout_correction_cap), the sampler's log-probs as recorded (truncated importance "
        "sampling, as verl's and TRL's rollout corrections; marlow.algo.losses): corrects a "
        "sampler whose numerics differ from the trainer's (vLLM); off: no weight",
    )
    rollout_correction_cap: float = Field(
        2.0, ge=1.0, description="C of rollout_correction=truncate (verl's default 2.0)"
    )
    fold_lora: Switch = Field(
        "auto",
        description="train each adapter with its LoRA folded into one weight per layer "
        "(x @ (W + s*B@A).T, rebuilt with gradient at every forward: one matmul instead of three "
        "and no per-token scale and sum; the same loss and gradients up to float round-off) and "
        "score its logp_old the same way; auto: on for a float32 base on the CPU, where it is "
        "faster (bench/vs_trl.py), unless grpo.compile is on, off elsewhere (on a GPU the "
        "weight-sized gradient costs more than it saves); needs plain LoRA linears without "
        "dropout",
    )
    activation_checkpointing: Switch = Field(
        "auto",
        description="keep only each decoder layer's input for the backward and run the layer "
        "again there (marlow.models.checkpoint_layers: the layer's forward without a graph, "
        "run again with one in the backward): one more forward of "
        "compute, and a micro-batch's activations shrink to a hidden state per layer plus one "
        "layer's own (marlow plan counts both); the same loss and gradients; auto: on for a "
        "Hugging Face model, whose activations dominate the learn phase's memory, except on a "
        "CUDA card where the largest forward's, every layer's kept, fit in half the memory "
        "beside the weights and adapters (the share that sizes grpo.micro_tokens; the "
        "micro-batch unchanged, the backward runs no layer twice; marlow.plan.update_settings), "
        "and off for a tiny scale, whose activations are small and whose step is compute-bound",
    )
    compile: Switch = Field(
        "auto",
        description="run the decoder layers, and the LM head's log-softmax and the update's "
        "slopes of the log-probs chunk by chunk, through torch.compile in scoring and the update "
        "(marlow.models.compile_layers: each layer's elementwise work fused into a few "
        "kernels, and the head's float32 logits never written whole; the same log-probs and "
        "gradients up to float round-off; one compilation serves every layer, one per kind of "
        "pass, shared by every adapter over a bfloat16 or float16 base, in the first steps); "
        "auto: off "
        "on every device (on a CPU the compilations cost more than a run of ordinary length "
        "wins back, bench/compile_layers.py; on a GPU its gain is not yet measured: the GPU "
        "check times it beside the eager update); on is a one-line error where "
        "grpo.fold_lora is on too (a folded layer's forward is made anew every step)",
    )
    micro_tokens: int | Literal["auto"] = Field(
        "auto",
        description="max padded tokens per forward (memory and speed, not math); auto: 8192 "
        "off CUDA (the step's buffers stay small: bench/micro_tokens.py), and on CUDA the most "
        "tokens (a multiple of 1024) whose activations (marlow plan's memory model) fit in "
        "half the card's memory beside the base weights and the adapters (and a vLLM engine's "
        "KV cache and weights: marlow.plan.engine_bytes), at most 32768 "
        "(marlow.plan.auto_micro_tokens)",
    )

    @property
    def update_turns(self) -> int:
        """Turns per optimizer update: ``minibatch_turns``, times ``group_size`` when the unit is
        prompts."""
        return self.minibatch_turns * (self.group_size if self.minibatch_unit == "prompts" else 1)

    @field_validator("micro_tokens", mode="before")
    @classmethod
    def _micro_tokens(cls, v: Any) -> Any:
        if v == "auto" or (type(v) is int and v >= 1):
            return v
        raise ValueError(f"must be auto or a whole number of tokens >= 1, got {v!r}")

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss(cls, v: str) -> str:
        from marlow.algo.policy_loss import POLICY_LOSSES  # torch: imported where one is named

        if v not in POLICY_LOSSES:
            raise ValueError(POLICY_LOSSES.unknown(v))
        return v

    @field_validator("aggregation")
    @classmethod
    def _agg(cls, v: str) -> str:
        from marlow.algo.losses import AGGREGATIONS

        if v not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {v!r}; valid: {', '.join(AGGREGATIONS)}")
        return v

    @field_validator("role_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {role: w for role, w in v.items() if w < 0}
        if bad:
            raise ValueError(
                f"role weights must be >= 0 (a negative one flips the sign), got {bad}"
            )
        return v

    @model_validator(mode="after")
    def _fold_or_compile(self) -> GRPOConfig:
        if self.fold_lora == "on" and self.compile == "on":
            raise ValueError(
                "grpo.fold_lora and grpo.compile are both on: a folded LoRA layer's forward is "
                "made anew every step, so the compiled layers would compile again every step; "
                "valid: one of them on, the other auto or off"
            )
        return self


class OptimConfig(_Section):
    """The optimizer (AdamW) and its learning-rate schedule."""

    lr: float = Field(2e-5, gt=0.0, description="AdamW's peak learning rate (paper: 2e-5)")
    warmup_steps: int = Field(
        15, ge=0, description="steps of linear warmup before the cosine decay (paper: 15)"
    )
    grad_clip: float = Field(
        1.0, gt=0.0, description="each adapter's gradient is clipped to this L2 norm (paper: 1)"
    )
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    schedule_stepping: ScheduleStepping = Field(
        "per-step",
        description="per-step: each adapter's own schedule, stepped once per step; "
        "per-role-update: one shared schedule stepped once per role update, 0 past the end; "
        "shared-uncapped: the same with verl's cosine, which rises again past the end (the "
        "official code)",
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(
                f"each beta must be in [0, 1), got {list(v)}; AdamW default: 0.9, 0.999"
            )
        return v


class DetectConfig(_Section):
    """The online detectors: the thresholds at which they fire while a run goes, on early signs
    of a terminal cliff, gradient amplification or role capture, and what a run does then.

    The report's after-the-fact labels keep their own, larger thresholds on purpose
    (``marlow.report.evidence.labels``, above ``CLIFF_DROP``)."""

    cliff_drop: float = Field(0.05, gt=0.0, lt=1.0, description="terminal_cliff: drop below peak")
    cliff_patience: int = Field(2, ge=1, description="terminal_cliff: validations below the line")
    amp_rise: float = Field(
        3.0,
        gt=1.0,
        description="gradient_amplification: peak-over-first ratio of a multi-slot role",
    )
    amp_flat: float = Field(
        1.5, gt=1.0, description="gradient_amplification: ratio every single-slot role stays under"
    )
    amp_window: int = Field(
        3,
        ge=1,
        description="gradient_amplification: values in the running median the ratios are "
        "taken on (1: the raw series)",
    )
    capture_share: float = Field(
        0.7, gt=0.5, le=1.0, description="sp_role_capture: gradient-mass share of the dominant role"
    )
    capture_patience: int = Field(
        2, ge=1, description="sp_role_capture: consecutive steps the share stays above the line"
    )
    capture_shift: float = Field(
        0.2, gt=0.0, le=1.0, description="sp_role_capture: change of a signature rate that counts"
    )
    capture_close: float = Field(
        0.5, gt=0.0, le=1.0, description="sp_role_capture: fraction of the length gap closed"
    )
    on_alarm: Literal["warn", "stop", "rollback"] = Field(
        "warn",
        description="warn: log and go on; stop: checkpoint and end the run; rollback: restore "
        "the best-validation checkpoint and end the run",
    )


class DiagnosticsConfig(_Section):
    """The diagnostics a run computes beside its loss: how often the update's chi2 and the KL
    to the base are taken, and on how many problems the trajectory signatures."""

    every: int = Field(
        5,
        ge=1,
        description="run chi2_update and kl_to_base on steps 1, 1+every, 1+2*every, ... "
        "(each one extra forward per turn on those steps; kl_to_base none where "
        "mitigate.kl_coef scored the base)",
    )
    kl_to_base: bool = Field(
        True,
        description="on diagnostics steps, score the tokens with the adapters disabled (or read "
        "the base log-probs mitigate.kl_coef scored)",
    )
    signature_problems: int = Field(
        100, ge=1, description="validation problems the trajectory signatures are computed on"
    )


class SinksConfig(_Section):
    """Where metrics go besides metrics.jsonl: TensorBoard and Weights & Biases."""

    tensorboard: bool = Field(False, description="also write TensorBoard event files (extra: tb)")
    wandb: bool = Field(False, description="also log to Weights & Biases (extra: wandb)")
    wandb_project: str = Field("marlow", description="the Weights & Biases project (sinks.wandb)")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline needs no network; `wandb sync` uploads later"
    )


class TrainConfig(_Section):
    """The training loop's safeguards: skipped non-finite updates, and the checkpoints kept."""

    max_nonfinite: int = Field(
        3,
        ge=1,
        description="consecutive steps an adapter's update may be skipped for a non-finite loss "
        "or gradient before the run stops (its last good checkpoint kept)",
    )
    keep_checkpoints: int | None = Field(
        2,
        ge=2,
        description="checkpoints kept (the newest ones, plus the best validation's); "
        "null keeps every one",
    )


class MitigateConfig(_Section):
    """Mitigations of the study's failure modes, each off by default and recorded with the run.

    docs/mitigations.md gives each one's reference. Agent-wise advantage normalisation (Dr. MAS,
    Feng et al. 2026) is not here: it is ``grpo.advantage_scope=role`` (each agent's turns of a
    problem normalised with their own mean and std) or ``slot``."""

    role_balance: bool = Field(
        False,
        description="under a shared adapter, rescale each role's gradient in every update so "
        "that the roles contribute equal gradient mass (their mean norm each); against role "
        "capture",
    )
    kl_coef: dict[str, float] = Field(
        default_factory=dict,
        description="per role, the weight of a k3 KL(policy || base) penalty in its loss, e.g. "
        "{aggregator: 0.05}; '*' stands for every role not named; a role not named has none",
    )

    def kl_weight(self, role: str) -> float:
        """The KL penalty's weight for ``role`` (its own entry, else ``*``, else 0)."""
        return self.kl_coef.get(role, self.kl_coef.get("*", 0.0))

    coherence_threshold: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="same-role parallel slots: when the mean pairwise cosine of their gradients "
        "in an update passes this, each slot's gradient is scaled by 1 / (1 + (N - 1) c); "
        "None: off",
    )

    @field_validator("kl_coef")
    @classmethod
    def _finite_coefs(cls, v: dict[str, float]) -> dict[str, float]:
        for role, coef in v.items():
            if not math.isfinite(coef) or coef < 0:
                raise ValueError(f"mitigate.kl_coef.{role} is {coef}; valid: a finite number >= 0")
        return v


class SandboxConfig(_Section):
    """The sandbox the code reward runs programs in: the isolation a run requires."""

    require: SandboxRequire = Field(
        "none",
        description="namespaces: stop at start unless the code sandbox gets its network, PID "
        "and mount namespaces and private root (root, or unprivileged user namespaces); none: "
        "run with whatever isolation the machine allows (printed and recorded per run)",
    )


class RewardsConfig(_Section):
    """The rewards' machinery: the code reward's sandbox."""

    sandbox: SandboxConfig = SandboxConfig()


DEVICES = "auto, cpu, cuda, cuda:N, mps"
"""The device names a config may give (``device``); :func:`marlow.models.resolve_device` says
what each means on the machine."""
DEVICE_FORM = re.compile(r"auto|cpu|mps|cuda(:\d+)?")
Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)
"""The dtypes of the base weights (``dtype``); each is the name of a torch dtype."""


class RunConfig(_Section):
    """The run as a whole: the preset it starts from, its seed, device and dtype, its length,
    and how often it validates and saves; each section below configures one part of it."""

    preset: Literal["paper", "official", "tiny", "quickstart"] = Field(
        "tiny",
        description="the settings a run starts from, under its file and overrides: paper (the "
        "study's text), official (the study's released code), tiny (small, on a CPU), "
        "quickstart (the quickstart's cells); marlow diff-presets A B compares two",
    )
    seed: int = Field(
        0,
        description="seeds the run's random draws (adapter initialisation, data order, "
        "sampling); the train/validation split has its own (task.split_seed)",
    )
    device: str = Field(
        "auto",
        description=f"where every tensor of the run lives: {DEVICES} (auto: cuda if available, "
        "else mps, else cpu)",
    )
    dtype: Dtype = Field(
        "float32",
        description="the frozen base weights' dtype (and so its activations, and LoRA's "
        "arithmetic over a bfloat16/float16 base); LoRA weights, optimizer state and log-prob "
        "arithmetic stay float32; on a CPU without native bfloat16 (AVX2) a bfloat16 run "
        "computes about 4 times slower than float32, and says so when it loads the model",
    )
    steps: int = Field(
        500, ge=0, description="training steps; 0 only for an evaluation run (routing base or map)"
    )
    val_every: int = Field(
        10, ge=1, description="validate every this many steps, and at step 0 and the last step"
    )
    ckpt_every: int = Field(
        5, ge=1, description="save a checkpoint every this many steps, and at the last step"
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="torch threads; default: all cores (a machine setting: a tiny world is "
        "pre-trained with 2 threads whatever this says)",
    )
    sample_episodes: int = Field(4, ge=0, description="episodes saved as text per logged step")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    workflow: WorkflowConfig = WorkflowConfig()
    policy: PolicyConfig = PolicyConfig()
    rollout: RolloutConfig = RolloutConfig()
    grpo: GRPOConfig = GRPOConfig()
    optim: OptimConfig = OptimConfig()
    detect: DetectConfig = DetectConfig()
    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    sinks: SinksConfig = SinksConfig()
    rewards: RewardsConfig = RewardsConfig()
    train: TrainConfig = TrainConfig()
    mitigate: MitigateConfig = MitigateConfig()

    @field_validator("device")
    @classmethod
    def _device_form(cls, v: str) -> str:
        if not DEVICE_FORM.fullmatch(v):
            raise ValueError(f"unknown device {v!r}; valid: {DEVICES}")
        return v

    @model_validator(mode="after")
    def _trains_something(self) -> RunConfig:
        # steps 0 is the grid's evaluation-only cells (base and transfer controls); a run that
        # trains its own adapters with no step would only validate the untrained start.
        if self.steps == 0 and self.policy.routing in ("sp", "ip"):
            raise ValueError(
                f"steps is 0 but policy.routing={self.policy.routing} trains adapters; valid: "
                "steps >= 1 (0 only for an evaluation run with routing base or map)"
            )
        return self
