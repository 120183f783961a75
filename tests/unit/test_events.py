"""The event bus never lets a listener break the emitter or the other listeners."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from devs_sandbox.events import EventBus, SandboxEvents

pytestmark = pytest.mark.unit


def test_constants() -> None:
    assert SandboxEvents.OOM == "sandbox:oom"
    assert SandboxEvents.RESOURCE_DRAIN == "sandbox:security:resource_drain"
    assert SandboxEvents.TIMEOUT == "timeout"


def test_several_listeners_and_a_failing_one() -> None:
    bus = EventBus()
    seen: list[tuple[str, Any]] = []

    def bad(_e: str, _p: dict[str, Any]) -> None:
        raise RuntimeError("listener bug")

    bus.on("x", lambda e, p: seen.append(("a", p["n"])))
    bus.on("x", bad)
    bus.on("x", lambda e, p: seen.append(("b", p["n"])))
    delivered = bus.emit("x", {"n": 1})
    assert seen == [("a", 1), ("b", 1)]
    assert delivered == 2


def test_unsubscribe_and_off_and_wildcard() -> None:
    bus = EventBus()
    seen: list[str] = []

    def listener(e: str, _p: dict[str, Any]) -> None:
        seen.append(e)

    unsubscribe = bus.on("x", listener)
    bus.on("*", lambda e, p: seen.append("*" + e))
    bus.emit("x")
    unsubscribe()
    unsubscribe()
    bus.emit("x")
    assert seen == ["x", "*x", "*x"]
    bus.on("y", listener)
    bus.off("y", listener)
    bus.off("never", listener)
    bus.emit("y")
    assert seen[-1] == "*y"
    bus.remove_all_listeners()
    assert bus.listener_count("*") == 0


def test_async_listener_without_loop_runs_to_completion() -> None:
    bus = EventBus()
    seen: list[int] = []

    async def listener(_e: str, p: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        seen.append(p["n"])

    bus.on("x", listener)
    bus.emit("x", {"n": 7})
    assert seen == [7]


def test_async_listener_registered_in_loop_runs_on_that_loop_from_another_thread() -> None:
    async def main() -> list[int]:
        bus = EventBus()
        seen: list[int] = []
        done = asyncio.Event()
        loop_thread = threading.get_ident()

        async def listener(_e: str, p: dict[str, Any]) -> None:
            assert threading.get_ident() == loop_thread
            seen.append(p["n"])
            done.set()

        async def failing(_e: str, _p: dict[str, Any]) -> None:
            raise RuntimeError("async listener bug")

        bus.on("x", failing)
        bus.on("x", listener)
        t = threading.Thread(target=bus.emit, args=("x", {"n": 3}))
        t.start()
        await asyncio.wait_for(done.wait(), 5)
        t.join()
        return seen

    assert asyncio.run(main()) == [3]
