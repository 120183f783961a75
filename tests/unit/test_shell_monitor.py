"""run_shell_monitored with a fake clock and a scripted stats source: no real process.

The policy alone (the counter logic), the sampling loop on ``FakeScheduler``, and the
whole run over ``FakeDriver``, whose exec advances the fake clock until the monitor
kills the sandbox or the scripted command ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devs_sandbox import ResourceLimitExceededError as RootExport
from devs_sandbox.config import SandboxLifecycleConfig, override
from devs_sandbox.drivers.fake import FakeDriver, FakeSandbox, killed_result, ok_result
from devs_sandbox.errors import (
    ConfigError,
    DriverError,
    ResourceLimitExceededError,
    SandboxTimeoutError,
)
from devs_sandbox.lifecycle import SandboxLifecycleManager
from devs_sandbox.lifecycle.sampling import ScriptedProcessStats
from devs_sandbox.lifecycle.timeout import SandboxTimeoutEnforcer
from devs_sandbox.lifecycle.watchdog import ShellMonitor
from devs_sandbox.models import ExecResult, TreeSample
from devs_sandbox.monitors.usage import LimitBreach, ResourcePolicy, cpu_busy_threshold
from devs_sandbox.scheduler import FakeScheduler
from devs_sandbox.store import ViolationStore
from devs_sandbox.tools.shell import (
    MonitoredShellOptions,
    ShellResult,
    monitored_exec,
    run_shell_monitored,
    run_shell_monitored_sync,
)

pytestmark = pytest.mark.unit
PID = 4242
MiB = 1024 * 1024


def idle(rss: int = 10 * MiB) -> TreeSample:
    return TreeSample(rss_bytes=rss, cpu_percent=0.0)


def busy(cpu: float = 150.0, rss: int = 10 * MiB) -> TreeSample:
    return TreeSample(rss_bytes=rss, cpu_percent=cpu)


PRIME = TreeSample(rss_bytes=1 * MiB, cpu_percent=None)  # what a first sample looks like


# -- the policy ---------------------------------------------------------------------------
def policy(**kw: Any) -> ResourcePolicy:
    args = {"rss_limit_bytes": 100 * MiB, "cpu_sustained_ms": 3_000, "poll_interval_ms": 1_000}
    return ResourcePolicy(**(args | kw))


def test_rss_above_the_limit_for_one_sample_breaches() -> None:
    p = policy()
    assert p.check(idle(rss=100 * MiB)) is None  # at the limit is within it
    b = p.check(idle(rss=100 * MiB + 1))
    assert b == LimitBreach("rss", 100 * MiB + 1, 100 * MiB, b.detail if b else "")
    assert b is not None and "rss_limit_bytes" in b.detail


def test_cpu_breaches_once_the_window_spans_sustained_ms() -> None:
    p = policy()  # a 3000 ms window at 1000 ms
    assert p.check(busy(120)) is None
    assert p.check(busy(140)) is None
    assert p.window_ms == 2_000
    b = p.check(busy(160))
    assert b is not None and b.reason == "cpu"
    assert b.value == 140.0  # the window's mean
    assert b.limit == cpu_busy_threshold(3_000) == pytest.approx(98.333, abs=1e-3)
    assert "over the last 3000 ms" in b.detail and "(CPU time)" in b.detail


def test_an_idle_sample_holds_the_window_below_until_it_slides_out() -> None:
    p = policy()
    for _ in range(2):
        assert p.check(busy(100.0)) is None
    assert p.check(busy(50.0)) is None  # mean 83.3 over 3 s
    assert p.window_ms == 3_000
    assert p.check(busy(100.0)) is None  # 50 still in the window
    assert p.check(busy(100.0)) is None
    assert p.check(busy(100.0)) is not None  # the 50 slid out


def test_cpu_is_judged_on_cumulative_time_not_per_sample() -> None:
    """A burst makes up for a quieter sample: 3 core-seconds in 3 s is a core for 3 s."""
    p = policy()
    assert p.check(busy(250.0)) is None
    assert p.check(busy(0.0)) is None
    b = p.check(busy(50.0))
    assert b is not None and b.value == 100.0


def test_a_busy_loop_on_a_loaded_host_breaches_on_time() -> None:
    """86-99% of a core per sample, runnable all along: killed after 3 s, not never."""
    p = policy()
    got = [86.0, 99.0, 91.0]
    assert p.check(TreeSample(10 * MiB, got[0], runnable_percent=100.0)) is None
    assert p.check(TreeSample(10 * MiB, got[1], runnable_percent=99.9)) is None
    b = p.check(TreeSample(10 * MiB, got[2], runnable_percent=100.0))
    assert b is not None and b.value == 100.0
    assert "CPU time plus time waiting for a CPU" in b.detail
    # The same CPU readings without run-queue accounting are not a full core.
    plain = policy()
    assert all(plain.check(busy(c)) is None for c in got)


def test_a_sleeping_tree_is_not_made_busy_by_run_queue_waits() -> None:
    p = policy()
    assert all(p.check(TreeSample(10 * MiB, 5.0, runnable_percent=7.0)) is None for _ in range(10))


def test_measured_intervals_make_the_window() -> None:
    p = policy()  # 3000 ms, however the samples fall
    for _ in range(5):
        assert p.check(TreeSample(10 * MiB, 100.0, interval_s=0.5)) is None
    assert p.window_ms == 2_500
    b = p.check(TreeSample(10 * MiB, 100.0, interval_s=0.5))
    assert b is not None and p.window_ms == 3_000


def test_a_sample_without_a_rate_neither_counts_nor_resets() -> None:
    p = policy()
    p.check(busy())
    p.check(PRIME)
    assert p.window_ms == 1_000


def test_rss_is_checked_before_cpu() -> None:
    p = policy(cpu_sustained_ms=1_000)
    b = p.check(busy(rss=200 * MiB))
    assert b is not None and b.reason == "rss"


def test_busy_threshold_allows_for_tick_granular_accounting() -> None:
    assert cpu_busy_threshold(1_000) == 97.0
    assert cpu_busy_threshold(500) == 95.0
    assert cpu_busy_threshold(200) == 90.0
    assert cpu_busy_threshold(10) == 90.0  # capped: never below 90%
    assert cpu_busy_threshold(60_000) == pytest.approx(98.9667, abs=1e-3)
    # A single-threaded busy loop reading 97.5% at the default interval counts as a full core.
    p = policy(cpu_sustained_ms=1_000)
    assert p.check(busy(97.5)) is not None
    # Over a 10 s window the resolution is finer: two ticks in 10 s, plus 1%.
    assert cpu_busy_threshold(10_000) == pytest.approx(98.8)


def test_an_explicit_busy_threshold_is_the_spec_literal() -> None:
    p = policy(cpu_busy_percent=100.0, cpu_sustained_ms=1_000)
    assert p.check(busy(99.9)) is None
    assert p.check(busy(100.0)) is not None


@settings(max_examples=200, deadline=None)
@given(
    cpus=st.lists(st.sampled_from([0.0, 50.0, 96.9, 97.0, 100.0, 250.0]), max_size=40),
    sustained=st.integers(min_value=1, max_value=6_000),
    interval=st.sampled_from([250, 500, 1_000]),
)
def test_breach_iff_a_trailing_window_averages_a_full_core(
    cpus: list[float], sustained: int, interval: int
) -> None:
    p = ResourcePolicy(
        rss_limit_bytes=1 << 40, cpu_sustained_ms=sustained, poll_interval_ms=interval
    )
    size = math.ceil(sustained / interval)  # the fewest samples that span the window
    threshold = cpu_busy_threshold(sustained)
    expected: int | None = None  # index of the first sample whose window breaches
    for i in range(len(cpus)):
        window = cpus[max(0, i + 1 - size) : i + 1]
        if len(window) * interval + 5 < sustained:  # half a tick of slack
            continue
        # The mean in exact arithmetic, to tenths with halves up (the policy's rounding).
        mean = Fraction(sum(Fraction(str(c)) for c in window), len(window))
        if math.floor(mean * 10 + Fraction(1, 2)) / 10 >= threshold:
            expected = i
            break
    got: int | None = None
    for i, cpu in enumerate(cpus):
        if p.check(busy(cpu)) is not None:
            got = i
            break
    assert got == expected


# -- options ------------------------------------------------------------------------------
def test_options_default_to_the_spec() -> None:
    o = MonitoredShellOptions()
    assert (o.rss_limit_bytes, o.cpu_sustained_ms, o.poll_interval_ms) == (
        4 * 1024**3,
        10_000,
        1_000,
    )
    assert o.timeout_s is None


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"rss_limit_bytes": -1}, "rss_limit_bytes"),
        ({"rss_limit_bytes": 0}, "rss_limit_bytes"),
        ({"rss_limit_bytes": True}, "rss_limit_bytes"),
        ({"rss_limit_bytes": 1.5e9}, "rss_limit_bytes"),
        ({"cpu_sustained_ms": 0}, "cpu_sustained_ms"),
        ({"cpu_sustained_ms": "10"}, "cpu_sustained_ms"),
        ({"poll_interval_ms": 5}, "poll_interval_ms"),
        ({"poll_interval_ms": 60_001}, "poll_interval_ms"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": -3.0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"timeout_s": False}, "timeout_s"),
        ({"timeout_s": "30"}, "timeout_s"),
    ],
)
def test_bad_options_name_the_option(kw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        MonitoredShellOptions(**kw)
    assert err.value.key == key and key in str(err.value)


# -- the sampling loop ----------------------------------------------------------------------
class Killer:
    def __init__(self, fail: bool = False) -> None:
        self.kills = 0
        self.fail = fail

    def __call__(self) -> None:
        self.kills += 1
        if self.fail:
            raise OSError("kill failed")


def loop(
    script: Sequence[TreeSample | BaseException | None], **kw: Any
) -> tuple[ShellMonitor, ScriptedProcessStats, Killer, FakeScheduler]:
    sched = FakeScheduler()
    stats = ScriptedProcessStats(script)
    killer = Killer(fail=kw.pop("fail_kill", False))
    return ShellMonitor(policy(**kw), stats, killer, scheduler=sched), stats, killer, sched


def test_start_takes_a_first_sample_then_one_per_interval() -> None:
    mon, stats, killer, sched = loop([PRIME, idle()])
    mon.start(PID)
    assert stats.calls == [PID] and mon.started
    sched.advance(0.999)
    assert len(stats.calls) == 1
    sched.advance(0.001)
    assert len(stats.calls) == 2
    sched.advance(5.0)
    assert len(stats.calls) == 7 and killer.kills == 0 and mon.breach is None


def test_rss_kill_stops_sampling_for_good() -> None:
    mon, stats, killer, sched = loop([PRIME, idle(), idle(rss=101 * MiB)])
    mon.start(PID)
    sched.advance(2.0)
    assert killer.kills == 1 and mon.killed
    assert mon.breach is not None and mon.breach.reason == "rss"
    taken = len(stats.calls)
    assert taken == 3
    sched.advance(60.0)
    assert len(stats.calls) == taken, "a sample was taken after the kill"
    assert sched.pending() == 0


def test_cpu_kill_after_the_sustained_time_not_before() -> None:
    mon, stats, killer, sched = loop([PRIME, busy()])  # 3000 ms at 1000 ms
    mon.start(PID)
    sched.advance(2.0)
    assert killer.kills == 0 and mon.policy.window_ms == 2_000
    sched.advance(1.0)
    assert killer.kills == 1 and mon.breach is not None and mon.breach.reason == "cpu"
    sched.advance(60.0)
    assert len(stats.calls) == 4


def test_an_idle_sample_in_every_window_is_not_killed() -> None:
    full = busy(100.0)
    mon, _stats, killer, sched = loop([PRIME, full, full, idle(), full, full, idle()])
    mon.start(PID)
    sched.advance(30.0)
    assert killer.kills == 0


def test_the_loop_ends_when_the_command_is_gone() -> None:
    mon, stats, killer, sched = loop([PRIME, idle(), None])
    mon.start(PID)
    sched.advance(10.0)
    assert len(stats.calls) == 3 and killer.kills == 0 and sched.pending() == 0


def test_stop_cancels_the_timer_and_is_idempotent() -> None:
    mon, stats, _killer, sched = loop([PRIME, idle()])
    mon.start(PID)
    mon.stop()
    mon.stop()
    sched.advance(10.0)
    assert len(stats.calls) == 1 and sched.pending() == 0
    mon.start(PID + 1)  # a late on_start after stop does nothing
    assert len(stats.calls) == 1


def test_stop_before_start_means_no_sample_at_all() -> None:
    mon, stats, _killer, _sched = loop([PRIME])
    mon.stop()
    mon.start(PID)
    assert stats.calls == [] and not mon.started


def test_a_second_start_is_ignored() -> None:
    mon, stats, _killer, _sched = loop([PRIME, idle()])
    mon.start(PID)
    mon.start(PID + 1)
    assert stats.calls == [PID]


def test_a_sampling_failure_kills_fail_closed() -> None:
    mon, stats, killer, sched = loop([PRIME, PermissionError("no /proc for you")])
    mon.start(PID)
    sched.advance(1.0)
    assert killer.kills == 1 and isinstance(mon.error, PermissionError) and mon.killed
    sched.advance(10.0)
    assert len(stats.calls) == 2


def test_a_failing_kill_is_logged_and_sampling_still_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mon, stats, killer, sched = loop([PRIME, idle(rss=1 << 40)], fail_kill=True)
    with caplog.at_level(logging.ERROR, logger="devs_sandbox.lifecycle.watchdog"):
        mon.start(PID)
        sched.advance(5.0)
    assert killer.kills == 1 and len(stats.calls) == 2
    assert "killing monitored process tree" in caplog.text


def test_scripted_stats_needs_a_script() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ScriptedProcessStats([])


# -- whole runs over FakeDriver ---------------------------------------------------------
class PidDriver(FakeDriver):
    """FakeDriver whose execs report a leader pid, as the process driver's do."""

    def provision(self, config: SandboxLifecycleConfig, **kw: Any) -> Any:
        ctx = super().provision(config, **kw)
        self.sandboxes[ctx.id].pid = PID
        return ctx


