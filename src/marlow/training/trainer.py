"""The training loop: rollout -> reward -> GRPO update -> metrics -> validation -> checkpoint.

A run folder holds ``config.yaml`` (the resolved config: it alone reproduces the run),
``metrics.jsonl`` (one line per training step and per validation), ``samples.jsonl`` (a few
episodes per logged step, as text) and ``checkpoints/step_NNNNNN/``.

Randomness is a pure function of (seed, step): the step's problems, its sampling seed and its
mini-batch order. A run resumed from the checkpoint of step k therefore continues exactly as
the uninterrupted run would have.

Device and precision (config ``device``, ``dtype``; :mod:`marlow.models` says which tensor is in
which dtype): the device is resolved first, before any data, model or file is touched, so a
device the machine lacks is one line and an untouched folder. The base is moved there once after
loading, the adapters are created there, and every tensor of the step is made there: the batch
record (built on the host from the episodes' token lists, then moved once), scoring, the update,
the diagnostics and the non-finite guard's snapshots. Values leave the device only as metrics
(a few reads per role), as the control flow that needs them on the host (each update's gradient
norm and summed loss, and whether the updated policy's log-probs are finite: a non-finite one
undoes the update), and as the rollout's sampled tokens (:mod:`marlow.rollout.hf`). The
mini-batch order is the one exception by design: it is a list of Python indices drawn from a CPU
generator, so it is the same on every device and costs no device read. On a CUDA device each
step's record also holds the peak memory of its rollout and of its learn phase, and what was
allocated when each began (``memory/*``, :mod:`marlow.training.memory`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from marlow.algo.turn_advantages import turn_advantages
from marlow.archs import Shape
from marlow.config import ConfigError, RunConfig, dump_config
from marlow.diagnostics.answers import remove_after as remove_answers_after
from marlow.diagnostics.answers import write_answers
from marlow.diagnostics.detectors import describe, run_detectors
from marlow.diagnostics.metrics import Meter, episode_metrics
from marlow.diagnostics.runstats import series
from marlow.diagnostics.signatures import read_signatures, trajectory_signatures, write_signatures
from marlow.diagnostics.sinks import JsonlSink, first_event, open_sinks, read_jsonl, read_metrics
from marlow.diagnostics.truncation import truncation_warnings
from marlow.fileio import held, write_json, write_text
from marlow.logs import Phase
from marlow.models import (
    checkpoint_layers,
    checkpointable_layers,
    checkpoints_layers,
    compile_layers,
    compiles_layers,
    decoder_and_head,
    pad_id,
    resolve_device,
    vocabulary,
)
from marlow.plan import (
    ACTIVATION_SHARE,
    MICRO_TOKENS_MAX,
    OPTIMIZER_BYTES,
    activations,
    engine_bytes,
    held_bytes,
    longest_turn,
    lora_shapes,
    update_settings,
)
from marlow.policy.adapters import (
    adapter_parameters,
    can_fold,
    load_adapter_weights,
)
from marlow.rewards.sandbox import Isolation, SandboxUnavailable, isolation_in_force
from marlow.rewards.user import RewardsMissing
from marlow.rollout.base import check_backend
from marlow.tasks import build_task
from marlow.training import checkpoint, runbase
from marlow.training import resume as resume_lib
from marlow.training.batch import build_batches, credit_rows, empty_batch
from marlow.training.distributed import (
    bind_local_device,
    check_ranks,
    join_ranks,
    launched_size,
    resolve_seeding,
)
from marlow.training.grpo import (
    finish_role_stats,
    fused_old_logp,
    kl_to_base_stats,
    post_update_stats,
    pre_update_stats,
    probe_logp,
    score_base,
    score_old,
    update_adapter,
)
from marlow.training.memory import card_memory, phase_peaks, start_phase
from marlow.training.nonfinite import NonFiniteGuard
from marlow.training.optim import AdapterOptimizers
from marlow.training.seeds import SHUFFLE, step_seed, validation_seed
from marlow.training.sync import check_sync, engine_drift
from marlow.types import Episode, SamplingParams, missing_reason
from marlow.workflows.agents import build_agents
from marlow.workflows.engine import run_episodes
from marlow.workflows.validate import check_run_config, workflow_copy

Log = Callable[[str], None]


class Trainer:
    """Builds everything a run needs from its config; ``run()`` trains."""

    def __init__(
        self,
        config: RunConfig,
        out_dir: str | Path,
        *,
        log: Log | None = None,
        run_dir: str | Path | None = None,
    ) -> None:
        """``run_dir``: the run whose own copy of a workflow file to read (default ``out_dir``;
        an eval writes elsewhere); a run not started yet reads the path as typed."""
        # rollout.seeding=auto, resolved for the processes torchrun started (one without it);
        # the run records and uses the resolved value
        config, seeding = resolve_seeding(config, launched_size())
        self.cfg = config
        # absolute: a user's reward or tool that changes the working directory (os.chdir) must
        # not send the run's later files elsewhere; messages name the folder as it was given
        self.named = Path(out_dir)
        self.out = self.named.absolute()
        self._folder: ExitStack | None = None  # the run folder, held while a run trains
        self.log = log or (lambda _msg: None)
        if config.threads:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        # What can be refused without the model is refused first: role-level settings, the
        # device, data.
        run = Path(run_dir).absolute() if run_dir is not None else self.out
        copy = workflow_copy(run)
        self.workflow = check_run_config(config, copy)
        check_backend(config)  # registered, and able to run here (vLLM imports)
        bind_local_device()  # under torchrun: one GPU per process
        self.device = resolve_device(config.device)
        self.ranks = join_ranks(self.device)  # one process unless torchrun started N
        check_ranks(config, self.ranks.size)
        if not self.ranks.main:  # rank 0 speaks and writes for the run
            self.log = lambda _msg: None
        if seeding is not None and self.ranks.size > 1:  # a one-process run samples as ever
            self.log(seeding)
        self.task = build_task(
            config.task,
            log=self.log,
            vocabulary=vocabulary(config.model.name),  # a tiny model reads printable ASCII only
            recorded=first_event(run, "data"),  # said in full once per run
        )
        # the code sandbox's isolation, logged, where grading runs model code
        self.isolation = sandbox_isolation(config, self.log) if self.task.sandboxed else None
        self.grade = self.task.grader()  # a user's reward is imported here, before the model
        self.agents = build_agents(config, self.workflow, self.device, log=self.log)
        try:
            self._learner(config)
        except BaseException:
            self.close()  # the engine may have started processes
            raise

    def _learner(self, config: RunConfig) -> None:
        """What the update needs beside the agents: folding, optimizers, sinks, the guard."""
        a = self.agents
        self.base, self.tokenizer, self.model, self.engine = a.base, a.tokenizer, a.model, a.engine
        self.routing, self.adapters, self.family = a.routing, a.adapters, a.family
        self.style, self.rules = a.style, a.rules
        # float32 on the CPU: folding (update) is exact enough and faster
        cpu_float32 = self.device.type == "cpu" and config.dtype == "float32"
        compiled = compiles_layers(config)  # grpo.compile
        self.fold = self._fold_adapters(config, cpu_float32 and not compiled)
        checkpointed = checkpoints_layers(config)  # grpo.activation_checkpointing
        if checkpointed and not checkpointable_layers(self.model):
            checkpointed = False  # auto: a model without such layers keeps its activations
            if config.grpo.activation_checkpointing == "on":
                raise ConfigError(
                    f"config field 'grpo.activation_checkpointing' is on, but "
                    f"{type(self.model).__name__} has no layers that can be checkpointed; "
                    "valid: auto, off"
                )
        # grpo.micro_tokens and activation_checkpointing auto, resolved; config.yaml keeps auto
        micro, checkpointed = self._update_settings(config, checkpointed)
        if checkpointed:
            checkpoint_layers(self.model)
        if compiled:
            try:
                compile_layers(self.model)
            except ValueError as err:
                raise ConfigError(
                    f"config field 'grpo.compile' is on, but {err}; valid: auto, off"
                ) from None
        self.grpo = config.grpo.model_copy(update={"micro_tokens": micro})
        self.pad_id = pad_id(self.tokenizer)
        self.optim = AdapterOptimizers(
            {a: list(adapter_parameters(self.model, a).values()) for a in self.adapters},
            lr=config.optim.lr,
            warmup=config.optim.warmup_steps,
            total=config.steps,
            weight_decay=config.optim.weight_decay,
            betas=config.optim.betas,
            grad_clip=config.optim.grad_clip,
            stepping=config.optim.schedule_stepping,
        )
        self.metrics = JsonlSink(self.out / "metrics.jsonl")
        self.samples = JsonlSink(self.out / "samples.jsonl")
        self.events = JsonlSink(self.out / "events.jsonl")  # alarms, resumes, skips: evidence
        self.nonfinite = NonFiniteGuard(
            self.optim,
            config.train.max_nonfinite,
            self.log,
            self.events.write if self.ranks.main else lambda _record: None,
        )
        self.val_set = self.task.val_problems()
        self.step = 0
        self._sandbox_errors = 0  # programs whose sandbox failed to set up, up to the last step
        self._truncation_warned: set[tuple[str, str]] = set()  # (split, role) warned of cut turns

    def close(self) -> None:
        """Stop the rollout engine (a vLLM engine's processes) and let go of the run folder; safe
        to call twice."""
        self._release_folder()
        engine = getattr(self, "engine", None)  # the agents' own, unless a caller swapped it
        if engine is None and getattr(self, "agents", None) is not None:
            engine = self.agents.engine
        if engine is not None:
            engine.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one step ---------------------------------------------------------------------------

    def rollout(
        self, problems, n: int, temperature: float, seed: int, first_group: int = 0
    ) -> list[Episode]:
        sampling = SamplingParams(temperature, self.cfg.rollout.max_new_tokens, seed)
        return run_episodes(
            self.workflow,
            problems,
            n,
            engine=self.engine,
            tokenizer=self.tokenizer,
            routing=self.routing,
            grade=self.grade,
            task=self.family,
            style=self.style,
            sampling=sampling,
            rules=self.rules,
            first_group=first_group,
        )

    def _update_settings(self, config: RunConfig, checkpointed: bool) -> tuple[int, bool]:
        """``grpo.micro_tokens`` and whether the update checkpoints its layers, ``auto`` resolved
        (:func:`marlow.plan.update_settings`) from this model, its adapters and, on CUDA, the
        card's memory; said in the log on CUDA. ``checkpointed``: what the setting asks."""
        card = card_memory(self.device)
        model = self.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        b = getattr(torch, config.dtype).itemsize
        frozen = sum(p.numel() for p in base.parameters() if not p.requires_grad) * b
        beside = frozen + engine_bytes(config, frozen)  # a vLLM engine's share of the card
        trainable = [
            sum(p.numel() for p in adapter_parameters(self.model, a).values())
            for a in self.adapters
        ]
        beside += OPTIMIZER_BYTES * sum(trainable)
        lora = lora_shapes(self.model, self.adapters[0]) if self.adapters else []
        chunked = decoder_and_head(self.model) is not None
        dropout = config.policy.lora_dropout > 0
        held = held_bytes(b, max(trainable, default=0), dropout)  # the factors cast once
        shape = Shape.of(base.config)
        auto = config.grpo.activation_checkpointing == "auto"
        model_of = partial(activations, shape, b, lora, chunked, dropout=dropout, held=held)
        micro, resolved = update_settings(
            model_of if lora else None,
            config.grpo.micro_tokens,
            checkpointed,
            auto,
            longest_turn(config),
            beside,
            card,
        )
        if card is not None and config.grpo.micro_tokens == "auto":
            self.log(
                f"grpo.micro_tokens auto: {micro:,} tokens a forward (their activations in marlow "
                f"plan's memory model take at most {ACTIVATION_SHARE:.0%} of the card's "
                f"{card / 2**30:.1f} GiB beside the weights and adapters; at most "
                f"{MICRO_TOKENS_MAX:,})"
            )
        if card is not None and auto and checkpointed:
            state, verb = ("on", "would pass") if resolved else ("off", "fits in")
            self.log(
                f"grpo.activation_checkpointing auto: {state} (the largest forward, every "
                f"layer's activations kept, {verb} {ACTIVATION_SHARE:.0%} of the card beside the "
                "weights and adapters)"
            )
        return micro, resolved

    def _fold_adapters(self, config: RunConfig, auto_on: bool) -> dict[str, bool]:
        """Per adapter: whether its update and logp_old pass fold the LoRA into one weight per
        layer (``grpo.fold_lora``; auto: float32 on the CPU, where that is faster, unless the
        layers are compiled: ``auto_on``)."""
        fold = config.grpo.fold_lora
        if fold == "auto":
            return {a: auto_on and can_fold(self.model, a) for a in self.adapters}
        if fold == "on":
            for a in self.adapters:
                if not can_fold(self.model, a):
                    raise ConfigError(
                        f"grpo.fold_lora=on: adapter {a!r} cannot be folded (LoRA dropout, DoRA "
                        "or a LoRA bias); valid: auto, off, or policy.lora_dropout=0 with plain LoRA"
                    )
        return dict.fromkeys(self.adapters, fold == "on")

    def train_step(self, step: int) -> dict[str, float]:
        """Step ``step`` (1-based): sample the step's episodes, then learn from them."""
        t0 = time.perf_counter()
        problems = self.task.train_batch(self.cfg.seed, step, self.cfg.grpo.batch_problems)
        shard = self.ranks.shard(len(problems))  # every problem, in a run of one process
        self.model.eval()
        start = start_phase(self.device)  # per-phase peak memory, on CUDA (training.memory)
        episodes = self.rollout(
            problems[shard.start : shard.stop],
            self.cfg.grpo.group_size,
            self.cfg.rollout.temperature,
            step_seed(self.cfg.seed, step),
            first_group=shard.start,
        )
        memory = phase_peaks(self.device, "rollout", start)
        self._reward_failures(step, "train", episodes)
        start = start_phase(self.device)
        record = self.learn(step, episodes)
        record.update(memory | phase_peaks(self.device, "learn", start))
        errors = getattr(self.grade, "sandbox_errors", None)  # the code grader's count so far
        if errors is not None:
            new = errors - self._sandbox_errors
            record["train/all/sandbox_errors"] = float(new)
            self._sandbox_errors = errors
            if new:
                self.log(
                    f"WARNING step {step}: {new} program(s) got no verdict because the sandbox "
                    f"failed to set up ({self.grade.last_sandbox_error}); they scored 0 and "
                    "were not cached"
                )
        record["time/rollout_s"] = time.perf_counter() - t0 - record["time/learn_s"]
        tokens = sum(len(t.completion_ids) for ep in episodes for t in ep.turns)
        record["time/rollout_tokens_per_s"] = tokens / max(record["time/rollout_s"], 1e-9)
        self._write_samples(step, "train", episodes)
        return record

    def learn(self, step: int, episodes: list[Episode]) -> dict[str, float]:
        """The GRPO update of step ``step`` on ``episodes``; returns the step's metrics.

        batch -> advantages -> logp_old -> update -> metrics (``marlow.training.grpo`` says which
        passes are fused or sampled)."""
        g, temperature = self.grpo, self.cfg.rollout.temperature
        diagnose = self.diagnostics_step(step)
        t1 = time.perf_counter()
        turns, rows = credit_rows(episodes)
        adv, frac_zero, n_groups = turn_advantages(
            rows, g.advantage_scope, g.eps, g.same_role_weighting, g.role_weights
        )
        batches = build_batches(turns, rows, adv, self.pad_id, self.device)
        counts = self.ranks.gather({a: len(b) for a, b in batches.items()})
        trained = {a: sum(c.get(a, 0) for c in counts) for a in self.adapters}  # every rank's
        dropout = self.cfg.policy.lora_dropout
        fused = {a: fused_old_logp(n, g, dropout) for a, n in trained.items()}
        kl_stats = diagnose and self.cfg.diagnostics.kl_to_base  # it reads every row's base
        for adapter, batch in batches.items():
            if not fused[adapter]:
                score_old(self.model, batch, temperature, g.micro_tokens, self.fold[adapter])
            anchored = [i for i, r in enumerate(batch.roles) if self.cfg.mitigate.kl_weight(r) > 0]
            if anchored:  # mitigate.kl_coef
                rows = None if kl_stats else anchored
                score_base(self.model, batch, temperature, g.micro_tokens, rows)
        t2 = time.perf_counter()
        meter = Meter()
        self.model.train()
        # the mini-batch order: host indices, from a CPU generator (module docstring)
        gen = torch.Generator(device="cpu").manual_seed(step_seed(self.cfg.seed, step, SHUFFLE))
        for adapter in self.adapters:
            if trained[adapter]:  # undone if non-finite (marlow.training.nonfinite)
                self.nonfinite.update(
                    adapter,
                    partial(
                        update_adapter,
                        self.model,
                        batches.get(adapter) or empty_batch(adapter, self.device),
                        self.optim,
                        g,
                        temperature=temperature,
                        generator=gen,
                        meter=meter,
                        fused=fused[adapter],
                        fold=self.fold[adapter],
                        ranks=self.ranks,
                        mitigate=self.cfg.mitigate,
                    ),
                )
            else:
                self.optim.end_role_update(adapter)
        self.optim.end_step()
        self.engine.refresh([a for a in self.adapters if trained[a]])  # serve the update
        self.model.eval()
        t3 = time.perf_counter()
        t_kl = 0.0
        finite: dict[str, bool] = {}  # per adapter: its updated policy scores finite log-probs
        drift: dict[str, float] = {}  # per adapter: rollout engine vs trainer on the probe turn
        for batch in batches.values():
            if batch.old_logp is None:  # a fused update that was undone: score the restored policy
                score_old(self.model, batch, temperature, g.micro_tokens, self.fold[batch.adapter])
            pre_update_stats(meter, batch)
            if kl_stats:
                tk = time.perf_counter()
                if batch.base_logp is None:  # else scored for mitigate.kl_coef: the same
                    score_base(self.model, batch, temperature, g.micro_tokens)
                kl_to_base_stats(meter, batch)
                t_kl += time.perf_counter() - tk
            if diagnose:
                new = post_update_stats(meter, self.model, batch, temperature, g.micro_tokens)
            else:  # the probe turn at temperature 1: also the sync check's side
                new = probe_logp(self.model, batch)
            finite[batch.adapter] = bool(torch.isfinite(new).all())  # one read
            if finite[batch.adapter]:  # the engine must serve the update (marlow.training.sync)
                probe = None if diagnose else new  # a diagnostics step scores the probe there
                drift[batch.adapter] = engine_drift(self.engine, self.model, batch, probe)
        for adapter in self.adapters:  # every rank undoes the same updates
            if trained[adapter]:
                kept = self.ranks.all_(finite.get(adapter, True))
                self.nonfinite.check_policy(adapter, kept)
                if not kept:
                    self.engine.refresh([adapter])  # serve the restored weights
        # a fraction of this rank's groups: the ranks' fractions merge weighted by their groups
        meter.mean("all", "frac_reward_zero_std", frac_zero * n_groups, n_groups)
        meter = Meter.merge(self.ranks.gather(meter))  # sums over ranks; one process: itself
        # lengths have percentiles, which do not merge: every rank's episodes, in problem order
        episode_metrics(meter, [e for rank in self.ranks.gather(episodes) for e in rank])
        out = finish_role_stats(meter.result("train"))
        out.update(self.nonfinite.count(step))
        out.update(check_sync(self.ranks.gather(drift), self.cfg.dtype, step))
        t4 = time.perf_counter()
        out.update(
            {
                "time/scoring_s": t2 - t1,
                "time/kl_to_base_s": t_kl,
                "time/update_s": t3 - t2,
                "time/stats_s": t4 - t3 - t_kl,
                "time/learn_s": t4 - t1,
            }
        )
        return out

    def _warn_truncation(self, step: int, record: dict) -> None:
        """Log :func:`truncation_warnings`, once per role and split in this process (a run cut
        on every step would otherwise say it every step)."""
        for seen, line in truncation_warnings(step, record, self.cfg.rollout.max_new_tokens):
            if seen not in self._truncation_warned:
                self._truncation_warned.add(seen)
                self.log(Phase(line))

    def diagnostics_step(self, step: int) -> bool:
        """Whether step ``step`` runs the sampled diagnostics (steps 1, 1 + k, 1 + 2k, ...)."""
        return (step - 1) % self.cfg.diagnostics.every == 0

    def validate(self, step: int) -> dict[str, float]:
        self.model.eval()
        t0 = time.perf_counter()
        temperature = self.cfg.rollout.val_temperature
        if temperature is None:
            temperature = self.cfg.rollout.temperature
        shard = self.ranks.shard(len(self.val_set))
        episodes = self.rollout(
            self.val_set[shard.start : shard.stop],
            1,
            temperature,
            validation_seed(self.cfg.seed),
            first_group=shard.start,
        )
        episodes = [e for rank in self.ranks.gather(episodes) for e in rank]  # in problem order
        self._reward_failures(step, "val", episodes)
        meter = Meter()
        episode_metrics(meter, episodes)
        out = meter.result("val")
        out["val/all/n_problems"] = float(len(self.val_set))
        n = self.cfg.diagnostics.signature_problems
        if self.ranks.main:
            write_signatures(
                self.out, step, trajectory_signatures([e for e in episodes if e.group < n])
            )
        out["time/val_s"] = time.perf_counter() - t0
        self._write_samples(step, "val", episodes)
        if self.ranks.main:  # every answer, for marlow rescore
            write_answers(self.out, step, episodes)
        return out

    def _reward_failures(self, step: int, split: str, episodes: list[Episode]) -> None:
        """A user's reward calls that failed since the last look (``marlow.rewards.user``): one
        event each in events.jsonl and one warning line. A training step in which more than
        ``task.reward_max_missing`` of the episodes (every rank's) have no reward stops the run
        before it learns, so the last checkpoint stands as it was."""
        failed = getattr(self.grade, "events", None)
        if failed:
            if self.ranks.main:
                for event in failed:
                    self.events.write({"step": step, "split": split, **event})
            items = sum(e["items"] for e in failed)
            self.log(
                f"WARNING step {step} ({split}): {len(failed)} reward call(s) failed, {items} "
                f"item(s) without a reward; last: {self.grade.last_error}"
            )
            failed.clear()
        if split != "train":
            return
        counts = self.ranks.gather(
            (sum(missing_reason(ep.reward) is not None for ep in episodes), len(episodes))
        )
        missing, total = (sum(c[i] for c in counts) for i in (0, 1))
        limit = self.cfg.task.reward_max_missing
        if total and missing / total > limit:
            last = getattr(self.grade, "last_error", None) or "rewards returned None or NaN"
            raise RewardsMissing(
                f"step {step}: {missing} of {total} episodes have no reward (more than "
                f"task.reward_max_missing={limit:g}) from {getattr(self.grade, 'name', 'the reward')}"
                f"; last error: {last}; the last checkpoint is kept"
            )

    def _write_samples(self, step: int, split: str, episodes: list[Episode]) -> None:
        if not self.ranks.main:
            return
        for ep in episodes[: self.cfg.sample_episodes]:
            record = {
                "step": step,
                "split": split,
                **{k: v for k, v in asdict(ep).items() if k != "turns"},
            }
            missing = missing_reason(ep.reward)
            if missing is not None:  # null in the file, and why
                record.update(reward=None, reward_missing=missing)
            record["turns"] = ep.transcript()
            self.samples.write(record)

    # -- the loop ---------------------------------------------------------------------------

    def run(
        self,
        *,
        resume: bool = False,
        resume_from: int | None = None,
        on_step: Callable[[int, dict], None] | None = None,
    ) -> Path:
        """Train to ``cfg.steps``. ``resume``: continue the run in the folder, if one was started
        there (``marlow.training.resume`` says what is checked); ``resume_from``: from that
        checkpoint step instead of the latest."""
        done = self._start_ranks(resume or resume_from is not None, resume_from)
        if not self.ranks.main:  # rank 0 writes the run; the others train beside it
            self.sinks = None
            self._loop(on_step)
            self.ranks.leave()
            return self.out
        with open_sinks(self.out, self.cfg.sinks, self.cfg.model_dump()) as self.sinks:
            self.log(f"device {self.device} (device={self.cfg.device}), base {self.cfg.dtype}")
            for line in self.sinks.describe():
                self.log(line)
            self.sinks.truncate_after(done)
            started, first = time.monotonic(), self.step
            if self.step < self.cfg.steps:
                self.log(Phase(self._describe_run()))
            self._loop(on_step)
            if self.step > first:
                seconds = time.monotonic() - started
                self.log(Phase(f"trained to step {self.step} in {seconds:.0f} s -> {self.named}"))
        self._release_folder()
        self.ranks.leave()  # after rank 0 closed the run's files
        return self.out

    def _describe_run(self) -> str:
        """The line that opens training: what trains, from which step, to which, where."""
        c = self.cfg
        where = f"steps {self.step + 1}-{c.steps}" if self.step else f"{c.steps} steps"
        return (
            f"training {self.workflow.title} ({c.policy.routing}) on {c.model.name} ({c.task.name})"
            f", {where}, validating every {c.val_every} on {len(self.val_set)} problems "
            f"-> {self.named}"
        )

    def _start_ranks(self, resume: bool, resume_from: int | None) -> int:
        """:meth:`_open_run_folder` on rank 0; the other data-parallel ranks then load the checkpoint it
        resumed from (or raise the error it raised)."""
        if self.ranks.size == 1:
            return self._open_run_folder(resume, resume_from)
        outcome: int | BaseException | None = None
        if self.ranks.main:
            try:
                outcome = self._open_run_folder(resume, resume_from)
            except Exception as err:
                self.ranks.broadcast(err)
                raise
        outcome = self.ranks.broadcast(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        if not self.ranks.main and outcome >= 0:
            path = checkpoint.checkpoint_dir(self.out, outcome)
            self.step = checkpoint.load(path, self.model, self.adapters, self.optim)
        return outcome

    def _open_run_folder(self, resume: bool, resume_from: int | None) -> int:
        """Create or reopen the run folder; returns the last step whose records stand (-1: none).
        Every check comes before the first write: a refused resume leaves the folder as it was.
        The folder is held (:func:`marlow.fileio.held`) from here until the run ends: a second
        trainer on it, a resume of a run still training included, is refused in one line."""
        if self.out.is_dir():
            self._hold_folder()
        if not resume and (self.out / "metrics.jsonl").exists():
            raise FileExistsError(
                f"{self.named} already holds a run; pass --resume to continue it or choose another "
                "--out"
            )
        stored = resume_lib.previous_config(self.out) if resume else None
        found, changes = None, []
        if stored is not None:
            found, changes = resume_lib.preflight(self.out, stored, self.cfg, resume_from)
        elif resume_from is not None:
            raise resume_lib.ResumeError(f"--resume-from {resume_from}: {self.named} holds no run")
        if found is not None:
            self.step = checkpoint.load(found, self.model, self.adapters, self.optim)
        done = self.step if found is not None else -1  # records after this are redone
        for later in checkpoint.all_done(self.out)[::-1]:  # a --resume-from redoes their steps
            if checkpoint.step_of(later) > done:
                checkpoint.remove(later)
        checkpoint.tidy(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self._hold_folder()
        runbase.record(self.out, self.cfg.model, self.family)  # once per run
        resume_lib.record_workflow_file(self.out, self.cfg)  # a file workflow's text, once
        write_text(self.out / "config.yaml", dump_config(self.cfg))
        record_isolation(self.out, self.isolation)
        for sink in (self.metrics, self.samples, self.events):
            if sink.truncate_after(done):
                self.log(f"{sink.path.name}: dropped a half-written last line (a killed run)")
        for path in (self.out / "signatures").glob("step_*.json"):
            if int(path.stem[len("step_") :]) > done:
                path.unlink()
        remove_answers_after(self.out, done)
        said = resume_lib.finished(self.out, self.cfg, resume_from) if found is not None else None
        if said:  # nothing to train: repaired as any resume (above), but no resume event
            self.log(said)
        elif found is not None:
            self.events.write(
                {"step": done, "action": "resume", "checkpoint": found.name, "changed": changes}
            )
            changed = f"; changed: {', '.join(changes)}" if changes else ""
            self.log(f"resumed from {found.name} (step {self.step}){changed}")
        return done

    def _hold_folder(self) -> None:
        """Hold the run folder until the run ends (:meth:`run`) or the trainer closes."""
        if self._folder is None:
            stack = ExitStack()
            stack.enter_context(held(self.out, "marlow train", self.named))
            self._folder = stack

    def _release_folder(self) -> None:
        if self._folder is not None:
            self._folder.close()
            self._folder = None

    def _loop(self, on_step: Callable[[int, dict], None] | None) -> None:
        if self.step == 0:
            if self.task.data_report is not None and self.ranks.main:  # rows read, kept, skipped
                self.events.write({"step": 0, "action": "data", **self.task.data_report})
            self._record(0, self.validate(0), on_step)
        for step in range(self.step + 1, self.cfg.steps + 1):
            record = self.train_step(step)
            validated = step % self.cfg.val_every == 0 or step == self.cfg.steps
            if validated:
                record.update(self.validate(step))
            self._record(step, record, on_step)
            self.step = step
            if validated:  # rank 0 decides; every rank acts
                action = self.ranks.broadcast(self._alarms(step) if self.ranks.main else None)
            else:
                action = None
            last = checkpoint.latest(self.out)
            self.nonfinite.check(step, last.name if last is not None else "none yet")
            saved = action or step % self.cfg.ckpt_every == 0 or step == self.cfg.steps
            if saved and self.ranks.main:
                self._checkpoint(step)
            if action == "rollback":
                self._roll_back(step)
            if action:
                self.log(f"ended at step {step} (detect.on_alarm={action})")
                return

    def _alarms(self, step: int) -> str | None:
        """Run every detector after a validation; log each new alarm once in ``events.jsonl`` and
        the console. Returns the action to take (``stop``/``rollback``) when one fired, else None."""
        verdicts = run_detectors(
            read_metrics(self.out),
            read_signatures(self.out),
            {role: self.workflow.slots_of(role) for role in self.workflow.roles},
            self.cfg.detect,
        )
        path = self.events.path
        logged = {e.get("detector") for e in read_jsonl(path)} if path.exists() else set()
        new = [v for v in verdicts if v.fired and v.name not in logged]
        for v in new:
            self.events.write(
                {"step": step, "detector": v.name, "fired_at": v.step, "evidence": v.evidence}
            )
            self.log(f"ALARM {v.name} at step {v.step}: {describe(v)}")
        on_alarm = self.cfg.detect.on_alarm
        return on_alarm if new and on_alarm != "warn" else None

    def _checkpoint(self, step: int) -> None:
        """Save the step's checkpoint, then prune to the last ``train.keep_checkpoints`` and the
        best-validation one (which ``detect.on_alarm=rollback`` restores)."""
        checkpoint.save(self.out, step, self.model, self.adapters, self.optim)
        keep = self.cfg.train.keep_checkpoints
        if keep is not None:
            best = self._best_checkpoint()
            checkpoint.prune(self.out, keep, protect=[best[0]] if best else [])

    def _best_checkpoint(self) -> tuple[int, float] | None:
        """(step, validation accuracy) of the saved checkpoint validated best (earliest on ties)."""
        saved = {checkpoint.step_of(p) for p in checkpoint.all_done(self.out)}
        val = [(s, a) for s, a in series(read_metrics(self.out), "val/all/accuracy") if s in saved]
        return max(val, key=lambda sa: (sa[1], -sa[0])) if val else None

    def _roll_back(self, step: int) -> None:
        """Load the checkpoint with the best validation accuracy into the model and name it in
        ``best.json`` (the current state was checkpointed first: nothing is lost). Rank 0 picks
        it; every data-parallel rank loads it."""
        best = self.ranks.broadcast(self._best_checkpoint() if self.ranks.main else None)
        if best is None:
            self.log("rollback: no validated checkpoint; keeping the current adapters")
            return
        best_step, best_acc = best
        path = checkpoint.checkpoint_dir(self.out, best_step)
        if self.adapters:
            load_adapter_weights(self.model, path / "adapters", self.adapters)
            self.engine.refresh(self.adapters)
        if not self.ranks.main:
            return
        write_json(
            self.out / "best.json",
            {
                "step": best_step,
                "val_accuracy": best_acc,
                "checkpoint": str(path.relative_to(self.out)),
            },
        )
        self.events.write({"step": step, "action": "rollback", "to_step": best_step})
        self.log(f"rolled back to step {best_step} (validation accuracy {best_acc:.3f})")

    def _record(self, step: int, record: dict, on_step) -> None:
        if not self.ranks.main:
            return
        self._warn_truncation(step, record)
        self.metrics.write({"step": step, **record})
        self.sinks.write({"step": step, **record})
        if on_step is not None:
            on_step(step, record)


# -- the code reward's sandbox: its isolation, once per run ------------------------------


def sandbox_isolation(config: RunConfig, log: Log) -> Isolation:
    """The isolation the code reward's sandbox gets on this machine, logged in one line. A run
    whose ``rewards.sandbox.require`` cannot be met stops here, before the model loads, with one
    line saying what failed and how to get it."""
    try:
        iso = isolation_in_force(config.rewards.sandbox.require)
    except SandboxUnavailable as err:
        raise ConfigError(str(err)) from None
    log(iso.line())
    return iso


def record_isolation(out: Path, iso: Isolation | None) -> None:
    """The run's sandbox metadata, ``sandbox.json`` beside ``config.yaml`` (code tasks only)."""
    if iso is not None:
        write_json(out / "sandbox.json", asdict(iso))
