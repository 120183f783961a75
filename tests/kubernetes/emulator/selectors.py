"""Label and field selectors as the API server parses them.

Label selectors follow k8s.io/apimachinery/pkg/labels/selector.go: comma-separated
requirements, each ``key``, ``!key``, ``key=v``, ``key==v``, ``key!=v``, ``key in (a,b)``,
``key notin (a,b)``, ``key>n``, ``key<n``; ``!=`` and ``notin`` also match objects without the
key. Field selectors (k8s.io/apimachinery/pkg/fields/selector.go) take ``=``, ``==``, ``!=``
on the fields a resource registers; any other field is a 400 "field label not supported"
(pkg/registry/core/pod/strategy.go and pkg/apis/core/v1/conversion.go list the pod fields).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from .status import bad_request

Matcher = Callable[[Mapping[str, Any]], bool]

_SET_RE = re.compile(r"^\s*(!?[^\s!=<>]+)\s+(in|notin)\s+\((.*)\)\s*$")
_OP_RE = re.compile(r"^\s*([^\s!=<>]+)\s*(==|!=|=|<|>)\s*(.*?)\s*$")
_EXISTS_RE = re.compile(r"^\s*(!?)\s*([^\s!=<>(),]+)\s*$")


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts: list[str] = []
    depth = 0
    cur = ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p for p in parts if p.strip()]


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def label_selector(text: str | None) -> Matcher:
    """A predicate over objects; an empty selector matches everything."""
    if not text or not text.strip():
        return lambda _obj: True
    checks: list[Matcher] = []
    for part in _split_top(text):
        if m := _SET_RE.match(part):
            key, op, values_text = m.group(1), m.group(2), m.group(3)
            values = {v.strip() for v in values_text.split(",") if v.strip()}
            if op == "in":
                checks.append(lambda o, k=key, vs=values: _labels(o).get(k) in vs)
            else:
                checks.append(lambda o, k=key, vs=values: _labels(o).get(k) not in vs)
        elif m := _OP_RE.match(part):
            key, op, value = m.group(1), m.group(2), m.group(3)
            if op in ("=", "=="):
                checks.append(lambda o, k=key, v=value: _labels(o).get(k) == v)
            elif op == "!=":
                checks.append(lambda o, k=key, v=value: _labels(o).get(k) != v)
            else:
                try:
                    bound = int(value)
                except ValueError:
                    raise bad_request(
                        f"unable to parse requirement: for 'Gt', 'Lt' operators, the value "
                        f"must be an integer: {part.strip()}"
                    ) from None
                checks.append(_compare(key, op, bound))
        elif m := _EXISTS_RE.match(part):
            negate, key = m.group(1) == "!", m.group(2)
            checks.append(lambda o, k=key, n=negate: (k in _labels(o)) != n)
        else:
            raise bad_request(f"unable to parse requirement: {part.strip()!r}")
    return lambda obj: all(check(obj) for check in checks)


def _compare(key: str, op: str, bound: int) -> Matcher:
    def check(obj: Mapping[str, Any]) -> bool:
        raw = _labels(obj).get(key)
        if raw is None:
            return False
        try:
            value = int(raw)
        except ValueError:
            return False
        return value > bound if op == ">" else value < bound

    return check


def _dig(obj: Mapping[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, Mapping) else None
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return "" if cur is None else str(cur)


# The fields each resource registers for selection; metadata.name/namespace are universal.
POD_FIELDS = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.podIPs",
        "status.nominatedNodeName",
    }
)
GENERIC_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


def field_selector(text: str | None, supported: frozenset[str] = GENERIC_FIELDS) -> Matcher:
    if not text or not text.strip():
        return lambda _obj: True
    checks: list[Matcher] = []
    for part in _split_top(text):
        m = _OP_RE.match(part)
        if m is None or m.group(2) in ("<", ">"):
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part.strip()}'")
        path, op, value = m.group(1), m.group(2), m.group(3)
        if path not in supported:
            raise bad_request(f"field label not supported: {path}")
        if op == "!=":
            checks.append(lambda o, p=path, v=value: _dig(o, p) != v)
        else:
            checks.append(lambda o, p=path, v=value: _dig(o, p) == v)
    return lambda obj: all(check(obj) for check in checks)
