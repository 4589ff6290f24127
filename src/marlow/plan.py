"""``marlow plan``: will a run fit? A dry run on PyTorch's meta device, from the config alone.

The run's base model is built on ``torch.device("meta")`` from its architecture (shapes, no
storage: no weights are loaded, nothing is downloaded, no file is written) and the first of the
run's LoRA adapters (the routing the workflow's roles and ``policy.routing`` make) is attached to
it exactly as the trainer attaches it (:func:`marlow.policy.adapters.attach_adapters`); the
others have its spec on the same layers, so its count. Parameter counts are read off the model; memory figures follow from them and the config by the formulas below
(bytes; ``b`` is the run dtype's size: 4 float32, 2 bfloat16/float16).

* **base weights** = P x b, with P the base's distinct parameters (tied embeddings once; buffers
  such as RoPE's inverse frequencies are left out).
* **adapter** (each) = 16 x its trainable LoRA parameters: weights, gradients, AdamW's exp_avg and
  exp_avg_sq, all float32 whatever the run dtype. Every adapter is counted with its gradients,
  though only the adapter being updated holds them at one time.
* **activations of one micro-batch**: the most bytes one update pass (forward and backward) over
  N tokens holds at once, with N = the largest forward the trainer makes:
  max(``grpo.micro_tokens``, one turn of prompt + ``rollout.max_new_tokens`` tokens), since a
  turn longer than ``micro_tokens`` is scored alone. ``grpo.micro_tokens=auto`` is sized to
  ``--gpu-mem`` as a CUDA run sizes it to its card (:func:`auto_micro_tokens`), and is 8,192
  without one. The pass holds what it keeps for its whole backward, and on top of that the
  larger of two phases, which never overlap: the backward of one decoder layer, or the LM head
  (forward or backward), so

      activations = N x kept + max(N x layer, N x head + the head's chunks)

  per token (:class:`Activations`), for a Qwen3 decoder under LoRA (a frozen base: no weight
  gradients), with h hidden, a / g query / key-value heads of size d, I the MLP width, L layers,
  V the vocabulary, r each LoRA module's rank:

      own  = b x (4h + 3ad + 3gd + 4I)  what a layer keeps for its backward: the inputs of its 4
             + 4 x (2 + 2a + g)         RMSNorms (2h + ad + gd) and of its linears after the two
                                        norms (2h); SDPA's q, k, v and output (2ad + 2gd);
                                        SwiGLU's gate, up, silu(gate) and their product (4I);
                                        in float32, each norm's rows' 1/rms and SDPA's logsumexp
      lora = b x sum of r               each LoRA module's rank-r A output (its input is the base
                                        linear's own), over a layer's modules; with LoRA dropout,
             + (b + 1) x sum of in      each module's dropped input and its mask too
      grad = 2bI + bh (checkpointed),   the layer's backward: its gradients in flight, at most
             3bI + 2bh (not)            about two or three (N, I) tensors and the residual's
      kept = L x b x h (checkpointed)   each layer's input, the layers running again in the
             L x (own + lora) (not)     backward (``grpo.activation_checkpointing``; auto: on for
                                        a Hugging Face model unless a card holds every layer's:
                                        :func:`update_settings`), or every layer's own
      layer = own + lora + grad         one layer's recompute and backward (checkpointed)
              grad (not)
      head = 3bh + 4                    the final norm's input and its 1/rms, the head's input
                                        at the completion positions and the slopes of their
                                        log-probs (the backward: the slopes and the gradient)
  and the head's chunks: 2 x HEAD_CHUNK_BYTES (fewer when N tokens do not fill one), a chunk's
  float32 logits and their log-softmax, which live together in the forward (the backward of a
  frozen head computes no logits: :func:`marlow.algo.estimators.head_logprobs_and_entropy`);
  and, whatever N, the adapter's factors in the base's dtype (b x its LoRA parameters) over a
  bfloat16 or float16 base without LoRA dropout, cast once and held for a mini-batch's passes
  (:func:`held_bytes`).

  These are what autograd keeps on any device; the backward's ``grad`` was measured by counting
  the live tensors of passes on the CPU (``tests/unit/test_plan_memory.py`` holds the model to
  them). The chunked head: where the model's logits are a plain linear head on its decoder
  (:func:`marlow.models.decoder_and_head`: Qwen3, Qwen2, Llama, Mistral), scoring takes the
  completion tokens through the head a chunk at a time
  (:func:`marlow.algo.estimators.head_logprobs_and_entropy`), so no (N, V) tensor exists. For any
  other model the head's phase holds, per token, V x (2b + 3 x 4) more: the model's logits (all
  positions) and their gathered completion positions in the run dtype, and the three float32
  (N, V) tensors of ``token_logprobs_and_entropy``; no chunks.

  Attention is taken to be a memory-efficient SDPA kernel (no N x N score matrix: true for
  flash/efficient attention on GPUs; PyTorch's math fallback on a CPU does keep one). RMSNorms
  are taken to be a loaded base's, through torch's ``rms_norm``
  (:func:`marlow.models.fuse_norms`): one fused kernel on CUDA, which keeps the input and the
  rows' 1/rms (on a CPU a bfloat16 norm keeps a float32 copy of its input too). A LoRA folded into one weight per layer (``grpo.fold_lora``, a CPU's float32
  default) keeps each layer's folded weight for its backward as well, which is not counted.
  Every token is counted as a completion token (an upper bound for the head's input). A run
  whose routing trains no adapter makes no backward: 0.
* **KV cache of one rollout batch** = ``rollout.max_batch`` x (prompt + ``rollout.max_new_tokens``)
  x L x 2 x g x d x b. The prompt length is not in the config: ``prompt_tokens`` (default
  :data:`PROMPT_TOKENS`) is the assumption, and it is printed with the figure. A DAPO math problem
  in Qwen3's chat template is a few hundred tokens; an aggregator's or synthesizer's prompt
  carries earlier turns (up to N x max_new_tokens): give those lengths (the paper capped prompts
  at 20480 for Voting/Orch-Workers math, Table 7) to size the worst batch.
* **peak** = base weights + every adapter + max(activations, KV cache): a step's rollout and its
  update do not overlap (the generation cache is freed before scoring). With
  ``rollout.backend=vllm`` the engine's memory (:func:`engine_bytes`: its KV cache,
  ``rollout.vllm.kv_cache_gib``, and its copy of the weights) takes the rollout batch's place
  and stays beside the update: peak = base weights + every adapter + engine + activations.
  It leaves out the CUDA context, allocator fragmentation and the optimizer's transient
  buffers: keep a margin.

Model names: a shipped architecture (:mod:`marlow.archs`: ``qwen3-0.6b`` or its hub id
``Qwen/Qwen3-0.6B``, likewise 1.7B and 4B), a tiny scale (its config from the tiny world's
builder, not pre-trained), a local folder with a ``config.json``, or a hub id whose config is
already in the local Hugging Face cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from peft.tuners.lora import LoraLayer
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from marlow.algo.estimators import HEAD_CHUNK_BYTES
from marlow.archs import Shape, arch_config, arch_names, shipped_arch
from marlow.config import ConfigError, RunConfig
from marlow.config.schema import MICRO_TOKENS_OFF_CUDA
from marlow.models import checkpointable_layers, checkpoints_layers, decoder_and_head
from marlow.policy.adapters import LoraSpec, adapter_parameters, attach_adapters
from marlow.policy.routing import make_routing
from marlow.tiny.model import SCALES, model_config
from marlow.tiny.tokenizer import build_tokenizer
from marlow.workflows.validate import check_run_config

PROMPT_TOKENS = 1024
"""Default prompt length (tokens) of a rollout sequence, for the KV cache."""
OPTIMIZER_BYTES = 16
"""float32 weight, gradient, exp_avg and exp_avg_sq per trainable parameter."""
GIB = 2**30


@dataclass(frozen=True)
class Activations:
    """What one update pass holds (module docstring), in bytes: ``kept`` a token through the
    whole backward; on top of it, ``layer`` a token while one decoder layer's backward runs, or
    ``head`` a token and the chunks of a head over ``vocab`` entries (0: not chunked) while the
    LM head runs."""

    kept: int
    layer: int
    head: int
    vocab: int
    held: int = 0  # bytes whatever the tokens (held_bytes)

    def bytes(self, tokens: int) -> int:
        """The most bytes a pass over ``tokens`` tokens holds at once."""
        head = tokens * self.head + head_chunk_bytes(self.vocab, tokens)
        return self.held + tokens * self.kept + max(tokens * self.layer, head)

    def tokens_that_fit(self, room: float) -> int:
        """The most tokens of one pass that hold at most ``room`` bytes (0 if not one does):
        :meth:`bytes` grows with the tokens, so the edge is found by bisection."""
        if self.bytes(1) > room:
            return 0
        low, high = 1, 2
        while self.bytes(high) <= room:
            low, high = high, 2 * high
        while high - low > 1:  # bytes(low) fits, bytes(high) does not
            middle = (low + high) // 2
            low, high = (middle, high) if self.bytes(middle) <= room else (low, middle)
        return low


def activations(
    shape: Shape,
    b: int,
    lora: list[tuple[int, int]],
    chunked_head: bool = True,
    checkpointed: bool = False,
    dropout: bool = False,
    held: int = 0,
) -> Activations:
    """The memory model of one update pass (module docstring) of a run of ``b`` bytes a base
    weight; ``lora`` holds (in features, rank) of every LoRA layer of one adapter;
    ``chunked_head``: the logits go through the head chunk by chunk
    (:func:`marlow.models.decoder_and_head`); ``checkpointed``: the decoder layers are
    checkpointed (``grpo.activation_checkpointing``); ``dropout``: the LoRA layers draw dropout
    (``policy.lora_dropout`` > 0); ``held``: bytes the pass holds whatever its tokens
    (:func:`held_bytes`)."""
    s = shape
    own = b * (4 * s.h + 3 * s.a * s.d + 3 * s.g * s.d + 4 * s.I) + 4 * (2 + 2 * s.a + s.g)
    adapters = b * sum(r for _, r in lora)  # every layer's A outputs
    if dropout:  # PEFT's forward: each module's dropped input, and its mask
        adapters += (b + 1) * sum(inp for inp, _ in lora)
    head = 3 * b * s.h + 4 + (0 if chunked_head else s.V * (2 * b + 3 * 4))
    vocab = s.V if chunked_head else 0
    if checkpointed:
        layer = own + adapters // s.L + 2 * b * s.I + b * s.h
        return Activations(s.L * b * s.h, layer, head, vocab, held)
    return Activations(s.L * own + adapters, 3 * b * s.I + 2 * b * s.h, head, vocab, held)


def held_bytes(b: int, parameters: int, dropout: bool) -> int:
    """The adapter's factors in the base's dtype that an update holds for a mini-batch's passes
    (:func:`marlow.policy.adapters.held_factors`): ``b`` bytes each of its ``parameters`` LoRA
    parameters over a bfloat16 or float16 base (``b`` < 4) whose LoRA draws no dropout (where
    its linears compute through :class:`marlow.policy.adapters.LoraLinear`); else 0."""
    return b * parameters if b < 4 and not dropout else 0


def head_chunk_bytes(vocab: int, tokens: int) -> int:
    """The chunked head's chunks (module docstring): 2 x the float32 logits of a chunk of at
    most HEAD_CHUNK_BYTES (fewer where ``tokens`` do not fill one) over ``vocab`` entries; 0
    where ``vocab`` is 0 (no chunked head)."""
    return 2 * min(HEAD_CHUNK_BYTES, tokens * 4 * vocab)


def activation_bytes(
    shape: Shape,
    b: int,
    lora: list[tuple[int, int]],
    tokens: int,
    chunked_head: bool = True,
    checkpointed: bool = False,
    dropout: bool = False,
    held: int = 0,
) -> int:
    """The activations of one pass over ``tokens`` tokens (module docstring): the
    :func:`activations` model's bytes at ``tokens``."""
    return activations(shape, b, lora, chunked_head, checkpointed, dropout, held).bytes(tokens)


