"""``run_shell_monitored``: one command in a fresh sandbox, destroyed afterwards.

REQ: 3_MCP-REQ-SEC-002: the command runs under the RSS/CPU monitor.
"""

from __future__ import annotations

import base64
import functools
import shlex
from typing import Any, Final

from mcp import types
from pydantic import Field, create_model

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
from devs_sandbox.tools.code import LANGUAGES, OUTPUT_DIR, Language, spec_of
from devs_sandbox.tools.shell import run_shell_monitored

MAX_CODE_BYTES: Final = 256 * 1024  # a program an agent writes, not a dataset


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
        ),
        ToolSpec(
            "run_code",
            "Run a program in a fresh sandbox, destroyed afterwards: its code is written to "
            f"main.py / main.js / main.sh in an empty workspace (with an {OUTPUT_DIR}/ "
            "directory) and run with python3, node or bash. Refused before anything runs when "
            "this server's driver lacks the language. Returns JSON as run_shell_monitored. "
            + monitor_description(env.config),
            create_model(
                "RunCodeArgs",
                __base__=Args,
                language=(Language, Field(description=f"One of {', '.join(LANGUAGES)}.")),
                code=(str, Field(min_length=1, max_length=MAX_CODE_BYTES)),
                **monitor_fields(env.config),
                **output_fields(env.config),
            ),
            ShellOutput,
            functools.partial(run_code, env),
            types.ToolAnnotations(destructive_hint=False, open_world_hint=False),
            structured=False,
        ),
    ]


async def run_code(env: ToolEnv, args: Any, call: ToolCall) -> ShellOutput:
    """``run_shell_monitored`` of the program: the runtime gate first, then the code (as
    base64, shell-safe) written into the workspace and run under the same monitor."""
    spec = spec_of(args.language)
    try:
        env.manager.config_for(env.sandbox_config, spec.argv)
    except Exception as exc:
        raise failure_for(exc, "run_code", {}) from exc
    payload = base64.b64encode(args.code.encode()).decode("ascii")
    command = (
        f"mkdir -p {OUTPUT_DIR} && printf %s {payload} | base64 -d > {spec.file_name} && "
        f"exec {shlex.join(spec.argv)}"
    )
    return await run_shell(env, args.model_copy(update={"command": command}), call)


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
