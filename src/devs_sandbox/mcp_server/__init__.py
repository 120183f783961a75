"""The MCP server: agents reach devs-sandbox as tools, over stdio or streamable HTTP.

The only package that imports the MCP SDK (``mcp``; its 2.x line renamed ``FastMCP`` to
``MCPServer`` and moved the wire types to ``mcp_types``: that churn stays here). It is a
thin shell over the library: ``run_shell_monitored`` for one-shot commands,
``SandboxSessions`` for sandboxes kept between calls, the violation store for the audit
trail, and ``DevsConfig.mcp`` for every default.

Tools (REQ: 3_MCP-REQ-SEC-002, every command runs monitored):

- ``run_shell_monitored {command, timeout_s?, rss_limit_bytes?, cpu_sustained_ms?,
  poll_interval_ms?}``: a fresh sandbox per call (``run_tools``);
- ``sandbox_create {quotas?}``, ``sandbox_exec {sandbox_id, command, ...}``,
  ``sandbox_destroy {sandbox_id}``: a sandbox whose workspace persists between calls;
  ``sandbox_violations {limit?, sandbox_id?}``: recent rows of the store
  (``session_tools``).

Modules, one concern each: ``schemas`` (arguments, outputs, listings), ``results`` (every
answer and error as a ``CallToolResult``), ``tenancy`` (who a call acts for), ``auth``
(bearer token, loopback rule, DNS rebinding), ``server`` (the registry and the SDK's
``Server``), ``app`` (stdio/HTTP and the cleanup at exit).

Tenancy over HTTP (``serve(http=True)``): every sandbox a call makes belongs to the MCP
session of that call. Another session's ``sandbox_exec``/``sandbox_destroy`` on it is
answered exactly as for an id that never existed; ``sandbox_violations`` lists the
caller's own sandboxes' rows only; the session's sandboxes are destroyed when the session
ends (the client's DELETE, the SDK's idle expiry, the server stopping). A request without
a session (the sessionless 2026-07-28 protocol) may run ``run_shell_monitored`` only, and
``server/discover`` advertises the handshake versions alone, so the SDK's ``mode='auto'``
clients open a session. ``--auth-token-file`` adds a bearer token to every request
(``BearerTokenAuth``); a loopback bind gets the SDK's Host/Origin checks against DNS
rebinding. Over stdio there is one client: it owns everything and sees the whole store.

Invariants: a tool call never crashes the server nor sends a traceback to the client (a
bug of ours is logged on stderr and answered "internal error"); no handler blocks the
event loop (sandbox work runs through ``aio.run_blocking``, which turns a cancelled call
into a kill); a multi-tenant call whose session cannot be told is refused, never run as
someone else's; when the server stops (stdin EOF, SIGTERM, SIGINT) every sandbox it made
is destroyed before the process exits.
"""

from __future__ import annotations

from devs_sandbox.mcp_server.app import DEFAULT_HTTP_HOST, DEFAULT_HTTP_PORT, HTTP_PATH, serve
from devs_sandbox.mcp_server.auth import (
    MIN_TOKEN_CHARS,
    SERVER_NAME,
    BearerTokenAuth,
    is_loopback,
    read_auth_token,
)
from devs_sandbox.mcp_server.results import ToolCallError
from devs_sandbox.mcp_server.server import DevsMcpServer
from devs_sandbox.mcp_server.tenancy import LOCAL_CALLER, Caller

__all__ = [
    "DEFAULT_HTTP_HOST",
    "DEFAULT_HTTP_PORT",
    "HTTP_PATH",
    "LOCAL_CALLER",
    "MIN_TOKEN_CHARS",
    "SERVER_NAME",
    "BearerTokenAuth",
    "Caller",
    "DevsMcpServer",
    "ToolCallError",
    "is_loopback",
    "read_auth_token",
    "serve",
]
