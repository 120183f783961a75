"""The tools' arguments and results, as pydantic models (their JSON Schemas are the
tools' inputSchema and outputSchema), and how a failure becomes a tool error result."""

import json
import logging
from dataclasses import dataclass
from typing import Annotated, Any, Final

from mcp import types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from devs_sandbox.config import (
    MAX_CPU_SUSTAINED_MS,
    MAX_POLL_INTERVAL_MS,
    MIN_POLL_INTERVAL_MS,
    MIN_RSS_LIMIT_BYTES,
    DevsConfig,
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
from devs_sandbox.mcp_server.constants import DEFAULT_VIOLATIONS_LIMIT, MAX_VIOLATIONS_LIMIT
from devs_sandbox.models import SANDBOX_ID_PATTERN, ExecResult
from devs_sandbox.monitors.usage import cpu_busy_threshold
from devs_sandbox.tools.sessions import DEFAULT_OWNER
from devs_sandbox.tools.shell import ShellResult

logger = logging.getLogger(__name__)

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
