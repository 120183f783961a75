"""run_shell_monitored: a shell command in a sandbox, killed when its process tree holds too
much memory or keeps a full core busy for too long.

The command runs through the configured driver like any task (fresh sandbox, quotas,
total timeout, destroyed afterwards); on top of that the lifecycle's exec watchdog
(``lifecycle.watchdog.ShellMonitor``) samples the command's process tree every
``poll_interval_ms`` (``lifecycle.sampling.PsutilProcessStats``) and asks the pure
policy (``monitors.usage.ResourcePolicy``), which kills on the first breach:

- **rss**: the tree's resident memory above ``rss_limit_bytes`` in one sample;
- **cpu**: the tree kept a full core busy (CPU time plus run-queue waits) over the
  trailing ``cpu_sustained_ms`` window (``monitors.usage``).

Kill path: the monitor calls ``Sandbox.kill()``, which SIGKILLs every process of the
sandbox (its cgroup and its pid namespace, so setsid'd and double-forked children too);
the exec then returns; ``ResourceLimitExceededError`` is raised, the breach is recorded in
the violation store, and the per-call sandbox is destroyed.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from devs_sandbox.base import OutputCallback, ProcessStatsSource, Scheduler
from devs_sandbox.config import (
    MAX_CALL_TIMEOUT_S,
    MAX_CPU_SUSTAINED_MS,
    MAX_POLL_INTERVAL_MS,
    MIN_POLL_INTERVAL_MS,
    MIN_RSS_LIMIT_BYTES,
    GiB,
    SandboxLifecycleConfig,
    ms_from_s,
    override,
)
from devs_sandbox.errors import ConfigError, DriverError, ResourceLimitExceededError
from devs_sandbox.events import SandboxEvents
from devs_sandbox.lifecycle import Sandbox, SandboxLifecycleManager, ShellMonitor
from devs_sandbox.lifecycle.aio import run_blocking
from devs_sandbox.lifecycle.sampling import PsutilProcessStats
from devs_sandbox.lifecycle.watchdog import monitor_scheduler
from devs_sandbox.models import (
    DetectionRule,
    ExecResult,
    Violation,
    ViolationType,
    new_sandbox_id,
)
from devs_sandbox.monitors.usage import LimitBreach, ResourcePolicy

__all__ = [
    "MonitoredShellOptions",
    "OutputTap",
    "ShellResult",
    "monitored_exec",
    "run_shell_monitored",
    "run_shell_monitored_sync",
]

logger = logging.getLogger(__name__)

# Work in the per-call sandbox around the command: ``prepare`` before it (write a
# program), ``finish`` after it however it ended, before the sandbox is destroyed (read
# what it left; a sandbox that timed out or broke a quota runs nothing more).
SandboxStep = Callable[[Sandbox], None]

DEFAULT_RSS_LIMIT_BYTES: Final = 4 * GiB
DEFAULT_CPU_SUSTAINED_MS: Final = 10_000
DEFAULT_POLL_INTERVAL_MS: Final = 1_000


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    # bool is an int to Python; as a byte count or a duration it is a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a whole number, got {value!r}", key=name)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"{name} must be {bound}, got {value}", key=name)


@dataclass(frozen=True, slots=True)
class MonitoredShellOptions:
    """Limits of one monitored command; validated on construction (``ConfigError``)."""

    rss_limit_bytes: int = DEFAULT_RSS_LIMIT_BYTES
    """Kill when the process tree's resident memory exceeds this (one sample is enough)."""

    cpu_sustained_ms: int = DEFAULT_CPU_SUSTAINED_MS
    """Kill after the tree kept a full core busy over a trailing window this long."""

    poll_interval_ms: int = DEFAULT_POLL_INTERVAL_MS
    """How often the monitor samples the tree."""

    timeout_s: float | None = None
    """Total time budget of the call (the sandbox's total timeout); None keeps
    ``sandbox.timeoutMs``. On expiry everything is SIGKILLed: ``SandboxTimeoutError``."""

    def __post_init__(self) -> None:
        _check_int("rss_limit_bytes", self.rss_limit_bytes, MIN_RSS_LIMIT_BYTES)
        _check_int("cpu_sustained_ms", self.cpu_sustained_ms, 1, MAX_CPU_SUSTAINED_MS)
        _check_int(
            "poll_interval_ms", self.poll_interval_ms, MIN_POLL_INTERVAL_MS, MAX_POLL_INTERVAL_MS
        )
        t = self.timeout_s
        if t is not None and (
            not isinstance(t, int | float)
            or isinstance(t, bool)
            or not 0 < t <= MAX_CALL_TIMEOUT_S  # also rejects NaN
        ):
            raise ConfigError(
                f"timeout_s must be a number of seconds in (0, {MAX_CALL_TIMEOUT_S:g}], got {t!r}",
                key="timeout_s",
            )


