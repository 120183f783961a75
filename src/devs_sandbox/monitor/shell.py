"""run_shell_monitored: a shell command in a sandbox, killed when its process tree holds too
much memory or keeps a full core busy for too long.

The command runs through the configured driver like any task (fresh sandbox, quotas,
total timeout, destroyed afterwards); on top of that a monitor samples the command's
process tree every ``poll_interval_ms`` and kills it on the first breach:

- **rss**: the tree's resident memory above ``rss_limit_bytes`` in one sample;
- **cpu**: the tree at or above 100% of one core for ``cpu_sustained_ms`` in a row
  (consecutive busy samples x the interval; one sample below resets the count).

Three parts, each replaceable, so the spec's unit tests need no process:

- ``ProcessStatsSource`` (``base.py``): samples the tree under a pid.
  ``PsutilProcessStats`` is the real one; ``ScriptedProcessStats`` replays samples.
- ``ResourcePolicy``: a pure check of one sample; its only state is the CPU streak.
- ``ShellMonitor``: the sampling loop, on a ``Scheduler`` (a thread, or the manual clock
  of ``FakeScheduler``).

What is measured (``PsutilProcessStats``):

- The tree is the exec's leader (its host pid, from the driver's ``on_start``) and all
  its descendants. The leader is the driver's ``/bin/sh`` shim, which execs setpriv and
  then bwrap; bwrap's pid-namespace init and the command sit below it. The shim and
  bwrap count: they take 1-4 MiB and no CPU, noise against any useful limit, and
  filtering processes by name would let a command named ``bwrap`` hide. Inside bwrap's
  pid namespace an orphan is adopted by bwrap's init, so double-forks stay in the tree.
- RSS is the sum over the tree. Shared pages (libc, copy-on-write after fork) count once
  per process, so the sum over-states a little; that errs towards killing. PSS would be
  exact but reads ``smaps`` and costs about a hundred times more per process.
- CPU% is the tree's CPU time (user + system, plus what reaped children used) since the
  previous sample, over the wall time in between, x 100: 100 is one core, 200 two. A
  child that exits between samples is not lost: its time moves into its parent's
  children counters, which stay in the sum.
- "At or above 100%" allows for measurement: kernels account CPU in clock ticks (10 ms
  on Linux), so a single-threaded busy loop reads 97-102% at a 1 s interval and never a
  steady 100. ``cpu_busy_threshold`` takes two ticks per sample plus 1% for interrupts
  off 100 (97% at the default 1 s interval, never below 90%).

Kill path: the monitor calls ``Sandbox.kill()``, which SIGKILLs every process of the
sandbox (its cgroup and its pid namespace, so setsid'd and double-forked children too);
the exec then returns; ``ResourceLimitExceededError`` is raised, the breach is recorded in
the violation store, and the per-call sandbox is destroyed.

Invariants: the monitor takes no sample after it decided to kill; it is stopped whenever
the exec ends (exit, error or kill); a failure to sample kills the command rather than
letting it run unwatched (fail closed).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import psutil

from devs_sandbox.aio import run_blocking
from devs_sandbox.base import ProcessStatsSource, Scheduler, TimerHandle
from devs_sandbox.config import (
    MAX_CALL_TIMEOUT_S,
    MAX_CPU_SUSTAINED_MS,
    MAX_POLL_INTERVAL_MS,
    MIN_POLL_INTERVAL_MS,
    MIN_RSS_LIMIT_BYTES,
    GiB,
    SandboxLifecycleConfig,
    override,
)
from devs_sandbox.errors import ConfigError, DriverError, ResourceLimitExceededError
from devs_sandbox.events import SandboxEvents
from devs_sandbox.lifecycle import Sandbox, SandboxLifecycleManager
from devs_sandbox.models import (
    DetectionRule,
    ExecResult,
    TreeSample,
    Violation,
    ViolationType,
    new_sandbox_id,
)
from devs_sandbox.scheduler import ThreadScheduler, shared_scheduler

__all__ = [
    "LimitBreach",
    "MonitoredShellOptions",
    "ProcessStatsSource",
    "PsutilProcessStats",
    "ResourcePolicy",
    "ScriptedProcessStats",
    "ShellMonitor",
    "ShellResult",
    "TreeSample",
    "cpu_busy_threshold",
    "monitored_exec",
    "run_shell_monitored",
    "run_shell_monitored_sync",
]

logger = logging.getLogger(__name__)

DEFAULT_RSS_LIMIT_BYTES: Final = 4 * GiB
DEFAULT_CPU_SUSTAINED_MS: Final = 10_000
DEFAULT_POLL_INTERVAL_MS: Final = 1_000
ONE_CORE_PERCENT: Final = 100.0
CLOCK_TICK_S: Final = 0.01  # Linux accounts CPU in USER_HZ=100 ticks; macOS/Windows finer
CPU_INTERRUPT_SLACK_PERCENT: Final = 1.0  # interrupts and kernel threads steal ~0.1-1%
CPU_MAX_SLACK_PERCENT: Final = 10.0  # below ~200 ms intervals, tick noise exceeds any slack


def cpu_busy_threshold(poll_interval_ms: int) -> float:
    """The CPU% at which a sample counts as "at or above 100% of one core".

    100 less the measurement's resolution: two clock ticks per sample (one at each end of
    the delta) and 1% for interrupts. 97.0 at 1 s, 95.0 at 500 ms, 90.0 at 200 ms or less.
    """
    tick_percent = ONE_CORE_PERCENT * 2 * CLOCK_TICK_S / (poll_interval_ms / 1000)
    return ONE_CORE_PERCENT - min(CPU_MAX_SLACK_PERCENT, CPU_INTERRUPT_SLACK_PERCENT + tick_percent)


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
    """Kill after the tree kept at least one core busy for this long in a row."""

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


# -- sampling ---------------------------------------------------------------------------
class PsutilProcessStats:
    """``ProcessStatsSource`` over psutil (Linux, macOS, Windows); one instance per tree.

    Finding a tree means knowing every host process's parent. ``Process.children()``
    reads all of them and builds a ``Process`` per descendant on every call: 7-9 ms a
    sample for a 50-process tree on a 100-170-process host, more as the host grows.
    This class keeps the host's pid -> parent table between samples instead. Each
    sample lists pids (one directory read), reads the parent of new pids only, re-reads
    orphans (a parent changes only when the old one dies), walks the tree, and reads
    each member once (``oneshot``: stat and statm on Linux). Cost then follows the tree
    and the host's churn, not the host's size: 2-3 ms for the same tree
    (``benchmarks/sampling.py``). The first sample learns the whole table (~20 ms).

    Known limit: a parent that dies and whose pid is reused before the next sample
    hides its orphans from the tree until the impostor exits; with a 32768-pid space
    that needs tens of thousands of forks within one interval.
    """

    UNREADABLE: Final = -1  # parent of a live pid we may not inspect: never in our tree

    def __init__(self, members: Callable[[], Iterable[int]] | None = None) -> None:
        """``members``: every pid of the command's sandbox (its cgroup), added to the ppid
        tree with their own descendants. A double fork re-parents the grandchild to the
        host's init (no pid namespace) or the container's: out of the tree, never out of
        the cgroup."""
        self._members = members
        self._parent: dict[int, int] = {}
        self._procs: dict[int, psutil.Process] = {}
        self._last: tuple[float, float] | None = None  # (monotonic time, tree CPU seconds)

    def _learn(self, pid: int) -> None:
        try:
            self._parent[pid] = psutil.Process(pid).ppid()
        except psutil.NoSuchProcess:
            self._parent.pop(pid, None)  # gone since the listing: gone from the next one too
        except psutil.AccessDenied:
            self._parent[pid] = self.UNREADABLE

    def _tree(self, root: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for pid, parent in self._parent.items():
            children.setdefault(parent, []).append(pid)
        tree = [root]
        seen = {root}
        for pid in tree:  # grows while we walk it: breadth first
            for child in children.get(pid, ()):
                if child not in seen:  # a recycled pid could close a loop in stale data
                    seen.add(child)
                    tree.append(child)
        return tree

    def sample(self, pid: int) -> TreeSample | None:
        live = set(psutil.pids())
        if pid not in live:
            return None
        for gone in self._parent.keys() - live:
            del self._parent[gone]
        for new in live - self._parent.keys():
            self._learn(new)
        # An orphan was re-parented (to bwrap's init, a subreaper or the host's init) when
        # its recorded parent died; nothing else changes a parent, so only these are re-read.
        for orphan in [p for p, parent in self._parent.items() if parent > 0]:
            if self._parent[orphan] not in self._parent:
                self._learn(orphan)
        tree = self._tree(pid)
        if self._members is not None:
            try:
                extra = [m for m in self._members() if m in live]
            except Exception:
                logger.exception("listing the sandbox's processes failed")
                extra = []
            in_tree = set(tree)
            for m in extra:
                if m not in in_tree:
                    for member in self._tree(m):
                        if member not in in_tree:
                            in_tree.add(member)
                            tree.append(member)
        now = time.monotonic()
        rss = 0
        cpu_s = 0.0
        counted = 0
        for member in tree:
            proc = self._procs.get(member)
            if proc is None:
                try:
                    proc = self._procs[member] = psutil.Process(member)
                except psutil.NoSuchProcess:
                    continue
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    rss += proc.memory_info().rss
            except psutil.NoSuchProcess:  # exited and reaped since the listing
                continue
            # A zombie still reports its CPU times (and 0 RSS) until it is reaped.
            cpu_s += times.user + times.system + times.children_user + times.children_system
            counted += 1
        for stale in self._procs.keys() - set(tree):
            del self._procs[stale]
        cpu_percent: float | None = None
        if self._last is not None and now > self._last[0]:
            # Clamped: a member that left the tree alive takes its past CPU time with it.
            used = max(0.0, cpu_s - self._last[1])
            cpu_percent = used / (now - self._last[0]) * ONE_CORE_PERCENT
        self._last = (now, cpu_s)
        return TreeSample(rss_bytes=rss, cpu_percent=cpu_percent, processes=counted)


class ScriptedProcessStats:
    """A ``ProcessStatsSource`` that replays a script, as ``FakeDriver`` does for drivers.

    Items are served in order, the last one repeating: a ``TreeSample``, ``None`` (the
    command has exited) or an exception instance, which is raised. ``calls`` records the
    pid of every sample taken, so tests can count them.
    """

    def __init__(self, script: Iterable[TreeSample | BaseException | None]) -> None:
        self._script = list(script)
        if not self._script:
            raise ValueError("the script needs at least one item")
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def sample(self, pid: int) -> TreeSample | None:
        with self._lock:
            self.calls.append(pid)
            item = self._script[min(len(self.calls), len(self._script)) - 1]
        if isinstance(item, BaseException):
            raise item
        return item


# -- policy -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LimitBreach:
    """Why the monitor kills: ``value`` > ``limit`` in bytes (rss) or percent of a core (cpu)."""

    reason: Literal["rss", "cpu"]
    value: float
    limit: float
    detail: str


class ResourcePolicy:
    """The kill conditions as a pure check of one sample at a time.

    ``check`` holds no I/O and kills nothing; its only state is the CPU streak: how many
    consecutive samples were busy and their CPU sum. RSS is checked first, on its own.
    """

    def __init__(
        self,
        *,
        rss_limit_bytes: int,
        cpu_sustained_ms: int,
        poll_interval_ms: int,
        cpu_busy_percent: float | None = None,
    ) -> None:
        self.rss_limit_bytes = rss_limit_bytes
        self.cpu_sustained_ms = cpu_sustained_ms
        self.poll_interval_ms = poll_interval_ms
        self.cpu_busy_percent = (
            cpu_busy_threshold(poll_interval_ms) if cpu_busy_percent is None else cpu_busy_percent
        )
        self._busy = 0
        self._busy_sum = 0.0

    @classmethod
    def from_options(cls, opts: MonitoredShellOptions) -> ResourcePolicy:
        return cls(
            rss_limit_bytes=opts.rss_limit_bytes,
            cpu_sustained_ms=opts.cpu_sustained_ms,
            poll_interval_ms=opts.poll_interval_ms,
        )

    @property
    def busy_ms(self) -> int:
        """How long the current CPU streak has lasted, by the spec's count: samples x interval."""
        return self._busy * self.poll_interval_ms

    def check(self, sample: TreeSample) -> LimitBreach | None:
        if sample.rss_bytes > self.rss_limit_bytes:
            return LimitBreach(
                "rss",
                sample.rss_bytes,
                self.rss_limit_bytes,
                f"process tree RSS {sample.rss_bytes} bytes over {sample.processes} "
                f"process(es), limit {self.rss_limit_bytes} (rss_limit_bytes)",
            )
        cpu = sample.cpu_percent
        if cpu is None:  # first sample: no rate yet, the streak neither grows nor resets
            return None
        if cpu < self.cpu_busy_percent:
            self._busy, self._busy_sum = 0, 0.0
            return None
        self._busy += 1
        self._busy_sum += cpu
        if self.busy_ms < self.cpu_sustained_ms:
            return None
        mean = round(self._busy_sum / self._busy, 1)
        return LimitBreach(
            "cpu",
            mean,
            self.cpu_busy_percent,
            f"{mean}% of one core on average for {self.busy_ms} ms in a row "
            f"(at least {self.cpu_busy_percent:g}% counts as a full core; "
            f"cpu_sustained_ms {self.cpu_sustained_ms})",
        )


