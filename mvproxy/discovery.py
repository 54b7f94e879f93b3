"""Aggregated discovery: parse, index, merge, render, negotiate and ETag.

Pure: no I/O and no aiohttp import. The poller hands in the raw ``/api`` and
``/apis`` bodies of the backend and of every peer; this module turns each pair into a
:class:`Snapshot`, merges the snapshots into the one document downstream clients see,
renders it in the format they asked for and gives it an ETag. Documents stay plain
dicts as decoded from JSON (unknown fields survive a round trip); treat every dict
reachable from a ``Snapshot`` as read-only, because merged snapshots share them with
their inputs.

The merge is upstream's peer-aggregated discovery (kube-apiserver
``peer_aggregated_handler.go``) wherever upstream defines a behaviour:

* server IDs are visited in lexicographic order; the first one that has a group,
  version or resource provides its attributes (metadata, scope, kinds, ...);
* versions and resources are unioned, and their order is
  :func:`merge_preserving_relative_order` of the accumulated order and the next
  server's, one server at a time;
* two different copies of one resource get the sorted union of their verbs and the
  union of their subresources (by name, sorted; the later server's copy of a
  duplicate wins);
* groups keep the common order when every server lists the same group names,
  otherwise the consensus order of all servers' lists, in server-ID order.

Two deliberate differences:

* ``/api`` (the core group) is merged too, because a new core subresource such as
  ``pods/resize`` must be discoverable; upstream serves ``/api`` locally.
* Freshness is decided by reachability. Upstream copies it from the lowest server ID,
  so a peer's ``Stale`` can hide a reachable server's ``Current``. Here a version is
  ``Current`` when at least one reachable server lists it and does not itself call it
  ``Stale``; otherwise it is ``Stale``, which clients read as "failed to discover",
  not "gone".

Where upstream finds nothing to merge it returns the *local* server's groups as they
are; with no local server here, the lowest server ID's copy is used. The two differ
only in group metadata and freshness, which no client reads from a merged document
(and freshness is recomputed anyway).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

from .accept import parse_accept
from .errors import MvproxyError

__all__ = [
    "CURRENT",
    "STALE",
    "AGGREGATED_V2",
    "AGGREGATED_V2BETA1",
    "API_VERSION_V2",
    "API_VERSION_V2BETA1",
    "DiscoveryFormatError",
    "Negotiated",
    "PEER_ACCEPT",
    "Snapshot",
    "check_prefix",
    "etag",
    "group_name",
    "legacy_resources",
    "merge",
    "merge_resource_list",
    "merge_preserving_relative_order",
    "negotiate",
    "parse_aggregated",
    "peer_only_resources",
    "render_aggregated",
    "render_api_group",
    "render_api_group_list",
    "render_api_versions",
]

API_VERSION_V2 = "apidiscovery.k8s.io/v2"
API_VERSION_V2BETA1 = "apidiscovery.k8s.io/v2beta1"
#: Content-Type of an aggregated v2 document (``profile`` is never echoed).
AGGREGATED_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
#: Content-Type of an aggregated v2beta1 document (kubectl 1.27 asks only for this).
AGGREGATED_V2BETA1 = "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList"
#: Accept for fetching a server's own view: exactly what kube-apiserver sends its peers.
PEER_ACCEPT = f"{AGGREGATED_V2};profile=nopeer,{AGGREGATED_V2},application/json"

CURRENT = "Current"
STALE = "Stale"

_LIST_KIND = "APIGroupDiscoveryList"
_CONTENT_TYPES = {"v2": AGGREGATED_V2, "v2beta1": AGGREGATED_V2BETA1}
_API_VERSIONS = {"v2": API_VERSION_V2, "v2beta1": API_VERSION_V2BETA1}
_SHOWN_CHARS = 60


# --------------------------------------------------------------------------- parsing

class DiscoveryFormatError(MvproxyError, ValueError):
    """A discovery document is malformed; the message says what and where, never the body."""


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _shown(value: object) -> str:
    """A value from the document as JSON, cut short: never echo a whole body."""
    return _clip(json.dumps(value, ensure_ascii=False))


def _fail(where: str, what: str) -> NoReturn:
    raise DiscoveryFormatError(f"{where}: {what}")


def _reject_constant(name: str) -> NoReturn:
    # Python's json accepts NaN/Infinity; Go's does not, and we must not echo them.
    raise ValueError(f"{name} is not valid JSON")


def _load_json(body: bytes, max_bytes: int) -> object:
    # Size first: a hostile or broken upstream must not make us parse 1 GB.
    if len(body) > max_bytes:
        _fail("document", f"{len(body)} bytes is over the {max_bytes}-byte limit")
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        _fail("document", f"not JSON ({_clip(str(exc))})")


_KIND_NAMES: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}
_T = TypeVar("_T")


def _typed(value: object, kind: type[_T], where: str, what: str) -> _T:
    if not isinstance(value, kind):
        _fail(where, f"{what} must be {_KIND_NAMES[kind]}, got {_shown(value)}")
    return value


def _name(obj: dict, key: str, where: str) -> str:
    """A required, non-empty string key (a list-map key such as ``version``)."""
    value = _typed(obj.get(key), str, where, repr(key))
    if not value:
        _fail(where, f"{key!r} must not be empty")
    return value


def _optional_list(obj: dict, key: str, where: str) -> list:
    # Go's omitempty drops empty lists and may write nil ones as null.
    value = obj.get(key)
    return [] if value is None else _typed(value, list, where, repr(key))


def _verbs(obj: dict, where: str) -> None:
    if "verbs" not in obj:
        _fail(where, "missing 'verbs'")
    for verb in _optional_list(obj, "verbs", where):
        _typed(verb, str, where, "each verb")


def _unique(names: Iterable[str], where: str, what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            _fail(where, f"{what} {_shown(name)} is listed twice")
        seen.add(name)


def _check_subresource(value: object, where: str) -> str:
    sub = _typed(value, dict, where, "a subresource")
    name = _name(sub, "subresource", where)
    _verbs(sub, f"{where}({_clip(name)})")
    return name


def _check_resource(value: object, where: str) -> str:
    resource = _typed(value, dict, where, "a resource")
    name = _name(resource, "resource", where)
    where = f"{where}({_clip(name)})"
    _verbs(resource, where)
    subs = _optional_list(resource, "subresources", where)
    _unique((_check_subresource(s, f"{where}.subresources[{i}]") for i, s in enumerate(subs)),
            where, "subresource")
    return name


def _check_version(value: object, where: str) -> str:
    version = _typed(value, dict, where, "a version")
    name = _name(version, "version", where)
    where = f"{where}({_clip(name)})"
    if version.get("freshness") is not None:
        _typed(version["freshness"], str, where, "'freshness'")
    resources = _optional_list(version, "resources", where)
    _unique((_check_resource(r, f"{where}.resources[{i}]") for i, r in enumerate(resources)),
            where, "resource")
    return name


def _check_group(value: object, where: str) -> dict:
    group = _typed(value, dict, where, "a group")
    metadata = _typed(group.get("metadata"), dict, where, "'metadata'")
    name = _typed(metadata.get("name", ""), str, where, "'metadata.name'")
    where = f"{where}({_clip(name)})"
    versions = _optional_list(group, "versions", where)
    _unique((_check_version(v, f"{where}.versions[{i}]") for i, v in enumerate(versions)),
            where, "version")
    return group


def _check_list_header(value: object) -> list:
    doc = _typed(value, dict, "document", "the document")
    if doc.get("kind") != _LIST_KIND:
        _fail("document", f"kind must be {_LIST_KIND!r}, got {_shown(doc.get('kind'))}")
    if doc.get("apiVersion") not in _API_VERSIONS.values():
        _fail("document", f"apiVersion must be {API_VERSION_V2!r} or {API_VERSION_V2BETA1!r}, "
                          f"got {_shown(doc.get('apiVersion'))}")
    return _optional_list(doc, "items", "document")


def parse_aggregated(body: bytes, *, max_bytes: int) -> tuple[dict, ...]:
    """The groups of an ``APIGroupDiscoveryList`` (v2 or v2beta1), checked for shape.

    Strict where garbage would otherwise corrupt the merge (kinds, names, list types,
    duplicate list-map keys), lenient where Go's encoder is (unknown fields, omitted or
    null empty lists, ``creationTimestamp: null``). Raises DiscoveryFormatError.
    """
    items = _check_list_header(_load_json(body, max_bytes))
    groups = tuple(_check_group(g, f"items[{i}]") for i, g in enumerate(items))
    _unique((group_name(g) for g in groups), "document", "group")
    return groups


# --------------------------------------------------------------------------- accessors
# Only for parsed (or merged) documents: shapes were checked by parse_aggregated.

def group_name(group: Mapping) -> str:
    """The group's name; "" is the core (legacy) group."""
    return group["metadata"].get("name", "")


