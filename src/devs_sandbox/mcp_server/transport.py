"""Serving it: stdio, or streamable HTTP with a bearer token and DNS-rebinding checks;
every sandbox is destroyed when the server stops."""

import contextlib
import hmac
import ipaddress
import logging
import math
import os
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import DEFAULT_SESSION_IDLE_TIMEOUT
from mcp.server.transport_security import TransportSecuritySettings

from devs_sandbox.config import (
    DevsConfig,
)
from devs_sandbox.errors import (
    ConfigError,
)
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.mcp_server.constants import (
    DEFAULT_HTTP_HOST,
    DEFAULT_HTTP_PORT,
    HTTP_GRACEFUL_SHUTDOWN_S,
    HTTP_PATH,
    MAX_TOKEN_FILE_BYTES,
    MIN_TOKEN_CHARS,
    SERVER_NAME,
    SIGNAL_EXIT_GRACE_S,
)
from devs_sandbox.mcp_server.server import DevsMcpServer
from devs_sandbox.store import ViolationStore
from devs_sandbox.tools.sessions import SandboxSessions

logger = logging.getLogger(__name__)


# -- HTTP: who may connect ----------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine: ``localhost`` or a loopback
    address. A name, ``0.0.0.0``, ``::`` or any other address is reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def read_auth_token(path: Path) -> str:
    """The bearer token in ``path``, read once at start.

    Refused, with one line naming the file: a file group or others may access (as ssh
    does for a private key), one owned by someone else than us or root, not a regular
    file, over ``MAX_TOKEN_FILE_BYTES``, or a token (the file less its trailing newline)
    that is empty, shorter than ``MIN_TOKEN_CHARS`` or not printable ASCII without spaces
    (the characters an ``Authorization: Bearer`` header carries).
    """
    key = "--auth-token-file"
    try:
        with path.open("rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"token file {path} is not a regular file", key=key)
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"token file {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or "
                    f"others may access it; run chmod 600 {path}",
                    key=key,
                )
            if st.st_uid not in {os.geteuid(), 0}:
                raise ConfigError(
                    f"token file {path} belongs to uid {st.st_uid}, neither this user nor root",
                    key=key,
                )
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc.strerror}", key=key) from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise ConfigError(
            f"token file {path} is over {MAX_TOKEN_FILE_BYTES} bytes: not a token", key=key
        )
    token = raw.decode("latin-1").rstrip("\r\n")
    if not token:
        raise ConfigError(f"token file {path} is empty", key=key)
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(
            f"the token in {path} must be printable ASCII without spaces (one line)", key=key
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"the token in {path} has {len(token)} characters; use at least "
            f"{MIN_TOKEN_CHARS} (e.g. openssl rand -hex 32 > {path})",
            key=key,
        )
    return token


class BearerTokenAuth:
    """ASGI middleware: an HTTP request runs only with ``Authorization: Bearer <token>``.

    Anything else (no header, another scheme, a wrong token, the header twice) is
    answered 401 with ``WWW-Authenticate: Bearer`` (RFC 6750) before the MCP app sees it,
    so no session opens and no tool runs. The comparison takes the same time wherever
    the tokens differ (``hmac.compare_digest``). The lifespan passes through; a WebSocket
    (the MCP app serves none) is closed.
    """

    def __init__(self, app: Any, token: str) -> None:
        self._app = app
        self._token = token.encode("ascii")

    def _authorized(self, scope: dict[str, Any]) -> bool:
        values = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, credentials = bytes(values[0]).strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(credentials.strip(), self._token)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in {"http", "websocket"} or self._authorized(scope):
            await self._app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        logger.debug("refused an HTTP request without the bearer token")
        body = b'{"error": "unauthorized", "error_description": "bearer token required"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", f'Bearer realm="{SERVER_NAME}"'.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _transport_security(host: str) -> TransportSecuritySettings | None:
    """The SDK's DNS-rebinding protection (Host and Origin must name this machine) for a
    loopback bind, the one a web page in the user's browser could otherwise reach under
    a name it rebinds to 127.0.0.1; the SDK turns it on by itself only for three spellings
    of loopback. A non-loopback bind requires a bearer token, which such a page lacks."""
    if not is_loopback(host):
        return None
    names = {"127.0.0.1", "localhost", "[::1]", f"[{host}]" if ":" in host else host}
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"{n}:*" for n in sorted(names)],
        allowed_origins=[f"http://{n}:*" for n in sorted(names)],
    )