MICRO_TOKENS_MAX = 32768
"""``grpo.micro_tokens=auto``'s most on CUDA: the largest micro-batch the GPU check measures."""
MICRO_TOKENS_STEP = 1024
ACTIVATION_SHARE = 0.5
"""``grpo.micro_tokens=auto`` on CUDA gives one micro-batch's activations at most this share of
the card's memory left beside the base weights and the adapters: the rest is margin for what the
memory model leaves out (the CUDA context, the allocator's fragmentation, the optimizer's
transient buffers, compiled kernels' workspaces)."""


def auto_micro_tokens(model: Activations | None, beside: int, memory: int | None) -> int:
    """``grpo.micro_tokens=auto``: :data:`MICRO_TOKENS_OFF_CUDA` where ``memory`` is None (not
    a CUDA device) or no adapter trains (``model`` None); else the most tokens of one forward
    whose activations (``model``, :func:`activations`) fit in :data:`ACTIVATION_SHARE` of the
    card's ``memory`` bytes left beside ``beside`` bytes (the base weights, the adapters and a
    rollout engine's own: :func:`engine_bytes`), rounded down to a multiple of
    :data:`MICRO_TOKENS_STEP`, at most :data:`MICRO_TOKENS_MAX` and at least one step (a card
    too small for that does not fit the run: ``marlow plan`` says so)."""
    if memory is None or model is None:
        return MICRO_TOKENS_OFF_CUDA
    room = ACTIVATION_SHARE * (memory - beside)
    fits = model.tokens_that_fit(room) if room > 0 else 0
    return max(
        MICRO_TOKENS_STEP, min(MICRO_TOKENS_MAX, fits // MICRO_TOKENS_STEP * MICRO_TOKENS_STEP)
    )


def update_settings(
    model: Callable[[bool], Activations] | None,
    micro_tokens: int | Literal["auto"],
    checkpointed: bool,
    auto: bool,
    turn: int,
    beside: int,
    memory: int | None,
) -> tuple[int, bool]:
    """``grpo.micro_tokens`` and whether the update checkpoints its decoder layers, ``auto``
    resolved, as a trainer resolves them and ``marlow plan`` predicts them.

    Args:
        model: the update's memory model, checkpointed or not (:func:`activations` of the run);
            None where no adapter trains.
        micro_tokens: ``grpo.micro_tokens``.
        checkpointed: what ``grpo.activation_checkpointing`` asks before a card is considered
            (:func:`marlow.models.checkpoints_layers`), for a model with layers to checkpoint.
        auto: ``grpo.activation_checkpointing`` is auto.
        turn: the longest turn the config allows (:func:`longest_turn`), scored in one forward
            whatever ``micro_tokens`` says.
        beside: the bytes of the base weights, the adapters and a rollout engine's own
            (:func:`engine_bytes`); memory: the card's (None: not CUDA).

    ``micro_tokens=auto`` is sized (:func:`auto_micro_tokens`) with the layers as asked. Then,
    on a CUDA card, checkpointing auto is turned off where the largest forward,
    max(micro-batch, ``turn``), with every layer's activations kept fits in the same
    :data:`ACTIVATION_SHARE` of the card that sizes the micro-batch: the micro-batch stays the
    same and its backward runs no layer twice. Not checkpointed, an update pass of the same
    micro-batch was faster at every size measured (one H200, 8,192 tokens: 1.58x at Qwen3-0.6B,
    1.07x at 1.7B, 1.39x at 4B; ``bench/gpu_check.py``'s update part), and plan's peak for it
    was within 1% of the measured one. Where that forward does not fit, and off CUDA (a CPU's
    memory is the machine's, and its attention keeps score matrices plan leaves out), the layers
    stay checkpointed."""
    micro = micro_tokens
    if micro == "auto":
        micro = auto_micro_tokens(model(checkpointed) if model else None, beside, memory)
    if model and checkpointed and auto and memory is not None:
        room = ACTIVATION_SHARE * (memory - beside)
        checkpointed = model(False).bytes(max(micro, turn)) > room
    return micro, checkpointed


def engine_bytes(cfg: RunConfig, base_bytes: int) -> int:
    """What a rollout engine in processes of its own holds on the trainer's card for the whole
    run, left beside the update by the auto settings (:func:`update_settings`): vLLM's
    (``rollout.backend=vllm``) KV cache, ``rollout.vllm.kv_cache_gib`` (on each of its
    ``tensor_parallel_size`` cards), and its own copy of the base weights (``base_bytes``, split
    across them); its activations, LoRA slots and CUDA graphs are left to the half of the card
    the auto settings keep free. 0 for the HF engine, which samples with the trainer's model and
    frees its KV cache before the update, and for a registered backend, whose memory marlow
    cannot know."""
    if cfg.rollout.backend != "vllm":
        return 0
    engine = cfg.rollout.vllm
    return int(engine.kv_cache_gib * GIB) + base_bytes // engine.tensor_parallel_size


def longest_turn(cfg: RunConfig) -> int:
    """The most tokens of one turn's forward a run's config allows, for
    :func:`update_settings`: ``rollout.max_prompt_tokens`` (else :data:`PROMPT_TOKENS`) +
    ``rollout.max_new_tokens``."""
    return (cfg.rollout.max_prompt_tokens or PROMPT_TOKENS) + cfg.rollout.max_new_tokens


def kv_cache_bytes(shape: Shape, b: int, sequences: int, tokens: int) -> int:
    """Keys and values of ``sequences`` sequences of ``tokens`` tokens, every layer."""
    return sequences * tokens * shape.L * 2 * shape.g * shape.d * b


@dataclass(frozen=True)
class AdapterPlan:
    name: str
    roles: list[str]
    trainable: int  # LoRA parameters
    bytes: int  # weights + gradients + AdamW state, float32


@dataclass(frozen=True)
class Plan:
    model: str  # model.name as given
    source: str  # where its architecture came from
    dtype: str
    parameters: int  # the base's, tied embeddings once
    non_embedding: int  # without the input (and an untied output) embedding
    lora_rank: int
    adapters: list[AdapterPlan]
    base_bytes: int
    adapter_bytes: int  # all adapters
    micro_tokens: int  # grpo.micro_tokens, auto resolved (auto_micro_tokens)
    micro_tokens_auto: bool  # grpo.micro_tokens is auto
    forward_tokens: int  # tokens of the largest forward: max(grpo.micro_tokens, one turn)
    activation_bytes: int
    checkpointed: bool  # the decoder layers' activations are checkpointed in the update
    auto_unchecked: bool  # activation_checkpointing auto turned off on the card (update_settings)
    checkpointing: str  # grpo.activation_checkpointing as set: auto, on or off
    max_batch: int
    prompt_tokens: int
    max_new_tokens: int
    kv_cache_bytes: int  # the HF engine's rollout batch; 0 with a vLLM engine (its own: below)
    engine_bytes: int  # a vLLM engine's KV cache and weights on the card (engine_bytes)
    peak_bytes: int
    gpu_mem_gib: float | None
    fits: bool | None  # None without gpu_mem_gib
    max_micro_tokens: int | None  # the largest grpo.micro_tokens that fits (None: none does)
    # what to set, together, for a run that does not fit: setting -> value (:func:`suggest`)
    suggestions: dict[str, Any] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)  # the workflow's tool stages: no GPU memory

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_run(
    cfg: RunConfig, *, prompt_tokens: int = PROMPT_TOKENS, gpu_mem_gib: float | None = None
) -> Plan:
    """The memory plan of the run ``cfg`` describes (module docstring); ConfigError names a
    field for a model, workflow or routing it cannot plan."""
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    workflow = check_run_config(cfg)
    config, source = architecture(cfg.model.name)
    shape = Shape.of(config)
    dtype = getattr(torch, cfg.dtype)
    b = dtype.itemsize
    try:
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, RuntimeError, TypeError) as err:  # no causal-LM class, a negative size
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(
            f"config field 'model.name': {source} is no causal LM ({reason})"
        ) from None
    parameters = _distinct_numel(base.parameters())
    non_embedding = non_embedding_parameters(base)
    adapters, lora = _attach(base, cfg, workflow.roles)
    turn = prompt_tokens + cfg.rollout.max_new_tokens
    chunked = decoder_and_head(base) is not None
    dropout = cfg.policy.lora_dropout > 0
    base_bytes = parameters * b
    adapter_bytes = sum(a.bytes for a in adapters)
    card = None if gpu_mem_gib is None else int(gpu_mem_gib * GIB)
    engine = engine_bytes(cfg, base_bytes)  # held beside the trainer for the whole run
    asked = checkpoints_layers(cfg) and bool(checkpointable_layers(base))
    held = held_bytes(b, adapters[0].trainable, dropout) if adapters else 0
    models = partial(activations, shape, b, lora, chunked, dropout=dropout, held=held)
    micro, ckpt = update_settings(
        models if adapters else None,
        cfg.grpo.micro_tokens,
        asked,
        cfg.grpo.activation_checkpointing == "auto",
        longest_turn(cfg),
        base_bytes + adapter_bytes + engine,
        card,
    )
    model = models(ckpt) if adapters else None
    tokens = max(micro, turn)
    pass_bytes = model.bytes(tokens) if model else 0
    kv = 0 if engine else kv_cache_bytes(shape, b, cfg.rollout.max_batch, turn)
    peak = base_bytes + adapter_bytes + engine + max(pass_bytes, kv)
    fits = max_micro = None
    suggestions: dict[str, Any] = {}
    if gpu_mem_gib is not None:
        budget = gpu_mem_gib * GIB
        fits = peak <= budget
        room = budget - base_bytes - adapter_bytes - engine
        most = model.tokens_that_fit(room) if model else 0
        if model and room >= kv and most >= turn:
            max_micro = most
        if not fits and engine:
            suggestions = suggest_vllm(cfg, micro, model, room, turn)
        elif not fits:
            suggestions = suggest(cfg, micro, shape, b, model, room, prompt_tokens)
    return Plan(
        model=cfg.model.name,
        source=source,
        micro_tokens=micro,
        micro_tokens_auto=cfg.grpo.micro_tokens == "auto",
        dtype=cfg.dtype,
        parameters=parameters,
        non_embedding=non_embedding,
        lora_rank=cfg.policy.lora_rank,
        adapters=adapters,
        base_bytes=base_bytes,
        adapter_bytes=adapter_bytes,
        forward_tokens=tokens,
        activation_bytes=pass_bytes,
        checkpointed=ckpt,
        auto_unchecked=asked and not ckpt,
        checkpointing=cfg.grpo.activation_checkpointing,
        max_batch=cfg.rollout.max_batch,
        prompt_tokens=prompt_tokens,
        max_new_tokens=cfg.rollout.max_new_tokens,
        kv_cache_bytes=kv,
        engine_bytes=engine,
        peak_bytes=peak,
        gpu_mem_gib=gpu_mem_gib,
        fits=fits,
        max_micro_tokens=max_micro,
        suggestions=suggestions,
        tools=list(workflow.tools),
    )


