"""What the API server checks and fills in before it stores an object.

- Structure: the OpenAPI schemas shipped by ``kubernetes-validate`` (strict variant). An
  unknown field follows the request's ``fieldValidation`` like the server does
  (KEP-2885): ``Strict`` answers 400 "strict decoding error", ``Ignore`` drops it, and the
  default ``Warn`` drops it and returns a ``Warning: 299`` header (recorded by the emulator
  so tests can assert there was none). A wrong type is a 400 decoding error.
- Semantics the schema cannot express (pkg/apis/core/validation/validation.go): names and
  label values, resource names in requests/limits (``pids`` is not one), quantities
  ("2 GiB" is not one: a 400 from decoding), requests above limits, pod spec immutability.
- Defaults (pkg/apis/core/v1/defaults.go): restartPolicy, grace period, requests copied from
  limits, imagePullPolicy, and the pod's QoS class in its status.
"""

from __future__ import annotations

import copy
import functools
import re
from decimal import Decimal
from typing import Any

from . import status
from .store import PODS, Kind

SCHEMA_VERSION = "1.33"

_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_STANDARD_CONTAINER_RESOURCES = {"cpu", "memory", "ephemeral-storage"}
_QUANTITY_RE = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"  # resource.Quantity's error text


@functools.cache
def _validator(kind: Kind) -> Any:
    import jsonschema
    from kubernetes_validate import utils as kv
    from referencing import Registry, Resource

    versions = [v for v in kv.all_versions() if kv.major_minor(v) <= SCHEMA_VERSION]
    schema_dir = f"v{versions[-1]}-local-strict"
    group = kind.group.split(".")[0]
    api = f"{group}-{kind.version}" if kind.group else kind.version
    schema = kv.schema_contents(
        f"kubernetes-json-schema/{schema_dir}/{kind.kind.lower()}-{api}.json", SCHEMA_VERSION
    )
    defs = kv.schema_contents(
        f"kubernetes-json-schema/{schema_dir}/_definitions.json", SCHEMA_VERSION
    )
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def check_structure(kind: Kind, obj: dict[str, Any], field_validation: str) -> list[str]:
    """Validate ``obj`` in place against the schema; returns the warnings to send."""
    unknown: list[tuple[list[Any], str]] = []
    for error in _validator(kind).iter_errors(obj):
        if error.validator == "additionalProperties":
            allowed = set(error.schema.get("properties", {}))
            for extra in sorted(set(error.instance) - allowed):
                unknown.append((list(error.absolute_path), extra))
        elif error.validator == "required":
            missing = re.findall(r"'([^']+)' is a required property", error.message)
            fld = _path([*error.absolute_path, *missing])
            raise status.invalid(
                kind.group,
                kind.kind,
                _name(obj),
                [("FieldValueRequired", fld, f"{fld}: Required value")],
            )
        else:
            raise status.bad_request(
                f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
                f"{_path(error.absolute_path)}: {error.message}"
            )
    warnings = [f'unknown field "{_path([*parent, extra])}"' for parent, extra in unknown]
    if unknown and field_validation == "Strict":
        raise status.bad_request(
            f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
            f"strict decoding error: {', '.join(warnings)}"
        )
    for parent, extra in unknown:
        holder: Any = obj
        for part in parent:
            holder = holder[part]
        holder.pop(extra, None)
    return [] if field_validation == "Ignore" else warnings


def _name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("name") or meta.get("generateName") or "")


def check_metadata(kind: Kind, obj: dict[str, Any]) -> None:
    meta = obj.get("metadata") or {}
    causes: list[tuple[str, str, str]] = []
    name = meta.get("name")
    if name and (len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name)):
        causes.append(
            (
                "FieldValueInvalid",
                "metadata.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist '
                "of lower case alphanumeric characters, '-' or '.', and must start and "
                "end with an alphanumeric character",
            )
        )
    for key, value in (meta.get("labels") or {}).items():
        key_name = key.rsplit("/", 1)[-1]
        if not _QUALIFIED_NAME.match(key_name) or len(key_name) > 63:
            causes.append(
                (
                    "FieldValueInvalid",
                    "metadata.labels",
                    f'Invalid value: "{key}": name part must consist of alphanumeric '
                    "characters, '-', '_' or '.', and must start and end with an "
                    "alphanumeric character",
                )
            )
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append(
                (
                    "FieldValueInvalid",
                    "metadata.labels",
                    f'Invalid value: "{value}": a valid label must be an empty string '
                    "or consist of alphanumeric characters, '-', '_' or '.', and must "
                    "start and end with an alphanumeric character",
                )
            )
    if causes:
        raise status.invalid(kind.group, kind.kind, _name(obj), causes)


# -- quantities ---------------------------------------------------------------------------
def quantity(text: Any, kind: Kind = PODS) -> Decimal:
    """resource.Quantity parsing; a malformed one fails decoding (400), as on the server."""
    from kubernetes.utils.quantity import parse_quantity

    try:
        if not isinstance(text, (str, int, float)) or (
            isinstance(text, str) and not re.match(_QUANTITY_RE, text)
        ):
            raise ValueError(text)
        return Decimal(parse_quantity(text))
    except (ValueError, ArithmeticError):
        raise status.bad_request(
            f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
            f"quantities must match the regular expression '{_QUANTITY_RE}'"
        ) from None


def format_quantity(value: Decimal, resource: str) -> str:
    """Quantity.String() for the values quota messages print."""
    if resource.endswith("cpu"):
        milli = int(value * 1000)
        return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"
    n = int(value)
    for suffix, factor in (
        ("Ei", 1 << 60),
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ):
        if n and n % factor == 0:
            return f"{n // factor}{suffix}"
    return str(n)


