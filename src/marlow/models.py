"""Loading the frozen base model and its tokenizer: a tiny scale or a Hugging Face id/path, in
the run's dtype, on the run's device.

A tiny scale name (``tiny-s``, ``tiny-m``, ``tiny-l``) is one world per task (the math and the
code world each have their own corpus), picked by ``model.world`` (:func:`tiny_world`): the world
marlow ships for the recipe (``marlow.tiny.shipped``: the quickstart's and the tiny preset's),
loaded with no pre-training once its weights' sha256 checks, or else one pre-trained on first use
and cached (``marlow.tiny.pretrain``). Anything else goes to ``from_pretrained``, after checks that
fail fast in one line:

* a name that looks like a path (starts with ``/``, ``.`` or ``~``) must be an existing folder
  ("no such folder" otherwise, never the hub's "Repo id must be..." message);
* a hub id must be in the local Hugging Face cache, or the hub must answer within
  ``HUB_PROBE_TIMEOUT_S`` (one metadata request, no retries): without this a model that is not
  cached took 66-70 s of download retries to fail offline. With ``HF_HUB_OFFLINE`` set no
  request is made at all. The message says how to fix it (download it, or use a folder or a tiny
  scale).

Precision (config ``dtype``): the base weights are loaded in that dtype, so its activations and
logits are too. Everything marlow trains or accumulates stays float32 whatever the base's dtype:
LoRA weights and their gradients (PEFT's ``autocast_adapter_dtype``,
:func:`marlow.policy.adapters.attach_adapters`), AdamW state, and the log-prob, entropy, chi2 and
KL arithmetic (logits are cast to float32 before the log-softmax). The model is moved to the
run's device (config ``device``, :func:`resolve_device`) once, right after loading.

RMSNorm: the loaded model's RMSNorms compute through torch's ``rms_norm`` (:func:`fuse_norms`),
one fused kernel each way on CUDA where transformers' eager arithmetic runs eight kernels
forward (float32 copies of every token's activations among them); the same values in float32,
one rounding instead of two in bfloat16.

Rotary embedding: transformers' ``apply_rotary_pos_emb`` of the Qwen3, Qwen2, Llama and Mistral
modules computes through :func:`rotate` and its own backward once a base is loaded
(:func:`fuse_rotary`): transformers' values and gradients bit for bit, in four kernels each way
where its arithmetic runs five forward and nine backward.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, get_device_states, set_device_states

from marlow.algo.estimators import (
    EAGER_HEAD,
    HeadOps,
    head_logprobs_and_entropy,
    token_logprobs_and_entropy,
)
from marlow.algo.matmul import slow_half
from marlow.config import DEVICE_FORM, DEVICES, ConfigError, ModelConfig, TaskConfig
from marlow.forwards import through
from marlow.logs import Phase
from marlow.policy.adapters import lora_in_base_dtype, recompute_as_forward, refresh_factors
from marlow.shared_prompts import pack_shared_prompts


class ModelLoadError(RuntimeError):
    pass


HUB_PROBE_TIMEOUT_S = 3.0
VALID_MODELS = "a folder, a hub id owner/name, or a tiny scale: tiny-s, tiny-m, tiny-l"


def _hub_offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower()
    return bool(constants.HF_HUB_OFFLINE) or env in ("1", "true", "yes", "on")


def check_model_source(name: str) -> str:
    """What ``from_pretrained`` should be given for ``name`` (a folder or a hub id), or a
    one-line ModelLoadError when it cannot load: a missing folder, a hub id neither cached nor
    reachable."""
    path = Path(name).expanduser()
    if name.startswith(("/", ".", "~")) or path.is_dir():
        if not path.is_dir():
            raise ModelLoadError(
                f"model.name {name!r}: no such folder ({path.resolve()}); valid: {VALID_MODELS}"
            )
        return str(path)
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError:
        raise ModelLoadError(
            f"model.name {name!r} is neither a folder nor a hub id; valid: {VALID_MODELS}"
        ) from None
    if isinstance(cached, str):
        return name
    fix = f"download it first (huggingface-cli download {name}) or use a folder or a tiny scale (tiny-s)"
    if _hub_offline():
        raise ModelLoadError(
            f"model.name {name!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {fix}"
        )
    try:
        model_info(name, timeout=HUB_PROBE_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"model.name {name!r}: no such model on the Hugging Face hub (or it is private: "
            f"log in with huggingface-cli login); valid: {VALID_MODELS}"
        ) from None
    except Exception as err:  # no network, DNS, timeout, proxy: all one line
        raise ModelLoadError(
            f"model.name {name!r} is not in the Hugging Face cache and the hub cannot be reached "
            f"({type(err).__name__}); {fix}"
        ) from None
    return name


def is_tiny(name: str) -> bool:
    from marlow.tiny.model import SCALES

    return name in SCALES


PRETRAIN_MS_PER_EXAMPLE = {"tiny-s": 4.0, "tiny-m": 10.0, "tiny-l": 20.0}
"""Milliseconds a tiny world's pre-training spends per example on the 2-core CPU marlow is built
on (docs/concepts/tiny-world.md: tiny-s's full recipe, 64 x 1,200 examples, 280-340 s; tiny-m
about 16 min; tiny-l 37-51 min), for the estimate printed before a world is pre-trained. Another
machine, or the code world's longer examples, may take longer: the line says it is an estimate."""