def suggest(
    cfg: RunConfig,
    micro_tokens: int,
    shape: Shape,
    b: int,
    model: Activations | None,
    room: float,
    prompt_tokens: int,
) -> dict[str, Any]:
    """The settings that, set together, make a run that does not fit do so: ``room`` is the
    memory left beside the base weights and the adapters, which both the rollout's KV cache and
    one micro-batch's activations must fit in (the peak takes the larger). Each number is the
    largest that fits, so the run keeps as much batch as the card allows:

    * ``rollout.max_batch``: the most sequences whose KV cache fits;
    * ``grpo.micro_tokens``: the most tokens per forward whose activations fit;
    * ``rollout.max_new_tokens``: only when one sequence (or one turn's forward, which is never
      split) is already too long; then the two above are sized for the shorter turn;
    * ``dtype`` / ``policy.lora_rank`` / ``model.name``: when the weights alone leave no room.

    ``micro_tokens``: the run's ``grpo.micro_tokens``, ``auto`` resolved. ``model``: its
    activations' memory model (:func:`activations`; None: no adapter trains, no update).
    The ``--prompt-tokens`` assumption (:data:`PROMPT_TOKENS`) is part of every figure."""
    r = cfg.rollout
    if room <= 0:  # the weights and adapters alone pass the card
        out: dict[str, Any] = {"model.name": "a smaller model"}
        if cfg.dtype == "float32":
            out = {"dtype": "bfloat16", **out}
        return out
    new = r.max_new_tokens
    kv_token = kv_cache_bytes(shape, b, 1, 1)  # one token of one sequence
    forward = model.tokens_that_fit(room) if model else math.inf
    longest = min(math.floor(room / kv_token), forward) - prompt_tokens  # one sequence fits
    out = {}
    if new > longest:
        if longest < 1:  # one prompt of --prompt-tokens alone does not fit
            return {"model.name": "a smaller model"}
        new = out["rollout.max_new_tokens"] = longest
    turn = prompt_tokens + new
    if kv_cache_bytes(shape, b, r.max_batch, turn) > room:
        out["rollout.max_batch"] = math.floor(room / kv_cache_bytes(shape, b, 1, turn))
    if model and max(micro_tokens, turn) > forward:
        out["grpo.micro_tokens"] = forward
    return out