def runs_until_killed(sched: FakeScheduler, *, seconds: int = 30, out: str = "done\n") -> Any:
    """An exec that lets fake time pass, second by second, until it is killed or done."""

    def handler(sb: FakeSandbox, _cmd: Sequence[str]) -> ExecResult:
        for _ in range(seconds):
            if sb.stopped.is_set():
                return killed_result()
            sched.advance(1.0)
        return killed_result() if sb.stopped.is_set() else ok_result(out)

    return handler


def setup(
    script: Sequence[TreeSample | BaseException | None],
    *,
    seconds: int = 30,
    db: Path | None = None,
    driver_cls: type[FakeDriver] = PidDriver,
) -> tuple[SandboxLifecycleManager, FakeDriver, FakeScheduler, ScriptedProcessStats]:
    sched = FakeScheduler()
    driver = driver_cls(exec_handler=runs_until_killed(sched, seconds=seconds))
    manager = SandboxLifecycleManager(
        driver,
        store=ViolationStore(db) if db is not None else None,
        enforcer=SandboxTimeoutEnforcer(scheduler=sched),
    )
    return manager, driver, sched, ScriptedProcessStats(script)


CFG = SandboxLifecycleConfig(driver="fake")
OPTS = MonitoredShellOptions(rss_limit_bytes=100 * MiB, cpu_sustained_ms=3_000)