def _versions(group: Mapping) -> list[dict]:
    return group.get("versions") or []


def _resources(version: Mapping) -> list[dict]:
    return version.get("resources") or []


def _subresources(resource: Mapping) -> list[dict]:
    return resource.get("subresources") or []


def _is_stale(version: Mapping) -> bool:
    return version.get("freshness") == STALE


def _group_versions(groups: Iterable[Mapping]) -> Iterator[tuple[str, dict]]:
    for group in groups:
        name = group_name(group)
        yield from ((name, version) for version in _versions(group))


# --------------------------------------------------------------------------- snapshot

def _build_index(groups: Iterable[Mapping]) -> tuple[frozenset, frozenset, frozenset]:
    gvs: set[tuple[str, str]] = set()
    gvrs: set[tuple[str, str, str]] = set()
    subs: set[tuple[str, str, str, str]] = set()
    for name, version in _group_versions(groups):
        gv = (name, version["version"])
        gvs.add(gv)
        for resource in _resources(version):
            gvr = (*gv, resource["resource"])
            gvrs.add(gvr)
            subs.update((*gvr, s["subresource"]) for s in _subresources(resource))
    return frozenset(gvs), frozenset(gvrs), frozenset(subs)


@dataclass(frozen=True, init=False)
class Snapshot:
    """One server's discovery (or the merged view), replaced whole, never edited.

    Indexes are built once at construction so that routing answers "does this server
    serve X" with set lookups on every request. A version the server itself marks
    ``Stale`` still counts as served here; freshness is a discovery concern.
    """

    #: Groups from ``/api``: the core group, named "".
    core: tuple[dict, ...] = ()
    #: Groups from ``/apis``, in the server's priority order.
    groups: tuple[dict, ...] = ()
    #: Every (group, version) listed.
    group_versions: frozenset[tuple[str, str]] = field(init=False, repr=False, compare=False)
    #: Every (group, version, resource) listed.
    gvrs: frozenset[tuple[str, str, str]] = field(init=False, repr=False, compare=False)
    #: Every (group, version, resource, subresource) listed.
    subresources: frozenset[tuple[str, str, str, str]] = field(
        init=False, repr=False, compare=False)

    def __init__(self, core: Iterable[dict] = (), groups: Iterable[dict] = ()) -> None:
        # Any iterable of groups (a parsed JSON list), kept as a tuple: an explicit
        # __init__ because compiled code checks a dataclass's argument types.
        object.__setattr__(self, "core", tuple(core))
        object.__setattr__(self, "groups", tuple(groups))
        gvs, gvrs, subs = _build_index((*self.core, *self.groups))
        object.__setattr__(self, "group_versions", gvs)
        object.__setattr__(self, "gvrs", gvrs)
        object.__setattr__(self, "subresources", subs)

    def serves(self, group: str, version: str, resource: str, subresource: str = "") -> bool:
        """Whether this server lists the resource ("" subresource: the resource itself)."""
        if subresource:
            return (group, version, resource, subresource) in self.subresources
        return (group, version, resource) in self.gvrs

    def serves_group_version(self, group: str, version: str) -> bool:
        """Whether this server lists the group/version (for ``/apis/<g>/<v>`` routing)."""
        return (group, version) in self.group_versions


