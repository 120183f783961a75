"""Delayed calls on one background thread, and a manual fake with the same interface.

Timeout timers and drain pollers for any number of sandboxes share one daemon
thread and one heap, instead of a thread per sandbox. Callbacks run on that
thread and must be short (they kill or sample, then return); one that raises is
logged and the thread carries on.

``FakeScheduler`` ships in the library, as httpx ships ``MockTransport``, so
tests drive timeouts and polling with a manual clock instead of sleeping.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(order=True)
class _Entry:
    due: float
    seq: int
    fn: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class ThreadScheduler:
    """Runs callbacks at monotonic deadlines on a lazily started daemon thread."""

    def __init__(self, name: str = "devs-sandbox-scheduler") -> None:
        self._name = name
        self._heap: list[_Entry] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> _Entry:
        entry = _Entry(time.monotonic() + max(0.0, delay_s), next(self._seq), fn)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._thread is None or not self._thread.is_alive():
                self._stopped = False
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return entry

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    while self._heap and self._heap[0].cancelled:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    delay = self._heap[0].due - time.monotonic()
                    if delay <= 0:
                        entry = heapq.heappop(self._heap)
                        break
                    self._cond.wait(delay)
            if entry.cancelled:
                continue
            try:
                entry.fn()
            except Exception:
                logger.exception("scheduled callback %r failed", entry.fn)

    def pending(self) -> int:
        with self._cond:
            return sum(1 for e in self._heap if not e.cancelled)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


class FakeScheduler:
    """A manual clock: ``advance(s)`` runs, in order, every callback that falls due."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self._lock = threading.RLock()

    def now(self) -> float:
        return self._now

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> _Entry:
        entry = _Entry(self._now + max(0.0, delay_s), next(self._seq), fn)
        with self._lock:
            heapq.heappush(self._heap, entry)
        return entry

    def advance(self, seconds: float) -> None:
        target = self._now + seconds
        while True:
            with self._lock:
                while self._heap and self._heap[0].cancelled:
                    heapq.heappop(self._heap)
                if not self._heap or self._heap[0].due > target:
                    break
                entry = heapq.heappop(self._heap)
            self._now = max(self._now, entry.due)
            entry.fn()
        self._now = target

    def pending(self) -> int:
        with self._lock:
            return sum(1 for e in self._heap if not e.cancelled)


_shared: dict[str, ThreadScheduler] = {}
_shared_lock = threading.Lock()


def shared_scheduler(name: str) -> ThreadScheduler:
    """The process-wide scheduler thread called ``name``, made on first use. Different
    duties get different threads, so that one slow callback never delays another's."""
    with _shared_lock:
        scheduler = _shared.get(name)
        if scheduler is None:
            scheduler = _shared[name] = ThreadScheduler(name)
        return scheduler


def default_scheduler() -> ThreadScheduler:
    """The timers' thread (timeout enforcement)."""
    return shared_scheduler("devs-sandbox-scheduler")