# -- the sampling loop ------------------------------------------------------------------
def monitor_scheduler() -> ThreadScheduler:
    """The monitors' own timer thread: a slow sample never delays a timeout's kill."""
    return shared_scheduler("devs-sandbox-shell-monitor")


class ShellMonitor:
    """Samples one command's tree on a scheduler until it exits, is stopped, or breaks a limit.

    ``start(pid)`` (the exec's ``on_start``) takes a first sample and arms the timer;
    every tick samples, checks and re-arms. On a breach or a sampling failure it marks
    itself stopped, then kills: one lock covers sample, decision and kill, so once
    ``stop()`` returns no tick is running and none will.
    """

    def __init__(
        self,
        policy: ResourcePolicy,
        stats: ProcessStatsSource,
        kill: Callable[[], None],
        *,
        scheduler: Scheduler,
    ) -> None:
        self.policy = policy
        self.stats = stats
        self._kill = kill
        self._scheduler = scheduler
        self._interval_s = policy.poll_interval_ms / 1000
        self._lock = threading.Lock()
        self._handle: TimerHandle | None = None
        self._stopped = False
        self.pid: int | None = None
        self.samples = 0
        self.breach: LimitBreach | None = None
        self.error: Exception | None = None

    @property
    def started(self) -> bool:
        return self.pid is not None

    @property
    def killed(self) -> bool:
        return self.breach is not None or self.error is not None

    def start(self, pid: int) -> None:
        with self._lock:
            if self._stopped or self.pid is not None:
                return
            self.pid = pid
            self._sample_locked()
            self._arm_locked()

    def _arm_locked(self) -> None:
        if not self._stopped:
            self._handle = self._scheduler.call_later(self._interval_s, self._tick)

    def _tick(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._sample_locked()
            self._arm_locked()

    def _sample_locked(self) -> None:
        assert self.pid is not None
        try:
            sample = self.stats.sample(self.pid)
        except Exception as exc:
            logger.exception("sampling process tree %d failed; killing it", self.pid)
            self.error = exc
            self._stop_and_kill_locked()
            return
        self.samples += 1
        if sample is None:  # the command has exited; the exec is about to return
            self._stopped = True
            return
        breach = self.policy.check(sample)
        if breach is not None:
            self.breach = breach
            self._stop_and_kill_locked()

    def _stop_and_kill_locked(self) -> None:
        self._stopped = True  # before the kill: nothing samples a tree being torn down
        try:
            self._kill()
        except Exception:
            logger.exception("killing monitored process tree %s failed", self.pid)

    def stop(self) -> None:
        """Idempotent; waits for a tick in progress, so nothing samples after it returns."""
        with self._lock:
            self._stopped = True
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None


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
        ResourcePolicy.from_options(opts),
        stats,
        sandbox.kill,
        scheduler=scheduler if scheduler is not None else monitor_scheduler(),
    )
    try:
        result = sandbox.exec(command, timeout_s=timeout_s, on_start=monitor.start)
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