def test_a_normal_exit_resolves_with_its_result() -> None:
    manager, driver, sched, stats = setup([PRIME, idle()], seconds=5)
    result = run_shell_monitored_sync(
        "echo done", OPTS, manager=manager, config=CFG, stats=stats, scheduler=sched
    )
    assert result == ShellResult(0, "done\n", "", False, False, 0.0)
    (sb_id,) = driver.provisioned
    assert driver.destroyed == [sb_id]
    assert driver.sandboxes == {} and sched.pending() == 0
    assert len(stats.calls) == 6  # the first sample and one per fake second


def test_the_command_runs_through_sh_in_a_fresh_sandbox() -> None:
    manager, driver, sched, stats = setup([PRIME], seconds=1)
    seen: list[list[str]] = []
    inner = driver.exec_handler
    driver.exec_handler = lambda sb, cmd: (seen.append(list(cmd)), inner(sb, cmd))[1]
    run_shell_monitored_sync(
        "ls | wc -l", manager=manager, config=CFG, stats=stats, scheduler=sched
    )
    assert seen == [["/bin/sh", "-c", "ls | wc -l"]]


def test_rss_kill_raises_with_the_spec_message_and_records_it(tmp_path: Path) -> None:
    db = tmp_path / "v.db"
    manager, driver, sched, stats = setup([PRIME, idle(), idle(rss=150 * MiB)], db=db)
    with pytest.raises(ResourceLimitExceededError) as err:
        run_shell_monitored_sync(
            "hog", OPTS, manager=manager, config=CFG, stats=stats, scheduler=sched
        )
    e = err.value
    assert (e.pid, e.reason, e.value, e.limit) == (PID, "rss", 150 * MiB, 100 * MiB)
    assert str(e) == f"Process {PID} exceeded rss limit: {150 * MiB} > {100 * MiB}"
    assert e.result is not None and e.result.exit_code == 137
    assert len(stats.calls) == 3, "sampled after the kill"
    (sb_id,) = driver.destroyed
    assert driver.sandboxes == {} and sched.pending() == 0
    rows = ViolationStore(db).list()
    assert [(r["sandbox_id"], r["violation_type"]) for r in rows] == [(sb_id, "MEMORY_EXCEEDED")]
    assert rows[0]["observed_value"] == 150 * MiB and rows[0]["limit_value"] == 100 * MiB
    assert f"pid {PID}" in rows[0]["detail"]
    assert isinstance(e, RootExport)


