"""An exec over the Kubernetes exec API, as the shared exec loop (``exec_io``) sees it.

Why not the client's ``kubernetes.stream``: ``stream()`` swaps ``call_api`` on the shared
ApiClient while it connects (a concurrent API call from our watcher or lease threads would
go out as a WebSocket), ``WSClient.update`` blocks on a partial frame and on TLS records
that ``select`` cannot see, ``returncode`` raises on a missing or non-exit status, and
``read_stdout()`` without a timeout blocks forever. So: the handshake is websocket-client's
(TLS, client certificates, proxies, the auth header from the client's configuration, with a
timeout), then the socket is ours, non-blocking, with a small frame codec:

- channels of ``v5.channel.k8s.io`` (preferred) or ``v4.channel.k8s.io``: 0 stdin, 1 stdout,
  2 stderr, 3 the exec's Status (JSON), 255 close (v5 only: ``[255, 0]`` ends stdin);
- reads take every byte the socket (and the TLS layer) holds, so readiness never hides in
  a TLS buffer; writes go through an outbox flushed whenever the loop touches the channel
  (read, write, poll), so a slow reader never blocks the loop;
- the exit status is what channel 3 says (``parse_status``); a stream that ends without it
  is a lost exec, never exit 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlencode, urlsplit, urlunsplit

from devs_sandbox.drivers import exec_io
from devs_sandbox.errors import DriverError

V5: Final = "v5.channel.k8s.io"
V4: Final = "v4.channel.k8s.io"
STDIN, STDOUT, STDERR, STATUS, CLOSE = 0, 1, 2, 3, 255
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
MAX_STDIN_FRAME: Final = 65_536
OUTBOX_HIGH_WATER: Final = 1 << 20  # stdin buffered ahead of the socket before we push back
RECV_ROUNDS: Final = 64  # reads per call before the loop gets a turn (fairness under floods)


# -- status ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ExecStatus:
    """What channel 3 said: ``code`` is the exit status, None when there was no usable
    status (missing, malformed, or an error of the runtime rather than of the command)."""

    code: int | None
    reason: str = ""
    message: str = ""

    @property
    def lost(self) -> bool:
        return self.code is None


def parse_status(payload: bytes | None) -> ExecStatus:
    """A ``metav1.Status`` from the exec's error channel (kubelet's remotecommand)."""
    if not payload:
        return ExecStatus(None, "Missing", "the exec stream ended without an exit status")
    try:
        status = json.loads(payload)
    except ValueError:
        return ExecStatus(None, "Malformed", payload[:200].decode("utf-8", "replace"))
    if not isinstance(status, dict):
        return ExecStatus(None, "Malformed", str(status)[:200])
    if status.get("status") == "Success":
        return ExecStatus(0, "Success")
    reason = str(status.get("reason") or "")
    message = str(status.get("message") or "")
    if reason == "NonZeroExitCode":
        causes = (status.get("details") or {}).get("causes") or []
        for cause in causes:
            if isinstance(cause, dict) and cause.get("reason") == "ExitCode":
                with contextlib.suppress(TypeError, ValueError):
                    code = int(str(cause.get("message")))
                    if 0 <= code <= 255:
                        return ExecStatus(code, reason, message)
        return ExecStatus(None, "Malformed", message or "a NonZeroExitCode without its code")
    return ExecStatus(None, reason or "Failure", message)


# -- frames ---------------------------------------------------------------------------------
class FrameDecoder:
    """Server-to-client WebSocket frames (RFC 6455: unmasked), whole messages out."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self._message = bytearray()
        self._opcode: int | None = None

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self.buf += data
        out: list[tuple[int, bytes]] = []
        while True:
            frame = self._next()
            if frame is None:
                return out
            fin, opcode, payload = frame
            if opcode >= OP_CLOSE:  # control frames are never fragmented
                out.append((opcode, payload))
            elif opcode == OP_CONT:
                if self._opcode is None:
                    raise DriverError("exec stream: a continuation frame without a message")
                self._message += payload
                if fin:
                    out.append((self._opcode, bytes(self._message)))
                    self._message.clear()
                    self._opcode = None
            elif fin:
                out.append((opcode, payload))
            else:
                self._opcode = opcode
                self._message = bytearray(payload)

    def _next(self) -> tuple[bool, int, bytes] | None:
        buf = self.buf
        if len(buf) < 2:
            return None
        fin, opcode, masked, size = buf[0] & 0x80, buf[0] & 0x0F, buf[1] & 0x80, buf[1] & 0x7F
        at = 2
        if size == 126:
            if len(buf) < 4:
                return None
            size, at = int.from_bytes(buf[2:4], "big"), 4
        elif size == 127:
            if len(buf) < 10:
                return None
            size, at = int.from_bytes(buf[2:10], "big"), 10
        key = b""
        if masked:
            if len(buf) < at + 4:
                return None
            key, at = bytes(buf[at : at + 4]), at + 4
        if len(buf) < at + size:
            return None
        payload = bytes(buf[at : at + size])
        del buf[: at + size]
        if key:
            payload = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
        return bool(fin), opcode, payload