def _call_config(
    base: SandboxLifecycleConfig, opts: MonitoredShellOptions
) -> SandboxLifecycleConfig:
    """The per-call sandbox: the configured one, with an id (for cancellation) and the
    call's time budget as its total timeout."""
    changes: dict[str, Any] = {}
    if base.sandbox_id is None:
        changes["sandbox_id"] = new_sandbox_id()
    if opts.timeout_s is not None:
        changes["timeout_ms"] = max(1, math.ceil(opts.timeout_s * 1000))
    return override(base, **changes) if changes else base


def _run(
    command: str,
    *,
    opts: MonitoredShellOptions,
    manager: SandboxLifecycleManager,
    cfg: SandboxLifecycleConfig,
    stats: ProcessStatsSource | None,
    scheduler: Scheduler | None,
) -> ShellResult:
    def task(sandbox: Sandbox) -> ExecResult:
        return monitored_exec(sandbox, command, opts, stats=stats, scheduler=scheduler)

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
        return _run(command, opts=opts, manager=mgr, cfg=cfg, stats=stats, scheduler=scheduler)


async def run_shell_monitored(
    command: str,
    opts: MonitoredShellOptions | None = None,
    *,
    manager: SandboxLifecycleManager | None = None,
    config: SandboxLifecycleConfig | None = None,
    stats: ProcessStatsSource | None = None,
    scheduler: Scheduler | None = None,
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
            return _run(command, opts=opts, manager=mgr, cfg=cfg, stats=stats, scheduler=scheduler)
        finally:
            if own:
                mgr.shutdown()

    return await run_blocking(
        run, on_cancel=lambda: mgr.cancel(sandbox_id), name=f"devs-sandbox-shell-{sandbox_id}"
    )
