"""The emulated API server: kmock's Kubernetes scaffold, extended with what a driver needs.

kmock (``kmock.KubernetesScaffold``) brings the HTTP server, request parsing, the request log
(``api.requests``) and API discovery. This subclass adds, for pods, namespaces, network
policies (networking.k8s.io/v1) and leases (coordination.k8s.io/v1), the semantics kmock's own
``KubernetesEmulator`` lacks (FACTS.md): resourceVersion on every object and list,
optimistic concurrency, label and field selectors, watches that honour ``timeoutSeconds`` and
``resourceVersion`` (410 Expired as an ERROR event), JSON patch with ``test`` (422), the real
``Status`` bodies (status.py), graceful pod deletion, ownerReference garbage collection, a
ResourceQuota-like admission (403 "exceeded quota"), and ``pods/exec`` over WebSocket
(v5.channel.k8s.io and v4) bridged to whatever node backend serves the pod (kubelet.py).

Fault hooks for tests: ``fail_next`` (answer the next matching request with a code),
``expire_watches`` (end every watch with 410 and compact history), ``compact``,
``drop_next_exec_status`` (close an exec without its channel-3 status).

What it does not do, on purpose: server-side apply (415), dryRun (400), strategic merge
patch semantics (applied as a merge patch, see patching.py), RBAC (one bearer token).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import queue
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol

import aiohttp
import aiohttp.web
import attrs
import kmock

from . import status, validation
from .patching import PatchError, json_patch, merge_patch
from .selectors import field_selector, label_selector
from .status import ApiError
from .store import KINDS, NAMESPACES, PODS, Kind, Store, owner_uids

logger = logging.getLogger(__name__)

V5_PROTOCOL = "v5.channel.k8s.io"
V4_PROTOCOL = "v4.channel.k8s.io"
STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255
GC_INTERVAL_S = 0.1  # the garbage collector's sweep period (the real one reacts in ~ms-s)
DISCONNECT_POLL_S = 1.0  # how often an idle watch checks that its client is still there
DEFAULT_GRACE_S = 30  # PodSpec.terminationGracePeriodSeconds default
SERVER_VERSION = {
    "major": "1",
    "minor": "33",
    "gitVersion": "v1.33.0-devs-emulator",
    "platform": "linux/amd64",
}


# -- the node side of exec ----------------------------------------------------------------
class ExecSession(Protocol):
    """One running exec on a node. All methods may block; the server calls them from threads."""

    def read(self) -> tuple[int, bytes] | None:
        """The next output chunk as (1 stdout | 2 stderr, data); ``None`` at end of output."""

    def write_stdin(self, data: bytes) -> None: ...

    def close_stdin(self) -> None: ...

    def resize(self, width: int, height: int) -> None: ...

    def exit_code(self) -> int | None:
        """After ``read`` returned ``None``: the exit status, ``None`` if it is unknown."""

    def error(self) -> str | None:
        """Why the command could not start (the runtime's message), else ``None``."""

    def detach(self) -> None:
        """The client went away: stop relaying, leave the process running (as a kubelet)."""


class NodeBackend(Protocol):
    def start_exec(
        self, pod: dict[str, Any], container: str, command: list[str], *, stdin: bool, tty: bool
    ) -> ExecSession: ...

    def logs(self, pod: dict[str, Any], container: str) -> bytes: ...


# -- configuration ------------------------------------------------------------------------
@dataclass
class Quota:
    """A ResourceQuota: ``hard`` as in its spec (``pods``, ``requests.memory``,
    ``limits.cpu``, ``memory`` = ``requests.memory``, ...), in ``namespace`` or everywhere."""

    hard: dict[str, str]
    name: str = "devs-quota"
    namespace: str | None = None

    def tracked(self) -> dict[str, Decimal]:
        out: dict[str, Decimal] = {}
        aliases = {"memory": "requests.memory", "cpu": "requests.cpu"}
        for key, value in self.hard.items():
            out[aliases.get(key, key)] = validation.quantity(value)
        return out


@dataclass
class _Fault:
    verb: str
    plural: str
    code: int
    message: str
    remaining: int


@dataclass
class _Route:
    kind: Kind
    namespace: str | None
    name: str | None
    subresource: str | None


def _flag(query: Any, key: str) -> bool:
    return str(query.get(key, "")).lower() in ("true", "1")


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    """kmock's scaffold serving pods, namespaces, network policies and leases from a Store."""

    token: str | None = None  # the bearer token clients must send; None: no auth
    initial_namespaces: tuple[str, ...] = ("default",)
    store: Store = attrs.field(factory=Store)
    quotas: list[Quota] = attrs.field(factory=list)
    warnings: list[str] = attrs.field(factory=list, init=False)  # Warning headers sent
    internal_errors: list[str] = attrs.field(factory=list, init=False)  # emulator bugs
    faults: list[_Fault] = attrs.field(factory=list, init=False)
    nodes: dict[str, NodeBackend] = attrs.field(factory=dict, init=False)
    exec_status_drops: int = attrs.field(default=0, init=False)
    hooks_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    gc_task: asyncio.Task[None] | None = attrs.field(default=None, init=False)
    open_execs: set[asyncio.Task[Any]] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for kind in KINDS:
            self.resources[f"{kind.api_version}/{kind.plural}"] = {
                "kind": kind.kind,
                "singular": kind.kind.lower(),
                "namespaced": kind.namespaced,
                "verbs": [
                    "create",
                    "delete",
                    "deletecollection",
                    "get",
                    "list",
                    "patch",
                    "update",
                    "watch",
                ],
                "shortnames": [],
                "categories": [],
                "subresources": list(kind.subresources),
            }
        for ns in self.initial_namespaces:
            self.store.create(
                NAMESPACES, "", {"metadata": {"name": ns}, "status": {"phase": "Active"}}
            )

    async def __aenter__(self) -> ApiServer:
        await super().__aenter__()
        self.gc_task = asyncio.create_task(self._gc_loop())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.gc_task is not None:
            self.gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.gc_task
        self.store.close_watches()
        for task in list(self.open_execs):
            task.cancel()
        await super().__aexit__(*exc)

    # -- test hooks (thread-safe) ---------------------------------------------------------
    def fail_next(
        self, verb: str, plural: str = "pods", code: int = 500, message: str = "", times: int = 1
    ) -> None:
        """Answer the next ``times`` requests of ``verb`` (create, get, list, watch, update,
        patch, delete, exec) on ``plural`` with ``code`` and the Status that code maps to."""
        with self.hooks_lock:
            self.faults.append(_Fault(verb, plural, code, message, times))

    def expire_watches(self) -> int:
        """End every open watch with an ERROR 410 event; resuming from any older
        resourceVersion then gets 410 too (the client must list again)."""
        return self.store.expire_watches()

    def compact(self) -> int:
        return self.store.compact()

    def drop_next_exec_status(self, times: int = 1) -> None:
        """The next exec closes its WebSocket without the channel-3 status (a lost frame)."""
        with self.hooks_lock:
            self.exec_status_drops += times

    def register_node(self, name: str, backend: NodeBackend) -> None:
        """A kubelet announces the node it serves; exec and logs of its pods go to it."""
        self.nodes[name] = backend

    def unregister_node(self, name: str) -> None:
        self.nodes.pop(name, None)

    # -- HTTP entry -----------------------------------------------------------------------
    async def _serve_server_version(self, request: Any) -> Any:
        return dict(SERVER_VERSION)

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """Our resources are served here, before kmock parses the request (its path parser
        cannot split ``/api/v1/namespaces``); everything else (discovery, unknown paths)
        goes to kmock. Every request lands in kmock's log (``api.requests``) either way."""
        try:
            route = self._route(raw.path)
        except ApiError as exc:
            return self._error(exc)
        if route is None:
            return await super().__call__(raw)
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        self._requests.append(
            kmock.Request(
                id=len(self._requests),
                method=raw.method,
                url=raw.url,
                params=dict(raw.query),
                headers=dict(raw.headers),
                body=body,
                text=body.decode(errors="replace"),
                data=data,
                namespace=route.namespace,
                name=route.name,
                subresource=route.subresource,
                resource=kmock.resource(route.kind.group, route.kind.version, route.kind.plural),
                raw_request=raw,
            )
        )
        try:
            self._authenticate(raw)
            return await self._dispatch(raw, body, route)
        except ApiError as exc:
            return self._error(exc)
        except Exception as exc:
            self.internal_errors.append("".join(traceback.format_exception(exc)))
            logger.exception("emulator bug serving %s %s", raw.method, raw.path_qs)
            return self._error(ApiError(500, "InternalError", f"Internal error occurred: {exc}"))

    def _error(self, exc: ApiError) -> aiohttp.web.Response:
        return aiohttp.web.json_response(exc.body(), status=exc.code, headers=exc.headers)

    def _authenticate(self, raw: aiohttp.web.BaseRequest) -> None:
        if self.token is None:
            return
        if raw.headers.get("Authorization", "") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized", "Unauthorized")

    def _route(self, path: str) -> _Route | None:
        parts = [p for p in path.split("/") if p]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        by_plural = {k.plural: k for k in KINDS if k.group == group and k.version == version}
        if not rest:
            return None  # discovery: kmock's scaffold answers
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] in by_plural:
            namespace, rest = rest[1], rest[2:]
        kind = by_plural.get(rest[0])
        if kind is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        name = rest[1] if len(rest) > 1 else None
        sub = "/".join(rest[2:]) or None
        if kind.namespaced and namespace is None and name is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub is not None and sub not in kind.subresources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return _Route(kind, namespace, name, sub)

    def _check_fault(self, verb: str, kind: Kind) -> None:
        with self.hooks_lock:
            for fault in self.faults:
                if fault.verb == verb and fault.plural == kind.plural and fault.remaining > 0:
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self.faults.remove(fault)
                    raise status.generic(fault.code, fault.message)

    async def _dispatch(
        self, raw: aiohttp.web.BaseRequest, body: bytes, route: _Route
    ) -> aiohttp.web.StreamResponse:
        kind, ns, name, sub, method = (
            route.kind,
            route.namespace,
            route.name,
            route.subresource,
            raw.method,
        )
        query = raw.query
        if query.get("dryRun"):
            raise status.bad_request("dryRun is not implemented by the emulator")
        if name is None:
            if method == "GET" and _flag(query, "watch"):
                self._check_fault("watch", kind)
                return await self._watch(raw, kind, ns, None)
            if method == "GET":
                self._check_fault("list", kind)
                return self._json(self._list(kind, ns, query))
            if method == "POST":
                self._check_fault("create", kind)
                created, warnings = self._create(kind, ns or "", self._body(body), query)
                return self._json(created, 201, warnings)
            if method == "DELETE":
                self._check_fault("delete", kind)
                return self._json(self._delete_collection(kind, ns, query, body))
            raise status.method_not_allowed(kind.group, kind.plural, method)
        assert ns is not None or not kind.namespaced
        ns = ns or ""
        if sub == "exec":
            self._check_fault("exec", kind)
            return await self._exec(raw, ns, name)
        if sub == "log":
            return await self._log(ns, name, query)
        if sub == "binding":
            if method != "POST":
                raise status.method_not_allowed(kind.group, "pods/binding", method)
            return self._json(self._bind(ns, name, self._body(body)), 201)
        if method == "GET" and _flag(query, "watch"):
            self._check_fault("watch", kind)
            return await self._watch(raw, kind, ns if kind.namespaced else None, name)
        if method == "GET":
            self._check_fault("get", kind)
            return self._json(self.store.require(kind, ns, name))
        if method == "PUT":
            self._check_fault("update", kind)
            obj, warnings = self._replace(kind, ns, name, self._body(body), sub=sub, query=query)
            return self._json(obj, 200, warnings)
        if method == "PATCH":
            self._check_fault("patch", kind)
            ctype = raw.headers.get("Content-Type", "").split(";")[0].strip()
            return self._json(self._patch(kind, ns, name, ctype=ctype, body=body, sub=sub))
        if method == "DELETE":
            self._check_fault("delete", kind)
            return self._json(self._delete(kind, ns, name, query, body))
        raise status.method_not_allowed(kind.group, kind.plural, method)

    def _json(
        self, payload: Any, code: int = 200, warnings: list[str] | None = None
    ) -> aiohttp.web.Response:
        headers = {}
        if warnings:
            self.warnings.extend(warnings)
            headers["Warning"] = ", ".join(f'299 - "{w}"' for w in warnings)
        return aiohttp.web.json_response(payload, status=code, headers=headers)

    @staticmethod
    def _body(body: bytes) -> Any:
        try:
            return json.loads(body or b"null")
        except ValueError as exc:
            raise status.bad_request(f"error decoding request body: {exc}") from None

    # -- verbs ----------------------------------------------------------------------------
    def _list(self, kind: Kind, ns: str | None, query: Any) -> dict[str, Any]:
        matches = self._matcher(kind, query)
        items, rev = self.store.list(kind, ns, matches)
        for item in items:  # typed lists carry no apiVersion/kind on their items
            item.pop("apiVersion", None)
            item.pop("kind", None)
        meta: dict[str, Any] = {"resourceVersion": str(rev)}
        limit = int(query.get("limit", "0") or 0)
        start = int(query.get("continue", "0") or 0)
        if limit > 0:
            if start + limit < len(items):
                meta["continue"] = str(start + limit)
                meta["remainingItemCount"] = len(items) - start - limit
            items = items[start : start + limit]
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": meta,
            "items": items,
        }

    def _matcher(self, kind: Kind, query: Any, name: str | None = None) -> Any:
        by_label = label_selector(query.get("labelSelector"))
        by_field = field_selector(query.get("fieldSelector"), kind.fields)
        return lambda o: (
            by_label(o) and by_field(o) and (name is None or o["metadata"]["name"] == name)
        )

    def _create(
        self,
        kind: Kind,
        ns: str,
        obj: Any,
        query: Any,
    ) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(obj, dict):
            raise status.bad_request("the body of the request is not an object")
        self._check_type(kind, obj)
        meta = obj.setdefault("metadata", {})
        if kind.namespaced and meta.get("namespace") not in (None, "", ns):
            raise status.bad_request(
                "the namespace of the provided object does not match "
                "the namespace sent on the request"
            )
        if meta.get("resourceVersion"):
            # storage/etcd3/store.go Create (surfaces as a 500)
            raise ApiError(
                500,
                "InternalError",
                "Internal error occurred: resourceVersion "
                "should not be set on objects to be created",
            )
        warnings = validation.check_structure(kind, obj, query.get("fieldValidation", "Warn"))
        validation.check_metadata(kind, obj)
        if kind == PODS:
            validation.prepare_pod(obj)
        with self.store.lock:
            if kind.namespaced:
                namespace = self.store.get(NAMESPACES, "", ns)
                if namespace is None:
                    raise status.not_found("", "namespaces", ns)
                if namespace["metadata"].get("deletionTimestamp"):
                    raise status.forbidden(
                        kind.group,
                        kind.plural,
                        meta.get("name") or "",
                        f"unable to create new content in namespace {ns} because it is being "
                        "terminated",
                    )
            if kind == PODS:
                self._admit_quota(ns, obj)
            return self.store.create(kind, ns, obj), warnings

    @staticmethod
    def _check_type(kind: Kind, obj: dict[str, Any]) -> None:
        if obj.get("apiVersion") not in (None, kind.api_version):
            raise status.bad_request(
                f"the API version in the data ({obj['apiVersion']}) does "
                f"not match the expected API version ({kind.api_version})"
            )
        if obj.get("kind") not in (None, kind.kind):
            raise status.bad_request(
                f"the kind in the data ({obj['kind']}) does not match "
                f"the expected kind ({kind.kind})"
            )

    def _admit_quota(self, ns: str, pod: dict[str, Any]) -> None:
        """plugin/pkg/admission/resourcequota/controller.go CheckRequest, for pods."""
        name = pod["metadata"].get("name") or pod["metadata"].get("generateName") or "Unknown"
        requested_all = validation.pod_requests(pod)
        live, _ = self.store.list(
            PODS, ns, lambda p: (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        )
        for quota in self.quotas:
            if quota.namespace not in (None, ns):
                continue
            hard = quota.tracked()
            missing = sorted(k for k in hard if k != "pods" and k not in requested_all)
            if missing:
                raise status.forbidden(
                    "",
                    "pods",
                    name,
                    f"failed quota: {quota.name}: must specify {','.join(missing)}",
                )
            used: dict[str, Decimal] = {k: Decimal(0) for k in hard}
            for other in live:
                for k, v in validation.pod_requests(other).items():
                    if k in used:
                        used[k] += v
            requested = {k: requested_all[k] for k in hard}
            exceeded = sorted(k for k in hard if used[k] + requested[k] > hard[k])
            if exceeded:

                def pp(values: dict[str, Decimal], keys: list[str] = exceeded) -> str:
                    return ",".join(f"{k}={validation.format_quantity(values[k], k)}" for k in keys)

                raise status.forbidden(
                    "",
                    "pods",
                    name,
                    (
                        f"exceeded quota: {quota.name}, requested: {pp(requested)}, "
                        f"used: {pp(used)}, limited: {pp(hard)}"
                    ),
                )

    def _replace(
        self,
        kind: Kind,
        ns: str,
        name: str,
        obj: Any,
        *,
        sub: str | None,
        query: Any,
    ) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(obj, dict):
            raise status.bad_request("the body of the request is not an object")
        self._check_type(kind, obj)
        meta = obj.setdefault("metadata", {})
        if meta.get("name") != name:
            raise status.bad_request(
                f"the name of the object ({meta.get('name')}) does not "
                f"match the name on the URL ({name})"
            )
        warnings = validation.check_structure(kind, obj, query.get("fieldValidation", "Warn"))
        with self.store.lock:
            return self._store_update(kind, ns, name, obj, sub), warnings

    def _store_update(
        self, kind: Kind, ns: str, name: str, obj: dict[str, Any], sub: str | None
    ) -> dict[str, Any]:
        """An update (PUT or the result of a patch) with the strategy of the endpoint."""
        current = self.store.require(kind, ns, name)
        obj.setdefault("metadata", {})["name"] = name
        if kind.namespaced:
            obj["metadata"]["namespace"] = ns
        validation.check_metadata(kind, obj)
        if kind == PODS and sub == "status":
            # podStatusStrategy.PrepareForUpdate: spec and ownerReferences stay.
            obj["spec"] = current["spec"]
            refs = current["metadata"].get("ownerReferences")
            obj["metadata"].pop("ownerReferences", None)
            if refs is not None:
                obj["metadata"]["ownerReferences"] = refs
        elif kind == PODS:
            validation.check_pod_update(current, obj)
            obj["status"] = current.get("status", {})
        updated = self.store.update(kind, obj)
        return self._maybe_finish_deletion(kind, ns, name, updated)

    def _patch(
        self,
        kind: Kind,
        ns: str,
        name: str,
        *,
        ctype: str,
        body: bytes,
        sub: str | None,
    ) -> dict[str, Any]:
        patch = self._body(body)
        with self.store.lock:
            current = self.store.require(kind, ns, name)
            if ctype == "application/json-patch+json":
                try:
                    patched = json_patch(current, patch)
                except PatchError:
                    raise status.unprocessable_patch() from None
                except (TypeError, KeyError) as exc:
                    raise status.bad_request(str(exc)) from None
            elif ctype in (
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
            ):
                if not isinstance(patch, dict):
                    raise status.bad_request("a merge patch must be a JSON object")
                patched = merge_patch(current, patch)
            elif ctype == "application/apply-patch+yaml":
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "server-side apply is not implemented by the emulator",
                )
            else:
                raise status.unsupported_media_type(ctype)
            if not isinstance(patched, dict) or not isinstance(patched.get("metadata"), dict):
                raise status.unprocessable_patch()
            validation.check_structure(kind, patched, "Ignore")
            return self._store_update(kind, ns, name, patched, sub)

    def _delete(
        self,
        kind: Kind,
        ns: str,
        name: str,
        query: Any,
        body: bytes,
    ) -> dict[str, Any]:
        opts = self._body(body) or {}
        if not isinstance(opts, dict):
            raise status.bad_request("DeleteOptions must be an object")
        grace = opts.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
        policy = opts.get("propagationPolicy") or query.get("propagationPolicy")
        if policy is None and opts.get("orphanDependents") is not None:
            policy = "Orphan" if opts["orphanDependents"] else "Background"
        policy = policy or "Background"
        if policy not in ("Orphan", "Background", "Foreground"):
            raise status.bad_request(f"unsupported propagationPolicy {policy!r}")
        pre = opts.get("preconditions") or {}
        with self.store.lock:
            current = self.store.require(kind, ns, name)
            meta = current["metadata"]
            for field_name, key in (("UID", "uid"), ("ResourceVersion", "resourceVersion")):
                if pre.get(key) and pre[key] != meta[key]:
                    raise status.conflict(
                        kind.group,
                        kind.plural,
                        name,
                        (
                            f"Precondition failed: {field_name} in precondition: {pre[key]}, "
                            f"{field_name} in object meta: {meta[key]}"
                        ),
                    )
            if policy == "Orphan":
                self._orphan_dependents(meta["uid"])
            if kind == PODS:
                grace_s = (
                    int(grace)
                    if grace is not None
                    else int(current["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
                )
                phase = (current.get("status") or {}).get("phase")
                # pod strategy CheckGracefulDelete: unscheduled or finished pods go at once.
                if not current["spec"].get("nodeName") or phase in ("Succeeded", "Failed"):
                    grace_s = 0
            else:
                grace_s = 0
            if kind == NAMESPACES:
                return self._terminate_namespace(current)
            finalizers = list(meta.get("finalizers") or [])
            if policy == "Foreground" and "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
            if grace_s == 0 and not finalizers:
                return self.store.remove(kind, ns, name)
            if finalizers != list(meta.get("finalizers") or []):
                meta["finalizers"] = finalizers
                current = self.store.update(kind, current)
            previous = meta.get("deletionGracePeriodSeconds")
            if previous is None or grace_s < previous:
                current = self.store.mark_deleting(kind, ns, name, grace_s)
            return current

    def _terminate_namespace(self, ns_obj: dict[str, Any]) -> dict[str, Any]:
        """A namespace goes Terminating; the namespace controller (here: the GC sweep)
        deletes its contents, then the namespace (pkg/controller/namespace)."""
        meta = ns_obj["metadata"]
        if meta.get("deletionTimestamp"):
            return ns_obj
        ns_obj["status"] = {"phase": "Terminating"}
        self.store.update(NAMESPACES, ns_obj)
        return self.store.mark_deleting(NAMESPACES, "", meta["name"], 0)

    def _sweep_namespaces(self) -> None:
        for ns_obj in self.store.objects(NAMESPACES):
            meta = ns_obj["metadata"]
            if not meta.get("deletionTimestamp"):
                continue
            left = 0
            for kind in KINDS:
                if not kind.namespaced:
                    continue
                items, _ = self.store.list(kind, meta["name"])
                left += len(items)
                for item in items:
                    if not item["metadata"].get("deletionTimestamp"):
                        with contextlib.suppress(ApiError):
                            self._delete(kind, meta["name"], item["metadata"]["name"], {}, b"")
            if left == 0:
                with contextlib.suppress(ApiError):
                    self.store.remove(NAMESPACES, "", meta["name"])

    def _maybe_finish_deletion(
        self, kind: Kind, ns: str, name: str, obj: dict[str, Any]
    ) -> dict[str, Any]:
        """A deleting object goes once its finalizers are gone (and, for a pod on a node,
        once the kubelet has confirmed with a zero grace period)."""
        meta = obj["metadata"]
        if not meta.get("deletionTimestamp") or meta.get("finalizers"):
            return obj
        if (
            kind == PODS
            and obj["spec"].get("nodeName")
            and meta.get("deletionGracePeriodSeconds") not in (0, None)
            and (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        ):
            return obj
        return self.store.remove(kind, ns, name)

    def _delete_collection(
        self, kind: Kind, ns: str | None, query: Any, body: bytes
    ) -> dict[str, Any]:
        items, _ = self.store.list(kind, ns, self._matcher(kind, query))
        deleted = []
        for item in items:
            with contextlib.suppress(ApiError):
                deleted.append(
                    self._delete(
                        kind,
                        item["metadata"].get("namespace", ""),
                        item["metadata"]["name"],
                        query,
                        body,
                    )
                )
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": str(self.store.revision)},
            "items": deleted,
        }

    def _bind(self, ns: str, name: str, binding: Any) -> dict[str, Any]:
        """pods/binding (what a scheduler posts): sets spec.nodeName once."""
        node = ((binding or {}).get("target") or {}).get("name")
        if not node:
            raise status.invalid(
                "", "Binding", name, [("FieldValueRequired", "target.name", "Required value")]
            )
        with self.store.lock:
            pod = self.store.require(PODS, ns, name)
            if pod["metadata"].get("deletionTimestamp"):
                raise status.conflict(
                    "", "pods", name, "pod is being deleted, cannot be assigned to a host"
                )
            if pod["spec"].get("nodeName"):
                raise status.conflict(
                    "",
                    "pods/binding",
                    name,
                    (f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"'),
                )
            pod["spec"]["nodeName"] = node
            self.store.update(PODS, pod)
        return status.success(code=201)

    # -- garbage collection ---------------------------------------------------------------
    def _orphan_dependents(self, uid: str) -> None:
        for kind in KINDS:
            for obj in self.store.objects(kind):
                refs = obj["metadata"].get("ownerReferences") or []
                if any(r.get("uid") == uid for r in refs):
                    obj["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                    self.store.update(kind, obj)

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(GC_INTERVAL_S)
            try:
                self.collect_garbage()
            except Exception as exc:
                self.internal_errors.append("".join(traceback.format_exception(exc)))
                logger.exception("garbage collector failed")

    def collect_garbage(self) -> None:
        """One sweep of the garbage collector (garbagecollector.go attemptToDeleteItem): a
        dependent all of whose owners are gone is deleted (background), one with some owners
        left loses the dangling references; dependents of an owner in foreground deletion
        are deleted, and the owner goes when none is left."""
        with self.store.lock:
            self._sweep_namespaces()
            everything = [(kind, obj) for kind in KINDS for obj in self.store.objects(kind)]
            live = {obj["metadata"]["uid"]: obj for _, obj in everything}
            foreground = {
                uid
                for uid, obj in live.items()
                if "foregroundDeletion" in (obj["metadata"].get("finalizers") or [])
            }
            for kind, obj in everything:
                meta = obj["metadata"]
                refs = meta.get("ownerReferences") or []
                if not refs:
                    continue
                solid = [r for r in refs if r.get("uid") in live and r.get("uid") not in foreground]
                ns = meta.get("namespace", "")
                if solid and len(solid) < len(refs) and not (owner_uids(obj) & foreground):
                    meta["ownerReferences"] = solid
                    with contextlib.suppress(ApiError):
                        self.store.update(kind, obj)
                elif not solid and not meta.get("deletionTimestamp"):
                    with contextlib.suppress(ApiError):
                        self._delete(kind, ns, meta["name"], {}, b"")
            for uid in foreground:
                if not any(
                    uid in owner_uids(o) for _, o in everything if o["metadata"]["uid"] in live
                ):
                    owner = live[uid]
                    kind = next(k for k in KINDS if k.kind == owner["kind"])
                    owner["metadata"]["finalizers"] = [
                        f for f in owner["metadata"]["finalizers"] if f != "foregroundDeletion"
                    ]
                    with contextlib.suppress(ApiError):
                        self._store_update(
                            kind,
                            owner["metadata"].get("namespace", ""),
                            owner["metadata"]["name"],
                            owner,
                            None,
                        )

    # -- watch ----------------------------------------------------------------------------
    async def _watch(
        self, raw: aiohttp.web.BaseRequest, kind: Kind, ns: str | None, name: str | None
    ) -> aiohttp.web.StreamResponse:
        query = raw.query
        matches = self._matcher(kind, query, name)  # a bad selector is a plain 400
        timeout_s = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        loop = asyncio.get_running_loop()
        resp = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await resp.prepare(raw)
        try:
            watcher = self.store.watch(kind, ns, matches, loop, query.get("resourceVersion"))
        except ApiError as exc:
            # Past parsing, the server reports errors as one ERROR event on a 200 stream.
            await resp.write(json.dumps({"type": "ERROR", "object": exc.body()}).encode() + b"\n")
            await resp.write_eof()
            return resp
        deadline = None if timeout_s is None else loop.time() + timeout_s
        try:
            while True:
                wait_s = DISCONNECT_POLL_S
                if deadline is not None:
                    wait_s = min(wait_s, deadline - loop.time())
                    if wait_s <= 0:
                        break
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), wait_s)
                except TimeoutError:
                    if raw.transport is None or raw.transport.is_closing():
                        break
                    continue
                if item is None:
                    break
                await resp.write(json.dumps(item).encode() + b"\n")
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            return resp
        finally:
            self.store.unwatch(watcher)
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
            await resp.write_eof()
        return resp

    # -- exec and logs --------------------------------------------------------------------
    def _node_of(self, ns: str, name: str) -> tuple[dict[str, Any], NodeBackend]:
        pod = self.store.require(PODS, ns, name)
        node = pod["spec"].get("nodeName")
        if not node:
            raise status.bad_request(f"pod {name} does not have a host assigned")
        backend = self.nodes.get(node)
        if backend is None:
            raise ApiError(
                500,
                "InternalError",
                f"Internal error occurred: error dialing backend: no kubelet for node {node}",
            )
        return pod, backend

    @staticmethod
    def _container_of(pod: dict[str, Any], wanted: str | None) -> str:
        names = [c["name"] for c in pod["spec"]["containers"]]
        name = pod["metadata"]["name"]
        if not wanted:
            if len(names) != 1:
                raise status.bad_request(
                    f"a container name must be specified for pod {name}, choose one of: {names}"
                )
            return names[0]
        if wanted not in names:
            raise status.bad_request(f"container {wanted} is not valid for pod {name}")
        return wanted

    async def _exec(
        self, raw: aiohttp.web.BaseRequest, ns: str, name: str
    ) -> aiohttp.web.StreamResponse:
        """pods/exec: checks as in pkg/registry/core/pod/strategy.go ExecLocation, then the
        channel protocol of apimachinery/pkg/util/httpstream/wsstream (v4: JSON status on
        channel 3; v5 adds the client's CLOSE frame [255, channel] to end stdin)."""
        query = raw.query
        command = query.getall("command", [])
        if not command:
            raise status.bad_request("you must specify at least one command for the container")
        stdin, stdout, stderr, tty = (_flag(query, k) for k in ("stdin", "stdout", "stderr", "tty"))
        if not (stdin or stdout or stderr):
            raise status.bad_request("you must specify at least 1 of stdin, stdout, stderr")
        pod, backend = self._node_of(ns, name)
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            raise status.bad_request(
                f"cannot exec into a container in a completed pod; current phase is {phase}"
            )
        container = self._container_of(pod, query.get("container"))
        offered = [p.strip() for p in raw.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        if not any(p in (V5_PROTOCOL, V4_PROTOCOL) for p in offered):
            raise status.bad_request(
                f"requested protocol(s) are not supported: {offered}; "
                f"supports {[V5_PROTOCOL, V4_PROTOCOL]}"
            )
        ws = aiohttp.web.WebSocketResponse(protocols=(V5_PROTOCOL, V4_PROTOCOL), max_msg_size=0)
        await ws.prepare(raw)
        task = asyncio.current_task()
        if task is not None:
            self.open_execs.add(task)
        try:
            await self._relay(ws, backend, pod, container, command, stdin=stdin, tty=tty)
        finally:
            if task is not None:
                self.open_execs.discard(task)
        return ws

    async def _relay(
        self,
        ws: aiohttp.web.WebSocketResponse,
        backend: NodeBackend,
        pod: dict[str, Any],
        container: str,
        command: list[str],
        *,
        stdin: bool,
        tty: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            session = await asyncio.to_thread(
                backend.start_exec, pod, container, command, stdin=stdin, tty=tty
            )
        except Exception as exc:
            err = ApiError(
                500,
                "InternalError",
                f"Internal error occurred: error executing command in container: {exc}",
                {"causes": [{"message": str(exc)}]},
            )
            await ws.send_bytes(bytes([ERROR]) + json.dumps(err.body()).encode())
            await ws.close()
            return
        output: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        to_stdin: queue.Queue[bytes | None] = queue.Queue()

        def pump_out() -> None:
            try:
                while (chunk := session.read()) is not None:
                    loop.call_soon_threadsafe(output.put_nowait, ("data", chunk))
                loop.call_soon_threadsafe(
                    output.put_nowait, ("exit", (session.exit_code(), session.error()))
                )
            except Exception as exc:
                loop.call_soon_threadsafe(output.put_nowait, ("exit", (None, str(exc))))

        def pump_in() -> None:
            with contextlib.suppress(Exception):
                while (data := to_stdin.get()) is not None:
                    if data == b"":
                        session.close_stdin()
                    else:
                        session.write_stdin(data)

        threading.Thread(target=pump_out, name="exec-out", daemon=True).start()
        if stdin:
            threading.Thread(target=pump_in, name="exec-in", daemon=True).start()

        async def client_side() -> None:
            async for msg in ws:
                if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    continue
                data = msg.data.encode() if isinstance(msg.data, str) else msg.data
                if not data:
                    continue
                channel, payload = data[0], data[1:]
                if channel == STDIN and stdin and payload:
                    to_stdin.put(payload)
                elif (
                    channel == CLOSE
                    and ws.ws_protocol == V5_PROTOCOL
                    and payload[:1] == bytes([STDIN])
                    and stdin
                ):
                    to_stdin.put(b"")  # stdin EOF
                elif channel == RESIZE and tty:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        size = json.loads(payload)
                        await asyncio.to_thread(
                            session.resize, int(size["Width"]), int(size["Height"])
                        )

        reader = asyncio.create_task(client_side())
        try:
            while True:
                getter = asyncio.ensure_future(output.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    # The client closed first: a kubelet leaves the process running.
                    session.detach()
                    return
                kind_, value = getter.result()
                if kind_ == "data":
                    channel, data = value
                    await ws.send_bytes(bytes([channel]) + data)
                    continue
                code, error = value
                with self.hooks_lock:
                    drop = self.exec_status_drops > 0
                    if drop:
                        self.exec_status_drops -= 1
                if not drop:
                    await ws.send_bytes(
                        bytes([ERROR])
                        + json.dumps(self._exec_status(code, error, command)).encode()
                    )
                await ws.close()
                return
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            session.detach()
        finally:
            to_stdin.put(None)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    @staticmethod
    def _exec_status(code: int | None, error: str | None, command: list[str]) -> dict[str, Any]:
        """kubelet/cri/streaming/remotecommand/exec.go ServeExec."""
        if error is not None or code is None:
            why = error or "the exit status could not be read"
            return ApiError(
                500,
                "InternalError",
                f"Internal error occurred: error executing command in container: {why}",
                {"causes": [{"message": why}]},
            ).body()
        if code == 0:
            return {"metadata": {}, "status": "Success"}
        return {
            "metadata": {},
            "status": "Failure",
            "message": f"command terminated with non-zero exit code: error executing command "
            f"[{' '.join(command)}], exit code {code}",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
        }

    async def _log(self, ns: str, name: str, query: Any) -> aiohttp.web.StreamResponse:
        pod, backend = self._node_of(ns, name)
        container = self._container_of(pod, query.get("container"))
        data = await asyncio.to_thread(backend.logs, pod, container)
        return aiohttp.web.Response(body=data, content_type="text/plain")


# -- running it ---------------------------------------------------------------------------
class EmulatorThread:
    """The API server on 127.0.0.1 (a free port) in a thread with its own event loop."""

    START_TIMEOUT_S = 30.0  # aiohttp binds in milliseconds; a stuck start must not hang a test
    STOP_TIMEOUT_S = 10.0

    def __init__(self, **options: Any) -> None:
        self.api = ApiServer(**options)
        self.url = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(self.START_TIMEOUT_S) or self._failure is not None:
            raise RuntimeError(f"the emulated API server did not start: {self._failure}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self.STOP_TIMEOUT_S)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._failure = exc
            self._ready.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with self.api, kmock.Server(self.api, host="127.0.0.1") as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def iter_requests(self) -> Iterator[Any]:
        return iter(list(self.api.requests))


@dataclass
class Kubeconfig:
    path: str
    context: str
    namespace: str
    token: str
    server: str
    extra: dict[str, Any] = field(default_factory=dict)


def write_kubeconfig(
    path: str, server: str, *, context: str, namespace: str, token: str
) -> Kubeconfig:
    """A kubeconfig for the emulator, as a driver reads one for a real cluster."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": context,
        "preferences": {},
        "clusters": [{"name": f"{context}-cluster", "cluster": {"server": server}}],
        "users": [{"name": f"{context}-user", "user": {"token": token}}],
        "contexts": [
            {
                "name": context,
                "context": {
                    "cluster": f"{context}-cluster",
                    "user": f"{context}-user",
                    "namespace": namespace,
                },
            }
        ],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)  # JSON is YAML: any kubeconfig loader reads it
    return Kubeconfig(path, context, namespace, token, server)


def deep(obj: Any) -> Any:
    return copy.deepcopy(obj)
