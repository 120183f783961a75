"""The kill conditions of a monitored command, as a pure policy.

``ResourcePolicy.check(sample)`` decides from one ``TreeSample`` at a time whether a
command's process tree broke its limits: no I/O, no killing; its only state is the
trailing CPU window. The watchdog that samples and kills is the lifecycle's
(``lifecycle.watchdog.ShellMonitor``); the tool that runs a command under it is
``tools.shell.run_shell_monitored``.

"At or above 100% of one core for ``cpu_sustained_ms``" is judged on cumulative time over
a trailing window of that length, not sample by sample: the tree must have demanded a
full core's worth of time over the whole window. Demand is CPU time plus the time its
processes waited for a CPU (``TreeSample.runnable_percent``, from the kernel's run-queue
accounting) where the host reports it: a busy loop on a loaded host gets 86-99% of a core
per sample but is runnable 100% of the time, and one short sample no longer resets a
10 s count (a per-sample streak took 52 s, or never fired, on a busy two-core host).
Where run-queue waits are not reported, CPU time alone is judged.

The threshold allows for measurement: kernels account CPU in clock ticks (10 ms on
Linux), off by up to a tick at each end of the window, plus 1% for interrupts:
``cpu_busy_threshold(window_ms)`` is 98.8% for a 10 s window, 97% for 1 s, never below 90%.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

from devs_sandbox.models import TreeSample

ONE_CORE_PERCENT: Final = 100.0
CLOCK_TICK_S: Final = 0.01  # Linux accounts CPU in USER_HZ=100 ticks; macOS/Windows finer
CPU_INTERRUPT_SLACK_PERCENT: Final = 1.0  # interrupts and kernel threads steal ~0.1-1%
CPU_MAX_SLACK_PERCENT: Final = 10.0  # below ~200 ms intervals, tick noise exceeds any slack


def cpu_busy_threshold(window_ms: int) -> float:
    """The mean CPU% over a window that counts as "at or above 100% of one core".

    100 less the measurement's resolution: two clock ticks per window (one at each end of
    the delta) and 1% for interrupts. 98.8 over 10 s, 97.0 over 1 s, 95.0 over 500 ms,
    90.0 over 200 ms or less.
    """
    tick_percent = ONE_CORE_PERCENT * 2 * CLOCK_TICK_S / (window_ms / 1000)
    return ONE_CORE_PERCENT - min(CPU_MAX_SLACK_PERCENT, CPU_INTERRUPT_SLACK_PERCENT + tick_percent)


def _tenths(percent: float) -> float:
    """``percent`` to one decimal, halves up, the same on every host.

    A mean that is exactly x.x5 in decimal is a hair above or below it in binary depending
    on the order of the additions; the 1e-9 nudge makes such ties round up every time
    (measurements are never that close to a tie by chance).
    """
    return math.floor(percent * 10 + 0.5 + 1e-9) / 10


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

    ``check`` holds no I/O and kills nothing; its only state is the trailing CPU window:
    each rated sample's interval and the core-seconds demanded in it. RSS is checked
    first, on its own; CPU breaches once the window spans ``cpu_sustained_ms`` and its
    mean demand is at least ``cpu_busy_percent``.
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
            cpu_busy_threshold(cpu_sustained_ms) if cpu_busy_percent is None else cpu_busy_percent
        )
        self._window: deque[tuple[float, float]] = deque()  # (interval s, core-seconds)
        self._span_s = 0.0
        self._used_s = 0.0

    @property
    def window_ms(self) -> int:
        """How much time the trailing CPU window covers so far."""
        return round(self._span_s * 1000)

    def _slide(self, interval_s: float, demand_percent: float) -> None:
        used = demand_percent / ONE_CORE_PERCENT * interval_s
        self._window.append((interval_s, used))
        sustained_s = self.cpu_sustained_ms / 1000
        span = math.fsum(i for i, _ in self._window)
        # Drop the oldest samples while the rest still cover the whole window.
        while len(self._window) > 1 and span - self._window[0][0] >= sustained_s:
            span = math.fsum(i for i, _ in itertools.islice(self._window, 1, None))
            self._window.popleft()
        # Summed afresh (correctly rounded) rather than kept as a running total: the
        # window slides for hours, and a drifting total would move the verdict.
        self._span_s = span
        self._used_s = math.fsum(u for _, u in self._window)

    def check(self, sample: TreeSample) -> LimitBreach | None:
        if sample.rss_bytes > self.rss_limit_bytes:
            return LimitBreach(
                "rss",
                sample.rss_bytes,
                self.rss_limit_bytes,
                f"process tree RSS {sample.rss_bytes} bytes over {sample.processes} "
                f"process(es), limit {self.rss_limit_bytes} (rss_limit_bytes)",
            )
        if sample.cpu_percent is None:  # first sample: no rate yet, the window is unchanged
            return None
        interval_s = sample.interval_s or self.poll_interval_ms / 1000
        runnable = sample.runnable_percent
        demand = sample.cpu_percent if runnable is None else max(runnable, sample.cpu_percent)
        self._slide(interval_s, demand)
        # Half a tick of slack: ten 1 s samples that measured 0.9999 s each still span 10 s.
        if self._span_s + CLOCK_TICK_S / 2 < self.cpu_sustained_ms / 1000:
            return None
        mean = _tenths(self._used_s / self._span_s * ONE_CORE_PERCENT)
        if mean < self.cpu_busy_percent:
            return None
        what = "CPU time" if runnable is None else "CPU time plus time waiting for a CPU"
        return LimitBreach(
            "cpu",
            mean,
            self.cpu_busy_percent,
            f"{mean}% of one core ({what}) over the last {self.window_ms} ms "
            f"(at least {self.cpu_busy_percent:g}% counts as a full core; "
            f"cpu_sustained_ms {self.cpu_sustained_ms})",
        )
