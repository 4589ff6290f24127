"""The sandbox against hostile programs: each scores 0, leaves nothing behind, the caller goes on.

The hostile suite runs once per module (two at a time, as training would), through the code
reward, and every program is then checked on its own: reward, status, processes left (by the
run's session id and uid, scanning /proc), its temporary directory, and its specific harm.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from marlow.rewards import sandbox
from marlow.rewards.code import code_details, score_code_batch
from marlow.rewards.sandbox import (
    KILLED,
    MEMORY,
    OK,
    OUTPUT_LIMIT,
    RUNTIME_ERROR,
    TIMEOUT,
    Job,
    Limits,
    RunResult,
    SandboxUnavailable,
    isolation_in_force,
    run_many,
    run_program,
)

SECRET = f"marlow-fake-secret-{uuid.uuid4().hex}"
ESCAPE = os.path.join(tempfile.gettempdir(), f"marlow-escape-{uuid.uuid4().hex}")
SHM_ESCAPE = f"/dev/shm/marlow-escape-{uuid.uuid4().hex}"
READABLE = os.path.join(tempfile.gettempdir(), f"marlow-readable-{uuid.uuid4().hex}")
READABLE_TEXT = f"host-only-{uuid.uuid4().hex}"

# Tight limits: the suite must not starve a 2-core machine shared with other work.
HOSTILE_LIMITS = {
    "timeout_s": 1.0,
    "wall_s": 2.0,
    "memory_mb": 256,
    "nproc": 24,
    "disk_mb": 16,
    "stdout_bytes": 1 << 16,
}
TESTS = {"inputs": ["20 22\n"], "outputs": ["42\n"]}  # the task every hostile program "solves"


def _py(body: str) -> str:
    return f"```python\n{body}\n```"


# name -> (program, statuses it may honestly end with)
HOSTILE: dict[str, tuple[str, set[str]]] = {
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        {TIMEOUT},
    ),
    "fork_bomb_exits": (
        "import os, time\nfor _ in range(200):\n    try:\n        if os.fork() == 0:"
        "\n            time.sleep(60)\n    except OSError:\n        pass",
        {OK, RUNTIME_ERROR},
    ),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(16 << 20))", {MEMORY}),
    "memory_one_shot": ("x = bytearray(8 << 30)", {MEMORY}),
    "infinite_loop": ("while True:\n    pass", {TIMEOUT}),
    "catch_sigxcpu": (
        "import signal\nsignal.signal(signal.SIGXCPU, lambda *a: None)\nwhile True:\n    pass",
        {TIMEOUT},
    ),
    "sleep": ("import time\ntime.sleep(60)\nprint(42)", {TIMEOUT}),
    "ignore_sigterm": (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "while True:\n    time.sleep(0.01)",
        {TIMEOUT},
    ),
    "disk_fill_one_file": (
        "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))",
        {RUNTIME_ERROR},
    ),
    "disk_fill_many_files": (
        "i = 0\nwhile True:\n    with open(f'f{i}', 'wb') as f:\n"
        "        f.write(b'x' * (1 << 20))\n    i += 1",
        {RUNTIME_ERROR},
    ),
    "inode_fill": (
        "i = 0\nwhile True:\n    open(f'/tmp/e{i}', 'w').close()\n    i += 1",
        {RUNTIME_ERROR},
    ),
    "socket_localhost": (
        "import socket, sys\ns = socket.create_connection(('127.0.0.1', "
        "int(sys.stdin.read().split()[0]) if False else PORT), timeout=1)\n"
        "print('CONNECTED')",
        {RUNTIME_ERROR},
    ),
    "socket_internet": (
        "import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=1)"
        "\nprint('CONNECTED')",
        {RUNTIME_ERROR},
    ),
    "dns": ("import socket\nprint(socket.getaddrinfo('example.com', 80))", {RUNTIME_ERROR}),
    "read_etc_passwd": ("print(open('/etc/passwd').read())", {RUNTIME_ERROR}),
    "read_host_file": (f"print(open({READABLE!r}).read())", {RUNTIME_ERROR}),
    "read_project": (f"import os\nprint(os.listdir({os.getcwd()!r}))", {RUNTIME_ERROR}),
    "env_secrets": (
        "import os\nprint(dict(os.environ))\nfor p in os.listdir('/proc'):\n"
        "    try:\n        print(open(f'/proc/{p}/environ', 'rb').read())\n"
        "    except OSError:\n        pass",
        {OK},
    ),
    "write_outside": (
        f"import os\nfor p in ({ESCAPE!r}, {SHM_ESCAPE!r}, '/usr/marlow-x'):\n"
        "    try:\n        open(p, 'w').write('x')\n    except OSError:\n"
        "        pass\nprint(os.path.exists('/etc'))",
        {OK},
    ),
    "kill_parent": (
        "import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n"
        "        print('refused', pid, e.errno)",
        {OK, KILLED},
    ),
    "kill_everything_visible": (
        "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit() "
        "and int(p) != os.getpid():\n        try:\n"
        "            os.kill(int(p), 9)\n        except OSError:\n"
        "            pass\nprint('done')",
        {OK},
    ),
    "huge_stdout": ("import sys\nwhile True:\n    sys.stdout.write('4' * 65536)", {OUTPUT_LIMIT}),
    "huge_stderr": ("import sys\nwhile True:\n    sys.stderr.write('4' * 65536)", {OUTPUT_LIMIT}),
    "deep_recursion": (
        "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)",
        {RUNTIME_ERROR, MEMORY, TIMEOUT},
    ),
    "thread_explosion": (
        "import threading, time\nwhile True:\n"
        "    threading.Thread(target=time.sleep, args=(60,), daemon=True)"
        ".start()",
        {RUNTIME_ERROR, MEMORY},
    ),
    "daemon_escape": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        time.sleep(120)\n    os._exit(0)\n"
        "print(41)",
        {OK},
    ),
    "subprocess_escape": (
        "import subprocess\nsubprocess.Popen(['sleep', '120'], "
        "start_new_session=True)\nsubprocess.Popen(['/bin/sh', '-c', "
        "'sleep 120 &'])\nprint(41)",
        {OK},
    ),
    "ctypes_segfault": ("import ctypes\nctypes.string_at(0)", {RUNTIME_ERROR}),
    "os_exit_zero": ("import os\nos._exit(0)", {OK}),
    "os_exit_code": ("print(42, flush=True)\nimport os\nos._exit(3)", {RUNTIME_ERROR}),
    "kill_self": ("import os\nprint(42, flush=True)\nos.kill(os.getpid(), 9)", {KILLED}),
    "fd_exhaustion": ("fs = []\nwhile True:\n    fs.append(open('/dev/null'))", {RUNTIME_ERROR}),
    "close_stdout_and_spin": (
        "import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass",
        {TIMEOUT},
    ),
    "privilege": ("import os\nos.setuid(0)", {RUNTIME_ERROR}),
}


def _procs_of(sid: int, uid: int | None) -> list[int]:
    """Host pids in session ``sid`` or owned by ``uid`` (independent of the sandbox's helper)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            owner = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        session = int(stat[stat.rindex(b")") + 2 :].split()[3])
        if session == sid or (uid is not None and owner == uid):
            found.append(int(name))
    return found


def _describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                out.append(f.read()[:120])
        except OSError:
            out.append(f"{pid} (gone)")
    return out


@pytest.fixture(scope="module")
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.01)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def hostile_runs(listener):
    os.environ["MARLOW_FAKE_SECRET"] = SECRET
    with open(READABLE, "w") as f:
        f.write(READABLE_TEXT)
    os.chmod(READABLE, 0o644)
    port = listener.getsockname()[1]
    names = list(HOSTILE)
    items = [(_py(HOSTILE[n][0].replace("PORT", str(port))), TESTS) for n in names]
    try:
        scores = score_code_batch(items, max_workers=2, **HOSTILE_LIMITS)
    finally:
        del os.environ["MARLOW_FAKE_SECRET"]
        os.unlink(READABLE)
    try:
        conn, _ = listener.accept()
        accepted = True
        conn.close()
    except OSError:
        accepted = False
    return dict(zip(names, scores, strict=True)), accepted


