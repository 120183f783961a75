"""One exec's I/O, written once for every driver: the code that decides whether a command
finished, timed out, went silent, or was killed, and what of its output is kept.

A driver hands the loop an ``ExecIO``: the readable ends of the command's output (two
pipes for the process driver, one multiplexed socket for Docker, a WebSocket for
Kubernetes), the writable end of its stdin, a way to learn that it exited (a pidfd, or a
poll), and a kill that reaches the exec's whole process tree. The loop does the rest:

- feeds stdin without ever blocking on it, and closes it (EOF) when done;
- reads output as it comes, redacts secrets before anything keeps or forwards a byte
  (also across chunk boundaries), keeps head and tail in O(cap) memory per stream, and
  forwards chunks to the caller's callbacks (a failing callback is logged, not fatal);
- kills on the total deadline or after ``idle_timeout_s`` without output, then waits at
  most ``kill_grace_s`` for the last bytes;
- after the command exits, waits at most ``exit_grace_s`` for the streams to end: a
  grandchild that inherited the pipes cannot hold the caller hostage;
- calls ``sample`` every ``sample_interval_s`` (peak process counting).

Time comes from an injectable clock, so the edge cases are tested with fake transports
and no sleeping (tests/unit/test_exec_io.py).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Final, Protocol

from devs_sandbox.base import OutputCallback
from devs_sandbox.capture import HeadTailCapture
from devs_sandbox.models import CapturedStream
from devs_sandbox.security.session_keys import Redactor, StreamRedactor

logger = logging.getLogger(__name__)

STDOUT: Final = 1
STDERR: Final = 2
READ_CHUNK: Final = 65_536
EXIT_DRAIN_GRACE_S: Final = 0.2  # after exit, how long a grandchild may keep our pipes open
KILL_DRAIN_GRACE_S: Final = 0.5  # after a kill, how long to wait for the streams to close
SAMPLE_INTERVAL_S: Final = 0.05  # peak process sampling while an exec runs
EXIT_POLL_S: Final = 0.01  # exit polling when the transport has no exit fd (no pidfd)


class OutputSource(Protocol):
    """A readable endpoint of the command's output (a pipe, a socket, a WebSocket)."""

    def fileno(self) -> int: ...

    def read(self) -> Iterable[tuple[int, bytes]] | None:
        """What is ready now as (STDOUT|STDERR, bytes) frames, or None at end of file.
        Never blocks; may return nothing (a partial frame) or raise BlockingIOError."""
        ...

    def finish(self) -> Iterable[tuple[int, bytes]]:
        """What the source still holds back when the exec is over (a partial marker)."""
        ...


class InputSink(Protocol):
    """The writable end of the command's stdin."""

    def fileno(self) -> int: ...

    def write(self, data: memoryview) -> int:
        """Write what fits now (BlockingIOError if nothing does); OSError: reader gone."""
        ...

    def close(self) -> None:
        """End of input for the command (close the pipe, shut the socket's write side)."""
        ...


class ExecProcess(Protocol):
    """The running command: how to learn it exited, and how to kill its whole tree."""

    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable when it exits (a pidfd), or None to poll."""
        ...

    def poll(self) -> bool:
        """True once it has exited (and, for a child process, has been reaped)."""
        ...

    def kill(self) -> None:
        """SIGKILL the exec and everything it started; safe to call twice."""
        ...


@dataclass
class ExecIO:
    """What a driver hands the loop for one exec."""

    sources: list[OutputSource]
    process: ExecProcess
    stdin: InputSink | None = None
    stdin_data: bytes | None = None
    stdin_file: IO[bytes] | None = None  # streamed after stdin_data (a spooled archive)
    sample: Callable[[], None] | None = None
    # A transport whose output carries its own end marker (Docker's launcher trailers)
    # may need longer than a pipe to flush after the exit is seen.
    exit_grace_s: float = EXIT_DRAIN_GRACE_S
    kill_grace_s: float = KILL_DRAIN_GRACE_S
    exit_poll_s: float = EXIT_POLL_S  # without an exit fd: how often to ask (an API call?)


@dataclass
class IOResult:
    stdout: CapturedStream
    stderr: CapturedStream
    timed_out: bool
    idle_timed_out: bool
    killed: bool  # the loop killed the exec (timeout); the driver's status tells the rest
    exited: bool  # the exit was seen (else the loop gave up after a kill)
    duration_s: float
    output_bytes: dict[int, int] = field(default_factory=dict)


def run(
    io: ExecIO,
    *,
    timeout_s: float | None,
    idle_timeout_s: float | None,
    max_output_bytes: int,
    redactor: Redactor | None = None,
    on_stdout: OutputCallback | None = None,
    on_stderr: OutputCallback | None = None,
    start: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    selector_factory: Callable[[], selectors.BaseSelector] = selectors.DefaultSelector,
    sample_interval_s: float = SAMPLE_INTERVAL_S,
) -> IOResult:
    """Drive one exec to its end (see the module docstring); never raises for the
    command's behaviour, only for a broken transport of ours."""
    start = clock() if start is None else start
    loop = _Loop(
        io,
        timeout_s=timeout_s,
        idle_timeout_s=idle_timeout_s,
        cap=max_output_bytes,
        redactor=redactor,
        callbacks={STDOUT: on_stdout, STDERR: on_stderr},
        start=start,
        clock=clock,
        sample_interval_s=sample_interval_s,
    )
    sel = selector_factory()
    try:
        return loop.run(sel)
    finally:
        sel.close()