def encode_frame(opcode: int, payload: bytes) -> bytes:
    """A client frame: FIN, masked (RFC 6455 requires clients to mask)."""
    size = len(payload)
    if size < 126:
        head = bytes([0x80 | opcode, 0x80 | size])
    elif size < 1 << 16:
        head = bytes([0x80 | opcode, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + size.to_bytes(8, "big")
    key = os.urandom(4)
    if payload:
        word = int.from_bytes(key * (size // 4 + 1), "little") & ((1 << (8 * size)) - 1)
        masked = (int.from_bytes(payload, "little") ^ word).to_bytes(size, "little")
    else:
        masked = b""
    return head + key + masked


# -- the connection -------------------------------------------------------------------------
def exec_url(host: str, namespace: str, pod: str, container: str, argv: Sequence[str]) -> str:
    parts = urlsplit(host)
    scheme = {"https": "wss", "http": "ws"}.get(parts.scheme, parts.scheme)
    query = [("command", a) for a in argv]
    query += [("container", container), ("stdin", "true"), ("stdout", "true")]
    query += [("stderr", "true"), ("tty", "false")]
    path = f"{parts.path.rstrip('/')}/api/v1/namespaces/{namespace}/pods/{pod}/exec"
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))


def _ssl_options(configuration: Any) -> dict[str, Any]:
    if not configuration.verify_ssl:
        return {"cert_reqs": ssl.CERT_NONE, "check_hostname": False}
    opts: dict[str, Any] = {"cert_reqs": ssl.CERT_REQUIRED}
    if configuration.ssl_ca_cert:
        opts["ca_certs"] = configuration.ssl_ca_cert
    if configuration.cert_file:
        opts["certfile"] = configuration.cert_file
    if configuration.key_file:
        opts["keyfile"] = configuration.key_file
    if getattr(configuration, "tls_server_name", None):
        opts["server_hostname"] = configuration.tls_server_name
    if getattr(configuration, "assert_hostname", None) is False:
        opts["check_hostname"] = False
    return opts


def _auth_headers(configuration: Any) -> list[str]:
    """The client's own auth headers (bearer token, refreshed by its hook if it has one)."""
    headers: list[str] = []
    for setting in (configuration.auth_settings() or {}).values():
        if setting.get("in") == "header" and setting.get("value"):
            headers.append(f"{setting['key']}: {setting['value']}")
    return headers


class HandshakeError(DriverError):
    """The server refused the exec (``status``: 400 pod not running, 403, 404, ...)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


class ExecChannel:
    """One exec's WebSocket: its output source, stdin sink and status, for ``exec_io``."""

    def __init__(self, sock: socket.socket, protocol: str, keep: Any = None) -> None:
        self.sock = sock
        self.protocol = protocol
        self._keep = keep  # the websocket-client object that made the handshake
        self._decoder = FrameDecoder()
        self._outbox = bytearray()
        self._status = bytearray()
        self.status_seen = False
        self.eof = False  # nothing more to read
        self._broken = False  # nothing more can be written
        self._closed_stdin = False
        sock.setblocking(False)
        pending = sock.pending() if isinstance(sock, ssl.SSLSocket) else 0
        self._early = self._decoder.feed(sock.recv(pending)) if pending else []

    @classmethod
    def connect(cls, configuration: Any, url: str, timeout_s: float) -> ExecChannel:
        import websocket  # noqa: PLC0415 - a dependency of the kubernetes extra

        ws: Any = websocket.WebSocket(sslopt=_ssl_options(configuration), skip_utf8_validation=True)
        options: dict[str, Any] = {
            "header": _auth_headers(configuration),
            "subprotocols": [V5, V4],
            "timeout": timeout_s,
        }
        if configuration.proxy:
            proxy = urlsplit(configuration.proxy)
            options["http_proxy_host"] = proxy.hostname
            options["http_proxy_port"] = proxy.port
            options["proxy_type"] = "http"
            if configuration.no_proxy:
                options["http_no_proxy"] = configuration.no_proxy.split(",")
        try:
            ws.connect(url, **options)
        except websocket.WebSocketBadStatusException as exc:
            body = exc.resp_body or b""
            message = _status_message(body) or str(exc)
            raise HandshakeError(
                f"exec refused ({exc.status_code}): {message}", exc.status_code
            ) from exc
        except (OSError, websocket.WebSocketException) as exc:
            raise HandshakeError(f"cannot open the exec stream: {exc}", None) from exc
        protocol = (ws.subprotocol or "").lower()
        if protocol not in (V5, V4):
            ws.close()
            raise HandshakeError(f"the server chose exec protocol {protocol!r}", None)
        return cls(ws.sock, protocol, ws)

    @property
    def can_close_stdin(self) -> bool:
        return self.protocol == V5

    # -- exec_io.OutputSource ----------------------------------------------------------
    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[tuple[int, bytes]] | None:
        self.flush()
        if self.eof:
            return None
        messages, self._early = self._early, []
        for _ in range(RECV_ROUNDS):
            try:
                data = self.sock.recv(exec_io.READ_CHUNK)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except OSError:
                self.eof = self._broken = True
                break
            if not data:
                self.eof = True
                break
            messages += self._decoder.feed(data)
        frames = self._take(messages)
        self.flush()
        if self.eof and not frames:
            return None
        return frames

    def _take(self, messages: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        frames: list[tuple[int, bytes]] = []
        for opcode, payload in messages:
            if opcode == OP_CLOSE:
                if not self.eof:
                    self._outbox += encode_frame(OP_CLOSE, payload[:2])
                self.eof = True
            elif opcode == OP_PING:
                self._outbox += encode_frame(OP_PONG, payload)
            elif opcode in (OP_BINARY, OP_TEXT) and payload:
                channel, data = payload[0], payload[1:]
                if channel in (STDOUT, STDERR) and data:
                    frames.append((channel, data))
                elif channel == STATUS:
                    self._status += data
                    self.status_seen = True
        return frames

    def finish(self) -> list[tuple[int, bytes]]:
        return []

    # -- exec_io.InputSink ---------------------------------------------------------------
    def send_stdin(self, data: bytes) -> None:
        """Queue ``data`` on channel 0 (the header, before the loop starts)."""
        for at in range(0, len(data), MAX_STDIN_FRAME):
            self._outbox += encode_frame(
                OP_BINARY, bytes([STDIN]) + data[at : at + MAX_STDIN_FRAME]
            )
        self.flush()

    def write(self, data: memoryview) -> int:
        self.flush()
        if len(self._outbox) > OUTBOX_HIGH_WATER:
            raise BlockingIOError
        chunk = bytes(data[:MAX_STDIN_FRAME])
        self.send_stdin(chunk)
        return len(chunk)

    def close(self) -> None:
        """End of the command's stdin (v5: ``[255, 0]``; v4 has no way, see the shim)."""
        if not self._closed_stdin and self.can_close_stdin and not self.eof:
            self._outbox += encode_frame(OP_BINARY, bytes([CLOSE, STDIN]))
        self._closed_stdin = True
        self.flush()

    def flush(self) -> None:
        while self._outbox and not self._broken:
            try:
                sent = self.sock.send(self._outbox)
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return
            except OSError:
                self._broken = self.eof = True
                break
            del self._outbox[:sent]
        if self._broken:
            self._outbox.clear()

    # -- the end ------------------------------------------------------------------------
    @property
    def status(self) -> ExecStatus:
        return parse_status(bytes(self._status) if self.status_seen else None)

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        self._keep = None


def _status_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body[:300].decode("utf-8", "replace").strip()
    return str(data.get("message") or "") if isinstance(data, dict) else ""
