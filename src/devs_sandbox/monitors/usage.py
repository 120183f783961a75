"""The kill conditions of a monitored command, as a pure policy.

``ResourcePolicy.check(sample)`` decides from one ``TreeSample`` at a time whether a
command's process tree broke its limits: no I/O, no killing; its only state is the
CPU streak. The watchdog that samples and kills is the lifecycle's
(``lifecycle.watchdog.ShellMonitor``); the tool that runs a command under it is
``tools.shell.run_shell_monitored``.

What "at or above 100% of one core" means allows for measurement: kernels account
CPU in clock ticks (10 ms on Linux), so a single-threaded busy loop reads 97-102% at
a 1 s interval and never a steady 100. ``cpu_busy_threshold`` takes two ticks per
sample plus 1% for interrupts off 100 (97% at the default 1 s interval, never below
90%).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from devs_sandbox.models import TreeSample

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
