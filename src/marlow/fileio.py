"""Result files written atomically (to a ``.tmp`` sibling, then ``os.replace``d into place, so a
reader, or a run killed mid-write, sees the old file or the new one, never half of one), a write
to a device that filled up told as :class:`NoSpace` (one line), a file's hash, a folder held by
one process at a time, and whether a path is short enough for a Unix socket."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class DamagedFileError(ValueError):
    """A run's file that cannot be read back (a malformed line, a truncated file); the message is
    one line naming the file."""


def write_bytes(path: str | Path, data: bytes) -> Path:
    """``data`` written to ``path`` atomically (module docstring); a device that fills up
    meanwhile is :class:`NoSpace`, the partial ``.tmp`` removed and ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise no_space(err, path) or err from None
    os.replace(tmp, path)
    return path


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode())


def write_json(path: str | Path, obj: Any, *, sort_keys: bool = False) -> Path:
    """``obj`` as indented JSON (NaN written as ``NaN``, which Python's json reads back)."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def read_json_object(path: str | Path) -> dict:
    """The JSON object a run's file holds (as :func:`write_json` wrote it); a file that is not
    UTF-8 text, not JSON or not an object is :class:`DamagedFileError`, naming it."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        reason = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else f"not JSON ({err})"
        raise DamagedFileError(f"{path} is {reason}; the file is damaged") from None
    if not isinstance(value, dict):
        raise DamagedFileError(
            f"{path} holds a JSON {type(value).__name__}, not an object; the file is damaged"
        )
    return value


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in 1 MiB blocks (weights files run to gigabytes)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class NoSpace(OSError):
    """The device holding a file filled up (or its quota ran out) while it was written; the
    message is one line naming the folder and what the device has free."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a write to a device that filled up, or past a quota."""

NO_SPACE_LEFT = 1 << 20
"""Bytes free below which a failed write is taken for a full device (:func:`no_space`)."""


def no_space(err: BaseException, path: str | Path) -> NoSpace | None:
    """A :class:`NoSpace` for ``err``, raised writing under ``path``, where it came of a full
    device: an OSError of ENOSPC or EDQUOT, or any error (torch's C++ writer reports a short
    write as a RuntimeError without an errno) while the device holding ``path`` has less than
    :data:`NO_SPACE_LEFT` free; None otherwise."""
    found = Path(path)
    while not found.exists() and found != found.parent:
        found = found.parent
    try:
        free = shutil.disk_usage(found).free
    except OSError:
        free = None
    quota = isinstance(err, OSError) and err.errno in FULL_ERRNOS
    if not quota and (free is None or free >= NO_SPACE_LEFT):
        return None
    left = f"{free / 2**20:.1f} MiB free" if free is not None else "its free space unknown"
    return NoSpace(
        errno.ENOSPC, f"no space left on the device holding {path} ({left}): free some space"
    )


SOCKET_PATH_MAX = 107
"""The longest path a Unix socket (``AF_UNIX``) can have on Linux: ``sun_path``'s 108 bytes, less
its closing NUL. A socket made under a long temporary folder (``TMPDIR``) can pass it."""


def socket_path_fits(path: str | Path) -> bool:
    """Whether a Unix socket can be made at ``path`` (:data:`SOCKET_PATH_MAX`)."""
    return len(os.fsencode(path)) <= SOCKET_PATH_MAX


class FolderBusy(RuntimeError):
    """Another process holds the folder (:func:`held`); the message is one line naming it."""


@contextmanager
def held(folder: str | Path, what: str, shown: str | Path | None = None) -> Iterator[None]:
    """Hold ``folder`` (which must exist) while the block runs, or raise :class:`FolderBusy`, at
    once, where another process holds it: ``another {what} is running in {shown}`` (``shown``:
    the folder as the caller's user named it; default ``folder``). The lock is the
    kernel's exclusive ``flock`` on the folder itself: nothing is written into the folder, and a
    process that ends, however it ends (``kill -9`` included), lets go of it. Where the platform
    has no ``flock``, nothing is held."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy(f"another {what} is running in {shown or folder}") from None
        yield
    finally:
        os.close(fd)