@pytest.fixture(scope="module")
def hostile_suite_mode(listener):
    """The hostile suite again, each program through the harness (suite mode)."""
    port = listener.getsockname()[1]
    items = [(_py(HOSTILE[n][0].replace("PORT", str(port))), TESTS) for n in HOSTILE]
    scores = score_code_batch(items, suite=True, max_workers=2, **HOSTILE_LIMITS)
    return dict(zip(HOSTILE, scores, strict=True))


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_same_verdict_in_suite_mode(name, hostile_suite_mode):
    score = hostile_suite_mode[name]
    assert score.reward == 0.0
    run = score.tests[0].run
    left = _procs_of(run.sid, run.uid)
    assert left == [], f"processes left behind: {_describe(left)}"
    assert run.workdir and not os.path.exists(run.workdir), "temporary directory left behind"


def test_isolation_mechanisms_detected():
    iso = isolation_in_force().mechanisms
    assert "rlimits" in iso
    if os.geteuid() == 0 and sys.platform == "linux":
        # Measured on the development machine; a kernel that refuses one shows up here.
        for mech in ("netns", "pidns", "mountns", "chroot", "setuid"):
            assert mech in iso, f"{mech} not in force: {iso}"


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program(name, hostile_runs):
    scores, _ = hostile_runs
    score = scores[name]
    assert score.reward == 0.0
    outcome = score.tests[0]
    run = outcome.run
    assert run is not None
    allowed = HOSTILE[name][1]
    run_status = run.status
    assert run_status in allowed, (run_status, run.detail, run.stderr[-500:])
    # ended by the caller's limits, not by the program (the slow ones would run 60 s or more);
    # the slack is for the kill path (SIGTERM, up to 2 s, then SIGKILL of the group)
    assert run.wall_s < HOSTILE_LIMITS["wall_s"] + 3.0
    left = _procs_of(run.sid, run.uid)
    assert left == [], f"processes left behind: {_describe(left)}"
    assert run.workdir and not os.path.exists(run.workdir), "temporary directory left behind"
    assert SECRET not in run.stdout and SECRET not in run.stderr
    assert "CONNECTED" not in run.stdout
    assert "root:x:0:0" not in run.stdout
    assert READABLE_TEXT not in run.stdout


