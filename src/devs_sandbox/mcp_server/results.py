"""What the agent reads: every outcome of a tool call as one ``CallToolResult``.

``failure_for`` is the one place that turns what the library raised into an error the
agent can act on (the option to change, the output so far); nothing else builds an
``isError`` result.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from mcp import types
from pydantic import BaseModel, ValidationError

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
from devs_sandbox.models import ExecResult
from devs_sandbox.tools.shell import ShellResult

logger = logging.getLogger(__name__)


class ToolCallError(Exception):
    """A tool's answer that is an error: ``message`` for the model, ``data`` as structured
    content. Raised inside handlers, turned into ``isError`` results in one place."""

    def __init__(self, message: str, data: dict[str, Any]) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


def output_fields(result: ExecResult | None) -> dict[str, Any]:
    return {} if result is None else ShellResult.from_exec(result).to_json()


def argument_problems(exc: ValidationError) -> list[dict[str, str]]:
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


def failure_for(exc: BaseException, tool: str, args: BaseModel | None) -> ToolCallError:
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
                **output_fields(exc.result),
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
        return ToolCallError(
            message, {"error": "timeout", "timeout_s": seconds, **output_fields(result)}
        )
    if isinstance(exc, QuotaExceededError):
        v = exc.violation
        result = exc.outcome.result if exc.outcome is not None else None
        gone = " and the sandbox destroyed" if tool == "sandbox_exec" else ""
        return ToolCallError(
            f"sandbox quota exceeded: {v.type} (observed {v.observed_value}, limit "
            f"{v.limit_value}); every process was killed{gone}",
            {"error": "quota_exceeded", "violation": v.to_json(), **output_fields(result)},
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


def error_result(failure: ToolCallError) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=failure.message)],
        structured_content=failure.data,
        is_error=True,
    )


def ok_result(output: BaseModel) -> types.CallToolResult:
    data = output.model_dump(mode="json")
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(data))],
        structured_content=data,
    )
