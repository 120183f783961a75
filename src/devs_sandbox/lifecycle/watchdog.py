"""The lifecycle's watchdogs: they sample, ask a policy, kill, and tell the world.

Monitors are pure policies (``monitors/``); acting on their verdicts is the
lifecycle's job, here:

- ``ResourceDrainDetector`` (the specification's name) polls each registered sandbox's
  driver (``get_metrics``) on its own scheduler thread (separate from the timeout
  timers, so a slow walk never delays a kill), asks the sandbox's ``DrainPolicy``, and
  on the first violation terminates through the driver and only then emits
  ``resource_drain``, ``security_pause`` and ``violation`` (the store listens): a
  failing listener or store cannot keep a hostile sandbox alive. ``enforce_quota`` is
  idempotent under races: the first violation for a sandbox wins.
- ``ShellMonitor`` samples one command's process tree (a ``ProcessStatsSource``) for
  ``run_shell_monitored`` and ``sandbox_exec``, asks a ``ResourcePolicy``, and kills the
  sandbox's processes on a breach or when it cannot sample (fail closed). One lock
  covers sample, decision and kill, so once ``stop()`` returns nothing samples again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from devs_sandbox.base import ProcessStatsSource, Scheduler, TimerHandle
from devs_sandbox.config import DEFAULT_POLL_INTERVAL_MS, QuotaConfig
from devs_sandbox.errors import SandboxNotFoundError
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.models import SandboxContext, SandboxMetrics, Violation, utc_now_iso
from devs_sandbox.monitors.drain import DrainPolicy, QuotaViolation
from devs_sandbox.monitors.usage import LimitBreach, ResourcePolicy
from devs_sandbox.scheduler import ThreadScheduler, shared_scheduler

logger = logging.getLogger(__name__)


# -- a sandbox's quotas ------------------------------------------------------------------
class MetricsSource(Protocol):
    """What the detector needs of a driver (``SandboxDriver`` satisfies it)."""

    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics: ...

    def force_stop(self, ctx: SandboxContext) -> None: ...


@dataclass
class _Watched:
    ctx: SandboxContext
    source: MetricsSource
    policy: DrainPolicy
    timer: TimerHandle | None = None
    interval_s: float = DEFAULT_POLL_INTERVAL_MS / 1000
    polling: bool = False


class ResourceDrainDetector:
    """Polls registered sandboxes, checks every rule, enforces the first violation."""

    def __init__(
        self,
        *,
        bus: EventBus | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.bus = bus or EventBus()
        self._scheduler = scheduler
        self._lock = threading.RLock()
        self._watched: dict[str, _Watched] = {}
        self._terminated: set[str] = set()
        self._violations: dict[str, Violation] = {}
        self._settled: dict[str, threading.Event] = {}

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            self._scheduler = shared_scheduler("devs-sandbox-drain")
        return self._scheduler

    # -- registration --------------------------------------------------------------------
    def register(self, ctx: SandboxContext, quotas: QuotaConfig, source: MetricsSource) -> None:
        """Make ``ctx`` known so that ``start_polling(ctx.id)`` and ``enforce_quota`` can act."""
        with self._lock:
            self._watched[ctx.id] = _Watched(ctx, source, DrainPolicy(ctx.id, quotas))

    def forget(self, sandbox_id: str) -> None:
        """Stop polling and drop all state of a destroyed sandbox."""
        self.stop_polling(sandbox_id)
        with self._lock:
            self._watched.pop(sandbox_id, None)
            self._terminated.discard(sandbox_id)
            self._violations.pop(sandbox_id, None)
            self._settled.pop(sandbox_id, None)

    def start_polling(
        self, sandbox_id: str, interval_s: float = DEFAULT_POLL_INTERVAL_MS / 1000
    ) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        with self._lock:
            w = self._watched.get(sandbox_id)
            if w is None:
                raise SandboxNotFoundError(sandbox_id)
            if w.timer is not None:
                w.timer.cancel()
            w.interval_s = interval_s
            w.polling = True
            w.timer = self.scheduler.call_later(w.interval_s, lambda: self._tick(sandbox_id))

    def stop_polling(self, sandbox_id: str) -> None:
        """Unknown ids and repeated calls are fine."""
        with self._lock:
            w = self._watched.get(sandbox_id)
            if w is None:
                return
            w.polling = False
            if w.timer is not None:
                w.timer.cancel()
                w.timer = None

    def is_polling(self, sandbox_id: str) -> bool:
        with self._lock:
            w = self._watched.get(sandbox_id)
            return w is not None and w.polling

    def polling_count(self) -> int:
        with self._lock:
            return sum(1 for w in self._watched.values() if w.polling)

    def violation_for(self, sandbox_id: str, *, settle_timeout_s: float = 5.0) -> Violation | None:
        """The violation that terminated ``sandbox_id``, once its events and record are out.

        A run that sees its sandbox die waits here (bounded) so that, when it returns,
        the violation is already in the store.
        """
        with self._lock:
            record = self._violations.get(sandbox_id)
            settled = self._settled.get(sandbox_id)
        if record is not None and settled is not None:
            settled.wait(settle_timeout_s)
            with self._lock:
                record = self._violations.get(sandbox_id, record)
        return record

    # -- polling ---------------------------------------------------------------------------
    def _tick(self, sandbox_id: str) -> None:
        with self._lock:
            w = self._watched.get(sandbox_id)
            if w is None or not w.polling:
                return
            w.timer = None
        verdict = self.poll_once(sandbox_id)
        with self._lock:
            w = self._watched.get(sandbox_id)
            if w is None or not w.polling:
                return
            if verdict is not None and verdict.violated:
                w.polling = False
                return
            w.timer = self.scheduler.call_later(w.interval_s, lambda: self._tick(sandbox_id))

    def poll_once(self, sandbox_id: str) -> QuotaViolation | None:
        """Sample once, evaluate, enforce on a violation. ``None`` if nothing could be read."""
        with self._lock:
            w = self._watched.get(sandbox_id)
        if w is None:
            return None
        try:
            metrics = w.source.get_metrics(w.ctx)
        except SandboxNotFoundError:
            self.stop_polling(sandbox_id)
            return None
        except Exception:
            logger.exception("sampling sandbox %s failed", sandbox_id)
            return None
        verdict = self.evaluate(sandbox_id, metrics)
        if verdict.violated:
            self.enforce_quota(verdict)
        return verdict

    def evaluate(
        self, sandbox_id: str, m: SandboxMetrics, *, growth: bool = True
    ) -> QuotaViolation:
        """The policy's verdict on one sample of ``sandbox_id`` (see ``DrainPolicy.check``)."""
        with self._lock:
            w = self._watched.get(sandbox_id)
        if w is None:
            return QuotaViolation.ok(sandbox_id)
        return w.policy.check(m, growth=growth)

    # -- enforcement -----------------------------------------------------------------------
    # REQ: 5_SECURITY_DESIGN-REQ-SEC-THR-003
    def enforce_quota(self, violation: QuotaViolation | Violation) -> bool:
        """Terminate the sandbox, then emit and record; True if this call terminated it.

        The first violation for a sandbox wins; a concurrent or later one returns False
        without a second termination or a second record.
        """
        record = violation.to_violation() if isinstance(violation, QuotaViolation) else violation
        sandbox_id = record.sandbox_id
        with self._lock:
            if sandbox_id in self._terminated:
                return False
            self._terminated.add(sandbox_id)
            # Recorded before the kill: whoever sees the sandbox die must find the reason.
            self._violations[sandbox_id] = record
            settled = self._settled[sandbox_id] = threading.Event()
            w = self._watched.get(sandbox_id)
            if w is not None:
                w.polling = False
                if w.timer is not None:
                    w.timer.cancel()
                    w.timer = None
        # Terminate first: nothing below may keep a draining sandbox alive.
        if w is not None:
            try:
                w.source.force_stop(w.ctx)
            except Exception:
                logger.exception("terminating sandbox %s failed", sandbox_id)
        else:
            logger.error("violation for unknown sandbox %s: cannot terminate it", sandbox_id)
        terminated_at = utc_now_iso()
        record = replace(record, terminated_at=terminated_at)
        with self._lock:
            self._violations[sandbox_id] = record
        logger.warning(
            "sandbox %s terminated: %s observed=%s limit=%s rule=%s",
            sandbox_id,
            record.type,
            record.observed_value,
            record.limit_value,
            record.rule,
        )
        payload: dict[str, Any] = {
            "sandbox_id": sandbox_id,
            "violation": record,
            "terminated_at": terminated_at,
        }
        self.bus.emit(SandboxEvents.RESOURCE_DRAIN, payload)
        self.bus.emit(
            SandboxEvents.SECURITY_PAUSE,
            {"sandbox_id": sandbox_id, "reason": str(record.type), "terminated_at": terminated_at},
        )
        try:
            self.bus.emit(SandboxEvents.VIOLATION, payload)
        finally:
            settled.set()
        return True


# -- a monitored command's memory and CPU ------------------------------------------
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
