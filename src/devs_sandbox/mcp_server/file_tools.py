"""The file tools: read, write and list files of a session sandbox's workspace.

Thin shells over ``Sandbox.read_file/write_file/list_files`` (``lifecycle/files.py``):
each runs inside the sandbox, paths are confined to its workspace (``..``, absolute paths
and symlinks out are refused), sizes are capped. Text or base64 both ways; a file that is
not UTF-8 is never mangled into text: it comes back as base64, and says so. The same
tenancy as every ``sandbox_*`` tool: another session's sandbox reads as no sandbox.
"""

from __future__ import annotations

import base64
import binascii
import functools
from typing import Final, Literal

from mcp import types
from pydantic import BaseModel, Field

from devs_sandbox.lifecycle.aio import run_blocking
from devs_sandbox.lifecycle.files import DEFAULT_MAX_READ_BYTES, MAX_WRITE_BYTES
from devs_sandbox.mcp_server.env import ToolEnv
from devs_sandbox.mcp_server.progress import ToolCall
from devs_sandbox.mcp_server.results import ToolCallError
from devs_sandbox.mcp_server.schemas import Args, SandboxId, ToolSpec
from devs_sandbox.mcp_server.tenancy import session_required

Encoding = Literal["text", "base64"]
MAX_PATH_CHARS: Final = 4096
Path_ = Field(min_length=1, max_length=MAX_PATH_CHARS, description="Relative to the workspace.")


class ReadArgs(Args):
    sandbox_id: SandboxId
    path: str = Path_
    encoding: Encoding = Field("text", description="text (UTF-8) or base64 (exact bytes).")
    max_bytes: int = Field(
        1 << 20, ge=1, le=DEFAULT_MAX_READ_BYTES, description="Refuse a larger file."
    )


class ReadOutput(BaseModel):
    sandbox_id: str
    path: str
    size_bytes: int
    encoding: Encoding = Field(description="base64 when the file is not UTF-8 text.")
    content: str


class WriteArgs(Args):
    sandbox_id: SandboxId
    path: str = Path_
    content: str = Field(description="The file's new content, in the given encoding.")
    encoding: Encoding = "text"
    executable: bool = Field(False, description="Mode 755 instead of 644.")


class WriteOutput(BaseModel):
    sandbox_id: str
    path: str
    size_bytes: int


class ListArgs(Args):
    sandbox_id: SandboxId
    path: str = Field(".", min_length=1, max_length=MAX_PATH_CHARS)


class Entry(BaseModel):
    name: str
    kind: Literal["file", "directory", "symlink", "other"]
    size_bytes: int


class ListOutput(BaseModel):
    sandbox_id: str
    path: str
    entries: list[Entry]


def tools(env: ToolEnv) -> list[ToolSpec]:
    confined = (
        " Paths are relative to the workspace; .., absolute paths and symlinks that lead "
        "out of it are refused."
    )
    return [
        ToolSpec(
            "sandbox_read_file",
            "Read a file of a sandbox from sandbox_create." + confined,
            ReadArgs,
            ReadOutput,
            functools.partial(read, env),
            types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
        ),
        ToolSpec(
            "sandbox_write_file",
            f"Create or replace a file (parents made) in a sandbox from sandbox_create, at "
            f"most {MAX_WRITE_BYTES} bytes." + confined,
            WriteArgs,
            WriteOutput,
            functools.partial(write, env),
            types.ToolAnnotations(destructive_hint=True, open_world_hint=False),
        ),
        ToolSpec(
            "sandbox_list_files",
            "List a directory of a sandbox from sandbox_create." + confined,
            ListArgs,
            ListOutput,
            functools.partial(list_, env),
            types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
        ),
    ]


async def read(env: ToolEnv, args: ReadArgs, call: ToolCall) -> ReadOutput:
    if not call.caller.session:
        raise session_required("sandbox_read_file")

    def work() -> bytes:
        with env.sessions.use(args.sandbox_id, owner=call.caller.owner) as sandbox:
            return sandbox.read_file(args.path, max_bytes=args.max_bytes)

    data = await run_blocking(work, name="devs-sandbox-read-file")
    encoding: Encoding = args.encoding
    if encoding == "text":
        try:
            content = data.decode("utf-8")
        except UnicodeDecodeError:
            encoding = "base64"  # never mangled: the exact bytes, and the answer says so
    if encoding == "base64":
        content = base64.b64encode(data).decode("ascii")
    return ReadOutput(
        sandbox_id=args.sandbox_id,
        path=args.path,
        size_bytes=len(data),
        encoding=encoding,
        content=content,
    )


async def write(env: ToolEnv, args: WriteArgs, call: ToolCall) -> WriteOutput:
    if not call.caller.session:
        raise session_required("sandbox_write_file")
    if args.encoding == "base64":
        try:
            data = base64.b64decode(args.content, validate=True)
        except binascii.Error:
            raise ToolCallError(
                "content: not valid base64", {"error": "invalid_arguments", "key": "content"}
            ) from None
    else:
        data = args.content.encode("utf-8")

    def work() -> None:
        with env.sessions.use(args.sandbox_id, owner=call.caller.owner) as sandbox:
            sandbox.write_file(args.path, data, mode=0o755 if args.executable else 0o644)

    await run_blocking(work, name="devs-sandbox-write-file")
    return WriteOutput(sandbox_id=args.sandbox_id, path=args.path, size_bytes=len(data))


async def list_(env: ToolEnv, args: ListArgs, call: ToolCall) -> ListOutput:
    if not call.caller.session:
        raise session_required("sandbox_list_files")

    def work() -> list[Entry]:
        with env.sessions.use(args.sandbox_id, owner=call.caller.owner) as sandbox:
            return [
                Entry(name=e.name, kind=e.kind, size_bytes=e.size_bytes)
                for e in sandbox.list_files(args.path)
            ]

    entries = await run_blocking(work, name="devs-sandbox-list-files")
    return ListOutput(sandbox_id=args.sandbox_id, path=args.path, entries=entries)
