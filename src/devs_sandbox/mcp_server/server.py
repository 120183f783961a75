"""``DevsMcpServer``: the tools, their handlers, and who the caller is (its MCP session)."""

import functools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mcp import types
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import BaseModel, ValidationError, create_model

from devs_sandbox import __version__
from devs_sandbox.base import ProcessStatsSource, Scheduler
from devs_sandbox.config import (
    DevsConfig,
    SandboxLifecycleConfig,
    override,
)
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.lifecycle.aio import run_blocking
from devs_sandbox.mcp_server.constants import _CALLER_KEY, SERVER_NAME
from devs_sandbox.mcp_server.schemas import (
    LOCAL_CALLER,
    Caller,
    Command,
    CreateArgs,
    CreateOutput,
    DestroyArgs,
    DestroyOutput,
    QuotaArgs,
    SandboxId,
    ShellOutput,
    ToolCallError,
    ViolationRow,
    ViolationsArgs,
    ViolationsOutput,
    _Args,
    _argument_problems,
    _error_result,
    _failure_for,
    _monitor_fields,
    _ok_result,
    _session_required,
)
from devs_sandbox.models import new_sandbox_id
from devs_sandbox.monitors.usage import cpu_busy_threshold
from devs_sandbox.tools.sessions import SandboxSessions
from devs_sandbox.tools.shell import MonitoredShellOptions, ShellResult, run_shell_monitored

logger = logging.getLogger(__name__)

# -- the server -----------------------------------------------------------------------------
Handler = Callable[[Any, Caller], Awaitable[BaseModel]]


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    args: type[BaseModel]
    output: type[BaseModel]
    handler: Handler
    annotations: types.ToolAnnotations

    def listing(self) -> types.Tool:
        return types.Tool(
            name=self.name,
            description=self.description,
            input_schema=_inline_refs(self.args.model_json_schema()),
            output_schema=_inline_refs(self.output.model_json_schema()),
            annotations=self.annotations,
        )


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """pydantic puts nested models under ``$defs``; not every MCP client resolves ``$ref``,
    so the tool schemas are written out in full (ours have no recursion)."""
    defs: dict[str, Any] = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return {**walk(defs[ref.removeprefix("#/$defs/")]), **walk(rest)}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    result: dict[str, Any] = walk(schema)
    return result


