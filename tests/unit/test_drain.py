"""Drain detection logic with a simulated metrics source and a manual clock."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from devs_sandbox.config import QuotaConfig
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.lifecycle.watchdog import ResourceDrainDetector
from devs_sandbox.models import DetectionRule, SandboxContext, SandboxMetrics, ViolationType
from devs_sandbox.monitors.drain import (
    QuotaViolation,
    check_filesystem_quota,
    check_growth,
    check_process_quota,
)
from devs_sandbox.scheduler import FakeScheduler
from devs_sandbox.store import ViolationStore

pytestmark = pytest.mark.unit


# -- pure checks (the spec's unit tests) ------------------------------------------------------
def test_file_count_over_the_limit() -> None:
    r = check_filesystem_quota(sandbox_id="sb-001", file_count=10_001, file_count_limit=10_000)
    assert r.violated and r.violation == ViolationType.FILE_COUNT_EXCEEDED
    assert (r.sandbox_id, r.observed_value, r.limit_value) == ("sb-001", 10_001, 10_000)


def test_file_count_under_the_limit() -> None:
    r = check_filesystem_quota(sandbox_id="sb-001", file_count=5_000, file_count_limit=10_000)
    assert not r.violated and r.violation is None


def test_file_count_at_the_limit_is_allowed() -> None:
    assert not check_filesystem_quota(
        sandbox_id="s", file_count=10_000, file_count_limit=10_000
    ).violated


def test_process_count_over_the_limit() -> None:
    r = check_process_quota(sandbox_id="sb-001", process_count=513, process_count_limit=512)
    assert r.violated and r.violation == ViolationType.PROCESS_COUNT_EXCEEDED
    assert not check_process_quota(
        sandbox_id="s", process_count=512, process_count_limit=512
    ).violated


def test_depth_and_size() -> None:
    d = check_filesystem_quota(
        sandbox_id="s", file_count=1, file_count_limit=10, directory_depth=30, depth_limit=20
    )
    assert d.violation == ViolationType.DIRECTORY_DEPTH_EXCEEDED and d.observed_value == 30
    f = check_filesystem_quota(
        sandbox_id="s",
        file_count=1,
        file_count_limit=10,
        largest_file_bytes=50 << 20,
        max_file_size_bytes=10 << 20,
    )
    assert f.violation == ViolationType.FILE_SIZE_EXCEEDED
    ok = check_filesystem_quota(
        sandbox_id="s", file_count=1, file_count_limit=10, directory_depth=5, depth_limit=20
    )
    assert not ok.violated


def test_growth_rule() -> None:
    assert check_growth([2000, 4000, 6000], 10_000, lookahead_ticks=2, min_samples=3) == (
        True,
        10_000,
    )
    assert not check_growth([2000, 4000], 10_000, lookahead_ticks=2, min_samples=3)[0]
    assert not check_growth([2000, 2000, 6000], 10_000, lookahead_ticks=2, min_samples=3)[0]
    assert not check_growth([100, 200, 300], 10_000, lookahead_ticks=2, min_samples=3)[0]
    assert not check_growth([2000, 4000, 6000], 10_000, lookahead_ticks=0, min_samples=3)[0]


# -- the detector with a simulated source ----------------------------------------------------------
class Source:
    """Scripted metrics; records force_stop calls (the driver's termination)."""

    def __init__(self, samples: list[SandboxMetrics]) -> None:
        self.samples = samples
        self.i = 0
        self.stops = 0
        self.lock = threading.Lock()

    def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
        m = self.samples[min(self.i, len(self.samples) - 1)]
        self.i += 1
        return m

    def force_stop(self, ctx: SandboxContext) -> None:
        with self.lock:
            self.stops += 1


def ctx(sid: str = "sb-001") -> SandboxContext:
    from pathlib import Path

    return SandboxContext(id=sid, driver="fake", workspace=Path("/nonexistent"), isolation=())


def setup(
    samples: list[SandboxMetrics], quotas: QuotaConfig | None = None, sid: str = "sb-001"
) -> tuple[ResourceDrainDetector, FakeScheduler, Source, dict[str, list[dict[str, Any]]]]:
    bus = EventBus()
    events: dict[str, list[dict[str, Any]]] = {}
    for name in (
        SandboxEvents.RESOURCE_DRAIN,
        SandboxEvents.SECURITY_PAUSE,
        SandboxEvents.VIOLATION,
    ):
        bus.on(name, lambda e, p: events.setdefault(e, []).append(p))
    clock = FakeScheduler()
    det = ResourceDrainDetector(bus=bus, scheduler=clock)
    src = Source(samples)
    det.register(ctx(sid), quotas or QuotaConfig(), src)
    return det, clock, src, events


def files(n: int) -> SandboxMetrics:
    return SandboxMetrics("sb-001", 0.0, file_count=n, process_count=1)


def procs(n: int) -> SandboxMetrics:
    return SandboxMetrics("sb-001", 0.0, file_count=0, process_count=n)


def test_file_growth_of_2000_per_tick_is_caught_by_the_third_tick() -> None:
    det, clock, src, _events = setup([files(2000 * k) for k in range(1, 10)])
    det.start_polling("sb-001", interval_s=2.0)
    clock.advance(2.0)
    clock.advance(2.0)
    assert src.stops == 0
    clock.advance(2.0)  # third tick: 6,000 files
    assert src.stops == 1
    v = det.violation_for("sb-001")
    assert v is not None and v.type == ViolationType.FILE_COUNT_EXCEEDED
    assert v.observed_value == 6000 and v.rule == DetectionRule.GROWTH
    assert not det.is_polling("sb-001")
    clock.advance(100)
    assert src.i == 3  # no sample after the violation


def test_threshold_alone_catches_it_later_when_growth_is_off() -> None:
    det, clock, src, _ = setup(
        [files(2000 * k) for k in range(1, 10)], QuotaConfig(growth_lookahead_ticks=0)
    )
    det.start_polling("sb-001", interval_s=2.0)
    for _ in range(5):
        clock.advance(2.0)
    assert src.stops == 0  # 10,000 is at the limit, not over
    clock.advance(2.0)
    v = det.violation_for("sb-001")
    assert v is not None and v.observed_value == 12_000 and v.rule == DetectionRule.THRESHOLD


def test_process_count_doubling_is_caught_at_the_first_tick_above_512() -> None:
    det, clock, src, _ = setup([procs(64 * 2**k) for k in range(8)])
    det.start_polling("sb-001", interval_s=2.0)
    for tick, count in enumerate([64, 128, 256, 512], start=1):
        clock.advance(2.0)
        assert src.stops == 0, f"stopped early at tick {tick} ({count})"
    clock.advance(2.0)
    v = det.violation_for("sb-001")
    assert src.stops == 1 and v is not None
    assert v.type == ViolationType.PROCESS_COUNT_EXCEEDED and v.observed_value == 1024


def test_enforce_terminates_then_emits_with_the_violation_and_timestamp() -> None:
    det, _clock, src, events = setup([files(0)])
    qv = check_filesystem_quota(sandbox_id="sb-001", file_count=10_001, file_count_limit=10_000)
    assert det.enforce_quota(qv) is True
    assert src.stops == 1
    drain = events[SandboxEvents.RESOURCE_DRAIN][0]
    assert drain["violation"].type == ViolationType.FILE_COUNT_EXCEEDED
    assert drain["terminated_at"].endswith("Z") and "T" in drain["terminated_at"]
    assert events[SandboxEvents.SECURITY_PAUSE][0]["sandbox_id"] == "sb-001"
    assert len(events[SandboxEvents.VIOLATION]) == 1


def test_two_concurrent_violations_terminate_once_and_record_the_first(tmp_path: Any) -> None:
    det, _clock, src, events = setup([files(0)])
    store = ViolationStore(tmp_path / "v.db")
    store.attach(det.bus)
    a = QuotaViolation(True, ViolationType.FILE_COUNT_EXCEEDED, "sb-001", 10_001, 10_000)
    b = QuotaViolation(True, ViolationType.PROCESS_COUNT_EXCEEDED, "sb-001", 513, 512)
    barrier = threading.Barrier(2)
    results: list[bool] = []

    def go(v: QuotaViolation) -> None:
        barrier.wait()
        results.append(det.enforce_quota(v))

    threads = [threading.Thread(target=go, args=(v,)) for v in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, True]
    assert src.stops == 1
    assert store.count() == 1
    assert len(events[SandboxEvents.RESOURCE_DRAIN]) == 1
    recorded = store.list()[0]["violation_type"]
    assert det.violation_for("sb-001").type == recorded  # type: ignore[union-attr]


def test_failing_listener_and_store_do_not_prevent_termination(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    det, _clock, src, _ = setup([files(0)])

    def bad_listener(_e: str, _p: dict[str, Any]) -> None:
        raise RuntimeError("listener down")

    det.bus.on(SandboxEvents.RESOURCE_DRAIN, bad_listener)
    blocker = tmp_path / "file"
    blocker.write_text("")
    ViolationStore(blocker / "no" / "db").attach(det.bus)  # every write fails
    with caplog.at_level(logging.ERROR):
        assert det.enforce_quota(
            QuotaViolation(True, ViolationType.FILE_COUNT_EXCEEDED, "sb-001", 2, 1)
        )
    assert src.stops == 1
    assert "listener down" in caplog.text
    assert "cannot" in caplog.text  # the store's failure was logged


def test_kernel_rules_report_what_the_kernel_refused() -> None:
    q = QuotaConfig(process_count_limit=64, memory_bytes=64 << 20, max_file_size_bytes=10 << 20)
    det, _c, _s, _e = setup([files(0)], q)
    pids = det.evaluate("sb-001", SandboxMetrics("sb-001", 0, process_count=64, pids_limit_hits=3))
    assert (
        pids.violation == ViolationType.PROCESS_COUNT_EXCEEDED and pids.rule == DetectionRule.KERNEL
    )
    oom = det.evaluate("sb-001", SandboxMetrics("sb-001", 0, oom_kills=1))
    assert oom.violation == ViolationType.MEMORY_EXCEEDED and oom.limit_value == 64 << 20
    size = det.evaluate("sb-001", SandboxMetrics("sb-001", 0, largest_file_bytes=10 << 20))
    assert size.violation == ViolationType.FILE_SIZE_EXCEEDED
    depth = det.evaluate("sb-001", SandboxMetrics("sb-001", 0, directory_depth=21))
    assert depth.violation == ViolationType.DIRECTORY_DEPTH_EXCEEDED
    assert not det.evaluate("sb-001", SandboxMetrics("sb-001", 0, file_count=3)).violated


def test_growth_rule_for_processes_when_enabled() -> None:
    q = QuotaConfig(growth_metrics=("fileCount", "processCount"))
    det, clock, _src, _ = setup([procs(64 * 2**k) for k in range(8)], q)
    det.start_polling("sb-001", interval_s=1.0)
    for _ in range(4):
        clock.advance(1.0)
    v = det.violation_for("sb-001")
    assert v is not None and v.rule == DetectionRule.GROWTH and v.observed_value <= 512


def test_stop_polling_and_unknown_ids() -> None:
    det, clock, src, _ = setup([files(1)])
    det.stop_polling("never")
    det.start_polling("sb-001", interval_s=0.1)
    clock.advance(0.35)
    assert src.i == 3
    det.stop_polling("sb-001")
    det.stop_polling("sb-001")
    clock.advance(10)
    assert src.i == 3
    with pytest.raises(KeyError):
        det.start_polling("unknown")
    with pytest.raises(ValueError):
        det.start_polling("sb-001", interval_s=0.0)
    det.forget("sb-001")
    assert det.poll_once("sb-001") is None


def test_a_failing_sample_keeps_polling() -> None:
    class Flaky(Source):
        def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
            self.i += 1
            if self.i == 1:
                raise OSError("transient")
            return files(1)

    bus = EventBus()
    clock = FakeScheduler()
    det = ResourceDrainDetector(bus=bus, scheduler=clock)
    src = Flaky([])
    det.register(ctx(), QuotaConfig(), src)
    det.start_polling("sb-001", interval_s=0.1)
    clock.advance(0.25)
    assert src.i == 2 and det.is_polling("sb-001")


def test_a_vanished_sandbox_stops_its_poller() -> None:
    from devs_sandbox.errors import SandboxNotFoundError

    class Gone(Source):
        def get_metrics(self, ctx: SandboxContext) -> SandboxMetrics:
            raise SandboxNotFoundError(ctx.id)

    det = ResourceDrainDetector(bus=EventBus(), scheduler=(clock := FakeScheduler()))
    det.register(ctx(), QuotaConfig(), Gone([]))
    det.start_polling("sb-001", interval_s=0.1)
    clock.advance(1)
    assert not det.is_polling("sb-001")


def test_enforce_for_an_unregistered_sandbox_still_records() -> None:
    bus = EventBus()
    seen: list[Any] = []
    bus.on(SandboxEvents.VIOLATION, lambda e, p: seen.append(p))
    det = ResourceDrainDetector(bus=bus, scheduler=FakeScheduler())
    assert det.enforce_quota(QuotaViolation(True, ViolationType.FILE_COUNT_EXCEEDED, "ghost", 2, 1))
    assert seen and seen[0]["sandbox_id"] == "ghost"


def test_quota_violation_without_a_violation_cannot_be_recorded() -> None:
    with pytest.raises(ValueError):
        QuotaViolation.ok("s").to_violation()