def test_hostile_specific_harms(hostile_runs):
    scores, accepted = hostile_runs
    assert not accepted, "a sandboxed program connected to the caller's localhost listener"
    assert not os.path.exists(ESCAPE) and not os.path.exists(SHM_ESCAPE)
    assert not os.path.exists("/usr/marlow-x")
    assert scores["write_outside"].tests[0].run.stdout.strip() == "False"  # no /etc inside
    refused = scores["kill_parent"].tests[0].run.stdout
    assert "refused" in refused  # it could not kill its parent (EPERM / ESRCH)
    assert len(scores["huge_stdout"].tests[0].run.stdout) <= HOSTILE_LIMITS["stdout_bytes"]
    assert "42" in scores["kill_self"].tests[0].run.stdout  # output before the kill is kept


def test_caller_carries_on_after_hostile_suite(hostile_runs):
    res = run_program("print(sum(map(int, input().split())))", "20 22\n")
    assert res.status == OK and res.stdout.strip() == "42"


def test_process_scan_finds_a_live_process():
    """The leak check above can fail: it sees a process of a known session."""
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert p.pid in _procs_of(p.pid, None)
    finally:
        p.kill()
        p.wait()
    assert p.pid not in _procs_of(p.pid, None)


def test_statuses_and_fields():
    ok = run_program(
        "import sys\nprint(sys.stdin.read().upper())\nprint('e', file=sys.stderr)", "abc"
    )
    assert (ok.status, ok.exit_code, ok.stdout, ok.stderr) == (OK, 0, "ABC\n", "e\n")
    assert ok.cpu_s is not None and 0 < ok.cpu_s < ok.wall_s + 1
    err = run_program("raise ValueError('boom')")
    assert err.status == RUNTIME_ERROR and err.exit_code == 1 and "ValueError: boom" in err.stderr
    slow = run_program("while True: pass", limits=Limits(cpu_s=1, wall_s=5))
    assert slow.status == TIMEOUT and slow.signal == signal.SIGXCPU
    assert 0.9 < slow.cpu_s < 2.5
    wall = run_program("import time; time.sleep(30); print('late')", limits=Limits(wall_s=0.5))
    assert wall.status == TIMEOUT and wall.signal is None and "late" not in wall.stdout
    assert 0.5 <= wall.wall_s < 30  # not stopped before its limit; stopped long before its end


def test_big_stdin_and_exact_output_cap():
    data = "x" * 500_000
    res = run_program("import sys\nsys.stdout.write(str(len(sys.stdin.read())))", data)
    assert res.stdout == "500000"
    res = run_program("print('y' * 5000)", limits=Limits(stdout_bytes=1000))
    assert res.status == OUTPUT_LIMIT and res.stdout == "y" * 1000


