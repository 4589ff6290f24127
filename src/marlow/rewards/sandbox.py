"""Run untrusted, model-written Python in a separate, limited, throw-away process.

``run_program(source, stdin, limits)`` runs one program; ``run_many(jobs)`` runs a list of them on
a thread pool (one thread per core by default; each thread only waits on its own process). With
``converse``, a function talks to the running program through its pipes (a ``Channel``) instead
of feeding it ``stdin``: the code reward's harness asks it for one call after another.

How one run is built
--------------------
The caller's process never forks Python code: it starts ``python -I -S -B -c <boot code>`` (the
boot functions of ``marlow.rewards._sandbox_boot``, stdlib only) with ``subprocess``
(``start_new_session=True``, a scrubbed environment, stdin/stdout/stderr pipes). That *boot* process, still with the caller's
privileges, unshares what the kernel allows and forks the *init* (PID 1 of the new namespace),
which builds the root and forks the program's process, which drops privileges and execs
``python -I -S -B program.py`` (no site-packages: the standard library only). In detail:

* **a user namespace** (``userns``, only when the caller is not root): the boot process unshares
  one and maps the caller's uid and gid to themselves, which gives it every capability inside
  (enough for all that follows, without root); the program, exec'd as that non-zero uid, holds
  none. Most kernels allow this to any user; some need a sysctl (see ``isolation_in_force``).
* **namespaces** (tried one by one with ``unshare(2)`` through ``ctypes``; what succeeded is
  reported in ``RunResult.isolation``, why the others failed in ``isolation_failed``): a new
  network namespace (``netns``: no interface but a
  downed loopback, so no network at all, not even localhost), a new PID namespace (``pidns``: the
  first child is PID 1 there; when it exits the kernel SIGKILLs every process left in the
  namespace, however it daemonised or ``setsid``-ed), a new mount namespace (``mountns``), IPC and
  UTS namespaces.
* **a private root** (``chroot``, needs the mount namespace): a size-capped ``tmpfs``
  (``disk_mb``, at most 4096 inodes) holding ``/work`` (the program's working directory and
  ``HOME``), ``/tmp``, ``/dev/{null,zero,random,urandom}``, a fresh ``/proc`` of the PID namespace
  only, and read-only, nosuid bind mounts of ``/usr`` (``/bin``, ``/lib``... as symlinks when they
  are symlinks on the host) and of the Python installation. Everything written lives in that tmpfs
  and disappears with the namespace.
* **an unprivileged user** (``setuid``, when the caller is root): the program runs as a uid of its
  own (``uid_base`` + slot, no passwd entry, no supplementary groups, ``PR_SET_NO_NEW_PRIVS``),
  so it holds no capabilities, cannot signal or ``ptrace`` the boot, init or caller processes,
  and ``RLIMIT_NPROC`` really binds (it does not bind root). Each concurrent run gets its own uid.
* **rlimits** (always): ``RLIMIT_CPU`` (SIGXCPU at ``cpu_s``, SIGKILL a second later),
  ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_NPROC`` (``nproc``, threads count too), ``RLIMIT_FSIZE``
  (``disk_mb``), ``RLIMIT_NOFILE`` (``max_open_files``), ``RLIMIT_CORE`` = 0.
* **the caller** enforces the wall clock, reads at most ``stdout_bytes`` of stdout (and keeps the
  last ``stderr_bytes`` of stderr; a flood past ``stdout_bytes`` on either stream is an overflow),
  SIGKILLs the whole process group on timeout/overflow and always once at the end, and removes its
  temporary directory. The environment passed on is only ``PATH``, ``LANG``/``LC_ALL`` and
  ``HOME``: secrets of the caller never reach the boot process, let alone the program.

Fallbacks, chosen at run time: without a network namespace an audit hook inside the program's
interpreter refuses every ``socket.*`` event (a program using ``ctypes`` or a subprocess can get
around this). Without a mount namespace the program runs in a host temporary directory (chowned to
its uid). Without a PID namespace, leftover processes are found by session id, by uid, and by a
marker ``MARLOW_SANDBOX_RUN=<token>`` in their initial environment, and killed (a process that
re-execs itself with a cleared environment after ``setsid`` escapes this). Without a separate uid
(not root, or root but the interpreter is not readable by other users and there is no private
root to bind it into) ``RLIMIT_NPROC`` is counted on top of the caller's own processes.
``Limits(namespaces=False)`` skips the namespaces to exercise these fallbacks. Whatever is in
force, ``isolation_in_force()`` says so in one line (a training run logs it at start and records
it in ``sandbox.json``), and ``rewards.sandbox.require=namespaces`` stops a run that would get
less than netns, pidns, mountns and the private root.

Why hand-written namespaces and not bubblewrap (``bwrap``, which does this job well and is in
Debian): the root path already builds the same private root with the same mount calls, and the
unprivileged path differs from it only by the user namespace and the uid maps (a few lines);
``bwrap`` is not installed on the machines marlow runs on (nor pip-installable), so the code
would have had to keep both paths and pick one per machine; and a second launcher would mean two
implementations to keep in step for the statuses, limits and leftover-process checks above.

Measured on the development machine (root in a VM, Linux 6.18, Python 3.11; see
``tests/unit/test_sandbox.py``): netns, pidns, mountns, ipcns, utsns, chroot and setuid all work,
and as uid 65534 userns, netns, pidns, mountns, ipcns, utsns and chroot (the host file, ``/tmp``
and the caller's socket out of reach);
the hostile suite (fork bomb, memory bomb, infinite loop, sleep, disk fill, sockets, reading
``/etc/passwd``, ``/root`` and the caller's environment, writing outside, killing the parent,
ignoring SIGTERM, huge output, deep recursion, thread explosion, escaping daemons, segfault,
``os._exit``) scores 0 and leaves no process and no file. With ``namespaces=False`` (root, but
this machine's interpreter under ``/root`` is unreadable to other uids, so no setuid either) the
audit hook refused sockets and a ``setsid`` daemon was found and killed.

What this does NOT isolate
--------------------------
* The kernel: one shared kernel, no seccomp filter. A kernel exploit escapes everything.
* Files under the bound ``/usr`` and the Python installation are readable (not writable). Without
  the private root (no mount namespace), every world-readable file is readable and, without a
  separate uid, everything the caller can read or write is reachable too (``/etc/passwd``, the
  project, ``/tmp``, ``/dev/shm``), and files written outside the work directory stay behind.
* ``/sys`` is not mounted in the private root, but kernel facts are still visible through
  syscalls (``uname``, CPU count, memory size via ``sysinfo``).
* No cgroup: memory is bounded per process by the address-space limit (a fork bomb of ``nproc``
  processes may use up to ``nproc * memory_mb`` of address space, and tmpfs pages up to
  ``disk_mb``); CPU time per process by ``RLIMIT_CPU``; the wall clock bounds the total. CPU
  *share* is not limited: ``nproc`` spinning processes compete with the caller until the wall
  timeout. I/O bandwidth is not limited.
* Without a PID namespace (kernel refused it) and without root, a program that ``setsid``-s and
  daemonises can outlive the run. Without a network namespace, a program can reach the network
  through ``ctypes`` or a subprocess.
* Not root and no user namespace: no namespace at all, so only the rlimits and the audit hook;
  the program runs as the caller's uid and can read and write what the caller can and signal the
  caller's processes (that is what ``rewards.sandbox.require=namespaces`` refuses).
* Under a user namespace (not root) the program runs as the caller's uid, with no capabilities.
  ``RLIMIT_NPROC`` is set to ``nproc`` plus the caller's own process count (kernels before 5.14
  count every process of the uid; later ones count per user namespace, where the bound is looser
  by that count).
* Uids are taken from a fixed range (``uid_base``) derived from the caller's pid; two callers on
  one machine may, rarely, share a uid and so share its ``RLIMIT_NPROC`` count.
"""

