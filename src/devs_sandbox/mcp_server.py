"""The MCP server: agents reach devs-sandbox as tools, over stdio or streamable HTTP.

The only module that imports the MCP SDK (``mcp``; its 2.x line renamed ``FastMCP`` to
``MCPServer`` and moved the wire types to ``mcp_types``: that churn stays here). It is a
thin shell over the library: ``run_shell_monitored`` for one-shot commands,
``SandboxSessions`` for sandboxes kept between calls, the violation store for the audit
trail, and ``DevsConfig.mcp`` for every default.

Tools (REQ: 3_MCP-REQ-SEC-002, every command runs monitored):

- ``run_shell_monitored {command, timeout_s?, rss_limit_bytes?, cpu_sustained_ms?,
  poll_interval_ms?}``: a fresh sandbox per call;
- ``sandbox_create {quotas?}``, ``sandbox_exec {sandbox_id, command, ...}``,
  ``sandbox_destroy {sandbox_id}``: a sandbox whose workspace persists between calls;
- ``sandbox_violations {limit?, sandbox_id?}``: recent rows of the store.

Why the low-level ``Server`` rather than ``MCPServer``: the tools' input schemas carry the
configured defaults and the config's bounds, unknown arguments are refused (an agent's
``timeout`` for ``timeout_s`` must not be silently ignored), argument errors read as one
line per field, and a kill is an ``isError`` result whose structured content carries
``{pid, reason, value, limit}``. All of that is plain pydantic and ``CallToolResult`` here.

Tenancy over HTTP (``serve(http=True)``): every sandbox a call makes (``sandbox_create``,
and the fresh sandbox of each ``run_shell_monitored``) belongs to the MCP session of that
call. Another session's ``sandbox_exec``/``sandbox_destroy`` on it is answered exactly as
for an id that never existed; ``sandbox_violations`` lists the caller's own sandboxes'
rows only; the session's sandboxes are destroyed when the session ends (the client's
DELETE, the SDK's idle expiry, the server stopping). A request without a session (the
sessionless 2026-07-28 protocol) may run ``run_shell_monitored`` only, and
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

import contextlib
import functools
import hmac
import ipaddress
import json
import logging
import math
import os
import secrets
import signal
import stat
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import anyio
import anyio.to_thread
from mcp import types
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import DEFAULT_SESSION_IDLE_TIMEOUT
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from devs_sandbox import __version__
from devs_sandbox.base import ProcessStatsSource, Scheduler
from devs_sandbox.config import (
    MAX_CPU_SUSTAINED_MS,
    MAX_POLL_INTERVAL_MS,
    MIN_POLL_INTERVAL_MS,
    MIN_RSS_LIMIT_BYTES,
    DevsConfig,
    SandboxLifecycleConfig,
    override,
)
from devs_sandbox.errors import (
    ConfigError,
    DevsSandboxError,
    ExecTimeoutError,
    QuotaExceededError,
    ResourceLimitExceededError,
    SandboxNotFoundError,
    SandboxPreFlightError,
    SandboxTimeoutError,
    SessionLimitError,
)
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.lifecycle.aio import run_blocking
from devs_sandbox.models import SANDBOX_ID_PATTERN, ExecResult, new_sandbox_id
from devs_sandbox.monitors.usage import cpu_busy_threshold
from devs_sandbox.store import ViolationStore
from devs_sandbox.tools.sessions import DEFAULT_OWNER, SandboxSessions
from devs_sandbox.tools.shell import MonitoredShellOptions, ShellResult, run_shell_monitored

logger = logging.getLogger(__name__)

SERVER_NAME: Final = "devs-sandbox"
DEFAULT_HTTP_HOST: Final = "127.0.0.1"
DEFAULT_HTTP_PORT: Final = 8000  # the SDK's default
HTTP_PATH: Final = "/mcp"
# uvicorn waits for open requests before it stops; a tool call may run for minutes, so cut
# them short and let the cancelled calls kill their sandboxes.
HTTP_GRACEFUL_SHUTDOWN_S: Final = 2.0
# After SIGTERM/SIGINT the sandboxes are destroyed first; the stdio transport may then
# still sit in a blocking read of stdin (anyio cannot abandon it), so exit after this.
SIGNAL_EXIT_GRACE_S: Final = 1.0
DEFAULT_VIOLATIONS_LIMIT: Final = 20
MAX_VIOLATIONS_LIMIT: Final = 1_000
# A bearer token is a short line; anything longer is not the file the operator meant.
MAX_TOKEN_FILE_BYTES: Final = 4_096
# Online guessing of a shorter token is within reach; `openssl rand -hex 32` gives 64.
MIN_TOKEN_CHARS: Final = 16
_CALLER_KEY: Final = "devs_sandbox.caller"  # our entry in the SDK's Connection.state

# -- argument and result models -------------------------------------------------------------
Command = Annotated[
    str,
    Field(
        min_length=1,
        description="Shell command, run with /bin/sh -c in the sandbox's workspace.",
    ),
]
SandboxId = Annotated[
    str,
    Field(
        pattern=SANDBOX_ID_PATTERN.pattern,
        description="Id returned by sandbox_create.",
    ),
]


class _Args(BaseModel):
    """Tool arguments: strict JSON types, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @field_validator("command", check_fields=False)
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty or only whitespace")
        if "\0" in v:
            raise ValueError("must not contain NUL bytes")
        return v


