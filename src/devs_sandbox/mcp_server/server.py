"""``DevsMcpServer``: the tool registry over one manager and one session registry, and the
SDK's low-level ``Server`` that serves it.

Why the low-level ``Server`` rather than ``MCPServer``: the tools' input schemas carry the
configured defaults and the config's bounds, unknown arguments are refused, argument
errors read as one line per field, and every failure is an ``isError`` result built in
one place (``results``). All of that is plain pydantic and ``CallToolResult`` here.

Invariant: ``call`` never raises and never sends a traceback; a bug of ours is logged on
stderr and answered "internal error".
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable
from typing import Any

from mcp import types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from pydantic import ValidationError

from devs_sandbox import __version__
from devs_sandbox.base import ProcessStatsSource, Scheduler
from devs_sandbox.config import DevsConfig, override
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.lifecycle.aio import run_blocking
from devs_sandbox.mcp_server import file_tools, run_tools, session_tools
from devs_sandbox.mcp_server.auth import SERVER_NAME
from devs_sandbox.mcp_server.env import ToolEnv
from devs_sandbox.mcp_server.progress import (
    PROGRESS_INTERVAL_S,
    Report,
    ToolCall,
)
from devs_sandbox.mcp_server.results import (
    ToolCallError,
    argument_problems,
    error_result,
    failure_for,
    ok_result,
)
from devs_sandbox.mcp_server.tenancy import (
    CALLER_KEY,
    LOCAL_CALLER,
    Caller,
    advertise_sessions_only,
    connection_of,
)
from devs_sandbox.tools.sessions import SandboxSessions

logger = logging.getLogger(__name__)


# REQ: 3_MCP-REQ-SEC-002
class DevsMcpServer:
    """The tools over one manager and one session registry; ``server()`` is the SDK's side.

    ``multi_tenant`` (the HTTP server) makes each MCP session a tenant of its own (see
    ``tenancy``); otherwise every call acts for ``LOCAL_CALLER``. ``stats_factory`` and
    ``monitor_scheduler`` are the monitor's test seams (a scripted stats source and a
    manual clock), passed through to ``run_shell_monitored``.
    """

    def __init__(
        self,
        config: DevsConfig,
        manager: SandboxLifecycleManager,
        sessions: SandboxSessions,
        *,
        multi_tenant: bool = False,
        stats_factory: Callable[[], ProcessStatsSource] | None = None,
        monitor_scheduler: Scheduler | None = None,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
    ) -> None:
        self.config = config
        self.progress_interval_s = progress_interval_s
        self.manager = manager
        self.sessions = sessions
        self.multi_tenant = multi_tenant
        # Every sandbox of ours gets a fresh id, even if the file pins sandbox.sandboxId.
        base = config.sandbox
        self.env = ToolEnv(
            config=config,
            manager=manager,
            sessions=sessions,
            sandbox_config=base if base.sandbox_id is None else override(base, sandbox_id=None),
            multi_tenant=multi_tenant,
            stats_factory=stats_factory,
            monitor_scheduler=monitor_scheduler,
        )
        tools = (
            run_tools.tools(self.env) + session_tools.tools(self.env) + file_tools.tools(self.env)
        )
        self.tools = {t.name: t for t in tools}
        self._listing = [t.listing() for t in tools]

    def server(self) -> Server[Any]:
        server: Server[Any] = Server(
            SERVER_NAME,
            version=__version__,
            instructions=(
                "Run shell commands in ephemeral, resource-capped sandboxes: run_shell_monitored "
                "for one command, sandbox_create/sandbox_exec/sandbox_destroy for several "
                "commands sharing a workspace."
            ),
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
        )
        if self.multi_tenant:
            advertise_sessions_only(server)
        return server

    # -- protocol handlers ------------------------------------------------------------------
    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        del ctx, params
        return types.ListToolsResult(tools=self._listing)

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            caller = self._caller(ctx)
        except ToolCallError as failure:
            return error_result(failure)
        # The SDK sends it only when the request asked for progress (a progress token over
        # JSON-RPC, a callback in process); otherwise report_progress does nothing.
        report = functools.partial(_report, ctx)
        return await self.call(params.name, params.arguments, caller, report=report)

    def _caller(self, ctx: ServerRequestContext[Any]) -> Caller:
        """The tenant of this request: one per MCP session, minted on its first tool call,
        with the destruction of its sandboxes pushed onto the session's teardown."""
        if not self.multi_tenant:
            return LOCAL_CALLER
        connection = connection_of(ctx)
        if connection is None:
            logger.error("cannot tell the MCP session of a %s request; refused", ctx.method)
            raise ToolCallError(
                "internal error: the server cannot tell which MCP session this call belongs "
                "to, so it runs nothing (details in the server's log)",
                {"error": "internal_error"},
            )
        if connection.session_id is None:
            # A sessionless request (2026-07-28): a tenant of its own that ends with it, and
            # that keeps nothing (session=False: no sandbox_create, no ownership record).
            return Caller(f"call-{secrets.token_hex(8)}", session=False)
        caller = connection.state.get(CALLER_KEY)
        if not isinstance(caller, Caller):
            # No await between the lookup and the store: concurrent first calls of one
            # session cannot mint two tenants.
            caller = Caller(f"session-{secrets.token_hex(8)}")
            connection.state[CALLER_KEY] = caller
            connection.exit_stack.push_async_callback(self._session_ended, caller.owner)
        return caller

    async def _session_ended(self, owner: str) -> None:
        """The MCP session's teardown (the SDK unwinds its ``exit_stack``, shielded, however
        the session ended): destroy what it still holds."""
        gone = await run_blocking(
            lambda: self.sessions.end_owner(owner, "destroyed when its MCP session ended"),
            name="devs-sandbox-session-end",
        )
        logger.info("MCP session ended; %d sandbox(es) destroyed", len(gone))

    async def call(
        self,
        name: str,
        arguments: dict[str, Any] | None,
        caller: Caller = LOCAL_CALLER,
        *,
        report: Report | None = None,
    ) -> types.CallToolResult:
        """Validate, run for ``caller``, and answer; every failure becomes an ``isError``
        result. ``report`` sends a progress notification (the request asked for them)."""
        tool = self.tools.get(name)
        if tool is None:
            return error_result(
                ToolCallError(
                    f"unknown tool {name!r}; the tools are {', '.join(self.tools)}",
                    {"error": "unknown_tool", "tool": name},
                )
            )
        try:
            args = tool.args.model_validate(arguments or {})
        except ValidationError as exc:
            problems = argument_problems(exc)
            text = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
            return error_result(
                ToolCallError(
                    f"invalid arguments for {name}: {text}",
                    {"error": "invalid_arguments", "problems": problems},
                )
            )
        call = ToolCall(caller, report, self.progress_interval_s)
        try:
            return ok_result(await tool.handler(args, call), structured=tool.structured)
        except Exception as exc:
            return error_result(failure_for(exc, name))


async def _report(ctx: ServerRequestContext[Any], progress: float, message: str) -> None:
    await ctx.session.report_progress(progress, message=message)