from __future__ import annotations

import contextlib
import marshal
import math
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import get_args

from marlow.choices import SandboxRequire
from marlow.rewards._channel import Channel
from marlow.rewards._sandbox_boot import boot_code
from marlow.rewards.limits import (  # noqa: F401  (the statuses are this module's API too)
    KILLED,
    MEMORY,
    OK,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    SANDBOX_ERROR,
    TIMEOUT,
    Limits,
)

_CRASH_SIGNALS = {4, 6, 7, 8, 11}  # SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV: a crash


@dataclass(frozen=True)
class Job:
    """One program to run: its source text and what it reads on stdin (or, with ``converse``,
    the function that talks to it while it runs; see ``run_program``)."""

    source: str
    stdin: str | bytes = ""
    limits: Limits = field(default_factory=Limits)
    converse: Callable[[Channel], None] | None = None


@dataclass
class RunResult:
    status: str
    exit_code: int | None  # the program's exit code; None if it died by a signal or never ran
    stdout: str
    stderr: str  # tail
    wall_s: float
    cpu_s: float | None  # user + system of the program and its reaped children; None if killed
    signal: int | None = None  # the signal that ended the program, if any
    isolation: tuple[str, ...] = ()  # the mechanisms that were in force
    isolation_failed: tuple[str, ...] = ()  # "netns: <why>" for each one tried that failed
    sid: int = 0  # session / process-group id of the run on the host (the boot pid)
    uid: int | None = None  # uid the program ran as, when it was a separate one
    workdir: str = ""  # the host temporary directory (removed before returning)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


