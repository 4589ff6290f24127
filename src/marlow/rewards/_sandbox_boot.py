"""The sandbox's boot side: what runs inside the child processes (see ``marlow.rewards.sandbox``).

The child is ``python -I -S -B -c <boot code>``: the functions and constants of this module as
source text (:func:`boot_code`), standard library only, without the caller's imports (json,
dataclasses, subprocess... would cost ~20 ms per run). Process 1 tries the namespaces and forks
the init; the init builds the private root, sets limits and execs the program.
"""

from __future__ import annotations

import functools
import marshal
import math
import os
import resource

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

_NO_NET_WRAPPER = """\
import sys
def _no_net(event, args):
    if event.startswith("socket."):
        raise PermissionError("network access is disabled in the sandbox")
sys.addaudithook(_no_net)
del _no_net
sys.argv = sys.argv[1:]
import runpy
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class _Libc:
    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)

    def call(self, name: str, *args: object) -> None:
        if getattr(self.lib, name)(*args) != 0:
            err = self._ctypes.get_errno()
            raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")

    def mount(self, src: str | None, dst: str, fstype: str | None, flags: int, data: str | None):
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        self.call("mount", enc(src), enc(dst), enc(fstype), self._ctypes.c_ulong(flags), enc(data))


def _boot_main(cfg: dict) -> None:
    """Process 1 of 3: try the namespaces, fork the init, wait for it, mirror its exit."""
    status_fd = cfg["status_fd"]
    try:
        libc = _Libc()
        iso: list[str] = []
        failed: list[str] = []
        # RLIMIT_NPROC counts every process of the real uid on the host: count the caller's
        # own now, while the host's /proc is still in view (root is not bound by it).
        own_tasks = 0 if os.geteuid() == 0 else _count_own_tasks()
        if cfg["limits"]["namespaces"]:
            if os.geteuid() != 0:
                try:
                    _enter_userns(libc)
                    iso.append("userns")
                except OSError as exc:
                    failed.append(f"userns: {exc}")
            if os.geteuid() == 0 or "userns" in iso:
                for name, flag in (
                    ("netns", CLONE_NEWNET),
                    ("mountns", CLONE_NEWNS),
                    ("pidns", CLONE_NEWPID),
                    ("ipcns", CLONE_NEWIPC),
                    ("utsns", CLONE_NEWUTS),
                ):
                    try:
                        libc.call("unshare", flag)
                        iso.append(name)
                    except OSError as exc:
                        failed.append(f"{name}: {exc}")
        with open(os.path.join(cfg["dir"], "program.py"), "rb") as f:
            source = f.read()
    except Exception as exc:
        _report(status_fd, {"error": f"boot: {type(exc).__name__}: {exc}"})
        os._exit(111)
    pid = os.fork()
    if pid == 0:
        try:
            code = _init_main(cfg, libc, iso, failed, source, own_tasks)
        except BaseException as exc:
            _report(status_fd, {"error": f"init: {type(exc).__name__}: {exc}"})
            code = 111
        os._exit(code)
    os.close(status_fd)
    import signal

    # The caller stops a run with SIGTERM to this process: kill the init (so the kernel tears
    # the PID namespace down) and reap it here, so that no zombie is left to the host's init.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, 9))
    _, st = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(st)
    os._exit(code if code >= 0 else 128 - code)


def _enter_userns(libc: _Libc) -> None:
    """A user namespace of our own (no root needed): the caller's uid and gid map to themselves,
    so this process holds every capability inside it (to make the other namespaces, mount and
    chroot), and the program, exec'd as that same non-zero uid, holds none."""
    uid, gid = os.getuid(), os.getgid()
    libc.call("unshare", CLONE_NEWUSER)
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _report(fd: int, payload: dict) -> None:
    try:  # noqa: SIM105 (boot code: no contextlib import)
        os.write(fd, marshal.dumps(payload))
    except OSError:
        pass


