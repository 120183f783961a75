"""The warm pool: pods created, started and probed ahead of time, claimed with one
conflict-checked patch, refilled in the background.

The pool is the namespace's, not one process's: any driver may claim any warm pod of its
configuration's shape (its own first, then the oldest). A claim is one JSON patch whose
first operations ``test`` the pod's state and pool labels; the API server applies a patch
atomically, so of claimers racing for one pod exactly one wins and the others get 422 (or
409 on a stale version) and try the next pod, or create one. The claim moves the pod to
the claimer's owner Lease, lowers its ``activeDeadlineSeconds`` from the warm pod's day to
this run's timeout plus the margin (a deadline can only be lowered), and the claimer
validates the pod as stored before it is used. The pod's NetworkPolicy is owned by the pod
as well, so it lives exactly as long as the pod, whoever owns it now.

What a warm pod's image and node offer (the probe, network check included) was learned
when it was filled and travels in its ``devs-sandbox.io/probe`` annotation, which only a
driver can write (the pod has no API token).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from devs_sandbox.drivers.kubernetes.box import Box, Plan
from devs_sandbox.drivers.kubernetes.client import JSON_PATCH, MERGE_PATCH, PODS, ApiError
from devs_sandbox.drivers.kubernetes.leases import parse_time
from devs_sandbox.drivers.kubernetes.manifest import (
    ANN_PROBE,
    ANN_SANDBOX_ID,
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_POOL,
    LABEL_STATE,
    MANAGED_BY,
    STATE_ACTIVE,
    STATE_FILLING,
    STATE_WARM,
    Manifest,
    validate_pod_spec,
)
from devs_sandbox.drivers.kubernetes.shim import ProbeInfo
from devs_sandbox.drivers.kubernetes.watcher import classify
from devs_sandbox.errors import DevsSandboxError, SecurityConfigError
from devs_sandbox.models import new_sandbox_id, validate_sandbox_id

if TYPE_CHECKING:
    from devs_sandbox.drivers.kubernetes.driver import KubernetesDriver

logger = logging.getLogger(__name__)

WARM_DEADLINE_S: Final = 86_400  # an unclaimed warm pod lives at most a day
FILL_BACKOFF_S: Final = 5.0  # after a failed fill (quota, image, API)
RECOUNT_S: Final = 5.0  # how often a full pool looks again (another driver may claim ours)
MAX_SHAPES: Final = 4  # configurations kept warm at once; the least recent is dropped
CLOSE_JOIN_S: Final = 10.0


def _label_path(key: str) -> str:
    return "/metadata/labels/" + key.replace("~", "~0").replace("/", "~1")


def warm_manifest(m: Manifest) -> Manifest:
    """A sandbox's objects as a warm pod: pool and state labels, a day's deadline."""
    pod = json.loads(json.dumps(m.pod))
    pod["metadata"]["labels"][LABEL_POOL] = m.shape
    pod["metadata"]["labels"][LABEL_STATE] = STATE_FILLING
    pod["spec"]["activeDeadlineSeconds"] = WARM_DEADLINE_S
    return dataclasses.replace(m, pod=pod)


class WarmPool:
    """See the module docstring. ``claims``/``conflicts`` count for tests and benchmarks."""

    def __init__(self, driver: KubernetesDriver) -> None:
        self.driver = driver
        self.claims = 0
        self.conflicts = 0
        self._wanted: OrderedDict[str, tuple[Plan, int]] = OrderedDict()
        self._filling: set[str] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def names(self) -> set[str]:
        with self._cond:
            return set(self._filling)

    def on_pod(self, kind: str, pod: Mapping[str, Any]) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if kind == "DELETED" and labels.get(LABEL_POOL):
            with self._cond:
                self._cond.notify_all()  # one of ours was claimed or deleted: refill

    def ready(self, plan: Plan) -> int:
        """How many warm pods of ``plan``'s shape are claimable now (any owner's)."""
        cl = self.driver.cluster
        selector = (
            f"{LABEL_MANAGED}={MANAGED_BY},{LABEL_POOL}={plan.shape},{LABEL_STATE}={STATE_WARM}"
        )
        listed = cl.request(
            "list warm pods", "GET", cl.path(PODS), query={"labelSelector": selector}
        )
        return len(listed.get("items") or [])

    # -- claiming ------------------------------------------------------------------------------
    def take(self, plan: Plan, size: int) -> Box | None:
        """A claimed warm pod of ``plan``'s shape, registered with the driver; None when the
        pool is empty (the filler is asked for more either way)."""
        self._want(plan, size)
        self.driver.ensure_watch()
        cl = self.driver.cluster
        selector = (
            f"{LABEL_MANAGED}={MANAGED_BY},{LABEL_POOL}={plan.shape},{LABEL_STATE}={STATE_WARM}"
        )
        try:
            listed = cl.request(
                "list warm pods", "GET", cl.path(PODS), query={"labelSelector": selector}
            )
        except DevsSandboxError as exc:
            logger.warning("warm pool: listing failed (%s); creating a pod", exc)
            return None
        mine = self.driver.lease.name
        items = sorted(
            listed.get("items") or [],
            key=lambda p: (
                (p["metadata"].get("labels") or {}).get(LABEL_OWNER) != mine,
                str(p["metadata"].get("creationTimestamp") or ""),
            ),
        )
        for pod in items:
            box = self._claim(plan, pod)
            if box is not None:
                with self._cond:
                    self._cond.notify_all()
                return box
        return None

    def _claim(self, plan: Plan, pod: Mapping[str, Any]) -> Box | None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        name = str(meta["name"])
        probe = ProbeInfo.from_json((meta.get("annotations") or {}).get(ANN_PROBE))
        try:
            sandbox_id = validate_sandbox_id(
                str((meta.get("annotations") or {}).get(ANN_SANDBOX_ID))
            )
            uid = int(str((spec.get("securityContext") or {}).get("runAsUser")))
        except (DevsSandboxError, TypeError, ValueError):
            return None
        state = classify(pod)
        if probe is None or not state.running or state.deleting:
            return None
        config = plan.config
        started = parse_time(state.start_time) or datetime.now(UTC)
        age_s = max(0.0, (datetime.now(UTC) - started).total_seconds())
        timeout_s = config.timeout_ms / 1000
        needed = math.ceil(age_s + timeout_s) + config.kubernetes.deadline_margin_s
        current = spec.get("activeDeadlineSeconds")
        ref = self.driver.lease.ref()
        ops: list[dict[str, Any]] = [
            {"op": "test", "path": _label_path(LABEL_STATE), "value": STATE_WARM},
            {"op": "test", "path": _label_path(LABEL_POOL), "value": plan.shape},
            {"op": "replace", "path": _label_path(LABEL_STATE), "value": STATE_ACTIVE},
            {"op": "replace", "path": _label_path(LABEL_OWNER), "value": ref.name},
            {"op": "replace", "path": "/metadata/ownerReferences", "value": [ref.reference()]},
        ]
        if not isinstance(current, int) or needed < current:
            ops.append({"op": "replace", "path": "/spec/activeDeadlineSeconds", "value": needed})
        elif current - age_s < timeout_s:
            return None  # too old for this run's timeout
        cl = self.driver.cluster
        try:
            patched = cl.request(
                "claim a warm pod", "PATCH", cl.path(PODS, name), body=ops, content_type=JSON_PATCH
            )
        except ApiError as exc:
            if exc.conflict or exc.not_found:
                with self._cond:
                    self.conflicts += 1
                return None  # another claimer won this one
            raise
        box = Box(sandbox_id, name, plan, uid, probe=probe)
        box.observe(patched)
        self.driver.adopt(box)
        try:
            validate_pod_spec(patched, plan.policy)
            box.isolation, box.warnings = self.driver._settle(config, probe)
        except SecurityConfigError as exc:
            logger.error("warm pod %s fails validation, deleting it: %s", name, exc)  # noqa: TRY400
            self.driver._undo(box, ["pod", "owned"])
            return None
        except BaseException:
            self.driver._undo(box, ["pod", "owned"])
            raise
        with self._cond:
            self.claims += 1
        return box

    # -- filling -------------------------------------------------------------------------------
    def _want(self, plan: Plan, size: int) -> None:
        with self._cond:
            self._wanted[plan.shape] = (plan, size)
            self._wanted.move_to_end(plan.shape)
            while len(self._wanted) > MAX_SHAPES:
                self._wanted.popitem(last=False)
            self._cond.notify_all()
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(
                    target=self._fill, name="devs-k8s-pool", daemon=True
                )
                self._thread.start()

    def _own(self, shape: str) -> int:
        cl = self.driver.cluster
        selector = (
            f"{LABEL_MANAGED}={MANAGED_BY},{LABEL_OWNER}={self.driver.lease.name},"
            f"{LABEL_POOL}={shape},{LABEL_STATE} in ({STATE_WARM},{STATE_FILLING})"
        )
        listed = cl.request(
            "count warm pods", "GET", cl.path(PODS), query={"labelSelector": selector}
        )
        return len(listed.get("items") or [])

    def _stopped(self) -> bool:
        with self._cond:
            return self._stopping

    def _next_job(self) -> Plan | None:
        while True:
            if self._stopped():
                return None
            with self._cond:
                wanted = list(self._wanted.values())
            for plan, size in wanted:
                try:
                    if self._own(plan.shape) < size:
                        return plan
                except DevsSandboxError as exc:
                    logger.warning("warm pool: counting failed: %s", exc)
            with self._cond:
                if self._stopping:
                    return None
                self._cond.wait(RECOUNT_S)

    def _fill(self) -> None:
        while True:
            plan = self._next_job()
            if plan is None:
                return
            sandbox_id = new_sandbox_id()
            name = ""
            try:
                box = self.driver.create(plan, sandbox_id, pool=True)
                name = box.name
                with self._cond:
                    self._filling.add(name)
                assert box.probe is not None
                cl = self.driver.cluster
                cl.request(
                    "mark a warm pod ready",
                    "PATCH",
                    cl.path(PODS, name),
                    body={
                        "metadata": {
                            "labels": {LABEL_STATE: STATE_WARM},
                            "annotations": {ANN_PROBE: box.probe.to_json()},
                        }
                    },
                    content_type=MERGE_PATCH,
                )
            except Exception as exc:
                logger.warning("warm pool: making a pod failed: %s", exc)
                with self._cond:
                    if not self._stopping:
                        self._cond.wait(FILL_BACKOFF_S)
            finally:
                if name:
                    self.driver.forget_pod(name)
                    with self._cond:
                        self._filling.discard(name)

    def close(self) -> None:
        """Stop filling and delete this process's unclaimed pods."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(CLOSE_JOIN_S)
        if self.driver._lease is None:
            return
        cl = self.driver.cluster
        selector = (
            f"{LABEL_MANAGED}={MANAGED_BY},{LABEL_OWNER}={self.driver.lease.name},"
            f"{LABEL_STATE} in ({STATE_WARM},{STATE_FILLING})"
        )
        try:
            listed = cl.request(
                "list warm pods", "GET", cl.path(PODS), query={"labelSelector": selector}
            )
        except DevsSandboxError as exc:
            logger.warning("warm pool: cannot list its pods at close (%s); the lease GC will", exc)
            return
        for pod in listed.get("items") or []:
            self.driver._delete_objects(str(pod["metadata"]["name"]))
