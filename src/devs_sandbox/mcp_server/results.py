"""What the agent reads: every outcome of a tool call as one ``CallToolResult``.

``failure_for`` is the one place that turns what the library raised into an error the
agent can act on (the option to change, the output so far); nothing else builds an
``isError`` result.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcp import types
from pydantic import BaseModel, ValidationError

from devs_sandbox.errors import (
    ConfigError,
    DevsSandboxError,
    ExecTimeoutError,
    QuotaExceededError,
    ResourceLimitExceededError,
    SandboxFileError,
    SandboxNotFoundError,
    SandboxPreFlightError,
    SandboxTimeoutError,
    SessionLimitError,
)
from devs_sandbox.models import ExecResult

logger = logging.getLogger(__name__)


class ToolCallError(Exception):
    """A tool's answer that is an error: ``message`` for the model (the first text block),
    ``data`` the details (``error`` names the kind; the second text block, as JSON).
    Raised inside handlers, turned into ``isError`` results in one place."""

    def __init__(
        self,
        message: str,
        data: dict[str, Any],
        attachments: Sequence[types.ImageContent] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.data = data
        self.attachments = tuple(attachments)  # after the text blocks (run_code's images)


@dataclass(frozen=True)
class Answer:
    """A tool's answer with content blocks after its JSON text: the images a ``run_code``
    program left, each once, as MCP image content (the JSON lists them, without bytes)."""

    output: BaseModel
    attachments: tuple[types.ImageContent, ...] = ()


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


def failure_for(
    exc: BaseException, tool: str, output: dict[str, Any] | None = None
) -> ToolCallError:
    """One place that turns what the library raised into what the agent reads; ``output``
    is what the command printed so far (``CallOutput.fields()``), for the kills."""
    printed = output or {}
    ended = _ended(exc)
    if ended is not None:  # how the command ended, beside what it printed
        printed = {**printed, "exit_code": ended.exit_code, "duration_s": ended.duration_s}
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
                **printed,
            },
        )
    if isinstance(exc, SandboxTimeoutError | ExecTimeoutError):
        seconds = exc.timeout_s
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
        return ToolCallError(message, {"error": "timeout", "timeout_s": seconds, **printed})
    if isinstance(exc, QuotaExceededError):
        v = exc.violation
        gone = " and the sandbox destroyed" if tool == "sandbox_exec" else ""
        return ToolCallError(
            f"sandbox quota exceeded: {v.type} (observed {v.observed_value}, limit "
            f"{v.limit_value}); every process was killed{gone}",
            {"error": "quota_exceeded", "violation": v.to_json(), **printed},
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
    if isinstance(exc, SandboxFileError):
        return ToolCallError(str(exc), {"error": "file_error"})
    if isinstance(exc, DevsSandboxError):
        return ToolCallError(str(exc), {"error": "sandbox_error", "type": type(exc).__name__})
    logger.error("tool %s failed", tool, exc_info=exc)
    return ToolCallError(
        f"internal error in {tool}: {type(exc).__name__} (details in the server's log)",
        {"error": "internal_error"},
    )


def _ended(exc: BaseException) -> ExecResult | None:
    if isinstance(exc, ResourceLimitExceededError | ExecTimeoutError):
        return exc.result
    if isinstance(exc, SandboxTimeoutError | QuotaExceededError) and exc.outcome is not None:
        return exc.outcome.result
    return None


def error_result(failure: ToolCallError) -> types.CallToolResult:
    """An ``isError`` result: our message, then its details as JSON, and no structured
    content. Both SDKs accept an error without it (the TypeScript client validates
    ``structuredContent`` against the tool's ``outputSchema`` whenever it is present, even
    on errors; the Python client skips errors), and hosts show errors' text to the model.
    """
    return types.CallToolResult(
        content=[
            types.TextContent(type="text", text=failure.message),
            types.TextContent(type="text", text=_json(failure.data)),
            *failure.attachments,
        ],
        is_error=True,
    )


def ok_result(output: BaseModel | Answer, *, structured: bool) -> types.CallToolResult:
    """A tool's answer as one JSON text block; with ``structured`` (a tool that declares
    an ``outputSchema``: the small answers) also as ``structuredContent``. A run tool's
    answer carries the command's output and goes once, in the text block only, which
    every host shows its model (some show ``structuredContent`` instead when present).
    An ``Answer``'s attachments (images) follow the text block."""
    answer = output if isinstance(output, Answer) else Answer(output)
    attachments = answer.attachments
    data = answer.output.model_dump(mode="json")
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=_json(data)), *attachments],
        structured_content=data if structured else None,
    )


def _json(data: dict[str, Any]) -> str:
    # Compact, and non-ASCII as itself: an escape per character would inflate the output.
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))