def pretrain_notice(config: ModelConfig, task: str = "math") -> str | None:
    """The line to say before the tiny world of ``config`` is pre-trained (None when it is
    cached): what happens, roughly how long it takes, that it happens once, and, for a tiny-s
    math world other than the quickstart's, whether ``preset=quickstart`` would reuse a cached
    one (the quickstart's quick recipe trains in about half the time)."""
    from marlow.config.presets import PRESETS
    from marlow.tiny.model import get_scale
    from marlow.tiny.pretrain import BATCH_EXAMPLES, tiny_path

    steps, batch = config.pretrain_steps, config.pretrain_batch
    path = tiny_path(config.name, steps=steps, batch=batch, task=task)
    if (path / "meta.json").exists():
        return None
    steps = get_scale(config.name).pretrain_steps if steps is None else steps
    batch = BATCH_EXAMPLES if batch is None else batch
    minutes = steps * batch * PRETRAIN_MS_PER_EXAMPLE[config.name] / 60_000
    took = f"about {minutes:.0f} min" if minutes >= 1.5 else "about a minute or less"
    line = (
        f"the tiny world {config.name} ({task}) is not cached: pre-training it first "
        f"({steps:,} steps of {batch} examples), {took} on 2 CPU cores (an estimate), once: "
        f"later runs reuse it ({path.parent})"
    )
    quick = PRESETS["quickstart"]["model"]
    if (config.name, task) == (quick["name"], "math") and (steps, batch) != (
        quick["pretrain_steps"],
        quick["pretrain_batch"],
    ):
        world = ModelConfig(
            name=quick["name"],
            pretrain_steps=quick["pretrain_steps"],
            pretrain_batch=quick["pretrain_batch"],
        )
        if _shipped(world, "math") is not None:
            line += "; preset=quickstart uses the world marlow ships (no pre-training)"
        elif (tiny_path(quick["name"], **_recipe(world, "math")) / "meta.json").exists():
            line += "; preset=quickstart reuses the quickstart's world, already cached"
        else:
            line += "; preset=quickstart trains on the quickstart's quicker world (half the time)"
    return line


def task_family(model: ModelConfig, task: TaskConfig) -> str:
    """The template family the run's roles read (``math``, ``code``, ``general``), which on a
    tiny model is also the tiny world it loads (:meth:`TaskConfig.family_for`)."""
    return task.family_for(is_tiny(model.name))


def vocabulary(name: str) -> str | None:
    """The characters model ``name`` reads, where it reads only some (a tiny model: printable
    ASCII and newline); None for a real model's tokenizer."""
    if not is_tiny(name):
        return None
    from marlow.tiny.tokenizer import CHARACTERS

    return "".join(CHARACTERS)


def prompt_style(name: str) -> str:
    """Tiny models read the terse ``tiny`` prompts; real chat models the ``chat`` ones."""
    return "tiny" if is_tiny(name) else "chat"


def resolve_device(name: str) -> torch.device:
    """The device config ``device`` names, on this machine: ``auto`` is cuda if torch sees a CUDA
    device, else mps if available, else cpu; ``cuda`` is the current CUDA device, with its index
    (``cuda:0``), so that it compares equal to the device its tensors report. A device this
    machine lacks is a one-line ConfigError listing the ones it has."""
    if not DEVICE_FORM.fullmatch(name):
        raise ConfigError(f"config field 'device': unknown device {name!r}; valid: {DEVICES}")
    has_cuda = torch.cuda.is_available()
    has_mps = torch.backends.mps.is_available()
    if name == "auto":
        name = "cuda" if has_cuda else "mps" if has_mps else "cpu"
    kind, _, index = name.partition(":")
    count = torch.cuda.device_count() if has_cuda else 0
    present = {"cpu": True, "mps": has_mps, "cuda": count > (int(index) if index else 0)}
    if not present[kind]:
        here = ["auto", "cpu"] + (["cuda", *(f"cuda:{i}" for i in range(count))] if count else [])
        if has_mps:
            here.append("mps")
        why = (
            f"torch sees {count} CUDA device(s)"
            if kind == "cuda"
            else "torch.backends.mps.is_available() is False"
        )
        if kind == "cuda" and not count and torch.version.cuda is None:
            why += f" (torch {torch.__version__} is a CPU-only build)"
        raise ConfigError(
            f"config field 'device' is {name!r} but this machine has no such device: {why}; "
            f"valid here: {', '.join(here)}"
        )
    if kind == "cuda" and not index:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def _recipe(config: ModelConfig, task: str) -> dict:
    return {"steps": config.pretrain_steps, "batch": config.pretrain_batch, "task": task}


def _shipped(config: ModelConfig, task: str):
    """The shipped world ``config`` may load (a ShippedWorld), or None (``model.world=rebuild``, or
    marlow ships none of this recipe)."""
    from marlow.tiny.shipped import find_shipped

    return None if config.world == "rebuild" else find_shipped(config.name, **_recipe(config, task))


def tiny_world_folder(config: ModelConfig, task: str = "math") -> Path:
    """The folder the tiny world of ``config`` loads from, whether it exists yet or not: the
    shipped world's (:func:`tiny_world`'s rule), else the cache's
    (:func:`marlow.tiny.pretrain.tiny_path`)."""
    from marlow.tiny.pretrain import tiny_path
    from marlow.tiny.shipped import ROOT

    found = _shipped(config, task)
    return ROOT / found.folder if found else tiny_path(config.name, **_recipe(config, task))


