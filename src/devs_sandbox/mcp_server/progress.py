"""One tool call as a handler sees it: for whom it runs, and how it reports progress.

A request that carries a progress token (``params._meta.progressToken``) gets a
``notifications/progress`` every ``PROGRESS_INTERVAL_S`` while its command runs: the
seconds elapsed as ``progress`` (so it grows with every notification, as the
specification requires; no ``total``, the end is not known) and the output so far as
``message``. A TypeScript host times a request out after 60 s unless it resets that
timeout on progress; with a notification every few seconds, a call may run as long as
its ``timeout_s``. A request without a token gets none: the SDK's ``report_progress``
sends only for a request that asked (a token over JSON-RPC, a callback in process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import anyio

from devs_sandbox.mcp_server.tenancy import LOCAL_CALLER, Caller

logger = logging.getLogger(__name__)

# Well inside the 60 s a TypeScript client waits between progress notifications, and
# rare enough to cost nothing (a few dozen bytes each).
PROGRESS_INTERVAL_S: Final = 5.0

Report = Callable[[float, str], Awaitable[None]]
T = TypeVar("T")


@dataclass(frozen=True)
class ToolCall:
    """``report(progress, message)`` sends one progress notification (if the request asked
    for them); None for a caller with no client behind it (the tests' direct calls)."""

    caller: Caller = LOCAL_CALLER
    report: Report | None = None
    interval_s: float = PROGRESS_INTERVAL_S

    async def with_progress(
        self, work: Callable[[], Awaitable[T]], message: Callable[[float], str]
    ) -> T:
        """Await ``work()``, reporting ``message(elapsed_s)`` every ``interval_s`` meanwhile.

        ``work``'s exception propagates as itself (not wrapped in a group), and a cancelled
        call cancels ``work`` as before (a kill, for a command)."""
        if self.report is None:
            return await work()
        report = self.report
        outcome: dict[str, Any] = {}
        start = time.monotonic()

        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    outcome["value"] = await work()
                except Exception as exc:  # re-raised below, outside the task group
                    outcome["error"] = exc
                finally:
                    tg.cancel_scope.cancel()

            async def tick() -> None:
                while True:
                    await anyio.sleep(self.interval_s)
                    elapsed = time.monotonic() - start
                    try:
                        await report(round(elapsed, 3), message(elapsed))
                    except Exception:
                        # The client is gone or its stream closed: the call's own answer
                        # (or its cancellation) will tell; stop reporting.
                        logger.debug("a progress notification could not be sent", exc_info=True)
                        return

            tg.start_soon(run)
            tg.start_soon(tick)
        if "error" in outcome:
            raise outcome["error"]
        value: T = outcome["value"]
        return value
