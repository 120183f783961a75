"""run_blocking, the async edge: results, errors, and what a cancellation does."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from devs_sandbox.lifecycle.aio import run_blocking

pytestmark = pytest.mark.unit


def test_result_and_error_come_back_from_the_thread() -> None:
    assert asyncio.run(run_blocking(lambda: threading.current_thread().name, name="t1")) == "t1"
    with pytest.raises(KeyError):
        asyncio.run(run_blocking(lambda: {}["x"]))


def test_a_cancelled_call_is_killed_and_awaited_before_the_cancel_propagates() -> None:
    stop = threading.Event()
    finished = threading.Event()

    def call() -> str:
        stop.wait(30)
        finished.set()
        return "killed"

    async def main() -> None:
        task = asyncio.ensure_future(run_blocking(call, on_cancel=stop.set))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished.is_set()

    asyncio.run(main())


def test_a_result_nobody_receives_is_discarded() -> None:
    release = threading.Event()
    discarded: list[str] = []
    gone = threading.Event()

    def discard(value: str) -> None:
        discarded.append(value)
        gone.set()

    async def main() -> None:
        task = asyncio.ensure_future(
            run_blocking(
                lambda: (release.wait(30), "a sandbox")[1], on_cancel=release.set, discard=discard
            )
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert gone.wait(10) and discarded == ["a sandbox"]


def test_a_failing_kill_is_logged_and_retried_and_the_wait_is_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()
    attempts: list[int] = []

    def failing_kill() -> None:
        attempts.append(1)
        raise OSError("no such process")

    async def main() -> None:
        task = asyncio.ensure_future(
            run_blocking(lambda: release.wait(30), on_cancel=failing_kill, name="stuck", join_s=0.3)
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.ERROR, logger="devs_sandbox.aio"):
        asyncio.run(main())
    release.set()
    assert len(attempts) >= 2  # tried again after the first attempt returned
    assert "stuck: cancel failed" in caplog.text
    assert "stuck still running" in caplog.text
