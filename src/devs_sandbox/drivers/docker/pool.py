"""The warm pool: containers created, started and attached ahead of time, per
configuration shape (``docker.warmPoolSize``), so a run skips the engine's create and
start. A shape nobody asked for lately is dropped; a dead warm container is never used."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Final

from devs_sandbox.drivers.docker.state import HOST_DIR_PREFIX, REMOVE_FLUSH_S, Box, Plan
from devs_sandbox.models import new_sandbox_id

if TYPE_CHECKING:
    from devs_sandbox.drivers.docker.driver import DockerDriver

logger = logging.getLogger(__name__)

POOL_FILL_BACKOFF_S: Final = 5.0  # after a failed warm-container create
POOL_MAX_SHAPES: Final = 4  # configurations kept warm at once; the least recent is dropped


class WarmPool:
    """Containers created, started and attached ahead of time, per configuration shape."""

    def __init__(self, driver: DockerDriver) -> None:
        self.driver = driver
        self._ready: dict[str, deque[Box]] = {}
        self._wanted: OrderedDict[str, tuple[Plan, int]] = OrderedDict()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._filling = 0

    def ids(self) -> set[str]:
        with self._cond:
            return {b.id for q in self._ready.values() for b in q}

    def take(self, plan: Plan, size: int) -> Box | None:
        dropped: list[Box] = []
        with self._cond:
            self._wanted[plan.shape] = (plan, size)
            self._wanted.move_to_end(plan.shape)
            while len(self._wanted) > POOL_MAX_SHAPES:  # a config nobody asked for lately
                old, _ = self._wanted.popitem(last=False)
                dropped += self._ready.pop(old, ())
            ready = self._ready.get(plan.shape)
            box = ready.popleft() if ready else None
            self._cond.notify_all()
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(
                    target=self._fill, name="devs-docker-pool", daemon=True
                )
                self._thread.start()
        for stale in dropped:
            self.driver.removal.finish(stale)
        if box is not None and not self.driver.alive(box):
            self.driver.removal.finish(box)
            return None
        return box

    def _next_job(self) -> Plan | None:
        """Block until some shape wants another container; None when stopping."""
        with self._cond:
            while not self._stopping:
                for shape, (plan, size) in self._wanted.items():
                    if len(self._ready.get(shape, ())) < size:
                        self._filling += 1
                        return plan
                self._cond.wait()
            return None

    def _fill(self) -> None:
        while True:
            plan = self._next_job()
            if plan is None:
                return
            sandbox_id = new_sandbox_id()
            box = Box(
                sandbox_id, plan, self.driver.workspace_root / f"{HOST_DIR_PREFIX}{sandbox_id}", ()
            )
            try:
                box.isolation = self.driver.active(self.driver.isolation_report(plan.config))
                self.driver.provisioner.create(box, pool=True)
            except Exception as exc:
                logger.warning("warm pool: creating a container failed: %s", exc)
                self.driver.removal.undo(box)
                with self._cond:
                    self._filling -= 1
                    self._cond.wait(POOL_FILL_BACKOFF_S)  # close() notifies: no long wait
                continue
            with self._cond:
                self._filling -= 1
                keep = not self._stopping
                if keep:
                    self._ready.setdefault(plan.shape, deque()).append(box)
                self._cond.notify_all()
            if not keep:
                self.driver.removal.finish(box)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(REMOVE_FLUSH_S)
        with self._cond:
            boxes = [b for q in self._ready.values() for b in q]
            self._ready.clear()
        for box in boxes:
            with contextlib.suppress(OSError):
                if box.launcher_sock is not None:
                    box.launcher_sock.close()
            self.driver.removal.finish(box)
