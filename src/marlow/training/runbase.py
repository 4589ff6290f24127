"""The run's base model: its identity, its copy in the run, and the name its adapters give it.

A run records which base its adapters belong to in ``RUN/base.json`` (:class:`BaseRecord`): the
name the user gave (``model.name``), what kind of name it is, the folder it was loaded from and
the sha256 of every weights file there. The record is written once, when a run starts in a
folder that has none (:func:`record`), and checked on every resume (:func:`changed`, called by
:func:`marlow.training.resume.preflight`): a base whose weights changed is refused.

What the adapters' ``adapter_config.json`` calls the base (``base_model_name_or_path``,
:attr:`BaseRecord.adapter_base`), by kind; choices of marlow, not fixed by the study:

* ``tiny`` (a tiny scale): its pre-trained weights live in marlow's package (a shipped world)
  or its cache, under a hashed folder name, which another machine may not have. The run therefore keeps a copy, ``RUN/base/``: a
  plain Hugging Face folder (config, float32 weights, tokenizer with its chat template; the
  cache's ``meta.json`` stays behind), written once, atomically, when the run starts; its files
  are hard links to the cache's where the filesystem allows (a grid's cells then share one
  copy of the bytes, and deleting the cache leaves them whole), else copies. Adapters
  name it ``"base"``: a path relative to the *run folder* (not to the adapter folder), so the
  same name holds in ``marlow export``'s folder, whose ``base/`` sits beside ``adapters/``.
* ``folder`` (a local path): its weights may be gigabytes, so they are not copied; adapters name
  the folder by its absolute path (it loads on this machine), and ``marlow export`` copies it.
* ``hub`` (a Hugging Face id): adapters name the id; the record adds the cached snapshot's
  revision.

The weights hash covers the top-level ``*.safetensors`` and ``*.bin`` files of the folder. It
is computed once per file and process (keyed by path, size and modification time), so a resume,
checked before the model loads and again in the trainer, reads a large base once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

from marlow.config import ModelConfig
from marlow.fileio import DamagedFileError, read_json_object, sha256_file, write_json
from marlow.models import is_tiny, tiny_world_folder

BASE_DIR = "base"
BASE_JSON = "base.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
TINY_EXTRA = ("meta.json",)  # marlow's cache bookkeeping, not part of a Hugging Face folder

Kind = Literal["tiny", "folder", "hub"]


@dataclass
class BaseRecord:
    """``RUN/base.json``: which base a run's adapters were trained on."""

    name: str  # model.name as the user gave it
    kind: Kind
    path: str  # the folder the weights were loaded from, absolute
    weights: dict[str, str]  # weights file name -> sha256
    adapter_base: str  # what adapter_config.json names as base_model_name_or_path
    revision: str | None = field(default=None)  # hub: the cached snapshot's commit

    @classmethod
    def read(cls, path: Path) -> BaseRecord:
        """The record ``path`` holds; a file without this record's fields (of their types) is
        :class:`~marlow.fileio.DamagedFileError`."""
        data = read_json_object(path)
        if (
            not all(isinstance(data.get(k), str) for k in ("name", "kind", "path", "adapter_base"))
            or not isinstance(data.get("weights"), dict)
            or not data.keys() <= {f.name for f in fields(cls)}
        ):
            raise DamagedFileError(
                f"{path} is not the record of a run's base (name, kind, path, weights, "
                "adapter_base); the file is damaged"
            )
        return cls(**data)


def _source(model: ModelConfig, task: str) -> tuple[Kind, Path | None]:
    """The kind of ``model.name`` and the folder it loads from (None: a hub id not cached)."""
    if is_tiny(model.name):
        return "tiny", tiny_world_folder(model, task)  # the shipped world's, or the cache's
    path = Path(model.name).expanduser()
    if model.name.startswith(("/", ".", "~")) or path.is_dir():
        return "folder", path.resolve()
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model.name, "config.json")
    return "hub", Path(cached).parent if isinstance(cached, str) else None