def tiny_world(
    config: ModelConfig, task: str = "math", log: Callable[[str], None] | None = None
) -> Path:
    """The folder of the tiny world ``config`` names, ready to load (``model.world``):

    * ``auto``: the shipped world of this recipe, its weights' sha256 checked (a damaged file is a
      one-line DamagedFileError), else the cache's, pre-trained first if missing;
    * ``shipped``: the shipped world, or a one-line ModelLoadError naming the shipped recipes;
    * ``rebuild``: the cache's (pre-trained on this machine if missing), never the shipped one.
    """
    from marlow.tiny import shipped
    from marlow.tiny.pretrain import pretrain_tiny

    found = _shipped(config, task)
    if found is not None:
        return shipped.checked(found)
    if config.world == "shipped":
        raise ModelLoadError(
            f"model.world=shipped: marlow ships no {config.name} {task} world of this recipe "
            f"(model.pretrain_steps={config.pretrain_steps}, model.pretrain_batch="
            f"{config.pretrain_batch}); shipped: {shipped.listing()}. Set model.world=auto to "
            "pre-train it"
        )
    notice = pretrain_notice(config, task)
    if notice is not None and log is not None:
        log(Phase(notice))
    return pretrain_tiny(config.name, log=log, **_recipe(config, task))


def load_base(
    config: ModelConfig,
    log: Callable[[str], None] | None = None,
    task: str = "math",
    *,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
    folder: Path | None = None,
):
    """(model, tokenizer) with every base weight frozen, in ``dtype`` (a torch dtype's name,
    config ``dtype``) and moved to ``device``. ``task`` picks the tiny world (:func:`tiny_world`;
    ignored for a Hugging Face model). Pre-training, when the world is not shipped, runs with
    the recipe's threads (``marlow.tiny.pretrain.THREADS``), never the run's: ``threads`` is a
    machine setting (resume-safe) and must not change the base model. It is float32 on the CPU;
    only the loaded copy is cast. ``folder``: a saved copy of the model ``config.name`` names
    (an export's), loaded instead."""
    torch_dtype = getattr(torch, dtype)
    if is_tiny(config.name):
        from marlow.tiny.pretrain import load_tiny

        world = folder if folder is not None else tiny_world(config, task, log)
        model, tokenizer = load_tiny(world, dtype=torch_dtype)
    else:
        if folder is not None:
            config = config.model_copy(update={"name": str(folder)})
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from marlow.tiny.pretrain import quiet_hf

        source = check_model_source(config.name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
        except Exception as err:  # noqa: BLE001 - any failure is _unloadable's one line
            raise _unloadable(config.name, err) from None
        if getattr(tokenizer, "chat_template", None) is None:  # checked before the weights load
            raise ModelLoadError(
                f"model.name {config.name!r}: its tokenizer has no chat template (a base model, "
                "not a chat one?), and every role's prompt is sent through the model's chat "
                "template. Use the model's chat (instruct) version, or give the folder a "
                "chat_template.jinja"
            )
        try:
            with quiet_hf():
                model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        except Exception as err:  # noqa: BLE001 - any failure is _unloadable's one line
            raise _unloadable(config.name, err) from None
    model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()  # dropout off in the base; LoRA dropout is set by the adapter config
    fuse_norms(model)
    fuse_rotary()
    if log is not None and (note := half_precision_note(torch_dtype, torch.device(device))):
        log(note)
    return model, tokenizer


def pad_id(tokenizer: Any) -> int:
    """The token id that fills padded positions (of a sampling batch, of an update's rows): the
    tokenizer's pad token, else its eos token (a tokenizer without a pad token, as Llama 3's),
    else 0. Padded positions are masked, so any valid id serves."""
    for found in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if found is not None:
            return int(found)
    return 0


def _unloadable(name: str, err: Exception) -> ModelLoadError:
    """The one line for a model ``name`` whose tokenizer or weights do not load: a damaged or
    foreign folder (OSError, ValueError, a config field of the wrong type from huggingface_hub's
    strict dataclasses, a negative size...), or a hub id not in the cache."""
    reason = " ".join(str(err).split())[:300].rstrip(".") or type(err).__name__
    return ModelLoadError(
        f"model.name {name!r} cannot be loaded (offline, or not a causal LM): {reason}. Use a "
        "local path, a cached hub id, or a tiny scale: tiny-s, tiny-m, tiny-l"
    )


def half_precision_note(dtype: torch.dtype, device: torch.device) -> str | None:
    """The line a run says when its base computes in bfloat16 or float16 on a CPU without native
    instructions for that dtype (:func:`marlow.algo.matmul.slow_half`: x86 without AVX-512
    BF16 or AMX, such as AVX2 machines), else None. There torch's half-precision matrix
    products run at a fifth to an eighth of float32's (16-20 GFLOP/s against 80-120 on a 2-core
    AMD EPYC, Zen 3, torch 2.13, in bfloat16 and float16 alike: ``bench/half_matmul.py``), and
    one update pass of a bfloat16 Qwen3-0.6B over 512 tokens took 158 s against 39 s in float32
    (``bench/learn_memory.py``)."""
    if not slow_half(dtype, device):
        return None
    name = str(dtype).removeprefix("torch.")
    units = "AVX-512 BF16 or AMX" if dtype == torch.bfloat16 else "AVX-512 FP16 or AMX-FP16"
    return (
        f"dtype is {name}, but this CPU has no native {name} matrix products (no {units}): "
        f"they run about 4 times slower than float32 here; dtype=float32 computes the same "
        f"model faster, with twice the weights' memory"
    )


RMS_NORMS = frozenset(["Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"])
"""transformers' RMSNorm classes whose forward is ``weight * (x / rms(x))`` computed in float32
and cast back to the input's dtype before the weight (the same code in each): the ones
:func:`fuse_norms` computes through torch's ``rms_norm``."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, through torch's
    ``rms_norm``: computed in float32 and rounded once to ``x``'s dtype (``weight`` is in it),
    outside any autocast (which would return float32). On CUDA one fused kernel forward and one
    backward (``_fused_rms_norm``), where transformers' eager RMSNorm runs eight forward, three of
    them float32 passes over every token; on the CPU torch composes it of the same operations as
    transformers', in float32 bit for bit the same values."""
    shape = (x.shape[-1],)
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.rms_norm(x, shape, weight, eps)
    return torch.nn.functional.rms_norm(x, shape, weight, eps)


def fuse_norms(model: torch.nn.Module) -> int:
    """Make each RMSNorm of ``model`` of a class in :data:`RMS_NORMS` compute through
    :func:`rms_norm` (its class made one whose forward is :class:`_NormThroughTorch`'s,
    :func:`marlow.forwards.through`: in every pass, a checkpoint's recompute and a compiled
    layer included); returns how many it made so. Over a float32 model the values are
    transformers' bit for bit; over a bfloat16 one ``x / rms(x)`` is no longer rounded to
    bfloat16 before the weight multiplies it (one rounding, not two: within one bfloat16 step of
    transformers'). The lean sampling forward (:mod:`marlow.rollout.lean`) computes a fused norm
    the same way."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in RMS_NORMS and not fused_norm(module):
            through(module, _NormThroughTorch)
            count += 1
    return count


def fused_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes through :func:`rms_norm` (:func:`fuse_norms`)."""
    return isinstance(module, _NormThroughTorch)


class _NormThroughTorch:
    """An RMSNorm's forward through :func:`rms_norm`; the class's own where the input's dtype is
    not the weight's (torch would compose it then, in another order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dtype != self.weight.dtype:
            return super().forward(x)
        return rms_norm(x, self.weight, self.variance_epsilon)


ROTARY_MODULES = ("qwen3", "qwen2", "llama", "mistral")
"""transformers' modeling modules (``transformers.models.<name>.modeling_<name>``) whose
``apply_rotary_pos_emb`` is ``q * cos + rotate_half(q) * sin`` (and the same for ``k``; the same
code in each): the ones :func:`fuse_rotary` computes through :func:`rotate`."""


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with the first half of its last dimension negated: the table :func:`rotate` takes."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` (last dimension even): ``x * cos + rotate_half(x) * sin``,
    with ``sin_signed = signed_sin(sin)``. ``rotate_half(x) = cat(-x2, x1)`` times ``sin`` is
    ``cat(x2, x1)``, the halves swapped by one ``roll``, times ``sin_signed`` (a sign moved from one
    factor to the other is exact), so the value is transformers' bit for bit in every dtype, in
    four kernels where transformers' runs five (a negation and a concatenation of halves in
    place of the ``roll``)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class _Rotary(torch.autograd.Function):
    """:func:`rotate` with its own backward: ``g * cos + roll(g * sin_signed)`` (the adjoint of
    the swap is the swap), four kernels and bit for bit the gradient autograd takes of
    transformers' arithmetic, where that runs nine (its negation, and for each half a filled
    zero tensor and a copy into it, then their sum). It keeps only the angles' tables, which
    take no gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin_signed):  # noqa: D102
        ctx.save_for_backward(cos, sin_signed)
        return rotate(x, cos, sin_signed)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        cos, sin_signed = ctx.saved_tensors
        return grad * cos + (grad * sin_signed).roll(grad.shape[-1] // 2, -1), None, None


class _FusedRotary:
    """``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` through :class:`_Rotary`; the
    module's own (``original``) where the head dimension is odd or is not the angles', or where
    the angles take a gradient. The signed table of the last ``sin`` it was given is found
    again by the next call while something else keeps it (the layers' saved tensors): every
    layer of a forward, and a checkpoint's recompute, get the same ``sin``, so where the table
    is kept for the backward they share one, as they share transformers' own, and it never
    outlives what keeps it (weak references to ``sin`` and to the table, and ``sin``'s
    version; a compiled layer makes its own: no state for its guards; and so does a forward in
    inference mode, whose tensors keep no version)."""

    def __init__(self, original: Callable) -> None:
        self.original = original
        self.last: tuple | None = None  # weakrefs: (sin, its version, unsqueeze_dim, table)

    def __call__(self, q, k, cos, sin, unsqueeze_dim: int = 1):
        if (
            q.shape[-1] % 2
            or not q.shape[-1] == k.shape[-1] == cos.shape[-1] == sin.shape[-1]
            or cos.requires_grad
            or sin.requires_grad
        ):
            return self.original(q, k, cos, sin, unsqueeze_dim)
        last, sin_signed = self.last, None
        keep = not (torch.compiler.is_compiling() or sin.is_inference())
        if keep and last and last[0]() is sin and last[1:3] == (sin._version, unsqueeze_dim):
            sin_signed = last[3]()
        if sin_signed is None:
            sin_signed = signed_sin(sin.unsqueeze(unsqueeze_dim))
            if keep:
                table = weakref.ref(sin_signed)
                self.last = (weakref.ref(sin), sin._version, unsqueeze_dim, table)
        cos = cos.unsqueeze(unsqueeze_dim)
        return _Rotary.apply(q, cos, sin_signed), _Rotary.apply(k, cos, sin_signed)


def fuse_rotary() -> int:
    """Make the ``apply_rotary_pos_emb`` of each modeling module of :data:`ROTARY_MODULES` compute
    through :class:`_FusedRotary` (in the whole process: transformers' attention looks the
    function up in its module; the values and gradients are transformers' bit for bit, so every
    model of those architectures computes exactly as before, in fewer kernels); returns how many
    it replaced (none the second time, and none that is not transformers' own: another library's
    replacement is left as it is)."""
    count = 0
    for module in _rotary_modules():
        original = getattr(module, "apply_rotary_pos_emb", None)
        if getattr(original, "__module__", None) == module.__name__:
            module.apply_rotary_pos_emb = _FusedRotary(original)
            count += 1
    return count


@contextlib.contextmanager
def transformers_rotary() -> Iterator[None]:
    """transformers' own ``apply_rotary_pos_emb`` again for a ``with`` block, where
    :func:`fuse_rotary` replaced it (so that the two can be timed side by side:
    ``bench/gpu_check.py``)."""
    fused = [(m, m.apply_rotary_pos_emb) for m in _rotary_modules()]
    fused = [(m, f) for m, f in fused if isinstance(f, _FusedRotary)]
    for module, f in fused:
        module.apply_rotary_pos_emb = f.original
    try:
        yield
    finally:
        for module, f in fused:
            module.apply_rotary_pos_emb = f


def _rotary_modules() -> list:
    return [
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for name in ROTARY_MODULES
    ]


def checkpoints_layers(config) -> bool:
    """Whether a run's ``grpo.activation_checkpointing`` asks to checkpoint its decoder layers'
    activations in the update, before a card is considered (auto: on for a Hugging Face model,
    off for a tiny scale); on a CUDA card auto may then keep them after all
    (:func:`marlow.plan.update_settings`)."""
    setting = config.grpo.activation_checkpointing
    return not is_tiny(config.model.name) if setting == "auto" else setting == "on"


def checkpointable_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of ``model`` that :func:`checkpoint_layers` checkpoints."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def checkpoint_layers(model: torch.nn.Module, on: bool = True) -> int:
    """Turn activation checkpointing of ``model``'s decoder layers on (or off): each layer keeps
    only its input for the backward and runs again there (:class:`_Recomputed`; a call it cannot
    replay through ``torch.utils.checkpoint``, non-reentrant), in the passes that build a graph
    with the model in training mode, which the trainer's update alone does; sampling and scoring
    without gradients run as before. The layers are transformers' ``GradientCheckpointingLayer``
    s (every decoder of Qwen3, Qwen2, Llama, Mistral); returns how many were set, and a model
    with none is a ValueError.
    The checkpoint wraps the layer's call (:func:`_layer_call`), not transformers' own
    switch inside its forward, so that a compiled layer (:func:`compile_layers`) is compiled
    without it: inside a compiled layer, the checkpoint's recompute region holds the attention's
    random-number state (scaled-dot-product attention in training mode), which torch.compile
    refuses to recompute."""
    layers = checkpointable_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no layers that can be checkpointed")
    for layer in layers:
        _set_call(layer, checkpointed=on)
    return len(layers)


def compiles_layers(config) -> bool:
    """Whether a run compiles its decoder layers for scoring and the update (``grpo.compile``
    on; auto is off on every device).

    Why auto is off on CUDA too: the compilations cost more than a run of ordinary length wins
    back. On an H200 the first Voting-IP step of a Qwen3-0.6B stand-in (2 adapters, 6,144-token
    micro-batches) spent 157 s learning, nearly all of it compiling a layer per adapter and kind
    of pass, against 1.5 s of rollout; the same card's eager update ran 22,000-25,000 tokens/s,
    under a second for that step's tokens; and the CPU's compiled update pass was 1.13 times the
    eager one's speed (``bench/compile_layers.py``)."""
    return config.grpo.compile == "on"


COMPILE_LIMIT = 64
"""How many compilations a compiled function may make in a process (torch.compile's default,
8, is for one function): a compiled decoder layer makes one with the adapters (over a bfloat16
or float16 base every adapter shares it: :func:`marlow.policy.adapters.active_factors`; over a
float32 base one per adapter) and one with the base, per kind of pass (with gradients, where the
first layer's input needs none and the others' do; without, in training mode for a checkpointed
layer's forward and in evaluation mode; in inference mode), with an attention mask and without,
and per batch of one row (the adapter-sync check's probe); the sampler's
compiled flex attention one per batch size (``marlow.rollout.lean``)."""
_LIMIT = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
)
"""The setting's name (torch before 2.7 called it ``cache_size_limit``)."""