# -- running it -------------------------------------------------------------------------------
async def _serve_stdio(server: Server[Any], cleanup: Callable[[], None]) -> int:
    """Serve until stdin closes (status 0) or a signal arrives (128 + N).

    On a signal the sandboxes are destroyed first, then the server is cancelled; if the
    transport's blocking stdin read keeps the loop from finishing, the process exits
    anyway after ``SIGNAL_EXIT_GRACE_S``: nothing is left to clean up by then.
    """
    from mcp.server.stdio import stdio_server  # noqa: PLC0415 - stdio only

    status = 0
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            nonlocal status
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    status = 128 + signum
                    logger.info("signal %d: destroying every sandbox, then stopping", signum)
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(cleanup)
                    _exit_later(status, SIGNAL_EXIT_GRACE_S)
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(on_signal)
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())
        tg.cancel_scope.cancel()
    return status


def _exit_later(status: int, delay_s: float) -> None:
    def bail() -> None:
        logging.shutdown()
        os._exit(status)

    timer = threading.Timer(delay_s, bail)
    timer.daemon = True
    timer.start()


async def _serve_http(
    server: Server[Any], host: str, port: int, token: str | None, session_idle_timeout_s: float
) -> int:
    import uvicorn  # noqa: PLC0415 - a dependency of mcp, needed for HTTP only

    app = server.streamable_http_app(
        streamable_http_path=HTTP_PATH,
        host=host,
        transport_security=_transport_security(host),
        # An MCP session that expires takes its sandboxes along: not before they would
        # have expired on their own (mcp.sessionIdleTimeoutS).
        session_idle_timeout=max(DEFAULT_SESSION_IDLE_TIMEOUT, session_idle_timeout_s),
    )
    config = uvicorn.Config(
        BearerTokenAuth(app, token) if token is not None else app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=math.ceil(HTTP_GRACEFUL_SHUTDOWN_S),
    )
    where = f"[{host}]" if ":" in host else host
    auth = "a bearer token" if token is not None else "no authentication (loopback only)"
    print(
        f"{SERVER_NAME}: serving MCP over streamable HTTP at http://{where}:{port}{HTTP_PATH} "
        f"with {auth}",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn owns SIGINT/SIGTERM here: it stops gracefully, then re-raises the signal,
    # which unwinds through serve()'s finally like any other exit.
    await uvicorn.Server(config).serve()
    return 0


@contextlib.contextmanager
def _ignore_signals() -> Iterator[None]:
    """A second Ctrl-C must not abort the cleanup that destroys the sandboxes."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def serve(
    config: DevsConfig,
    *,
    db_path: Path,
    http: bool = False,
    host: str = DEFAULT_HTTP_HOST,
    port: int = DEFAULT_HTTP_PORT,
    auth_token: str | None = None,
) -> int:
    """Run the server until its transport ends; destroy every sandbox it made; return the
    exit status (0, or 128 + N after signal N).

    Over HTTP every MCP session is a tenant of its own, and ``auth_token`` (required by the
    CLI for a non-loopback ``host``) must come with every request.
    """
    if http and auth_token is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve {host} without --auth-token-file: anyone who can reach it "
            "could run commands on this host",
            key="--auth-token-file",
        )
    manager = SandboxLifecycleManager(config=config, store=ViolationStore(db_path))
    sessions = SandboxSessions.from_config(manager, config.mcp)
    app = DevsMcpServer(config, manager, sessions, multi_tenant=http)
    done = False

    def cleanup() -> None:
        nonlocal done
        if done:
            return
        done = True
        try:
            # One-shot runs still in flight end as cancelled runs (their threads then skip
            # the final quota check of a sandbox that is about to disappear).
            for sandbox in manager.live_sandboxes():
                manager.cancel(sandbox.id)
            sessions.close()
        finally:
            manager.shutdown()

    try:
        if http:
            return anyio.run(
                _serve_http,
                app.server(),
                host,
                port,
                auth_token,
                config.mcp.session_idle_timeout_s,
            )
        return anyio.run(_serve_stdio, app.server(), cleanup)
    finally:
        with _ignore_signals():
            cleanup()
