"""The local server behind ``devs-sandbox run``'s fast path (the client is ``cli/fast.py``).

One per user and per version of the code (the socket's name carries the fingerprint),
started in the background by the first ``run`` that found none, gone after
``IDLE_EXIT_S`` without a request. It keeps the library imported and the host probed, and
runs each request exactly as the command would in a process of its own: the same parser,
the same ``cmd_run``, through a ``Console`` made of the client's arguments, working
directory, environment and file descriptors. It serves only its own uid (SO_PEERCRED),
on a socket in a directory only that uid can enter.

A request's sandbox belongs to the request: a forwarded signal or a client that went away
cancels it, and ``run_in_sandbox`` destroys it. On SIGTERM the server stops accepting,
cancels what runs, and exits once those runs have cleaned up.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import marshal
import os
import selectors
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final

from devs_sandbox.cli.console import EXIT_CANNOT_RUN, PROG, Console, RunInCaller
from devs_sandbox.cli.fast import _FRAME_LEN, HEADER_LIMIT, PROTOCOL, peer_uid

logger = logging.getLogger(__name__)

IDLE_EXIT_S: Final = 300.0  # a server nobody used for five minutes goes away
IDLE_ENV: Final = "DEVS_SANDBOX_DAEMON_IDLE_S"  # another idle time (tests)
REAP_EVERY_S: Final = 60.0  # leftovers of crashed owners, reaped here instead of per request
ACCEPT_POLL_S: Final = 1.0  # how often the accept loop checks idleness and its socket
SHUTDOWN_GRACE_S: Final = 30.0  # on SIGTERM, how long running requests get to clean up
MAX_FDS: Final = 3


class Server:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.active: dict[int, Console] = {}
        self.last_request = time.monotonic()
        self.stopping = threading.Event()
        self.sock: socket.socket | None = None
        self.inode = 0
        self.last_reap = time.monotonic()
        try:
            self.idle_exit_s = float(os.environ.get(IDLE_ENV) or IDLE_EXIT_S)
        except ValueError:
            self.idle_exit_s = IDLE_EXIT_S

    # -- lifetime ---------------------------------------------------------------------------
    def claim(self) -> bool:
        """One server per socket path: the first to lock it; a stale socket file is replaced."""
        lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            return False
        self._lock_fd = lock_fd  # held for the server's life
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        # The pid file before the socket, so whoever sees the socket finds it; whole or
        # absent, never empty: written aside and renamed into place.
        pid_tmp = Path(f"{self.path}.pid.{os.getpid()}")
        pid_tmp.write_text(f"{os.getpid()}\n")
        pid_tmp.replace(self.path + ".pid")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        sock.listen(64)
        self.sock = sock
        self.inode = os.stat(self.path).st_ino
        return True

    def warm(self) -> None:
        """What every run needs, loaded before the first client is accepted: the modules,
        the parser, the host probe, the syscall filter; and this host's leftovers reaped."""
        from devs_sandbox.cli import run  # noqa: F401, PLC0415
        from devs_sandbox.cli.main import _shared_parser  # noqa: PLC0415
        from devs_sandbox.config import SandboxLifecycleConfig  # noqa: PLC0415
        from devs_sandbox.drivers.process import ProcessDriver  # noqa: PLC0415
        from devs_sandbox.isolation import seccomp  # noqa: PLC0415
        from devs_sandbox.lifecycle import SandboxLifecycleManager  # noqa: F401, PLC0415

        _shared_parser()
        driver = ProcessDriver()
        driver.isolation_report(SandboxLifecycleConfig())
        with contextlib.suppress(Exception):
            seccomp.build_bpf(seccomp.Profile(pid_namespace=True))
        self.reap()

    def reap(self) -> None:
        from devs_sandbox.drivers.process import ProcessDriver  # noqa: PLC0415

        with contextlib.suppress(Exception):
            ProcessDriver().reap_orphans()
        self.last_reap = time.monotonic()

    def serve(self) -> None:
        assert self.sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        try:
            while not self.stopping.is_set():
                if sel.select(ACCEPT_POLL_S):
                    try:
                        conn, _ = self.sock.accept()
                    except OSError:
                        continue
                    threading.Thread(target=self.handle, args=(conn,), daemon=True).start()
                    continue
                if self._should_exit():
                    break
                if time.monotonic() - self.last_reap >= REAP_EVERY_S:
                    self.reap()
        finally:
            sel.close()
            self._close()
        self._drain()

    def _should_exit(self) -> bool:
        with self.lock:
            busy = bool(self.active)
            idle = time.monotonic() - self.last_request
        if busy:
            return False
        if idle >= self.idle_exit_s:
            return True
        try:  # our socket was removed or taken over: nobody can reach us any more
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def stop(self) -> None:
        self.stopping.set()
        with self.lock:
            consoles = list(self.active.values())
        for con in consoles:
            _cancel(con)

    def _drain(self) -> None:
        end = time.monotonic() + SHUTDOWN_GRACE_S
        while time.monotonic() < end:
            with self.lock:
                if not self.active:
                    return
            time.sleep(0.05)

    def _close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
                os.unlink(self.path + ".pid")

    # -- one request ------------------------------------------------------------------------
    def handle(self, conn: socket.socket) -> None:
        key = conn.fileno()
        con: Console | None = None
        try:
            if peer_uid(conn) != os.geteuid():
                return
            request, fds = _receive(conn)
            if request is None or len(fds) != MAX_FDS or request.get("protocol") != PROTOCOL:
                for fd in fds:
                    os.close(fd)
                conn.sendall(_frame({"fallback": "malformed request"}))
                return
            con = Console.from_fds(fds[0], fds[1], fds[2], request["env"], Path(request["cwd"]))
            with self.lock:
                self.active[key] = con
                self.last_request = time.monotonic()
            signalled: list[int] = []
            threading.Thread(target=_watch, args=(conn, con, signalled), daemon=True).start()
            try:
                status = _run(request["argv"], con)
            except RunInCaller as exc:
                conn.sendall(_frame({"fallback": str(exc)}))
                return
            if signalled:
                status = 128 + signalled[0]
            with contextlib.suppress(OSError):
                conn.sendall(_frame({"exit": status}))
        except Exception:
            logger.exception("request failed")
            with contextlib.suppress(OSError):
                conn.sendall(_frame({"exit": EXIT_CANNOT_RUN}))
        finally:
            with self.lock:
                self.active.pop(key, None)
                self.last_request = time.monotonic()
            if con is not None:
                con.close()
            conn.close()


