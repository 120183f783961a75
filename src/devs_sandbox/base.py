"""The seams, as Protocols: what a driver, a clock/scheduler and a killable thing must offer.

A driver does infrastructure only: create, run, sample, kill, destroy, and
return plain data (``models``). It never calls the lifecycle or a monitor; facts
that arrive on their own (an engine's OOM event) leave through an ``emit``
callable handed to it. That keeps the Docker and Kubernetes drivers
interchangeable with the process driver and with ``FakeDriver`` in tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from devs_sandbox.config import SandboxLifecycleConfig
    from devs_sandbox.errors import QuotaExceededError
    from devs_sandbox.models import ExecResult, SandboxContext, SandboxMetrics, TreeSample

OutputCallback = Callable[[bytes], None]
# Called once with the host pid of the exec's leader process, right after it was confined
# and released (for observers such as run_shell_monitored that sample its process tree).
StartCallback = Callable[[int], None]
Emit = Callable[[str, dict[str, Any]], Any]


@dataclass(frozen=True, slots=True)
class ExecRequest:
    """One command to run in a sandbox: everything a driver's ``exec`` needs, in one
    frozen value that crosses lifecycle -> driver unchanged, so the signature lives once.

    ``argv`` is run as given (a shell command is ``("/bin/sh", "-c", cmd)``); ``env`` is
    added to the sandbox's own environment; ``cwd`` is a directory relative to the
    workspace (None: the workspace). ``timeout_s``/``idle_timeout_s`` bound this exec only
    (the sandbox's total timeout still holds); ``max_output_bytes`` caps each of stdout and
    stderr (None: the sandbox's ``maxOutputBytes``). Callbacks get redacted chunks as they
    come; ``on_start`` the host pid of the exec's leader, once confined.
    """

    argv: tuple[str, ...]
    stdin: bytes | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float | None = None
    idle_timeout_s: float | None = None
    max_output_bytes: int | None = None
    on_stdout: OutputCallback | None = None
    on_stderr: OutputCallback | None = None
    on_start: StartCallback | None = None

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError("command must not be empty (a sequence of strings)")
        if any("\0" in a for a in self.argv):
            raise ValueError("embedded null byte in the command")
        # Any name a kernel environment can carry; drivers that export through a shell
        # (the process driver) also require a shell name (models.ENV_NAME).
        for name, value in self.env.items():
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"invalid environment variable name {name!r}")
            if "\0" in value:
                raise ValueError(f"embedded null byte in environment variable {name}")
        for label, seconds in (
            ("timeout_s", self.timeout_s),
            ("idle_timeout_s", self.idle_timeout_s),
        ):
            if seconds is not None and not 0 < seconds < float("inf"):
                raise ValueError(f"{label} must be a positive number of seconds")
        if self.max_output_bytes is not None and self.max_output_bytes < 0:
            raise ValueError("max_output_bytes must be >= 0")
        if self.cwd is not None:
            parts = PurePosixPath(self.cwd).parts
            if PurePosixPath(self.cwd).is_absolute() or ".." in parts or "\0" in self.cwd:
                raise ValueError(f"cwd {self.cwd!r} must be a path inside the workspace")

    @classmethod
    def of(cls, command: str | Sequence[str], **fields: Any) -> ExecRequest:
        """``command`` as a shell string (run with ``/bin/sh -c``) or an argv."""
        if isinstance(command, str):
            if not command.strip():
                raise ValueError("command must not be empty")
            argv: tuple[str, ...] = ("/bin/sh", "-c", command)
        else:
            argv = tuple(command)
        env = fields.pop("env", None)
        return cls(argv, env=dict(env or {}), **fields)

    def replace(self, **changes: Any) -> ExecRequest:
        return dataclasses.replace(self, **changes)


@runtime_checkable
class SandboxDriver(Protocol):
    """What every backend implements, optional capabilities included (a driver with
    nothing to say answers with an empty value: no pids, no runtimes, a no-op close).

    ``destroy`` is idempotent and safe after a partial ``provision``; ``force_stop``
    kills every process but keeps the sandbox for inspection.
    """

    name: str

    def provision(
        self,
        config: SandboxLifecycleConfig,
        *,
        secrets: Mapping[str, bytes | bytearray] | None = None,
    ) -> SandboxContext:
        """``secrets`` reach the sandbox as files named by ``NAME_FILE``, never in argv or
        environment, and are redacted from its output."""
        ...

    def exec(self, ctx: SandboxContext, request: ExecRequest) -> ExecResult: ...

    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics: ...

    def is_running(self, ctx: SandboxContext) -> bool: ...

    def force_stop(self, ctx: SandboxContext) -> None: ...

    def destroy(self, ctx: SandboxContext) -> None: ...

    def isolation_report(self, config: SandboxLifecycleConfig) -> dict[str, str]:
        """Mechanism -> "" when it would be in effect for ``config``, else why not."""
        ...

    def reap_orphans(self) -> list[str]:
        """Destroy sandboxes of this driver whose owner process is dead; return their ids."""
        ...

    def member_pids(self, ctx: SandboxContext) -> list[int]:
        """Host pids of every process of the sandbox (its cgroup), for observers that
        sample process trees; empty when the driver cannot tell."""
        ...

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None:
        """Runtimes (python, node, go, rust) the driver provides for ``config``; None when
        it cannot tell."""
        ...

    def on_quota_exceeded(self, ctx: SandboxContext, error: QuotaExceededError) -> None:
        """Infrastructure to release when a run ends in a quota violation (Docker routes a
        full workspace to its ResourceExhaustionHandler); usually nothing."""
        ...

    def close(self) -> None:
        """Release process-wide resources (watcher threads, warm containers)."""
        ...


class Killable(Protocol):
    """Anything the timeout enforcer can SIGKILL: a Popen, or a whole sandbox."""

    def kill(self) -> None: ...


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Scheduler(Protocol):
    """Monotonic time and delayed calls; the real one is a thread, the fake one is manual."""

    def now(self) -> float: ...

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> TimerHandle: ...


class ProcessStatsSource(Protocol):
    """Samples the process tree under one pid, for run_shell_monitored's monitor.

    Stateful: CPU is a rate since the previous sample of the same tree, so the first sample
    reports ``cpu_percent=None``. Returns ``None`` once the root process is gone. The real
    one is ``PsutilProcessStats``; ``ScriptedProcessStats`` replays samples for tests.
    """

    def sample(self, pid: int) -> TreeSample | None: ...