class _Loop:
    def __init__(
        self,
        io: ExecIO,
        *,
        timeout_s: float | None,
        idle_timeout_s: float | None,
        cap: int,
        redactor: Redactor | None,
        callbacks: dict[int, OutputCallback | None],
        start: float,
        clock: Callable[[], float],
        sample_interval_s: float,
    ) -> None:
        self.io = io
        self.clock = clock
        self.start = start
        self.deadline = None if timeout_s is None else start + timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.captures = {STDOUT: HeadTailCapture(cap), STDERR: HeadTailCapture(cap)}
        self.callbacks = callbacks
        # Secrets are redacted before anything keeps or forwards a byte of output.
        self.redactors: dict[int, StreamRedactor] = (
            {STDOUT: redactor.stream(), STDERR: redactor.stream()} if redactor else {}
        )
        self.sample_interval_s = sample_interval_s
        self.last_output = start
        self.exited_at: float | None = None
        self.killed_at: float | None = None
        self.timed_out = self.idle_timed_out = False
        self.open_sources = len(io.sources)
        self.pending = memoryview(io.stdin_data) if io.stdin_data is not None else None
        self.bytes_seen = {STDOUT: 0, STDERR: 0}
        self._shared_stdin = False  # stdin is the same descriptor as an output source

    # -- output --------------------------------------------------------------------------
    def deliver(self, stream: int, chunk: bytes) -> None:
        if stream not in self.captures:
            return
        red = self.redactors.get(stream)
        if red is not None:
            chunk = red.feed(chunk)
        self._keep(stream, chunk)

    def _keep(self, stream: int, chunk: bytes) -> None:
        if not chunk:
            return
        self.bytes_seen[stream] += len(chunk)
        self.captures[stream].feed(chunk)
        cb = self.callbacks.get(stream)
        if cb is not None:
            try:
                cb(chunk)
            except Exception:
                logger.exception("output callback failed")

    def flush(self) -> None:
        for stream, red in self.redactors.items():
            self._keep(stream, red.flush())

    # -- the loop ------------------------------------------------------------------------
    def run(self, sel: selectors.BaseSelector) -> IOResult:
        io = self.io
        for source in io.sources:
            sel.register(source.fileno(), selectors.EVENT_READ, source)
        exit_fd = io.process.exit_fd()
        if exit_fd is not None:
            sel.register(exit_fd, selectors.EVENT_READ, "exit")
        feeding = self._start_stdin(sel)
        next_sample = self.start
        next_poll = self.start
        try:
            while True:
                now = self.clock()
                # Without an exit fd (polled), or once killed (the fd may have fired unseen).
                polling = exit_fd is None or self.killed_at is not None
                if self.exited_at is None and polling and (now >= next_poll or self.killed_at):
                    if io.process.poll():
                        self.exited_at = now
                    next_poll = now + io.exit_poll_s
                if self._finished(now):
                    break
                if self.killed_at is None:
                    if self.deadline is not None and now >= self.deadline:
                        self.timed_out = True
                    elif (
                        self.idle_timeout_s is not None
                        and now - self.last_output >= self.idle_timeout_s
                    ):
                        self.idle_timed_out = True
                    if self.timed_out or self.idle_timed_out:
                        io.process.kill()
                        self.killed_at = now
                        continue
                if io.sample is not None and now >= next_sample:
                    try:
                        io.sample()
                    except Exception:
                        logger.exception("sampling the exec failed")
                    next_sample = now + self.sample_interval_s
                wait = self._wait(now, next_sample, next_poll, exit_fd)
                for key, mask in sel.select(wait):
                    if key.data == "exit":
                        sel.unregister(key.fd)
                        exit_fd = None
                        if io.process.poll():
                            self.exited_at = self.clock()
                        continue
                    if mask & selectors.EVENT_WRITE:
                        feeding = self._feed(sel, feeding)
                    reading = mask & selectors.EVENT_READ and key.data != "stdin"
                    if reading and not self._read(sel, key.data) and self._shared_stdin:
                        feeding = False  # the one socket is gone in both directions
        finally:
            if feeding and io.stdin is not None:
                with contextlib.suppress(OSError):
                    io.stdin.close()
        for source in io.sources:
            try:
                for stream, chunk in source.finish():
                    self.deliver(stream, chunk)
            except OSError:
                pass
        self.flush()
        end = self.clock()
        if self.exited_at is None and io.process.poll():
            self.exited_at = end
        return IOResult(
            stdout=self.captures[STDOUT].result(),
            stderr=self.captures[STDERR].result(),
            timed_out=self.timed_out,
            idle_timed_out=self.idle_timed_out,
            killed=self.killed_at is not None,
            exited=self.exited_at is not None,
            duration_s=end - self.start,
            output_bytes=dict(self.bytes_seen),
        )

    def _finished(self, now: float) -> bool:
        if self.exited_at is not None:
            if self.open_sources == 0:
                return True
            if now - self.exited_at >= self.io.exit_grace_s:
                return True  # a grandchild holds the streams; the command itself is done
        return self.killed_at is not None and now - self.killed_at >= self.io.kill_grace_s

    def _wait(self, now: float, next_sample: float, next_poll: float, exit_fd: int | None) -> float:
        waits: list[float] = []
        if self.io.sample is not None:
            waits.append(next_sample - now)
        if self.killed_at is None:
            if self.deadline is not None:
                waits.append(self.deadline - now)
            if self.idle_timeout_s is not None:
                waits.append(self.last_output + self.idle_timeout_s - now)
        else:
            waits.append(self.killed_at + self.io.kill_grace_s - now)
            waits.append(EXIT_POLL_S)
        if self.exited_at is not None:
            waits.append(self.exited_at + self.io.exit_grace_s - now)
        elif exit_fd is None:
            waits.append(next_poll - now)
        return max(0.0, min(waits)) if waits else 1.0

    # -- stdin -----------------------------------------------------------------------------
    def _start_stdin(self, sel: selectors.BaseSelector) -> bool:
        sink = self.io.stdin
        if sink is None:
            return False
        if (self.pending is None or not len(self.pending)) and self.io.stdin_file is None:
            with contextlib.suppress(OSError):
                sink.close()
            return False
        fd = sink.fileno()
        registered = sel.get_map()
        if fd in registered:  # one socket for both directions (Docker)
            key = registered[fd]
            sel.modify(fd, key.events | selectors.EVENT_WRITE, key.data)
            self._shared_stdin = True
        else:
            sel.register(fd, selectors.EVENT_WRITE, "stdin")
            self._shared_stdin = False
        return True

    def _feed(self, sel: selectors.BaseSelector, feeding: bool) -> bool:
        sink = self.io.stdin
        if not feeding or sink is None:
            return feeding
        if (self.pending is None or not len(self.pending)) and self.io.stdin_file is not None:
            chunk = self.io.stdin_file.read(READ_CHUNK)
            self.pending = memoryview(chunk)
            if not chunk:
                self.io.stdin_file = None
        if self.pending is None:
            self.pending = memoryview(b"")
        try:
            if len(self.pending):
                n = sink.write(self.pending[:READ_CHUNK])
                self.pending = self.pending[n:]
        except BlockingIOError:
            return True
        except OSError:
            # The command stopped reading: drop the rest.
            self.pending, self.io.stdin_file = self.pending[:0], None
        if len(self.pending) or self.io.stdin_file is not None:
            return True
        with contextlib.suppress(OSError):
            sink.close()
        fd = sink.fileno()
        key = sel.get_map().get(fd)
        if key is not None:
            if self._shared_stdin:
                sel.modify(fd, selectors.EVENT_READ, key.data)
            else:
                sel.unregister(fd)
        return False

    # -- output ----------------------------------------------------------------------------
    def _read(self, sel: selectors.BaseSelector, source: OutputSource) -> bool:
        """Take what ``source`` has; False once it reached end of file."""
        fd = source.fileno()
        try:
            frames = source.read()
        except BlockingIOError:
            return True
        except OSError:
            frames = None
        if frames is None:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(fd)
            self.open_sources -= 1
            return False
        got = False
        for stream, chunk in frames:
            if chunk:
                got = True
                self.deliver(stream, chunk)
        if got:
            self.last_output = self.clock()
        return True
