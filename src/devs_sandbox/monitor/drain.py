"""Resource drain detection: file bombs, fork bombs, deep trees, huge files, memory hogs.

Three layers, each recorded with the rule that fired:
- ``kernel``: the kernel already held the line and we read that it did
  (pids.events ``max`` = refused forks, ``oom_kill``, a file stopped at
  RLIMIT_FSIZE, a tmpfs out of inodes). Overshoot is zero;
- ``threshold``: a sample above a limit (``check_filesystem_quota``,
  ``check_process_quota``: pure functions);
- ``growth``: sustained growth that reaches a limit within the look-ahead,
  projected conservatively from the slowest recent step, so a file bomb is
  stopped before it gets there.

``enforce_quota`` terminates through the driver first and only then tells the
world (events, store): a failing listener or store cannot keep a hostile
sandbox alive. It is idempotent under races: the first violation for a sandbox
wins, later ones are ignored.

``ResourceDrainDetector`` polls each registered sandbox on its own scheduler
thread (separate from the timeout timers, so a slow walk never delays a kill),
and stops polling on the first violation or when the sandbox is destroyed.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Final, Protocol

from devs_sandbox.base import Scheduler, TimerHandle
from devs_sandbox.config import (
    DEFAULT_DIRECTORY_DEPTH_LIMIT,
    DEFAULT_FILE_COUNT_LIMIT,
    DEFAULT_POLL_INTERVAL_MS,
    DEFAULT_PROCESS_COUNT_LIMIT,
    QuotaConfig,
)
from devs_sandbox.errors import SandboxNotFoundError
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.models import (
    DetectionRule,
    SandboxContext,
    SandboxMetrics,
    Violation,
    ViolationType,
    utc_now_iso,
)
from devs_sandbox.scheduler import shared_scheduler

logger = logging.getLogger(__name__)

HISTORY: Final = 16  # samples kept per metric for the growth rule


@dataclass(frozen=True, slots=True)
class FilesystemQuotaConfig:
    sandbox_id: str
    file_count_limit: int = DEFAULT_FILE_COUNT_LIMIT
    directory_depth_limit: int = DEFAULT_DIRECTORY_DEPTH_LIMIT
    max_file_size_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class ProcessQuotaConfig:
    sandbox_id: str
    process_count_limit: int = DEFAULT_PROCESS_COUNT_LIMIT


@dataclass(frozen=True, slots=True)
class QuotaViolation:
    """The verdict of a check: ``violated`` False means all limits held."""

    violated: bool
    violation: ViolationType | None
    sandbox_id: str
    observed_value: int | None = None
    limit_value: int | None = None
    rule: DetectionRule = DetectionRule.THRESHOLD
    detail: str = ""

    @classmethod
    def ok(cls, sandbox_id: str) -> QuotaViolation:
        return cls(False, None, sandbox_id)

    def to_violation(self) -> Violation:
        if not self.violated or self.violation is None:
            raise ValueError("no violation to record")
        return Violation(
            sandbox_id=self.sandbox_id,
            type=self.violation,
            observed_value=int(self.observed_value or 0),
            limit_value=int(self.limit_value or 0),
            rule=self.rule,
            detail=self.detail,
        )


def check_filesystem_quota(
    *,
    sandbox_id: str,
    file_count: int,
    file_count_limit: int,
    directory_depth: int | None = None,
    depth_limit: int | None = None,
    largest_file_bytes: int | None = None,
    max_file_size_bytes: int | None = None,
) -> QuotaViolation:
    """Pure threshold check of one filesystem sample; file count first, then depth, then size."""
    if file_count > file_count_limit:
        return QuotaViolation(
            True, ViolationType.FILE_COUNT_EXCEEDED, sandbox_id, file_count, file_count_limit
        )
    if directory_depth is not None and depth_limit is not None and directory_depth > depth_limit:
        return QuotaViolation(
            True, ViolationType.DIRECTORY_DEPTH_EXCEEDED, sandbox_id, directory_depth, depth_limit
        )
    if (
        largest_file_bytes is not None
        and max_file_size_bytes is not None
        and largest_file_bytes > max_file_size_bytes
    ):
        return QuotaViolation(
            True,
            ViolationType.FILE_SIZE_EXCEEDED,
            sandbox_id,
            largest_file_bytes,
            max_file_size_bytes,
        )
    return QuotaViolation.ok(sandbox_id)


def check_process_quota(
    *, sandbox_id: str, process_count: int, process_count_limit: int
) -> QuotaViolation:
    """Pure threshold check of one process-count sample."""
    if process_count > process_count_limit:
        return QuotaViolation(
            True,
            ViolationType.PROCESS_COUNT_EXCEEDED,
            sandbox_id,
            process_count,
            process_count_limit,
        )
    return QuotaViolation.ok(sandbox_id)


def check_growth(
    samples: list[int], limit: int, *, lookahead_ticks: int, min_samples: int
) -> tuple[bool, int]:
    """(fires, projected value): the last ``min_samples`` strictly increase and the current
    value plus ``lookahead_ticks`` of the slowest recent step reaches ``limit``."""
    if lookahead_ticks <= 0 or len(samples) < min_samples:
        return False, samples[-1] if samples else 0
    window = samples[-min_samples:]
    steps = [b - a for a, b in itertools.pairwise(window)]
    if any(s <= 0 for s in steps):
        return False, window[-1]
    projected = window[-1] + lookahead_ticks * min(steps)
    return projected >= limit, projected


class MetricsSource(Protocol):
    """What the detector needs of a driver (``SandboxDriver`` satisfies it)."""

    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics: ...

    def force_stop(self, ctx: SandboxContext) -> None: ...


@dataclass
class _Watched:
    ctx: SandboxContext
    quotas: QuotaConfig
    source: MetricsSource
    history: dict[str, deque[int]] = field(default_factory=dict)
    timer: TimerHandle | None = None
    interval_s: float = DEFAULT_POLL_INTERVAL_MS / 1000
    polling: bool = False
    ticks: int = 0


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
            self._watched[ctx.id] = _Watched(ctx, quotas, source)

    def forget(self, sandbox_id: str) -> None:
        """Stop polling and drop all state of a destroyed sandbox."""
        self.stop_polling(sandbox_id)
        with self._lock:
            self._watched.pop(sandbox_id, None)
            self._terminated.discard(sandbox_id)
            self._violations.pop(sandbox_id, None)
            self._settled.pop(sandbox_id, None)

    def start_polling(self, sandbox_id: str, interval_ms: int = DEFAULT_POLL_INTERVAL_MS) -> None:
        if interval_ms <= 0:
            raise ValueError("interval_ms must be positive")
        with self._lock:
            w = self._watched.get(sandbox_id)
            if w is None:
                raise SandboxNotFoundError(sandbox_id)
            if w.timer is not None:
                w.timer.cancel()
            w.interval_s = interval_ms / 1000
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
        """Apply the kernel, threshold and (a poll tick only) growth rules to one sample.

        ``growth=False`` is the lifecycle's check after the task ended: a finished task's
        trend predicts nothing, and that sample must not enter the history.
        """
        with self._lock:
            w = self._watched.get(sandbox_id)
        if w is None:
            return QuotaViolation.ok(sandbox_id)
        q = w.quotas
        if growth:
            w.ticks += 1
        # 1. The kernel held a line: report it (overshoot was zero).
        if m.oom_kills:
            return QuotaViolation(
                True,
                ViolationType.MEMORY_EXCEEDED,
                sandbox_id,
                max(m.peak_memory_bytes or 0, q.memory_bytes),
                q.memory_bytes,
                DetectionRule.KERNEL,
                f"memory cgroup OOM-killed {m.oom_kills} process(es)",
            )
        if m.pids_limit_hits:
            return QuotaViolation(
                True,
                ViolationType.PROCESS_COUNT_EXCEEDED,
                sandbox_id,
                q.process_count_limit + 1,
                q.process_count_limit,
                DetectionRule.KERNEL,
                f"pids cgroup refused {m.pids_limit_hits} fork(s) at the limit",
            )
        if m.inodes_free == 0:
            return QuotaViolation(
                True,
                ViolationType.FILE_COUNT_EXCEEDED,
                sandbox_id,
                q.file_count_limit + 1,
                q.file_count_limit,
                DetectionRule.KERNEL,
                "the workspace tmpfs ran out of inodes: the kernel refused the next file",
            )
        if m.disk_free_bytes == 0:
            return QuotaViolation(
                True,
                ViolationType.DISK_QUOTA_EXCEEDED,
                sandbox_id,
                q.disk_bytes + 1,
                q.disk_bytes,
                DetectionRule.KERNEL,
                "the workspace tmpfs is full: the kernel refused the next write",
            )
        if m.largest_file_bytes is not None and m.largest_file_bytes >= q.max_file_size_bytes:
            return QuotaViolation(
                True,
                ViolationType.FILE_SIZE_EXCEEDED,
                sandbox_id,
                m.largest_file_bytes,
                q.max_file_size_bytes,
                DetectionRule.KERNEL,
                "a file reached RLIMIT_FSIZE; the write past it failed",
            )
        # 2. Thresholds.
        if m.file_count is not None:
            fs = check_filesystem_quota(
                sandbox_id=sandbox_id,
                file_count=m.file_count,
                file_count_limit=q.file_count_limit,
                directory_depth=m.directory_depth,
                depth_limit=q.directory_depth_limit,
                largest_file_bytes=m.largest_file_bytes,
                max_file_size_bytes=q.max_file_size_bytes,
            )
            if fs.violated:
                return fs
        elif m.directory_depth is not None and m.directory_depth > q.directory_depth_limit:
            return QuotaViolation(
                True,
                ViolationType.DIRECTORY_DEPTH_EXCEEDED,
                sandbox_id,
                m.directory_depth,
                q.directory_depth_limit,
            )
        if m.process_count is not None:
            pv = check_process_quota(
                sandbox_id=sandbox_id,
                process_count=m.process_count,
                process_count_limit=q.process_count_limit,
            )
            if pv.violated:
                return pv
        if not growth:
            return QuotaViolation.ok(sandbox_id)
        # 3. Growth.
        for key, value, limit, vtype in (
            ("fileCount", m.file_count, q.file_count_limit, ViolationType.FILE_COUNT_EXCEEDED),
            (
                "processCount",
                m.process_count,
                q.process_count_limit,
                ViolationType.PROCESS_COUNT_EXCEEDED,
            ),
        ):
            if value is None:
                continue
            hist = w.history.setdefault(key, deque(maxlen=HISTORY))
            hist.append(value)
            if key not in q.growth_metrics:
                continue
            fires, projected = check_growth(
                list(hist),
                limit,
                lookahead_ticks=q.growth_lookahead_ticks,
                min_samples=q.growth_min_samples,
            )
            if fires:
                return QuotaViolation(
                    True,
                    vtype,
                    sandbox_id,
                    value,
                    limit,
                    DetectionRule.GROWTH,
                    f"sustained growth projects {projected} within "
                    f"{q.growth_lookahead_ticks} tick(s)",
                )
        return QuotaViolation.ok(sandbox_id)

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
