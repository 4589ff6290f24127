"""What a sandboxed run may use and how it can end: the pieces the sandbox
(``marlow.rewards.sandbox``) and the caller's end of its pipes (``marlow.rewards._channel``) both
need, in one module below both."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Statuses of a run.
OK = "ok"
RUNTIME_ERROR = "runtime_error"
TIMEOUT = "timeout"  # the wall clock ran out (the channel sees it)
OUTPUT_LIMIT = "output_limit"  # stdout passed its cap (the channel sees it)
MEMORY = "memory"
KILLED = "killed"
SANDBOX_ERROR = "sandbox_error"  # the sandbox itself could not set up (reported, never raised)


@dataclass(frozen=True)
class Limits:
    """Resource limits for one run. Times in seconds, sizes in MiB / bytes as named."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512  # RLIMIT_AS of every process of the program
    nproc: int = 32  # processes + threads of the program's uid
    disk_mb: int = 32  # tmpfs size of the private root, and RLIMIT_FSIZE
    max_open_files: int = 64
    stdout_bytes: int = 1 << 20
    stderr_bytes: int = 8 << 10  # tail kept
    uid_base: int | None = None  # first uid of the per-run uids; None: derived from the pid
    namespaces: bool = True  # False: do not even try them (exercises the fallbacks)

    @classmethod
    def from_kwargs(cls, **kw: object) -> Limits:
        """Limits from keyword arguments; ``timeout_s`` sets ``cpu_s`` and ``wall_s`` (+1 s)."""
        timeout = kw.pop("timeout_s", None)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kw) - known)
        if unknown:
            raise TypeError(f"unknown sandbox limit(s) {unknown}; valid: {sorted(known)}")
        lim = cls(**kw)  # type: ignore[arg-type]
        if timeout is not None:
            t = float(timeout)  # type: ignore[arg-type]
            lim = replace(lim, cpu_s=t, wall_s=kw.get("wall_s", t + 1.0))  # type: ignore[arg-type]
        return lim