def test_cpu_kill_raises_after_the_sustained_time(tmp_path: Path) -> None:
    db = tmp_path / "v.db"
    manager, _driver, sched, stats = setup([PRIME, busy(180.0)], db=db)
    with pytest.raises(ResourceLimitExceededError) as err:
        run_shell_monitored_sync(
            "spin", OPTS, manager=manager, config=CFG, stats=stats, scheduler=sched
        )
    e = err.value
    limit = cpu_busy_threshold(3_000)
    assert (e.reason, e.value, e.limit) == ("cpu", 180.0, limit)
    assert str(e) == f"Process {PID} exceeded cpu limit: 180.0 > {limit}"
    assert len(stats.calls) == 4  # the first sample, then 3 busy seconds
    (row,) = ViolationStore(db).list()
    assert row["violation_type"] == "CPU_EXCEEDED"


def test_a_sampling_failure_kills_and_raises_a_driver_error() -> None:
    manager, driver, sched, stats = setup([PRIME, RuntimeError("psutil broke")])
    with pytest.raises(DriverError, match="could not sample"):
        run_shell_monitored_sync(
            "x", OPTS, manager=manager, config=CFG, stats=stats, scheduler=sched
        )
    assert len(driver.destroyed) == 1


def test_a_driver_without_pids_runs_unmonitored_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, _driver, sched, stats = setup([PRIME], seconds=2, driver_cls=FakeDriver)
    with caplog.at_level(logging.WARNING, logger="devs_sandbox.tools.shell"):
        result = run_shell_monitored_sync(
            "x", OPTS, manager=manager, config=CFG, stats=stats, scheduler=sched
        )
    assert result.exit_code == 0 and stats.calls == []
    assert "without the RSS/CPU monitor" in caplog.text


