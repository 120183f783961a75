"""The documented output contracts, written down once, independently of the code."""

from __future__ import annotations

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

# The MCP tool run_shell_monitored's structured output (issue 5).
SHELL_OUTPUT_KEYS = frozenset(
    {"exit_code", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "duration_s"}
)
