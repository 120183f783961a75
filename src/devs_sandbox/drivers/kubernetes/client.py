"""Reaching a cluster: the official client's configuration (kubeconfig, context, in-cluster
service account), its connection pool, plain-JSON requests, and errors translated where
they enter.

Why raw requests over the client's pool rather than the generated API methods: they
validate every body into pydantic models whose first use costs about a second (a one-shot
``devs-sandbox run`` would pay it on every call), and their model classes change between
releases. The pool, TLS settings, proxy and auth headers are the client's own; the bodies
are dicts, and creates ask the server for ``fieldValidation=Strict``, so a field it does
not know is an error rather than a hardening setting silently dropped.

Error mapping: a 403 naming a quota is ``CapacityError`` (at once, with the server's
reason: never a timeout); other 401/403 are an ``ApiError`` naming the RBAC to grant; a
server that cannot be reached is ``DriverUnavailableError``; any other answer >= 400 an
``ApiError`` (a ``DriverError``) with the HTTP status and the Status reason.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final
from urllib.parse import quote, urlencode

from devs_sandbox.config import KubernetesConfig
from devs_sandbox.drivers.kubernetes.manifest import ServerVersion, parse_server_version
from devs_sandbox.errors import (
    CapacityError,
    ConfigError,
    DevsSandboxError,
    DriverError,
    DriverUnavailableError,
)

INSTALL_HINT: Final = "pip install 'devs-sandbox[kubernetes]'"
IN_CLUSTER_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
RBAC_HINT: Final = "grant the driver's Role: see docs/deploy/kubernetes.md"
JSON_PATCH: Final = "application/json-patch+json"
MERGE_PATCH: Final = "application/merge-patch+json"
USER_AGENT: Final = "devs-sandbox"

PODS: Final = "/api/v1/namespaces/{ns}/pods"
POLICIES: Final = "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
LEASES: Final = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def kubernetes_sdk() -> ModuleType:
    """The ``kubernetes`` package, imported only when this driver is used."""
    try:
        return importlib.import_module("kubernetes")
    except ImportError as exc:
        raise DriverUnavailableError(
            "the kubernetes driver needs the kubernetes client, which is not installed: "
            + INSTALL_HINT
        ) from exc


class ApiError(DriverError):
    """An API request failed; ``status`` is the HTTP code, ``reason`` the Status reason
    (NotFound, AlreadyExists, Conflict, Invalid, Expired, ...)."""

    def __init__(self, message: str, *, status: int, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        # 409: a stale resourceVersion; 422: a failed JSON-patch ``test`` (another claimer).
        return self.status in (409, 422)


def error_for(status: int, body: bytes, what: str) -> DevsSandboxError:
    """The error an answer ``status`` with ``body`` (a Status, usually) stands for."""
    reason, message = "", ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        data = json.loads(body)
        reason, message = str(data.get("reason") or ""), str(data.get("message") or "")
    message = message or body[:300].decode("utf-8", "replace").strip() or f"HTTP {status}"
    if status == 403 and ("exceeded quota" in message or "failed quota" in message):
        return CapacityError(f"{what}: the cluster refused it: {message}", reason=message)
    if status in (401, 403):
        return ApiError(f"{what}: {message} ({RBAC_HINT})", status=status, reason=reason)
    return ApiError(f"{what}: {message}", status=status, reason=reason)


@dataclass
class Cluster:
    """One configured client and the namespace every object of ours lives in."""

    configuration: Any  # kubernetes.client.Configuration
    pool: Any  # its urllib3 PoolManager (TLS, proxy)
    namespace: str
    timeout_s: float
    context: str | None = None
    server: ServerVersion | None = None
    _keep: Any = None  # the ApiClient owning the pool

    @property
    def host(self) -> str:
        return str(self.configuration.host).rstrip("/")

    def path(self, template: str, name: str | None = None, sub: str | None = None) -> str:
        path = template.format(ns=quote(self.namespace, safe=""))
        if name is not None:
            path += "/" + quote(name, safe="")
        if sub is not None:
            path += "/" + sub
        return path

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if content_type:
            headers["Content-Type"] = content_type
        for setting in (self.configuration.auth_settings() or {}).values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[str(setting["key"])] = str(setting["value"])
        return headers

    def request(
        self,
        what: str,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One request; the decoded JSON answer, or our error (see the module docstring)."""
        url = self.host + path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        try:
            resp = self.pool.request(
                method,
                url,
                body=data,
                headers=self._headers(content_type if data is not None else None),
                timeout=self.timeout_s,
                preload_content=True,
            )
        except Exception as exc:
            raise DriverUnavailableError(
                f"{what}: the API server at {self.host} cannot be reached: {exc}"
            ) from exc
        if resp.status >= 400:
            raise error_for(resp.status, resp.data or b"", what)
        try:
            answer = json.loads(resp.data) if resp.data else {}
        except ValueError as exc:
            raise ApiError(f"{what}: the answer is not JSON", status=resp.status) from exc
        return answer if isinstance(answer, dict) else {}

    def watch(
        self, path: str, query: Mapping[str, Any], timeout_s: int
    ) -> tuple[Any, Iterator[dict[str, Any]]]:
        """Open a watch: (the response, which another thread may close; its events)."""
        params = {**query, "watch": "true", "timeoutSeconds": str(timeout_s)}
        url = f"{self.host}{path}?{urlencode(params)}"
        try:
            resp = self.pool.request(
                "GET",
                url,
                headers=self._headers(None),
                timeout=_timeout(self.timeout_s, timeout_s + self.timeout_s),
                preload_content=False,
            )
        except Exception as exc:
            raise DriverUnavailableError(f"watch: the API server cannot be reached: {exc}") from exc
        if resp.status >= 400:
            body = resp.read()
            resp.release_conn()
            raise error_for(resp.status, body, "watch")
        return resp, _events(resp)

    def server_version(self) -> ServerVersion | None:
        """The server's major.minor (None if it will not say); asked once."""
        if self.server is None:
            try:
                info = self.request("server version", "GET", "/version")
            except DevsSandboxError:
                return None
            self.server = parse_server_version(str(info.get("major")), str(info.get("minor")))
        return self.server

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pool.clear()


