"""The emulator's etcd: objects by (resource, namespace, name), one revision counter, and a
bounded event history that watches resume from.

Invariants the API server keeps and this store keeps too:
- every write (create, update, delete) takes the next revision, stamped on the object as
  ``metadata.resourceVersion``; a list carries the revision it was read at;
- a write whose object equals the stored one is not a write: no new revision, no event
  (storage/etcd3/store.go GuaranteedUpdate skips unchanged objects);
- a watch from revision ``r`` gets every event after ``r`` if the history still holds it,
  otherwise a 410 Expired (storage/cacher/watch_cache.go); ``compact()`` drops history.

Thread-safe: the HTTP handlers run on the emulator's event loop, test hooks and the kubelet
on other threads; watchers are fed through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import status
from .selectors import GENERIC_FIELDS, POD_FIELDS, Matcher

HISTORY_EVENTS = 10_000  # like the watch cache's capacity: old enough watches get a 410


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    fields: frozenset[str] = GENERIC_FIELDS
    subresources: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        return f"{self.api_version}/{self.plural}"


PODS = Kind(
    "", "v1", "pods", "Pod", fields=POD_FIELDS, subresources=("status", "binding", "exec", "log")
)
NAMESPACES = Kind("", "v1", "namespaces", "Namespace", namespaced=False)
NETWORK_POLICIES = Kind("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
LEASES = Kind("coordination.k8s.io", "v1", "leases", "Lease")
KINDS: tuple[Kind, ...] = (PODS, NAMESPACES, NETWORK_POLICIES, LEASES)

Key = tuple[str, str, str]  # (kind.key, namespace or "", name)


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def generate_name(prefix: str) -> str:
    # names.SimpleNameGenerator: 5 characters from a vowel-free alphabet.
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    return prefix + "".join(secrets.choice(alphabet) for _ in range(5))


@dataclass
class Event:
    revision: int
    type: str  # ADDED, MODIFIED, DELETED
    kind: Kind
    obj: dict[str, Any]
    old: dict[str, Any] | None = None


@dataclass
class Watcher:
    """One open watch: the events it wants arrive on ``queue`` (``None`` = the end)."""

    kind: Kind
    namespace: str | None
    matches: Matcher
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)

    def translate(self, event: Event) -> dict[str, Any] | None:
        """The watch event this watcher sees, honouring selectors the way the watch cache
        does: an object moving out of the selection is DELETED, into it ADDED."""
        if event.kind != self.kind:
            return None
        ns = event.obj["metadata"].get("namespace", "")
        if self.namespace is not None and ns != self.namespace:
            return None
        now = self.matches(event.obj)
        before = event.old is not None and self.matches(event.old)
        if event.type == "MODIFIED":
            if now and before:
                return {"type": "MODIFIED", "object": event.obj}
            if now:
                return {"type": "ADDED", "object": event.obj}
            if before:
                return {"type": "DELETED", "object": event.obj}
            return None
        return {"type": event.type, "object": event.obj} if now else None

    def push(self, item: dict[str, Any] | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Store:
    def __init__(self, history: int = HISTORY_EVENTS) -> None:
        self.lock = threading.RLock()
        self.revision = 1
        self._objects: dict[Key, dict[str, Any]] = {}
        self._history: collections.deque[Event] = collections.deque(maxlen=history)
        self._floor = 1  # the oldest revision a watch may resume from
        self._watchers: list[Watcher] = []
        self.on_event: list[Callable[[Event], None]] = []

    # -- reads ---------------------------------------------------------------------------
    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self._objects.get((kind.key, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def require(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        obj = self.get(kind, namespace, name)
        if obj is None:
            raise status.not_found(kind.group, kind.plural, name)
        return obj

    def list(
        self, kind: Kind, namespace: str | None, matches: Matcher = lambda _o: True
    ) -> tuple[list[dict[str, Any]], int]:
        with self.lock:
            items = [
                copy.deepcopy(obj)
                for (k, ns, _), obj in sorted(self._objects.items())
                if k == kind.key and (namespace is None or ns == namespace) and matches(obj)
            ]
            return items, self.revision

    def objects(self, kind: Kind) -> Iterator[dict[str, Any]]:
        items, _ = self.list(kind, None)
        return iter(items)

    # -- writes --------------------------------------------------------------------------
    def _commit(
        self, event_type: str, kind: Kind, key: Key, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> dict[str, Any]:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        if event_type == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        event = Event(
            self.revision,
            event_type,
            kind,
            copy.deepcopy(obj),
            copy.deepcopy(old) if old is not None else None,
        )
        self._history.append(event)
        if len(self._history) == self._history.maxlen:
            self._floor = self._history[0].revision - 1
        for watcher in list(self._watchers):
            item = watcher.translate(event)
            if item is not None:
                watcher.push(item)
        for listener in list(self.on_event):
            listener(event)
        return copy.deepcopy(obj)

    def create(self, kind: Kind, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a new object: name (or generateName), uid, timestamps, revision."""
        with self.lock:
            meta = obj.setdefault("metadata", {})
            if not meta.get("name"):
                if not meta.get("generateName"):
                    raise status.invalid(
                        kind.group,
                        kind.kind,
                        "",
                        [
                            (
                                "FieldValueRequired",
                                "metadata.name",
                                "Required value: name or generateName is required",
                            )
                        ],
                    )
                for _ in range(8):
                    meta["name"] = generate_name(meta["generateName"])
                    if (kind.key, namespace, meta["name"]) not in self._objects:
                        break
            key: Key = (kind.key, namespace, meta["name"])
            if key in self._objects:
                raise status.already_exists(kind.group, kind.plural, meta["name"])
            if kind.namespaced:
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            for transient in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(transient, None)
            obj["apiVersion"] = kind.api_version
            obj["kind"] = kind.kind
            return self._commit("ADDED", kind, key, obj, None)

    def update(
        self, kind: Kind, obj: dict[str, Any], *, expect_uid: str | None = None
    ) -> dict[str, Any]:
        """Store ``obj`` over the current object of that name. A resourceVersion in ``obj``
        must be the current one (409 Conflict otherwise); none means unconditional, which
        pods, leases and network policies allow (their strategies' AllowUnconditionalUpdate).
        """
        with self.lock:
            meta = obj["metadata"]
            namespace = meta.get("namespace", "") if kind.namespaced else ""
            key: Key = (kind.key, namespace, meta["name"])
            current = self._objects.get(key)
            if current is None:
                raise status.not_found(kind.group, kind.plural, meta["name"])
            cur_meta = current["metadata"]
            rv = meta.get("resourceVersion")
            if rv and rv != cur_meta["resourceVersion"]:
                raise status.conflict(kind.group, kind.plural, meta["name"])
            if expect_uid is not None and expect_uid != cur_meta["uid"]:
                raise status.conflict(
                    kind.group,
                    kind.plural,
                    meta["name"],
                    f"Precondition failed: UID in precondition: {expect_uid}, "
                    f"UID in object meta: {cur_meta['uid']}",
                )
            # Fields the server owns survive any update (rest.BeforeUpdate).
            for owned in (
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
            ):
                if owned in cur_meta:
                    meta[owned] = cur_meta[owned]
                else:
                    meta.pop(owned, None)
            meta["resourceVersion"] = cur_meta["resourceVersion"]
            obj["apiVersion"] = kind.api_version
            obj["kind"] = kind.kind
            if obj == current:
                return copy.deepcopy(current)
            return self._commit("MODIFIED", kind, key, obj, current)

    def mark_deleting(self, kind: Kind, namespace: str, name: str, grace_s: int) -> dict[str, Any]:
        """Graceful deletion's first step: deletionTimestamp + grace period (MODIFIED)."""
        with self.lock:
            key: Key = (kind.key, namespace, name)
            current = self._objects[key]
            obj = copy.deepcopy(current)
            meta = obj["metadata"]
            deadline = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace_s)
            meta["deletionTimestamp"] = deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
            meta["deletionGracePeriodSeconds"] = grace_s
            return self._commit("MODIFIED", kind, key, obj, current)

    def remove(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        with self.lock:
            key: Key = (kind.key, namespace, name)
            current = self._objects.get(key)
            if current is None:
                raise status.not_found(kind.group, kind.plural, name)
            return self._commit("DELETED", kind, key, copy.deepcopy(current), current)

    # -- watches -------------------------------------------------------------------------
    def watch(
        self,
        kind: Kind,
        namespace: str | None,
        matches: Matcher,
        loop: asyncio.AbstractEventLoop,
        since: str | None,
    ) -> Watcher:
        """Register a watch. ``since`` empty or "0": synthetic ADDED events for the current
        state first; a number: the events after it, or 410 if compacted away."""
        with self.lock:
            watcher = Watcher(kind, namespace, matches, loop)
            if since in (None, "", "0"):
                items, _ = self.list(kind, namespace, matches)
                for obj in items:
                    watcher.queue.put_nowait({"type": "ADDED", "object": obj})
            else:
                try:
                    rv = int(since)
                except ValueError:
                    raise status.bad_request(f'invalid resource version "{since}"') from None
                if rv < self._floor:
                    raise status.expired(f"too old resource version: {rv} ({self._floor})")
                for event in self._history:
                    if event.revision > rv:
                        item = watcher.translate(event)
                        if item is not None:
                            watcher.queue.put_nowait(item)
            self._watchers.append(watcher)
            return watcher

    def unwatch(self, watcher: Watcher) -> None:
        with self.lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def compact(self) -> int:
        """Forget all history (etcd compaction): a watch resuming from any revision up to
        now gets 410. Returns the new floor."""
        with self.lock:
            self._history.clear()
            self._floor = self.revision
            return self._floor

    def expire_watches(self) -> int:
        """Compact and end every open watch with an ERROR 410 event, as when the watch
        cache is re-initialised. Returns how many watches were ended."""
        with self.lock:
            floor = self.compact()
            ended = list(self._watchers)
            for watcher in ended:
                err = status.expired(f"too old resource version: {floor - 1} ({floor})")
                watcher.push({"type": "ERROR", "object": err.body()})
                watcher.push(None)
            self._watchers.clear()
            return len(ended)

    def close_watches(self) -> None:
        with self.lock:
            for watcher in self._watchers:
                watcher.push(None)
            self._watchers.clear()


def owner_uids(obj: Mapping[str, Any]) -> set[str]:
    return {ref.get("uid", "") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []}
