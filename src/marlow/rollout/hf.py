"""Rollout with plain Hugging Face transformers: one batched sampling loop for every adapter a call
names.

The loop is written out instead of calling ``model.generate`` so that what is sampled, and the
log-prob recorded for it, is exactly the textbook definition the trainer re-computes:

    p(token) = softmax(logits / T)           (T > 0; pure temperature sampling: no top-k, no top-p,
    logprob  = log_softmax(logits / T)[tok]   like verl's rollout with top_k=-1, top_p=1)
    T == 0   -> greedy argmax, logprob = log_softmax(logits)[tok]

Batches are left-padded with an explicit attention mask and position ids (cumsum(mask) - 1), so a
row's tokens do not depend on what it is batched with (up to float round-off).

Adapters: where the lean forward (:class:`marlow.rollout.lean.LeanQwen3`) computes every adapter
of the call, their rows share one pass, each row applying its own LoRA inside the same forward
(one adapter, or the base alone, is the same loop). Otherwise, or where ``merge`` folds adapters
into the base (one adapter at a time), the requests are grouped by adapter, one pass per adapter
in order of first appearance; the model's own forward (any causal LM, any adapter, a
``DynamicCache``) runs where the lean one does not. A workflow calls the engine once per stage
and a stage serves one role, so a training step's calls name one adapter each.

A pass holds at most ``max_batch`` rows at once. With ``refill`` (where the lean forward runs),
a pass of more rows keeps the rest waiting in order, and at a host read (below) rows that have
stopped make room for them once they are an eighth of the working batch (or as many as wait):
the waiting rows' prompts are prefilled (:meth:`marlow.rollout.lean.LeanQwen3.admit`) into the
stopped rows' places, and each row writes its tokens at its own cache column from then on. A
few long completions then no longer hold the next ``max_batch`` rows back: on this CPU, 256
rows of 4 adapters at ``max_batch`` 64 whose completions stopped at scattered lengths (mean 41,
longest 128) took 0.83 of the time of batches one after the other on tiny-s and 0.78 on a
Python-bound 28-layer proxy, in 262 decode steps instead of 508 (``bench/refill.py``). Without
it, the pass runs as batches of ``max_batch`` rows, one after the other. The eighth is a
measured choice: on the same call, admitting once a quarter, an eighth or a sixteenth of the 64
rows had stopped took 0.73, 0.70 and 0.68 s on tiny-s (6.18, 6.14 and 6.05 s on the proxy),
admitting as soon as one row had stopped 0.80 s (6.70 s: a prefill per row).

Sampling draws from one ``torch.Generator`` seeded with ``params.seed`` per call, consumed pass
by pass, step by step over the working batch: the same requests, params, ``max_batch`` and
``refill`` give the same samples. Requests that carry their own ``seed`` (all of a call, or
none) are sampled by inversion instead: row r draws its ``max_new_tokens`` uniforms u from a
generator seeded with its seed, and token t is the first id whose cumulative probability exceeds
u_t times the total. That is the same categorical distribution, and a row's sample no longer
depends on which rows share its batch (up to the float round-off of its logits), so a problem
sharded to another data-parallel rank draws the same tokens, and a row samples the same with
rows refilled or not.

Rows whose prompts and adapters are the same (a GRPO group's samples) share one prefill: each
distinct pair of the rows admitted together is forwarded once and its KV cache and last logits
are repeated for its rows (on this CPU the samples are bit-equal to a prefill per row; the
prefill of ``bench/vs_trl.py``'s 256 rows over 32 prompts took 6 ms instead of 50 ms a step).

The decode loop keeps sampled ids, log-probs, lengths and stop flags on the device; the host reads
whether rows have stopped once every ``read_every`` tokens (default: every token on the CPU,
where the read costs nothing, every :data:`READ_EVERY` elsewhere, where it waits for the device)
and at the end of a pass, to hand the sampled ids and log-probs over as Python lists. Rows that
have stopped are fed pads until their places are taken; once no row waits, they leave the working
batch, KV cache included, whenever they make up an eighth of it at a read, so a few long
completions do not carry every finished row through the remaining steps. With ``compile`` (on
CUDA by default) the lean decode step runs at fixed shapes, its layers compiled and, on CUDA,
the whole step replayed from CUDA graphs (:mod:`marlow.rollout.lean`): its KV cache holds the
call's columns (its longest prompt and the new tokens) rounded up to :data:`CAPACITY_STEP`, and
the working batch is padded with filler rows (always stopped, writing to a spare output row) up
to one of a few sizes (:func:`_bucket`), so that a call and its compactions need few compiled
steps and CUDA graphs. Each row's attention in a graphed step reads its cache up to its own
column (rows that have stopped stay where they stopped while others wait).

Device and precision: every tensor of the loop (ids, masks, KV cache, the generator) is on the
model's device; the logits come in the base's dtype and are cast to float32 before the
temperature and the log-softmax, so sampling probabilities and recorded log-probs are float32.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

from marlow.models import completion_logprobs, pad_id
from marlow.policy.adapters import (
    activate,
    active_adapter,
    adapter_names,
    can_merge,
    lora_in_base_dtype,
    merged,
)
from marlow.rollout.base import check_requests, default_stop_ids
from marlow.rollout.lean import LeanQwen3
from marlow.types import BASE, Completion, FinishReason, GenRequest, SamplingParams

# transformers 5.24 renamed the model forward's ``past_key_values`` to ``cache`` (the old name
# works until 5.40, with a FutureWarning); marlow takes any transformers 5.
CACHE_KWARG = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"

READ_EVERY = 8
"""Off the CPU, the host reads whether rows have stopped once every this many tokens (a read
waits for the device); rows that stop in between are fed pads until then."""
STOPPED_SHARE = 8
"""Rows that have stopped leave the working batch (compaction), or make room for waiting rows
(refill), once they are one in this many of it."""
CAPACITY_STEP = 64
"""A compiled call's KV cache holds its columns rounded up to a multiple of this, so that calls
of nearby lengths share a compiled step."""


class HFEngine:
    """RolloutEngine over a PeftModel (or a plain causal LM when there are no adapters).

    ``stop_ids`` defaults to :func:`marlow.rollout.base.default_stop_ids` (the tokenizer's eos
    token, for chat models the end-of-turn token, and the generation config's eos ids).
    ``merge``: sample each adapter with its LoRA folded into the base weights
    (:func:`marlow.policy.adapters.merged`: one matmul per linear instead of three; the base is
    restored bit for bit afterwards). It costs one copy of the adapted weights while a group
    samples, and rounds the sum in the base's dtype, so the trainer turns it on for float32
    bases on the CPU only (``rollout.merge_lora``). Scoring never merges.
    ``lean``: where a pass samples a Qwen3 model (the base, a merged adapter, or unmerged plain
    LoRA adapters, several at once), run marlow's own forward (:mod:`marlow.rollout.lean`: the
    same arithmetic without the per-module Python) instead of the model's; False: always the
    model's forward, one pass per adapter.
    ``compile``: the lean decode step at fixed shapes, its layers through ``torch.compile`` (on
    CUDA the step replayed from CUDA graphs); None: on CUDA only. On this CPU the first
    compiled call took 4.4 s and the compiled step saved 1.4 of 24.3 ms per sampled position of
    a Python-bound model (``bench/lean_lora.py``): it pays after about 3,000 positions of one
    shape, more than a tiny-world call samples, so auto leaves the CPU eager.
    ``read_every``: how often the host reads whether rows have stopped (module docstring).
    ``refill``: in a pass of more rows than ``max_batch``, waiting rows take the places of rows
    that stop (module docstring); None: where the decode step is compiled. It pays on the CPU
    too (``bench/refill.py``), but it changes which random numbers a call-seeded row draws, so
    auto leaves the CPU as the shipped quickstart's figures were measured.
    """

    @classmethod
    def from_run(cls, model, tokenizer, *, config, device) -> HFEngine:
        """The engine of a run: ``rollout.max_batch``, ``rollout.merge_lora`` (auto: on for a
        float32 run on the CPU, where sampling from the merged weights is exact enough and
        faster), ``rollout.compile`` (auto: compiled decode steps on CUDA) and
        ``rollout.refill`` (auto: where the decode step is compiled)."""
        merge = config.rollout.merge_lora
        if merge == "auto":
            cpu_float32 = getattr(device, "type", device) == "cpu" and config.dtype == "float32"
            merge = "on" if cpu_float32 else "off"
        compile = {"auto": None, "on": True, "off": False}[config.rollout.compile]
        return cls(
            model,
            tokenizer,
            max_batch=config.rollout.max_batch,
            merge=merge == "on",
            compile=compile,
            refill={"auto": None, "on": True, "off": False}[config.rollout.refill],
        )

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_batch: int = 256,
        stop_ids: Sequence[int] | None = None,
        merge: bool = False,
        lean: bool = True,
        compile: bool | None = None,
        read_every: int | None = None,
        refill: bool | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if stop_ids is None:
            stop_ids = default_stop_ids(model, tokenizer)
        if not stop_ids:
            raise ValueError("stop_ids must name at least one token id")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.merge = merge
        self.lean = lean
        self.compile = compile
        if read_every is not None and read_every < 1:
            raise ValueError(f"read_every must be >= 1, got {read_every}")
        self.read_every = read_every
        self.refill = refill
        self.stop_ids = [int(i) for i in stop_ids]
        self.pad_id = pad_id(tokenizer)  # fills masked positions and finished rows

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, requests: Sequence[GenRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in request order."""
        self._validate(requests, params)
        out: list[Completion | None] = [None] * len(requests)
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seeded = bool(requests) and requests[0].seed is not None
        was_training, previous = self.model.training, active_adapter(self.model)
        self.model.eval()
        try:
            with torch.inference_mode():
                for adapters, rows in self._groups(requests):
                    # one adapter: switched to (or merged); several: each row's own, in one batch
                    with self._adapted(adapters[0]) if len(adapters) == 1 else nullcontext():
                        while rows:  # the lean forward takes them all; the model's, a batch
                            batch = [requests[i] for i in rows]
                            done = self._sample(batch, adapters, params, generator, seeded)
                            for i, comp in zip(rows, done, strict=False):
                                out[i] = comp
                            rows = rows[len(done) :]
        finally:
            activate(self.model, previous)
            self.model.train(was_training)
        return out  # type: ignore[return-value]  # every slot was filled above

    def _groups(self, requests: Sequence[GenRequest]) -> list[tuple[tuple[str, ...], list[int]]]:
        """The call's requests as sampling passes: (adapters, request indices). Every adapter in
        one pass where the lean forward computes them together and none is to be merged; else
        one pass per adapter, in order of first appearance."""
        by_adapter: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_adapter.setdefault(req.adapter, []).append(i)
        names = tuple(by_adapter)
        merging = self.merge and any(n != BASE and can_merge(self.model, n) for n in names)
        if len(names) > 1 and self.lean and not merging and LeanQwen3.supports(self.model, names):
            return [(names, list(range(len(requests))))]
        return [((name,), rows) for name, rows in by_adapter.items()]

    def score(
        self,
        requests: Sequence[GenRequest],
        completions: Sequence[Sequence[int]],
        temperature: float,
    ) -> list[list[float]]:
        """Teacher-forced log-probs of each completion after its prompt, under the request's
        adapter, as :meth:`generate` records them: log_softmax(logits / T) (raw logits at T == 0),
        in float32. One unpadded forward per request, with the attention mask and positions the
        trainer's scoring uses for one row, through the same function
        (:func:`marlow.models.completion_logprobs`), so on the trainer's own model the two agree
        bit for bit: the adapter-sync check (``marlow.training.sync``)."""
        if len(completions) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(completions)} completions")
        self._validate(requests, SamplingParams(temperature, 1, 0))
        out: list[list[float]] = [[] for _ in requests]
        was_training, previous = self.model.training, active_adapter(self.model)
        self.model.eval()
        try:
            # no_grad, not inference mode: the same values, and compiled layers (grpo.compile)
            # reuse the trainer's graphs without gradients instead of compiling their own
            with torch.no_grad():
                for i, (req, completion) in enumerate(zip(requests, completions, strict=True)):
                    if not completion:
                        continue
                    activate(self.model, req.adapter)
                    ids = torch.tensor([[*req.prompt_ids, *completion]], device=self.device)
                    p = torch.tensor([len(req.prompt_ids)], device=self.device)
                    target = ids[:, len(req.prompt_ids) :]  # (1, L)
                    every = torch.ones_like(target, dtype=torch.bool)
                    logp, _ = completion_logprobs(
                        self.model,
                        ids,
                        torch.ones_like(ids),
                        p,
                        target,
                        every,
                        temperature,
                        entropy=False,
                    )
                    out[i] = logp[0].tolist()
        finally:
            activate(self.model, previous)
            self.model.train(was_training)
        return out

    def refresh(self, adapters: Sequence[str]) -> None:
        """Nothing to do: every call samples from the trainer's model as it is now."""

    def close(self) -> None:
        """Nothing to release: the model is the trainer's."""

    @contextmanager
    def _adapted(self, adapter: str) -> Iterator[None]:
        """The model answering as ``adapter``: merged into the base (``merge``) or switched to."""
        if self.merge and adapter != BASE and can_merge(self.model, adapter):
            with merged(self.model, adapter):
                yield
        else:
            activate(self.model, adapter)
            yield

    def _validate(self, requests: Sequence[GenRequest], params: SamplingParams) -> None:
        check_requests(
            requests, params.temperature, params.max_new_tokens, adapter_names(self.model)
        )

    def _sample(
        self,
        batch: list[GenRequest],
        adapters: tuple[str, ...],
        params: SamplingParams,
        generator: torch.Generator,
        seeded: bool,
    ) -> list[Completion]:
        """Completions of the first rows of ``batch``, in order: all of them where the forward
        refills its rows (the lean one), else the first ``max_batch``."""
        device, n_new = self.device, params.max_new_tokens
        compiled = self.compiled
        width = min(len(batch), self.max_batch)
        refills = self.lean and (compiled if self.refill is None else self.refill)
        if not refills:
            batch = batch[:width]  # no rows admitted later: a batch, as many as it holds
        N = len(batch)
        own = [adapters.index(req.adapter) for req in batch] if len(adapters) > 1 else [0] * N
        # every prompt of the call fits the cache, its first rows' and those admitted later
        length = max(len(req.prompt_ids) for req in batch) + n_new
        if compiled:  # few shapes: a compiled step is made (and captured) once per shape
            length = -(-length // CAPACITY_STEP) * CAPACITY_STEP
        bucket = _bucket if compiled else int
        b = bucket(width)  # working rows, fillers included
        forward = None
        if self.lean:
            forward = LeanQwen3.for_model(
                self.model,
                b,
                length,
                adapters=adapters if len(adapters) > 1 else None,
                compiled=compiled,
            )
        if forward is None:
            if len(adapters) > 1:  # _groups mixes adapters only where the lean forward runs
                raise RuntimeError(f"adapters {adapters} mixed without the lean forward")
            forward, compiled, bucket, b = _Transformers(self.model), False, int, width
            if refills:  # the model's cache takes its rows once
                refills, N, batch = False, width, batch[:width]

        # The working batch: ``rows`` (indices into the outputs) of the rows sampling, the rows
        # that have stopped until they are replaced or dropped, and fillers (compiled: up to
        # the batch's bucket), which write to the spare output row N and are always done.
        # ``queue``: the call's rows not yet admitted, in order.
        rows = torch.full((b,), N, dtype=torch.long, device=device)
        done = torch.ones(b, dtype=torch.bool, device=device)
        attn = torch.zeros((b, length), dtype=torch.long, device=device)  # real columns
        next_pos = torch.zeros((b, 1), dtype=torch.long, device=device)
        columns = torch.zeros(b, dtype=torch.long, device=device)  # where each row writes next
        top = 0  # on the host, at least the largest of them (read from the device at reads)
        queue = list(range(N))
        logits = None

        def admit(slots: list[int]) -> None:
            """Prefill the queue's next rows into the working ``slots`` (their rows of one
            prompt and adapter, a GRPO group's, prefilled once)."""
            nonlocal rows, done, logits, top
            take, queue[:] = queue[: len(slots)], queue[len(slots) :]
            keys = [(tuple(batch[r].prompt_ids), own[r]) for r in take]
            distinct: dict[tuple, int] = {}  # (prompt, adapter) -> its index among the distinct
            for key in keys:
                distinct.setdefault(key, len(distinct))
            which = [distinct[key] for key in keys]
            P = max(len(p) for p, _ in distinct)
            ids = torch.full((len(distinct), P), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(distinct), P), dtype=torch.long)
            for i, (p, _) in enumerate(distinct):  # left padding: the last token at column P-1
                ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[i, P - len(p) :] = 1
            ids, mask = ids.to(device), mask.to(device)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # pads 0, masked
            at_slots = torch.tensor(slots, device=device)
            expand = torch.tensor(which, device=device)
            fresh = forward.admit(at_slots, ids, mask, pos, [a for _, a in distinct], expand)
            rows = rows.index_copy(0, at_slots, torch.tensor(take, device=device))
            done = done.index_fill(0, at_slots, False)
            attn[at_slots] = 0
            attn[at_slots, :P] = mask[expand]
            next_pos[at_slots] = pos[expand, -1:] + 1
            columns[at_slots] = P
            top = max(top, P)
            if logits is None:  # the fillers' logits: any finite numbers
                logits = fresh.new_zeros((b, fresh.shape[1]))
            logits = logits.index_copy(0, at_slots, fresh)

        admit(list(range(width)))
        # outputs, one spare row (N) for the fillers and the rows that have stopped
        tokens = torch.full((N + 1, n_new), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((N + 1, n_new), dtype=torch.float32, device=device)
        lengths = torch.zeros(N + 1, dtype=torch.long, device=device)
        stopped = torch.zeros(N + 1, dtype=torch.bool, device=device)
        stop = torch.tensor(self.stop_ids, device=device)
        uniforms = None  # (N + 1, n_new): each row's own draws when the requests carry seeds
        if seeded:
            uniforms = torch.stack(
                [
                    torch.rand(
                        n_new, generator=torch.Generator(device).manual_seed(seed), device=device
                    )
                    for seed in [req.seed for req in batch]
                ]
                + [torch.zeros(n_new, device=device)]
            )
        read_every = self.read_every or (1 if device.type == "cpu" else READ_EVERY)
        last = n_new  # by this token every admitted row has stopped
        rows_at = torch.arange(b, device=device)  # each working row's index
        t = 0
        while True:
            steps = lengths[rows]  # each row's tokens so far (its next token's index)
            at_step = steps.clamp(max=n_new - 1)  # a stopped row's, in range: it writes the spare
            u = None if uniforms is None else uniforms[rows, at_step]
            tok, lp = _pick(logits, params.temperature, generator, u)
            tok = torch.where(done, self.pad_id, tok)  # finished rows keep being padded
            into = torch.where(done, N, rows)  # stopped rows write to the spare row
            tokens[into, at_step] = tok  # no host read: every row written
            logps[into, at_step] = lp.masked_fill(done, 0.0)
            lengths.index_add_(0, rows, (~done).long())
            hit = torch.isin(tok, stop) & ~done
            stopped[rows] |= hit
            done = done | hit | (steps + 1 >= n_new)
            t += 1
            if t == last and not queue:
                break
            read = t % read_every == 0 or t == last
            if read:  # the host reads the device only here
                if refills:  # stopped rows stay where they stopped: the span is the live rows'
                    live, top = torch.stack([(~done).sum(), columns.max()]).tolist()
                else:
                    live = int((~done).sum())
                if live == 0 and not queue:
                    break
                # drop stopped rows, KV cache included, once they are an eighth of the batch
                # (until then they are fed pads), so a few long completions do not carry it;
                # while rows wait, stopped rows are replaced instead (below)
                stale = STOPPED_SHARE * (len(rows) - live) >= len(rows)
                if not queue and stale and bucket(live) < len(rows):
                    keep = _compaction(done, bucket(live))
                    forward.select(keep)
                    rows, tok, attn, next_pos = rows[keep], tok[keep], attn[keep], next_pos[keep]
                    columns, done = columns[keep], done[keep]
                    rows[live:] = N
                    done[live:] = True
                    rows_at = rows_at[: len(rows)]
            # every row's token at its own column (stopped rows' land in their own cache rows)
            attn[rows_at, columns] = 1
            # one column for all where no row was admitted later (the cheaper cache write)
            logits = forward(tok[:, None], attn, next_pos, top, columns if refills else None)
            # Refilling, a stopped row stays at its column (its pads overwrite it), so that the
            # rows it waits beside, admitted later at smaller columns, attend over their own
            # span; else every row moves on together, one column a step (as before a read).
            step = (~done).long() if refills else 1
            columns, next_pos = columns + step, next_pos + (step[:, None] if refills else 1)
            top = min(top + 1, length - 1)
            if queue and read:
                # stopped rows make room for waiting ones once they are an eighth of the batch
                # (or as many as wait), so that a few long completions do not hold the rest
                free = done.nonzero()[:, 0].tolist()[: len(queue)]
                if len(free) >= min(len(queue), max(1, len(rows) // STOPPED_SHARE)):
                    admit(free)
                    last = t + n_new

        counts = lengths[:N].tolist()
        token_rows = [row[:n] for row, n in zip(tokens[:N].tolist(), counts, strict=True)]
        logp_rows = [row[:n] for row, n in zip(logps[:N].tolist(), counts, strict=True)]
        texts = self.tokenizer.batch_decode(token_rows, skip_special_tokens=True)
        reasons: list[FinishReason] = ["stop" if s else "length" for s in stopped[:N].tolist()]
        return [
            Completion(token_ids=t, logprobs=lp, finish_reason=r, text=x)
            for t, lp, r, x in zip(token_rows, logp_rows, reasons, texts, strict=True)
        ]

    @property
    def compiled(self) -> bool:
        """Whether decode steps run compiled: ``compile``, or where it is None (auto) on CUDA."""
        return self.device.type == "cuda" if self.compile is None else self.compile


def _bucket(rows: int) -> int:
    """The batch size a compiled step runs ``rows`` rows at: the next of 2, 4, 8, 16, 24, 32,
    48, 64, 96, ... (powers of two, and above 16 their halfway points too: at most a third of a
    batch is filler), so a call and its compactions make few shapes. Never 1: torch.compile
    compiles a batch of one row apart from the others (its dimension cannot vary), and a call
    whose last row samples alone would wait for that compilation."""
    size = 2
    while size < rows:
        if size < 16:
            size *= 2
        elif size & (size - 1) == 0:  # a power of two: on to the halfway point above it
            size += size // 2
        else:  # a halfway point 3 * 2^k: on to 4 * 2^k
            size = size // 3 * 4
    return size


def _compaction(done: torch.Tensor, size: int) -> torch.Tensor:
    """Working-batch indices to keep: every live row first, then finished ones up to ``size``
    (they become fillers)."""
    order = torch.argsort(done.int(), stable=True)  # live rows first, in their order
    return order[:size]


class _Transformers:
    """The model's own forward with a ``DynamicCache``: any causal LM, any adapter state, LoRA
    computing as in the trainer's scoring (:func:`marlow.policy.adapters.lora_in_base_dtype`).
    Called like :class:`marlow.rollout.lean.LeanQwen3`: the next tokens (b, q) at column ``at``,
    the mask of every column, their positions; the last position's logits (b, V) in float32."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)

    def admit(self, slots, ids, mask, positions, row_adapters, expand) -> torch.Tensor:
        """Prefill the call's first rows (``slots`` 0, 1, ...; the model's cache does not take
        rows later): :meth:`marlow.rollout.lean.LeanQwen3.admit`'s arguments."""
        if slots.tolist() != list(range(len(slots))) or self.cache.get_seq_length() > 0:
            raise ValueError("the model's forward takes its rows once, at the start of a call")
        logits = self(ids, mask, positions, 0)
        self.select(expand)
        return logits[expand]

    def __call__(self, ids, mask, positions, at: int, columns=None) -> torch.Tensor:
        """``columns``: unused (every row is at column ``at``: the call admits no rows later)."""
        # the arithmetic of the trainer's scoring, its layers eager even where the trainer
        # compiled them (marlow.models.compile_layers): the cache grows every token
        with lora_in_base_dtype(self.model), torch.compiler.set_stance("force_eager"):
            out = self.model(
                input_ids=ids,
                attention_mask=mask[:, : at + ids.shape[1]],
                position_ids=positions,
                **{CACHE_KWARG: self.cache},
                use_cache=True,
                logits_to_keep=1,  # only the last position's logits are needed
            )
        return out.logits[:, -1, :].float()  # (B, V)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)


def _pick(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row and its sampler log-prob. logits: (B, V) float32 -> (B,), (B,).
    ``uniforms`` (B,) in [0, 1): sample by inversion with these draws instead of ``generator``."""
    if temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        probs = logp.exp()
        if uniforms is None:
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:  # the first id whose cumulative probability exceeds u * total (zero-mass ids never)
            cdf = probs.cumsum(-1)
            target = (uniforms * cdf[:, -1])[:, None]
            tok = torch.searchsorted(cdf, target, right=True).squeeze(-1)
            tok = tok.clamp(max=logits.shape[-1] - 1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