@dataclass(frozen=True, slots=True)
class ShellResult:
    """What a monitored command produced when it ran to its own end (any exit status)."""

    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0

    @classmethod
    def from_exec(cls, result: ExecResult) -> ShellResult:
        return cls(
            exit_code=result.exit_code,
            stdout=result.stdout.text,
            stderr=result.stderr.text,
            stdout_truncated=result.stdout.truncated,
            stderr_truncated=result.stderr.truncated,
            duration_s=result.duration_s,
        )

    def to_json(self) -> dict[str, Any]:
        """The MCP tool's structured output."""
        return {
            "exit_code": self.exit_code,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "stdout_truncated": self.stdout_truncated,
            "stderr_truncated": self.stderr_truncated,
            "duration_s": round(self.duration_s, 6),
        }


@dataclass(frozen=True, slots=True)
class OutputTap:
    """How a caller sees a monitored command's output besides its result: the bytes kept
    of each stream (``max_output_bytes``, head and tail; None: the sandbox's
    ``maxOutputBytes``) and the redacted chunks as they come (the MCP server keeps its own
    copy, to count progress and to return binary output as it was)."""

    max_output_bytes: int | None = None
    on_stdout: OutputCallback | None = None
    on_stderr: OutputCallback | None = None

    def exec_options(self) -> dict[str, Any]:
        return {
            "max_output_bytes": self.max_output_bytes,
            "on_stdout": self.on_stdout,
            "on_stderr": self.on_stderr,
        }


# -- running a command --------------------------------------------------------------------
def _check_command(command: object) -> str:
    if not isinstance(command, str):
        raise ConfigError(
            f"command must be a string (run through /bin/sh -c), got {type(command).__name__}",
            key="command",
        )
    if not command.strip():
        raise ConfigError("command must not be empty", key="command")
    if "\0" in command:
        raise ConfigError("command must not contain NUL bytes", key="command")
    return command


def _record(sandbox: Sandbox, pid: int, breach: LimitBreach) -> None:
    """Tell the world after the kill: the store writes a row, listeners log it."""
    kind = ViolationType.MEMORY_EXCEEDED if breach.reason == "rss" else ViolationType.CPU_EXCEEDED
    violation = Violation(
        sandbox_id=sandbox.id,
        type=kind,
        observed_value=math.ceil(breach.value),
        limit_value=math.floor(breach.limit),
        rule=DetectionRule.THRESHOLD,
        detail=f"run_shell_monitored killed pid {pid}: {breach.detail}",
    )
    sandbox.manager.bus.emit(SandboxEvents.VIOLATION, {"violation": violation})


# REQ: 3_MCP-REQ-SEC-002
def monitored_exec(
    sandbox: Sandbox,
    command: str,
    opts: MonitoredShellOptions,
    *,
    timeout_s: float | None = None,
    stats: ProcessStatsSource | None = None,
    scheduler: Scheduler | None = None,
    tap: OutputTap | None = None,
) -> ExecResult:
    """Run ``command`` (``sh -c``) in a live sandbox under the monitor; the sandbox survives.

    Returns the exec's result when the command ends on its own (any status, or the
    exec's own ``timeout_s``); raises ``ResourceLimitExceededError`` after a kill for a
    limit, ``DriverError`` after a kill because the tree could not be sampled.
    """
    _check_command(command)
    if stats is None:
        stats = PsutilProcessStats(lambda: sandbox.driver.member_pids(sandbox.context))
    monitor = ShellMonitor(
        _policy(opts),
        stats,
        sandbox.kill,
        scheduler=scheduler if scheduler is not None else monitor_scheduler(),
    )
    try:
        extra = tap.exec_options() if tap is not None else {}
        result = sandbox.exec(command, timeout_s=timeout_s, on_start=monitor.start, **extra)
    finally:
        monitor.stop()
    if monitor.breach is not None:
        assert monitor.pid is not None
        _record(sandbox, monitor.pid, monitor.breach)
        b = monitor.breach
        raise ResourceLimitExceededError(monitor.pid, b.reason, b.value, b.limit, result=result)
    if monitor.error is not None:
        raise DriverError(
            f"could not sample the command's processes, so it was killed: {monitor.error!r}"
        ) from monitor.error
    if not monitor.started:
        logger.warning(
            "driver %r did not report the command's pid: it ran without the RSS/CPU monitor "
            "(the sandbox's quotas still held)",
            sandbox.driver.name,
        )
    return result


def _policy(opts: MonitoredShellOptions) -> ResourcePolicy:
    return ResourcePolicy(
        rss_limit_bytes=opts.rss_limit_bytes,
        cpu_sustained_ms=opts.cpu_sustained_ms,
        poll_interval_ms=opts.poll_interval_ms,
    )


