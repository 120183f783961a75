"""The event bus: how facts about sandboxes reach the store, logs, the CLI and the MCP server.

Invariant: emitting never fails and never blocks on a broken listener. A listener
that raises is logged and skipped; the others still run, and the emitter (often
the code that is killing a hostile sandbox) carries on.

Listeners may be plain callables or coroutine functions. A coroutine listener
registered while an event loop runs in that thread is scheduled onto that loop
(thread-safely, so watchdog threads can emit); one registered with no loop
running is run to completion in the emitting thread.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, NamedTuple

if TYPE_CHECKING:
    import asyncio

logger = logging.getLogger(__name__)

Listener = Callable[[str, dict[str, Any]], Any]


class SandboxEvents:
    """Event names. Payloads are plain dicts; keys documented beside each name."""

    CREATED: Final = "sandbox:created"  # {sandbox_id, driver, isolation}
    DESTROYED: Final = "sandbox:destroyed"  # {sandbox_id}
    TIMEOUT: Final = "timeout"  # {sandbox_id, timeout_ms}
    IDLE_TIMEOUT: Final = "sandbox:idle_timeout"  # {sandbox_id, idle_timeout_ms}
    PREFLIGHT_FAILED: Final = "sandbox:preflight_failed"  # {sandbox_id, command, exit_code}
    VIOLATION: Final = "sandbox:violation"  # {violation: Violation} -> the store writes a row
    RESOURCE_DRAIN: Final = "sandbox:security:resource_drain"  # {violation, terminated_at}
    SECURITY_PAUSE: Final = "SECURITY_PAUSE"  # {sandbox_id, reason, terminated_at}
    OOM: Final = "sandbox:oom"  # {container_id, timestamp}
    DISK_QUOTA: Final = "sandbox:disk_quota"  # {container_id, timestamp}
    CLEANUP_COMPLETE: Final = "sandbox:cleanup_complete"  # {container_id, cleaned_at}
    ORPHAN_REAPED: Final = "sandbox:orphan_reaped"  # {sandbox_id, driver, removed}
    KEY_ROTATED: Final = "session_key_rotated"  # {sandbox_id}
    # A placing driver (ray) waits for a free slot: {sandbox_id, resource, waited_s}.
    QUEUED: Final = "sandbox:queued"


class _Subscription(NamedTuple):
    listener: Listener
    loop: asyncio.AbstractEventLoop | None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The loop running in this thread, if any; asyncio is not imported for the answer
    (a process that never imported it runs no loop): the CLI's start-up stays lean."""
    if "asyncio" not in sys.modules:
        return None
    import asyncio  # noqa: PLC0415 - already loaded

    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class EventBus:
    """Many listeners per event name, plus wildcard listeners for every event."""

    WILDCARD: Final = "*"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: dict[str, list[_Subscription]] = {}

    def on(self, event: str, listener: Listener) -> Callable[[], None]:
        """Subscribe; returns a function that unsubscribes (idempotent)."""
        sub = _Subscription(listener, _running_loop())
        with self._lock:
            self._subs.setdefault(event, []).append(sub)

        def unsubscribe() -> None:
            with self._lock:
                subs = self._subs.get(event, [])
                if sub in subs:
                    subs.remove(sub)

        return unsubscribe

    def off(self, event: str, listener: Listener) -> None:
        """Remove every subscription of ``listener`` to ``event``; unknown pairs are fine."""
        with self._lock:
            subs = self._subs.get(event, [])
            self._subs[event] = [s for s in subs if s.listener != listener]

    def remove_all_listeners(self, event: str | None = None) -> None:
        with self._lock:
            if event is None:
                self._subs.clear()
            else:
                self._subs.pop(event, None)

    def listener_count(self, event: str) -> int:
        with self._lock:
            return len(self._subs.get(event, ()))

    def emit(self, event: str, payload: dict[str, Any] | None = None) -> int:
        """Deliver to every listener of ``event`` and of ``*``; returns how many succeeded."""
        data = payload if payload is not None else {}
        with self._lock:
            subs = [*self._subs.get(event, ()), *self._subs.get(self.WILDCARD, ())]
        delivered = 0
        for sub in subs:
            try:
                result = sub.listener(event, data)
                if hasattr(result, "__await__"):  # an async listener's coroutine
                    self._run_awaitable(result, sub.loop, event)
                delivered += 1
            except Exception:
                logger.exception("listener %r for event %r failed", sub.listener, event)
        return delivered

    @staticmethod
    def _run_awaitable(
        awaitable: Awaitable[Any], loop: asyncio.AbstractEventLoop | None, event: str
    ) -> None:
        import asyncio  # noqa: PLC0415 - only async listeners need it

        async def guarded() -> None:
            try:
                await awaitable
            except Exception:
                logger.exception("async listener for event %r failed", event)

        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                loop.create_task(guarded())
            else:
                asyncio.run_coroutine_threadsafe(guarded(), loop)
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(guarded())
            return
        # A loop runs in this thread but the listener was registered elsewhere: run it
        # in a helper thread rather than blocking (or re-entering) this loop.
        t = threading.Thread(target=asyncio.run, args=(guarded(),), daemon=True)
        t.start()