def suggest_vllm(
    cfg: RunConfig, micro_tokens: int, model: Activations | None, room: float, turn: int
) -> dict[str, Any]:
    """:func:`suggest` for a run sampled by vLLM, whose KV cache (``rollout.vllm.kv_cache_gib``)
    and copy of the weights are on the card beside the update for the whole run: ``room`` is the
    memory left beside the base weights, the adapters and the engine (:func:`engine_bytes`), for
    one micro-batch's activations. ``grpo.micro_tokens`` (the most tokens that fit) where one
    turn's forward fits; else ``rollout.vllm.kv_cache_gib`` (in steps of 0.01 GiB, the largest
    that leaves room for one turn's forward; vLLM refuses one too small for a sequence of its
    ``max_model_len``); ``dtype`` / ``model.name`` when not even that leaves 0.01 GiB."""
    kv = int(cfg.rollout.vllm.kv_cache_gib * GIB)
    free = room + kv  # what the engine's KV cache and the activations share
    one_turn = model.bytes(turn) if model else 0
    if free - one_turn < GIB / 100:  # the weights and one turn's forward alone pass the card
        out: dict[str, Any] = {"model.name": "a smaller model"}
        return {"dtype": "bfloat16", **out} if cfg.dtype == "float32" else out
    if one_turn > room:
        return {"rollout.vllm.kv_cache_gib": math.floor((free - one_turn) / GIB * 100) / 100}
    forward = model.tokens_that_fit(room) if model else math.inf
    return {"grpo.micro_tokens": forward} if model and max(micro_tokens, turn) > forward else {}


