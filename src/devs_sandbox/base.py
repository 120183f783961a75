"""The seams, as Protocols: what a driver, a clock/scheduler and a killable thing must offer.

A driver does infrastructure only: create, run, sample, kill, destroy, and
return plain data (``models``). It never calls the lifecycle or a monitor; facts
that arrive on their own (an engine's OOM event) leave through an ``emit``
callable handed to it. That keeps the Docker and Kubernetes drivers
interchangeable with the process driver and with ``FakeDriver`` in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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


@runtime_checkable
class SandboxDriver(Protocol):
    """What every backend implements. ``destroy`` is idempotent and safe after a partial
    ``provision``; ``force_stop`` kills every process but keeps the sandbox for inspection."""

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

    def exec(
        self,
        ctx: SandboxContext,
        command: Sequence[str],
        *,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        max_output_bytes: int | None = None,
        on_start: StartCallback | None = None,
    ) -> ExecResult: ...

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


# Optional capabilities: the lifecycle checks for them with isinstance, so a driver that has
# nothing to say (the fake one) needs no stub methods.
@runtime_checkable
class ClosableDriver(Protocol):
    """A driver holding process-wide resources (watcher threads, warm containers)."""

    def close(self) -> None: ...


@runtime_checkable
class QuotaAwareDriver(Protocol):
    """A driver with infrastructure to release when a run ends in a quota violation (Docker
    routes a full workspace to its ResourceExhaustionHandler)."""

    def on_quota_exceeded(self, ctx: SandboxContext, error: QuotaExceededError) -> None: ...


@runtime_checkable
class RuntimeProvider(Protocol):
    """A driver that can say which runtimes (python, node, go, rust) it provides for a config;
    None means it cannot tell."""

    def provided_runtimes(self, config: SandboxLifecycleConfig) -> frozenset[str] | None: ...


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