def check_prefix(path: str, groups: tuple[dict, ...]) -> None:
    """``/api`` holds only the core group and ``/apis`` only named groups, as on every
    real kube-apiserver: anything else means the documents were mixed up."""
    core = path == "/api"
    for group in groups:
        if (group_name(group) == "") != core:
            raise DiscoveryFormatError(
                f"GET {path}: group {group_name(group)!r} does not belong there")


# --------------------------------------------------------------------------- ordering

def _precedence(lists: Sequence[Sequence[str]]) -> tuple[dict[str, set[str]], dict[str, int]]:
    after: dict[str, set[str]] = {}
    indegree: dict[str, int] = {}
    for items in lists:
        for item in items:
            after.setdefault(item, set())
            indegree.setdefault(item, 0)
        for earlier, later in zip(items, items[1:], strict=False):  # neighbours
            if later not in after[earlier]:
                after[earlier].add(later)
                indegree[later] += 1
    return after, indegree


def _kahn(after: dict[str, set[str]], indegree: dict[str, int]) -> list[str]:
    ready = sorted(item for item, count in indegree.items() if count == 0)  # a valid heap
    order: list[str] = []
    while ready:
        item = heapq.heappop(ready)
        order.append(item)
        for later in after[item]:
            indegree[later] -= 1
            if indegree[later] == 0:
                heapq.heappush(ready, later)
    # A cycle leaves items unplaced: upstream then gives up on order and sorts.
    return order if len(order) == len(after) else sorted(after)


