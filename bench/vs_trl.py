"""marlow's single-agent GRPO step vs TRL's GRPOTrainer: same tiny model, prompts and settings.

Both train LoRA r16 (alpha 32, dropout 0, every linear layer of the base) on the tiny-s math
world, fp32, on the same 32 training problems x 8 completions per step (the problems of marlow's
step k are TRL's step k, rendered as the single-agent workflow renders them: the script checks
that TRL tokenizes them to marlow's prompt ids), pure temperature sampling at 0.7 up to the same
number of new tokens, rewarded by marlow's math grader (boxed answer vs gold, -0.1 unboxed),
group-normalised advantages, the clipped loss with epsilon 0.2 / 0.28, sequence-mean-token-mean
aggregation (TRL's loss_type "grpo"), no KL (beta 0), one optimizer update per batch (one
mini-batch, one iteration), AdamW lr 1e-3 held constant, weight decay 0.01, grad clip 1.0.

The two run in one process and take turns step by step: TRL's trainer loop runs, and after each of
its optimizer steps a callback runs marlow's step of the same index, so a change of machine load
falls on both. TRL's step time is everything from the end of the previous marlow step to TRL's
``on_step_end`` (its data loading and logging included); marlow's is ``Trainer.train_step``.

Phase splits. marlow: generation (the rollout engine's calls), reward (grader calls), other
rollout work (prompts, episodes, samples), scoring (batch record and advantages; a separate
logp_old pass only when the update is not fused), update (forward, backward, optimizer), stats
(metrics and the one-turn finiteness probe; the post-update chi2 pass on diagnostics steps only).
TRL: generation (``_generate``: tokenise, ``model.generate``, decode), reward
(``_calculate_rewards``), other scoring (padding, advantages, metrics: the rest of
``_prepare_inputs``), loss forward (``compute_loss``), backward, optimizer (clip, step, schedule)
and other (data loading, logging).

Rewards: the mean reward of each timed step's batch (the same problems for both at each step),
and a greedy evaluation on validation problems before and after (untimed; one code path for both:
marlow's HF rollout engine).

TRL is a bench-only extra; install it in its own virtual environment so that torch stays pinned:

    python3.11 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 \
        && /tmp/trlvenv/bin/pip install -e '.[bench-trl]'
    /tmp/trlvenv/bin/python bench/vs_trl.py [--steps 5] [--warmup 1] [--max-new 96] \
        [--threads 2] [--compile auto] [--cache-dir DIR] [--eval-problems 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict

import torch

INSTALL = (
    "bench/vs_trl.py needs TRL (the bench-trl extra). Install it in a separate virtual "
    "environment so that torch stays pinned:\n"
    "    python3.11 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 "
    "&& /tmp/trlvenv/bin/pip install -e '.[bench-trl]'\n"
    "then run: /tmp/trlvenv/bin/python bench/vs_trl.py"
)

BATCH_PROBLEMS = 32
GROUP_SIZE = 8
LR = 1e-3
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
TEMPERATURE = 0.7
LORA_RANK, LORA_ALPHA = 16, 32
DIAGNOSTICS_EVERY = 1000  # post-update chi2 on step 1 only: a warm-up step

M_PARTS = ("generation", "reward", "rollout_other", "scoring", "update", "stats")
T_PARTS = (
    "generation",
    "reward",
    "scoring_other",
    "loss_forward",
    "backward",
    "optimizer",
    "other",
)


def require_trl():
    try:
        import trl
    except ImportError:
        print(INSTALL, file=sys.stderr)
        raise SystemExit(2) from None
    return trl


def marlow_config(args):
    from marlow.config import load_config

    return load_config(
        None,
        [
            "workflow.name=single",
            f"policy.routing={args.routing}",
            f"policy.lora_rank={LORA_RANK}",
            f"policy.lora_alpha={LORA_ALPHA}",
            "policy.lora_dropout=0.0",
            "policy.target_modules=all-linear",
            f"grpo.batch_problems={BATCH_PROBLEMS}",
            f"grpo.group_size={GROUP_SIZE}",
            f"grpo.minibatch_turns={BATCH_PROBLEMS * GROUP_SIZE}",
            *([f"grpo.micro_tokens={args.micro_tokens}"] if args.micro_tokens else []),
            f"grpo.compile={args.compile}",
            "grpo.epochs=1",
            f"grpo.clip_low={CLIP_LOW}",
            f"grpo.clip_high={CLIP_HIGH}",
            "grpo.credit=broadcast",
            "grpo.aggregation=seq-mean-token-mean",
            f"rollout.temperature={TEMPERATURE}",
            f"rollout.max_new_tokens={args.max_new}",
            "diagnostics.kl_to_base=false",
            f"diagnostics.every={DIAGNOSTICS_EVERY}",
            f"optim.lr={LR}",
            "optim.warmup_steps=0",
            "optim.weight_decay=0.01",
            "optim.grad_clip=1.0",
            # The cosine schedule decays to 0 at `steps`: far away, the rate is ~constant (TRL: constant).
            "steps=100000",
            f"threads={args.threads}",
            f"seed={args.seed}",
            "sample_episodes=0",
        ],
    )


class Timer:
    """Wraps a callable and adds its wall time to ``times[key]``."""

    def __init__(self, fn, times: dict[str, float], key: str) -> None:
        self.fn, self.times, self.key = fn, times, key

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.times[self.key] += time.perf_counter() - t0


def prompt_text(problem) -> str:
    from marlow.prompts import render

    return render("tiny", "math", "generator", "answer", {"problem": problem.prompt})


def greedy_eval(model, tokenizer, adapter: str, problems, max_new: int, grade):
    """(mean reward, accuracy, answers, correct flags) of greedy answers through marlow's HF rollout engine."""
    from marlow.prompts.chat import chat_prompt_ids
    from marlow.rollout.hf import HFEngine
    from marlow.types import GenRequest, SamplingParams

    engine = HFEngine(model, tokenizer, max_batch=256)
    requests = [GenRequest(chat_prompt_ids(tokenizer, prompt_text(p)), adapter) for p in problems]
    was_training = model.training
    completions = engine.generate(requests, SamplingParams(0.0, max_new, 0))
    model.train(was_training)
    rewards = [grade(c.text, p) for c, p in zip(completions, problems, strict=True)]
    correct = [r >= 1.0 for r in rewards]
    return (
        statistics.mean(rewards),
        sum(correct) / len(correct),
        [c.text for c in completions],
        correct,
    )


