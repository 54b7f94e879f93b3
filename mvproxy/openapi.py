"""``GET /openapi/v3``: the backend's OpenAPI index plus the group/versions only peers serve.

kubectl validates ``create -f`` / ``apply -f`` against OpenAPI v3: it reads the
index at ``/openapi/v3`` and then the document of the object's group/version. If
the index lacks a group/version that only a peer serves, kubectl fails with "the
server could not find the requested resource" before sending anything, so merged
discovery alone would not make ``kubectl apply`` work during an upgrade (upstream
has this gap too). mvproxy asks its backend for the index with the downstream's own
credentials (so authorization stays the backend's) and adds an entry for each
group/version a reachable peer serves; routing sends ``/openapi/v3/apis/<g>/<v>``
to that peer.

Pure: the handler fetches and responds; this module only edits the document.
"""

from __future__ import annotations

import json

from mvproxy.cache import CacheView


def _path_key(group: str, version: str) -> str:
    return f"api/{version}" if group == "" else f"apis/{group}/{version}"


def peer_only_entries(view: CacheView, present: set[str]) -> dict[str, dict[str, str]]:
    """Index entries for group/versions some reachable peer serves and the index lacks."""
    entries = {}
    for (group, version), peers in sorted(view.capable_gv.items()):
        key = _path_key(group, version)
        if key in present or not any(p in view.reachable for p in peers):
            continue
        entries[key] = {"serverRelativeURL": f"/openapi/v3/{key}"}
    return entries


def merge_index(body: bytes, view: CacheView) -> bytes | None:
    """The backend's index with the peer-only entries added; None if it is not an index."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    paths = document.get("paths") if isinstance(document, dict) else None
    if not isinstance(paths, dict):
        return None
    extra = peer_only_entries(view, set(paths))
    if not extra:
        return body
    document["paths"] = {**paths, **extra}
    return json.dumps(document, separators=(",", ":")).encode()