def _monitor_fields(cfg: DevsConfig) -> dict[str, Any]:
    """The monitor's arguments, their defaults taken from the config's ``mcp`` section."""
    mcp = cfg.mcp
    busy = cpu_busy_threshold(mcp.poll_interval_ms)
    return {
        "timeout_s": (
            float,
            Field(
                default=mcp.timeout_s,
                gt=0,
                le=mcp.max_timeout_s,
                description="Seconds before the command (and all it started) is killed.",
            ),
        ),
        "rss_limit_bytes": (
            int,
            Field(
                default=mcp.rss_limit_bytes,
                ge=MIN_RSS_LIMIT_BYTES,
                description="Kill when the command's process tree holds more resident memory.",
            ),
        ),
        "cpu_sustained_ms": (
            int,
            Field(
                default=mcp.cpu_sustained_ms,
                ge=1,
                le=MAX_CPU_SUSTAINED_MS,
                description=(
                    "Kill after the process tree kept a full core busy (100% of one core, "
                    f"measured as at least {busy:g}% at the default interval) this long in a row."
                ),
            ),
        ),
        "poll_interval_ms": (
            int,
            Field(
                default=mcp.poll_interval_ms,
                ge=MIN_POLL_INTERVAL_MS,
                le=MAX_POLL_INTERVAL_MS,
                description="How often the process tree is sampled.",
            ),
        ),
    }


class QuotaArgs(BaseModel):
    """Quotas an agent may set on its sandbox: tighter than the server's, never looser."""

    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True
    )

    memory_bytes: int | None = Field(None, ge=1)
    """Memory cap of the whole sandbox."""
    disk_bytes: int | None = Field(None, ge=1)
    """Size of the workspace."""
    file_count_limit: int | None = Field(None, ge=1)
    """Most files and directories in the workspace."""
    process_count_limit: int | None = Field(None, ge=1)
    """Most processes and threads at once."""
    directory_depth_limit: int | None = Field(None, ge=1)
    """Deepest directory nesting in the workspace."""
    max_file_size_bytes: int | None = Field(None, ge=1)
    """Largest single file."""
    cpu_cores: float | None = Field(None, gt=0, le=1024)
    """CPU bandwidth cap in cores."""


class CreateArgs(_Args):
    quotas: QuotaArgs | None = Field(
        None, description="Optional limits, each at most the server's configured one."
    )


class DestroyArgs(_Args):
    sandbox_id: SandboxId


class ViolationsArgs(_Args):
    limit: int = Field(
        DEFAULT_VIOLATIONS_LIMIT, ge=1, le=MAX_VIOLATIONS_LIMIT, description="Most rows returned."
    )
    sandbox_id: SandboxId | None = Field(None, description="Only this sandbox's rows.")


class ShellOutput(BaseModel):
    """What a command printed and how it ended, when it ended on its own."""

    exit_code: int = Field(description="The command's status; 128+N when signal N ended it.")
    stdout: str
    stderr: str
    stdout_truncated: bool = Field(
        description="The middle of stdout was dropped (head and tail kept)."
    )
    stderr_truncated: bool
    duration_s: float


class CreateOutput(BaseModel):
    sandbox_id: str
    workspace: str = Field(description="The working directory of every sandbox_exec.")
    isolation: list[str] = Field(description="Isolation layers in effect.")
    idle_timeout_s: float = Field(description="Destroyed after this long without a call.")
    expires_in_s: float = Field(description="Destroyed this long from now, whatever happens.")


class DestroyOutput(BaseModel):
    sandbox_id: str
    destroyed: bool


class ViolationRow(BaseModel):
    violation_id: str
    sandbox_id: str
    violation_type: str
    observed_value: int
    limit_value: int
    terminated_at: str
    rule: str
    detail: str


class ViolationsOutput(BaseModel):
    violations: list[ViolationRow]


