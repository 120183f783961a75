"""The ``sandbox_*`` tools: sandboxes an agent keeps between calls, and the audit trail.

Each sandbox belongs to the caller that created it (``tenancy``); every lookup goes
through ``SandboxSessions`` with the caller's owner, so another tenant's id reads as one
that never existed. A sessionless caller (HTTP 2026-07-28) can keep nothing: these tools
answer it ``session_required``.
"""

from __future__ import annotations

import functools
from typing import Any

from mcp import types
from pydantic import create_model

from devs_sandbox.config import SandboxLifecycleConfig, override
from devs_sandbox.errors import ExecTimeoutError, ResourceLimitExceededError
from devs_sandbox.lifecycle import Sandbox
from devs_sandbox.lifecycle.aio import run_blocking
from devs_sandbox.mcp_server.env import ToolEnv
from devs_sandbox.mcp_server.output import CallOutput
from devs_sandbox.mcp_server.progress import ToolCall
from devs_sandbox.mcp_server.results import ToolCallError, failure_for
from devs_sandbox.mcp_server.run_tools import shell_output
from devs_sandbox.mcp_server.schemas import (
    Args,
    Command,
    CreateArgs,
    CreateOutput,
    DestroyArgs,
    DestroyOutput,
    QuotaArgs,
    SandboxId,
    ShellOutput,
    ToolSpec,
    ViolationRow,
    ViolationsArgs,
    ViolationsOutput,
    monitor_description,
    monitor_fields,
    output_fields,
)
from devs_sandbox.mcp_server.tenancy import session_required


def tools(env: ToolEnv) -> list[ToolSpec]:
    mcp = env.config.mcp
    exec_args = create_model(
        "SandboxExecArgs",
        __base__=Args,
        sandbox_id=(SandboxId, ...),
        command=(Command, ...),
        **monitor_fields(env.config),
        **output_fields(env.config),
    )
    ends = "when the server stops"
    ends = f"when this MCP session ends, or {ends}" if env.multi_tenant else f"or {ends}"
    whose = "this MCP session's sandboxes" if env.multi_tenant else "this host"
    return [
        ToolSpec(
            "sandbox_create",
            "Create a sandbox that keeps its workspace between sandbox_exec calls; returns its "
            f"id. Destroyed by sandbox_destroy, after {mcp.session_idle_timeout_s:g} s without "
            f"a call, {mcp.session_timeout_s:g} s after creation, {ends}.",
            CreateArgs,
            CreateOutput,
            functools.partial(create, env),
            types.ToolAnnotations(destructive_hint=False, open_world_hint=False),
        ),
        ToolSpec(
            "sandbox_exec",
            "Run a shell command in the workspace of a sandbox from sandbox_create (files "
            "persist between calls). "
            + monitor_description(env.config)
            + " The sandbox survives a kill; if a kill or a quota ends it, the error says "
            "so (and why) on the call that caused it.",
            exec_args,
            ShellOutput,
            functools.partial(exec_, env),
            types.ToolAnnotations(destructive_hint=True, open_world_hint=False),
            structured=False,
        ),
        ToolSpec(
            "sandbox_destroy",
            "Destroy a sandbox from sandbox_create: its processes and its workspace.",
            DestroyArgs,
            DestroyOutput,
            functools.partial(destroy, env),
            types.ToolAnnotations(destructive_hint=True, open_world_hint=False),
        ),
        ToolSpec(
            "sandbox_violations",
            f"Recent quota and resource-limit violations of {whose}, newest first.",
            ViolationsArgs,
            ViolationsOutput,
            functools.partial(violations, env),
            types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
        ),
    ]


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(p.capitalize() for p in rest)


def _session_config(env: ToolEnv, quotas: QuotaArgs | None) -> SandboxLifecycleConfig:
    """The server's sandbox config with the agent's quotas, each at most the server's."""
    if quotas is None:
        return env.sandbox_config
    mine = env.sandbox_config.quotas
    asked = quotas.model_dump(exclude_none=True)
    for key, value in asked.items():
        ceiling = getattr(mine, key)
        if ceiling is not None and value > ceiling:
            raise ToolCallError(
                f"quotas.{key} {value} is above this server's limit {ceiling} "
                f"(sandbox.quotas.{_camel(key)}); ask for at most that",
                {"error": "invalid_arguments", "key": f"quotas.{key}", "limit": ceiling},
            )
    return override(env.sandbox_config, quotas=asked)


