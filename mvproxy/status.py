"""What the operator endpoints show: the servers, the APIs each serves, and routing.

Pure functions over one ``CacheView`` (and the metric families for reroutes), so a
single process and the ``--workers`` supervisor build the same documents: the
supervisor gets a worker's ``peers_document`` as JSON and renders it (``statuspage``).
Everything here is data: escaping is the renderer's job, and every string that came
from a peer (server IDs from membership, group names, error messages quoting a
peer's discovery) is treated as hostile there.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Protocol

from mvproxy.cache import CacheView, ServerState
from mvproxy.requestinfo import parse_request_info
from mvproxy.routing import decide

STATIC = "static"
"""The source of a server that configuration names (the backend, ``peers.static``)."""

Sources = Callable[[], Mapping[str, str]]
"""Server ID -> where membership learnt of it ("static", "lease", "dns", ...)."""



class _Listed(Protocol):
    """A peer as ``membership_sources`` reads it (``membership.Peer``)."""

    @property
    def server_id(self) -> str: ...


class _Members(Protocol):
    """What ``membership_sources`` reads of a membership (``membership.Membership``,
    which this module may not import: the layer contract keeps the two independent)."""

    def peers(self) -> Iterable[_Listed]: ...


MAX_PATH = 4096
"""Longest ``path`` the route explainer accepts (characters, query included)."""
MAX_METHOD = 16
REROUTED = "apiserver_rerouted_request_total"


def membership_sources(membership: _Members) -> Sources:
    """Sources from a membership's peers: a source may set ``Peer.source``; without
    one (static membership) the peer is "static"."""
    def sources() -> Mapping[str, str]:
        return {p.server_id: str(getattr(p, "source", STATIC) or STATIC)
                for p in membership.peers()}
    return sources


def group_version(gv: tuple[str, str]) -> str:
    """``apps/v1``; the core group's ``v1`` as kubectl writes it."""
    return f"{gv[0]}/{gv[1]}" if gv[0] else gv[1]


