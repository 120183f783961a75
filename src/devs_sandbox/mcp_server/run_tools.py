"""``run_shell_monitored``: one command in a fresh sandbox, destroyed afterwards.

REQ: 3_MCP-REQ-SEC-002: the command runs under the RSS/CPU monitor.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Final

from mcp import types
from pydantic import Field, create_model

from devs_sandbox.config import override
from devs_sandbox.mcp_server.env import ToolEnv
from devs_sandbox.mcp_server.output import CallOutput
from devs_sandbox.mcp_server.progress import ToolCall
from devs_sandbox.mcp_server.results import Answer, ToolCallError, failure_for
from devs_sandbox.mcp_server.schemas import (
    Args,
    Command,
    RunCodeOutput,
    ShellOutput,
    ToolSpec,
    monitor_description,
    monitor_fields,
    output_fields,
)
from devs_sandbox.models import new_sandbox_id
from devs_sandbox.tools.code import LANGUAGES, OUTPUT_DIR, Language, prepare, spec_of
from devs_sandbox.tools.outputs import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_IMAGES_TOTAL_BYTES,
    OUTPUT_DIR_ENV,
    OutputImages,
    collect_images,
)
from devs_sandbox.tools.shell import SandboxStep, run_shell_monitored

if TYPE_CHECKING:
    from devs_sandbox.lifecycle import Sandbox

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
            f"main.py / main.js / main.sh in an empty workspace (with an empty {OUTPUT_DIR}/ "
            f"directory, its absolute path in ${OUTPUT_DIR_ENV}) and run with python3, node "
            "or bash. Refused before anything runs when this server's driver lacks the "
            "language. Returns JSON as run_shell_monitored; png, jpeg, gif, webp and svg "
            f"files the program saved in {OUTPUT_DIR}/ (not its subdirectories) come back as "
            f"image content after the JSON (at most {MAX_IMAGES}, {MAX_IMAGE_BYTES} bytes "
            f"each, {MAX_IMAGES_TOTAL_BYTES} in all), listed in its images; files named as "
            "images but not returned (a symlink, content of another type, too big) are "
            "listed in skipped_images with the reason. " + monitor_description(env.config),
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


async def run_code(env: ToolEnv, args: Any, call: ToolCall) -> ShellOutput | Answer:
    """``run_shell_monitored`` of the program: the runtime gate first, then the code written
    into the workspace (``Sandbox.write_file``) and run under the same monitor; the images
    it left in ``outputs/`` are read before the sandbox goes, however the program ended."""
    spec = spec_of(args.language)
    try:
        env.manager.config_for(env.sandbox_config, spec.argv)
    except Exception as exc:
        raise failure_for(exc, "run_code", {}) from exc
    found: list[OutputImages] = []
    code = args.code

    def write(sandbox: Sandbox) -> None:
        prepare(sandbox, code, args.language)

    def collect(sandbox: Sandbox) -> None:
        found.append(collect_images(sandbox))

    shell_args = args.model_copy(update={"command": spec.command()})
    try:
        output = await run_shell(env, shell_args, call, prepare=write, finish=collect)
    except ToolCallError as failure:
        images = found[0] if found else OutputImages()
        if images:  # a kill after the program saved plots: they come back with the error
            failure.data.update(images.to_json())
            failure.attachments = image_content(images)
        raise
    images = found[0] if found else OutputImages()
    if not images:
        return output
    listed = RunCodeOutput(**output.model_dump(), **images.to_json())
    return Answer(listed, image_content(images))


def image_content(images: OutputImages) -> tuple[types.ImageContent, ...]:
    return tuple(
        types.ImageContent(type="image", data=i.base64(), mime_type=i.mime_type)
        for i in images.images
    )


async def run_shell(
    env: ToolEnv,
    args: Any,
    call: ToolCall,
    *,
    prepare: SandboxStep | None = None,
    finish: SandboxStep | None = None,
) -> ShellOutput:
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
                    prepare=prepare,
                    finish=finish,
                ),
                output.progress_message,
            )
        except Exception as exc:
            raise failure_for(exc, "run_shell_monitored", output.fields()) from exc
    return shell_output(result.exit_code, result.duration_s, output)


def shell_output(exit_code: int, duration_s: float, output: CallOutput) -> ShellOutput:
    return ShellOutput(exit_code=exit_code, duration_s=round(duration_s, 6), **output.fields())