def test_timeout_s_is_the_sandboxs_total_timeout() -> None:
    manager, driver, sched, stats = setup([PRIME, idle()], seconds=60)
    opts = MonitoredShellOptions(timeout_s=4.5)
    with pytest.raises(SandboxTimeoutError) as err:
        run_shell_monitored_sync(
            "sleep 60", opts, manager=manager, config=CFG, stats=stats, scheduler=sched
        )
    assert err.value.timeout_s == 4.5
    assert err.value.outcome is not None and err.value.outcome.result.exit_code == 137
    assert len(driver.destroyed) == 1 and sched.pending() == 0


def test_a_pinned_sandbox_id_is_kept() -> None:
    manager, driver, sched, stats = setup([PRIME], seconds=1)
    cfg = override(CFG, sandbox_id="sb-pinned")
    run_shell_monitored_sync("x", manager=manager, config=cfg, stats=stats, scheduler=sched)
    assert driver.provisioned == ["sb-pinned"]


@pytest.mark.parametrize("command", ["", "   \n", "a\0b", 42, None])
def test_bad_commands_are_refused_before_any_sandbox(command: Any) -> None:
    manager, driver, sched, stats = setup([PRIME])
    with pytest.raises(ConfigError) as err:
        run_shell_monitored_sync(command, manager=manager, config=CFG, stats=stats, scheduler=sched)
    assert err.value.key == "command"
    assert driver.provisioned == []