def compile_limit() -> contextlib.AbstractContextManager:
    """Within it, a compiled function may make :data:`COMPILE_LIMIT` compilations."""
    return torch._dynamo.config.patch(**{_LIMIT: COMPILE_LIMIT})


def compile_layers(model: torch.nn.Module, on: bool = True) -> int:
    """Compile ``model``'s decoder layers (:func:`checkpointable_layers`) with ``torch.compile``
    (dynamic shapes: one compilation serves every micro-batch's rows and length, and every
    layer, whose norms and LoRA linears compute through marlow's forwards by their class:
    :mod:`marlow.forwards`), or with
    ``on`` False turn them back to eager. The forwards that read no KV cache go through them:
    the trainer's scoring and update (checkpointed or not, :func:`checkpoint_layers`) and the
    HF engine's scoring. Where scoring takes the model's LM head chunk by chunk
    (:func:`decoder_and_head`), each chunk's log-softmax and slopes are compiled too
    (:func:`compiled_head`). Returns how many were set; a
    model with none is a ValueError.

    Why: the update of a bfloat16 0.6B on a GPU spent most of its device time in elementwise
    kernels (RMSNorm's float32 copies, the rotary angles, LoRA's scaling and sums), each a pass
    over every token's activations; compiled, each layer's elementwise work is fused into a few
    kernels. The layer's arithmetic is unchanged: in float32 the log-probs and gradients equal
    the eager layers' within float round-off (tests); in bfloat16 a fused kernel rounds once
    where eager rounds after every operation. A compilation that fails warns once and leaves
    every layer eager for the rest of the process (``grpo.compile=off`` skips the attempt).
    The sampling loop's own forward through a model's modules (a model the lean forward does
    not compute) runs them eager: its KV cache grows every token, which would compile again
    each time."""
    layers = checkpointable_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers that can be compiled")
    for layer in layers:
        _set_call(layer, compiled=torch.compile(layer._call_impl, dynamic=True) if on else None)
    split = decoder_and_head(model)
    if split is not None:  # its chunks' log-softmax and slopes too: compiled_head
        split[1]._marlow_head_ops = compiled_head() if on else None
    return len(layers)


