"""run_in_sandbox over FakeDriver: one fresh sandbox per run, destroyed on every exit path."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from devs_sandbox.config import SandboxLifecycleConfig
from devs_sandbox.drivers.fake import FakeDriver, FakeSandbox, killed_result, ok_result
from devs_sandbox.errors import (
    ProvisionError,
    QuotaExceededError,
    SandboxCancelledError,
    SandboxNotFoundError,
    SandboxPreFlightError,
    SandboxTimeoutError,
)
from devs_sandbox.events import SandboxEvents
from devs_sandbox.models import ExecResult, SandboxMetrics
from devs_sandbox.store import ViolationStore
from tests.helpers import config, manager

pytestmark = pytest.mark.unit


def cfg(**kw: Any) -> SandboxLifecycleConfig:
    return config(driver="fake", **kw)


def test_success_returns_outcome_and_destroys() -> None:
    driver = FakeDriver(exec_handler=lambda sb, cmd: ok_result("hi\n"))
    m = manager(driver)
    out = m.run_in_sandbox(["echo", "hi"], cfg())
    assert out.exit_code == 0 and out.result.stdout.text == "hi\n"
    assert driver.destroyed == [out.sandbox_id]
    assert m.live_sandboxes() == []


def test_each_run_gets_a_fresh_unique_sandbox() -> None:
    driver = FakeDriver()
    m = manager(driver)
    ids = {m.run_in_sandbox(["true"], cfg()).sandbox_id for _ in range(20)}
    assert len(ids) == 20
    assert sorted(driver.destroyed) == sorted(ids)


def test_nonzero_exit_is_data_not_an_error() -> None:
    m = manager(FakeDriver(exec_handler=lambda sb, cmd: ok_result(exit_code=3)))
    out = m.run_in_sandbox("exit 3", cfg())
    assert out.exit_code == 3


def test_task_error_still_destroys() -> None:
    def boom(_sb: FakeSandbox, _cmd: Sequence[str]) -> ExecResult:
        raise RuntimeError("driver blew up")

    driver = FakeDriver(exec_handler=boom)
    with pytest.raises(RuntimeError):
        manager(driver).run_in_sandbox(["x"], cfg())
    assert len(driver.destroyed) == 1


def test_keyboard_interrupt_still_destroys() -> None:
    def interrupt(_sb: FakeSandbox, _cmd: Sequence[str]) -> ExecResult:
        raise KeyboardInterrupt

    driver = FakeDriver(exec_handler=interrupt)
    with pytest.raises(KeyboardInterrupt):
        manager(driver).run_in_sandbox(["x"], cfg())
    assert len(driver.destroyed) == 1


def test_preflight_runs_first_and_a_failure_stops_the_task() -> None:
    def handler(_sb: FakeSandbox, cmd: Sequence[str]) -> ExecResult:
        return ok_result(exit_code=1 if "check-fails" in cmd[-1] else 0)

    driver = FakeDriver(exec_handler=handler)
    m = manager(driver)
    events: list[dict[str, Any]] = []
    m.bus.on(SandboxEvents.PREFLIGHT_FAILED, lambda _e, p: events.append(p))
    with pytest.raises(SandboxPreFlightError) as info:
        m.run_in_sandbox(["the-task"], cfg(preflight_commands=("check-ok", "check-fails", "never")))
    sid = driver.provisioned[0]
    assert info.value.command == "check-fails"
    assert info.value.result is not None and info.value.result.exit_code == 1
    assert events == [{"sandbox_id": sid, "command": "check-fails", "exit_code": 1}]
    # The sandbox was destroyed, the third preflight and the task never ran.
    assert driver.destroyed == [sid]
    assert "the-task" not in str(info.value)


def test_preflight_success_then_task() -> None:
    seen: list[list[str]] = []

    def handler(_sb: FakeSandbox, cmd: Sequence[str]) -> ExecResult:
        seen.append(list(cmd))
        return ok_result()

    m = manager(FakeDriver(exec_handler=handler))
    out = m.run_in_sandbox(["task"], cfg(preflight_commands=("a", "b")))
    assert [c[-1] for c in seen] == ["a", "b", "task"]
    assert len(out.preflight) == 2


def blocking_until_stopped(sb: FakeSandbox, _cmd: Sequence[str]) -> ExecResult:
    sb.stopped.wait(30)
    return killed_result()


def test_total_timeout_kills_raises_and_destroys() -> None:
    driver = FakeDriver(exec_handler=blocking_until_stopped)
    m = manager(driver)
    events: list[dict[str, Any]] = []
    m.bus.on(SandboxEvents.TIMEOUT, lambda _e, p: events.append(p))
    start = time.monotonic()
    with pytest.raises(SandboxTimeoutError) as info:
        m.run_in_sandbox(["sleep"], cfg(timeout_ms=100))
    assert time.monotonic() - start < 10
    sid = driver.provisioned[0]
    assert events == [{"sandbox_id": sid, "timeout_s": 0.1}]
    assert info.value.outcome is not None and info.value.outcome.exit_code == 124
    assert isinstance(info.value, TimeoutError)
    assert driver.destroyed == [sid]


def test_preflight_budget_is_separate_and_reported_as_preflight() -> None:
    def handler(sb: FakeSandbox, cmd: Sequence[str]) -> ExecResult:
        if cmd[-1] == "slow":
            time.sleep(0.3)
        return ok_result()

    driver = FakeDriver(exec_handler=handler)
    with pytest.raises(SandboxPreFlightError, match="preflightTimeoutMs"):
        manager(driver).run_in_sandbox(
            ["t"], cfg(preflight_commands=("slow",), preflight_timeout_ms=50)
        )
    assert len(driver.destroyed) == 1


def test_violation_raises_records_and_destroys(db_path: Path) -> None:
    metrics = [SandboxMetrics("x", 0.0, process_count=1, pids_limit_hits=5)]
    driver = FakeDriver(exec_handler=blocking_until_stopped, metrics=metrics)
    m = manager(driver, db=db_path)
    with pytest.raises(QuotaExceededError) as info:
        m.run_in_sandbox(["bomb"], cfg(quotas={"poll_interval_ms": 20, "process_count_limit": 64}))
    v = info.value.violation
    assert v.type == "PROCESS_COUNT_EXCEEDED" and v.limit_value == 64 and v.rule == "kernel"
    assert info.value.outcome is not None and info.value.outcome.exit_code == 137
    assert ViolationStore(db_path).list()[0]["sandbox_id"] == v.sandbox_id
    assert driver.destroyed == [v.sandbox_id]


def test_violation_found_after_the_task_ended_is_still_recorded(db_path: Path) -> None:
    metrics = [SandboxMetrics("x", 0.0, oom_kills=1, peak_memory_bytes=70 << 20)]
    driver = FakeDriver(exec_handler=lambda sb, c: killed_result(), metrics=metrics)
    m = manager(driver, db=db_path)
    with pytest.raises(QuotaExceededError) as info:
        m.run_in_sandbox(["hog"], cfg(quotas={"memory_bytes": 64 << 20}))
    assert info.value.violation.type == "MEMORY_EXCEEDED"
    assert ViolationStore(db_path).count() == 1


def test_cancel_kills_raises_and_destroys() -> None:
    driver = FakeDriver(exec_handler=blocking_until_stopped)
    m = manager(driver)
    c = cfg(sandbox_id="cancel-me")
    t = threading.Timer(0.1, lambda: m.cancel("cancel-me"))
    t.start()
    with pytest.raises(SandboxCancelledError):
        m.run_in_sandbox(["x"], c)
    assert driver.destroyed == ["cancel-me"]
    assert m.cancel("cancel-me") is False


def test_asyncio_cancellation_destroys_before_propagating() -> None:
    driver = FakeDriver(exec_handler=blocking_until_stopped)
    m = manager(driver)

    async def main() -> None:
        task = asyncio.ensure_future(m.arun_in_sandbox(["x"], cfg()))
        for _ in range(200):
            if driver.provisioned:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert driver.destroyed == driver.provisioned and len(driver.destroyed) == 1


def test_async_success() -> None:
    out = asyncio.run(manager(FakeDriver()).arun_in_sandbox(["true"], cfg()))
    assert out.exit_code == 0


def test_destroy_is_guarded_against_double_calls() -> None:
    driver = FakeDriver()
    m = manager(driver)
    sb = m.open_sandbox(cfg())
    sb.destroy()
    sb.destroy()
    assert driver.destroyed == [sb.id]
    with pytest.raises(SandboxNotFoundError):
        sb.exec(["true"])


def test_failed_provision_leaves_nothing_live() -> None:
    driver = FakeDriver(fail_provision=True)
    m = manager(driver)
    with pytest.raises(ProvisionError):
        m.run_in_sandbox(["x"], cfg())
    assert m.live_sandboxes() == []


def test_poller_and_timer_do_not_outlive_the_sandbox() -> None:
    driver = FakeDriver()
    m = manager(driver)
    sb = m.open_sandbox(cfg())
    assert m.detector.is_polling(sb.id) and m.enforcer.is_watching(sb.id)
    sb.destroy()
    assert not m.detector.is_polling(sb.id) and not m.enforcer.is_watching(sb.id)
    assert m.detector.polling_count() == 0


def test_shutdown_destroys_every_live_sandbox() -> None:
    driver = FakeDriver()
    m = manager(driver)
    ids = {m.open_sandbox(cfg()).id for _ in range(3)}
    m.shutdown()
    assert set(driver.destroyed) == ids