# ------------------------------------------------------------------ caller side


class _UidPool:
    """Distinct unprivileged uids for concurrent runs (only used when the caller is root)."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._free: list[int] = []
        self._next = 0

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._next - 1

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


_UIDS = _UidPool()


def _uid_for(slot: int, limits: Limits) -> int:
    base = limits.uid_base
    if base is None:
        base = 1_900_000_000 + (os.getpid() % 8192) * 1024
    return base + slot


def _python() -> tuple[str, list[str]]:
    """The real interpreter binary and the directories the program needs to run it."""
    exe = os.path.realpath(sys.executable)
    dirs = {os.path.realpath(sys.base_prefix), os.path.dirname(exe)}
    return exe, sorted(dirs)


def _world_accessible(path: str) -> bool:
    """Can an unrelated uid reach and read ``path`` (each parent o+x, the file o+r)?"""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        d = os.sep.join(parts[:i]) or os.sep
        if not os.stat(d).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o005 == 0o005)


def _scan_procs(sid: int, uid: int | None, token: str | None = None) -> list[int]:
    """Host pids whose session is ``sid``, whose real uid is ``uid``, or whose initial
    environment holds the run's ``token`` (how a ``setsid`` daemon is found without a PID
    namespace)."""
    found = []
    mark = f"MARLOW_SANDBOX_RUN={token}".encode() if token else None
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rindex(b")") + 2 :].split()
            if int(fields[3]) == sid:
                found.append(int(name))
                continue
            if uid is not None:
                with open(f"/proc/{name}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"Uid:"):
                            if int(line.split()[1]) == uid:
                                found.append(int(name))
                            break
                if found and found[-1] == int(name):
                    continue
            if mark is not None:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


def _kill_leftovers(sid: int, uid: int | None, token: str | None) -> None:
    """SIGKILL, pass after pass, every process of the run still on the host (``_scan_procs``)."""
    for _ in range(50):
        pids = _scan_procs(sid, uid, token)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, 9)
        time.sleep(0.01)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, 9)


def _stop(proc: subprocess.Popen) -> None:
    """End a run early: SIGTERM to the boot (it kills and reaps the init), then SIGKILL all."""
    try:
        proc.terminate()
        proc.wait(timeout=2.0)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _killpg(proc.pid)


def run_program(
    source: str,
    stdin: str | bytes = "",
    limits: Limits | None = None,
    converse: Callable[[Channel], None] | None = None,
) -> RunResult:
    """Run ``source`` as a Python program in the sandbox; never raises for anything it does.

    The program reads ``stdin``; or, with ``converse``, that function talks to it through a
    ``Channel`` while it runs (and the program is stopped once it returns)."""
    import shutil
    import tempfile

    lim = limits or Limits()
    exe, prefixes = _python()
    root = os.geteuid() == 0
    slot = _UIDS.acquire() if root else None
    uid = _uid_for(slot, lim) if slot is not None else None
    workdir = tempfile.mkdtemp(prefix="marlow-sbx-")
    t0 = time.monotonic()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        result = _run(stdin, converse, lim, exe, prefixes, uid, workdir)
    except Exception as exc:  # the sandbox must never take the caller down
        result = RunResult(
            SANDBOX_ERROR,
            None,
            "",
            "",
            time.monotonic() - t0,
            None,
            detail=f"{type(exc).__name__}: {exc}",
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if slot is not None:
            _UIDS.release(slot)
    result.workdir = workdir
    return result


def _run(
    stdin: str | bytes,
    converse: Callable[[Channel], None] | None,
    lim: Limits,
    exe: str,
    prefixes: list[str],
    uid: int | None,
    workdir: str,
) -> RunResult:
    """One run, start to end: launch the boot process, feed or converse with the program under
    the wall clock, read the status the init left, clear leftovers, and classify the outcome."""
    data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
    token = secrets.token_hex(8)  # marks the run's processes in their environment
    start = time.monotonic()
    proc, status_r = _launch(lim, exe, prefixes, uid, workdir, token)
    deadline = start + lim.wall_s
    ch = Channel(proc, lim, deadline)
    verdict = _supervise(proc, ch, data, converse, deadline)
    wall = time.monotonic() - start
    st = _read_status(status_r)
    if "pidns" not in _isolation(st):  # not known to be torn down by the kernel: look for them
        _kill_leftovers(proc.pid, uid, token)
    return _outcome(verdict, st, ch, proc.returncode, lim, wall, proc.pid, uid)


def _launch(
    lim: Limits, exe: str, prefixes: list[str], uid: int | None, workdir: str, token: str
) -> tuple[subprocess.Popen, int]:
    """Start the boot process (its own session, a scrubbed environment, three pipes) with its
    config; returns it and the read end of the pipe the init writes its status to."""
    status_r, status_w = os.pipe()
    cfg = {
        "dir": workdir,
        "uid": uid,
        "python": exe,
        "prefixes": prefixes,
        "limits": asdict(lim),
        "status_fd": status_w,
        "token": token,
        "python_world_readable": _world_accessible(exe) and _world_accessible(prefixes[0]),
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    try:
        proc = subprocess.Popen(
            [exe, "-I", "-S", "-B", "-c", boot_code(), marshal.dumps(cfg).hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
            env=env,
            cwd=workdir,
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    return proc, status_r


def _supervise(
    proc: subprocess.Popen,
    ch: Channel,
    data: bytes,
    converse: Callable[[Channel], None] | None,
    deadline: float,
) -> str | None:
    """Feed ``data`` (or let ``converse`` talk) and wait for the program up to ``deadline``;
    returns the verdict that ended it early (timeout, output limit) or None. However it ends,
    the process group is killed and the boot process reaped."""
    try:
        if converse is None:
            ch.send(data)
            ch.close_input()
            ch.drain(deadline)
        else:  # the conversation decides; then the program gets a moment to exit on its own
            converse(ch)
            ch.close_input()
            ch.drain(min(deadline, time.monotonic() + 0.5))
            if ch.verdict is None and proc.poll() is None:
                _stop(proc)
        verdict = ch.verdict
        if verdict:
            _stop(proc)
        try:
            proc.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            verdict = verdict or TIMEOUT
            _stop(proc)
            proc.wait()
    finally:
        _killpg(proc.pid)  # whatever is left of the process group
        ch.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return verdict


def _read_status(status_r: int) -> dict | None:
    """The status the init wrote (isolation, exit code or signal, CPU time, or a setup error);
    None when it wrote none or garbage. Written before the init exits: never waited on."""
    os.set_blocking(status_r, False)
    raw = b""
    with contextlib.suppress(BlockingIOError), os.fdopen(status_r, "rb") as f:
        while chunk := f.read(65536):
            raw += chunk
    try:
        return marshal.loads(raw) if raw else None
    except (ValueError, EOFError, TypeError):
        return None


def _isolation(st: dict | None) -> tuple[str, ...]:
    return tuple(st.get("isolation", ())) if st else ()


def _outcome(
    verdict: str | None,
    st: dict | None,
    ch: Channel,
    boot_exit: int | None,
    lim: Limits,
    wall: float,
    sid: int,
    uid: int | None,
) -> RunResult:
    """The run's result: the caller's verdict first (timeout, output limit), then a sandbox
    setup error, then how the program ended (a signal, or its exit code)."""
    iso = _isolation(st)
    res = RunResult(
        status=OK,
        exit_code=None,
        stdout=ch.out.decode("utf-8", "replace"),
        stderr=ch.err.decode("utf-8", "replace"),
        wall_s=wall,
        cpu_s=None,
        isolation=iso,
        isolation_failed=tuple(st.get("failed", ())) if st else (),
        sid=sid,
        uid=uid if st and "setuid" in iso else None,
    )
    if verdict is not None:
        res.status = verdict
        res.detail = f"{verdict} (wall {lim.wall_s:g} s, stdout {lim.stdout_bytes} B)"
        return res
    if st is None or "error" in st:
        res.status = SANDBOX_ERROR
        res.detail = (st or {}).get("error", f"boot exited {boot_exit} without a status")
        return res
    res.cpu_s = st.get("cpu_s")
    sig = st.get("signal")
    if sig is not None:
        res.signal = sig
        res.status = _signal_status(sig, res.cpu_s, lim, res.stderr)
        res.detail = f"killed by signal {sig}"
        return res
    res.exit_code = st.get("exit")
    if res.exit_code != 0:
        res.status = MEMORY if "MemoryError" in res.stderr else RUNTIME_ERROR
    return res


def _signal_status(sig: int, cpu_s: float | None, lim: Limits, stderr: str) -> str:
    """What a program killed by ``sig`` ran into: its CPU limit, memory, a crash, or a kill."""
    cpu_out = cpu_s is not None and cpu_s >= math.floor(lim.cpu_s) - 0.05
    if sig == 24 or (sig == 9 and cpu_out):  # SIGXCPU, then SIGKILL at the hard limit
        return TIMEOUT
    if "MemoryError" in stderr:
        return MEMORY
    if sig in _CRASH_SIGNALS:
        return RUNTIME_ERROR
    return KILLED


def run_many(jobs: list[Job], max_workers: int | None = None) -> list[RunResult]:
    """Run ``jobs`` in parallel (default: one at a time per CPU core); results in job order."""
    from concurrent.futures import ThreadPoolExecutor

    if not jobs:
        return []
    workers = max(1, min(len(jobs), max_workers or os.cpu_count() or 1))
    if workers == 1:
        return [run_program(j.source, j.stdin, j.limits, j.converse) for j in jobs]
    with ThreadPoolExecutor(workers, thread_name_prefix="marlow-sandbox") as pool:
        return list(pool.map(lambda j: run_program(j.source, j.stdin, j.limits, j.converse), jobs))


REQUIRES: tuple[str, ...] = get_args(SandboxRequire)  # choices of rewards.sandbox.require
NAMESPACES = ("netns", "pidns", "mountns", "chroot")  # what require="namespaces" demands
_HOW_TO_GET = (
    "run as root, or allow unprivileged user namespaces (sysctl user.max_user_namespaces > 0; "
    "kernel.unprivileged_userns_clone=1 on Debian/Ubuntu kernels; "
    "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04; in a container, a seccomp "
    "profile that allows unshare), or set rewards.sandbox.require=none"
)


class SandboxUnavailable(RuntimeError):
    """The isolation a run requires cannot be made on this machine (one line: what and how)."""


@dataclass(frozen=True)
class Isolation:
    """What a sandboxed run gets on this machine: the mechanisms in force and why others failed."""

    mechanisms: tuple[str, ...]
    failed: tuple[str, ...] = ()  # "userns: [Errno 1] ..." per mechanism tried in vain
    uid: int = 0  # the caller's euid

    def line(self) -> str:
        """One line for a run's log: ``sandbox isolation: netns pidns ... (as uid 1000)``."""
        who = "root" if self.uid == 0 else f"uid {self.uid}"
        line = f"sandbox isolation (as {who}): {' '.join(self.mechanisms) or 'none'}"
        return line + (f"; not available: {'; '.join(self.failed)}" if self.failed else "")


def isolation_in_force(require: str = "none") -> Isolation:
    """The isolation a run gets on this machine, measured by running an empty program; with
    ``require="namespaces"``, raise ``SandboxUnavailable`` unless ``NAMESPACES`` are all in force."""
    if require not in REQUIRES:
        raise ValueError(f"rewards.sandbox.require is {require!r}; valid: {', '.join(REQUIRES)}")
    res = run_program("", limits=Limits(wall_s=20))
    iso = Isolation(res.isolation, res.isolation_failed, os.geteuid())
    missing = [m for m in NAMESPACES if m not in iso.mechanisms]
    if require == "namespaces" and missing:
        why = "; ".join(iso.failed) or res.detail or "not tried"
        raise SandboxUnavailable(
            f"rewards.sandbox.require=namespaces but the sandbox could not make "
            f"{', '.join(missing)} ({why}): {_HOW_TO_GET}"
        )
    return iso
