"""The async edge: blocking sandbox work on its own thread, cancellation turned into a kill.

The core is synchronous (psutil, sqlite3, subprocess and the Docker SDK are), so an
``async def`` that needs it hands the call to a thread and awaits the result; it
never blocks the event loop itself. What asyncio cannot do is stop a thread, so a
cancelled caller (an MCP client that gave up, a server shutting down) would leave
the command running behind its back. ``run_blocking`` closes that gap: on
cancellation it calls ``on_cancel`` (which kills the sandbox's processes, so the
blocking call returns within milliseconds), waits for the thread, bounded, and only
then lets the ``CancelledError`` go.

Why a thread per call instead of ``asyncio.to_thread``: the default executor has
``cpu_count + 4`` workers (6 on a 2-core host). A server with that many long commands
in flight would queue the next call, and worse, queue the very ``on_cancel`` that
should stop them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Final, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

CANCEL_JOIN_S: Final = 10.0  # a killed sandbox call returns in ms; bound the wait all the same
RECANCEL_S: Final = 0.05  # kill again this often: the call may not have started its command yet


def _settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


def start_thread(fn: Callable[[], T], *, name: str) -> asyncio.Future[T]:
    """Run ``fn`` on a new daemon thread; the returned future (of the running loop) settles
    with its result or exception."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop closed while we ran (interpreter shutdown)
            logger.debug("event loop closed before %s finished", name)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


def _quiet(fn: Callable[[], object], what: str) -> Callable[[], None]:
    """``fn`` with its failure logged: nobody awaits a cleanup thread's future."""

    def call() -> None:
        try:
            fn()
        except Exception:
            logger.exception("%s failed", what)

    return call


async def run_blocking(
    fn: Callable[[], T],
    *,
    on_cancel: Callable[[], object] | None = None,
    discard: Callable[[T], object] | None = None,
    name: str = "devs-sandbox-call",
    join_s: float = CANCEL_JOIN_S,
) -> T:
    """Await ``fn()`` run on its own thread.

    If the awaiting task is cancelled: ``on_cancel()`` runs on a thread of its own, again
    every ``RECANCEL_S`` once the previous attempt returned, until ``fn`` returns or
    ``join_s`` passes; a result ``fn`` still produced goes to ``discard`` (e.g. to destroy
    a sandbox nobody will receive); then the cancellation propagates. The wait swallows
    repeated cancellations on purpose: anyio re-delivers them at every await inside a
    cancelled scope, and returning early would leave the command running.
    """
    future = start_thread(fn, name=name)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + join_s
        killing: asyncio.Future[None] | None = None
        while not future.done() and loop.time() < deadline:
            if on_cancel is not None and (killing is None or killing.done()):
                killing = start_thread(_quiet(on_cancel, f"{name}: cancel"), name=f"{name}-cancel")
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(future), RECANCEL_S)
        if not future.done():
            # Not the cancellation is the error, but a call that outlived it: no traceback.
            logger.error("%s still running %.0f s after its cancellation", name, join_s)  # noqa: TRY400
        elif future.exception() is None and discard is not None:  # (also marks it retrieved)
            result, drop = future.result(), discard
            start_thread(_quiet(lambda: drop(result), f"{name}: discard"), name=f"{name}-discard")
        raise