def _timeout(connect_s: float, read_s: float) -> Any:
    import urllib3  # noqa: PLC0415 - the client's own dependency

    return urllib3.Timeout(connect=connect_s, read=read_s)


def _events(resp: Any) -> Iterator[dict[str, Any]]:
    pending = b""
    try:
        for chunk in resp.stream(65_536, decode_content=True):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    event = json.loads(line)
                    if isinstance(event, dict):
                        yield event
    finally:
        with contextlib.suppress(Exception):
            resp.release_conn()


def connect(k: KubernetesConfig) -> Cluster:
    """A client for ``k``'s kubeconfig and context (or the pod's service account when we
    run in a cluster without a kubeconfig), and the namespace to use."""
    sdk = kubernetes_sdk()
    configuration = sdk.client.Configuration()
    explicit = str(Path(k.kubeconfig).expanduser()) if k.kubeconfig is not None else None
    candidates = [explicit] if explicit else (os.environ.get("KUBECONFIG") or "").split(":")
    has_file = any(p and Path(p).expanduser().is_file() for p in candidates) or (
        not explicit and Path("~/.kube/config").expanduser().is_file()
    )
    namespace = k.namespace
    try:
        if explicit and not Path(explicit).is_file():
            raise ConfigError(
                f"kubeconfig not found: {explicit}", key="sandbox.kubernetes.kubeconfig"
            )
        if has_file:
            sdk.config.load_kube_config(
                config_file=explicit,
                context=k.context,
                client_configuration=configuration,
                persist_config=False,
            )
            if namespace is None:
                namespace = _context_namespace(sdk, explicit, k.context)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            sdk.config.load_incluster_config(client_configuration=configuration)
            if namespace is None and IN_CLUSTER_NAMESPACE.is_file():
                namespace = IN_CLUSTER_NAMESPACE.read_text().strip() or None
        else:
            raise DriverUnavailableError(
                "no kubeconfig found ($KUBECONFIG, ~/.kube/config) and not running in a "
                "cluster: pass --kubeconfig or set sandbox.kubernetes.kubeconfig"
            )
    except sdk.config.ConfigException as exc:
        raise ConfigError(f"kubeconfig: {exc}", key="sandbox.kubernetes.kubeconfig") from exc
    api = sdk.client.ApiClient(configuration)
    pool = api.rest_client.pool_manager
    return Cluster(
        configuration, pool, namespace or "default", k.api_timeout_s, k.context, None, api
    )


def _context_namespace(sdk: ModuleType, path: str | None, context: str | None) -> str | None:
    try:
        contexts, active = sdk.config.list_kube_config_contexts(path)
    except Exception:
        return None
    if context is None:
        chosen = active
    else:
        chosen = next((c for c in contexts or [] if c.get("name") == context), None)
    ns = ((chosen or {}).get("context") or {}).get("namespace")
    return str(ns) if ns else None