def _attach(
    base: PreTrainedModel, cfg: RunConfig, roles: list[str]
) -> tuple[list[AdapterPlan], list[tuple[int, int]]]:
    """The plans of the adapters the routing of the workflow's ``roles`` makes, and (in features,
    rank) of each LoRA layer of one of them: the first attached to ``base`` (on the meta device)
    as the trainer attaches it and counted; the others share its spec, so its count."""
    pol = cfg.policy
    routing = make_routing(pol.routing, roles, pol.role_map)
    names = routing.adapters
    if not names:
        return [], []
    spec = LoraSpec(pol.lora_rank, pol.lora_alpha, pol.lora_dropout, pol.target_modules)
    with torch.device("meta"):  # the LoRA tensors too: nothing is allocated
        # one adapter is attached and counted: every other has its spec on the same layers
        model = attach_adapters(base, names[:1], spec, seed=cfg.seed)
    n = sum(p.numel() for p in adapter_parameters(model, names[0]).values())
    plans = [AdapterPlan(a, routing.roles_of(a), n, OPTIMIZER_BYTES * n) for a in names]
    return plans, lora_shapes(model, names[0])


def lora_shapes(model: torch.nn.Module, name: str) -> list[tuple[int, int]]:
    """(in features, rank) of every LoRA layer of adapter ``name`` in ``model``, as
    :func:`activations` reads them."""
    return [
        (layer.lora_A[name].in_features, layer.r[name])
        for layer in model.modules()
        if isinstance(layer, LoraLayer) and name in layer.lora_A
    ]


