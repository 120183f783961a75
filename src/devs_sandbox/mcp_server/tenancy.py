"""Who a tool call acts for: one tenant per MCP session over HTTP, one for stdio.

Every sandbox a call makes (``sandbox_create``, and the fresh sandbox of each
``run_shell_monitored``) belongs to the ``Caller.owner`` of that call; ``SandboxSessions``
answers another owner's lookup exactly as for an id that never existed. The tenant of an
HTTP request is read from the SDK's ``Connection`` behind it (``connection_of``); a call
whose session cannot be told is refused, never run as someone else's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from mcp import types
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from devs_sandbox.mcp_server.results import ToolCallError
from devs_sandbox.tools.sessions import DEFAULT_OWNER

CALLER_KEY: Final = "devs_sandbox.caller"  # our entry in the SDK's Connection.state


@dataclass(frozen=True)
class Caller:
    """Whom a tool call acts for.

    ``owner`` tags every sandbox the call makes and is the only key that finds them again
    (``SandboxSessions``); ``session`` is False for a request outside any MCP session,
    which may run one-shot commands only; ``sees_all_rows`` lets ``sandbox_violations``
    show the whole store (the one client of a stdio server is the host's operator).
    """

    owner: str
    session: bool = True
    sees_all_rows: bool = False


LOCAL_CALLER: Final = Caller(DEFAULT_OWNER, sees_all_rows=True)


def session_required(tool: str) -> ToolCallError:
    return ToolCallError(
        f"{tool} needs an MCP session and this request has none (the 2026-07-28 protocol "
        "is sessionless; a sandbox kept between calls belongs to a session): connect with "
        "the initialize handshake, e.g. mcp.Client(url, mode='legacy'); run_shell_monitored "
        "works without one",
        {"error": "session_required"},
    )


def connection_of(ctx: ServerRequestContext[Any]) -> Connection | None:
    """The SDK's per-client ``Connection`` behind a request.

    Its ``session_id`` (the streamable HTTP ``mcp-session-id``), ``state`` and
    ``exit_stack`` (unwound, shielded, whenever the connection ends: the client's DELETE,
    the session's idle expiry, the server stopping) are public API; but mcp 2.3 hands a
    low-level handler no public path to it (the ``Context`` that has ``.connection`` is not
    built by the runner yet, see TODO(L54) in ``mcp.server.runner``), so it is read from
    the per-request ``ServerSession``, which holds it. Anything else there reads as
    unknown, and the multi-tenant server refuses the call.
    """
    connection = getattr(ctx.session, "_connection", None)
    return connection if isinstance(connection, Connection) else None


def advertise_sessions_only(server: Server[Any]) -> None:
    """Answer ``server/discover`` with the handshake protocol versions only.

    A sandbox kept between calls belongs to an MCP session, and the 2026-07-28 protocol has
    none; a ``mode='auto'`` client of the SDK takes a discover result without a modern
    version as a legacy server and opens a session with ``initialize`` (mcp.client._probe),
    as the go-sdk's stateful streamable servers have it. A client pinned to 2026-07-28 still
    gets its answers, sessionless.
    """

    async def discover(
        ctx: ServerRequestContext[Any], params: types.RequestParams
    ) -> types.DiscoverResult:
        del params
        return types.DiscoverResult(
            supported_versions=list(HANDSHAKE_PROTOCOL_VERSIONS),
            capabilities=server.get_capabilities(protocol_version=ctx.protocol_version),
            instructions=server.instructions,
        )

    server.add_request_handler("server/discover", types.RequestParams, discover)
