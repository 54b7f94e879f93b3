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

A group/version the backend serves while a reachable peer serves more of it (1.35
and 1.36 both serve ``admissionregistration.k8s.io/v1``; only 1.36 has
MutatingAdmissionPolicies in it) gets an index entry without the backend's ``hash``,
and its document (``routing.OPENAPI_MERGED``) is the backend's plus, from such a
peer's, the paths of what only peers serve and the schemas those paths need that the
backend lacks (:func:`merge_document`): ``kubectl explain`` then describes the peer's
resource, and the backend's own resources keep the backend's schemas. The hash is
left out because it names the backend's document (kube-apiserver serves a hashed URL
as immutable, and redirects a stale hash): a merged document changes when either
server's does.

Pure: the handler fetches and responds; this module only edits the documents.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from mvproxy.cache import CacheView
from mvproxy.routing import openapi_peers


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


def _group_version(key: str) -> tuple[str, str] | None:
    """``apis/<g>/<v>`` -> (g, v); ``api/<v>`` -> ("", v); anything else None."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "apis":
        return parts[1], parts[2]
    if len(parts) == 2 and parts[0] == "api":
        return "", parts[1]
    return None


def merged_entries(view: CacheView, present: Mapping[str, object]) -> dict[str, dict[str, str]]:
    """Entries of the index the backend serves whose document mvproxy completes from a
    peer (``routing.openapi_peers``): the same URL without the backend's ``hash``."""
    entries = {}
    for key in present:
        group_version = _group_version(key)
        if group_version is not None and openapi_peers(view, *group_version):
            entries[key] = {"serverRelativeURL": f"/openapi/v3/{key}"}
    return entries


def merge_index(body: bytes, view: CacheView) -> bytes | None:
    """The backend's index with the peer-only entries added and the entries of merged
    documents unhashed; None if it is not an index."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    paths = document.get("paths") if isinstance(document, dict) else None
    if not isinstance(paths, dict):
        return None
    extra = {**peer_only_entries(view, set(paths)), **merged_entries(view, paths)}
    if not extra:
        return body
    document["paths"] = {**paths, **extra}
    return json.dumps(document, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- documents

_REF_PREFIX = "#/components/schemas/"


def _refs(node: object) -> Iterator[str]:
    """Every schema name ``node`` refers to (``$ref``), at any depth."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith(_REF_PREFIX):
                yield ref[len(_REF_PREFIX):]
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _resource_of(path: str, prefix: str) -> tuple[str, str] | None:
    """(resource, subresource or "") a path of the group/version ``prefix`` is about:
    ``<prefix>/[watch/][namespaces/{namespace}/]<resource>[/{name}[/<sub>]]``."""
    if not path.startswith(prefix + "/"):
        return None
    segments = [s for s in path[len(prefix) + 1:].split("/") if s]
    if segments[:1] == ["watch"]:
        segments = segments[1:]
    if len(segments) > 2 and segments[0] == "namespaces" and segments[1] == "{namespace}":
        segments = segments[2:]
    if not segments:
        return None
    return segments[0], segments[2] if len(segments) > 2 else ""


def merge_document(backend: bytes, peer: bytes, group: str, version: str,
                   peer_only: set[tuple[str, str]]) -> bytes | None:
    """The backend's OpenAPI v3 document of ``group``/``version`` plus, from the peer's,
    every path about a resource or subresource of ``peer_only`` ((resource, "") or
    (resource, subresource)) that the backend lacks, and every schema those paths
    refer to (transitively) that the backend lacks; the backend's own paths and
    schemas are kept as they are. None if either is not such a document."""
    try:
        own, theirs = json.loads(backend), json.loads(peer)
    except ValueError:
        return None
    documents = (own, theirs)
    if not all(isinstance(d, dict) and isinstance(d.get("paths"), dict) for d in documents):
        return None
    own_schemas = (own.get("components") or {}).get("schemas")
    their_schemas = (theirs.get("components") or {}).get("schemas")
    if not isinstance(own_schemas, dict) or not isinstance(their_schemas, dict):
        return None
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    added_paths = {}
    for path, item in theirs["paths"].items():
        about = _resource_of(path, prefix)
        if path in own["paths"] or about is None:
            continue
        if (about[0], "") in peer_only or about in peer_only:
            added_paths[path] = item
    if not added_paths:
        return backend
    added_schemas: dict[str, object] = {}
    wanted = list(_refs(added_paths))
    while wanted:
        name = wanted.pop()
        if name in own_schemas or name in added_schemas or name not in their_schemas:
            continue
        added_schemas[name] = their_schemas[name]
        wanted.extend(_refs(their_schemas[name]))
    own["paths"] = {**own["paths"], **added_paths}
    own["components"]["schemas"] = {**own_schemas, **added_schemas}
    return json.dumps(own, separators=(",", ":"), ensure_ascii=False).encode()