def merge_preserving_relative_order(lists: Sequence[Sequence[str]]) -> list[str]:
    """One order of all items that keeps every input's relative order where possible.

    Upstream's ``MergePreservingRelativeOrder``: the first input holding every item
    once is returned as is; otherwise a topological sort of the adjacent pairs that
    breaks ties lexicographically; a lexicographic sort if the inputs contradict each
    other (a cycle). O(n log n) in the number of items.
    """
    after, indegree = _precedence(lists)
    for items in lists:
        if len(items) == len(after) and len(set(items)) == len(items):
            return list(items)
    return _kahn(after, indegree)


def _merged_order(a: list[str], b: list[str]) -> list[str]:
    return a if a == b else merge_preserving_relative_order([a, b])


# --------------------------------------------------------------------------- merging

def _union_resource(a: dict, b: dict) -> dict:
    """Two different copies of one resource: capabilities unioned, the rest from ``a``."""
    verbs = sorted({*(a.get("verbs") or ()), *(b.get("verbs") or ())})
    by_name = {s["subresource"]: s for s in (*_subresources(a), *_subresources(b))}
    merged = {**a, "verbs": verbs, "subresources": [by_name[n] for n in sorted(by_name)]}
    if not by_name:
        del merged["subresources"]  # omitempty, as kube-apiserver writes it
    return merged


def _merge_version(a: dict, b: dict) -> dict:
    by_name = {r["resource"]: r for r in _resources(a)}
    changed = False
    for resource in _resources(b):
        existing = by_name.get(resource["resource"])
        if existing != resource:
            by_name[resource["resource"]] = (
                resource if existing is None else _union_resource(existing, resource))
            changed = True
    a_names = [r["resource"] for r in _resources(a)]
    b_names = [r["resource"] for r in _resources(b)]
    if not changed and a_names == b_names:
        return a
    return {**a, "resources": [by_name[n] for n in _merged_order(a_names, b_names)]}


def _merge_group(a: dict, b: dict) -> dict:
    by_name = {v["version"]: v for v in _versions(a)}
    changed = False
    for version in _versions(b):
        existing = by_name.get(version["version"])
        merged = version if existing is None else _merge_version(existing, version)
        changed |= merged is not existing
        by_name[version["version"]] = merged
    a_names = [v["version"] for v in _versions(a)]
    b_names = [v["version"] for v in _versions(b)]
    if not changed and a_names == b_names:
        return a
    return {**a, "versions": [by_name[n] for n in _merged_order(a_names, b_names)]}


def _merge_group_lists(lists: Sequence[Sequence[dict]]) -> tuple[dict, ...]:
    if len(lists) == 1:
        return tuple(lists[0])
    by_name: dict[str, dict] = {}
    for groups in lists:
        for group in groups:
            name = group_name(group)
            existing = by_name.get(name)
            if existing is None:
                by_name[name] = group
            elif existing != group:  # most groups are the same everywhere: compare in C
                by_name[name] = _merge_group(existing, group)
    names = [[group_name(g) for g in groups] for groups in lists]
    same = all(n == names[0] for n in names)
    order = names[0] if same else merge_preserving_relative_order(names)
    return tuple(by_name[n] for n in order)


def _with_freshness(groups: Sequence[dict], current: Collection[tuple[str, str]]) -> tuple:
    return tuple(_group_with_freshness(g, current) for g in groups)


