"""What the tools take and answer: argument and output models, and each tool's listing.

Arguments are strict (JSON types, unknown keys refused: an agent's ``timeout`` for
``timeout_s`` must not be silently ignored) and carry the configured defaults and bounds
in their JSON Schema, so ``tools/list`` tells an agent what the server will accept.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from mcp import types
from pydantic import BaseModel, ConfigDict, Field, field_validator

from devs_sandbox.config import (
    MAX_CPU_SUSTAINED_MS,
    MAX_POLL_INTERVAL_MS,
    MIN_POLL_INTERVAL_MS,
    MIN_RSS_LIMIT_BYTES,
    DevsConfig,
)
from devs_sandbox.models import SANDBOX_ID_PATTERN
from devs_sandbox.monitors.usage import cpu_busy_threshold

if TYPE_CHECKING:
    from devs_sandbox.mcp_server.progress import ToolCall
    from devs_sandbox.mcp_server.results import Answer

DEFAULT_VIOLATIONS_LIMIT: Final = 20
MIN_OUTPUT_BYTES: Final = 64  # as sandbox.maxOutputBytes
MAX_VIOLATIONS_LIMIT: Final = 1_000

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


class Args(BaseModel):
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


def monitor_fields(cfg: DevsConfig) -> dict[str, Any]:
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


def output_fields(cfg: DevsConfig) -> dict[str, Any]:
    """How much of a command's output comes back, and how: the run tools' last arguments."""
    ceiling = cfg.sandbox.max_output_bytes
    return {
        "max_output_bytes": (
            int,
            Field(
                default=min(cfg.mcp.max_output_bytes, ceiling),
                ge=MIN_OUTPUT_BYTES,
                le=ceiling,
                description="Bytes kept of each of stdout and stderr: the first and the last "
                "halves when there is more (the middle is dropped and counted).",
            ),
        ),
        "output_encoding": (
            Literal["text", "base64"],
            Field(
                default="text",
                description="text: UTF-8, bytes that are not read U+FFFD and the stream is "
                "flagged *_binary; base64: the bytes exactly.",
            ),
        ),
    }


def monitor_description(cfg: DevsConfig) -> str:
    """The kill conditions of a run tool, in its description, with the configured defaults."""
    mcp = cfg.mcp
    busy = cpu_busy_threshold(mcp.cpu_sustained_ms)
    return (
        f"Killed (SIGKILL to every process) when its process tree's resident memory exceeds "
        f"rss_limit_bytes (default {mcp.rss_limit_bytes}), or when it keeps a full core busy "
        f"(on average >= {busy:g}% of one core, counting time waiting for a CPU) over "
        "cpu_sustained_ms "
        f"(default {mcp.cpu_sustained_ms}); a kill is an error result with structured "
        "{pid, reason, value, limit}."
    )


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


class CreateArgs(Args):
    quotas: QuotaArgs | None = Field(
        None, description="Optional limits, each at most the server's configured one."
    )


class DestroyArgs(Args):
    sandbox_id: SandboxId


class ViolationsArgs(Args):
    limit: int = Field(
        DEFAULT_VIOLATIONS_LIMIT, ge=1, le=MAX_VIOLATIONS_LIMIT, description="Most rows returned."
    )
    sandbox_id: SandboxId | None = Field(None, description="Only this sandbox's rows.")


class ShellOutput(BaseModel):
    """What a command printed and how it ended, when it ended on its own: the JSON text of
    a run tool's answer (the error answers of a kill carry the same output fields)."""

    exit_code: int = Field(description="The command's status; 128+N when signal N ended it.")
    stdout: str = Field(description="Text, or base64 with output_encoding='base64'.")
    stderr: str
    stdout_truncated: bool = Field(
        description="The middle of stdout was dropped (head and tail kept)."
    )
    stderr_truncated: bool
    stdout_bytes: int = Field(description="Bytes the command wrote to stdout in all.")
    stderr_bytes: int
    stdout_binary: bool = Field(
        description="stdout is not UTF-8 text: as text its invalid bytes read U+FFFD; ask "
        "output_encoding='base64' for the bytes."
    )
    stderr_binary: bool
    encoding: Literal["text", "base64"]
    duration_s: float


class ImageListing(BaseModel):
    """An image ``run_code`` returns as MCP image content (its bytes are there, once)."""

    name: str = Field(description="File name in outputs/.")
    mime_type: Literal["image/png", "image/jpeg", "image/gif", "image/webp", "image/svg+xml"]
    size_bytes: int


class SkippedListing(BaseModel):
    """A file of outputs/ named as an image and not returned."""

    name: str
    reason: str = Field(description="Why: a symlink, its content, a size limit, ...")
    size_bytes: int


class RunCodeOutput(ShellOutput):
    """``run_code``'s answer when its program left files named as images in outputs/
    (without any, its answer is ``ShellOutput``, unchanged)."""

    images: list[ImageListing] = Field(
        description="The images returned as image content after this JSON, in this order."
    )
    skipped_images: list[SkippedListing]


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


# -- listings -------------------------------------------------------------------------------
Handler = Callable[[Any, "ToolCall"], Awaitable["BaseModel | Answer"]]


@dataclass(frozen=True)
class ToolSpec:
    """A tool: its arguments, its handler, and its answer's model. ``structured`` tools
    declare that model as ``outputSchema`` and answer with ``structuredContent`` too; the
    run tools, whose answer carries a command's output, answer in one text block (see
    ``results.ok_result``) and declare none."""

    name: str
    description: str
    args: type[BaseModel]
    output: type[BaseModel]
    handler: Handler
    annotations: types.ToolAnnotations
    structured: bool = True

    def listing(self) -> types.Tool:
        schema = inline_refs(self.output.model_json_schema()) if self.structured else None
        return types.Tool(
            name=self.name,
            description=self.description,
            input_schema=inline_refs(self.args.model_json_schema()),
            output_schema=schema,
            annotations=self.annotations,
        )


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
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
