"""Every bad input a clear error, nothing left behind.

One table of bad inputs a user can type: config values, override syntax, config and data files,
data rows, models, paths and command-line flags. For each, the CLI (driven in-process with
typer's CliRunner, in a fresh folder: tests.conftest.in_process) must:

* exit with code 2 through ``SystemExit`` (no other exception: no traceback);
* print exactly one line, ``error: ...``, holding every needle of the row (the field or file it
  names and the valid choices);
* leave the folder exactly as it was: no new, removed or changed file.

Most rows fail at validation: the model loader is replaced by its fast checks (the model source)
followed by a failure of the test, so a row that slips past validation (a silent accept) fails
loudly instead of pre-training a model. Rows
marked ``model`` need the tiny model (their error comes from loading it or from what follows).
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from marlow.models import check_model_source, is_tiny
from tests.conftest import PRETRAIN_STEPS, in_process

GSM = '{"question": "1+1?", "answer": "it is #### 2"}\n'
GSM_ROWS = "".join(
    f'{{"question": "q{i}?", "answer": "#### {i}"}}\n' for i in range(12)
)  # 12 good rows
# Rows that load the model use the conftest's briefly pre-trained world (not the 1200-step one).
TINY = f"model.pretrain_steps={PRETRAIN_STEPS}"
RUN_CONFIG = f"preset: tiny\nsteps: 2\nworkflow: {{name: voting}}\nmodel: {{pretrain_steps: {PRETRAIN_STEPS}}}\n"


@dataclass
class Case:
    id: str
    args: list[str]
    needles: list[str]
    files: dict[str, str | bytes] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    model: bool = False


def train(*overrides: str) -> list[str]:
    return ["train", *overrides, "--out", "run"]


def value(id: str, override: str, *needles: str) -> Case:
    """A bad config value given as an override to ``marlow train``."""
    return Case(id, train(override), list(needles))


def data(id: str, rows: str | bytes, *needles: str, name="d.jsonl", extra=()) -> Case:
    """A dataset file for ``task.source``."""
    args = train(f"task.source={name}", "task.dataset=gsm8k", "task.val_size=2", *extra)
    return Case(id, args, list(needles), files={name: rows})


ADAPTER = "checkpoints/step_000001/adapters/generator/adapter_model.safetensors"
BAD_QWEN3 = (  # a Qwen3-0.6B's config.json with its hidden size replaced
    '{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": %s, '
    '"intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, '
    '"num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}'
)


def run_folder(checkpoint: dict[str, str | bytes] | None = None, metrics: str | None = None):
    """A run folder ``r`` with config, metrics and one checkpoint (files given may override)."""
    files: dict[str, str | bytes] = {
        "r/config.yaml": RUN_CONFIG,
        "r/metrics.jsonl": metrics or '{"step": 0, "val/all/accuracy": 0.5}\n{"step": 1}\n',
        "r/checkpoints/step_000001/DONE": "1",
        "r/checkpoints/step_000001/trainer_state.pt": b"PK\x03\x04 truncated",
        f"r/{ADAPTER}": b"\x08\x00",
    }
    files.update(checkpoint or {})
    return files


CASES: list[Case] = [
    # -- the bad inputs --------------------------------------------------------------------
    value("routing-map-without-role-map", "policy.routing=map", "policy.role_map", "sp, ip"),
    value("workflow-n-0", "workflow.params={n: 0}", "workflow.params", ">= 1"),
    value("betas-2-3", "optim.betas=[2, 3]", "optim.betas", "[0, 1)"),
    value("role-weights-unknown-role", "grpo.role_weights={critic: 2}", "critic", "generator"),
    value("eps-negative", "grpo.eps=-1", "grpo.eps", "greater than or equal to 0"),
    value("steps-0", "steps=0", "steps", ">= 1"),
    Case("out-empty", ["train", "--out", ""], ["--out", "current folder"]),
    Case("out-under-a-file", ["train", "--out", "f/run"], ["f is a file"], files={"f": "x"}),
    Case("out-is-a-file", ["train", "--out", "f"], ["--out f is a file"], files={"f": "x"}),
    value("lr-inf", "optim.lr=inf", "optim.lr", "finite", "> 0"),
    data(
        "torn-jsonl-line-strict",
        GSM_ROWS + '{"question": "torn',
        "task.strict",
        "bad_json",
        extra=("task.strict=true",),
    ),
    Case(
        "model-hub-id-not-cached-offline",
        train("model.name=someorg/not-a-cached-model"),
        ["model.name", "not in the Hugging Face cache", "HF_HUB_OFFLINE", "download"],
        env={"HF_HUB_OFFLINE": "1"},
    ),
    Case(
        "model-hub-id-not-cached",
        train("model.name=someorg/not-a-cached-model-xyz"),
        ["model.name", "someorg/not-a-cached-model-xyz"],
    ),
    value("model-missing-relative-path", "model.name=./no-model", "no such folder", "hub id"),
    value("model-missing-absolute-path", "model.name=/no/such/model", "no such folder"),
    value("model-missing-home-path", "model.name=~/no-such-model-x", "no such folder"),
    value("model-not-an-id", "model.name=not a model", "neither a folder nor a hub id"),
    *(
        Case(
            f"{command}-model-folder-{what}",
            train("model.name=./m") if command == "train" else ["plan", "model.name=./m"],
            ["model.name", needle],
            files={"m/config.json": config},
            model=command == "train",  # the real loader reads the folder
        )
        for command in ("train", "plan")
        for what, config, needle in (
            ("config-not-json", '{"model_type": "qwen3"', "not a valid JSON file"),
            ("config-field-of-a-wrong-type", BAD_QWEN3 % '"big"', "hidden_size"),
            ("config-negative-size", BAD_QWEN3 % "-1024", "negative"),
        )
        if (command, what) != ("train", "config-negative-size")  # train: no weights, first
    ),
    Case(
        "inspect-corrupted-metrics",
        ["inspect", "r"],
        ["metrics.jsonl", "line 1 of 2 is not JSON"],
        files=run_folder(metrics='{"step": 0, "tor\n{"step": 1}\n'),
    ),
    Case(
        "resume-missing-folder",
        ["train", "--out", "nowhere", "--resume"],
        ["nowhere"],
    ),
    Case(
        "completion-longer-than-the-model",
        train("rollout.max_new_tokens=600", TINY),
        ["rollout.max_new_tokens", "512 positions"],
        model=True,
    ),
    Case(
        "resume-truncated-trainer-state",
        ["train", "--out", "r", "--resume"],
        ["trainer_state.pt"],
        files=run_folder({f"r/{ADAPTER}": save({"w": torch.zeros(2)})}),  # a readable adapter
        model=True,
    ),
    Case(
        "resume-truncated-adapter",
        ["train", "--out", "r", "--resume"],
        ["adapter_model.safetensors"],
        files=run_folder(),
        model=True,
    ),
    Case(
        "resume-corrupted-metrics",
        ["train", "--out", "r", "--resume"],
        ["metrics.jsonl"],
        files=run_folder(metrics='{"step": 0, "tor\n{"step": 1}\n'),
    ),
    Case(
        "eval-truncated-checkpoint",
        ["eval", "r/checkpoints/step_000001"],
        ["step_000001"],
        files=run_folder(),
        model=True,
    ),
    Case(
        "wandb-online-without-network",
        train("sinks.wandb=true", "sinks.wandb_mode=online", "steps=1", "task.val_size=2", TINY),
        ["sinks.wandb_mode=online", "offline"],
        env={"WANDB_API_KEY": "", "WANDB_MODE": ""},
        model=True,
    ),
    Case(
        "unknown-target-module",
        train("policy.target_modules=[nope_proj]", "steps=1", "task.val_size=2", TINY),
        ["policy.target_modules", "q_proj"],
        model=True,
    ),
    Case(
        "existing-run-without-resume",
        ["train", TINY, "--out", "r"],
        ["r already holds a run", "--resume"],
        files=run_folder(),
        model=True,
    ),
    # -- numbers: non-finite and out of range ------------------------------------------------
    value("lr-nan", "optim.lr=nan", "optim.lr", "finite"),
    value("lr-negative", "optim.lr=-1", "optim.lr", "greater than 0"),
    value("lr-zero", "optim.lr=0", "optim.lr", "greater than 0"),
    value("lr-text", "optim.lr=fast", "optim.lr", "valid number"),
    value("eps-inf", "grpo.eps=inf", "grpo.eps", "finite"),
    value("clip-low-1.5", "grpo.clip_low=1.5", "grpo.clip_low", "less than 1"),
    value("clip-low-negative", "grpo.clip_low=-0.1", "grpo.clip_low", "greater than or equal"),
    value("clip-high-negative", "grpo.clip_high=-1", "grpo.clip_high", "greater than or equal"),
    value("clip-high-inf", "grpo.clip_high=inf", "grpo.clip_high", "finite"),
    value("clip-ratio-c-1", "grpo.clip_ratio_c=1", "grpo.clip_ratio_c", "greater than 1"),
    value("clip-ratio-c-nan", "grpo.clip_ratio_c=nan", "grpo.clip_ratio_c", "finite"),
    value("betas-one-value", "optim.betas=[0.9]", "optim.betas"),
    value("betas-negative", "optim.betas=[-0.1, 0.9]", "optim.betas", "[0, 1)"),
    value("betas-one", "optim.betas=[0.9, 1.0]", "optim.betas", "[0, 1)"),
    value("betas-inf", "optim.betas=[0.9, .inf]", "optim.betas", "finite"),
    value("weight-decay-negative", "optim.weight_decay=-0.1", "optim.weight_decay", "greater"),
    value("weight-decay-nan", "optim.weight_decay=nan", "optim.weight_decay", "finite"),
    value("grad-clip-0", "optim.grad_clip=0", "optim.grad_clip", "greater than 0"),
    value("grad-clip-inf", "optim.grad_clip=inf", "optim.grad_clip", "finite"),
    value("warmup-negative", "optim.warmup_steps=-1", "optim.warmup_steps", "greater"),
    value("schedule-stepping", "optim.schedule_stepping=daily", "optim.schedule_stepping"),
    value("temperature-0", "rollout.temperature=0", "rollout.temperature", "greater than 0"),
    value("temperature-inf", "rollout.temperature=inf", "rollout.temperature", "finite"),
    value("temperature-negative", "rollout.temperature=-1", "rollout.temperature"),
    value("val-temperature-negative", "rollout.val_temperature=-1", "rollout.val_temperature"),
    value("val-temperature-nan", "rollout.val_temperature=nan", "rollout.val_temperature"),
    value("max-new-tokens-0", "rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    value("max-batch-0", "rollout.max_batch=0", "rollout.max_batch"),
    value(
        "backend-unknown",
        "rollout.backend=sglang",
        "'rollout.backend' is 'sglang'",
        "hf, vllm",
    ),
    value("steps-negative", "steps=-5", "steps", "greater than or equal to 0"),
    value("steps-fraction", "steps=1.5", "steps", "integer"),
    value("steps-text", "steps=many", "steps", "integer"),
    value("val-every-0", "val_every=0", "val_every", "greater than or equal to 1"),
    value("ckpt-every-0", "ckpt_every=0", "ckpt_every", "greater than or equal to 1"),
    value("threads-0", "threads=0", "threads", "greater than or equal to 1"),
    value("sample-episodes-negative", "sample_episodes=-1", "sample_episodes"),
    value("seed-text", "seed=abc", "seed", "integer"),
    value("batch-problems-0", "grpo.batch_problems=0", "grpo.batch_problems"),
    value("group-size-1", "grpo.group_size=1", "grpo.group_size", "greater than or equal to 2"),
    value("minibatch-0", "grpo.minibatch_turns=0", "grpo.minibatch_turns"),
    value("epochs-0", "grpo.epochs=0", "grpo.epochs"),
    value("micro-tokens-0", "grpo.micro_tokens=0", "grpo.micro_tokens"),
    value("aggregation", "grpo.aggregation=mean", "aggregation", "token-mean"),
    value("scope", "grpo.advantage_scope=episode", "grpo.advantage_scope", "'problem'"),
    value("credit", "grpo.credit=team", "grpo.credit", "'broadcast'"),
    value("role-weight-negative", "grpo.role_weights={generator: -1}", "role_weights", ">= 0"),
    value("role-weight-inf", "grpo.role_weights={generator: .inf}", "role_weights", "finite"),
    value("same-role-weighting", "grpo.same_role_weighting=maybe", "same_role_weighting"),
    value("lora-rank-0", "policy.lora_rank=0", "policy.lora_rank"),
    value("lora-alpha-0", "policy.lora_alpha=0", "policy.lora_alpha"),
    value("lora-dropout-1", "policy.lora_dropout=1", "policy.lora_dropout", "less than 1"),
    value("lora-dropout-nan", "policy.lora_dropout=nan", "policy.lora_dropout", "finite"),
    value("routing", "policy.routing=shared", "policy.routing", "'sp'"),
    value("role-map-without-map", "policy.role_map={generator: g}", "policy.role_map", "map"),
    Case(
        "role-map-missing-role",
        train("policy.routing=map", "policy.role_map={generator: g}"),
        ["policy.role_map", "aggregator"],
    ),
    Case(
        "role-map-unknown-role",
        train("policy.routing=map", "policy.role_map={generator: g, aggregator: a, critic: c}"),
        ["policy.role_map", "critic"],
    ),
    value("workflow-name", "workflow.name=debate", "unknown workflow 'debate'", "voting"),
    value("workflow-param-unknown", "workflow.params={m: 2}", "no parameter m", "valid: n"),
    value("workflow-param-text", "workflow.params={n: many}", "workflow.params.n", "integer"),
    Case(
        "eval-opt-rounds-negative",
        train("workflow.name=eval_opt", "workflow.params={rounds: -1}"),
        ["workflow.params", "rounds must be >= 0"],
    ),
    value("model-name-empty", "model.name=", "model.name", "tiny-s"),
    value("model-dtype", "model.dtype=bfloat16", "'model.dtype' is unknown", "valid here: name"),
    value("dtype", "dtype=float64", "'dtype'", "'float32', 'bfloat16' or 'float16'"),
    value("device-tpu", "device=tpu", "'device'", "'tpu'", "auto, cpu, cuda, cuda:N, mps"),
    value("device-meta", "device=meta", "'device'", "'meta'", "auto, cpu, cuda, cuda:N, mps"),
    value("device-cuda-99", "device=cuda:99", "'device' is 'cuda:99'", "valid here: auto, cpu"),
    # checked where the run starts, before the data, the model or any file: the machine's devices
    *(
        []
        if torch.cuda.is_available()
        else [value("device-no-cuda", "device=cuda", "'device' is 'cuda'", "valid here: auto")]
    ),
    *(
        []
        if torch.backends.mps.is_available()
        else [value("device-no-mps", "device=mps", "'device' is 'mps'", "valid here: auto")]
    ),
    value("pretrain-steps-0", "model.pretrain_steps=0", "model.pretrain_steps"),
    value("pretrain-batch-0", "model.pretrain_batch=0", "model.pretrain_batch"),
    value("world-unknown", "model.world=fresh", "model.world", "'auto', 'shipped' or 'rebuild'"),
    Case(
        "world-not-shipped",
        train("model.name=tiny-l", "model.world=shipped"),
        ["model.world=shipped", "ships no tiny-l math world", "model.world=auto"],
        model=True,
    ),
    value(
        "task-name", "task.name=physics", "'task.name' is 'physics'", "valid: math, code, custom"
    ),
    value(
        "task-name-a-dataset",
        "task.name=humaneval",
        "humaneval is a dataset: task.dataset=humaneval task.source=",
        "under task.name=code",
    ),
    value("task-val-size-0", "task.val_size=0", "task.val_size"),
    value(
        "task-val-size-past-the-tiny-world",
        "task.val_size=100000",
        "task.val_size is 100000",
        "tiny math world has at most 5000",
    ),
    value("format-penalty-positive", "task.format_penalty=0.5", "task.format_penalty"),
    value("code-timeout-0", "task.code_timeout_s=0", "task.code_timeout_s"),
    value("dataset-with-tiny", "task.dataset=gsm8k", "task.dataset", "tiny"),
    value("subset-without-deepcoder", "task.subset=taco", "task.subset", "deepcoder"),
    value("dataset-unknown", "task.source=x.jsonl", "task.dataset", "gsm8k, math500, dapo"),
    Case(
        "deepcoder-without-subset",
        train("task.name=code", "task.source=x.jsonl", "task.dataset=deepcoder"),
        ["task.subset", "primeintellect"],
    ),
    Case(
        "tiny-code-val-size",
        train("task.name=code", "task.val_size=2000"),
        ["task.val_size", "at most 1000"],
    ),
    value("strict-text", "task.strict=sometimes", "task.strict", "boolean"),
    value("wandb-mode", "sinks.wandb_mode=cloud", "sinks.wandb_mode", "'offline'"),
    value("cliff-drop-2", "detect.cliff_drop=2", "detect.cliff_drop", "less than 1"),
    value("amp-rise-1", "detect.amp_rise=1", "detect.amp_rise", "greater than 1"),
    value("on-alarm", "detect.on_alarm=panic", "detect.on_alarm", "'warn'"),
    value("capture-share", "detect.capture_share=0.4", "detect.capture_share"),
    value("signature-problems-0", "diagnostics.signature_problems=0", "signature_problems"),
    value("preset", "preset=huge", "preset", "paper, official, tiny"),
    value("unknown-top-level", "lr=0.1", "'lr' is unknown", "preset, seed"),
    value("unknown-nested", "grpo.clip_hgh=0.3", "'grpo.clip_hgh' is unknown", "clip_high"),
    value("unknown-section", "bogus.x=1", "'bogus' is unknown", "optim"),
    value("section-not-a-mapping", "optim=3", "optim", "dictionary"),
    # -- override syntax --------------------------------------------------------------------
    Case("override-without-equals", train("steps=2", "optim.lr"), ["optim.lr", "key=value"]),
    value("override-empty-key", "=1", "empty key part"),
    value("override-leading-dot", ".lr=1", "empty key part"),
    value("override-trailing-dot", "optim.=1", "empty key part"),
    value("override-bad-yaml", "optim.lr=[1,", "optim.lr", "not a YAML value"),
    value("override-bad-yaml-mapping", "workflow.params={n: ", "workflow.params", "YAML"),
    Case("override-value-then-field", train("optim=1", "optim.lr=2"), ["optim", "already set"]),
    value("override-mapping-for-number", "optim.lr={a: 1}", "optim.lr", "valid number"),
    # -- config files -----------------------------------------------------------------------
    Case("config-missing", ["train", "nope.yaml", "--out", "run"], ["nope.yaml"]),
    Case("config-is-a-folder", ["train", "cfgdir", "--out", "run"], ["cfgdir"], {"cfgdir/x": ""}),
    Case(
        "config-a-list",
        ["train", "c.yaml", "--out", "run"],
        ["c.yaml", "mapping"],
        {"c.yaml": "- 1\n"},
    ),
    Case(
        "config-bad-yaml",
        ["train", "c.yaml", "--out", "run"],
        ["c.yaml", "not valid YAML", "line"],
        {"c.yaml": "steps: [1,\n"},
    ),
    Case(
        "config-binary",
        ["train", "c.yaml", "--out", "run"],
        ["c.yaml"],
        {"c.yaml": b"\xff\xfe\x00"},
    ),
    Case(
        "config-unknown-key",
        ["train", "c.yaml", "--out", "run"],
        ["'optim.rate' is unknown", "lr"],
        {"c.yaml": "optim: {rate: 1}\n"},
    ),
    Case(
        "config-inf-lr",
        ["train", "c.yaml", "--out", "run"],
        ["optim.lr", "finite"],
        {"c.yaml": "optim: {lr: .inf}\n"},
    ),
    # -- data files and rows ----------------------------------------------------------------
    data("data-empty-file", "", "no rows to load"),
    data("data-missing-fields", '{"text": "a"}\n' * 3, "question, answer", "found: text"),
    data("data-no-gold-marker", '{"question": "q", "answer": "2"}\n' * 3, "no_gold_marker"),
    data("data-too-few-rows", GSM * 1, "task.val_size", "only 1 usable"),
    data(
        "data-strict-missing-field",
        GSM_ROWS + '{"question": "q"}\n',
        "task.strict",
        "missing_field:answer",
        extra=("task.strict=true",),
    ),
    data(
        "data-strict-duplicate-id",
        GSM_ROWS,
        "task.strict",
        "rejected",
        name="dup.jsonl",
    ),
    data("data-not-parquet", b"not parquet", "not a readable parquet file", name="d.parquet"),
    data("data-bad-gzip", b"not gzip", "not a readable jsonl file", name="d.jsonl.gz"),
    data("data-not-utf8", b'{"question": "\xff"}\n', "most rows: not_utf8", "save it as UTF-8"),
    data("data-utf16", '{"question": "1"}\n'.encode("utf-16"), "is UTF-16 text", "as UTF-8"),
    data(
        "data-chat-messages",
        '{"question": [{"role": "user", "content": "1+1"}], "answer": "#### 2"}\n',
        "most rows: not_text:question",
        "chat messages",
    ),
    value("data-missing-file", "task.source=missing.jsonl", "task.dataset"),
    Case(
        "data-missing-file-with-dataset",
        train("task.source=missing.jsonl", "task.dataset=gsm8k"),
        ["missing.jsonl", "file not found"],
    ),
    Case(
        "data-unsupported-suffix",
        train("task.source=d.csv", "task.dataset=gsm8k"),
        ["d.csv", "unsupported file type", ".jsonl"],
        files={"d.csv": "a,b\n"},
    ),
    Case(
        "data-neither-file-nor-hub",
        train("task.source=nothing", "task.dataset=gsm8k"),
        ["nothing", "hub id"],
    ),
    # -- command-line flags and paths ------------------------------------------------------
    Case("unknown-flag", ["train", "--foo"], ["No such option: --foo", "train --help"]),
    Case(
        "answer-negative-question",
        ["answer", "run", "-5+3"],
        ["No such option: -5", "put `--` before it", "answer --help"],
    ),
    Case(
        "answer-input-a-folder",
        ["answer", "run", "--input", "d", "--out", "o.jsonl"],
        ["--input d is a folder", "JSON-lines file"],
        files={"d/x": ""},
    ),
    Case(
        "answer-out-a-folder",
        ["answer", "run", "--input", "q.jsonl", "--out", "d"],
        ["--out d is a folder", "answers' file"],
        files={"q.jsonl": '{"prompt": "1+1"}\n', "d/x": ""},
    ),
    Case(
        "answer-out-under-a-file",
        ["answer", "run", "--input", "q.jsonl", "--out", "f/o.jsonl"],
        ["f is a file, not a folder"],
        files={"q.jsonl": '{"prompt": "1+1"}\n', "f": "x"},
    ),
    Case("unknown-command", ["bogus"], ["No such command 'bogus'"]),
    Case("out-current-folder", ["train", "--out", "."], ["current folder"]),
    Case("eval-out-under-file", ["eval", "--out", "f/ev"], ["f is a file"], files={"f": "x"}),
    Case("eval-missing-checkpoint", ["eval", "nope"], ["nope", "run folder"]),
    Case("eval-bad-override", ["eval", "optim.lr=inf", "--out", "ev"], ["optim.lr", "finite"]),
    Case("quickstart-seed-text", ["quickstart", "--seed", "abc"], ["--seed", "integer"]),
    Case("quickstart-out-under-file", ["quickstart", "--out", "f/q"], ["f is a file"], {"f": "x"}),
    Case("pretrain-unknown-scale", ["pretrain-tiny", "--scale", "tiny-xl"], ["tiny-xl", "tiny-s"]),
    Case("pretrain-unknown-task", ["pretrain-tiny", "--task", "chess"], ["chess", "math"]),
    Case("grid-missing-file", ["grid", "nope.yaml"], ["nope.yaml"]),
    Case("grid-without-file", ["grid"], ["Missing argument", "grid --help"]),
    Case(
        "grid-binary", ["grid", "g.yaml"], ["g.yaml", "byte 2 is not UTF-8"], {"g.yaml": b"a:\xff"}
    ),
    Case(
        "grid-bad-yaml",
        ["grid", "g.yaml"],
        ["g.yaml is not valid YAML at line 2", "expected ',' or ']'"],
        {"g.yaml": "workflows: [single\n"},
    ),
    Case(
        "workflow-file-binary",
        train("workflow.name=w.yaml"),
        ["workflow file w.yaml", "byte 0 is not UTF-8 text"],
        {"w.yaml": b"\xff\xfe name: x\n"},
    ),
    *(
        Case(
            f"grid-workers-{name}",
            ["grid", "g.yaml", "--workers", workers],
            ["--workers", "greater than or equal to 1"],
            {"g.yaml": "workflows: [single]\ncontrols: []\n"},
        )
        for name, workers in (("negative", "-3"), ("zero", "0"))
    ),
    Case(
        "grid-out-under-file",
        ["grid", "g.yaml", "--out", "f/g"],
        ["f is a file"],
        {"f": "x", "g.yaml": ""},
    ),
    Case("inspect-missing-folder", ["inspect", "nowhere"], ["nowhere", "no metrics.jsonl"]),
    Case("inspect-without-run", ["inspect"], ["Missing argument 'run'"]),
    Case(
        "inspect-bad-threshold",
        ["inspect", "r", "detect.cliff_drop=5"],
        ["detect.cliff_drop", "less than 1"],
        files=run_folder(),
    ),
    Case(
        "inspect-no-config",
        ["inspect", "r"],
        ["config.yaml"],
        files={"r/metrics.jsonl": '{"step": 0}\n'},
    ),
    Case("report-missing-folder", ["report", "nowhere"], ["nowhere"]),
    Case(
        "report-of-one-run",
        ["report", "r"],
        ["r holds no grid results", "it is one run: marlow inspect r"],
        files={"r/metrics.jsonl": '{"step": 0}\n', "r/config.yaml": "steps: 1\n"},
    ),
    # -- marlow plan: it loads no model, so no row needs one ---------------------------------
    Case(
        "plan-model-unknown",
        ["plan", "model.name=Qwen/Qwen3-99B"],
        ["model.name", "Qwen3-99B", "qwen3-0.6b, qwen3-1.7b, qwen3-4b", "tiny-s"],
        env={"HF_HUB_OFFLINE": "1"},
    ),
    Case("plan-model-missing-folder", ["plan", "model.name=./nowhere"], ["model.name", "no such"]),
    Case(
        "plan-folder-without-config",
        ["plan", "model.name=./m"],
        ["model.name", "has no config.json", "qwen3-1.7b"],
        files={"m/weights.bin": b"\x00"},
    ),
    Case("plan-gpu-mem-negative", ["plan", "--gpu-mem", "-1"], ["--gpu-mem", "positive"]),
    Case("plan-gpu-mem-inf", ["plan", "--gpu-mem", "inf"], ["--gpu-mem", "positive"]),
    Case("plan-gpu-mem-text", ["plan", "--gpu-mem", "lots"], ["--gpu-mem", "valid number"]),
    Case("plan-prompt-tokens-negative", ["plan", "--prompt-tokens", "-5"], ["--prompt-tokens"]),
    Case("plan-bad-override", ["plan", "optim.lr=inf"], ["optim.lr", "finite"]),
    Case("plan-unknown-workflow", ["plan", "workflow.name=debate"], ["workflow.name", "voting"]),
    Case(
        "plan-unknown-target-module",
        ["plan", "model.name=qwen3-0.6b", "policy.target_modules=[nope_proj]"],
        ["policy.target_modules", "q_proj"],
    ),
    Case("plan-config-missing", ["plan", "nope.yaml"], ["nope.yaml"]),
    # -- marlow export: it reads the run's files, loads no model --------------------------------
    Case("export-missing-run", ["export", "nowhere", "ex"], ["nowhere", "no config.yaml"]),
    Case(
        "export-no-checkpoint",
        ["export", "r", "ex"],
        ["r has no checkpoint yet", "ckpt_every"],
        files={"r/config.yaml": RUN_CONFIG},
    ),
    Case(
        "export-dest-not-empty",
        ["export", "r", "ex"],
        ["ex already exists", "new one"],
        files={**run_folder(), "ex/x.txt": "mine"},
    ),
    Case(
        "export-dest-is-a-file",
        ["export", "r", "ex"],
        ["ex already exists"],
        files={**run_folder(), "ex": "mine"},
    ),
    Case(
        "export-step-missing",
        ["export", "r", "ex", "--step", "7"],
        ["--step 7", "no such checkpoint", "valid: 1"],
        files=run_folder(),
    ),
    Case(
        "export-no-base-record",
        ["export", "r", "ex"],
        ["base.json", "--resume"],
        files=run_folder(),
    ),
    Case("export-without-dest", ["export", "r"], ["Missing argument 'dest'", "export --help"]),
]


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root``: a folder marker or the sha256 of the file's bytes."""
    return {
        str(p.relative_to(root)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def _write(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".gz") and isinstance(content, str):
            content = gzip.compress(content.encode())
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def _params() -> list:
    return [pytest.param(case, id=case.id) for case in CASES]


def test_the_table_has_at_least_100_distinct_rows():
    assert len(CASES) >= 100
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_one_clear_line_and_leaves_nothing(case: Case, tmp_path, monkeypatch, request):
    if case.model:
        monkeypatch.setenv("MARLOW_CACHE", request.getfixturevalue("tiny_cache"))
    else:

        def no_model(config, *args, **kwargs):
            if not is_tiny(config.name):  # the fast checks of load_base run; the load does not
                check_model_source(config.name)
            raise AssertionError(f"{case.id}: accepted by validation, went on to load a model")

        monkeypatch.setattr("marlow.workflows.agents.load_base", no_model)
        monkeypatch.setenv("MARLOW_CACHE", str(tmp_path / "cache"))  # under watch: must stay absent
    for key, val in case.env.items():
        monkeypatch.setenv(key, val)
    if case.id == "data-strict-duplicate-id":  # two rows with the same MATH-500 id
        case = Case(
            case.id,
            train("task.source=dup.jsonl", "task.dataset=math500", "task.strict=true"),
            ["task.strict", "duplicate_id"],
            files={"dup.jsonl": '{"problem": "p", "answer": "1", "unique_id": "a"}\n' * 4},
        )
    _write(tmp_path, case.files)
    before = _snapshot(tmp_path)

    result = in_process(case.args, tmp_path)

    assert isinstance(result.exception, SystemExit), result.exception  # no traceback
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for needle in case.needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    assert _snapshot(tmp_path) == before  # nothing new, removed or changed


def test_a_run_folder_another_process_holds_is_refused_in_one_line_and_left_as_it_was(
    tmp_path, monkeypatch, tiny_cache
):
    """A trainer holds its run folder while it trains: a second ``marlow train`` on it (here
    while the first has made the folder and not yet written a record) is refused before it
    writes anything there."""
    from marlow.fileio import held

    monkeypatch.setenv("MARLOW_CACHE", tiny_cache)
    (tmp_path / "r").mkdir()
    before = _snapshot(tmp_path)
    with held(tmp_path / "r", "marlow train"):  # as the trainer of that run holds it
        result = in_process(["train", TINY, "--out", "r"], tmp_path)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: another marlow train is running in r"], result.output
    assert _snapshot(tmp_path) == before
