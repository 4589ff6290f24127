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

Sampling draws from one ``torch.Generator`` seeded with ``params.seed`` per call, consumed pass
by pass, chunk by chunk (``max_batch`` rows): the same requests, params and ``max_batch`` give
the same samples. Requests that carry their own ``seed`` (all of a call, or none) are sampled by
inversion instead: row r draws its ``max_new_tokens`` uniforms u from a generator seeded with its
seed, and token t is the first id whose cumulative probability exceeds u_t times the total. That
is the same categorical distribution, and a row's sample no longer depends on which rows share
its batch (up to the float round-off of its logits), so a problem sharded to another
data-parallel rank draws the same tokens.

Rows whose prompts and adapters are the same (a GRPO group's samples) share one prefill: each
distinct pair of a chunk is forwarded once and its KV cache and last logits are repeated for its
rows (on this CPU the samples are bit-equal to a prefill per row; the prefill of
``bench/vs_trl.py``'s 256 rows over 32 prompts took 6 ms instead of 50 ms a step).

The decode loop keeps sampled ids, log-probs, lengths and stop flags on the device; the host reads
whether rows have stopped once every ``read_every`` tokens (default: every token on the CPU,
where the read costs nothing, every :data:`READ_EVERY` elsewhere, where it waits for the device)
and at the end of a chunk, to hand the sampled ids and log-probs over as Python lists. Rows that
have stopped are fed pads; they leave the working batch, KV cache included, whenever they make up
an eighth of it at a read, so a few long completions do not carry every finished row through the
remaining steps. With ``compile`` (on CUDA by default) the lean decode step runs at fixed
shapes, its layers compiled and, on CUDA, the whole step replayed from CUDA graphs
(:mod:`marlow.rollout.lean`): its KV cache holds the call's columns rounded up to :data:`CAPACITY_STEP`, and the
working batch is padded with filler rows (always stopped, writing to a spare output row) up to
one of a few sizes (:func:`_bucket`), so that a call and its compactions need few compiled steps
and CUDA graphs.

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

from marlow.models import completion_logprobs
from marlow.policy.adapters import (
    activate,
    active_adapter,
    adapter_names,
    can_merge,
    lora_in_base_dtype,
    merged,
)
from marlow.rollout.base import check_requests
from marlow.rollout.lean import LeanQwen3
from marlow.types import BASE, Completion, FinishReason, GenRequest, SamplingParams

# transformers 5.24 renamed the model forward's ``past_key_values`` to ``cache`` (the old name
# works until 5.40, with a FutureWarning); marlow takes any transformers 5.
CACHE_KWARG = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"

READ_EVERY = 8
"""Off the CPU, the host reads whether rows have stopped once every this many tokens (a read
waits for the device); rows that stop in between are fed pads until then."""
CAPACITY_STEP = 64
"""A compiled call's KV cache holds its columns rounded up to a multiple of this, so that calls
of nearby lengths share a compiled step."""


class HFEngine:
    """RolloutEngine over a PeftModel (or a plain causal LM when there are no adapters).

    ``stop_ids`` defaults to the tokenizer's eos token (for chat models, the end-of-turn token).
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
    """

    @classmethod
    def from_run(cls, model, tokenizer, *, config, device) -> HFEngine:
        """The engine of a run: ``rollout.max_batch``, ``rollout.merge_lora`` (auto: on for a
        float32 run on the CPU, where sampling from the merged weights is exact enough and
        faster) and ``rollout.compile`` (auto: compiled decode steps on CUDA)."""
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
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if stop_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos token; pass stop_ids explicitly")
            stop_ids = [tokenizer.eos_token_id]
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
        self.stop_ids = [int(i) for i in stop_ids]
        # The pad id only fills masked positions and finished rows; any valid id works.
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.stop_ids[0]

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
                        for start in range(0, len(rows), self.max_batch):
                            chunk = rows[start : start + self.max_batch]
                            batch = [requests[i] for i in chunk]
                            for i, comp in zip(
                                chunk,
                                self._sample(batch, adapters, params, generator, seeded),
                                strict=True,
                            ):
                                out[i] = comp
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
            with torch.inference_mode():
                for i, (req, completion) in enumerate(zip(requests, completions, strict=True)):
                    if not completion:
                        continue
                    activate(self.model, req.adapter)
                    ids = torch.tensor([[*req.prompt_ids, *completion]], device=self.device)
                    p = torch.tensor([len(req.prompt_ids)], device=self.device)
                    target = ids[:, len(req.prompt_ids) :]  # (1, L)
                    every = torch.ones_like(target, dtype=torch.bool)
                    logp, _ = completion_logprobs(
                        self.model, ids, torch.ones_like(ids), p, target, every, temperature
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
        device, n_new = self.device, params.max_new_tokens
        prompts = [req.prompt_ids for req in batch]
        B, P = len(prompts), max(len(p) for p in prompts)
        # Rows with the same prompt and adapter (a GRPO group) share its prefill: each distinct
        # pair is forwarded once, then its KV cache and logits are repeated for its rows.
        own = [adapters.index(req.adapter) for req in batch] if len(adapters) > 1 else [0] * B
        distinct: dict[tuple, int] = {}  # each pair's index among the distinct
        which: list[int] = []  # per row, its pair's index
        firsts: list[int] = []  # each pair's first row
        for r, key in enumerate(zip(map(tuple, prompts), own, strict=True)):
            if key not in distinct:
                distinct[key] = len(firsts)
                firsts.append(r)
            which.append(distinct[key])

        compiled = self.compiled
        length = P + n_new
        if compiled:  # few shapes: a compiled step is made (and captured) once per shape
            length = -(-length // CAPACITY_STEP) * CAPACITY_STEP
        forward = None
        if self.lean:
            forward = LeanQwen3.for_model(
                self.model,
                len(firsts),
                length,
                adapters=adapters if len(adapters) > 1 else None,
                row_adapters=[own[r] for r in firsts],
                compiled=compiled,
            )
        if forward is None:
            if len(adapters) > 1:  # _groups mixes adapters only where the lean forward runs
                raise RuntimeError(f"adapters {adapters} mixed without the lean forward")
            forward, compiled = _Transformers(self.model), False
        bucket = _bucket if compiled else int
        # The working batch: ``rows`` (indices into the outputs) of the rows still sampling, the
        # rows that have stopped until they are dropped, and fillers up to the batch's bucket
        # (compiled: few shapes), which write to the spare output row B and are always done.
        b = bucket(B)
        rows = torch.cat([torch.arange(B), torch.full((b - B,), B)]).to(device)
        done = (rows == B).to(device)
        expand = torch.tensor(which + [0] * (b - B), device=device)  # each working row's pair

        # Left padding: the last prompt token of every row sits at column P - 1.
        input_ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, length), dtype=torch.long)  # grows one column per step
        for r, p in enumerate(prompts):
            input_ids[r, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[r, P - len(p) : P] = 1
        input_ids, attn = input_ids.to(device), attn.to(device)
        position_ids = (attn[:, :P].cumsum(-1) - 1).clamp(min=0)  # (B, P); pads 0, masked
        f = torch.tensor(firsts, device=device)
        logits = forward(input_ids[f], attn[f], position_ids[f], 0)
        if len(firsts) < b:
            forward.select(expand)
            logits = logits[expand]
        seen = torch.cat([torch.arange(B), torch.zeros(b - B, dtype=torch.long)]).to(device)
        attn, next_pos = attn[seen], position_ids[seen, -1:] + 1  # (b, length), (b, 1)

        # outputs, one spare row (B) for the fillers
        tokens = torch.full((B + 1, n_new), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((B + 1, n_new), dtype=torch.float32, device=device)
        lengths = torch.zeros(B + 1, dtype=torch.long, device=device)
        stopped = torch.zeros(B + 1, dtype=torch.bool, device=device)
        stop = torch.tensor(self.stop_ids, device=device)
        uniforms = None  # (B + 1, n_new): each row's own draws when the requests carry seeds
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
        for t in range(n_new):
            u = None if uniforms is None else uniforms[rows, t]
            tok, lp = _pick(logits, params.temperature, generator, u)
            tok = torch.where(done, self.pad_id, tok)  # finished rows keep being padded
            tokens[rows, t] = tok  # no host read: every row written, finished ones as pads
            logps[rows, t] = lp.masked_fill(done, 0.0)
            lengths.index_add_(0, rows, (~done).long())
            hit = torch.isin(tok, stop) & ~done
            stopped[rows] |= hit
            done = done | hit
            if t == n_new - 1:
                break
            if (t + 1) % read_every == 0:  # the host reads the device only here
                live = int((~done).sum())
                if live == 0:
                    break
                # drop stopped rows, KV cache included, once they are an eighth of the batch
                # (until then they are fed pads), so a few long completions do not carry it
                if 8 * (len(rows) - live) >= len(rows) and bucket(live) < len(rows):
                    keep = _compaction(done, bucket(live))
                    forward.select(keep)
                    rows, tok, attn, next_pos = rows[keep], tok[keep], attn[keep], next_pos[keep]
                    done = done[keep]
                    rows[live:] = B
                    done[live:] = True
            attn[:, P + t] = 1
            logits = forward(tok[:, None], attn, next_pos, P + t)
            next_pos = next_pos + 1

        counts = lengths[:B].tolist()
        token_rows = [row[:n] for row, n in zip(tokens[:B].tolist(), counts, strict=True)]
        logp_rows = [row[:n] for row, n in zip(logps[:B].tolist(), counts, strict=True)]
        texts = self.tokenizer.batch_decode(token_rows, skip_special_tokens=True)
        reasons: list[FinishReason] = ["stop" if s else "length" for s in stopped[:B].tolist()]
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

    def __call__(self, ids, mask, positions, at: int) -> torch.Tensor:
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
