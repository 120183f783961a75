"""JSON merge patch (RFC 7386) and JSON patch (RFC 6902), as the API server applies them.

The server applies a patch to the stored object's JSON, resourceVersion included
(endpoints/handlers/patch.go ``applyJSPatch``), then stores the result as an update: a patch
that sets ``metadata.resourceVersion`` to a stale value therefore fails with 409 Conflict,
while a failed ``test`` op fails with 422 before any write.

Strategic merge patch is applied as a merge patch here: the difference is in lists with a
merge key (``containers`` by ``name``), which a strategic patch merges and a merge patch
replaces. A driver that relies on that difference is not covered by this emulator.
"""

from __future__ import annotations

import copy
from typing import Any


class PatchError(Exception):
    """The patch does not apply (the server answers 422)."""


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _tokens(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"invalid JSON pointer {pointer!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _parent(doc: Any, tokens: list[str]) -> Any:
    cur = doc
    for tok in tokens[:-1]:
        if isinstance(cur, dict):
            if tok not in cur:
                raise PatchError(f"missing path element {tok!r}")
            cur = cur[tok]
        elif isinstance(cur, list):
            cur = cur[_index(cur, tok)]
        else:
            raise PatchError(f"cannot descend into {tok!r}")
    return cur


def _index(lst: list[Any], tok: str, *, allow_end: bool = False) -> int:
    if tok == "-" and allow_end:
        return len(lst)
    if not tok.isdigit():
        raise PatchError(f"invalid array index {tok!r}")
    i = int(tok)
    if i > len(lst) or (i == len(lst) and not allow_end):
        raise PatchError(f"array index {i} out of bounds")
    return i


def _get(doc: Any, pointer: str) -> Any:
    tokens = _tokens(pointer)
    if not tokens:
        return doc
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {pointer!r} does not exist")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last)]
    raise PatchError(f"path {pointer!r} does not exist")


def _remove(doc: Any, pointer: str) -> Any:
    tokens = _tokens(pointer)
    if not tokens:
        raise PatchError("cannot remove the root")
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {pointer!r} does not exist")
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last))
    raise PatchError(f"path {pointer!r} does not exist")


def _add(doc: Any, pointer: str, value: Any) -> Any:
    tokens = _tokens(pointer)
    if not tokens:
        return copy.deepcopy(value)
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), copy.deepcopy(value))
    else:
        raise PatchError(f"cannot add at {pointer!r}")
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """Apply RFC 6902 ``ops`` to a deep copy of ``doc``; all or nothing."""
    if not isinstance(ops, list):
        raise TypeError("a JSON patch is a list of operations")
    out = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise TypeError(f"malformed JSON patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind == "test":
            if _get(out, path) != op.get("value"):
                raise PatchError(f"testing value {path} failed: test failed")
        elif kind == "add":
            out = _add(out, path, op.get("value"))
        elif kind == "remove":
            _remove(out, path)
        elif kind == "replace":
            _get(out, path)  # must exist (RFC 6902 section 4.3)
            _remove(out, path)
            out = _add(out, path, op.get("value"))
        elif kind == "move":
            value = _remove(out, op["from"])
            out = _add(out, path, value)
        elif kind == "copy":
            out = _add(out, path, _get(out, op["from"]))
        else:
            raise TypeError(f"unknown JSON patch operation {kind!r}")
    return out
