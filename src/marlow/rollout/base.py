"""The rollout-engine interface and the registry of backends.

A rollout engine turns prompt token ids into sampled completions, each request answered by the
adapter it names (or by the frozen base, ``BASE``). Backends are picked by name in the config
(``rollout.backend``); a backend's module is imported only when that name is chosen, so the
``vllm`` backend never imports vLLM on a machine that runs ``hf``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from marlow.registry import Registry
from marlow.types import BASE, Completion, GenRequest, SamplingParams

if TYPE_CHECKING:
    from marlow.config import RunConfig


def default_stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """The token ids a completion ends at, where an engine is given none: the tokenizer's eos
    token (a chat tokenizer's end of turn) and then the eos ids of the model's generation config
    (``generation_config.json``: Qwen3's ``<|im_end|>`` and ``<|endoftext|>``, Gemma's
    ``<end_of_turn>`` beside ``<eos>``), each once, as transformers' ``generate`` and vLLM stop.
    A ValueError where neither names one."""
    ids: list[int] = []
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for found in (tokenizer.eos_token_id, config_eos):
        for i in found if isinstance(found, list | tuple) else [found]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError(
            "neither the tokenizer nor the model's generation config names an eos token; pass "
            "stop_ids explicitly"
        )
    return ids


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples one completion per request, returned in request order, and scores given ones.

    Contract every backend keeps: ``token_ids`` include the stop token when one was produced
    (``finish_reason == "stop"``), else ``finish_reason == "length"``; ``logprobs[i]`` is the
    sampler's log-prob of ``token_ids[i]`` under temperature scaling (log_softmax(logits / T); raw
    logits when T == 0, i.e. greedy); the same requests, params and seed give the same samples.

    ``score`` returns, per request, the log-probs the engine *would* record for the given
    completion tokens after the request's prompt (teacher-forced, same definition as
    ``logprobs``), from the weights it serves now. The trainer scores one turn per adapter this
    way after every update and stops when the engine disagrees with it
    (:mod:`marlow.training.sync`): an engine holding its own copy of the weights (vLLM) must have
    loaded the new adapters by then (the trainer calls ``refresh`` after every change of an
    adapter's weights). It may be slow per token: it sees one short turn per adapter.
    """

    def generate(
        self, requests: Sequence[GenRequest], params: SamplingParams
    ) -> list[Completion]: ...

    def score(
        self,
        requests: Sequence[GenRequest],
        completions: Sequence[Sequence[int]],
        temperature: float,
    ) -> list[list[float]]: ...

    def refresh(self, adapters: Sequence[str]) -> None:
        """The trainer changed these adapters' weights: from the next call the engine serves the
        new ones (an engine sampling from the trainer's own model has nothing to do)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (processes, memory, files); safe to call twice."""
        ...


def check_requests(
    requests: Sequence[GenRequest], temperature: float, max_new_tokens: int, adapters: Sequence[str]
) -> None:
    """The checks every backend makes on a call, each a one-line ValueError: temperature >= 0,
    max_new_tokens >= 1, every request names ``BASE`` or one of ``adapters`` and has a prompt,
    and either every request carries its own seed or none does."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    valid = {BASE, *adapters}
    for i, req in enumerate(requests):
        if req.adapter not in valid:
            raise ValueError(
                f"request {i}: unknown adapter {req.adapter!r}; valid: {sorted(valid)}"
            )
        if not req.prompt_ids:
            raise ValueError(f"request {i}: empty prompt_ids (nothing to condition on)")
        if (req.seed is None) != (requests[0].seed is None):
            raise ValueError(f"request {i}: either every request of a call has a seed or none")


EngineFactory = Callable[..., RolloutEngine]

# name -> "module:attribute" (imported on first use) or an already imported factory: vLLM is
# imported only by get_backend("vllm").
_BACKENDS: Registry[str | EngineFactory] = Registry(
    "rollout backend",
    {"hf": "marlow.rollout.hf:HFEngine", "vllm": "marlow.rollout.vllm:VLLMEngine"},
)


def register_backend(name: str, factory: str | EngineFactory) -> None:
    """Add a backend: a factory returning a RolloutEngine, or its lazy ``"module:attr"`` path."""
    if isinstance(factory, str) and ":" not in factory:
        raise ValueError(
            f"lazy backend path must look like 'package.module:Factory', got {factory!r}"
        )
    _BACKENDS.add(name, factory)


def available_backends() -> list[str]:
    return _BACKENDS.names()


def get_backend(name: str) -> EngineFactory:
    """The factory registered under ``name``, importing its module now if it is lazy."""
    return _BACKENDS.load(name)  # type: ignore[return-value]  # a string is imported


def make_engine(name: str, *args: Any, **kwargs: Any) -> RolloutEngine:
    """``get_backend(name)(*args, **kwargs)``: build the engine a config names."""
    return get_backend(name)(*args, **kwargs)


def check_backend_name(config: RunConfig) -> None:
    """A one-line ConfigError unless ``rollout.backend`` names a registered backend (nothing is
    imported: a grid checks its cells with this before anything runs)."""
    from marlow.config import ConfigError

    name = config.rollout.backend
    if name not in _BACKENDS:
        raise ConfigError(
            f"config field 'rollout.backend' is {name!r}; valid: {', '.join(available_backends())}"
            " (marlow.rollout.register_backend adds one)"
        )


def backend_factory(config: RunConfig) -> EngineFactory:
    """The factory of the run's ``rollout.backend`` (:func:`check_backend_name` first)."""
    check_backend_name(config)
    return get_backend(config.rollout.backend)


def check_backend(config: RunConfig) -> None:
    """Refuse, before any model loads, a backend that is not registered or cannot run here (its
    factory's ``preflight(config)``, when it has one: vLLM must import)."""
    preflight = getattr(backend_factory(config), "preflight", None)
    if preflight is not None:
        preflight(config)


def engine_for_run(config: RunConfig, model: Any, tokenizer: Any, device: Any) -> RolloutEngine:
    """The engine the run's ``rollout.backend`` names, over ``model``. A factory with a
    ``from_run(model, tokenizer, config=, device=)`` reads its own settings from the run's config
    (``hf``: ``rollout.merge_lora``; ``vllm``: ``rollout.vllm``, the dtype, the seed); any other
    is called with the model, the tokenizer and ``max_batch`` (``rollout.max_batch``)."""
    factory = backend_factory(config)
    from_run = getattr(factory, "from_run", None)
    if from_run is not None:
        return from_run(model, tokenizer, config=config, device=device)
    return factory(model, tokenizer, max_batch=config.rollout.max_batch)


def served_positions(config: RunConfig, model: Any) -> int | None:
    """The longest sequence the run's engine serves: the model's positions, capped by what the
    backend itself serves (its factory's ``served_length(config)``, when it has one: vLLM's
    ``max_model_len``); None when neither says."""
    positions = getattr(model.config, "max_position_embeddings", None)
    served_length = getattr(backend_factory(config), "served_length", None)
    served = served_length(config) if served_length is not None else None
    if served is not None:
        positions = min(positions, served) if positions else served
    return positions
