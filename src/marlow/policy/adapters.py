"""LoRA adapters on one frozen base: one adapter per policy, all resident at once.

A *policy* is a named LoRA adapter. Isolated-policy routing attaches one adapter per role
type, shared-policy routing one adapter for every role; both live on the same frozen base model, and
the name ``BASE`` means "every adapter disabled".

Departures from plain PEFT usage, and why:

* **Every adapter stays trainable.** PEFT's ``set_adapter`` / ``disable_adapter`` flip
  ``requires_grad`` to False on the inactive adapters. marlow gives each adapter its own optimizer
  and decides itself which parameters receive gradients (only the active adapter is in the graph),
  so :func:`activate` switches the active adapter on the LoRA layers directly and never touches
  ``requires_grad``. It also costs microseconds instead of a walk over every module.
* **Parameters are matched by exact adapter name**: ``...lora_A.<name>.weight`` with
  ``<name>`` a whole dotted path component, so adapters ``worker`` and ``workers`` never mix.
* **LoRA weights are float32 on any base dtype.** PEFT first creates an adapter in its base
  layer's dtype, then (``autocast_adapter_dtype=True``, passed explicitly here) casts bfloat16
  and float16 LoRA weights to float32. Its LoRA forward casts the layer's input to the LoRA
  weights' dtype and the sum back to the base output's dtype, so a bfloat16 base and float32
  adapters mix; marlow's scoring runs them under :func:`lora_in_base_dtype` instead, which
  computes LoRA in the base's dtype (autocast), each plain LoRA linear in one fused call
  (:class:`LoraLinear`). The gradients, and the AdamW state built from them, are float32 either
  way. (The random LoRA A of a bfloat16 base has passed through
  bfloat16 once on creation, so it is the float32 run's rounded to bfloat16; B starts at 0
  either way.)
* **Saving is atomic per adapter**: each ``out_dir/<name>/`` is written beside its final place and
  renamed in, in the standard PEFT layout (``adapter_config.json`` + ``adapter_model.safetensors``)
  that ``PeftModel.from_pretrained(base, out_dir/<name>)`` loads anywhere.
* **Saved configs are portable** (:func:`save_adapters`): ``base_model_name_or_path`` is the name
  the caller gives (the run's base as the user named it, :mod:`marlow.training.runbase`), not the
  folder the base happened to load from; ``target_modules`` are the sorted short names
  (``q_proj``, ...) that PEFT matches by suffix, not the full module paths PEFT resolves
  ``all-linear`` to. Short names are written only when they select exactly the modules that carry
  the adapter (else the full paths stay: e.g. a user list of full paths naming one layer).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinearLayer
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict, load_peft_weights, set_peft_model_state_dict
from torch import nn
from transformers import PreTrainedModel

from marlow.algo.matmul import addmm_, mm
from marlow.config import ConfigError
from marlow.forwards import through
from marlow.types import BASE

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass
class LoraSpec:
    """LoRA hyper-parameters shared by every adapter of a run (paper: rank 64, alpha 32, dropout 0,
    every linear module of the base)."""

    rank: int = 64
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"

    def to_peft(self) -> LoraConfig:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        targets = self.target_modules
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets if isinstance(targets, str) else list(targets),
            bias="none",
            task_type="CAUSAL_LM",
        )


def _check_names(names: Sequence[str]) -> list[str]:
    names = list(names)
    if not names:
        raise ValueError("attach_adapters needs at least one adapter name")
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
        if name == BASE:
            raise ValueError(f"adapter name {BASE!r} is reserved for the frozen base model")
        if "." in name:
            raise ValueError(
                f"adapter name {name!r} must not contain '.' (it is a module path key)"
            )
        if name.startswith("lora_") or name in "lora_":
            # PEFT locates LoRA tensors by the "lora_" prefix; names that overlap it (e.g. "a",
            # "lora") can be re-initialised instead of loaded by PEFT's loaders.
            raise ValueError(f"adapter name {name!r} overlaps PEFT's 'lora_' prefix; pick another")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"adapter names must be unique; repeated: {dupes}")
    return names


def attach_adapters(
    base: PreTrainedModel, names: Sequence[str], spec: LoraSpec, seed: int
) -> PeftModel:
    """Wrap ``base`` (in place) with one LoRA adapter per name; base weights frozen.

    Adapter ``i`` is initialised right after ``torch.manual_seed(seed + i)``, so the same names, spec
    and seed give the same weights. LoRA B starts at zero: a fresh adapter computes the base model.
    The global torch RNG is restored afterwards, so attaching adapters does not shift later draws.
    """
    names = _check_names(names)
    config = spec.to_peft()
    rng_state = torch.get_rng_state()
    try:
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            # peft 0.21 probes transformers 5's deprecated `is_gradient_checkpointing`; not ours to fix.
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
            )
            try:
                model = get_peft_model(
                    base, config, adapter_name=names[0], autocast_adapter_dtype=True
                )
            except ValueError as err:
                if "target module" not in str(err).lower():
                    raise
                raise ConfigError(
                    f"config field 'policy.target_modules': {spec.target_modules!r} matches no "
                    f"module of the model; valid: all-linear or names among "
                    f"{', '.join(linear_module_names(base))}"
                ) from None
        for i, name in enumerate(names[1:], start=1):
            torch.manual_seed(seed + i)
            model.add_adapter(name, spec.to_peft(), autocast_adapter_dtype=True)
    finally:
        torch.set_rng_state(rng_state)
    for p in model.base_model.model.parameters():
        p.requires_grad_(False)
    _lora_state(model, refresh=True)  # caches the LoRA layers, makes every LoRA param trainable
    activate(model, names[0])
    return model


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (LoRA targets), sorted."""
    return sorted(
        {path.rsplit(".", 1)[-1] for path, m in model.named_modules() if isinstance(m, nn.Linear)}
    )


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the adapters resident on ``model`` (empty for a plain model)."""
    config = getattr(model, "peft_config", None)
    return list(config) if isinstance(config, dict) else []


def _is_lora_param(path: str, name: str) -> bool:
    """True when ``path`` is a LoRA tensor of adapter ``name``: the component right after a
    ``lora_*`` container (lora_A, lora_B, lora_embedding_A, lora_magnitude_vector, ...) equals
    ``name`` exactly."""
    parts = path.split(".")
    return any(parts[i].startswith("lora_") and parts[i + 1] == name for i in range(len(parts) - 1))


def adapter_parameters(model: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """The LoRA parameters of exactly adapter ``name``, keyed by their full parameter path."""
    valid = adapter_names(model)
    if name not in valid:
        raise ValueError(f"unknown adapter {name!r}; resident adapters: {valid}")
    params = {p: t for p, t in model.named_parameters() if _is_lora_param(p, name)}
    if not params:
        raise ValueError(f"adapter {name!r} has no LoRA parameters (are target_modules empty?)")
    return params


class _LoraState:
    """The LoRA layers and parameters of one model, collected once so switching stays cheap."""

    def __init__(self, model: nn.Module) -> None:
        self.names = tuple(adapter_names(model))
        self.layers = lora_layers(model)
        self.params = [p for n, p in model.named_parameters() if _is_any_lora_param(n, self.names)]
        # PEFT switches requires_grad a whole adapter at a time, so one sentinel per adapter tells
        # whether anything needs fixing without a walk over every parameter.
        first: dict[str, nn.Parameter] = {}
        for path, p in model.named_parameters():
            for name in self.names:
                if name not in first and _is_lora_param(path, name):
                    first[name] = p
        self.sentinels = list(first.values())


def lora_layers(module: nn.Module) -> list[LoraLayer]:
    """The LoRA layers in ``module`` (itself included), in the order of ``module.modules()``,
    without a walk through each one's own submodules (PEFT never puts one inside another): a
    checkpointed decoder layer's are found at each of its calls."""
    if isinstance(module, LoraLayer):
        return [module]
    found: list[LoraLayer] = []
    for child in module._modules.values():
        if child is not None:
            found += lora_layers(child)
    return found


