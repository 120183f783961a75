"""The ``Status`` bodies the real API server answers with, one builder per error.

Each builder mirrors a constructor of k8s.io/apimachinery/pkg/api/errors/errors.go
(kubernetes/kubernetes, staging/src/k8s.io/apimachinery/pkg/api/errors/errors.go): the same
code, ``reason``, ``details`` and message format, so a client that parses the message or
``reason`` (the official client's ``ApiException.body``) sees what a cluster sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OPTIMISTIC_LOCK_MSG = (
    # registry/generic/registry/store.go: OptimisticLockErrorMsg
    "the object has been modified; please apply your changes to the latest version and try again"
)


@dataclass
class ApiError(Exception):
    """An error answered as a ``Status`` (HTTP code = ``code``)."""

    code: int
    reason: str
    message: str
    details: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            out["details"] = {k: v for k, v in self.details.items() if v not in ("", None)}
        return out


def qualified(group: str, resource: str) -> str:
    """GroupResource.String(): ``pods`` for the core group, ``leases.coordination.k8s.io``."""
    return f"{resource}.{group}" if group else resource


def _details(group: str, resource: str, name: str) -> dict[str, Any]:
    return {"name": name, "group": group, "kind": resource}


def not_found(group: str, resource: str, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{qualified(group, resource)} "{name}" not found',
        _details(group, resource, name),
    )


def already_exists(group: str, resource: str, name: str) -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{qualified(group, resource)} "{name}" already exists',
        _details(group, resource, name),
    )


def conflict(group: str, resource: str, name: str, why: str = OPTIMISTIC_LOCK_MSG) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified(group, resource)} "{name}": {why}',
        _details(group, resource, name),
    )


def forbidden(group: str, resource: str, name: str, why: str) -> ApiError:
    """NewForbidden; admission.NewForbidden names the object (or its generateName, or
    "Unknown") even on a create (apiserver/pkg/admission/errors.go extractResourceName)."""
    return ApiError(
        403,
        "Forbidden",
        f'{qualified(group, resource)} "{name}" is forbidden: {why}',
        _details(group, resource, name),
    )


def invalid(group: str, kind: str, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """NewInvalid: 422 with one cause per field error ``(type, field, message)``."""
    group_kind = f"{kind}.{group}" if group else kind
    text = "; ".join(f"{fld}: {msg}" for _, fld, msg in causes)
    if len(causes) > 1:
        text = f"[{text}]"
    return ApiError(
        422,
        "Invalid",
        f'{group_kind} "{name}" is invalid: {text}',
        {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": t, "message": m, "field": f} for t, f, m in causes],
        },
    )


def unprocessable_patch() -> ApiError:
    """A JSON patch that does not apply (a failed ``test``, a missing path):
    endpoints/handlers/patch.go answers NewGenericServerResponse(422, ...), whose message
    for 422 is fixed and drops the server's own text."""
    return ApiError(
        422, "Invalid", "the server rejected our request due to an error in our request", {}
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def expired(message: str) -> ApiError:
    """NewResourceExpired: what a watch from a compacted resourceVersion gets (410)."""
    return ApiError(410, "Expired", message)


def method_not_allowed(group: str, resource: str, action: str) -> ApiError:
    return ApiError(
        405,
        "MethodNotAllowed",
        f'{action} is not supported on resources of kind "{qualified(group, resource)}"',
        {"group": group, "kind": resource},
    )


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: "
        "application/json-patch+json, application/merge-patch+json, "
        f"application/strategic-merge-patch+json (got {content_type!r})",
    )


def generic(code: int, message: str = "") -> ApiError:
    """NewGenericServerResponse for an injected fault: the reason its code maps to."""
    reasons = {
        400: "BadRequest",
        401: "Unauthorized",
        403: "Forbidden",
        404: "NotFound",
        405: "MethodNotAllowed",
        409: "Conflict",
        410: "Expired",
        422: "Invalid",
        429: "TooManyRequests",
        503: "ServiceUnavailable",
        504: "Timeout",
    }
    reason = reasons.get(code, "InternalError" if code >= 500 else "Unknown")
    return ApiError(code, reason, message or f"injected fault: HTTP {code}")


def success(details: dict[str, Any] | None = None, code: int = 200) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "code": code,
    }
    if details:
        out["details"] = details
    return out
