"""How a command reaches a container and its output comes back.

The container's main process is a small shell (``LAUNCHER``) that serves one request on
its stdin: a nonce and a POSIX-quoted command. It forks a subshell that waits for "go",
and when the command ends writes ``\\0devs-exit:<nonce>:<status>\\0`` on stdout and
stderr. Every other exec is a ``docker exec`` of the shared shim. Either way the output
arrives on the engine's multiplexed attach stream, which ``AttachStream`` reads for the
shared exec loop, less the launcher's trailers.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any, Final

from devs_sandbox.drivers import exec_io
from devs_sandbox.errors import DriverError

CD_SHIM: Final = 'cd -- "$0" || exit 1; exec "$@"'

# The container's main process, under docker-init. It serves at most one request and
# then holds the container up: stdin stays open (StdinOnce false) after we detach. The
# request is "<nonce> <sh snippet>"; $N is a newline for arguments that contain one.
LAUNCHER: Final = r"""N='
'
IFS=' ' read -r nonce cmd || exit 0
( IFS= read -r _ || exit 125; eval "$cmd" )
st=$?
printf '\000devs-exit:%s:%03d\000' "$nonce" "$st"
printf '\000devs-exit:%s:%03d\000' "$nonce" "$st" >&2
while IFS= read -r _; do :; done
"""
LAUNCHER_NAME: Final = "devs-sandbox-launcher"
_TRAILER_TAG: Final = b"\0devs-exit:"
_TRAILER_STATUS_LEN: Final = 4  # three digits and the closing NUL


def sh_quote(text: str) -> str:
    """POSIX single quotes, with newlines spliced in from $N so a request stays one line."""
    return "'" + text.replace("'", "'\"'\"'").replace("\n", "'\"$N\"'") + "'"


def launcher_request(
    nonce: str, argv: Sequence[str], env: Mapping[str, str], prelude: str | None = None
) -> bytes:
    """The one line the launcher reads: ``<nonce> [prelude;] export ...; unset PWD; exec
    ARGV`` (``prelude``: the secrets' writer on a sandbox's first exec)."""
    parts: list[str] = [prelude] if prelude else []
    if env:
        parts.append("export " + " ".join(f"{k}={sh_quote(v)}" for k, v in env.items()))
    parts.append("unset PWD")
    parts.append("exec " + " ".join(sh_quote(a) for a in argv) + " </dev/null")
    return f"{nonce} {'; '.join(parts)}\n".encode("utf-8", "surrogateescape")


class Trailer:
    """Finds the launcher's end marker in one stream, holding back only what could be its
    beginning, so output without NUL bytes is never delayed."""

    __slots__ = ("done", "pending", "prefix", "status")

    def __init__(self, nonce: str) -> None:
        self.prefix = _TRAILER_TAG + nonce.encode() + b":"
        self.pending = b""
        self.done = False
        self.status: int | None = None

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return b""
        buf = self.pending + data
        self.pending = b""
        at = buf.find(self.prefix)
        if at >= 0:
            end = at + len(self.prefix) + _TRAILER_STATUS_LEN
            if len(buf) >= end:
                digits = buf[at + len(self.prefix) : end - 1]
                self.status = int(digits) if digits.isdigit() else None
                self.done = True
            else:
                self.pending = buf[at:]
            return buf[:at]
        keep = 0
        if b"\0" in buf[-len(self.prefix) :]:
            for k in range(min(len(buf), len(self.prefix) - 1), 0, -1):
                if buf.endswith(self.prefix[:k]):
                    keep = k
                    break
        if keep:
            self.pending = buf[-keep:]
            return buf[:-keep]
        return buf

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest


class Demux:
    """Docker's multiplexed stream (no tty): 8-byte header [stream, 0, 0, 0, size BE] + payload."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buf += data
        frames: list[tuple[int, bytes]] = []
        while len(self.buf) >= 8:
            size = int.from_bytes(self.buf[4:8], "big")
            if len(self.buf) < 8 + size:
                break
            frames.append((self.buf[0], bytes(self.buf[8 : 8 + size])))
            del self.buf[: 8 + size]
        return frames


class AttachStream:
    """An exec's attach socket as the shared loop sees it: Docker's multiplexed frames,
    less the launcher's trailers (which carry the exit status), both directions."""

    def __init__(self, sock: socket.socket, nonce: str | None) -> None:
        self.sock = sock
        self.demux = Demux()
        self.trailers = {1: Trailer(nonce), 2: Trailer(nonce)} if nonce else None
        self.eof = False

    @property
    def done(self) -> bool:
        """The command's output is complete: both trailers seen, or the socket closed."""
        return self.eof or (
            self.trailers is not None and all(t.done for t in self.trailers.values())
        )

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[tuple[int, bytes]] | None:
        data = self.sock.recv(exec_io.READ_CHUNK)
        if not data:
            self.eof = True
            return None
        frames: list[tuple[int, bytes]] = []
        for stream, frame in self.demux.feed(data):
            if stream not in (1, 2):
                continue
            frames.append((stream, self.trailers[stream].feed(frame) if self.trailers else frame))
        if self.done:
            return frames or None
        return frames

    def finish(self) -> list[tuple[int, bytes]]:
        if self.trailers is None:
            return []
        return [(s, t.flush()) for s, t in self.trailers.items() if not t.done]

    def write(self, data: memoryview) -> int:
        return self.sock.send(data)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)  # EOF on the command's stdin


def raw_socket(obj: Any) -> socket.socket:
    """The socket under the SDK's hijacked response (SocketIO for unix, SSLSocket for TLS)."""
    sock = getattr(obj, "_sock", obj)
    if not isinstance(sock, socket.socket):
        raise DriverError(
            f"the docker driver needs a socket connection to the engine, got {type(obj).__name__}"
        )
    return sock