def _is_any_lora_param(path: str, names: Sequence[str]) -> bool:
    return any(_is_lora_param(path, n) for n in names)


_STATE_ATTR = "_marlow_lora_state"


def _lora_state(model: nn.Module, refresh: bool = False) -> _LoraState:
    # Stored with object.__setattr__ so nn.Module does not register it (it holds modules).
    state = model.__dict__.get(_STATE_ATTR)
    if refresh or state is None or state.names != tuple(adapter_names(model)):
        state = _LoraState(model)
        object.__setattr__(model, _STATE_ATTR, state)
        _ensure_trainable(state, force=True)
    return state


def _ensure_trainable(state: _LoraState, force: bool = False) -> None:
    # PEFT's set_adapter / enable_adapters / disable_adapter turn requires_grad off; turn it back on.
    if force or not all(p.requires_grad for p in state.sentinels):
        for p in state.params:
            p.requires_grad_(True)


def active_adapter(model: nn.Module) -> str:
    """The adapter the next forward uses, or BASE when adapters are disabled (or there are none)."""
    if not adapter_names(model):
        return BASE
    layers = _lora_state(model).layers
    if not layers or layers[0].disable_adapters:
        return BASE
    active = layers[0].active_adapters
    return active[0] if len(active) == 1 else ",".join(active)


