"""The caller's end of a sandboxed program's pipes (``marlow.rewards.sandbox``): feed stdin,
read stdout line by line or to the end, keep stderr's tail, and stop at the wall clock or at an
output flood. ``run_program`` drives it; a ``converse`` function talks through it."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

from marlow.rewards.limits import OUTPUT_LIMIT, TIMEOUT, Limits


class Channel:
    """A running program's pipes, seen from the caller. ``send`` queues bytes for its stdin,
    ``line`` waits for its next stdout line and ``drain`` for the end of its output; while
    waiting they feed stdin and keep reading stdout and stderr, and they give up at the run's
    wall clock (``deadline``, monotonic) or when output passes ``stdout_bytes`` (then ``verdict``
    says which, and the program is stopped)."""

    def __init__(self, proc: subprocess.Popen, lim: Limits, deadline: float) -> None:
        import selectors

        assert proc.stdin and proc.stdout and proc.stderr
        self.proc, self.lim, self.deadline = proc, lim, deadline
        self.out, self.err = bytearray(), bytearray()
        self.verdict: str | None = None
        self._err_total = 0
        self._pending = bytearray()  # queued for stdin
        self._closing = False  # close stdin once the queue is written
        self._gone_at: float | None = None  # when the boot exited (escaped processes may
        # still hold the pipes)
        self._sel = selectors.DefaultSelector()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(pipe.fileno(), False)
        self._sel.register(proc.stdout, selectors.EVENT_READ)
        self._sel.register(proc.stderr, selectors.EVENT_READ)

    def send(self, data: bytes) -> None:
        """Queue ``data`` for the program's stdin (dropped if it closed stdin or exited)."""
        import selectors

        stdin = self.proc.stdin
        if not data or stdin is None or stdin.closed or self._closing:
            return
        if not self._pending:
            self._sel.register(stdin, selectors.EVENT_WRITE)
        self._pending += data

    def close_input(self) -> None:
        """Close the program's stdin once what is queued is written."""
        self._closing = True
        stdin = self.proc.stdin
        if not self._pending and stdin is not None and not stdin.closed:
            stdin.close()

    def line(self, deadline: float) -> bytes | None:
        """The program's next stdout line (without the newline), or None if none came by
        ``deadline`` (monotonic), the program closed stdout, or the run was stopped."""
        self._pump(lambda: b"\n" in self.out, min(deadline, self.deadline))
        at = self.out.find(b"\n")
        if at < 0:
            return None
        line = bytes(self.out[:at])
        del self.out[: at + 1]
        return line

    def drain(self, deadline: float) -> None:
        """Read until the program closes stdout and stderr (or ``deadline``)."""
        self._pump(lambda: False, deadline)

    def close(self) -> None:
        self._sel.close()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe and not pipe.closed:
                pipe.close()

    def _pump(self, done: Callable[[], bool], deadline: float) -> None:
        stdin = self.proc.stdin
        while not done() and self.verdict is None and self._sel.get_map():
            now = time.monotonic()
            if now >= self.deadline:
                self.verdict = TIMEOUT
                return
            if now >= deadline:
                return
            if self._gone_at is None and self.proc.poll() is not None:
                self._gone_at = now
            if self._gone_at is not None and now - self._gone_at > 0.5:
                return  # only descendants that left the PID tree hold the pipes: stop reading
            for key, _ in self._sel.select(min(deadline - now, 0.25)):
                if key.fileobj is stdin:
                    self._write(stdin)
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _write(self, stdin) -> None:  # noqa: ANN001
        try:
            sent = os.write(stdin.fileno(), self._pending[:65536])
        except BlockingIOError:
            return
        except OSError:  # the program closed stdin or exited: stop feeding it
            sent = len(self._pending)
        del self._pending[:sent]
        if not self._pending:
            self._sel.unregister(stdin)
            if self._closing:
                stdin.close()

    def _read(self, f) -> None:  # noqa: ANN001
        try:
            chunk = os.read(f.fileno(), 65536)
        except BlockingIOError:
            return
        if not chunk:
            self._sel.unregister(f)
            return
        if f is self.proc.stdout:
            self.out += chunk
            if len(self.out) > self.lim.stdout_bytes:
                del self.out[self.lim.stdout_bytes :]
                self.verdict = OUTPUT_LIMIT
        else:
            self._err_total += len(chunk)
            self.err += chunk
            if len(self.err) > self.lim.stderr_bytes:
                del self.err[: len(self.err) - self.lim.stderr_bytes]
            if self._err_total > self.lim.stdout_bytes:
                self.verdict = OUTPUT_LIMIT