# -- pods ---------------------------------------------------------------------------------
def _containers(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = [(f"spec.containers[{i}]", c) for i, c in enumerate(spec.get("containers") or [])]
    out += [
        (f"spec.initContainers[{i}]", c) for i, c in enumerate(spec.get("initContainers") or [])
    ]
    return out


def prepare_pod(pod: dict[str, Any]) -> None:
    """Validate and default a new pod in place (422/400 as the server would)."""
    spec = pod.setdefault("spec", {})
    name = _name(pod)
    causes: list[tuple[str, str, str]] = []
    if not spec.get("containers"):
        causes.append(("FieldValueRequired", "spec.containers", "Required value"))
    seen: set[str] = set()
    for where, c in _containers(spec):
        cname = c.get("name", "")
        if not _DNS1123_LABEL.match(cname or "") or len(cname) > 63:
            causes.append(("FieldValueInvalid", f"{where}.name", f'Invalid value: "{cname}"'))
        if cname in seen:
            causes.append(("FieldValueDuplicate", f"{where}.name", f'Duplicate value: "{cname}"'))
        seen.add(cname)
        if not c.get("image"):
            causes.append(("FieldValueRequired", f"{where}.image", "Required value"))
        res = c.setdefault("resources", {})
        for section in ("limits", "requests"):
            for rname in res.get(section) or {}:
                if not (
                    rname in _STANDARD_CONTAINER_RESOURCES
                    or rname.startswith("hugepages-")
                    or "/" in rname
                ):
                    causes.append(
                        (
                            "FieldValueInvalid",
                            f"{where}.resources.{section}[{rname}]",
                            f'Invalid value: "{rname}": must be a standard resource for containers',
                        )
                    )
        limits = {k: quantity(v) for k, v in (res.get("limits") or {}).items()}
        requests = {k: quantity(v) for k, v in (res.get("requests") or {}).items()}
        for rname, req in requests.items():
            if rname in limits and req > limits[rname]:
                causes.append(
                    (
                        "FieldValueInvalid",
                        f"{where}.resources.requests",
                        f'Invalid value: "{res["requests"][rname]}": must be less than or equal to '
                        f"{rname} limit of {res['limits'][rname]}",
                    )
                )
        # defaults.go SetDefaults_ResourceRequirements: requests default to limits.
        if res.get("limits"):
            reqs = res.setdefault("requests", {})
            for rname, value in res["limits"].items():
                reqs.setdefault(rname, value)
        image = str(c.get("image", ""))
        tag = image.rsplit("/", 1)[-1]
        c.setdefault(
            "imagePullPolicy",
            "Always" if ":" not in tag or tag.endswith(":latest") else "IfNotPresent",
        )
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
    if causes:
        raise status.invalid("", "Pod", name, causes)
    for key, value in (
        ("restartPolicy", "Always"),
        ("terminationGracePeriodSeconds", 30),
        ("dnsPolicy", "ClusterFirst"),
        ("schedulerName", "default-scheduler"),
        ("securityContext", {}),
        ("enableServiceLinks", True),
        ("priority", 0),
    ):
        spec.setdefault(key, value)
    pod["status"] = {"phase": "Pending", "qosClass": qos_class(spec)}


def qos_class(spec: dict[str, Any]) -> str:
    """pkg/apis/core/helper/qos: Guaranteed, Burstable or BestEffort."""
    any_set = False
    guaranteed = True
    for _, c in _containers(spec):
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        if limits or requests:
            any_set = True
        for rname in ("cpu", "memory"):
            if rname not in limits or quantity(requests.get(rname, limits[rname])) != quantity(
                limits[rname]
            ):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def check_pod_update(old: dict[str, Any], new: dict[str, Any]) -> None:
    """ValidatePodUpdate: only images, activeDeadlineSeconds (set or lowered) and added
    tolerations may change in a pod's spec."""
    old_spec, new_spec = copy.deepcopy(old.get("spec") or {}), copy.deepcopy(new.get("spec") or {})
    name = _name(old)
    old_deadline = old_spec.pop("activeDeadlineSeconds", None)
    new_deadline = new_spec.pop("activeDeadlineSeconds", None)
    if old_deadline is not None and (new_deadline is None or new_deadline > old_deadline):
        raise status.invalid(
            "",
            "Pod",
            name,
            [
                (
                    "FieldValueInvalid",
                    "spec.activeDeadlineSeconds",
                    f"Invalid value: {new_deadline}: must be less than or equal to previous value",
                )
            ],
        )
    for _, container in _containers(old_spec):
        container.pop("image", None)
    for _, container in _containers(new_spec):
        container.pop("image", None)
    old_tol = old_spec.pop("tolerations", None) or []
    new_tol = new_spec.pop("tolerations", None) or []
    if old_spec != new_spec or any(t not in new_tol for t in old_tol):
        raise status.invalid(
            "",
            "Pod",
            name,
            [
                (
                    "FieldValueForbidden",
                    "spec",
                    "Forbidden: pod updates may not change fields other than "
                    "`spec.containers[*].image`,`spec.initContainers[*].image`,"
                    "`spec.activeDeadlineSeconds`,`spec.tolerations` "
                    "(only additions to existing tolerations),"
                    "`spec.terminationGracePeriodSeconds` "
                    "(allow it to be set to 1 if it was previously negative)",
                )
            ],
        )


def pod_requests(pod: dict[str, Any]) -> dict[str, Decimal]:
    """The quota footprint of a pod: requests.* and limits.* summed over its containers."""
    total: dict[str, Decimal] = {"pods": Decimal(1)}
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        for section in ("requests", "limits"):
            for rname, value in (res.get(section) or {}).items():
                key = f"{section}.{rname}"
                total[key] = total.get(key, Decimal(0)) + quantity(value)
    return total
