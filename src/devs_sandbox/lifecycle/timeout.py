"""Total-time enforcement: a timer per sandbox that SIGKILLs on expiry, never SIGTERM first.

Why no SIGTERM grace: the timeout is the last line against a task that is
hostile or wedged, and a process that handles SIGTERM can use the grace period
to fork away. What is killed is whatever ``watch`` was given: a Popen, or (from
the lifecycle) the whole sandbox, whose kill reaches every process through the
cgroup or pid namespace.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

from devs_sandbox.base import Killable, Scheduler, TimerHandle
from devs_sandbox.config import DEFAULT_TIMEOUT_MS
from devs_sandbox.errors import ExecTimeoutError
from devs_sandbox.events import EventBus, SandboxEvents
from devs_sandbox.scheduler import default_scheduler

logger = logging.getLogger(__name__)
T = TypeVar("T")

JOIN_AFTER_KILL_S: Final = 5.0  # a killed call returns in ms; bound the wait all the same


# REQ: 8_RISKS-REQ-034
class SandboxTimeoutEnforcer:
    """Arms one timer per sandbox id; ``clear`` disarms; re-``watch`` replaces."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_MS / 1000,
        *,
        bus: EventBus | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError("timeout_s must be positive")
        self.timeout_s = timeout_s
        self.bus = bus
        self._scheduler = scheduler
        self._timers: dict[str, TimerHandle] = {}
        self._fired: set[str] = set()
        self._lock = threading.Lock()

    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            self._scheduler = default_scheduler()
        return self._scheduler

    def watch(self, proc: Killable, sandbox_id: str, timeout_s: float | None = None) -> None:
        """Kill ``proc`` with SIGKILL after ``timeout_s`` (default: the enforcer's)."""
        seconds = self.timeout_s if timeout_s is None else timeout_s
        if not seconds > 0:
            raise ValueError("timeout_s must be positive")

        def expire() -> None:
            with self._lock:
                if self._timers.get(sandbox_id) is not handle_box[0]:
                    return  # replaced or cleared after it fell due
                self._timers.pop(sandbox_id, None)
                self._fired.add(sandbox_id)
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            except Exception:
                logger.exception("timeout kill of sandbox %s failed", sandbox_id)
            if self.bus is not None:
                self.bus.emit(
                    SandboxEvents.TIMEOUT, {"sandbox_id": sandbox_id, "timeout_s": seconds}
                )

        handle_box: list[TimerHandle | None] = [None]
        with self._lock:
            previous = self._timers.pop(sandbox_id, None)
            self._fired.discard(sandbox_id)
            handle = self.scheduler.call_later(seconds, expire)
            handle_box[0] = handle
            self._timers[sandbox_id] = handle
        if previous is not None:
            previous.cancel()

    def clear(self, sandbox_id: str) -> None:
        """Disarm; unknown ids are a no-op. Also forgets whether the timer fired."""
        with self._lock:
            handle = self._timers.pop(sandbox_id, None)
            self._fired.discard(sandbox_id)
        if handle is not None:
            handle.cancel()

    def fired(self, sandbox_id: str) -> bool:
        with self._lock:
            return sandbox_id in self._fired

    def is_watching(self, sandbox_id: str) -> bool:
        with self._lock:
            return sandbox_id in self._timers


default_timeout_enforcer = SandboxTimeoutEnforcer()


def with_execution_timeout(
    call: Callable[[], T],
    *,
    kill: Callable[[], None],
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000,
) -> T:
    """Run ``call`` (one exec) with its own deadline; on expiry ``kill`` its work and raise.

    ``call`` runs on a worker thread so the deadline holds even if it blocks; ``kill``
    must make it return (it kills the exec's processes), and then ExecTimeoutError is
    raised here. The call is never left running behind the caller's back.
    """
    if not timeout_s > 0:
        raise ValueError("timeout_s must be positive")
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=target, name="devs-sandbox-exec", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        kill()
        worker.join(JOIN_AFTER_KILL_S)
        raise ExecTimeoutError(timeout_s)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


async def awith_execution_timeout(
    awaitable: Awaitable[T],
    *,
    kill: Callable[[], None] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_MS / 1000,
) -> T:
    """Async form: await with a deadline; on expiry call ``kill`` and raise ExecTimeoutError."""
    import asyncio  # noqa: PLC0415 - only async callers pay for asyncio

    if not timeout_s > 0:
        raise ValueError("timeout_s must be positive")
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        if kill is not None:
            kill()
        raise ExecTimeoutError(timeout_s) from None
