"""Where a grid's cells run: a pool of local processes or Ray tasks, and how wide it is.

Sizing (local runner): workers = min(cores, cells ready, memory available * 0.8 / memory per
cell), torch threads per cell = cores // workers. Memory per cell is an estimate of marlow's,
not a measurement: 1.5 GiB for a tiny scale, 16 GiB for any other model (override with
``--workers``). Ray: each cell is a task asking for the grid's ``resources`` (GPUs, CPUs:
by default its ``threads``, custom resources); a request no node of the cluster could ever meet
is refused in one line before anything is submitted (Ray would otherwise wait forever). Each cell
logs what Ray assigned it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from marlow.fileio import socket_path_fits
from marlow.grids.cell_process import run_cell
from marlow.grids.grid import Cell, CellResources
from marlow.usercode import first_line

TINY_CELL_GIB = 1.5
OTHER_CELL_GIB = 16.0
RUNNERS = ("local", "ray")


class Pool(Protocol):
    workers: int

    def submit(self, cell: Cell, args: tuple) -> Any: ...
    def wait(self, handles: list[Any], timeout: float) -> list[Any]: ...
    def result(self, handle: Any) -> str: ...
    def stop(self, handles: list[Any]) -> None: ...
    def close(self) -> None: ...


PRELOAD = ["marlow.grids.cell_process", "marlow.training.trainer"]
"""What the local pool's fork server imports once for every cell (torch, transformers, peft and
the trainer: 9-10 s of a spawned cell's start on a 2-core AMD EPYC)."""


class LocalPool:
    """Worker processes, one cell each at a time, forked from a fork server that imported
    :data:`PRELOAD` once (spawned where the platform has no fork server, or where no folder
    holds its socket: :func:`_socket_folder`). The server is started
    with one OpenMP thread, so that no torch thread team exists to be forked, and has run no
    torch operation; each cell sets its own threads and takes the grid process's environment and
    working directory as they were when the cell was submitted (the server's are the ones it was
    started with). Every worker ends as soon as the grid process does (:func:`_end_with`): a
    worker's parent is the server, which outlives the grid while any worker runs."""

    def __init__(self, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers
        if "forkserver" in multiprocessing.get_all_start_methods() and _socket_folder():
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _start_fork_server()
        else:
            ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_end_with, initargs=(os.getpid(),)
        )

    def submit(self, cell: Cell, args: tuple) -> Any:
        return self._pool.submit(_run_as_submitted, dict(os.environ), os.getcwd(), *args)

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures

        done, _ = wait_futures(handles, timeout=timeout, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle: Any) -> str:
        return handle.result()

    def stop(self, handles: list[Any]) -> None:
        """Stop every worker now (an interrupted grid): SIGTERM, then SIGKILL after 10 s. A
        cell's own children end with it (the math grader's worker on its closed stdin, the code
        sandbox on ``PR_SET_PDEATHSIG``). The cells resume from their last checkpoint."""
        processes = list((self._pool._processes or {}).values())  # no public handle on them
        for proc in processes:
            proc.terminate()
        for proc in processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


SOCKET_NAME = "listener-XXXXXXXX"
"""The name multiprocessing gives the fork server's socket in its temporary folder, as long as
Python 3.11's (8 random characters; newer Pythons' are shorter)."""


def _socket_folder() -> str | None:
    """multiprocessing's temporary folder (``pymp-XXXXXXXX``, made once a process and removed at
    its exit), where the fork server's Unix socket goes; None where no socket fits there.

    multiprocessing makes it in the temporary folder, whose path may be too long for a socket
    (``TMPDIR`` set deep in a job's scratch space: the server would not start, with
    ``OSError: AF_UNIX path too long``). There it is made under the first of /tmp and /var/tmp
    that is short enough and writable instead (as newer Pythons' multiprocessing does itself);
    the rest of the grid keeps the temporary folder the user set. Where this process made the
    folder already (an earlier pool), it stays where it is."""
    import tempfile
    from multiprocessing import util

    before = tempfile.tempdir
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp"):
        room = socket_path_fits(f"{base}/pymp-XXXXXXXX/{SOCKET_NAME}")
        if room and os.access(base, os.W_OK | os.X_OK):
            tempfile.tempdir = base  # where util makes its folder, if it has none yet
            try:
                folder = util.get_temp_dir()
            finally:
                tempfile.tempdir = before
            return folder if socket_path_fits(f"{folder}/{SOCKET_NAME}") else None
    return None


def _start_fork_server() -> None:
    """Start this process's fork server (if not running) with ``OMP_NUM_THREADS=1`` in its
    environment only."""
    from multiprocessing import forkserver

    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def _end_with(pid: int) -> None:
    """Pool initializer: a thread that kills this worker (and so its cell) when process ``pid``
    ends, however it ends (a SIGKILL runs no handler), waiting on a pidfd (Linux 5.3+; where
    there is none, a killed grid may leave its cells running)."""
    import select
    import signal
    import threading

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # the grid ended before this worker started
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):
        return

    def watch() -> None:
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="marlow-grid-watch", daemon=True).start()