def non_embedding_parameters(model: PreTrainedModel) -> int:
    """The distinct parameters of ``model`` without its input embedding and, unless tied to it,
    its output embedding (the Qwen3 cards' "non-embedding" count)."""
    return _distinct_numel(model.parameters()) - _distinct_numel(_embeddings(model))


def architecture(name: str) -> tuple[PretrainedConfig, str]:
    """The config of model ``name`` and where it came from, without the hub (module docstring)."""
    arch = shipped_arch(name)
    if arch is not None:
        return AutoConfig.for_model(**arch_config(arch)), f"shipped architecture {arch}"
    if name in SCALES:
        return model_config(name, len(build_tokenizer())), f"tiny scale {name} (not pre-trained)"
    valid = (
        f"valid: {', '.join(arch_names())} (or their hub ids, e.g. Qwen/Qwen3-1.7B), "
        f"{', '.join(SCALES)}, a folder with a config.json, or a hub id in the local cache"
    )
    path = Path(name).expanduser()
    if name.startswith(("/", ".", "~")) or path.is_dir():
        if not (path / "config.json").is_file():
            what = "has no config.json" if path.is_dir() else "is no such folder"
            raise ConfigError(f"config field 'model.name': {name!r} {what}; {valid}")
        try:
            return AutoConfig.from_pretrained(path), f"folder {path}"
        except Exception as err:  # not JSON, no or an unknown model_type, a field of a wrong type
            reason = " ".join(str(err).split())[:200]
            raise ConfigError(
                f"config field 'model.name': {path / 'config.json'} cannot be read as a model's "
                f"config ({reason})"
            ) from None
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True), f"hub cache {name}"
    except (OSError, ValueError):
        raise ConfigError(
            f"config field 'model.name': {name!r} is not a shipped architecture, a tiny scale, a "
            f"folder or a cached hub id (plan downloads nothing); {valid}"
        ) from None