def test_monitored_exec_keeps_the_sandbox_and_passes_the_exec_timeout() -> None:
    manager, driver, sched, stats = setup([PRIME, idle(rss=1 << 40)])
    sandbox = manager.open_sandbox(CFG)
    try:
        with pytest.raises(ResourceLimitExceededError):
            monitored_exec(sandbox, "hog", OPTS, timeout_s=30.0, stats=stats, scheduler=sched)
        assert not sandbox.destroyed and driver.sandboxes[sandbox.id].force_stops == 1
    finally:
        sandbox.destroy()


def test_the_default_manager_is_private_and_shut_down(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[SandboxLifecycleManager] = []
    shut: list[SandboxLifecycleManager] = []
    real_init = SandboxLifecycleManager.__init__

    def init(self: SandboxLifecycleManager, *a: Any, **kw: Any) -> None:
        real_init(self, FakeDriver(), store=None)
        made.append(self)

    monkeypatch.setattr(SandboxLifecycleManager, "__init__", init)

    def shutdown(self: SandboxLifecycleManager) -> None:
        shut.append(self)

    monkeypatch.setattr(SandboxLifecycleManager, "shutdown", shutdown)
    sched = FakeScheduler()
    result = run_shell_monitored_sync(
        "true", config=CFG, stats=ScriptedProcessStats([PRIME]), scheduler=sched
    )
    assert result.exit_code == 0 and made == shut and len(made) == 1
    out = asyncio.run(
        run_shell_monitored(
            "true", config=CFG, stats=ScriptedProcessStats([PRIME]), scheduler=sched
        )
    )
    assert out.exit_code == 0 and made == shut and len(made) == 2


# -- the async edge -------------------------------------------------------------------------
def test_async_form_returns_the_same_result() -> None:
    manager, _driver, sched, stats = setup([PRIME, idle()], seconds=2)
    result = asyncio.run(
        run_shell_monitored("x", OPTS, manager=manager, config=CFG, stats=stats, scheduler=sched)
    )
    assert result.stdout == "done\n"


def test_async_form_raises_the_kill() -> None:
    manager, _driver, sched, stats = setup([PRIME, idle(rss=1 << 40)])
    with pytest.raises(ResourceLimitExceededError):
        asyncio.run(
            run_shell_monitored(
                "x", OPTS, manager=manager, config=CFG, stats=stats, scheduler=sched
            )
        )


def test_cancelling_the_coroutine_kills_and_destroys_before_propagating() -> None:
    started = threading.Event()

    def blocks(sb: FakeSandbox, _cmd: Sequence[str]) -> ExecResult:
        started.set()
        sb.stopped.wait(30)  # runs until killed
        return killed_result()

    driver = PidDriver(exec_handler=blocks)
    manager = SandboxLifecycleManager(driver, store=None)
    sched = FakeScheduler()

    async def main() -> None:
        task = asyncio.ensure_future(
            run_shell_monitored(
                "sleep 1000",
                manager=manager,
                config=CFG,
                stats=ScriptedProcessStats([PRIME]),
                scheduler=sched,
            )
        )
        while not started.is_set():
            assert not task.done(), task.exception()  # a failure before the exec: show it
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # By the time the cancellation reached us, the sandbox was gone.
        assert len(driver.destroyed) == 1 and driver.sandboxes == {}

    asyncio.run(main())
