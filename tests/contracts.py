"""The documented output contracts, written down once, independently of the code."""

from __future__ import annotations

import json
from typing import Any

# `devs-sandbox run --json` (README, issue 2's CLI contract).
RUN_JSON_KEYS = frozenset(
    {
        "sandbox_id",
        "driver",
        "isolation",
        "exit_code",
        "stdout",
        "stderr",
        "stdout_truncated",
        "stderr_truncated",
        "duration_s",
        "timed_out",
        "resources",
        "violation",
        "warnings",
        "node",
    }
)
# The one stderr line a run prints before the task when default layers are missing
# (a host without cgroups, say): not the task's output.
WEAKER_ISOLATION_WARNING = "devs-sandbox: warning: running with weaker isolation: "


def task_stderr(stderr: str) -> str:
    """The task's own stderr, less devs-sandbox's weaker-isolation warning line."""
    return "".join(
        line
        for line in stderr.splitlines(keepends=True)
        if not line.startswith(WEAKER_ISOLATION_WARNING)
    )


RESOURCE_KEYS = frozenset({"cpu_time_s", "peak_memory_bytes", "peak_processes"})

# The MCP run tools' answer (run_shell_monitored, sandbox_exec; issues 5 and 13): one JSON
# text block, and these keys in it (a kill's error details carry the output keys too).
SHELL_OUTPUT_KEYS = frozenset(
    {
        "exit_code",
        "stdout",
        "stderr",
        "stdout_truncated",
        "stderr_truncated",
        "stdout_bytes",
        "stderr_bytes",
        "stdout_binary",
        "stderr_binary",
        "encoding",
        "duration_s",
    }
)


def tool_answer(result: Any) -> dict[str, Any]:
    """The data of an MCP tool result (an SDK's ``CallToolResult``), checking its shape:

    - an error: our message, then its details as JSON; no structured content (the
      TypeScript client would check it against the tool's output schema);
    - a tool with an output schema: the JSON text and the same structured content;
    - a run tool (no output schema): one JSON text block, the output sent once;
    - after the text, ``run_code``'s images as image content (checked by the caller).
    """
    blocks = list(result.content)
    while blocks and getattr(blocks[-1], "type", None) == "image":
        blocks.pop()
    assert all(getattr(c, "type", None) == "text" for c in blocks), result
    texts = [getattr(c, "text", None) for c in blocks]
    if result.is_error:
        assert result.structured_content is None, result
        assert len(texts) == 2 and all(isinstance(t, str) for t in texts), result
        details: dict[str, Any] = json.loads(texts[1])
        return details
    assert len(texts) == 1 and isinstance(texts[0], str), result
    data: dict[str, Any] = json.loads(texts[0])
    if result.structured_content is not None:
        assert result.structured_content == data, result
    return data