# REQ: 3_MCP-REQ-SEC-002
class DevsMcpServer:
    """The tools over one manager and one session registry; ``server()`` is the SDK's side.

    ``multi_tenant`` (the HTTP server) makes each MCP session a tenant of its own (see the
    module docstring); otherwise every call acts for ``LOCAL_CALLER``. ``stats_factory``
    and ``monitor_scheduler`` are the monitor's test seams (a scripted stats source and a
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
    ) -> None:
        self.config = config
        self.manager = manager
        self.sessions = sessions
        self.multi_tenant = multi_tenant
        self._stats_factory = stats_factory
        self._monitor_scheduler = monitor_scheduler
        # Every sandbox of ours gets a fresh id, even if the file pins sandbox.sandboxId.
        base = config.sandbox
        self._sandbox_config = base if base.sandbox_id is None else override(base, sandbox_id=None)
        monitor = _monitor_fields(config)
        shell_args = create_model(
            "RunShellMonitoredArgs", __base__=_Args, command=(Command, ...), **monitor
        )
        exec_args = create_model(
            "SandboxExecArgs",
            __base__=_Args,
            sandbox_id=(SandboxId, ...),
            command=(Command, ...),
            **monitor,
        )
        mcp = config.mcp
        busy = cpu_busy_threshold(mcp.cpu_sustained_ms)
        limits = (
            f"Killed (SIGKILL to every process) when its process tree's resident memory exceeds "
            f"rss_limit_bytes (default {mcp.rss_limit_bytes}), or when it keeps a full core busy "
            f"(on average >= {busy:g}% of one core, counting time waiting for a CPU) over "
            "cpu_sustained_ms "
            f"(default {mcp.cpu_sustained_ms}); a kill is an error result with structured "
            "{pid, reason, value, limit}."
        )
        ends = "when the server stops"
        ends = f"when this MCP session ends, or {ends}" if multi_tenant else f"or {ends}"
        whose = "this MCP session's sandboxes" if multi_tenant else "this host"
        tools = [
            _Tool(
                "run_shell_monitored",
                "Run a shell command in a fresh sandbox (the server's isolation and quotas; "
                "its workspace is empty) that is destroyed afterwards. Returns exit_code, "
                "stdout, stderr. " + limits,
                shell_args,
                ShellOutput,
                self._run_shell,
                types.ToolAnnotations(destructive_hint=False, open_world_hint=False),
            ),
            _Tool(
                "sandbox_create",
                "Create a sandbox that keeps its workspace between sandbox_exec calls; returns its "
                f"id. Destroyed by sandbox_destroy, after {mcp.session_idle_timeout_s:g} s without "
                f"a call, {mcp.session_timeout_s:g} s after creation, {ends}.",
                CreateArgs,
                CreateOutput,
                self._create,
                types.ToolAnnotations(destructive_hint=False, open_world_hint=False),
            ),
            _Tool(
                "sandbox_exec",
                "Run a shell command in the workspace of a sandbox from sandbox_create (files "
                "persist between calls). " + limits + " The sandbox survives a kill.",
                exec_args,
                ShellOutput,
                self._exec,
                types.ToolAnnotations(destructive_hint=True, open_world_hint=False),
            ),
            _Tool(
                "sandbox_destroy",
                "Destroy a sandbox from sandbox_create: its processes and its workspace.",
                DestroyArgs,
                DestroyOutput,
                self._destroy,
                types.ToolAnnotations(destructive_hint=True, open_world_hint=False),
            ),
            _Tool(
                "sandbox_violations",
                f"Recent quota and resource-limit violations of {whose}, newest first.",
                ViolationsArgs,
                ViolationsOutput,
                self._violations,
                types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
            ),
        ]
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
            _advertise_sessions_only(server)
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
            return _error_result(failure)
        return await self.call(params.name, params.arguments, caller)

    def _caller(self, ctx: ServerRequestContext[Any]) -> Caller:
        """The tenant of this request: one per MCP session, minted on its first tool call,
        with the destruction of its sandboxes pushed onto the session's teardown."""
        if not self.multi_tenant:
            return LOCAL_CALLER
        connection = _connection_of(ctx)
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
        caller = connection.state.get(_CALLER_KEY)
        if not isinstance(caller, Caller):
            # No await between the lookup and the store: concurrent first calls of one
            # session cannot mint two tenants.
            caller = Caller(f"session-{secrets.token_hex(8)}")
            connection.state[_CALLER_KEY] = caller
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
        self, name: str, arguments: dict[str, Any] | None, caller: Caller = LOCAL_CALLER
    ) -> types.CallToolResult:
        """Validate, run for ``caller``, and answer; every failure becomes an ``isError``
        result."""
        tool = self.tools.get(name)
        if tool is None:
            return _error_result(
                ToolCallError(
                    f"unknown tool {name!r}; the tools are {', '.join(self.tools)}",
                    {"error": "unknown_tool", "tool": name},
                )
            )
        try:
            args = tool.args.model_validate(arguments or {})
        except ValidationError as exc:
            problems = _argument_problems(exc)
            text = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
            return _error_result(
                ToolCallError(
                    f"invalid arguments for {name}: {text}",
                    {"error": "invalid_arguments", "problems": problems},
                )
            )
        try:
            return _ok_result(await tool.handler(args, caller))
        except Exception as exc:
            return _error_result(_failure_for(exc, name, args))

    # -- tools -------------------------------------------------------------------------------
    def _options(self, args: Any) -> MonitoredShellOptions:
        return MonitoredShellOptions(
            rss_limit_bytes=args.rss_limit_bytes,
            cpu_sustained_ms=args.cpu_sustained_ms,
            poll_interval_ms=args.poll_interval_ms,
            timeout_s=args.timeout_s,
        )

    def _stats(self) -> ProcessStatsSource | None:
        return self._stats_factory() if self._stats_factory is not None else None

    async def _run_shell(self, args: Any, caller: Caller) -> ShellOutput:
        # The id is ours to choose, so the caller owns the sandbox (and its audit rows)
        # before it exists; a sessionless caller keeps no record (nothing could ask).
        sandbox_id = new_sandbox_id()
        config = override(self._sandbox_config, sandbox_id=sandbox_id)
        owned = sandbox_id if caller.session else None
        with self.sessions.slot(owner=caller.owner, sandbox_id=owned):
            result = await run_shell_monitored(
                args.command,
                self._options(args),
                manager=self.manager,
                config=config,
                stats=self._stats(),
                scheduler=self._monitor_scheduler,
            )
        return ShellOutput(**result.to_json())

    def _session_config(self, quotas: QuotaArgs | None) -> SandboxLifecycleConfig:
        if quotas is None:
            return self._sandbox_config
        mine = self._sandbox_config.quotas
        asked = quotas.model_dump(exclude_none=True)
        for key, value in asked.items():
            ceiling = getattr(mine, key)
            if ceiling is not None and value > ceiling:
                raise ToolCallError(
                    f"quotas.{key} {value} is above this server's limit {ceiling} "
                    f"(sandbox.quotas.{_camel(key)}); ask for at most that",
                    {"error": "invalid_arguments", "key": f"quotas.{key}", "limit": ceiling},
                )
        return override(self._sandbox_config, quotas=asked)

    async def _create(self, args: CreateArgs, caller: Caller) -> CreateOutput:
        if not caller.session:
            raise _session_required("sandbox_create")
        cfg = self._session_config(args.quotas)
        sandbox = await run_blocking(
            functools.partial(self._create_session, cfg, caller.owner),
            discard=lambda sb: self.sessions.end(sb.id, "its sandbox_create call was cancelled"),
            name="devs-sandbox-create",
        )
        return CreateOutput(
            sandbox_id=sandbox.id,
            workspace=str(sandbox.workspace),
            isolation=list(sandbox.isolation),
            idle_timeout_s=self.sessions.idle_timeout_s,
            expires_in_s=round(self.sessions.remaining_s(sandbox.id, owner=caller.owner), 3),
        )

    def _create_session(self, cfg: SandboxLifecycleConfig, owner: str) -> Any:
        sandbox = self.sessions.create(cfg, owner=owner)
        if cfg.preflight_commands:
            try:
                # The same preflight, budget and errors as a one-shot run.
                self.manager.run_preflight(sandbox, cfg)
            except BaseException:
                self.sessions.end(sandbox.id, "its preflight failed")
                raise
        return sandbox

    async def _exec(self, args: Any, caller: Caller) -> ShellOutput:
        if not caller.session:
            raise _session_required("sandbox_exec")
        sandbox_id: str = args.sandbox_id
        result = await run_blocking(
            lambda: self.sessions.exec(
                sandbox_id,
                args.command,
                self._options(args),
                timeout_s=args.timeout_s,
                owner=caller.owner,
                stats=self._stats(),
                scheduler=self._monitor_scheduler,
            ),
            on_cancel=lambda: self.sessions.kill(sandbox_id, owner=caller.owner),
            name=f"devs-sandbox-exec-{sandbox_id}",
        )
        return ShellOutput(**ShellResult.from_exec(result).to_json())

    async def _destroy(self, args: DestroyArgs, caller: Caller) -> DestroyOutput:
        if not caller.session:
            raise _session_required("sandbox_destroy")
        await run_blocking(
            lambda: self.sessions.destroy(args.sandbox_id, owner=caller.owner),
            name="devs-sandbox-destroy",
        )
        return DestroyOutput(sandbox_id=args.sandbox_id, destroyed=True)

    async def _violations(self, args: ViolationsArgs, caller: Caller) -> ViolationsOutput:
        if not caller.session:
            raise _session_required("sandbox_violations")
        store = self.manager.store
        if store is None:
            return ViolationsOutput(violations=[])
        # The caller's own sandboxes, filtered in SQL; the store itself knows no owners.
        ids = None if caller.sees_all_rows else self.sessions.owned_ids(caller.owner)
        rows = await run_blocking(
            lambda: store.list(sandbox_id=args.sandbox_id, sandbox_ids=ids, limit=args.limit),
            name="devs-sandbox-violations",
        )
        return ViolationsOutput(violations=[ViolationRow(**r) for r in rows])


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(p.capitalize() for p in rest)


# -- the SDK's sessions -------------------------------------------------------------------------
def _connection_of(ctx: ServerRequestContext[Any]) -> Connection | None:
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


def _advertise_sessions_only(server: Server[Any]) -> None:
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