def _group_with_freshness(group: dict, current: Collection[tuple[str, str]]) -> dict:
    name = group_name(group)
    versions = _versions(group)
    marked = [_version_with_freshness(v, (name, v["version"]) in current) for v in versions]
    if all(m is v for m, v in zip(marked, versions, strict=True)):
        return group
    return {**group, "versions": marked}


def _version_with_freshness(version: dict, is_current: bool) -> dict:
    # Only touch what is wrong, so an unchanged input keeps its exact bytes.
    if _is_stale(version) != is_current:
        return version
    return {**version, "freshness": CURRENT if is_current else STALE}


def merge(snapshots: Mapping[str, Snapshot], *, stale: Collection[str] = ()) -> Snapshot:
    """The discovery downstream clients see: every server's snapshot merged.

    A function of the mapping alone (no "local" server): the same inputs give the same
    document on every mvproxy. ``stale`` names servers that are currently unreachable;
    a version only they list is marked ``Stale``, any version a reachable server lists
    as not Stale is ``Current``.
    """
    ordered = [snapshots[i] for i in sorted(snapshots)]
    if not ordered:
        return Snapshot()
    reachable = (s for i, s in snapshots.items() if i not in stale)
    current = {(name, v["version"]) for s in reachable
               for name, v in _group_versions((*s.core, *s.groups)) if not _is_stale(v)}
    core = _merge_group_lists([s.core for s in ordered])
    groups = _merge_group_lists([s.groups for s in ordered])
    return Snapshot(_with_freshness(core, current), _with_freshness(groups, current))


# --------------------------------------------------------------------------- rendering