def _call_config(
    base: SandboxLifecycleConfig, opts: MonitoredShellOptions
) -> SandboxLifecycleConfig:
    """The per-call sandbox: the configured one, with an id (for cancellation) and the
    call's time budget as its total timeout."""
    changes: dict[str, Any] = {}
    if base.sandbox_id is None:
        changes["sandbox_id"] = new_sandbox_id()
    if opts.timeout_s is not None:
        changes["timeout_ms"] = ms_from_s(opts.timeout_s)
    return override(base, **changes) if changes else base


def _run(
    command: str,
    *,
    opts: MonitoredShellOptions,
    manager: SandboxLifecycleManager,
    cfg: SandboxLifecycleConfig,
    stats: ProcessStatsSource | None,
    scheduler: Scheduler | None,
    tap: OutputTap | None = None,
    prepare: SandboxStep | None = None,
    finish: SandboxStep | None = None,
) -> ShellResult:
    def task(sandbox: Sandbox) -> ExecResult:
        if prepare is not None:
            prepare(sandbox)
        try:
            return monitored_exec(sandbox, command, opts, stats=stats, scheduler=scheduler, tap=tap)
        finally:
            if finish is not None:
                finish(sandbox)

    # run_in_sandbox owns the sandbox: preflight, total timeout, quota verdict, destroy.
    outcome = manager.run_in_sandbox(task, cfg)
    return ShellResult.from_exec(outcome.result)


@contextlib.contextmanager
def _manager(manager: SandboxLifecycleManager | None) -> Iterator[SandboxLifecycleManager]:
    if manager is not None:
        yield manager
        return
    own = SandboxLifecycleManager()
    try:
        yield own
    finally:
        own.shutdown()


# REQ: 3_MCP-REQ-SEC-002
def run_shell_monitored_sync(
    command: str,
    opts: MonitoredShellOptions | None = None,
    *,
    manager: SandboxLifecycleManager | None = None,
    config: SandboxLifecycleConfig | None = None,
    stats: ProcessStatsSource | None = None,
    scheduler: Scheduler | None = None,
    tap: OutputTap | None = None,
    prepare: SandboxStep | None = None,
    finish: SandboxStep | None = None,
) -> ShellResult:
    """Run ``command`` with ``/bin/sh -c`` in a fresh sandbox under the RSS/CPU monitor.

    Returns a ``ShellResult`` when the command ends on its own, whatever its exit status.
    Raises ``ResourceLimitExceededError`` (killed for rss or cpu), ``SandboxTimeoutError``
    (``opts.timeout_s`` or ``sandbox.timeoutMs`` ran out), ``QuotaExceededError`` (a
    sandbox quota stopped it first), ``SandboxPreFlightError``, ``ConfigError`` or
    ``DriverError``. The sandbox is destroyed in every case.

    ``manager`` and ``config`` default to a private manager and ``DevsConfig().sandbox``
    (so the process driver with every isolation layer the host offers); ``stats`` and
    ``scheduler`` are the test seams (one ``stats`` per call: it keeps per-tree state).
    """
    _check_command(command)
    opts = opts if opts is not None else MonitoredShellOptions()
    with _manager(manager) as mgr:
        cfg = _call_config(config if config is not None else mgr.config.sandbox, opts)
        return _run(
            command,
            opts=opts,
            manager=mgr,
            cfg=cfg,
            stats=stats,
            scheduler=scheduler,
            tap=tap,
            prepare=prepare,
            finish=finish,
        )


async def run_shell_monitored(
    command: str,
    opts: MonitoredShellOptions | None = None,
    *,
    manager: SandboxLifecycleManager | None = None,
    config: SandboxLifecycleConfig | None = None,
    stats: ProcessStatsSource | None = None,
    scheduler: Scheduler | None = None,
    tap: OutputTap | None = None,
    prepare: SandboxStep | None = None,
    finish: SandboxStep | None = None,
) -> ShellResult:
    """The asyncio form of ``run_shell_monitored_sync``: the run happens on a worker thread;
    cancelling this coroutine kills and destroys the sandbox before the cancellation
    propagates."""
    _check_command(command)
    opts = opts if opts is not None else MonitoredShellOptions()
    own = manager is None
    mgr = manager if manager is not None else SandboxLifecycleManager()
    cfg = _call_config(config if config is not None else mgr.config.sandbox, opts)
    sandbox_id = cfg.sandbox_id
    assert sandbox_id is not None

    def run() -> ShellResult:
        try:
            return _run(
                command,
                opts=opts,
                manager=mgr,
                cfg=cfg,
                stats=stats,
                scheduler=scheduler,
                tap=tap,
                prepare=prepare,
                finish=finish,
            )
        finally:
            if own:
                mgr.shutdown()

    return await run_blocking(
        run, on_cancel=lambda: mgr.cancel(sandbox_id), name=f"devs-sandbox-shell-{sandbox_id}"
    )
