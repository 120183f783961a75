"""Where a sandbox goes: Ray decides, through a slot reserved in a placement group.

Capacity is a Ray custom resource (``sandbox.ray.slotResource``, ``devs_sandbox_slots`` by
default) that each node declares (``ray start --resources '{"devs_sandbox_slots": 8}'``).
A sandbox holds one unit for its whole life, reserved as a placement group of one bundle:

- Ray's own scheduler picks the node (on a single-bundle group it takes the node with the
  most headroom, so sandboxes spread over the cluster; measured in tests/ray);
- the reservation holds no process: nothing runs in the bundle, the node's host actor
  does the work;
- a full cluster queues in Ray, where users already look for it: the group stays
  PENDING and ``ray status`` lists the demand (an autoscaler sees it and may add a node);
  we wait at most the run's total timeout, emit ``sandbox:queued`` once the wait passes
  ``QUEUE_NOTICE_S`` and record the wait in the context's labels (``queued_ms``);
- the slot outlives nothing: the group is removed when the sandbox is destroyed, and Ray
  removes it by itself when the process that created it dies; the host actor then
  destroys the sandbox it held (``host.SandboxHost.sweep``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from devs_sandbox.base import Emit
from devs_sandbox.errors import DriverUnavailableError, SandboxTimeoutError
from devs_sandbox.events import SandboxEvents

logger = logging.getLogger(__name__)

QUEUE_NOTICE_S: Final = 1.0  # a wait longer than this is announced (event + log)
WAIT_SLICE_S: Final = 0.5  # how often a queued provision looks at the clock
CAPACITY_TTL_S: Final = 5.0  # the cluster's slot total, cached between provisions


@dataclass(frozen=True, slots=True)
class Slot:
    """A reserved slot: the placement group holding it and the node Ray chose."""

    group: PlacementGroup
    node_id: str
    waited_s: float


class SlotPlacement:
    """Reserves and releases sandbox slots on the connected cluster."""

    def __init__(self, emit: Emit | None = None, clock: Callable[[], float] = time.monotonic):
        self._emit = emit
        self._clock = clock
        self._lock = threading.Lock()
        self._capacity: dict[str, tuple[float, float]] = {}  # resource -> (total, read at)

    def capacity(self, resource: str) -> float:
        """The cluster's total of ``resource`` (cached for ``CAPACITY_TTL_S``)."""
        now = self._clock()
        with self._lock:
            cached = self._capacity.get(resource)
        if cached is not None and now - cached[1] < CAPACITY_TTL_S:
            return cached[0]
        total = float(ray.cluster_resources().get(resource, 0.0))
        with self._lock:
            self._capacity[resource] = (total, now)
        return total

    def acquire(self, sandbox_id: str, resource: str, timeout_ms: int) -> Slot:
        """One slot of ``resource`` on a node Ray picks; waits at most ``timeout_ms``.

        ``DriverUnavailableError`` when no node offers the resource at all (the wait could
        never end); ``SandboxTimeoutError`` when every slot stayed taken for the whole
        total timeout.
        """
        if self.capacity(resource) <= 0:
            raise DriverUnavailableError(
                f"no node of the Ray cluster offers the {resource!r} resource, so no sandbox "
                f"can be placed; start nodes with `ray start --resources "
                f"'{{\"{resource}\": 4}}'` (sandbox.ray.slotResource names the resource)"
            )
        start = self._clock()
        group = placement_group([{resource: 1}], name=f"devs-sandbox:{sandbox_id}")
        try:
            ready = group.ready()
            announced = False
            while True:
                waited = self._clock() - start
                left = timeout_ms / 1000 - waited
                if left <= 0:
                    raise self._timed_out(resource, timeout_ms)  # noqa: TRY301 - released below
                done, _ = ray.wait([ready], timeout=min(WAIT_SLICE_S, left))
                if done:
                    ray.get(done[0])
                    break
                if not announced and self._clock() - start >= QUEUE_NOTICE_S:
                    announced = True
                    self._announce(sandbox_id, resource, self._clock() - start)
            node_id = placement_group_table(group)["bundles_to_node_id"][0]
        except BaseException:
            self.release(group)
            raise
        return Slot(group, str(node_id), self._clock() - start)

    def _timed_out(self, resource: str, timeout_ms: int) -> SandboxTimeoutError:
        exc = SandboxTimeoutError(timeout_ms)
        exc.args = (
            f"no {resource} slot became free on the Ray cluster within {timeout_ms} ms (the "
            "total timeout, sandbox.timeoutMs); add slots or nodes, or raise the timeout",
        )
        return exc

    def _announce(self, sandbox_id: str, resource: str, waited_s: float) -> None:
        logger.info(
            "sandbox %s waits for a free %s slot (all taken; `ray status` lists the demand)",
            sandbox_id,
            resource,
        )
        if self._emit is not None:
            payload: dict[str, Any] = {
                "sandbox_id": sandbox_id,
                "resource": resource,
                "waited_s": round(waited_s, 3),
            }
            try:
                self._emit(SandboxEvents.QUEUED, payload)
            except Exception:
                logger.exception("queued event listener failed")

    @staticmethod
    def release(group: PlacementGroup) -> None:
        """Give the slot back (idempotent: removing a removed group is a no-op)."""
        try:
            remove_placement_group(group)
        except Exception:
            logger.debug("removing placement group %s failed", group.id, exc_info=True)