def activate(model: nn.Module, name: str) -> None:
    """Make ``name`` the adapter of the next forward (BASE: every adapter disabled).

    Unlike PEFT's ``set_adapter``, this keeps ``requires_grad=True`` on every adapter's LoRA
    parameters: only the active adapter enters the graph, so only it gets gradients, and each
    adapter's optimizer sees its own. Cost: two dict writes per LoRA layer, ~15 us for a 28-layer
    model with LoRA on all 7 linears (196 layers).
    """
    names = adapter_names(model)
    if not names:
        if name != BASE:
            raise ValueError(f"model has no adapters; only {BASE!r} is valid, got {name!r}")
        return
    if name != BASE and name not in names:
        raise ValueError(f"unknown adapter {name!r}; valid: {[BASE, *names]}")
    state = _lora_state(model)
    disabled = name == BASE
    active = [names[0]] if disabled else [name]  # a disabled model keeps a valid adapter name
    for layer in state.layers:
        # The private fields behind PEFT's `disable_adapters` / `active_adapter` properties: the
        # public setters would also rewrite requires_grad, which we must not. They hold plain
        # values, so writing the instance dict equals nn.Module.__setattr__, ~50x faster.
        fields = layer.__dict__
        fields["_disable_adapters"] = disabled
        fields["_active_adapter"] = active
    if not disabled:
        model.base_model.active_adapter = name
    _ensure_trainable(state)