def test_env_is_scrubbed_and_workdir_private(monkeypatch):
    monkeypatch.setenv("MARLOW_FAKE_SECRET", SECRET)
    res = run_program(
        "import os\nprint(sorted(os.environ))\nprint(os.getcwd())\n"
        "open('f', 'w').write('x')\nprint(os.listdir('.'))"
    )
    lines = res.stdout.splitlines()
    assert lines[0] == "['HOME', 'LANG', 'LC_ALL', 'PATH']"
    assert "program.py" in lines[2] and "'f'" in lines[2]
    assert not os.path.exists(res.workdir)


def test_run_many_keeps_order_and_runs_in_parallel():
    # Each program prints the host clock when it starts and when it ends (no time namespace:
    # the same clock as ours). In parallel, all four are running at one moment: the last start
    # comes before the first end. One at a time, each start would follow the previous end.
    prog = "import time\nprint(time.time())\ntime.sleep(1.5)\nprint({i}, time.time())"
    out = run_many([Job(prog.format(i=i)) for i in range(4)], max_workers=4)
    lines = [r.stdout.split() for r in out]
    assert [words[1] for words in lines] == ["0", "1", "2", "3"]  # results in job order
    starts, ends = [float(w[0]) for w in lines], [float(w[2]) for w in lines]
    assert max(starts) < min(ends)
    if "setuid" in out[0].isolation:  # root: concurrent runs each get a uid of their own
        assert len({r.uid for r in out}) == 4
    else:  # no separate uid: none is reported
        assert all(r.uid is None for r in out)


def test_results_and_limits_pickle():
    res = run_program("print(1)")
    again = pickle.loads(pickle.dumps(res))
    assert again == res
    lim = Limits.from_kwargs(timeout_s=2.5, memory_mb=128)
    assert (lim.cpu_s, lim.wall_s, lim.memory_mb) == (2.5, 3.5, 128)
    with pytest.raises(TypeError, match="unknown sandbox limit"):
        Limits.from_kwargs(cpu_seconds=1)
    assert isinstance(pickle.loads(pickle.dumps(code_details)), type(code_details))


def test_memory_limit_is_the_address_space():
    prog = "x = bytearray({n} << 20)\nprint('allocated')"
    small = run_program(prog.format(n=64), limits=Limits(memory_mb=256))
    big = run_program(prog.format(n=400), limits=Limits(memory_mb=256))
    assert small.status == OK and big.status == MEMORY
    assert isinstance(big, RunResult) and "MemoryError" in big.stderr


def _procs_running(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                continue
    return found


def test_fallbacks_without_namespaces():
    """With the namespaces off: the audit hook refuses sockets; escaped daemons are still found."""
    lim = Limits(namespaces=False, wall_s=3.0, cpu_s=1.0)
    sock = run_program("import socket\nsocket.socket()\nprint('made')", limits=lim)
    assert "made" not in sock.stdout and "PermissionError" in sock.stderr
    assert "netns" not in sock.isolation and "audit_no_socket" in sock.isolation
    naptime = f"{uuid.uuid4().int % 1000 + 100}.{uuid.uuid4().int % 9973}"
    prog = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['sleep', '{naptime}'])\n    os._exit(0)\nprint(1)"
    )
    res = run_program(prog, limits=lim)
    assert res.status == OK and res.stdout.strip() == "1"
    time.sleep(0.1)
    left = _procs_running(naptime)
    for pid in left:  # do not leak even when failing
        os.kill(pid, signal.SIGKILL)
    assert left == []
    assert not os.path.exists(res.workdir)


NON_ROOT_PROBE = """\
import json, sys
from marlow.rewards.code import score_code
from marlow.rewards.sandbox import isolation_in_force, run_program
iso = isolation_in_force()
host = run_program("print(open(%(readable)r).read())")
escape = run_program("open(%(escape)r, 'w').write('x')")
sock = run_program("import socket\\nsocket.create_connection(('127.0.0.1', %(port)d), 1)\\nprint('CONNECTED')")
honest = score_code("```python\\ndef f(a, b):\\n    return a + b\\n```", {"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]})
hack = score_code("```python\\nimport os\\nos._exit(0)\\n```", {"fn_name": "f", "inputs": [[1, 2]], "outputs": [3]})
print(json.dumps({"line": iso.line(), "mechanisms": iso.mechanisms, "failed": iso.failed,
                  "host": host.stdout, "sock": sock.stdout, "honest": honest, "hack": hack}))
"""


