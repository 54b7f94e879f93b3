"""The patch formats kube-apiserver accepts, applied to plain JSON documents.

- JSON merge patch (RFC 7386): ``application/merge-patch+json``.
- JSON patch (RFC 6902): ``application/json-patch+json``.
- Strategic merge patch, simplified: a merge patch whose lists of objects merge by a
  well-known key (``name``, ``containerPort``...) and whose ``$`` directives are
  honoured where simple (``$patch: delete|replace``, ``$deleteFromPrimitiveList``)
  and dropped otherwise. Real kube reads merge keys from Go struct tags; we guess, so
  that ``kubectl apply`` (client-side) does not wipe sibling list entries.

All functions are pure and return new documents. Malformed patches raise PatchError.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["PatchError", "PatchTestFailed", "merge_patch", "json_patch", "strategic_merge_patch"]

_MISSING = object()
# Merge keys of the list fields kubectl most often patches (containers, ports, env...).
_MERGE_KEYS = ("name", "containerPort", "mountPath", "devicePath", "type", "ip", "port")


class PatchError(ValueError):
    """The patch cannot be applied (bad syntax, failed ``test``, missing path)."""


class PatchTestFailed(PatchError):
    """A JSON patch ``test`` operation did not hold (kube answers it with a bare 422)."""


# --- RFC 7386 ---------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --- RFC 6902 ---------------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _index(container: list, token: str, *, for_insert: bool) -> int:
    if token == "-" and for_insert:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token[0] == "0"):
        raise PatchError(f"invalid array index {token!r}")
    i = int(token)
    if i > len(container) or (i == len(container) and not for_insert):
        raise PatchError(f"array index {i} out of bounds")
    return i


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, for_insert=False)]
        else:
            raise PatchError(f"path segment {token!r} not found")
    return node


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {path!r} not found")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, for_insert=False)]
    raise PatchError(f"path {path!r} not found")


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, for_insert=True), value)
    else:
        raise PatchError(f"cannot add at {path!r}")
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    """Remove and return (document, removed value)."""
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent, last = _parent(doc, tokens), tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {path!r} not found")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, for_insert=False))
    raise PatchError(f"path {path!r} not found")


def _operation(doc: Any, op: dict) -> Any:
    kind, path = op.get("op"), op.get("path")
    if not isinstance(path, str):
        raise PatchError(f"operation {kind!r} needs a string 'path'")
    if kind in ("add", "replace", "test") and "value" not in op:
        raise PatchError(f"operation {kind!r} needs a 'value'")
    if kind == "add":
        return _add(doc, path, copy.deepcopy(op["value"]))
    if kind == "remove":
        return _remove(doc, path)[0]
    if kind == "replace":
        _get(doc, path)  # must exist
        doc = _remove(doc, path)[0] if _pointer(path) else doc
        return _add(doc, path, copy.deepcopy(op["value"]))
    if kind == "test":
        if _get(doc, path) != op["value"]:
            raise PatchTestFailed(f"test failed at {path!r}")
        return doc
    if kind in ("move", "copy"):
        source = op.get("from")
        if not isinstance(source, str):
            raise PatchError(f"operation {kind!r} needs a string 'from'")
        if kind == "move":
            if path.startswith(source + "/"):
                raise PatchError("cannot move a value into its own child")
            doc, value = _remove(doc, source)
        else:
            value = copy.deepcopy(_get(doc, source))
        return _add(doc, path, value)
    raise PatchError(f"unknown JSON patch operation {kind!r}")


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902: apply the operations in order; any failure aborts the whole patch."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    result = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict):
            raise PatchError("each JSON patch operation must be an object")
        result = _operation(result, op)
    return result


# --- strategic merge (simplified) -----------------------------------------------------


def _merge_key(original: list, patch: list) -> str | None:
    items = original + patch
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    return next((k for k in _MERGE_KEYS if all(k in i for i in items)), None)


def _merge_list(original: Any, patch: list) -> list:
    base = original if isinstance(original, list) else []
    key = _merge_key(base, patch)
    if key is None:
        return [_strip(v) for v in patch]
    result = [copy.deepcopy(i) for i in base]
    for item in patch:
        at = next((n for n, i in enumerate(result) if i[key] == item[key]), None)
        if item.get("$patch") == "delete":
            if at is not None:
                result.pop(at)
        elif at is None:
            result.append(_strip(item))
        else:
            result[at] = strategic_merge_patch(result[at], item)
    return result


def _strip(value: Any) -> Any:
    """Drop ``$`` directives from a value that is inserted as-is."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _delete_from_lists(result: dict, patch: dict) -> None:
    prefix = "$deleteFromPrimitiveList/"
    for key, values in patch.items():
        if key.startswith(prefix) and isinstance(values, list):
            field = key[len(prefix):]
            if isinstance(result.get(field), list):
                result[field] = [v for v in result[field] if v not in values]


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Merge patch plus list merging by key and the simple ``$`` directives."""
    if not isinstance(patch, dict):
        return _strip(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace" or not isinstance(target, dict):
        return _strip(patch)
    result = copy.deepcopy(target)
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value)
        else:
            merged = strategic_merge_patch(result.get(key, _MISSING), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    _delete_from_lists(result, patch)
    return result