def _distinct_numel(params) -> int:
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def _embeddings(model: PreTrainedModel) -> list[torch.nn.Parameter]:
    """The input embedding and, unless tied to it, the output embedding (the Qwen3 cards'
    "non-embedding" count leaves both out)."""
    modules = [model.get_input_embeddings(), model.get_output_embeddings()]
    return [m.weight for m in modules if m is not None]


def render(plan: Plan) -> list:
    """The plan as rich renderables: a table (base, each adapter, activations, KV cache, peak),
    what each row holds, and the verdict against ``gpu_mem_gib``."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"{plan.model}: {plan.source}, {plan.dtype}, LoRA rank {plan.lora_rank}")
    table.add_column("part")
    for name in ("parameters", "trainable", "memory"):
        table.add_column(name, justify="right")
    table.add_row("base", f"{plan.parameters:,}", "0", _gib(plan.base_bytes))
    for a in plan.adapters:
        label = f"adapter {a.name}" + ("" if a.roles == [a.name] else f" ({', '.join(a.roles)})")
        table.add_row(label, f"{a.trainable:,}", f"{a.trainable:,}", _gib(a.bytes))
    table.add_row("activations", "", "", _gib(plan.activation_bytes))
    if plan.engine_bytes:
        table.add_row("vLLM engine", "", "", _gib(plan.engine_bytes))
    else:
        table.add_row("KV cache", "", "", _gib(plan.kv_cache_bytes))
    trainable = sum(a.trainable for a in plan.adapters)
    total = f"{plan.parameters + trainable:,}"
    table.add_row("peak", total, f"{trainable:,}", _gib(plan.peak_bytes), style="bold")
    auto = ""
    if plan.micro_tokens_auto:
        auto = (
            " (grpo.micro_tokens auto: off CUDA; --gpu-mem sizes it to a card)"
            if plan.gpu_mem_gib is None
            else f" (grpo.micro_tokens auto, sized to {plan.gpu_mem_gib:g} GiB)"
        )
    notes = [
        f"base: {plan.dtype} weights; {plan.non_embedding:,} non-embedding parameters",
        "adapters: LoRA weights, gradients and AdamW state, float32; activations: one "
        f"micro-batch of {plan.forward_tokens:,} tokens{auto}"
        + (", its layers checkpointed (grpo.activation_checkpointing)" if plan.checkpointed else "")
        + (
            "; auto: a card that holds every layer's activations keeps them (--gpu-mem)"
            if plan.checkpointed and plan.checkpointing == "auto" and plan.gpu_mem_gib is None
            else ""
        )
        + (
            ", its layers not checkpointed (grpo.activation_checkpointing auto: every layer's "
            f"activations fit in {ACTIVATION_SHARE:.0%} of the card beside the weights and "
            "adapters)"
            if plan.auto_unchecked
            else ""
        )
        if plan.adapters
        else "adapters: none (the routing trains nothing, so no backward and no activations)",
        *(
            [
                "vLLM engine: its KV cache (rollout.vllm.kv_cache_gib) and its copy of the base "
                "weights, on the card for the whole run (its activations and CUDA graphs not "
                "counted)",
                "peak: base + adapters + vLLM engine + activations, per GPU: each data-parallel "
                "process (torchrun, marlow train --nproc) holds all of it",
            ]
            if plan.engine_bytes
            else [
                f"KV cache: one rollout batch of {plan.max_batch} sequences x "
                f"({plan.prompt_tokens:,} prompt (--prompt-tokens) + {plan.max_new_tokens:,} "
                "new) tokens",
                "peak: base + adapters + max(activations, KV cache), per GPU: each data-parallel "
                "process (torchrun, marlow train --nproc) holds all of it",
            ]
        ),
    ]
    if plan.tools:
        notes.append(
            f"tool stages ({', '.join(plan.tools)}): functions, no adapter and no GPU memory"
        )
    out: list = [table, Text("\n".join(notes), style="dim")]
    if plan.gpu_mem_gib is not None:
        if plan.fits:
            spare = plan.gpu_mem_gib * GIB - plan.peak_bytes
            verdict = f"fits in {plan.gpu_mem_gib:g} GiB ({_gib(spare)} spare)"
        else:
            verdict = f"does NOT fit in {plan.gpu_mem_gib:g} GiB"
            if plan.suggestions:
                settings = " ".join(
                    f"{k}={v}" if " " not in str(v) else f"{k}: {v}"
                    for k, v in plan.suggestions.items()
                )
                verdict += f"; it would with {settings} (each the largest that fits, or less)"
        out.append(Text(verdict))
    return out


def _gib(n: float) -> str:
    """Bytes in GiB, or in MiB below one GiB (tiny scales)."""
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / 2**20:,.2f} MiB"