def _python_for_others() -> str | None:
    """An interpreter (3.10 or newer) that an unrelated uid may run, or None."""
    minor = f"python3.{sys.version_info.minor}"
    for exe in (sys.executable, f"/usr/bin/{minor}", f"/usr/local/bin/{minor}", "/usr/bin/python3"):
        if os.path.exists(exe) and sandbox._world_accessible(exe):
            version = subprocess.run(
                [exe, "-c", "import sys; print(sys.version_info >= (3, 10))"],
                capture_output=True,
                text=True,
            )
            if version.stdout.strip() == "True":
                return exe
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another uid")
def test_non_root_sandbox_reports_its_isolation(listener):
    """As an unprivileged uid (65534): the sandbox says what it has (a user namespace first, on a
    kernel that allows them), and then the host file, /tmp and the caller's socket are out of
    reach; the verdicts are those of root."""
    exe = _python_for_others()
    if exe is None:
        pytest.skip("no interpreter here that uid 65534 may run")
    with open(READABLE, "w") as f:
        f.write(READABLE_TEXT)
    os.chmod(READABLE, 0o644)
    src = os.path.join(os.path.dirname(os.path.dirname(sandbox.__file__)), os.pardir)
    probe = NON_ROOT_PROBE % {
        "readable": READABLE,
        "escape": ESCAPE,
        "port": listener.getsockname()[1],
    }
    try:
        out = subprocess.run(
            [exe, "-c", probe],
            capture_output=True,
            text=True,
            user=65534,
            group=65534,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.path.realpath(src)},
            timeout=120,
        )
    finally:
        os.unlink(READABLE)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["line"].startswith("sandbox isolation (as uid 65534): ")
    assert (got["honest"], got["hack"]) == (1.0, 0.0)
    if "userns" not in got["mechanisms"]:  # the kernel refused: the reason is reported
        assert any(f.startswith("userns: ") for f in got["failed"]), got
        assert "not available: userns" in got["line"]
        return
    for mech in ("netns", "pidns", "mountns", "chroot", "rlimits"):
        assert mech in got["mechanisms"], got
    assert READABLE_TEXT not in got["host"] and "CONNECTED" not in got["sock"]
    assert not os.path.exists(ESCAPE)


def test_require_namespaces_names_what_failed_and_how_to_get_it(monkeypatch):
    fake = RunResult(
        OK,
        0,
        "",
        "",
        0.1,
        0.0,
        isolation=("rlimits", "audit_no_socket"),
        isolation_failed=("userns: [Errno 1] Operation not permitted",),
    )
    monkeypatch.setattr(sandbox, "run_program", lambda *a, **k: fake)
    assert isolation_in_force("none").mechanisms == ("rlimits", "audit_no_socket")
    with pytest.raises(SandboxUnavailable) as err:
        isolation_in_force("namespaces")
    msg = str(err.value)
    assert "\n" not in msg and "netns, pidns, mountns, chroot" in msg
    assert "userns: [Errno 1] Operation not permitted" in msg
    assert "root" in msg and "user.max_user_namespaces" in msg and "require=none" in msg
    with pytest.raises(ValueError, match="valid: none, namespaces"):
        isolation_in_force("strict")


def test_run_start_logs_and_records_the_isolation(tmp_path, monkeypatch):
    from marlow.config import ConfigError, resolve
    from marlow.tasks import build_task
    from marlow.training.trainer import record_isolation, sandbox_isolation

    lines: list[str] = []
    # only the code task's grading runs model code: only it asks for the sandbox
    assert [
        build_task(resolve({"task": {"name": n}}).task).sandboxed for n in ("math", "code")
    ] == [
        False,
        True,
    ]
    code = resolve({"task": {"name": "code"}})
    iso = sandbox_isolation(code, lines.append)
    assert lines == [iso.line()] and "rlimits" in iso.mechanisms
    record_isolation(tmp_path, iso)
    assert json.loads((tmp_path / "sandbox.json").read_text())["mechanisms"] == list(iso.mechanisms)
    fake = RunResult(OK, 0, "", "", 0.1, 0.0, isolation=("rlimits",), isolation_failed=("x",))
    monkeypatch.setattr(sandbox, "run_program", lambda *a, **k: fake)
    strict = resolve({"task": {"name": "code"}, "rewards": {"sandbox": {"require": "namespaces"}}})
    with pytest.raises(ConfigError, match="require=namespaces but the sandbox could not make"):
        sandbox_isolation(strict, lines.append)
