"""``run_shell_monitored``: one command in a fresh sandbox, destroyed afterwards.

REQ: 3_MCP-REQ-SEC-002: the command runs under the RSS/CPU monitor.
"""

from __future__ import annotations

import functools
from typing import Any

from mcp import types
from pydantic import create_model

from devs_sandbox.config import override
from devs_sandbox.mcp_server.env import ToolEnv
from devs_sandbox.mcp_server.output import CallOutput
from devs_sandbox.mcp_server.progress import ToolCall
from devs_sandbox.mcp_server.results import failure_for
from devs_sandbox.mcp_server.schemas import (
    Args,
    Command,
    ShellOutput,
    ToolSpec,
    monitor_description,
    monitor_fields,
    output_fields,
)
from devs_sandbox.models import new_sandbox_id
from devs_sandbox.tools.shell import run_shell_monitored


def tools(env: ToolEnv) -> list[ToolSpec]:
    shell_args = create_model(
        "RunShellMonitoredArgs",
        __base__=Args,
        command=(Command, ...),
        **monitor_fields(env.config),
        **output_fields(env.config),
    )
    return [
        ToolSpec(
            "run_shell_monitored",
            "Run a shell command in a fresh sandbox (the server's isolation and quotas; "
            "its workspace is empty) that is destroyed afterwards. Returns JSON: exit_code, "
            "stdout, stderr (max_output_bytes of each), and flags. "
            + monitor_description(env.config),
            shell_args,
            ShellOutput,
            functools.partial(run_shell, env),
            types.ToolAnnotations(destructive_hint=False, open_world_hint=False),
            structured=False,
        )
    ]


async def run_shell(env: ToolEnv, args: Any, call: ToolCall) -> ShellOutput:
    caller = call.caller
    # The id is ours to choose, so the caller owns the sandbox (and its audit rows)
    # before it exists; a sessionless caller keeps no record (nothing could ask).
    sandbox_id = new_sandbox_id()
    config = override(env.sandbox_config, sandbox_id=sandbox_id)
    owned = sandbox_id if caller.session else None
    output = CallOutput(args.max_output_bytes, args.output_encoding)
    with env.sessions.slot(owner=caller.owner, sandbox_id=owned):
        try:
            result = await call.with_progress(
                lambda: run_shell_monitored(
                    args.command,
                    env.options(args),
                    manager=env.manager,
                    config=config,
                    stats=env.stats(),
                    scheduler=env.monitor_scheduler,
                    tap=output.tap(),
                ),
                output.progress_message,
            )
        except Exception as exc:
            raise failure_for(exc, "run_shell_monitored", output.fields()) from exc
    return shell_output(result.exit_code, result.duration_s, output)


def shell_output(exit_code: int, duration_s: float, output: CallOutput) -> ShellOutput:
    return ShellOutput(exit_code=exit_code, duration_s=round(duration_s, 6), **output.fields())