# -- tool errors ----------------------------------------------------------------------------
class ToolCallError(Exception):
    """A tool's answer that is an error: ``message`` for the model, ``data`` as structured
    content. Raised inside handlers, turned into ``isError`` results in one place."""

    def __init__(self, message: str, data: dict[str, Any]) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


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


def _session_required(tool: str) -> ToolCallError:
    return ToolCallError(
        f"{tool} needs an MCP session and this request has none (the 2026-07-28 protocol "
        "is sessionless; a sandbox kept between calls belongs to a session): connect with "
        "the initialize handshake, e.g. mcp.Client(url, mode='legacy'); run_shell_monitored "
        "works without one",
        {"error": "session_required"},
    )


def _output(result: ExecResult | None) -> dict[str, Any]:
    return {} if result is None else ShellResult.from_exec(result).to_json()


def _argument_problems(exc: ValidationError) -> list[dict[str, str]]:
    problems = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "(arguments)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown argument"
        elif err["type"] != "missing":
            msg += f" (got {err.get('input')!r})"
        problems.append({"field": field, "message": msg})
    return problems


def _failure_for(exc: BaseException, tool: str, args: BaseModel | None) -> ToolCallError:
    """One place that turns what the library raised into what the agent reads."""
    if isinstance(exc, ToolCallError):
        return exc
    if isinstance(exc, ResourceLimitExceededError):
        unit = "bytes" if exc.reason == "rss" else "% of one core"
        option = "rss_limit_bytes" if exc.reason == "rss" else "cpu_sustained_ms"
        return ToolCallError(
            f"{exc} ({unit}): every process of the command was killed; fix the command "
            f"or raise {option}",
            {
                "error": "resource_limit_exceeded",
                "pid": exc.pid,
                "reason": exc.reason,
                "value": exc.value,
                "limit": exc.limit,
                **_output(exc.result),
            },
        )
    if isinstance(exc, SandboxTimeoutError | ExecTimeoutError):
        seconds = exc.timeout_s
        if isinstance(exc, ExecTimeoutError):
            result = exc.result
        else:
            result = exc.outcome.result if exc.outcome is not None else None
        if isinstance(exc, SandboxTimeoutError) and exc.idle:
            message = (
                f"the command printed nothing for {seconds:g} s and every process of it was "
                "killed (sandbox.idleTimeoutMs)"
            )
        else:
            message = (
                f"the command timed out after {seconds:g} s and every process of it was killed "
                "(raise timeout_s)"
            )
        return ToolCallError(message, {"error": "timeout", "timeout_s": seconds, **_output(result)})
    if isinstance(exc, QuotaExceededError):
        v = exc.violation
        result = exc.outcome.result if exc.outcome is not None else None
        gone = " and the sandbox destroyed" if tool == "sandbox_exec" else ""
        return ToolCallError(
            f"sandbox quota exceeded: {v.type} (observed {v.observed_value}, limit "
            f"{v.limit_value}); every process was killed{gone}",
            {"error": "quota_exceeded", "violation": v.to_json(), **_output(result)},
        )
    if isinstance(exc, SandboxNotFoundError):
        return ToolCallError(
            str(exc),
            {"error": "sandbox_not_found", "sandbox_id": exc.sandbox_id, "detail": exc.detail},
        )
    if isinstance(exc, SessionLimitError):
        return ToolCallError(str(exc), {"error": "too_many_sandboxes", "limit": exc.limit})
    if isinstance(exc, SandboxPreFlightError):
        return ToolCallError(str(exc), {"error": "preflight_failed", "command": exc.command})
    if isinstance(exc, ConfigError):
        return ToolCallError(str(exc), {"error": "invalid_arguments", "key": exc.key})
    if isinstance(exc, DevsSandboxError):
        return ToolCallError(str(exc), {"error": "sandbox_error", "type": type(exc).__name__})
    logger.error("tool %s failed", tool, exc_info=exc)
    return ToolCallError(
        f"internal error in {tool}: {type(exc).__name__} (details in the server's log)",
        {"error": "internal_error"},
    )


def _error_result(failure: ToolCallError) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=failure.message)],
        structured_content=failure.data,
        is_error=True,
    )


def _ok_result(output: BaseModel) -> types.CallToolResult:
    data = output.model_dump(mode="json")
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(data))],
        structured_content=data,
    )


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
        busy = cpu_busy_threshold(mcp.poll_interval_ms)
        limits = (
            f"Killed (SIGKILL to every process) when its process tree's resident memory exceeds "
            f"rss_limit_bytes (default {mcp.rss_limit_bytes}), or when it keeps a full core busy "
            f"(>= {busy:g}% measured) for cpu_sustained_ms in a row "
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