_COMPILED_HEAD: list[HeadOps] = []
"""The process's one :func:`compiled_head`, made on first use (every model's head shares its
compilations)."""


def compiled_head() -> HeadOps:
    """The chunk functions of :func:`marlow.algo.estimators.head_logprobs_and_entropy` through
    ``torch.compile`` (dynamic shapes: one compilation serves every chunk's length), each
    falling back to eager as the decoder layers do (:func:`_compiled_call`). What
    :func:`compile_layers` gives a model's LM head, and :func:`completion_logprobs` then scores
    through.

    Why: eager, a chunk's forward runs three operations over its (chunk, vocabulary) logits
    beyond the head's product (the upcast, the temperature's division, the log-softmax; three
    more for the entropies) and, in an update (the slopes), four more before the slopes'
    product (the softmax, its sign, the temperature, the downcast), each a pass through memory;
    compiled, the log-softmax and the gather fuse into reductions that never write the float32
    logits, and the slopes' softmax, scaling and downcast into a few kernels. On a 2-core CPU
    an update pass at the 0.6B's widths and vocabulary (4 layers, 2 x 512 tokens, bfloat16,
    ``bench/compile_layers.py --vocab 151936``) took 4.16 s eager and 3.65 s compiled, the same
    with a 4,096-id vocabulary 1.92 and 1.73: the head's part about 2.2 s eager and 1.9
    compiled. Float32 round-off apart, the same values (tests)."""
    if not _COMPILED_HEAD:
        _COMPILED_HEAD.append(
            HeadOps(
                *(
                    partial(_compiled_call, eager, torch.compile(eager, dynamic=True))
                    for eager in EAGER_HEAD
                )
            )
        )
    return _COMPILED_HEAD[0]


