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
from devs_sandbox.mcp_server.schemas import (
    Args,
    Command,
    ShellOutput,
    ToolSpec,
    monitor_description,
    monitor_fields,
)
from devs_sandbox.mcp_server.tenancy import Caller
from devs_sandbox.models import new_sandbox_id
from devs_sandbox.tools.shell import run_shell_monitored


def tools(env: ToolEnv) -> list[ToolSpec]:
    shell_args = create_model(
        "RunShellMonitoredArgs", __base__=Args, command=(Command, ...), **monitor_fields(env.config)
    )
    return [
        ToolSpec(
            "run_shell_monitored",
            "Run a shell command in a fresh sandbox (the server's isolation and quotas; "
            "its workspace is empty) that is destroyed afterwards. Returns exit_code, "
            "stdout, stderr. " + monitor_description(env.config),
            shell_args,
            ShellOutput,
            functools.partial(run_shell, env),
            types.ToolAnnotations(destructive_hint=False, open_world_hint=False),
        )
    ]


async def run_shell(env: ToolEnv, args: Any, caller: Caller) -> ShellOutput:
    # The id is ours to choose, so the caller owns the sandbox (and its audit rows)
    # before it exists; a sessionless caller keeps no record (nothing could ask).
    sandbox_id = new_sandbox_id()
    config = override(env.sandbox_config, sandbox_id=sandbox_id)
    owned = sandbox_id if caller.session else None
    with env.sessions.slot(owner=caller.owner, sandbox_id=owned):
        result = await run_shell_monitored(
            args.command,
            env.options(args),
            manager=env.manager,
            config=config,
            stats=env.stats(),
            scheduler=env.monitor_scheduler,
        )
    return ShellOutput(**result.to_json())
