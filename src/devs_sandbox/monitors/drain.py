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

Everything here is pure: thresholds and growth are functions of samples, and
``DrainPolicy`` applies all three layers to one ``SandboxMetrics``. Polling the
driver, killing and publishing belong to the lifecycle's watchdog
(``lifecycle.watchdog.ResourceDrainDetector``).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Final

from devs_sandbox.config import (
    DEFAULT_DIRECTORY_DEPTH_LIMIT,
    DEFAULT_FILE_COUNT_LIMIT,
    DEFAULT_PROCESS_COUNT_LIMIT,
    QuotaConfig,
)
from devs_sandbox.models import (
    DetectionRule,
    SandboxMetrics,
    Violation,
    ViolationType,
)

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


class DrainPolicy:
    """The drain rules of one sandbox, as a pure policy: ``check(sample) -> verdict``.

    No I/O, no killing, no publishing: the lifecycle's watchdog samples the driver, asks
    the policy, and acts. Its only state is the growth rule's recent history.
    """

    def __init__(self, sandbox_id: str, quotas: QuotaConfig) -> None:
        self.sandbox_id = sandbox_id
        self.quotas = quotas
        self.history: dict[str, deque[int]] = {}
        self.ticks = 0

    def check(self, m: SandboxMetrics, *, growth: bool = True) -> QuotaViolation:
        """Apply the kernel, threshold and (a poll tick only) growth rules to one sample.

        ``growth=False`` is the lifecycle's check after the task ended: a finished task's
        trend predicts nothing, and that sample must not enter the history.
        """
        sandbox_id = self.sandbox_id
        q = self.quotas
        if growth:
            self.ticks += 1
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
            hist = self.history.setdefault(key, deque(maxlen=HISTORY))
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