def _compact(doc: object) -> bytes:
    """As kube-apiserver writes JSON (Go's ``json.Encoder``): compact, then a newline."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8") + b"\n"


def render_aggregated(groups: Iterable[Mapping], *, api_version: str = API_VERSION_V2) -> bytes:
    """Compact JSON ``APIGroupDiscoveryList`` (v2 or v2beta1: same shape, other label)."""
    if api_version not in _API_VERSIONS.values():
        raise ValueError(f"not an aggregated discovery apiVersion: {api_version!r}")
    return _compact({"kind": _LIST_KIND, "apiVersion": api_version, "metadata": {},
                     "items": list(groups)})


def render_api_versions(core_groups: Iterable[Mapping]) -> bytes:
    """Legacy ``/api`` ``APIVersions``: the core versions, in merged order.

    No ``serverAddressByClientCIDRs``: the backend's own address would be wrong for
    a client that reached it through mvproxy.
    """
    versions = [v["version"] for _, v in _group_versions(core_groups)]
    return _compact({"kind": "APIVersions", "versions": list(dict.fromkeys(versions)),
                     "serverAddressByClientCIDRs": []})


def _version_ref(group: str, version: str) -> dict:
    return {"groupVersion": f"{group}/{version}" if group else version, "version": version}


def _legacy_group(group: Mapping) -> dict:
    name = group_name(group)
    versions = _versions(group)
    refs = [_version_ref(name, v["version"]) for v in versions]
    fresh = [ref for ref, v in zip(refs, versions, strict=True) if not _is_stale(v)]
    return {"name": name, "versions": refs, "preferredVersion": (fresh or refs)[0]}


def render_api_group(group: Mapping) -> bytes:
    """Legacy ``/apis/<g>`` ``APIGroup`` of one merged group that lists a version: the
    same entry, preferred version included, as :func:`render_api_group_list` gives it,
    so ``/apis`` and ``/apis/<g>`` never disagree."""
    return _compact({"kind": "APIGroup", "apiVersion": "v1", **_legacy_group(group)})


def render_api_group_list(groups: Iterable[Mapping]) -> bytes:
    """Legacy ``/apis`` ``APIGroupList`` from merged groups.

    The preferred version is the first one not ``Stale``, as client-go picks it from
    aggregated discovery. Versions served only by unreachable peers stay listed (the
    legacy format cannot say Stale): a client asking ``/apis/<g>/<v>`` then gets a
    503, which garbage collection and namespace deletion treat as "unknown", not as
    "gone". A group whose versions are all Stale is listed with its first version as
    preferred; a group with no versions is left out (APIGroup needs a preferred one).
    """
    items = [_legacy_group(g) for g in groups if _versions(g)]
    return _compact({"kind": "APIGroupList", "apiVersion": "v1", "groups": items})


# --------------------------------------------------------------------------- APIResourceList

def legacy_resources(resource: Mapping) -> list[dict]:
    """One aggregated resource entry as the legacy ``APIResourceList`` lists it: the
    resource, then each subresource as ``<resource>/<sub>``.

    The inverse of kube-apiserver's conversion to aggregated discovery, checked against
    every group/version of real 1.35 and 1.36 servers: the same fields in the same
    order (``group``/``version`` only where the response kind is in another group,
    as for ``deployments/scale``), except ``storageVersionHash``, which aggregated
    discovery does not carry (only the storage version migrator reads it).
    """
    namespaced = resource.get("scope") == "Namespaced"

    def entry(name: str, singular: str, kind: Mapping, verbs: Iterable[str] | None) -> dict:
        item: dict = {"name": name, "singularName": singular, "namespaced": namespaced}
        for key in ("group", "version"):
            if kind.get(key):
                item[key] = kind[key]
        item["kind"] = kind.get("kind", "")
        item["verbs"] = list(verbs or ())
        return item

    name = resource["resource"]
    main = entry(name, resource.get("singularResource", ""),
                 resource.get("responseKind") or {}, resource.get("verbs"))
    for key in ("shortNames", "categories"):
        if resource.get(key):
            main[key] = list(resource[key])
    return [main] + [entry(f"{name}/{sub['subresource']}", "", sub.get("responseKind") or {},
                           sub.get("verbs")) for sub in _subresources(resource)]


def peer_only_resources(merged: Snapshot, local: Snapshot, group: str,
                        version: str) -> tuple[dict, ...]:
    """Legacy ``APIResource`` entries of ``group``/``version`` that the merged view lists
    and ``local`` (the backend) does not: whole resources only peers serve, and the
    peer-only subresources of resources both serve. Empty when there are none."""
    extra: list[dict] = []
    for name, entry in _group_versions(merged.core if group == "" else merged.groups):
        if name != group or entry["version"] != version:
            continue
        for resource in _resources(entry):
            gvr = (group, version, resource["resource"])
            converted = legacy_resources(resource)
            if gvr not in local.gvrs:
                extra.extend(converted)
                continue
            extra.extend(item for sub, item in zip(_subresources(resource), converted[1:],
                                                   strict=True)
                         if (*gvr, sub["subresource"]) not in local.subresources)
    return tuple(extra)


def merge_resource_list(body: bytes, extra: Sequence[Mapping], group_version: str) -> bytes | None:
    """The backend's legacy ``APIResourceList`` (JSON) for ``group_version`` with the
    entries of ``extra`` it lacks; None if ``body`` is not that document (then it is
    relayed as it came). The backend lists resources by name (subresources right after
    their resource): a sorted list stays sorted, any other order gets the extra entries
    at the end."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if (not isinstance(document, dict) or document.get("kind") != "APIResourceList"
            or document.get("groupVersion") != group_version
            or not isinstance(document.get("resources"), list)
            or not all(isinstance(r, dict) for r in document["resources"])):
        return None
    resources: list = document["resources"]
    present = {r.get("name") for r in resources}
    added = [dict(r) for r in extra if r["name"] not in present]
    if not added:
        return body
    names = [r.get("name") for r in resources]
    in_order = all(isinstance(n, str) for n in names) and names == sorted(names)
    merged = resources + added
    if in_order:
        merged.sort(key=lambda r: r["name"])
    document["resources"] = merged
    return _compact(document)


def etag(body: bytes) -> str:
    """Upstream's ETag format: quoted uppercase-hex SHA-512 (of our rendered bytes)."""
    return f'"{hashlib.sha512(body).hexdigest().upper()}"'


# --------------------------------------------------------------------------- negotiation