@contextmanager
def use_adapter(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """``activate(model, name)`` for the duration of a ``with`` block, then restore the previous."""
    previous = active_adapter(model)
    activate(model, name)
    try:
        yield model
    finally:
        activate(model, previous)


def lora_compute_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype LoRA layers compute in over a base of ``base_dtype``: the base's own where it is
    bfloat16 or float16 (:func:`lora_in_base_dtype`), else float32 (the factors'). The lean
    sampling forward (:mod:`marlow.rollout.lean`) casts its factors to it and ``marlow plan``
    counts the activations it keeps, so that sampling, scoring and the plan agree."""
    return base_dtype if base_dtype in (torch.bfloat16, torch.float16) else torch.float32


@contextmanager
def lora_in_base_dtype(model: nn.Module) -> Iterator[None]:
    """Inside the ``with`` block, the LoRA layers of ``model`` compute in
    :func:`lora_compute_dtype` of its base's dtype: over a bfloat16 or float16 base,
    ``torch.autocast`` to that dtype (on every device marlow runs on), and
    PEFT's cast of each LoRA layer's input to its float32 factors turned off, so the factors are
    cast down (once per forward) instead of the activations up, and ``B(A(x)) * scaling`` and
    its sum with the base output stay in the base's dtype. The factors, their gradients and the
    optimizer's state stay float32 (mixed precision, as Hugging Face's Trainer runs a bfloat16
    model). Each plain LoRA linear (:func:`plain_lora`, one adapter active, no dropout drawn)
    computes through :class:`LoraLinear` there: the scaling folded into B and the sum with the
    base output done by the low-rank matrix product itself, in the forward and in the backward
    (PEFT's forward elsewhere: DoRA, dropout in training, several adapters, none). Elsewhere
    nothing changes.

    Why: on one H200, the update of a bfloat16 Qwen3-0.6B stand-in with a rank-64 adapter on
    8,192 tokens spent most of its device time in elementwise kernels around PEFT's float32 LoRA
    (the input cast up, the scaling, the sum, the cast back down: each over every token) and in
    float32 GEMMs without tensor cores, the base's bfloat16 GEMMs about a tenth of it (the
    profile in ``bench/results/gpu_check.json``); on a 2-core CPU it pays too
    (``bench/lora_dtype.py``)."""
    weight = model.get_input_embeddings().weight
    dtype = lora_compute_dtype(weight.dtype)
    if dtype == torch.float32 or not adapter_names(model):
        yield
        return
    layers = _lora_state(model).layers
    before = [_how_it_computes(layer) for layer in layers]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
        if isinstance(layer, LoraLinearLayer) and "forward" not in layer.__dict__:  # not folded
            through(layer, _ThroughLoraLinear)
    try:
        with torch.autocast(weight.device.type, dtype=dtype):
            yield
    finally:
        for layer, how in zip(layers, before, strict=True):
            _compute_as(layer, how)


def _how_it_computes(layer: nn.Module) -> tuple[bool, object, type]:
    """What decides a LoRA layer's arithmetic besides its weights: PEFT's cast of its input to
    the factors' dtype, the forward shadowing the class's (:func:`folded`) or None, and its
    class (:func:`lora_in_base_dtype`'s or its own)."""
    cast = getattr(layer, "cast_input_dtype_enabled", True)
    return cast, layer.__dict__.get("forward"), type(layer)


def _compute_as(layer: nn.Module, how: tuple[bool, object, type]) -> None:
    cast, forward, cls = how
    # plain attributes, set as nn.Module would (neither is a parameter, buffer or module)
    object.__setattr__(layer, "cast_input_dtype_enabled", cast)
    if forward is None:
        layer.__dict__.pop("forward", None)
    else:
        object.__setattr__(layer, "forward", forward)
    layer.__class__ = cls


def recompute_as_forward(module: nn.Module) -> Callable[[], AbstractContextManager]:
    """For a checkpointed ``module`` (a decoder layer), called at its forward: a function
    whose every call makes a context in which ``module``'s LoRA layers compute as they do now
    (:func:`_how_it_computes`), for its recompute in the backward (once for each backward, a
    graph kept included). The recompute runs after :func:`lora_in_base_dtype` has closed, under
    the autocast the checkpoint restores: without this, PEFT would cast each LoRA input up to
    float32 there and compute through its own forward (exact, but another computation, which
    saves other tensors than the forward did)."""
    layers = lora_layers(module)
    forward = [_how_it_computes(m) for m in layers]

    @contextmanager
    def as_in_the_forward() -> Iterator[None]:
        now = [_how_it_computes(m) for m in layers]
        for m, how in zip(layers, forward, strict=True):
            _compute_as(m, how)
        try:
            yield
        finally:
            for m, how in zip(layers, now, strict=True):
                _compute_as(m, how)

    return as_in_the_forward


def plain_lora(layer: nn.Module, name: str) -> bool:
    """Whether ``layer`` computes adapter ``name`` as plain LoRA on a linear,
    ``base(x) + scaling * B(A(dropout(x)))``: a PEFT LoRA linear over an ``nn.Linear``, not
    merged by PEFT, without DoRA or another variant, a LoRA bias, a transposed weight, or a bias
    on B."""
    if not isinstance(layer, LoraLinearLayer) or name not in layer.lora_A:
        return False
    a, b = layer.lora_A[name], layer.lora_B[name]
    return (
        type(layer.get_base_layer()) is nn.Linear
        and not layer.merged
        and not layer.use_dora.get(name, False)
        and not getattr(layer, "lora_bias", {}).get(name, False)
        and not getattr(layer, "fan_in_fan_out", False)
        and name not in getattr(layer, "lora_variant", {})
        and type(a) is nn.Linear
        and type(b) is nn.Linear
        and b.bias is None
    )


class LoraLinear(torch.autograd.Function):
    """``x @ W.T + bias + scaling * (x @ A.T) @ B.T`` (a plain LoRA linear without dropout) in
    ``x``'s dtype, with as few passes over the tokens as the algebra allows: the scaling is
    folded into B (a weight-sized product), and the low-rank update is added to the base output
    by its own matrix product (:func:`add_low_rank`: ``addmm``, whose sum is part of the
    product), where PEFT computes ``B(A(x))`` over every token, then scales it and adds it in
    two more passes. The backward does the same for the input's gradient,
    ``g @ W + (g @ (scaling B)) @ A``, by one in-place ``addmm_``. The base (``weight``,
    ``bias``) is frozen: no gradient. A and B get their gradients in their own dtype (float32
    factors computing in bfloat16: mixed precision); B's is computed unscaled and scaled in the
    wider of the two dtypes. It keeps what PEFT's keeps for the backward (the input and the
    low-rank output; the cast factors are weight-sized). The same values as PEFT's up to float
    round-off (exactly PEFT's in float32 where the scaling is a power of two; tests).

    ``a_low`` and ``b_low``: A, and B times the scaling, in ``x``'s dtype
    (:func:`low_factors`), which ``a`` and ``b`` (the parameters, for their gradients' place
    and dtype) hold in theirs."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling, a_low, b_low):  # noqa: D102
        out = nn.functional.linear(x, weight, bias)  # as PEFT's base layer, then its A
        low = nn.functional.linear(x, a_low)
        ctx.save_for_backward(x, weight, a_low, b_low, low)
        ctx.scaling, ctx.a_dtype, ctx.b_dtype = scaling, a.dtype, b.dtype
        return add_low_rank(out, low, b_low)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, weight, a_low, b_low, low = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        g_low = mm(g, b_low)
        gx = ga = gb = None
        if ctx.needs_input_grad[0]:
            gx = addmm_(mm(g, weight), g_low, a_low).view(x.shape)
        if ctx.needs_input_grad[3]:
            ga = mm(g_low.t(), x.reshape(-1, x.shape[-1])).to(ctx.a_dtype)
        if ctx.needs_input_grad[4]:
            gb = mm(g.t(), low.reshape(-1, low.shape[-1]))
            gb = (gb.to(torch.promote_types(gb.dtype, ctx.b_dtype)) * ctx.scaling).to(ctx.b_dtype)
        return gx, None, None, ga, gb, None, None, None


def add_low_rank(out: torch.Tensor, low: torch.Tensor, b_scaled: torch.Tensor) -> torch.Tensor:
    """``out + low @ b_scaled.T`` over the last dimension, the sum made by the matrix product
    itself (accumulated with the product, rounded once), the LoRA update of :class:`LoraLinear`
    (and of the lean sampling forward where it computes as the trainer's scoring). Where
    ``out`` is contiguous it is written in place (``addmm_``), so ``out`` must be the caller's
    own (a base linear's fresh output, read by nothing else): ``torch.addmm`` would first copy it
    into its result, a pass over every token's outputs: 14 copies a layer of a
    checkpointed update (7 in the forward, 7 in the recompute), about 3% of its device time on
    an H200 (the profile's ``Memcpy DtoD``). The same values either way."""
    flat_low = low.reshape(-1, low.shape[-1])
    if out.is_contiguous():
        addmm_(out.view(-1, out.shape[-1]), flat_low, b_scaled.t())
        return out
    return torch.addmm(out.reshape(-1, out.shape[-1]), flat_low, b_scaled.t()).view(out.shape)


class _ThroughLoraLinear:
    """A LoRA linear's forward through :class:`LoraLinear` where that computes it
    (:func:`lora_in_base_dtype`): :func:`active_factors`, a frozen base in the input's dtype and
    no extra arguments; else the class's own forward. While ``torch.compile`` traces it, the
    factors are those :func:`active_factors` last found (:func:`refresh_factors` finds them
    before a compiled call), not looked up by the adapter's name."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: D102
        if torch.compiler.is_compiling():
            found = self.__dict__.get(_FACTORS)
            factors = found[-1] if found is not None else _plain_factors(self)[1]
        else:
            factors = active_factors(self)
        base = self.get_base_layer()
        if (
            args
            or kwargs
            or factors is None
            or base.weight.requires_grad
            or base.weight.dtype != x.dtype
        ):
            return super().forward(x, *args, **kwargs)
        a, b, scaling = factors
        a_low, b_low = low_factors(a, b, scaling, x.dtype)
        return LoraLinear.apply(x, base.weight, base.bias, a, b, scaling, a_low, b_low)


_FACTORS = "_marlow_factors"
"""Where :func:`active_factors` keeps a LoRA linear's factors, with what they were found for."""


def active_factors(layer: LoraLayer) -> tuple[nn.Parameter, nn.Parameter, float] | None:
    """(A, B, scaling) of the adapter ``layer`` computes, where it computes one adapter as
    :class:`LoraLinear` does: one adapter active, :func:`plain_lora`, no dropout drawn; else
    None. Found once and kept on the layer until its active adapters (PEFT's list, which
    :func:`activate` and PEFT's ``set_adapter`` both replace), whether they are disabled, its
    training mode, its merged adapters, or the adapter's factors or scaling change.

    Why kept: a compiled decoder layer reads them from there (:class:`_ThroughLoraLinear`), so
    that torch.compile guards the factors as tensors (shape, dtype), not the adapter's name,
    and every adapter of a run shares the layer's compilations, where each adapter had its own;
    and an eager forward skips the checks of :func:`plain_lora`."""
    key = (layer._active_adapter, layer._disable_adapters, layer.training)
    merged = len(layer.merged_adapters)
    found = layer.__dict__.get(_FACTORS)
    if (
        found is not None
        and found[0] is key[0]
        and found[1:3] == key[1:]
        and found[3] == merged
        and _still(layer, *found[4:])
    ):
        return found[-1]
    name, factors = _plain_factors(layer)
    layer.__dict__[_FACTORS] = (*key, merged, name, factors)
    return factors


def _still(layer: LoraLayer, name: str | None, factors: tuple | None) -> bool:
    """Whether ``factors``, found for ``layer``'s adapter ``name``, are still its own: the same
    parameters and scaling (read from the modules' own dictionaries: a forward asks this of
    every LoRA linear)."""
    if factors is None:
        return True
    a, b, scaling = factors
    modules = layer._modules
    return (
        _factor(modules["lora_A"], name) is a
        and _factor(modules["lora_B"], name) is b
        and layer.scaling.get(name) == scaling
    )


def _factor(factors: nn.ModuleDict, name: str) -> nn.Parameter | None:
    linear = factors._modules.get(name)
    return None if linear is None else linear._parameters.get("weight")


def _plain_factors(layer: LoraLayer) -> tuple[str | None, tuple | None]:
    """(the adapter's name, :func:`active_factors`), found by the layer's PEFT attributes."""
    active = layer.active_adapters
    name = active[0] if len(active) == 1 else None
    if (
        name is None
        or layer.disable_adapters
        or not plain_lora(layer, name)
        or _draws_dropout(layer.lora_dropout[name])
    ):
        return name, None
    return name, (layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name]))


def refresh_factors(module: nn.Module) -> None:
    """:func:`active_factors` of each LoRA linear in ``module`` that computes through
    :class:`LoraLinear`, found anew where they are out of date: before a compiled call of
    ``module``, which reads them as they were last found."""
    for layer in lora_layers(module):
        if isinstance(layer, _ThroughLoraLinear):
            active_factors(layer)


_HELD: list[dict] = []
"""The open :func:`held_factors` blocks' factors, the innermost last (a list, not a context
variable: a checkpoint's recompute runs in autograd's own thread on a GPU)."""


@contextmanager
def held_factors() -> Iterator[None]:
    """Inside the ``with`` block, each LoRA factor pair's :func:`low_factors` is made once and
    kept for every forward of the block, the recomputes of its checkpointed layers included,
    where each forward made its own: three weight-sized kernels fewer a LoRA linear a forward
    (A's cast, B's cast and its scaling; 5% of the operations of a checkpointed update pass,
    ``bench/update_ops.py``, each a kernel launch on a GPU, where an update of a few thousand
    tokens is bound by its launches). For a block in which the factors do not change (the
    micro-batches of one mini-batch, before its optimizer step; a scoring pass); a factor
    changed in place anyway (its version moved) is cast anew. They take the adapter's
    parameters x the compute dtype's bytes until the block ends (``marlow plan`` counts them:
    :func:`marlow.plan.held_bytes`)."""
    _HELD.append({})
    try:
        yield
    finally:
        _HELD.pop()


def low_factors(
    a: torch.Tensor, b: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A in ``dtype``, and B in ``dtype`` times ``scaling`` (rounded there, as PEFT's scaling of
    B's output is): the factors :class:`LoraLinear` computes with, without gradient; those of
    the innermost :func:`held_factors` block where one is open (and not while compiling: no
    state for the compiler's guards)."""
    if torch.compiler.is_compiling() or not _HELD:
        # compiling: the cast traced, not looked up (an object's id would be a guard, and each
        # layer's factors a compilation of their own; asked first, so that whether a block is
        # open is no guard either)
        return a.detach().to(dtype), b.detach().to(dtype) * scaling
    held = _HELD[-1]
    key, versions = (id(a), id(b), scaling, dtype), (a._version, b._version)
    entry = held.get(key)
    if entry is None or entry[0] is not a or entry[1] is not b or entry[2] != versions:
        low = a.detach().to(dtype), b.detach().to(dtype) * scaling
        entry = held[key] = (a, b, versions, low)
    return entry[3]


def _draws_dropout(dropout: nn.Module) -> bool:
    return not isinstance(dropout, nn.Identity) and dropout.training and dropout.p > 0


def can_merge(model: nn.Module, name: str) -> bool:
    """Whether :func:`merged` can stand in for adapter ``name``: every layer carrying it is a plain
    LoRA linear (:func:`plain_lora`)."""
    layers = [m for m in _lora_state(model).layers if name in m.lora_A]
    return bool(layers) and all(plain_lora(m, name) for m in layers)


@contextmanager
def merged(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """Adapter ``name`` folded into the base for a ``with`` block: each layer's base weight is
    replaced by ``W + scaling * B @ A`` (in W's dtype) and every adapter is disabled, so a forward
    costs one matmul per linear instead of three (sampling only: no gradient reaches the
    adapter). The original weight tensors are put back afterwards, not recomputed, so the base is
    unchanged bit for bit. Outputs equal the unmerged adapter's up to float round-off (one sum
    in another order). Needs :func:`can_merge`."""
    if not can_merge(model, name):
        raise ValueError(f"adapter {name!r} has layers merged() cannot fold (DoRA, bias, ...)")
    previous = active_adapter(model)
    originals: list[tuple[nn.Module, nn.Parameter]] = []
    try:
        with torch.no_grad():
            for layer in _lora_state(model).layers:
                if name not in layer.lora_A:
                    continue
                base = layer.get_base_layer()
                weight = _folded_weight(layer, name)
                originals.append((base, base.weight))
                base.weight = nn.Parameter(weight, False)
        activate(model, BASE)
        yield model
    finally:
        for base, weight in originals:
            base.weight = weight
        activate(model, previous)


def _folded_weight(layer: LoraLayer, name: str) -> torch.Tensor:
    """``W + scaling * B @ A`` in W's dtype: the one weight a plain LoRA linear with adapter
    ``name`` amounts to (with gradient to A and B when enabled)."""
    base = layer.get_base_layer()
    delta = (layer.lora_B[name].weight @ layer.lora_A[name].weight) * layer.scaling[name]
    return base.weight + delta.to(base.weight.dtype)


def can_fold(model: nn.Module, name: str) -> bool:
    """Whether :func:`folded` can stand in for adapter ``name`` in training: :func:`can_merge`, and
    no LoRA dropout (a randomly dropped input is not one weight)."""
    if not can_merge(model, name):
        return False
    dropouts = [m.lora_dropout[name] for m in _lora_state(model).layers if name in m.lora_A]
    return all(isinstance(d, nn.Identity) or d.p == 0 for d in dropouts)


@contextmanager
def folded(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """Adapter ``name`` active for a ``with`` block, each of its layers computing
    ``x @ (W + scaling * B @ A).T`` as one matmul, the folded weight rebuilt with gradient at every
    forward, where PEFT computes ``x @ W.T + scaling * (x @ A.T) @ B.T`` (three matmuls, a scale
    and a sum over every token). Autograd gives A and B their exact gradients through the fold, so
    losses and gradients equal PEFT's up to float round-off (tests/unit/test_rollout_hf.py).

    Why: on the CPU, for the tiny world's widths (128-384, rank 16), the thin rank-16 products
    and the elementwise scale and sum over every token cost more than the base matmul itself;
    folding cut ``bench/vs_trl.py``'s update from 0.497 to 0.409 s a step. It costs one
    weight-sized gradient matmul per layer in the backward, which for a GPU and a wide model is
    more than the thin products it saves, so the trainer folds float32 bases on the CPU only
    (``grpo.fold_lora``). Needs :func:`can_fold`. The layers' own forward is back afterwards."""
    if not can_fold(model, name):
        raise ValueError(
            f"adapter {name!r} has layers folded() cannot fold (DoRA, bias, dropout, ...)"
        )
    layers = [m for m in _lora_state(model).layers if name in m.lora_A]
    with use_adapter(model, name):
        try:
            for layer in layers:
                layer.forward = _FoldedForward(layer, name)  # shadows the class's forward
            yield model
        finally:
            for layer in layers:
                layer.__dict__.pop("forward", None)


class _FoldedForward:
    """A LoRA linear's forward with adapter ``name`` folded into its weight (:func:`folded`); the
    layer's own forward whenever another adapter, or none, is active."""

    def __init__(self, layer: LoraLayer, name: str) -> None:
        self.layer, self.name = layer, name

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        layer = self.layer
        if layer.disable_adapters or layer.active_adapters != [self.name]:
            return type(layer).forward(layer, x, *args, **kwargs)
        base = layer.get_base_layer()
        return nn.functional.linear(x, _folded_weight(layer, self.name), base.bias)


def save_adapters(
    model: PeftModel, out_dir: str | Path, names: Sequence[str], *, base_name: str | None = None
) -> None:
    """Write each adapter to ``out_dir/<name>/`` in standard PEFT format, atomically per adapter.

    ``base_name`` goes into ``adapter_config.json`` as ``base_model_name_or_path`` (None: PEFT's
    own, the path the base was loaded from); ``target_modules`` become short names (module
    docstring)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    valid = adapter_names(model)
    for name in names:
        if name not in valid:
            raise ValueError(f"cannot save unknown adapter {name!r}; resident adapters: {valid}")
        final = out_dir / name
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{name}.") as tmp:
            model.save_pretrained(tmp, selected_adapters=[name])
            # PEFT writes adapter "default" into the root and every other one into a sub-folder.
            written = Path(tmp) if name == "default" else Path(tmp) / name
            staged = Path(tmp) / ".staged"
            staged.mkdir()
            for fname in (CONFIG_NAME, WEIGHTS_NAME):
                (written / fname).replace(staged / fname)
            _portable_config(staged / CONFIG_NAME, model, base_name)
            # The old folder is moved aside only once the new one is complete, then swapped in.
            old = Path(tmp) / ".old"
            if final.exists():
                final.replace(old)
            staged.replace(final)


def _portable_config(config_file: Path, model: PeftModel, base_name: str | None) -> None:
    """Rewrite a saved ``adapter_config.json``: the base named ``base_name``, ``target_modules``
    as sorted short names where they select the same modules, keys sorted (the same adapter always
    writes the same bytes; PEFT saves "all-linear" as a set of paths in hash order)."""
    config = json.loads(config_file.read_text())
    if base_name is not None:
        config["base_model_name_or_path"] = base_name
    targets = config.get("target_modules")
    if isinstance(targets, list):
        config["target_modules"] = short_target_modules(model.base_model.model, targets)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def short_target_modules(base: nn.Module, targets: Sequence[str]) -> list[str]:
    """``targets`` (module paths of ``base`` carrying LoRA) as sorted unique last names, when PEFT's
    suffix rule (a module whose path is a name or ends in ``.name``) would pick exactly those
    modules of ``base``; else ``targets`` sorted, unchanged."""
    short = sorted({t.rsplit(".", 1)[-1] for t in targets})
    chosen = set(targets)
    picked = set()
    for path, _ in base.named_modules():
        parts = path.split(".")
        if any(".".join(parts[:i]) in chosen for i in range(1, len(parts))):
            continue  # inside a LoRA layer: its base_layer, lora_A, ... are not candidates
        if parts[-1] in short:
            picked.add(path)
    return short if picked == chosen else sorted(targets)


def load_adapter_weights(model: PeftModel, in_dir: str | Path, names: Sequence[str]) -> None:
    """Copy saved weights from ``in_dir/<name>/`` into the resident adapters, in place.

    Parameters keep their identity (an optimizer holding them stays valid). Fails when a saved
    folder misses any LoRA tensor of the resident adapter or carries tensors it does not have.
    """
    in_dir = Path(in_dir)
    valid = adapter_names(model)
    for name in names:
        if name not in valid:
            raise ValueError(
                f"cannot load into unknown adapter {name!r}; resident adapters: {valid}"
            )
        folder = in_dir / name
        if not (folder / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"no {WEIGHTS_NAME} for adapter {name!r} in {folder}")
        saved = load_peft_weights(str(folder), device="cpu")
        expected = get_peft_model_state_dict(model, adapter_name=name)
        wrong = [k for k in expected.keys() & saved.keys() if saved[k].shape != expected[k].shape]
        if wrong:
            k = wrong[0]
            raise ValueError(
                f"adapter {name!r} in {folder} has other shapes than the resident adapter (LoRA rank "
                f"or base model differ): {k} is {tuple(saved[k].shape)}, expected {tuple(expected[k].shape)}"
            )
        missing = sorted(set(expected) - set(saved))
        extra = sorted(set(saved) - set(expected))
        if missing or extra:
            raise ValueError(
                f"adapter {name!r} in {folder} does not match the resident adapter: "
                f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}"
            )
        with torch.no_grad():
            result = set_peft_model_state_dict(model, saved, adapter_name=name)
        unloaded = [k for k in result.missing_keys if _is_lora_param(k, name)]
        if unloaded or result.unexpected_keys:
            raise ValueError(
                f"adapter {name!r} from {folder}: PEFT left {unloaded[:3]} unloaded and "
                f"ignored {list(result.unexpected_keys)[:3]}"
            )
    _ensure_trainable(_lora_state(model))