def _init_main(
    cfg: dict, libc: _Libc, iso: list[str], failed: list[str], source: bytes, own_tasks: int
) -> int:
    """Process 2 (PID 1 of the new PID namespace, still privileged): build the root, run, reap."""
    libc.call("prctl", PR_SET_PDEATHSIG, 9, 0, 0, 0)  # the boot died: go too
    lim = cfg["limits"]
    uid = cfg["uid"]
    work = cfg["dir"]
    chroot_to = None
    if "mountns" in iso:
        chroot_to = _build_root(cfg, libc, iso, failed, source)
        iso.append("chroot")
        work = "/work"
    elif uid is not None:
        os.chown(work, uid, uid)
        os.chmod(work, 0o700)
    if uid is not None and (chroot_to is not None or cfg["python_world_readable"]):
        iso.append("setuid")
    else:
        uid = None
    iso.append("rlimits")
    wrap = "netns" not in iso
    if wrap:
        iso.append("audit_no_socket")
    status_fd = cfg["status_fd"]
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_fd)
            token = None if "pidns" in iso else cfg["token"]
            nproc = int(lim["nproc"]) + (own_tasks if uid is None else 0)
            _exec_program(cfg["python"], lim, nproc, uid, chroot_to, work, wrap, token, libc)
        except BaseException as exc:
            os.write(2, f"sandbox: could not start the program: {exc}\n".encode())
        os._exit(112)
    cpu = 0.0
    exit_code: int | None = None
    sig: int | None = None
    while True:
        try:
            p, st, ru = os.wait4(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        cpu += ru.ru_utime + ru.ru_stime
        if p == pid:
            if os.WIFSIGNALED(st):
                sig = os.WTERMSIG(st)
            else:
                exit_code = os.waitstatus_to_exitcode(st)
            break  # leaving kills whatever is still in the PID namespace
    st = {"isolation": iso, "failed": failed, "exit": exit_code, "signal": sig, "cpu_s": cpu}
    _report(status_fd, st)
    if sig is not None:
        return 128 + sig
    return exit_code if exit_code is not None and 0 <= exit_code < 256 else 1


def _build_root(cfg: dict, libc: _Libc, iso: list[str], failed: list[str], source: bytes) -> str:
    """A tmpfs root with /work, /tmp, /dev, /proc and read-only binds of /usr and Python."""
    lim = cfg["limits"]
    uid = cfg["uid"]
    root = cfg["dir"]
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    libc.mount(
        "tmpfs",
        root,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={int(lim['disk_mb'])}m,nr_inodes=4096,mode=755",
    )
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    with open(os.path.join(work, "program.py"), "wb") as f:
        f.write(source)
    if uid is not None:
        os.chown(work, uid, uid)
    tmp = os.path.join(root, "tmp")
    os.mkdir(tmp)
    os.chmod(tmp, 0o1777)
    dev = os.path.join(root, "dev")
    os.mkdir(dev)
    for name in ("null", "zero", "random", "urandom"):
        target = os.path.join(dev, name)
        open(target, "w").close()
        libc.mount(f"/dev/{name}", target, None, MS_BIND, None)
    ro = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    # A remount inside a user namespace must keep the flags the host locked on the source mount
    # (atime, noexec...), or it fails with EPERM: read them back as statvfs ST_* bits.
    keep = ((8, MS_NOEXEC), (1024, MS_NOATIME), (2048, MS_NODIRATIME), (4096, MS_RELATIME))
    binds = ["/usr", *cfg["prefixes"]]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            os.symlink(os.readlink(top), os.path.join(root, top[1:]))
        elif os.path.isdir(top):
            binds.append(top)
    done: list[str] = []
    for src in binds:
        if any(src == d or src.startswith(d + "/") for d in done):
            continue
        target = root + src
        os.makedirs(target, 0o755, exist_ok=True)
        libc.mount(src, target, None, MS_BIND | MS_REC, None)
        st_flags = os.statvfs(target).f_flag
        libc.mount(None, target, None, ro | sum(ms for st, ms in keep if st_flags & st), None)
        done.append(src)
    os.mkdir(os.path.join(root, "proc"))
    if "pidns" in iso:
        try:  # refused in a user namespace when the host's /proc has parts masked (containers)
            flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
            libc.mount("proc", os.path.join(root, "proc"), "proc", flags, None)
        except OSError as exc:
            failed.append(f"proc: {exc}")
    os.chmod(root, 0o755)
    return root


def _exec_program(
    python: str,
    lim: dict,
    nproc: int,
    uid: int | None,
    chroot_to: str | None,
    work: str,
    wrap: bool,
    token: str | None,
    libc: _Libc,
) -> None:
    """Process 3: drop everything, then exec the interpreter on program.py."""
    if chroot_to is not None:
        os.chroot(chroot_to)
    os.chdir(work)
    cpu = max(1, math.ceil(lim["cpu_s"]))
    mem = int(lim["memory_mb"]) << 20
    fsize = int(lim["disk_mb"]) << 20
    for res, value in (
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (mem, mem)),
        (resource.RLIMIT_FSIZE, (fsize, fsize)),
        (resource.RLIMIT_NOFILE, (lim["max_open_files"], lim["max_open_files"])),
        (resource.RLIMIT_NPROC, (nproc, nproc)),
        (resource.RLIMIT_MEMLOCK, (0, 0)),
        (resource.RLIMIT_MSGQUEUE, (0, 0)),
    ):
        resource.setrlimit(res, value)
    libc.call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.umask(0o077)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": os.getcwd(),
    }
    if token:  # no PID namespace: mark the run's processes so that leftovers can be found
        env["MARLOW_SANDBOX_RUN"] = token
    argv = [python, "-I", "-S", "-B"]
    argv += ["-c", _NO_NET_WRAPPER, "program.py"] if wrap else ["program.py"]
    os.closerange(3, 1 << 16)
    os.execve(python, argv, env)