@dataclass(frozen=True)
class Negotiated:
    """What to answer a discovery request with, decided from its Accept header alone."""

    #: "aggregated", "legacy", "backend" (protobuf ``profile=nopeer``: the backend's own
    #: view, which mvproxy cannot encode) or "not_acceptable".
    kind: str
    #: Exact Content-Type to send (no ``profile``); "" unless aggregated or legacy.
    content_type: str = ""
    #: For aggregated: API_VERSION_V2 or API_VERSION_V2BETA1, ready for render_aggregated
    #: (also set for an aggregated v2 protobuf clause with ``profile=nopeer``).
    api_version: str = ""
    #: The client asked for one server's own view (``profile=nopeer``).
    nopeer: bool = False

    @property
    def counts_as_nopeer(self) -> bool:
        """Whether upstream counts it in ``aggregator_discovery_nopeer_requests_total``:
        ``profile=nopeer`` on an aggregated v2 clause, JSON or protobuf (wrapper.go)."""
        return self.nopeer and self.api_version == API_VERSION_V2


_LEGACY = Negotiated("legacy", "application/json")
_NOT_ACCEPTABLE = Negotiated("not_acceptable")
_PROTOBUF = "application/vnd.kubernetes.protobuf"


def _aggregated_outcome(params: Mapping[str, str], v2beta1: bool) -> Negotiated | None:
    version = params.get("v", "")
    if (params["as"] != _LIST_KIND or params.get("g") != "apidiscovery.k8s.io"
            or version not in _CONTENT_TYPES):
        return None  # e.g. as=Table: not something discovery can produce
    if version == "v2beta1" and not v2beta1:
        return None  # the backend does not serve it: as there, the next clause
    # Unknown profiles get the merged view, as upstream.
    return Negotiated("aggregated", _CONTENT_TYPES[version], _API_VERSIONS[version],
                      nopeer=params.get("profile") == "nopeer")


def _outcome(media_type: str, params: Mapping[str, str], aggregated: bool,
             v2beta1: bool) -> Negotiated | None:
    if media_type in ("*/*", "application/*"):
        return _LEGACY
    if media_type not in ("application/json", _PROTOBUF):
        return None
    if "as" not in params:
        # Protobuf legacy documents would come from the backend alone, without the
        # peer-only groups that mvproxy's merged JSON lists: skipped, like YAML.
        return _LEGACY if media_type == "application/json" else None
    outcome = _aggregated_outcome(params, v2beta1) if aggregated else None
    if media_type == _PROTOBUF and outcome is not None:
        # mvproxy cannot encode protobuf; only the backend's own view may be asked so.
        if not outcome.nopeer:
            return None
        # Still counted as upstream counts it (a v2 clause), whatever the encoding.
        return Negotiated("backend", api_version=outcome.api_version, nopeer=True)
    return outcome


def negotiate(accept: str | None, *, aggregated: bool = True,
              v2beta1: bool = True) -> Negotiated:
    """Choose the answer for a discovery request (memoised for the short Accept values
    clients send; the memo stays small whatever they send). ``aggregated``: the path
    offers aggregated discovery (``/api``, ``/apis``; not ``/apis/<g>``). ``v2beta1``:
    whether aggregated v2beta1 may be chosen; the discovery handler asks the backend,
    and where it does not serve v2beta1 (kube-apiserver 1.33+), negotiates again
    without, so the client gets what the backend would give it: its next clause."""
    if accept is not None and len(accept) <= 512:
        return _negotiate_memo(accept, aggregated, v2beta1)
    return _negotiate(accept, aggregated, v2beta1)


@functools.lru_cache(maxsize=256)
def _negotiate_memo(accept: str, aggregated: bool, v2beta1: bool) -> Negotiated:
    return _negotiate(accept, aggregated, v2beta1)


def _negotiate(accept: str | None, aggregated: bool, v2beta1: bool = True) -> Negotiated:
    """The first acceptable clause wins (upstream's ``NegotiateMediaTypeOptions``).

    Aggregated JSON (v2, v2beta1), where offered → the merged document; plain JSON or a
    wildcard or no Accept → legacy documents, merged; protobuf → only with
    ``profile=nopeer`` (to the backend): every other protobuf answer would lack the
    peer-only APIs, so the client's next clause is used; nothing usable →
    not_acceptable.
    """
    if accept is None or not accept.strip():
        return _LEGACY
    for clause in parse_accept(accept):
        outcome = _outcome(clause.media_type, clause.params, aggregated, v2beta1)
        if outcome is not None:
            return outcome
    return _NOT_ACCEPTABLE