_NOT_SET = object()


def _set_call(layer: torch.nn.Module, checkpointed=_NOT_SET, compiled=_NOT_SET) -> None:
    """Record ``layer``'s checkpointing and compiled call (what is not given stays), and route
    its calls through :func:`_layer_call` where either is on (else its plain call)."""
    state = dict(getattr(layer, "_marlow_call", {"checkpointed": False, "compiled": None}))
    if checkpointed is not _NOT_SET:
        state["checkpointed"] = checkpointed
    if compiled is not _NOT_SET:
        state["compiled"] = compiled
    layer._marlow_call = state
    on = state["checkpointed"] or state["compiled"] is not None
    # nn.Module calls ``_compiled_call_impl`` instead of its own call where it is set
    layer._compiled_call_impl = partial(_layer_call, layer) if on else None


def _layer_call(layer: torch.nn.Module, *args, **kwargs):
    """A call of ``layer`` through its compiled call (else its eager one), inside a checkpoint
    where it is checkpointed and the pass builds a graph in training mode."""
    state = layer._marlow_call
    run = layer._call_impl
    if state["compiled"] is not None and not _GAVE_UP:
        refresh_factors(layer)  # the compiled call reads each LoRA linear's as last found
        run = partial(_compiled_call, layer._call_impl, state["compiled"])
    if state["checkpointed"] and layer.training and torch.is_grad_enabled():
        as_forward = recompute_as_forward(layer)  # LoRA's arithmetic as in the forward
        if _replayable(args, kwargs) and not _TORCH_CHECKPOINT:
            return _Recomputed.apply(_Replay(run, args[0], kwargs, as_forward), _ANCHOR, args[0])
        context = partial(_in_the_forward, as_forward)
        return checkpoint(run, *args, use_reentrant=False, context_fn=context, **kwargs)
    return run(*args, **kwargs)


