"""SandboxTimeoutEnforcer with a fake clock: SIGKILL semantics, events, clear, replace."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from devs_sandbox.errors import ExecTimeoutError
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.lifecycle.timeout import (
    SandboxTimeoutEnforcer,
    awith_execution_timeout,
    default_timeout_enforcer,
    with_execution_timeout,
)
from devs_sandbox.scheduler import FakeScheduler, ThreadScheduler

pytestmark = pytest.mark.unit


class Proc:
    def __init__(self) -> None:
        self.kills = 0
        self.terminates = 0

    def kill(self) -> None:
        self.kills += 1

    def terminate(self) -> None:  # must never be called: no SIGTERM first
        self.terminates += 1


def make() -> tuple[SandboxTimeoutEnforcer, FakeScheduler, list[dict[str, Any]]]:
    bus = EventBus()
    events: list[dict[str, Any]] = []
    bus.on(SandboxEvents.TIMEOUT, lambda _e, p: events.append(p))
    clock = FakeScheduler()
    return SandboxTimeoutEnforcer(bus=bus, scheduler=clock), clock, events


def test_default_timeout_is_five_minutes() -> None:
    assert SandboxTimeoutEnforcer().timeout_s == 300.0
    assert default_timeout_enforcer.timeout_s == 300.0


def test_fires_sigkill_and_emits_after_the_timeout() -> None:
    enforcer, clock, events = make()
    proc = Proc()
    enforcer.watch(proc, "sb-1")
    clock.advance(299.999)
    assert proc.kills == 0 and events == []
    clock.advance(0.002)
    assert proc.kills == 1 and proc.terminates == 0
    assert events == [{"sandbox_id": "sb-1", "timeout_s": 300.0}]
    assert enforcer.fired("sb-1")
    assert not enforcer.is_watching("sb-1")
    clock.advance(1000)
    assert proc.kills == 1


def test_clear_cancels_and_unknown_ids_are_a_noop() -> None:
    enforcer, clock, events = make()
    proc = Proc()
    enforcer.watch(proc, "sb-1", timeout_s=0.1)
    enforcer.clear("sb-1")
    enforcer.clear("sb-1")
    enforcer.clear("never-watched")
    clock.advance(10)
    assert proc.kills == 0 and events == []


def test_watching_again_replaces_the_timer() -> None:
    enforcer, clock, events = make()
    first, second = Proc(), Proc()
    enforcer.watch(first, "sb-1", timeout_s=1.0)
    clock.advance(0.5)
    enforcer.watch(second, "sb-1", timeout_s=1.0)
    clock.advance(0.9)
    assert first.kills == 0 and second.kills == 0
    clock.advance(0.2)
    assert first.kills == 0 and second.kills == 1
    assert len(events) == 1


def test_independent_sandboxes() -> None:
    enforcer, clock, _ = make()
    a, b = Proc(), Proc()
    enforcer.watch(a, "a", timeout_s=1.0)
    enforcer.watch(b, "b", timeout_s=2.0)
    clock.advance(1.5)
    assert (a.kills, b.kills) == (1, 0)
    clock.advance(1)
    assert (a.kills, b.kills) == (1, 1)


def test_a_failing_kill_still_emits() -> None:
    enforcer, clock, events = make()

    class Broken:
        def kill(self) -> None:
            raise OSError("boom")

    enforcer.watch(Broken(), "sb-x", timeout_s=0.01)
    clock.advance(1)
    assert events and events[0]["sandbox_id"] == "sb-x"


def test_rejects_non_positive_timeouts() -> None:
    with pytest.raises(ValueError):
        SandboxTimeoutEnforcer(0)
    enforcer, _, _ = make()
    with pytest.raises(ValueError):
        enforcer.watch(Proc(), "a", timeout_s=-0.001)


def test_real_scheduler_thread_fires() -> None:
    sched = ThreadScheduler("test-sched")
    enforcer = SandboxTimeoutEnforcer(scheduler=sched)
    proc = Proc()
    enforcer.watch(proc, "sb", timeout_s=0.05)
    deadline = time.monotonic() + 5
    while proc.kills == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.kills == 1
    sched.shutdown()


def test_with_execution_timeout_kills_and_raises() -> None:
    release = threading.Event()
    killed: list[bool] = []

    def call() -> int:
        release.wait(10)
        return 1

    def kill() -> None:
        killed.append(True)
        release.set()

    start = time.monotonic()
    with pytest.raises(ExecTimeoutError) as info:
        with_execution_timeout(call, kill=kill, timeout_s=0.1)
    assert killed == [True]
    assert info.value.timeout_s == 0.1
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - start < 5


def test_with_execution_timeout_passes_results_and_errors() -> None:
    assert with_execution_timeout(lambda: 5, kill=lambda: None) == 5

    def boom() -> int:
        raise KeyError("x")

    with pytest.raises(KeyError):
        with_execution_timeout(boom, kill=lambda: None)


def test_awith_execution_timeout() -> None:
    killed: list[bool] = []

    async def main() -> None:
        assert await awith_execution_timeout(asyncio.sleep(0, result=3), timeout_s=1.0) == 3
        with pytest.raises(ExecTimeoutError):
            await awith_execution_timeout(
                asyncio.sleep(10), kill=lambda: killed.append(True), timeout_s=0.02
            )

    asyncio.run(main())
    assert killed == [True]