def summary(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return (
        f"mean {statistics.mean(xs):.3f} s (sd {sd:.3f}), median {statistics.median(xs):.3f}, "
        f"min {min(xs):.3f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps of each")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps of each before them")
    ap.add_argument("--max-new", type=int, default=96, help="max new tokens (both)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--routing", choices=("sp", "ip"), default="sp")
    ap.add_argument(
        "--micro-tokens",
        type=int,
        default=None,
        help="marlow's grpo.micro_tokens (padded tokens per forward: memory and speed, not "
        "math; bench/micro_tokens.py; default: marlow's); TRL takes its 256 sequences in one "
        "forward",
    )
    ap.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="marlow's grpo.compile (auto: off on the CPU; on: compiled layers, LoRA unfolded; "
        "the compilation falls in the warm-up step and the first one-row micro-batch)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None, help="tiny-world cache (default: marlow's)")
    ap.add_argument(
        "--eval-problems", type=int, default=256, help="greedy validation problems (0: skip)"
    )
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1 (step 1 runs marlow's sampled diagnostics)")
    trl = require_trl()
    import transformers
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if args.cache_dir:
        os.environ["MARLOW_CACHE"] = args.cache_dir
    from marlow.models import load_base
    from marlow.policy.adapters import LoraSpec
    from marlow.training.trainer import Trainer
    from marlow.types import BASE

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed arguments
    torch.set_num_threads(args.threads)
    total = args.warmup + args.steps
    load_start = os.getloadavg()
    cfg = marlow_config(args)
    work = tempfile.TemporaryDirectory()

    # -- marlow ------------------------------------------------------------------------------
    mtrainer = Trainer(cfg, f"{work.name}/marlow", log=print)
    m_times: dict[str, float] = defaultdict(float)
    m_sampled: list[list[int]] = []  # the prompt ids marlow's engine was asked to continue
    generate = mtrainer.engine.generate

    def recorded(requests, params):
        m_sampled.extend(list(r.prompt_ids) for r in requests)
        return generate(requests, params)

    mtrainer.engine.generate = Timer(recorded, m_times, "generation")
    grade = mtrainer.task.grader()  # the same math grader for both
    mtrainer.grade = Timer(mtrainer.grade, m_times, "reward")
    adapter = mtrainer.adapters[0]
    m_steps: list[float] = []
    m_cpu: list[float] = []  # process CPU seconds (every thread): less sensitive to others' load
    m_parts: dict[str, list[float]] = {p: [] for p in M_PARTS}
    m_rewards: list[float] = []
    m_lengths: list[tuple[float, float]] = []  # (mean completion tokens, truncated fraction)

    def marlow_step(step: int) -> None:
        m_times.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        record = mtrainer.train_step(step)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if step > args.warmup:
            m_steps.append(dt)
            m_cpu.append(cpu)
            m_rewards.append(record["train/all/reward"])
            m_lengths.append(
                (record["train/generator/length_mean"], record["train/all/truncation_rate"])
            )
            gen, rew = m_times["generation"], m_times["reward"]
            m_parts["generation"].append(gen)
            m_parts["reward"].append(rew)
            m_parts["rollout_other"].append(record["time/rollout_s"] - gen - rew)
            m_parts["scoring"].append(record["time/scoring_s"])
            m_parts["update"].append(record["time/update_s"])
            m_parts["stats"].append(record["time/stats_s"] + record["time/kl_to_base_s"])

    # -- TRL: the same problems, in marlow's step order ----------------------------------------
    problems = {}
    rows = []
    for step in range(1, total + 1):
        for p in mtrainer.task.train_batch(cfg.seed, step, BATCH_PROBLEMS):
            problems[p.id] = p
            rows.append(
                {"prompt": [{"role": "user", "content": prompt_text(p)}], "problem_id": p.id}
            )
    dataset = Dataset.from_list(rows)
    t_times: dict[str, float] = defaultdict(float)
    t_rewards_by_step: list[float] = []
    t_lengths_by_step: list[tuple[float, float]] = []
    eos = mtrainer.tokenizer.eos_token_id

    def math_reward(completions, problem_id, completion_ids, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [grade(t, problems[pid]) for t, pid in zip(texts, problem_id, strict=True)]
        t_rewards_by_step.append(statistics.mean(rewards))
        t_lengths_by_step.append(
            (
                statistics.mean(len(ids) for ids in completion_ids),
                statistics.mean(float(not ids or ids[-1] != eos) for ids in completion_ids),
            )
        )
        return rewards

    class TimedGRPO(GRPOTrainer):
        def _generate(self, prompts):
            return Timer(super()._generate, t_times, "generation")(prompts)

        def _calculate_rewards(self, *a, **kw):
            return Timer(super()._calculate_rewards, t_times, "reward")(*a, **kw)

        def _prepare_inputs(self, *a, **kw):
            return Timer(super()._prepare_inputs, t_times, "prepare_inputs")(*a, **kw)

        def compute_loss(self, *a, **kw):
            return Timer(super().compute_loss, t_times, "loss_forward")(*a, **kw)

        def training_step(self, *a, **kw):
            return Timer(super().training_step, t_times, "training_step")(*a, **kw)

    t_steps: list[float] = []
    t_inner: list[float] = []
    t_cpu: list[float] = []
    t_parts: dict[str, list[float]] = {p: [] for p in T_PARTS}
    clock = {"since": time.perf_counter(), "cpu": time.process_time(), "begin": 0.0}

    class Interleave(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            clock["begin"] = time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            now = time.perf_counter()
            step = state.global_step
            if step > args.warmup:
                inner = now - clock["begin"]
                t_steps.append(now - clock["since"])
                t_cpu.append(time.process_time() - clock["cpu"])
                t_inner.append(inner)
                tt = t_times
                t_parts["generation"].append(tt["generation"])
                t_parts["reward"].append(tt["reward"])
                t_parts["scoring_other"].append(
                    tt["prepare_inputs"] - tt["generation"] - tt["reward"]
                )
                t_parts["loss_forward"].append(tt["loss_forward"])
                t_parts["backward"].append(
                    tt["training_step"] - tt["prepare_inputs"] - tt["loss_forward"]
                )
                t_parts["optimizer"].append(inner - tt["training_step"])
                t_parts["other"].append(now - clock["since"] - inner)
            marlow_step(step)  # marlow's step of the same index, outside TRL's timing
            t_times.clear()
            clock["since"], clock["cpu"] = time.perf_counter(), time.process_time()

    tbase, ttok = load_base(cfg.model, task="math")
    targs = GRPOConfig(
        output_dir=f"{work.name}/trl",
        per_device_train_batch_size=BATCH_PROBLEMS * GROUP_SIZE,
        gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE,
        num_iterations=1,
        max_completion_length=args.max_new,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        loss_type="grpo",
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=total,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # TRL's GRPOConfig turns it on by default
        use_cpu=True,
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    lora = LoraSpec(LORA_RANK, LORA_ALPHA, 0.0, "all-linear").to_peft()
    ttrainer = TimedGRPO(
        model=tbase,
        reward_funcs=math_reward,
        args=targs,
        train_dataset=dataset,
        processing_class=ttok,
        peft_config=lora,
        callbacks=[Interleave()],
    )
    ttrainer.remove_callback(PrinterCallback)  # TRL still builds its logs; they are not printed
    if targs.activation_checkpointing or next(ttrainer.model.parameters()).dtype != torch.float32:
        raise SystemExit("TRL is not set up as intended: activation checkpointing on or not fp32")
    n_lora = sum(p.numel() for p in ttrainer.model.parameters() if p.requires_grad)
    m_lora = sum(p.numel() for n, p in mtrainer.model.named_parameters() if f".{adapter}." in n)

    val = mtrainer.task.val_problems()[: args.eval_problems]
    if val:
        before = greedy_eval(mtrainer.model, mtrainer.tokenizer, BASE, val, args.max_new, grade)
    torch.set_num_threads(args.threads)  # a trainer may have set its own
    print(
        f"tiny-s math, single agent: {BATCH_PROBLEMS} problems x {GROUP_SIZE}, max_new "
        f"{args.max_new}, T {TEMPERATURE}, LoRA r{LORA_RANK} all-linear "
        f"(trainable: marlow {m_lora}, TRL {n_lora}), fp32, clip {CLIP_LOW}/{CLIP_HIGH}, "
        f"no KL, one update per batch, lr {LR} constant; threads {args.threads}; "
        f"{args.steps} timed steps after {args.warmup} warm-up, interleaved (TRL k, marlow k)"
    )
    print(
        f"marlow: routing {args.routing}, micro_tokens {cfg.grpo.micro_tokens} ({mtrainer.grpo.micro_tokens}), merge_lora "
        f"{cfg.rollout.merge_lora} (sampling: {'on' if mtrainer.engine.merge else 'off'}), "
        f"fold_lora {cfg.grpo.fold_lora} (update: "
        f"{'on' if all(mtrainer.fold.values()) else 'off'}), compile {cfg.grpo.compile}, "
        f"minibatch_turns {cfg.grpo.minibatch_turns} (logp_old "
        "fused into the update forward), kl_to_base off, post-update chi2 on diagnostics step 1 "
        f"only (every {DIAGNOSTICS_EVERY}; a warm-up step), a one-turn finiteness probe on the "
        "others; passes per timed step: rollout, one update forward + backward, the probe"
    )
    print(
        f"TRL {trl.__version__} (transformers {transformers.__version__}, torch "
        f"{torch.__version__}): GRPOTrainer, per-device batch {targs.per_device_train_batch_size}, "
        "steps_per_generation 1, num_iterations 1, beta 0, loss_type grpo, no vLLM, "
        "gradient_checkpointing off, bf16 off; passes per step: generate, one forward + backward"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )

    t0 = time.perf_counter()
    clock["since"], clock["cpu"] = t0, time.process_time()
    ttrainer.train()
    wall = time.perf_counter() - t0
    load_end = os.getloadavg()

    if val:
        after_m = greedy_eval(mtrainer.model, mtrainer.tokenizer, adapter, val, args.max_new, grade)
        after_t = greedy_eval(
            ttrainer.model, ttrainer.processing_class, "default", val, args.max_new, grade
        )

    # Same prompts: TRL's tokenisation of every step's rows is what marlow's engine sampled from.
    trl_ids, _, _ = ttrainer._tokenize_prompts([r["prompt"] for r in rows])
    expected = [list(ids) for ids in trl_ids for _ in range(GROUP_SIZE)]
    if m_sampled != expected:
        raise SystemExit("marlow and TRL sampled from different prompt ids; the comparison is void")
    m_mean, t_mean = statistics.mean(m_steps), statistics.mean(t_steps)
    pairs = [m / t for m, t in zip(m_steps, t_steps, strict=True)]
    print(f"\nper step, {args.steps} timed steps ({wall:.0f} s for the whole interleaved run)")
    print(f"  marlow: {summary(m_steps)}; steps: {' '.join(f'{x:.2f}' for x in m_steps)}")
    print(f"  TRL:    {summary(t_steps)}; steps: {' '.join(f'{x:.2f}' for x in t_steps)}")
    print(f"          (TRL on_step_begin -> on_step_end only: {summary(t_inner)})")
    print(
        f"  marlow/TRL s/step: {m_mean / t_mean:.3f} (means), "
        f"{statistics.median(m_steps) / statistics.median(t_steps):.3f} (medians), "
        f"{statistics.median(pairs):.3f} (median of the step-by-step ratios: "
        f"{' '.join(f'{x:.2f}' for x in pairs)}); target <= 0.5"
    )
    print(
        f"  CPU s/step (process time, {args.threads} threads): marlow "
        f"{statistics.mean(m_cpu):.2f}, TRL {statistics.mean(t_cpu):.2f}, "
        f"marlow/TRL {statistics.mean(m_cpu) / statistics.mean(t_cpu):.3f}"
    )
    print(f"prompts: the same token ids for both at every step ({len(rows)} problems, checked)")
    print("phase split, mean s/step")
    print("  marlow: " + "  ".join(f"{p} {statistics.mean(m_parts[p]):.3f}" for p in M_PARTS))
    print("  TRL:    " + "  ".join(f"{p} {statistics.mean(t_parts[p]):.3f}" for p in T_PARTS))
    t_rewards = t_rewards_by_step[args.warmup :]
    print("mean reward of each timed step's batch (same problems per step)")
    print(f"  marlow: {' '.join(f'{r:.3f}' for r in m_rewards)}")
    print(f"  TRL:    {' '.join(f'{r:.3f}' for r in t_rewards)}")
    for name, lengths in (("marlow", m_lengths), ("TRL", t_lengths_by_step[args.warmup :])):
        tokens, cut = (statistics.mean(x[i] for x in lengths) for i in (0, 1))
        print(
            f"  {name}: {tokens:.1f} completion tokens (eos included), {cut:.3f} cut at --max-new"
        )
    if val:
        print(
            f"greedy validation, {len(val)} problems, mean reward / accuracy: before "
            f"{before[0]:.3f} / {before[1]:.3f} (the base: both start there, LoRA B = 0); after: "
            f"marlow {after_m[0]:.3f} / {after_m[1]:.3f}, TRL {after_t[0]:.3f} / {after_t[1]:.3f}"
        )
        changed = [
            sum(a != b for a, b in zip(before[2], x[2], strict=True)) for x in (after_m, after_t)
        ]
        differ = sum(a != b for a, b in zip(after_m[2], after_t[2], strict=True))
        only = [
            sum(a and not b for a, b in zip(x[3], y[3], strict=True))
            for x, y in ((after_m, after_t), (after_t, after_m))
        ]
        print(
            f"  greedy answers changed by training: marlow {changed[0]}, TRL {changed[1]}; "
            f"marlow's and TRL's differ on {differ} of {len(val)} (right only under marlow "
            f"{only[0]}, only under TRL {only[1]})"
        )
    print(
        f"load average (1/5/15 min): start {' '.join(f'{x:.2f}' for x in load_start)}, "
        f"end {' '.join(f'{x:.2f}' for x in load_end)}; torch threads {torch.get_num_threads()}"
    )
    work.cleanup()


if __name__ == "__main__":
    main()
