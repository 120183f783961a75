"""Files in and out of a live sandbox: read, write, list, and copy a tree out to the host.

Every operation runs as a command inside the sandbox (``/bin/sh`` with coreutils, tar and
find, which every driver's image has), so it goes through the same boundary as the task:
the same user, mount view, quotas and timeout, on every driver, with nothing of the
workspace opened by the host process. Paths are relative to the workspace; ``..``,
absolute paths and NUL are refused before anything runs, and inside the sandbox the
resolved path (``realpath``, symlinks followed) must still be in the workspace, so a
link the task planted cannot turn a read or a write into one elsewhere. Bytes cross as
base64 text (binary-safe through the exec's text capture); sizes are capped on both
sides. Copy-out unpacks on the host with ``workspace.unpack_tar`` (the tar "data" rules:
nothing outside the destination, no links out, no devices, no setuid bits).
"""

from __future__ import annotations

import base64
import binascii
import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Final, Literal

from devs_sandbox.base import ExecRequest
from devs_sandbox.errors import SandboxFileError
from devs_sandbox.workspace import unpack_tar

if TYPE_CHECKING:
    from devs_sandbox.lifecycle.sandbox import Sandbox

MiB: Final = 1 << 20
DEFAULT_MAX_READ_BYTES: Final = 16 * MiB
MAX_WRITE_BYTES: Final = 64 * MiB
DEFAULT_MAX_COPY_OUT_BYTES: Final = 64 * MiB
# Exit statuses of the scripts below, so a refusal reads as one clear reason.
_OUTSIDE: Final = 3
_NOT_FOUND: Final = 4
_WRONG_TYPE: Final = 5
_TOO_BIG: Final = 6
_REASONS: Final = {
    _OUTSIDE: "resolves outside the workspace (a symlink?)",
    _NOT_FOUND: "no such file or directory",
    _WRONG_TYPE: "is not a regular file",
    _TOO_BIG: "is larger than the limit",
}

# "$1" the path; the resolved path must be the workspace itself or below it.
_CONFINE: Final = (
    'ws=$(pwd -P); p=$(realpath -e -- "$1" 2>/dev/null) || exit 4; '
    'case "$p" in "$ws"|"$ws"/*) ;; *) exit 3;; esac; '
)
_READ: Final = (
    _CONFINE + '[ -f "$p" ] || exit 5; '
    '[ "$(stat -c %s -- "$p")" -le "$2" ] || exit 6; base64 -w0 -- "$p"'
)
# The parent must resolve inside; the file itself must not be a symlink (it is replaced,
# never followed); the bytes come on stdin as base64.
_WRITE: Final = (
    'ws=$(pwd -P); d=$(dirname -- "$1"); mkdir -p -- "$d" || exit 4; '
    'p=$(realpath -e -- "$d") || exit 4; case "$p" in "$ws"|"$ws"/*) ;; *) exit 3;; esac; '
    'f="$p/$(basename -- "$1")"; [ -L "$f" ] && exit 3; [ -d "$f" ] && exit 5; '
    'base64 -d > "$f" && chmod "$2" -- "$f"'
)
_LIST: Final = (
    _CONFINE + '[ -d "$p" ] || exit 5; '
    "find \"$p\" -mindepth 1 -maxdepth 1 -printf '%y\\t%s\\t%f\\0' | base64 -w0"
)
_COPY_OUT: Final = (
    _CONFINE + 'b=$(basename -- "$p"); '
    '[ "$(du -sb -- "$p" | cut -f1)" -le "$2" ] || exit 6; '
    'tar -C "$(dirname -- "$p")" -cf - -- "$b" | base64 -w0'
)


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One entry of ``list_files``: its name, kind and size in bytes."""

    name: str
    kind: Literal["file", "directory", "symlink", "other"]
    size_bytes: int


def workspace_path(path: str | PurePosixPath) -> str:
    """``path`` as a relative path inside the workspace; refuses ``..``, absolute, NUL."""
    text = str(path)
    pure = PurePosixPath(text)
    if not text or "\0" in text or pure.is_absolute() or ".." in pure.parts:
        raise SandboxFileError(f"{text!r}: a path inside the workspace is needed")
    return text


def _run(
    sandbox: Sandbox,
    script: str,
    args: list[str],
    *,
    stdin: bytes | None = None,
    out_bytes: int = 4096,
    what: str,
) -> str:
    request = ExecRequest(
        ("/bin/sh", "-c", script, "devs-sandbox-files", *args),
        stdin=stdin,
        max_output_bytes=out_bytes,
    )
    result = sandbox.exec(request)
    if result.exit_code in _REASONS:
        raise SandboxFileError(f"{what}: {_REASONS[result.exit_code]}")
    if result.exit_code != 0 or result.stdout.truncated:
        detail = result.stderr.text.strip().splitlines()[-1:] or [f"exit {result.exit_code}"]
        raise SandboxFileError(f"{what}: failed in the sandbox ({detail[0]})")
    return result.stdout.text


def _b64_len(n: int) -> int:
    return 4 * ((n + 2) // 3) + 16


def read_file(sandbox: Sandbox, path: str, *, max_bytes: int = DEFAULT_MAX_READ_BYTES) -> bytes:
    rel = workspace_path(path)
    out = _run(sandbox, _READ, [rel, str(max_bytes)], out_bytes=_b64_len(max_bytes), what=rel)
    try:
        return base64.b64decode(out, validate=True)
    except binascii.Error:
        raise SandboxFileError(f"{rel}: the sandbox answered with something else") from None


def write_file(sandbox: Sandbox, path: str, data: bytes, *, mode: int = 0o644) -> None:
    rel = workspace_path(path)
    if len(data) > MAX_WRITE_BYTES:
        raise SandboxFileError(f"{rel}: {len(data)} bytes, over the {MAX_WRITE_BYTES} limit")
    if not 0 <= mode <= 0o777:
        raise SandboxFileError(f"{rel}: mode {mode:o} is not a permission mode")
    _run(sandbox, _WRITE, [rel, f"{mode:o}"], stdin=base64.b64encode(data), what=rel)


def list_files(sandbox: Sandbox, path: str = ".", *, max_entries: int = 10_000) -> list[FileEntry]:
    rel = workspace_path(path)
    out = _run(sandbox, _LIST, [rel], out_bytes=_b64_len(max_entries * 300), what=rel)
    kinds: dict[str, Literal["file", "directory", "symlink", "other"]] = {
        "f": "file",
        "d": "directory",
        "l": "symlink",
    }
    entries = []
    for record in base64.b64decode(out).split(b"\0"):
        if not record:
            continue
        kind, size, name = record.decode("utf-8", "surrogateescape").split("\t", 2)
        entries.append(FileEntry(name, kinds.get(kind, "other"), int(size)))
    return sorted(entries, key=lambda e: e.name)


def copy_out(
    sandbox: Sandbox, source: str, dest: Path, *, max_bytes: int = DEFAULT_MAX_COPY_OUT_BYTES
) -> Path:
    """Copy ``source`` (a file or a directory of the workspace) into the host directory
    ``dest`` (made if missing), under its own name; returns the host path it now has."""
    rel = workspace_path(source)
    out = _run(
        sandbox, _COPY_OUT, [rel, str(max_bytes)], out_bytes=_b64_len(2 * max_bytes), what=rel
    )
    try:
        archive = base64.b64decode(out, validate=True)
        names = unpack_tar(archive, dest)
    except (binascii.Error, ValueError, tarfile.TarError) as exc:
        raise SandboxFileError(f"{rel}: could not copy out: {exc}") from None
    return dest / names[0] if names else dest
