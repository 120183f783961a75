"""Cleanup that survives a crash: an owner Lease per driver process, and the reaper.

Every Pod and NetworkPolicy a driver makes carries ``ownerReferences`` to its process's
``coordination.k8s.io`` Lease (the policy also to its pod) and the owner's name as a label.
The driver renews the Lease every third of ``leaseDurationS``. When the process dies the
Lease stops being renewed; the next driver to start (or ``devs-sandbox cleanup --driver
kubernetes``) finds it expired and deletes it, with the pods and policies it owns, and
the cluster's garbage collector deletes whatever still points at it. A Lease deleted by
anyone has the same effect: the garbage collector removes what it owned.

Expired means: not renewed for twice the lease's duration (once for the duration, once
more for clock skew between the renewing host and the reaping one). The reaper also
deletes finished pods (Succeeded/Failed) of other owners once they have been finished
for ``FINISHED_GRACE_S`` (their owner may still be reading why they ended), and objects
whose owner Lease no longer exists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from devs_sandbox.drivers.kubernetes.client import LEASES, PODS, POLICIES, ApiError, Cluster
from devs_sandbox.drivers.kubernetes.manifest import (
    ANN_SANDBOX_ID,
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_SANDBOX,
    MANAGED_BY,
    OwnerRef,
)
from devs_sandbox.errors import DevsSandboxError

logger = logging.getLogger(__name__)

LABEL_ROLE: Final = "devs-sandbox.io/role"
OWNER_PREFIX: Final = "devs-sandbox-owner-"
FINISHED_GRACE_S: Final = 60.0  # a finished pod's own driver reads its end within seconds
SKEW_FACTOR: Final = 2  # expired after this many lease durations without a renewal


def micro_time(at: datetime | None = None) -> str:
    """metav1.MicroTime: RFC 3339 with microseconds, UTC."""
    return (at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    raw = text.rstrip("Z")
    for fmt in ("%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S"):
        with contextlib.suppress(ValueError):
            return datetime.strptime(raw, fmt).replace(tzinfo=UTC)
    return None


def lease_expired(lease: Mapping[str, Any], now: datetime | None = None) -> bool:
    """Not renewed for SKEW_FACTOR lease durations (see the module docstring)."""
    spec = lease.get("spec") or {}
    meta = lease.get("metadata") or {}
    last = (
        parse_time(spec.get("renewTime"))
        or parse_time(spec.get("acquireTime"))
        or parse_time(meta.get("creationTimestamp"))
    )
    if last is None:
        return True
    duration = int(spec.get("leaseDurationSeconds") or 0) or 30
    return (now or datetime.now(UTC)) - last > timedelta(seconds=SKEW_FACTOR * duration)


def lease_body(name: str, holder: str, duration_s: int) -> dict[str, Any]:
    """The owner Lease object as created."""
    now = micro_time()
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "labels": {LABEL_MANAGED: MANAGED_BY, LABEL_ROLE: "owner"}},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration_s,
            "acquireTime": now,
            "renewTime": now,
        },
    }


class OwnerLease:
    """This process's Lease: created on first use, renewed in the background, deleted by
    ``release`` (the garbage collector then takes anything of ours still left)."""

    def __init__(self, cluster: Cluster, duration_s: int) -> None:
        self.cluster = cluster
        self.duration_s = duration_s
        self.name = OWNER_PREFIX + secrets.token_hex(6)
        self.holder = f"{socket.gethostname()}/{os.getpid()}"
        self.renewals = 0
        self._ref: OwnerRef | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ref(self) -> OwnerRef:
        """The Lease to own new objects by (created, and its renewal started, on first use)."""
        with self._lock:
            if self._ref is None:
                self._ref = self._create()
                self._thread = threading.Thread(
                    target=self._renew_loop, name="devs-k8s-lease", daemon=True
                )
                self._thread.start()
            return self._ref

    def _create(self) -> OwnerRef:
        body = lease_body(self.name, self.holder, self.duration_s)
        made = self.cluster.request(
            "create the owner lease",
            "POST",
            self.cluster.path(LEASES),
            body=body,
            query={"fieldValidation": "Strict"},
        )
        return OwnerRef(self.name, str(made["metadata"]["uid"]))

    def renew(self) -> None:
        try:
            self.cluster.request(
                "renew the owner lease",
                "PATCH",
                self.cluster.path(LEASES, self.name),
                body={"spec": {"renewTime": micro_time(), "holderIdentity": self.holder}},
                content_type="application/merge-patch+json",
            )
            self.renewals += 1
        except ApiError as exc:
            if not exc.not_found:
                raise
            # Someone deleted it (a reaper that took us for dead): what it owned is being
            # collected. New objects get a new Lease.
            logger.error(  # noqa: TRY400 - expected, not a crash: no traceback
                "owner lease %s was deleted; its sandboxes are being collected", self.name
            )
            with self._lock:
                self._ref = self._create()

    def _renew_loop(self) -> None:
        period = max(0.5, self.duration_s / 3)
        while not self._stop.wait(period):
            try:
                self.renew()
            except DevsSandboxError as exc:
                logger.warning("renewing owner lease %s failed: %s", self.name, exc)

    def release(self) -> None:
        """Stop renewing and delete the Lease (what it still owns is garbage-collected)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            had, self._ref = self._ref, None
        if had is None:
            return
        with contextlib.suppress(DevsSandboxError):
            self.cluster.request(
                "delete the owner lease",
                "DELETE",
                self.cluster.path(LEASES, self.name),
                body={"propagationPolicy": "Background"},
            )


