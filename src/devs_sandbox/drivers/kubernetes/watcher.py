"""One watch of this process's pods: how the driver learns what the kubelet decided.

A pod's end arrives here pushed, not polled: ``OOMKilled`` (the container's OOM kill; on
cgroup v2 nodes since 1.28 the whole container is killed on an OOM), ``Evicted`` (node
memory or ephemeral-storage pressure), ``DeadlineExceeded`` (activeDeadlineSeconds, the
backstop behind our own timeout). ``classify`` turns a pod into a ``PodState``; the driver
records it before anything deletes the pod, so a run's final check reports the kill.

The watch is list-then-watch from the list's resourceVersion, renewed every
``WATCH_TIMEOUT_S``; when the server answers 410 Gone (history compacted: an ERROR event
or a 410 status) it lists again, and the list re-delivers every pod, so nothing that
happened meanwhile is missed. Connection failures back off and list again. The thread
stops when ``stop`` closes the open response.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from devs_sandbox.drivers.kubernetes.client import PODS, Cluster
from devs_sandbox.errors import DevsSandboxError

logger = logging.getLogger(__name__)

WATCH_TIMEOUT_S: Final = 60  # a watch is renewed (from its last resourceVersion) this often
BACKOFF_S: Final = (0.2, 0.5, 1.0, 2.0, 5.0)  # after failures in a row; then stays at 5 s
WAITING_FAILURES: Final = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)


@dataclass(frozen=True, slots=True)
class PodState:
    """What one pod object says about its sandbox."""

    phase: str = "Pending"
    running: bool = False
    finished: bool = False  # Succeeded/Failed: nothing runs any more
    reason: str = ""  # OOMKilled, Evicted, DeadlineExceeded, Error, Completed, ...
    message: str = ""
    oom: bool = False  # the kernel's OOM killer or a memory eviction ended it
    disk_full: bool = False  # evicted for ephemeral storage or an emptyDir over its limit
    start_failure: str = ""  # a waiting reason that will not resolve by itself
    unschedulable: str = ""  # the scheduler's message while no node fits
    deleting: bool = False
    start_time: str = ""


def classify(pod: Mapping[str, Any]) -> PodState:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    reason = str(status.get("reason") or "")
    message = str(status.get("message") or "")
    running = False
    start_failure = ""
    oom = False
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if state.get("running") is not None:
            running = True
        term = state.get("terminated")
        if term:
            reason = reason or str(term.get("reason") or "")
            message = message or str(term.get("message") or "")
            oom = oom or term.get("reason") == "OOMKilled"
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in WAITING_FAILURES:
            start_failure = f"{waiting.get('reason')}: {waiting.get('message') or ''}".strip()
    lowered = message.lower()
    evicted = reason == "Evicted"
    if evicted and "memory" in lowered:
        oom = True
    disk_full = evicted and any(w in lowered for w in ("ephemeral", "emptydir", "storage"))
    unschedulable = ""
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            unschedulable = str(cond.get("message") or "no node can run the pod")
    finished = phase in ("Succeeded", "Failed")
    return PodState(
        phase=phase,
        running=running and phase == "Running",
        finished=finished,
        reason=reason,
        message=message,
        oom=oom,
        disk_full=disk_full,
        start_failure=start_failure,
        unschedulable=unschedulable,
        deleting=bool(meta.get("deletionTimestamp")),
        start_time=str(status.get("startTime") or ""),
    )


OnPod = Callable[[str, Mapping[str, Any]], None]


class PodWatcher:
    """List-then-watch of the pods matching ``selector``; every event goes to ``on_pod``
    (``"SYNC"`` for each pod of a fresh list, then ADDED/MODIFIED/DELETED), and
    ``on_list(names)`` after each list, naming every pod that exists."""

    def __init__(
        self,
        cluster: Cluster,
        selector: str,
        on_pod: OnPod,
        on_list: Callable[[set[str]], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.selector = selector
        self.on_pod = on_pod
        self.on_list = on_list
        self.lists = 0  # how many times it listed (each 410 makes one more)
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._resp: Any = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="devs-k8s-watch", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> PodWatcher:
        self._thread.start()
        return self

    def stop(self, join_s: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):
                getattr(resp, "shutdown", resp.close)()
        if self.started and threading.current_thread() is not self._thread:
            self._thread.join(join_s)

    def _run(self) -> None:
        failures = 0
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                rv = self._watch(rv)
                failures = 0
            except _ExpiredError:
                rv = None  # 410 Gone: list again, which re-delivers every pod
            except (DevsSandboxError, OSError, ValueError) as exc:
                if self._stop.is_set():
                    return
                logger.warning("pod watch failed (%s); listing again", exc)
                rv = None
                self._stop.wait(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                failures += 1
            except Exception as exc:  # urllib3 ProtocolError and friends: the stream broke
                if self._stop.is_set():
                    return
                logger.warning("pod watch stream broke (%s); listing again", exc)
                rv = None
                self._stop.wait(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                failures += 1

    def _list(self) -> str:
        listed = self.cluster.request(
            "list pods",
            "GET",
            self.cluster.path(PODS),
            query={"labelSelector": self.selector},
        )
        self.lists += 1
        names: set[str] = set()
        for pod in listed.get("items") or []:
            names.add(str((pod.get("metadata") or {}).get("name")))
            self._deliver("SYNC", pod)
        if self.on_list is not None:
            self.on_list(names)
        self.synced.set()
        return str((listed.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, rv: str) -> str:
        query = {"labelSelector": self.selector, "allowWatchBookmarks": "true"}
        if rv:
            query["resourceVersion"] = rv
        try:
            resp, events = self.cluster.watch(self.cluster.path(PODS), query, WATCH_TIMEOUT_S)
        except DevsSandboxError as exc:
            if getattr(exc, "status", 0) == 410:
                raise _ExpiredError from exc
            raise
        with self._lock:
            self._resp = resp
        if self._stop.is_set():
            resp.shutdown()
        try:
            for event in events:
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410 or obj.get("reason") in ("Expired", "Gone"):
                        raise _ExpiredError
                    raise _WatchError(str(obj.get("message") or obj))
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if version:
                    rv = str(version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._deliver(str(kind), obj)
        finally:
            with self._lock:
                self._resp = None
        return rv

    def _deliver(self, kind: str, pod: Mapping[str, Any]) -> None:
        try:
            self.on_pod(kind, pod)
        except Exception:
            logger.exception("handling a pod event failed")


class _ExpiredError(Exception):
    """The watch's resourceVersion is too old (410 Gone)."""


class _WatchError(DevsSandboxError):
    """The server ended the watch with an ERROR event other than 410."""