def _count_own_tasks() -> int:
    me = os.getuid()
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                st = os.stat(f"/proc/{name}")
                if st.st_uid == me:
                    n += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                continue
    return n


_BOOT_PARTS = (
    _Libc,
    _boot_main,
    _enter_userns,
    _report,
    _init_main,
    _build_root,
    _exec_program,
    _count_own_tasks,
)
_BOOT_CONSTANTS = (
    "CLONE_NEWNS",
    "CLONE_NEWUSER",
    "CLONE_NEWUTS",
    "CLONE_NEWIPC",
    "CLONE_NEWPID",
    "CLONE_NEWNET",
    "MS_RDONLY",
    "MS_NOSUID",
    "MS_NODEV",
    "MS_NOEXEC",
    "MS_REMOUNT",
    "MS_BIND",
    "MS_REC",
    "MS_PRIVATE",
    "MS_NOATIME",
    "MS_NODIRATIME",
    "MS_RELATIME",
    "PR_SET_PDEATHSIG",
    "PR_SET_NO_NEW_PRIVS",
    "_NO_NET_WRAPPER",
)


@functools.cache
def boot_code() -> str:
    """The boot program given to ``python -c``: the functions above, without this module's
    imports (json, dataclasses, subprocess... would cost ~20 ms per run); config via marshal."""
    import inspect

    head = ["from __future__ import annotations", "import marshal, math, os, resource, sys"]
    head += [f"{name} = {globals()[name]!r}" for name in _BOOT_CONSTANTS]
    body = [inspect.getsource(obj) for obj in _BOOT_PARTS]
    tail = "_boot_main(marshal.loads(bytes.fromhex(sys.argv[1])))\n"
    return "\n".join(head) + "\n\n\n" + "\n\n".join(body) + "\n\n" + tail