def _rfc3339(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def peers_document(view: CacheView, *, sources: Mapping[str, str] | None = None,
                   reroutes: list[dict] | None = None,
                   connections: dict[str, int] | None = None,
                   clock: Callable[[], float] = time.monotonic,
                   wall: Callable[[], float] = time.time) -> dict:
    """Every server (backend first, then peers by ID) with its reachability, last poll,
    last error, snapshot age, counts and the group/versions only it serves; the
    group/version x server table; reroutes by resource and code."""
    now, now_wall = clock(), wall()
    sources = sources or {}
    states: list[tuple[str, ServerState]] = [("backend", view.backend)] + [
        ("peer", view.peers[p]) for p in sorted(view.peers)]
    served: dict[tuple[str, str], list[str]] = {}
    for _, state in states:
        if state.snapshot is not None:
            for gv in state.snapshot.group_versions:
                served.setdefault(gv, []).append(state.server_id)
    with_snapshot = [s.server_id for _, s in states if s.snapshot is not None]

    def ago(moment: float | None) -> float | None:
        return None if moment is None else round(max(0.0, now - moment), 3)

    def describe(role: str, state: ServerState) -> dict:
        snapshot = state.snapshot
        only = sorted(group_version(gv) for gv, ids in served.items()
                      if ids == [state.server_id] and len(with_snapshot) > 1)
        return {
            "serverID": state.server_id, "role": role,
            "source": STATIC if role == "backend" else sources.get(state.server_id, STATIC),
            "polled": state.polled, "reachable": state.reachable,
            "lastPollTime": None if state.last_poll is None
            else _rfc3339(now_wall - (now - state.last_poll)),
            "secondsSinceLastPoll": ago(state.last_poll),
            "lastError": state.last_error,
            "hasSnapshot": snapshot is not None,
            "snapshotAgeSeconds": ago(state.last_success) if snapshot is not None else None,
            "kubeVersion": None,  # mvproxy polls discovery only; /version is not asked
            "groupVersions": 0 if snapshot is None else len(snapshot.group_versions),
            "resources": 0 if snapshot is None else len(snapshot.gvrs),
            "onlyHere": only,
        }
    apis = [{"groupVersion": group_version(gv), "servedBy": sorted(ids),
             "everywhere": len(ids) == len(with_snapshot)}
            for gv, ids in sorted(served.items(), key=lambda item: group_version(item[0]))]
    return {"serverID": view.server_id, "generation": view.generation, "synced": view.synced,
            "time": _rfc3339(now_wall),
            "servers": [describe(role, state) for role, state in states],
            "apis": apis, "reroutes": reroutes or [], "connections": connections or {}}


CONNECTION_GAUGES = {
    "mvproxy_open_connections": "downstream",
    "mvproxy_http2_connections": "downstreamHTTP2",
    "mvproxy_http2_streams": "downstreamHTTP2Streams",
    "mvproxy_upstream_http2_connections": "upstreamHTTP2",
    "mvproxy_upstream_http2_streams": "upstreamHTTP2Streams",
}
"""The gauges ``connections`` reads, and the key each becomes."""


def connections(families: Iterable) -> dict[str, int]:
    """Connections and streams by protocol, from the gauges (summed over workers when
    ``families`` is their merged exposition): ``downstream`` counts every protocol,
    ``downstreamHTTP1`` is what is not HTTP/2."""
    found = dict.fromkeys(CONNECTION_GAUGES.values(), 0)
    for family in families:
        for sample in family.samples:
            key = CONNECTION_GAUGES.get(sample.name)
            if key is not None:
                found[key] += int(sample.value)
    found["downstreamHTTP1"] = max(0, found["downstream"] - found["downstreamHTTP2"])
    return found


def reroutes(families: Iterable) -> list[dict]:
    """``apiserver_rerouted_request_total`` samples (from a registry's ``collect()``
    or a parsed exposition) as rows, most first."""
    rows = []
    for family in families:
        for sample in family.samples:
            if sample.name == REROUTED and sample.value:
                labels = sample.labels
                rows.append({"group": labels.get("group", ""),
                             "version": labels.get("version", ""),
                             "resource": labels.get("resource", ""),
                             "code": labels.get("code", ""), "count": int(sample.value)})
    return sorted(rows, key=lambda r: (-r["count"], r["group"], r["version"], r["resource"],
                                       r["code"]))


class BadQuery(ValueError):
    """The route explainer's input is unusable; the message says why (400)."""


def route_query(query: Mapping[str, str]) -> dict[str, str]:
    """Validated, normalised ``method``, ``path`` (with any query), ``peerProxied`` and
    ``credentials`` of ``/debug/mvproxy/route``; raises BadQuery.

    ``credentials`` defaults to true (the explainer answers for a client that has
    some, as an operator's kubectl does); ``credentials=false`` asks for a request
    without any, which never goes to a peer (``routing``)."""
    method = query.get("method", "GET").upper()
    if not method or len(method) > MAX_METHOD or not method.isascii() or not method.isalpha():
        raise BadQuery(f"method must be 1 to {MAX_METHOD} ASCII letters")
    path = query.get("path")
    if not path:
        raise BadQuery("path is required, e.g. ?method=GET&path=/apis/apps/v1/deployments")
    if len(path) > MAX_PATH:
        raise BadQuery(f"path is longer than {MAX_PATH} characters")
    if not path.startswith("/"):
        raise BadQuery("path must start with /")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path):
        raise BadQuery("path must not hold control characters")
    flags = {}
    for name, default in (("peerProxied", "false"), ("credentials", "true")):
        flags[name] = query.get(name, default).lower()
        if flags[name] not in ("true", "false"):
            raise BadQuery(f"{name} must be true or false")
    return {"method": method, "path": path, **flags}


def explain_route(view: CacheView, query: Mapping[str, str]) -> dict:
    """What mvproxy would do with the request ``query`` describes, and why.

    The same ``parse_request_info`` and ``decide`` the request path runs, on the
    current view; nothing is sent anywhere. Raises BadQuery for unusable input."""
    wanted = route_query(query)
    path, _, raw_query = wanted["path"].partition("?")
    info = parse_request_info(wanted["method"], path, raw_query)
    proxied = wanted["peerProxied"] == "true"
    credentials = proxied or wanted["credentials"] == "true"  # a peer always has some
    # A fixed shuffle: the explainer lists candidates; each real request draws its own order.
    decision = decide(info, view, peer_proxied=proxied, credentials=credentials,
                      rng=random.Random(0))
    capable: tuple[str, ...] = ()
    if info.is_resource_request:
        capable = view.capable_peers(info.api_group, info.api_version, info.resource,
                                     info.subresource)
    return {"request": {"method": wanted["method"], "path": path, "query": raw_query,
                        "peerProxied": proxied, "credentials": credentials},
            "route": decision.route, "reason": decision.reason,
            "candidatePeers": sorted(decision.peers),
            "capablePeers": sorted(capable or decision.peers),
            "unreachablePeers": sorted(p for p in (capable or decision.peers)
                                       if p not in view.reachable),
            "requestInfo": {f.name: getattr(info, f.name) for f in dataclasses.fields(info)},
            "generation": view.generation, "synced": view.synced}