def _run_as_submitted(environ: dict[str, str], cwd: str, *args: Any) -> str:
    """:func:`run_cell` in a forked worker, under the grid process's ``environ`` and working
    directory ``cwd`` as they were when the cell was submitted: a worker runs cell after cell,
    and a cell's reward that changed either (``os.chdir``) must not move the next cell's
    relative paths (its data file, its folder)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    return run_cell(*args)


class RayPool:
    """Each cell a Ray task asking for ``resources`` (CPUs default to its threads); ``address``
    None starts a local Ray. Where Ray runs already in this process (the caller's own
    ``ray.init``), the pool uses it, ``address`` unread, and leaves it running at the end;
    otherwise it connects, and disconnects when it closes or fails to start."""

    def __init__(
        self,
        workers: int,
        threads: int,
        address: str | None,
        resources: CellResources | None = None,
    ) -> None:
        try:
            import ray
        except ImportError:
            from marlow.config import ConfigError

            raise ConfigError(
                "--runner ray needs Ray; install it with: pip install 'marlow[ray]'"
            ) from None
        self._ray = ray
        self._owned = not ray.is_initialized()
        if self._owned:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address is None:
                kwargs["num_cpus"] = os.cpu_count() or 1
                if (folder := _ray_folder()) is not None:
                    kwargs["_temp_dir"] = folder
            else:
                _check_address(address)
            try:
                ray.init(address=address, **kwargs)
            except Exception as err:  # Ray's own types, several lines each: one line
                where = "a local Ray" if address is None else f"Ray at --address {address}"
                raise RuntimeError(f"could not start {where}: {first_line(err)}") from None
        self.workers = workers
        res = resources or CellResources()
        ask = {"CPU": float(res.cpus or threads), "GPU": res.gpus, **res.custom}
        try:
            _check_cluster(ask, ray.cluster_resources())
        except BaseException:
            self.close()
            raise
        self._task = ray.remote(
            num_cpus=ask["CPU"], num_gpus=res.gpus, resources=dict(res.custom), max_retries=0
        )(run_cell)

    def submit(self, cell: Cell, args: tuple) -> Any:
        return self._task.remote(*args)

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        done, _ = self._ray.wait(handles, num_returns=1, timeout=timeout)
        return done

    def result(self, handle: Any) -> str:
        return self._ray.get(handle)

    def stop(self, handles: list[Any]) -> None:
        """Cancel the running cells' tasks (force: their worker processes are killed)."""
        for handle in handles:
            self._ray.cancel(handle, force=True)

    def close(self) -> None:
        if self._owned:
            self._ray.shutdown()


RAY_SOCKET = "ray/session_2026-12-01_00-00-00_000000_4194304/sockets/plasma_store"
"""The longest socket path a local Ray makes in its temporary folder: its session folder is named
by the date, the time and its process id (at most 4,194,304 on Linux)."""


def _ray_folder() -> str | None:
    """Where a local Ray keeps its files, where Ray's own choice would not do: its default folder
    (``RAY_TMPDIR``, else ``TMPDIR``, else /tmp) made so deep by ``TMPDIR`` that its sockets'
    paths pass the Unix socket limit (Ray would fail to start). Then ``ray`` under the first of
    /tmp and /var/tmp that is short enough and writable; None keeps Ray's choice (a user's own
    ``RAY_TMPDIR`` included)."""
    if "RAY_TMPDIR" in os.environ or socket_path_fits(
        f"{os.environ.get('TMPDIR') or '/tmp'}/{RAY_SOCKET}"
    ):
        return None
    for base in ("/tmp", "/var/tmp"):
        if socket_path_fits(f"{base}/{RAY_SOCKET}") and os.access(base, os.W_OK | os.X_OK):
            return f"{base}/ray"
    return None


ADDRESS_TIMEOUT_S = 10.0
"""How long a Ray cluster's address may take to accept a connection before the grid is refused
(``ray.init`` itself would retry for minutes)."""


def _check_address(address: str) -> None:
    """Refuse, in one line, a ``host:port`` address (or ``ray://host:port``) where nothing
    accepts a connection within :data:`ADDRESS_TIMEOUT_S`; other forms (``auto``) go to Ray as
    they are."""
    import socket

    from marlow.config import ConfigError

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), ADDRESS_TIMEOUT_S).close()
    except OSError as err:
        raise ConfigError(
            f"--address {address}: no Ray cluster answers there ({err.strerror or err}); start "
            "one (ray start --head) or leave out --address to start a local Ray"
        ) from None


def _check_cluster(ask: dict[str, float], cluster: dict[str, float]) -> None:
    """Refuse, in one line, a per-cell request larger than the whole Ray cluster holds."""
    from marlow.config import ConfigError

    names = {"CPU": "cpus", "GPU": "gpus"}
    for name, amount in ask.items():
        if amount > cluster.get(name, 0.0):
            field = names.get(name, f"custom.{name}")
            raise ConfigError(
                f"grid field 'resources.{field}' asks {amount:g} per cell but the Ray cluster "
                f"has {cluster.get(name, 0.0):g}; valid: at most {cluster.get(name, 0.0):g}"
            )


def plan_workers(cells: list[Cell], cores: int | None = None, mem_gib: float | None = None) -> int:
    """How many cells run at once on this machine (see the module docstring)."""
    from marlow.models import is_tiny

    cores = cores or os.cpu_count() or 1
    mem_gib = _available_gib() if mem_gib is None else mem_gib
    per_cell = max(TINY_CELL_GIB if is_tiny(c.config.model.name) else OTHER_CELL_GIB for c in cells)
    return max(1, min(cores, len(cells), int(mem_gib * 0.8 // per_cell)))


def _available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 8.0