def _delete(cluster: Cluster, template: str, name: str) -> bool:
    """Delete one object; True if it is gone (also when it was gone already)."""
    try:
        cluster.request(f"delete {name}", "DELETE", cluster.path(template, name))
    except ApiError as exc:
        return exc.not_found
    except DevsSandboxError:
        return False
    return True


def reap(cluster: Cluster, *, mine: set[str], own_lease: str | None) -> list[str]:
    """Delete what dead owners left in the namespace (see the module docstring); returns
    the sandbox ids reaped. ``mine``: pod names this process still uses."""
    managed = f"{LABEL_MANAGED}={MANAGED_BY}"
    leases = cluster.request(
        "list leases", "GET", cluster.path(LEASES), query={"labelSelector": managed}
    )
    live: set[str] = set()
    for lease in leases.get("items") or []:
        name = str(lease["metadata"]["name"])
        if name == own_lease or not lease_expired(lease):
            live.add(name)
        elif _delete(cluster, LEASES, name):
            logger.info(
                "reaped expired owner lease %s (%s)", name, lease["spec"].get("holderIdentity")
            )
    pods = cluster.request("list pods", "GET", cluster.path(PODS), query={"labelSelector": managed})
    reaped: list[str] = []
    remaining: set[str] = set()  # sandbox keys of the pods that stay
    now = datetime.now(UTC)
    for pod in pods.get("items") or []:
        meta = pod["metadata"]
        name = str(meta["name"])
        labels = meta.get("labels") or {}
        owner = labels.get(LABEL_OWNER)
        finished_at = _finished_at(pod.get("status") or {})
        stale = finished_at is not None and (now - finished_at).total_seconds() > FINISHED_GRACE_S
        if name not in mine and (owner not in live or stale) and _delete(cluster, PODS, name):
            reaped.append(str((meta.get("annotations") or {}).get(ANN_SANDBOX_ID) or name))
        else:
            remaining.add(str(labels.get(LABEL_SANDBOX) or ""))
    policies = cluster.request(
        "list network policies", "GET", cluster.path(POLICIES), query={"labelSelector": managed}
    )
    for policy in policies.get("items") or []:
        meta = policy["metadata"]
        labels = meta.get("labels") or {}
        # A live owner may be between its policy and its pod; a pod still there needs it.
        if labels.get(LABEL_OWNER) in live or labels.get(LABEL_SANDBOX) in remaining:
            continue
        _delete(cluster, POLICIES, str(meta["name"]))
    return reaped


def _finished_at(status: Mapping[str, Any]) -> datetime | None:
    if status.get("phase") not in ("Succeeded", "Failed"):
        return None
    latest: datetime | None = None
    for cs in status.get("containerStatuses") or []:
        at = parse_time(((cs.get("state") or {}).get("terminated") or {}).get("finishedAt"))
        if at is not None and (latest is None or at > latest):
            latest = at
    return latest or datetime.now(UTC) - timedelta(seconds=FINISHED_GRACE_S + 1)