class _Recomputed(torch.autograd.Function):
    """A checkpointed decoder layer: its forward builds no graph and keeps only the layer's
    input; its backward runs the layer again on it with a graph, in the state the forward ran
    in (:class:`_Replay`), and back-propagates through that at once, by a backward of its own
    (the layer's parameters get their gradients in ``.grad`` there, as from the whole
    backward). The same operations in the same order as the layer without checkpointing, so the
    same values and gradients bit for bit (tests).

    Why not ``torch.utils.checkpoint``'s non-reentrant checkpoint: it hooks every tensor the
    layer saves for the backward, a Python call to pack each and one to unpack it, and checks
    each recomputed tensor's metadata: host's work, which a GPU waits on where an update pass of
    a few thousand tokens is bound by its launches. On the update's Python-bound stand-in
    (``bench/update_ops.py``'s last line: one row of 16 tokens, 2-core CPU) a checkpointed pass
    took 183-199 ms through it, 147-150 ms through this, 91-96 ms not checkpointed. Its
    reentrant one would do, but gives
    no gradient to the LoRA factors of a layer whose input needs none (the first, after the
    frozen embedding); here the output always takes part in the backward through
    :data:`_ANCHOR`.

    A choice of this design: gradients reach the layer's parameters only through
    ``backward()`` (``torch.autograd.grad`` of a loss with respect to them would find none),
    which is how the trainer takes them."""

    @staticmethod
    def forward(ctx, replay: _Replay, _anchor: torch.Tensor, hidden: torch.Tensor):  # noqa: D102
        ctx.replay = replay
        ctx.save_for_backward(hidden)
        # detached: whether the input needs a gradient is no concern of a forward without a
        # graph, and a compiled layer is then compiled once for it, not once each way
        return replay.run(hidden.detach())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # noqa: D102
        (hidden,) = ctx.saved_tensors
        again = hidden.detach().requires_grad_(hidden.requires_grad)
        out = ctx.replay.again(again)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [
            (o, g)
            for o, g in zip(outs, grads, strict=True)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None, None, again.grad


def _in_the_forward(as_forward: Callable) -> tuple:
    """``torch.utils.checkpoint``'s ``context_fn``: the forward as it is, the recompute in
    ``as_forward()``."""
    return contextlib.nullcontext(), as_forward()


_ANCHOR = torch.empty(0, requires_grad=True)
"""An input of every :class:`_Recomputed` that needs a gradient, so that the layer's output
takes part in the backward even where its input (the embedding's output) needs none; it gets
none."""


class _Replay:
    """What a checkpointed layer's recompute needs of its forward: the call (``run`` on the
    hidden state with ``kwargs``), LoRA's arithmetic as it was (``recompute``:
    :func:`marlow.policy.adapters.recompute_as_forward`), the autocast then in force and the
    random number generators' states (the CPU's and the hidden state's device's), as
    ``torch.utils.checkpoint`` restores them: a layer drawing LoRA dropout draws the same
    again."""

    def __init__(
        self, run: Callable, hidden: torch.Tensor, kwargs: dict, recompute: Callable
    ) -> None:
        self.call, self.kwargs, self.recompute = run, kwargs, recompute
        self.device_type = hidden.device.type
        types = dict.fromkeys([self.device_type, "cpu"])
        self.autocast = [
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
            for t in types
            if torch.amp.is_autocast_available(t)
        ]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.cpu_rng = torch.get_rng_state()
        self.devices, self.device_rng = get_device_states(hidden)

    def run(self, hidden: torch.Tensor):
        return self.call(hidden, **self.kwargs)

    def again(self, hidden: torch.Tensor):
        """The forward once more, with a graph, in the forward's state."""
        rng = torch.random.fork_rng(devices=self.devices, device_type=self.device_type)
        with rng, contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            set_device_states(self.devices, self.device_rng, device_type=self.device_type)
            for device_type, enabled, dtype in self.autocast:
                cache = self.autocast_cache
                stack.enter_context(torch.autocast(device_type, dtype, enabled, cache))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(self.recompute())
            return self.run(hidden)


_TORCH_CHECKPOINT: list[bool] = []
"""Non-empty inside :func:`torch_checkpoint`."""


@contextlib.contextmanager
def torch_checkpoint() -> Iterator[None]:
    """Inside the ``with`` block, checkpointed layers go through ``torch.utils.checkpoint``'s
    non-reentrant checkpoint instead of :class:`_Recomputed` (the same values: so that the two
    can be timed side by side, ``bench/update_ops.py`` and ``bench/gpu_check.py``)."""
    _TORCH_CHECKPOINT.append(True)
    try:
        yield
    finally:
        _TORCH_CHECKPOINT.pop()


def _replayable(args: tuple, kwargs: dict) -> bool:
    """Whether a layer's call is one :class:`_Recomputed` replays: its hidden state the one
    positional argument, and no keyword argument a tensor that needs a gradient or an object
    the layer could change (a KV cache); else it goes through ``torch.utils.checkpoint``."""
    if len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return False
    for value in kwargs.values():
        parts = value if isinstance(value, tuple | list) else (value,)
        for part in parts:
            if isinstance(part, torch.Tensor):
                if part.requires_grad:
                    return False
            elif part is not None and not isinstance(part, bool | int | float | str):
                return False
    return True


def _compiled_call(eager: Callable, compiled: Callable, *args, **kwargs):
    """``compiled(*args, **kwargs)`` (a decoder layer's forward, a head chunk's function),
    allowed :data:`COMPILE_LIMIT` compilations; ``eager``'s once compiling failed in this
    process: a failure (:data:`_COMPILER_ERRORS`) warns and turns everything compiled eager
    (:func:`_give_up_compiling`)."""
    if _GAVE_UP:  # since this call was bound: a checkpoint's recompute after a failure
        return eager(*args, **kwargs)
    try:
        with compile_limit():
            return compiled(*args, **kwargs)
    except _COMPILER_ERRORS as err:  # not the checkpoint's own signal to stop a recompute
        _give_up_compiling(err)
        return eager(*args, **kwargs)


_COMPILER_ERRORS = (torch._dynamo.exc.TorchDynamoException,)
"""What a failed compilation raises: the tracer's errors and the code generator's, which
derive from them (``InductorError`` is a ``BackendCompilerFailed``)."""

_GAVE_UP: list[str] = []
"""The first compilation failure of this process, once there was one: every compiled layer runs
eager from then on."""


def _give_up_compiling(err: Exception) -> None:
    import warnings

    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # torch's own errors say what failed on a later line than the first ("backend='inductor'
    # raised:"): the first line that is not such a heading
    said = next((line for line in lines if not line.endswith(":")), lines[0] if lines else "")
    _GAVE_UP.append(f"{type(err).__name__}: {said}"[:300])
    warnings.warn(
        f"marlow: compiling the decoder layers or the LM head failed ({_GAVE_UP[0]}); scoring "
        "and the update run them eager from now on (grpo.compile=off skips the attempt)",
        RuntimeWarning,
        stacklevel=3,
    )


HEAD_ONLY = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
"""Causal LMs whose logits are their plain linear head on the decoder's last hidden state (no
scaling, no soft-capping): the ones scoring
(:mod:`marlow.training.logprobs`) and ``marlow plan`` take through the head chunk by chunk."""


def decoder_and_head(model) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, head) where ``model``'s logits are ``head(decoder(...).last_hidden_state)`` with
    a frozen or plain ``nn.Linear`` head (not LoRA-wrapped), so that scoring can
    compute log-probs through the head chunk by chunk
    (:func:`marlow.algo.estimators.head_logprobs_and_entropy`: the (tokens, vocabulary) logits
    never held at once); None for any other model, which is scored from its whole logits."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(causal_lm).__name__ not in HEAD_ONLY:
        return None
    head = causal_lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return None
    return causal_lm.get_decoder(), head


