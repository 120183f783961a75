"""What crosses the Ray boundary between a caller's ``RayDriver`` and a node's host actor.

Only plain, picklable values cross: the library's own frozen records (``SandboxContext``,
``ExecResult``, ``SandboxMetrics``), the validated config, bytes, and the small types
below. Three things cannot cross as they are, and this module says what crosses instead:

- **Callbacks** (``ExecRequest.on_stdout``/``on_stderr``/``on_start``): the request is
  sent without them plus ``StreamWants``; the node streams ``Frame`` batches back (a Ray
  streaming generator) and the caller calls its callbacks with them.
- **Exceptions**: ours do not survive pickling (several take structured arguments, e.g.
  ``WeakerIsolationError(missing)``), and Ray would wrap them anyway. The node answers with
  a ``Reply`` carrying a ``RemoteError``, and ``RemoteError.rebuild`` raises the same type
  on the caller's side, with the node named in its message.
- **Events** a node's local driver emits on its own (a Docker OOM event): the host keeps
  them per sandbox and hands them back in the next ``Reply`` for that sandbox; the caller
  emits them on its own bus, with the node added.

Nothing here imports Ray: the unit tests exercise it without a cluster.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from devs_sandbox import errors
from devs_sandbox.errors import (
    ConfigError,
    DevsSandboxError,
    DriverError,
    IsolationUnavailableError,
    SandboxNotFoundError,
    UnsupportedRuntimeError,
)
from devs_sandbox.workspace import unpack_tar

HOST_ACTOR_PREFIX: Final = "devs-sandbox-host"
STDOUT: Final = 1
STDERR: Final = 2
# A Frame is ("start", pid) | ("out", STDOUT|STDERR, bytes) | ("end", Reply).
Frame = tuple[Any, ...]


def host_actor_name(version: str, node_driver: str, node_id: str) -> str:
    """One host actor per node, node driver and library version: an upgraded caller never
    talks to an actor running older code (the old one keeps serving its own sandboxes)."""
    return f"{HOST_ACTOR_PREFIX}-{version}-{node_driver}-{node_id}"


def short_node(node_id: str) -> str:
    """The 12-character prefix Ray's own tools print for a node id."""
    return node_id[:12]


@dataclass(frozen=True, slots=True)
class StreamWants:
    """Which of the request's callbacks the caller has (so the node forwards only those)."""

    stdout: bool = False
    stderr: bool = False
    start: bool = False

    @property
    def any(self) -> bool:
        return self.stdout or self.stderr or self.start


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node as its host actor sees it: where it is, what it reaped when it started, and
    which isolation layers a default sandbox gets there (``layers``: mechanism -> "" when
    in effect, else why not)."""

    node_id: str
    hostname: str
    ip: str
    boot_id: str
    host_pid: int
    node_driver: str
    version: str
    reaped_at_start: tuple[str, ...] = ()
    layers: dict[str, str] = field(default_factory=dict)
    layers_error: str = ""  # the report could not be made (e.g. no Docker engine there)


@dataclass(frozen=True, slots=True)
class RemoteError:
    """An exception raised on the node, as data: its type name, message and the structured
    fields its constructor needs."""

    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls, exc: BaseException) -> RemoteError:
        fields: dict[str, Any] = {}
        if isinstance(exc, IsolationUnavailableError):
            fields["missing"] = dict(exc.missing)
        elif isinstance(exc, SandboxNotFoundError):
            fields["sandbox_id"] = exc.sandbox_id
            fields["detail"] = exc.detail
        elif isinstance(exc, UnsupportedRuntimeError):
            fields["runtime"] = exc.runtime
            fields["suggested_driver"] = exc.suggested_driver
        elif isinstance(exc, ConfigError):
            fields["key"] = exc.key
        kind = type(exc).__name__
        if not isinstance(exc, DevsSandboxError):
            kind = "ValueError" if isinstance(exc, ValueError) else f"builtins.{kind}"
        return cls(kind, str(exc), fields)

    def rebuild(self, where: str) -> Exception:
        """The exception to raise on the caller's side; ``where`` names the node."""
        cls = getattr(errors, self.kind, None)
        f = self.fields
        exc: Exception
        if self.kind == "ValueError":
            exc = ValueError(self.message)
        elif not (isinstance(cls, type) and issubclass(cls, DevsSandboxError)):
            exc = DriverError(f"{self.kind.removeprefix('builtins.')}: {self.message}")
        elif issubclass(cls, IsolationUnavailableError):
            exc = cls(dict(f.get("missing") or {}))
        elif issubclass(cls, SandboxNotFoundError):
            exc = cls(str(f.get("sandbox_id", "")), str(f.get("detail", "")))
            exc.args = (f"{self.message} on {where}",)
            return exc
        elif issubclass(cls, UnsupportedRuntimeError):
            exc = cls(
                self.message,
                runtime=str(f.get("runtime", "")),
                suggested_driver=f.get("suggested_driver"),
            )
        elif issubclass(cls, ConfigError):
            exc = cls(self.message, key=f.get("key"))
        else:
            try:
                exc = cls(self.message)
            except TypeError:  # a leaf whose constructor wants more than a message
                exc = DriverError(f"{self.kind}: {self.message}")
        exc.args = (f"{where}: {exc}",)
        return exc


@dataclass(frozen=True, slots=True)
class Reply:
    """What every host actor method returns: a value or an error, and the events the
    node's driver emitted for that sandbox since the last reply."""

    value: Any = None
    error: RemoteError | None = None
    events: tuple[tuple[str, dict[str, Any]], ...] = ()


def coalesce(frames: Iterable[Frame]) -> list[Frame]:
    """Merge adjacent output frames of the same stream: one Ray object per batch, not per
    chunk, when a command floods."""
    out: list[Frame] = []
    for frame in frames:
        if frame[0] == "out" and out and out[-1][0] == "out" and out[-1][1] == frame[1]:
            out[-1] = ("out", frame[1], out[-1][2] + frame[2])
        else:
            out.append(frame)
    return out


# -- copy-in ------------------------------------------------------------------------------
def pack_directory(source: Path, limit_bytes: int) -> bytes:
    """``source``'s contents as an uncompressed tar (symlinks kept as links), refused above
    ``limit_bytes`` (the workspace could not hold it anyway)."""
    if not source.is_dir():
        raise ConfigError(f"--copy-in {source}: not a directory", key="sandbox.copyIn")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(source.iterdir()):
            tar.add(entry, arcname=entry.name, recursive=True)
            if buf.tell() > limit_bytes:
                raise ConfigError(
                    f"--copy-in {source}: more than {limit_bytes} bytes "
                    "(quotas.diskBytes), the sandbox's workspace could not hold it",
                    key="sandbox.copyIn",
                )
    return buf.getvalue()


def unpack_directory(data: bytes, target: Path) -> None:
    """Extract what ``pack_directory`` made into ``target`` (``workspace.unpack_tar``: no
    absolute paths, no ``..``, no links out of ``target``, no devices, no setuid bits)."""
    unpack_tar(data, target)
