"""Running the server: stdio or streamable HTTP, and the cleanup that destroys every
sandbox it made before the process exits (stdin EOF, SIGTERM, SIGINT, or any error)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.to_thread
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import DEFAULT_SESSION_IDLE_TIMEOUT

from devs_sandbox.config import DevsConfig
from devs_sandbox.errors import ConfigError
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.mcp_server.auth import (
    SERVER_NAME,
    BearerTokenAuth,
    is_loopback,
    transport_security,
)
from devs_sandbox.mcp_server.server import DevsMcpServer
from devs_sandbox.store import ViolationStore
from devs_sandbox.tools.sessions import SandboxSessions

logger = logging.getLogger(__name__)

DEFAULT_HTTP_HOST: Final = "127.0.0.1"
DEFAULT_HTTP_PORT: Final = 8000  # the SDK's default
HTTP_PATH: Final = "/mcp"
# uvicorn waits for open requests before it stops; a tool call may run for minutes, so cut
# them short and let the cancelled calls kill their sandboxes.
HTTP_GRACEFUL_SHUTDOWN_S: Final = 2.0
# After SIGTERM/SIGINT the sandboxes are destroyed first; the stdio transport may then
# still sit in a blocking read of stdin (anyio cannot abandon it), so exit after this.
SIGNAL_EXIT_GRACE_S: Final = 1.0


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
        transport_security=transport_security(host),
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