def padding_mask(attention: torch.Tensor) -> torch.Tensor | None:
    """The attention mask to give a causal model for rows masked by ``attention`` (T, S): None
    where it masks right padding only (each row's ones a prefix), else ``attention``. A causal
    model's states at a row's real positions never attend to the padding after them, so those
    states, the log-probs read from them and their gradients are the same without the mask, up
    to float round-off; without it, transformers' SDPA attention takes its causal kernels
    (flash attention on CUDA, the KV heads not repeated for grouped queries) instead of a masked
    kernel over repeated heads. The padded positions' own states differ and are never read."""
    if attention.shape[1] < 2 or bool((attention[:, 1:] <= attention[:, :-1]).all()):
        return None
    return attention


def completion_logprobs(
    model,
    ids: torch.Tensor,
    attention: torch.Tensor,
    prompt_len: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    share_prompts: bool = True,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (with gradient when enabled) and entropies (detached) of the completion tokens
    ``targets`` (T, L) after prompts of ``prompt_len`` (T,) in right-padded sequences ``ids``
    (T, S) with their ``attention`` mask; ``mask`` (T, L) marks the real completion tokens, and
    both results are 0 elsewhere; float32. Completion token j of a row is predicted at position
    P + j - 1. Where :func:`decoder_and_head` applies, only the real completion tokens' hidden
    states go through the head, a chunk at a time
    (:func:`marlow.algo.estimators.head_logprobs_and_entropy`); else from the model's whole
    logits (:func:`marlow.algo.estimators.token_logprobs_and_entropy`). The trainer's scoring
    and the HF engine's both call this, so on one model they agree bit for bit. The model's
    forward runs under :func:`marlow.policy.adapters.lora_in_base_dtype` (a bfloat16 base's
    LoRA layers compute in bfloat16).

    ``share_prompts``: rows with the same prompt forward it once where that is estimated cheaper
    (:mod:`marlow.shared_prompts`; the chunked-head models only); the same results up to float
    round-off. ``entropy`` False: the entropies are not computed (None), for a pass that does
    not read them.

    A mask of right padding only is not passed to the model (:func:`padding_mask`)."""
    length = ids.shape[1]
    attention = padding_mask(attention)
    steps = torch.arange(mask.shape[1], device=ids.device)
    # position of the logits that predict completion token j: P + j - 1, clamped on padding
    pos = (prompt_len[:, None] - 1 + steps[None, :]).clamp(max=length - 1)  # (T, L)
    split = decoder_and_head(model)
    if split is None:
        # no KV cache: scoring reads each sequence once
        with lora_in_base_dtype(model):
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
        picked = logits.gather(1, pos[:, :, None].expand(-1, -1, logits.shape[-1]))  # (T, L, V)
        logp, ent = token_logprobs_and_entropy(picked, targets, temperature, entropy)
        zero = torch.zeros((), dtype=torch.float32, device=ids.device)
        return torch.where(mask, logp, zero), None if ent is None else torch.where(mask, ent, zero)
    decoder, head = split
    packing = None
    if share_prompts:
        packing = pack_shared_prompts(ids, prompt_len, mask, decoder.config, head.weight.dtype)
    with lora_in_base_dtype(model):
        if packing is None:
            hidden = decoder(input_ids=ids, attention_mask=attention, use_cache=False)
        else:
            hidden = decoder(
                input_ids=packing.ids,
                attention_mask=packing.mask,
                position_ids=packing.positions,
                use_cache=False,
            )
    hidden = hidden.last_hidden_state
    if packing is None:
        picked = hidden.gather(1, pos[:, :, None].expand(-1, -1, hidden.shape[-1]))[mask]
    else:
        picked = hidden.flatten(0, 1)[packing.index[mask]]  # (N, H)
    logp, ent = head_logprobs_and_entropy(
        picked,
        head.weight,
        head.bias,
        targets[mask],
        temperature,
        entropy=entropy,
        ops=getattr(head, "_marlow_head_ops", None),  # compile_layers
    )
    full = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return full.masked_scatter(mask, logp), None if ent is None else full.masked_scatter(mask, ent)