_HASHES: dict[tuple[str, int, int], str] = {}


def weight_hashes(folder: Path) -> dict[str, str]:
    """sha256 of each weights file at the top of ``folder``, by file name (module docstring)."""
    out = {}
    for pattern in WEIGHT_PATTERNS:
        for file in sorted(folder.glob(pattern)):
            stat = file.stat()
            key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
            if key not in _HASHES:
                _HASHES[key] = sha256_file(file)
            out[file.name] = _HASHES[key]
    return dict(sorted(out.items()))


def identify(model: ModelConfig, task: str) -> BaseRecord | None:
    """The record of the base ``model`` names, as it is on disk now; None when its folder is not
    there yet (a tiny world not yet pre-trained, a hub id not yet downloaded)."""
    kind, folder = _source(model, task)
    if folder is None or not (folder / "config.json").is_file():
        return None
    adapter_base = {"tiny": BASE_DIR, "folder": str(folder), "hub": model.name}[kind]
    return BaseRecord(
        name=model.name,
        kind=kind,
        path=str(folder),
        weights=weight_hashes(folder),
        adapter_base=adapter_base,
        revision=folder.name if kind == "hub" else None,
    )


def record(run_dir: Path, model: ModelConfig, task: str) -> None:
    """Write ``RUN/base.json`` (and for a tiny scale ``RUN/base/``) unless the run has them: once
    per run, after its base has loaded. ``base.json`` is written last, so a run killed in between
    rewrites the copy on its next start."""
    if (run_dir / BASE_JSON).exists():
        return
    found = identify(model, task)
    if found is None:
        raise FileNotFoundError(f"model.name {model.name!r}: its folder vanished after loading")
    if found.kind == "tiny":
        copy_hf_folder(Path(found.path), run_dir / BASE_DIR, skip=TINY_EXTRA, link=True)
    write_json(run_dir / BASE_JSON, asdict(found))


def changed(run_dir: Path, model: ModelConfig, task: str) -> str | None:
    """None when the run's recorded base has the same weights now (or cannot be checked yet: no
    record, or the base not on disk before loading; the trainer checks again after loading); else
    one line saying what changed."""
    path = run_dir / BASE_JSON
    if not path.is_file():
        return None
    then = BaseRecord.read(path)
    now = identify(model, task)
    if now is None or now.weights == then.weights:
        return None
    names = sorted(set(then.weights) | set(now.weights))
    diff = next(n for n in names if then.weights.get(n) != now.weights.get(n))
    was, is_ = then.weights.get(diff, "absent")[:12], now.weights.get(diff, "absent")[:12]
    return (
        f"{path}: the base model {then.name!r} has changed since the run started ({diff} sha256 "
        f"{was}... is now {is_}..., in {now.path}); its adapters were trained on the old "
        "weights: restore them, or start a new run with another --out"
    )


def adapter_base(run_dir: Path) -> str | None:
    """What the run's saved adapters name as their base (None: the run has no ``base.json``)."""
    path = run_dir / BASE_JSON
    return BaseRecord.read(path).adapter_base if path.is_file() else None


def copy_hf_folder(src: Path, dst: Path, skip: tuple[str, ...] = (), link: bool = False) -> None:
    """Copy the top-level files of ``src`` (not ``skip``) into a new folder ``dst``, atomically:
    into a temporary sibling first, renamed into place (replacing a ``dst`` left by a kill).
    ``link``: hard-link each file where the filesystem allows (else copy it), for a source that
    is only ever replaced, never written in place (marlow's cache)."""
    for stale in dst.parent.glob(f".{dst.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        for file in sorted(src.iterdir()):
            if file.is_file() and file.name not in skip:
                _link_or_copy(file, tmp / file.name, link)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(src: Path, dst: Path, link: bool) -> None:
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:  # another filesystem, or one without hard links
            pass
    shutil.copyfile(src, dst)  # follows the hub cache's symlinks
