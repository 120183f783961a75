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

Invariants: a tool call never crashes the server nor sends a traceback to the client (a
bug of ours is logged on stderr and answered "internal error"); no handler blocks the
event loop (sandbox work runs through ``aio.run_blocking``, which turns a cancelled call
into a kill); when the server stops (stdin EOF, SIGTERM, SIGINT) every sandbox it made
is destroyed before the process exits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import anyio
import anyio.to_thread
from mcp import types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
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
from devs_sandbox.models import SANDBOX_ID_PATTERN, ExecResult
from devs_sandbox.monitors.usage import cpu_busy_threshold
from devs_sandbox.store import ViolationStore
from devs_sandbox.tools.sessions import SandboxSessions
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
    busy = cpu_busy_threshold(mcp.cpu_sustained_ms)
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
                    "Kill after the process tree kept a full core busy this long: its CPU time "
                    "plus time waiting for a CPU over this trailing window, at least "
                    f"{busy:g}% of one core on average for the default window."
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
Handler = Callable[[Any], Awaitable[BaseModel]]


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

    ``stats_factory`` and ``monitor_scheduler`` are the monitor's test seams (a scripted
    stats source and a manual clock), passed through to ``run_shell_monitored``.
    """

    def __init__(
        self,
        config: DevsConfig,
        manager: SandboxLifecycleManager,
        sessions: SandboxSessions,
        *,
        stats_factory: Callable[[], ProcessStatsSource] | None = None,
        monitor_scheduler: Scheduler | None = None,
    ) -> None:
        self.config = config
        self.manager = manager
        self.sessions = sessions
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
                f"a call, {mcp.session_timeout_s:g} s after creation, or when the server stops.",
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
                "Recent quota and resource-limit violations recorded by this host, newest first.",
                ViolationsArgs,
                ViolationsOutput,
                self._violations,
                types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
            ),
        ]
        self.tools = {t.name: t for t in tools}
        self._listing = [t.listing() for t in tools]

    def server(self) -> Server[Any]:
        return Server(
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

    # -- protocol handlers ------------------------------------------------------------------
    async def _list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        del ctx, params
        return types.ListToolsResult(tools=self._listing)

    async def _call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        del ctx
        return await self.call(params.name, params.arguments)

    async def call(self, name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
        """Validate, run, and answer; every failure becomes an ``isError`` result."""
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
            return _ok_result(await tool.handler(args))
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

    async def _run_shell(self, args: Any) -> ShellOutput:
        with self.sessions.slot():
            result = await run_shell_monitored(
                args.command,
                self._options(args),
                manager=self.manager,
                config=self._sandbox_config,
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

    async def _create(self, args: CreateArgs) -> CreateOutput:
        cfg = self._session_config(args.quotas)
        sandbox = await run_blocking(
            functools.partial(self._create_session, cfg),
            discard=lambda sb: self.sessions.end(sb.id, "its sandbox_create call was cancelled"),
            name="devs-sandbox-create",
        )
        return CreateOutput(
            sandbox_id=sandbox.id,
            workspace=str(sandbox.workspace),
            isolation=list(sandbox.isolation),
            idle_timeout_s=self.sessions.idle_timeout_s,
            expires_in_s=round(self.sessions.remaining_s(sandbox.id), 3),
        )

    def _create_session(self, cfg: SandboxLifecycleConfig) -> Any:
        sandbox = self.sessions.create(cfg)
        if cfg.preflight_commands:
            try:
                # The same preflight, budget and errors as a one-shot run.
                self.manager.run_preflight(sandbox, cfg)
            except BaseException:
                self.sessions.end(sandbox.id, "its preflight failed")
                raise
        return sandbox

    async def _exec(self, args: Any) -> ShellOutput:
        sandbox_id: str = args.sandbox_id
        result = await run_blocking(
            lambda: self.sessions.exec(
                sandbox_id,
                args.command,
                self._options(args),
                timeout_s=args.timeout_s,
                stats=self._stats(),
                scheduler=self._monitor_scheduler,
            ),
            on_cancel=lambda: self.sessions.kill(sandbox_id),
            name=f"devs-sandbox-exec-{sandbox_id}",
        )
        return ShellOutput(**ShellResult.from_exec(result).to_json())

    async def _destroy(self, args: DestroyArgs) -> DestroyOutput:
        await run_blocking(
            lambda: self.sessions.destroy(args.sandbox_id), name="devs-sandbox-destroy"
        )
        return DestroyOutput(sandbox_id=args.sandbox_id, destroyed=True)

    async def _violations(self, args: ViolationsArgs) -> ViolationsOutput:
        store = self.manager.store
        if store is None:
            return ViolationsOutput(violations=[])
        rows = await run_blocking(
            lambda: store.list(sandbox_id=args.sandbox_id, limit=args.limit),
            name="devs-sandbox-violations",
        )
        return ViolationsOutput(violations=[ViolationRow(**r) for r in rows])


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(p.capitalize() for p in rest)


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


async def _serve_http(server: Server[Any], host: str, port: int) -> int:
    import uvicorn  # noqa: PLC0415 - a dependency of mcp, needed for HTTP only

    app = server.streamable_http_app(streamable_http_path=HTTP_PATH, host=host)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=math.ceil(HTTP_GRACEFUL_SHUTDOWN_S),
    )
    print(
        f"{SERVER_NAME}: serving MCP over streamable HTTP at http://{host}:{port}{HTTP_PATH}",
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
) -> int:
    """Run the server until its transport ends; destroy every sandbox it made; return the
    exit status (0, or 128 + N after signal N)."""
    manager = SandboxLifecycleManager(config=config, store=ViolationStore(db_path))
    sessions = SandboxSessions.from_config(manager, config.mcp)
    app = DevsMcpServer(config, manager, sessions)
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
            return anyio.run(_serve_http, app.server(), host, port)
        return anyio.run(_serve_stdio, app.server(), cleanup)
    finally:
        with _ignore_signals():
            cleanup()