async def create(env: ToolEnv, args: CreateArgs, call: ToolCall) -> CreateOutput:
    caller = call.caller
    if not caller.session:
        raise session_required("sandbox_create")
    cfg = _session_config(env, args.quotas)
    sandbox = await run_blocking(
        functools.partial(_create_session, env, cfg, caller.owner),
        discard=lambda sb: env.sessions.end(sb.id, "its sandbox_create call was cancelled"),
        name="devs-sandbox-create",
    )
    return CreateOutput(
        sandbox_id=sandbox.id,
        workspace=str(sandbox.workspace),
        isolation=list(sandbox.isolation),
        idle_timeout_s=env.sessions.idle_timeout_s,
        expires_in_s=round(env.sessions.remaining_s(sandbox.id, owner=caller.owner), 3),
    )


def _create_session(env: ToolEnv, cfg: SandboxLifecycleConfig, owner: str) -> Sandbox:
    sandbox = env.sessions.create(cfg, owner=owner)
    if cfg.preflight_commands:
        try:
            # The same preflight, budget and errors as a one-shot run.
            env.manager.run_preflight(sandbox, cfg)
        except BaseException:
            env.sessions.end(sandbox.id, "its preflight failed")
            raise
    return sandbox


async def exec_(env: ToolEnv, args: Any, call: ToolCall) -> ShellOutput:
    caller = call.caller
    if not caller.session:
        raise session_required("sandbox_exec")
    sandbox_id: str = args.sandbox_id
    output = CallOutput(args.max_output_bytes, args.output_encoding)
    try:
        result = await call.with_progress(
            lambda: run_blocking(
                lambda: env.sessions.exec(
                    sandbox_id,
                    args.command,
                    env.options(args),
                    timeout_s=args.timeout_s,
                    owner=caller.owner,
                    stats=env.stats(),
                    scheduler=env.monitor_scheduler,
                    tap=output.tap(),
                ),
                on_cancel=lambda: env.sessions.kill(sandbox_id, owner=caller.owner),
                name=f"devs-sandbox-exec-{sandbox_id}",
            ),
            output.progress_message,
        )
    except Exception as exc:
        failure = failure_for(exc, "sandbox_exec", output.fields())
        gone = ""
        if isinstance(exc, ResourceLimitExceededError | ExecTimeoutError):
            gone = env.sessions.ended_why(sandbox_id, caller.owner)
        if gone:  # the kill took the sandbox with it: say so on this call
            failure = ToolCallError(
                f"{failure.message}; the sandbox is gone: {gone}",
                {**failure.data, "sandbox_gone": gone},
            )
        raise failure from exc
    return shell_output(result.exit_code, result.duration_s, output)


async def destroy(env: ToolEnv, args: DestroyArgs, call: ToolCall) -> DestroyOutput:
    caller = call.caller
    if not caller.session:
        raise session_required("sandbox_destroy")
    await run_blocking(
        lambda: env.sessions.destroy(args.sandbox_id, owner=caller.owner),
        name="devs-sandbox-destroy",
    )
    return DestroyOutput(sandbox_id=args.sandbox_id, destroyed=True)


async def violations(env: ToolEnv, args: ViolationsArgs, call: ToolCall) -> ViolationsOutput:
    caller = call.caller
    if not caller.session:
        raise session_required("sandbox_violations")
    store = env.manager.store
    if store is None:
        return ViolationsOutput(violations=[])
    # The caller's own sandboxes, filtered in SQL; the store itself knows no owners.
    ids = None if caller.sees_all_rows else env.sessions.owned_ids(caller.owner)
    rows = await run_blocking(
        lambda: store.list(sandbox_id=args.sandbox_id, sandbox_ids=ids, limit=args.limit),
        name="devs-sandbox-violations",
    )
    return ViolationsOutput(violations=[ViolationRow(**r) for r in rows])
