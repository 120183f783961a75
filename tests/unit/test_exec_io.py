"""The shared exec loop, driven directly through fake transports (real pipes and sockets
as the byte carriers, a scripted process): every edge case once, for every driver."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator

import pytest

from devs_sandbox.drivers import exec_io
from devs_sandbox.drivers.exec_io import STDERR, STDOUT, ExecIO
from devs_sandbox.security.session_keys import Redactor

pytestmark = pytest.mark.unit


class PipeSource:
    """One pipe carrying one stream, as the process driver's."""

    def __init__(self, fd: int, stream: int) -> None:
        self.fd, self.stream = fd, stream
        os.set_blocking(fd, False)

    def fileno(self) -> int:
        return self.fd

    def read(self) -> Iterable[tuple[int, bytes]] | None:
        data = os.read(self.fd, 65536)
        return None if not data else [(self.stream, data)]

    def finish(self) -> Iterable[tuple[int, bytes]]:
        return ()


class SocketSource:
    """One socket for both directions, frames tagged by a leading stream byte (a toy
    multiplexing, as Docker's attach stream or the Kubernetes channels carry)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> Iterable[tuple[int, bytes]] | None:
        data = self.sock.recv(65536)
        if not data:
            return None
        return [(data[0], data[1:])]

    def finish(self) -> Iterable[tuple[int, bytes]]:
        return ()

    def write(self, data: memoryview) -> int:
        return self.sock.send(data)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)


class PipeSink:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self.closed = False

    def fileno(self) -> int:
        return self.fd

    def write(self, data: memoryview) -> int:
        return os.write(self.fd, data)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)


class ScriptedProcess:
    """Exits when told (or when killed, unless it ignores kills); an exit fd or polling."""

    def __init__(self, *, dies_on_kill: bool = True, with_exit_fd: bool = True) -> None:
        self.r, self.w = os.pipe()
        self.exited = False
        self.kills = 0
        self.dies_on_kill = dies_on_kill
        self.with_exit_fd = with_exit_fd

    def exit_fd(self) -> int | None:
        return self.r if self.with_exit_fd else None

    def poll(self) -> bool:
        return self.exited

    def exit(self) -> None:
        if not self.exited:
            self.exited = True
            os.write(self.w, b"x")

    def kill(self) -> None:
        self.kills += 1
        if self.dies_on_kill:
            self.exit()

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


@pytest.fixture
def pipes() -> Iterator[dict[str, int]]:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    fds = {"out_r": out_r, "out_w": out_w, "err_r": err_r, "err_w": err_w}
    yield fds
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)


def io_for(pipes: dict[str, int], proc: ScriptedProcess, **kw: object) -> ExecIO:
    sources = [PipeSource(pipes["out_r"], STDOUT), PipeSource(pipes["err_r"], STDERR)]
    return ExecIO(sources=list(sources), process=proc, **kw)  # type: ignore[arg-type]


def later(delay_s: float, fn: object) -> threading.Timer:
    t = threading.Timer(delay_s, fn)  # type: ignore[arg-type]
    t.start()
    return t


def close_writers(pipes: dict[str, int]) -> None:
    for name in ("out_w", "err_w"):
        os.close(pipes[name])
        pipes[name] = os.open(os.devnull, os.O_RDONLY)  # keep the fixture's close harmless


def run(io: ExecIO, **kw: object) -> exec_io.IOResult:
    args: dict[str, object] = {"timeout_s": 10.0, "idle_timeout_s": None, "max_output_bytes": 1024}
    args.update(kw)
    return exec_io.run(io, **args)  # type: ignore[arg-type]


def test_both_streams_are_captured_and_forwarded(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess()
    got: list[bytes] = []
    os.write(pipes["out_w"], b"out-1 ")
    os.write(pipes["err_w"], b"err-1")
    os.write(pipes["out_w"], b"out-2")

    def finish() -> None:
        close_writers(pipes)
        proc.exit()

    later(0.05, finish)

    def broken(_: bytes) -> None:
        raise RuntimeError("a callback of the caller's fails")

    r = run(io_for(pipes, proc), on_stdout=got.append, on_stderr=broken)
    assert r.stdout.text == "out-1 out-2" and r.stderr.text == "err-1"
    assert b"".join(got) == b"out-1 out-2"
    assert r.exited and not r.killed and not r.timed_out
    proc.close()


def test_the_deadline_kills_and_the_loop_ends_after_the_kill(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess()
    os.write(pipes["out_w"], b"started\n")
    start = time.monotonic()
    r = run(io_for(pipes, proc, kill_grace_s=0.1), timeout_s=0.3)
    assert r.timed_out and r.killed and not r.idle_timed_out and proc.kills == 1
    assert r.stdout.text == "started\n"
    assert time.monotonic() - start < 5
    proc.close()


def test_idle_timeout_fires_after_silence_not_during_output(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess()
    stop = threading.Event()

    def chatter() -> None:
        for _ in range(8):  # output every 50 ms for 0.4 s: never 0.2 s of silence
            if stop.is_set():
                return
            os.write(pipes["out_w"], b".")
            time.sleep(0.05)

    t = threading.Thread(target=chatter)
    t.start()
    r = run(io_for(pipes, proc, kill_grace_s=0.1), idle_timeout_s=0.25, timeout_s=10)
    stop.set()
    t.join()
    assert r.idle_timed_out and not r.timed_out and r.killed
    assert r.stdout.text == "." * 8, "it fired while output was still flowing"
    proc.close()


def test_the_earlier_of_deadline_and_idle_timeout_wins(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess()
    r = run(io_for(pipes, proc, kill_grace_s=0.05), idle_timeout_s=5.0, timeout_s=0.2)
    assert r.timed_out and not r.idle_timed_out
    proc2 = ScriptedProcess()
    r2 = run(io_for(pipes, proc2, kill_grace_s=0.05), idle_timeout_s=0.2, timeout_s=5.0)
    assert r2.idle_timed_out and not r2.timed_out
    proc.close()
    proc2.close()


def test_a_grandchild_holding_the_pipes_cannot_hold_the_caller(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess()
    os.write(pipes["out_w"], b"done\n")
    later(0.05, proc.exit)  # the command exits; its writers (a grandchild) stay open
    start = time.monotonic()
    r = run(io_for(pipes, proc, exit_grace_s=0.2))
    assert r.exited and not r.killed and r.stdout.text == "done\n"
    assert time.monotonic() - start < 3, "the loop waited for the grandchild"
    proc.close()


def test_a_kill_that_does_not_take_still_ends_the_loop(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess(dies_on_kill=False)
    r = run(io_for(pipes, proc, kill_grace_s=0.1), timeout_s=0.1)
    assert r.timed_out and r.killed and not r.exited
    proc.close()


def test_exit_is_polled_when_the_transport_has_no_exit_fd(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess(with_exit_fd=False)

    def finish() -> None:
        close_writers(pipes)
        proc.exited = True

    later(0.05, finish)
    r = run(io_for(pipes, proc))
    assert r.exited and not r.killed
    proc.close()


def test_secrets_are_redacted_across_chunk_boundaries(pipes: dict[str, int]) -> None:
    secret = b"hunter2-" + b"x" * 40
    proc = ScriptedProcess()
    forwarded: list[bytes] = []

    def write() -> None:
        os.write(pipes["out_w"], b"token=" + secret[:10])
        time.sleep(0.05)  # the value arrives in two reads
        os.write(pipes["out_w"], secret[10:] + b" end")
        close_writers(pipes)
        proc.exit()

    t = threading.Thread(target=write)
    t.start()
    r = run(
        io_for(pipes, proc),
        redactor=Redactor({"API_TOKEN": bytearray(secret)}),
        on_stdout=forwarded.append,
    )
    t.join()
    assert "hunter2" not in r.stdout.text and "[REDACTED:API_TOKEN]" in r.stdout.text
    assert secret not in b"".join(forwarded) and b"[REDACTED:API_TOKEN]" in b"".join(forwarded)
    proc.close()


def test_a_flood_keeps_head_and_tail_in_bounded_memory(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess()

    def flood() -> None:
        os.write(pipes["out_w"], b"HEAD")
        for _ in range(200):
            os.write(pipes["out_w"], b"m" * 4096)
        os.write(pipes["out_w"], b"TAIL")
        close_writers(pipes)
        proc.exit()

    t = threading.Thread(target=flood)
    t.start()
    r = run(io_for(pipes, proc), max_output_bytes=256)
    t.join()
    assert (
        r.stdout.truncated and r.stdout.text.startswith("HEAD") and r.stdout.text.endswith("TAIL")
    )
    assert r.stdout.dropped_bytes == 200 * 4096 + 8 - 256
    assert r.output_bytes[STDOUT] == 200 * 4096 + 8
    proc.close()


def test_stdin_larger_than_a_pipe_is_fed_without_blocking(pipes: dict[str, int]) -> None:
    in_r, in_w = os.pipe()
    proc = ScriptedProcess()
    data = os.urandom(1 << 20)  # 16x a pipe's buffer
    received: list[bytes] = []

    def reader() -> None:
        while chunk := os.read(in_r, 65536):
            received.append(chunk)
        close_writers(pipes)
        proc.exit()

    t = threading.Thread(target=reader)
    t.start()
    r = run(io_for(pipes, proc, stdin=PipeSink(in_w), stdin_data=data))
    t.join()
    os.close(in_r)
    assert b"".join(received) == data and r.exited


def test_a_command_that_stops_reading_stdin_does_not_hang_the_feed(pipes: dict[str, int]) -> None:
    in_r, in_w = os.pipe()
    proc = ScriptedProcess()
    os.close(in_r)  # the command never reads its stdin (EPIPE for us)
    later(0.1, lambda: (close_writers(pipes), proc.exit()))
    r = run(io_for(pipes, proc, stdin=PipeSink(in_w), stdin_data=b"x" * (1 << 20)))
    assert r.exited and not r.killed


def test_one_socket_for_stdin_and_output(pipes: dict[str, int]) -> None:
    ours, theirs = socket.socketpair()
    proc = ScriptedProcess()
    src = SocketSource(ours)

    def remote() -> None:
        got = b""
        while chunk := theirs.recv(65536):  # until our SHUT_WR: stdin's EOF
            got += chunk
        theirs.sendall(bytes([STDOUT]) + b"echo:" + got)
        time.sleep(0.05)
        theirs.sendall(bytes([STDERR]) + b"bye")
        theirs.close()
        proc.exit()

    t = threading.Thread(target=remote)
    t.start()
    r = run(ExecIO(sources=[src], process=proc, stdin=src, stdin_data=b"hello"))
    t.join()
    ours.close()
    assert r.stdout.text == "echo:hello" and r.stderr.text == "bye" and r.exited


def test_sample_is_called_while_the_command_runs(pipes: dict[str, int]) -> None:
    proc = ScriptedProcess()
    samples: list[float] = []
    later(0.3, lambda: (close_writers(pipes), proc.exit()))
    run(
        io_for(pipes, proc, sample=lambda: samples.append(time.monotonic())), sample_interval_s=0.05
    )
    assert len(samples) >= 3


def test_stdin_streams_from_a_file_after_the_bytes(pipes: dict[str, int], tmp_path: object) -> None:
    import io as _io

    in_r, in_w = os.pipe()
    proc = ScriptedProcess()
    received: list[bytes] = []

    def reader() -> None:
        while chunk := os.read(in_r, 65536):
            received.append(chunk)
        close_writers(pipes)
        proc.exit()

    t = threading.Thread(target=reader)
    t.start()
    spool = _io.BytesIO(b"f" * 300_000)
    run(io_for(pipes, proc, stdin=PipeSink(in_w), stdin_data=b"head:", stdin_file=spool))
    t.join()
    os.close(in_r)
    assert b"".join(received) == b"head:" + b"f" * 300_000