def _run(argv: list[str], con: Console) -> int:
    from devs_sandbox.cli.main import main  # noqa: PLC0415

    try:
        return main(argv, console=con)
    except RunInCaller:
        raise
    except BaseException as exc:  # a bug of ours must not take the server down
        with contextlib.suppress(Exception):
            print(f"{PROG}: internal error: {type(exc).__name__}: {exc}", file=con.err)
        return EXIT_CANNOT_RUN


def _cancel(con: Console) -> None:
    for hook in list(con.cancel_hooks):
        with contextlib.suppress(Exception):
            hook()


def _watch(conn: socket.socket, con: Console, signalled: list[int]) -> None:
    """The client's side of a running request: forwarded signals, or the client gone."""
    while True:
        try:
            frame = _read_frame(conn)
        except OSError:
            frame = None
        if frame is None:  # the client went away (or we closed after replying)
            _cancel(con)
            return
        if isinstance(frame, dict) and isinstance(frame.get("signal"), int):
            signalled.append(frame["signal"])
            _cancel(con)


def _frame(obj: dict[str, Any]) -> bytes:
    data = marshal.dumps(obj)
    return len(data).to_bytes(_FRAME_LEN, "big") + data


def _read_frame(conn: socket.socket) -> Any:
    header = _recv_exact(conn, _FRAME_LEN)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > HEADER_LIMIT:
        return None
    body = _recv_exact(conn, size)
    return None if body is None else marshal.loads(body)


def _recv_exact(conn: socket.socket, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = conn.recv(size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _receive(conn: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The request frame and the descriptors that came with its first bytes."""
    fds: list[int] = []
    data, ancdata, _flags, _addr = conn.recvmsg(65536, socket.CMSG_LEN(MAX_FDS * 4))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds += [
                int.from_bytes(payload[i : i + 4], sys.byteorder, signed=True)
                for i in range(0, usable, 4)
            ]
    if len(data) < _FRAME_LEN:
        return None, fds
    size = int.from_bytes(data[:_FRAME_LEN], "big")
    if size > HEADER_LIMIT:
        return None, fds
    body = data[_FRAME_LEN:]
    if len(body) < size:
        rest = _recv_exact(conn, size - len(body))
        if rest is None:
            return None, fds
        body += rest
    request = marshal.loads(body[:size])
    return (request if isinstance(request, dict) else None), fds


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {__name__} SOCKET", file=sys.stderr)
        return 2
    logging.getLogger("devs_sandbox").addHandler(logging.NullHandler())
    server = Server(args[0])
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        server.warm()
    except Exception:
        logger.exception("warming up failed")
        return 1  # no server: clients keep running in-process
    if not server.claim():
        return 0  # another server holds this socket
    server.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
