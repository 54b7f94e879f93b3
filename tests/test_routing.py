"""routing.decide: the decision order of docs/routing.md as a table, over real snapshots.

The backend is a 1.35 server and the peers 1.36 (or the reverse for a downgrade):
1.35 serves ``scheduling.k8s.io/v1alpha1`` (``workloads``), 1.36 replaces it with
``v1alpha2`` (``workloads``, ``podgroups`` with ``podgroups/status``) and adds
``resource.k8s.io/v1beta2 devicetaintrules``. Subresource and group cases that the
catalogs do not contain (``pods/resize``, a group only a peer has) use small
hand-made snapshots. Views come from a real ``DiscoveryCache`` driven by a fake clock.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry, Counter

from mvproxy import routing
from mvproxy.cache import CacheView, DiscoveryCache
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.discoverydocs import aggregated
from mvproxy.discovery import Snapshot
from mvproxy.requestinfo import parse_request_info
from mvproxy.routing import (
    BACKEND,
    DISCOVERY,
    OPENAPI_INDEX,
    PEER,
    UNAVAILABLE,
    Decision,
    decide,
)

SELF, B, C = "apiserver-a", "apiserver-b", "apiserver-c"
STALE_AFTER, FORGET_AFTER = 15.0, 600.0
UP, DOWN, UNPOLLED, NEVER = "up", "down", "unpolled", "never answered"
FAILING = "failing"  # the backend only: its last poll failed, within staleAfter

SCHED = "/apis/scheduling.k8s.io"
PODGROUPS = f"{SCHED}/v1alpha2/namespaces/ns/podgroups"   # 1.36 only
WORKLOADS_OLD = f"{SCHED}/v1alpha1/namespaces/ns/workloads"  # 1.35 only


# --------------------------------------------------------------------------- snapshots

def catalog_snapshot(version: str) -> Snapshot:
    catalog = load_catalog(version)
    return Snapshot(core=aggregated(catalog, core=True)["items"],
                    groups=aggregated(catalog, core=False)["items"])


def _group(name: str, version: str, resources: Mapping[str, tuple[str, ...]]) -> dict:
    return {"metadata": {"name": name}, "versions": [{"version": version, "resources": [
        {"resource": r, "verbs": ["get"], "subresources": [{"subresource": s} for s in subs]}
        for r, subs in resources.items()]}]}


def small(pod_subresources: tuple[str, ...], *groups: dict) -> Snapshot:
    """A hand-made server: core v1 pods (with the given subresources) and ``groups``."""
    return Snapshot(core=[_group("", "v1", {"pods": pod_subresources, "configmaps": ()})],
                    groups=list(groups))


V135, V136 = catalog_snapshot("1.35"), catalog_snapshot("1.36")
OLD_PODS = small(("status", "log", "exec"))
NEW_PODS = small(("status", "log", "exec", "resize"))
WIDGETS = _group("widgets.example.com", "v1", {"widgets": ("status",)})
WITH_WIDGETS = small(("status",), WIDGETS)


# --------------------------------------------------------------------------- views

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_view(local: Snapshot | None, peers: Mapping[str, tuple[Snapshot | None, str]],
              backend: str = UP) -> CacheView:
    """A view as polling would leave it.

    ``local`` None: the backend's first poll failed; ``backend`` DOWN: it answered
    once, then went silent past staleAfter; FAILING: its last poll failed, within
    staleAfter (or a request found it down). Each peer is (snapshot, state):
    UP (polled, answered), DOWN (answered once, then silent past staleAfter: the
    snapshot is kept, the peer is unreachable), NEVER (polled, never answered), or
    UNPOLLED (no poll finished yet).
    """
    clock = Clock()
    cache = DiscoveryCache(SELF, list(peers), stale_after=STALE_AFTER,
                           forget_after=FORGET_AFTER, clock=clock)
    if local is None:
        cache.record_failure(SELF)
    else:
        cache.record_success(SELF, local)
    for peer_id, (snapshot, state) in peers.items():
        if state in (UP, DOWN):
            cache.record_success(peer_id, snapshot)
    clock.now += STALE_AFTER + 1
    if local is not None and backend == DOWN:
        cache.record_failure(SELF)
    elif local is not None:
        cache.record_success(SELF, local)
        if backend == FAILING:  # its last poll failed, a moment ago: still reachable
            cache.record_failure(SELF, "connect: refused")
    for peer_id, (snapshot, state) in peers.items():
        if state == UP:
            cache.record_success(peer_id, snapshot)
        elif state in (DOWN, NEVER):
            cache.record_failure(peer_id)
    return cache.view()


VIEWS: dict[str, CacheView] = {
    "upgrade": make_view(V135, {B: (V136, UP)}),
    "upgrade, peer down": make_view(V135, {B: (V136, DOWN)}),
    "two new peers": make_view(V135, {B: (V136, UP), C: (V136, UP)}),
    "two new peers, one down": make_view(V135, {B: (V136, UP), C: (V136, DOWN)}),
    "two new peers, both down": make_view(V135, {B: (V136, DOWN), C: (V136, DOWN)}),
    "peer never answered": make_view(V135, {B: (None, NEVER)}),
    "peer not polled yet": make_view(V135, {B: (V136, UNPOLLED)}),
    "backend never answered": make_view(None, {B: (V136, UP)}),
    "downgrade": make_view(V136, {B: (V135, UP)}),
    "resize on peer": make_view(OLD_PODS, {B: (NEW_PODS, UP)}),
    "resize on peer, down": make_view(OLD_PODS, {B: (NEW_PODS, DOWN)}),
    "group on peer": make_view(OLD_PODS, {B: (WITH_WIDGETS, UP)}),
    "group on peer, down": make_view(OLD_PODS, {B: (WITH_WIDGETS, DOWN)}),
    "backend down": make_view(V135, {B: (V136, UP)}, backend=DOWN),
    "backend down, two peers": make_view(V135, {B: (V136, UP), C: (V136, DOWN)},
                                         backend=DOWN),
    "backend and peer down": make_view(V135, {B: (V136, DOWN)}, backend=DOWN),
    "backend failing": make_view(V136, {B: (V135, UP)}, backend=FAILING),
    "backend down, resize nowhere else": make_view(NEW_PODS, {B: (OLD_PODS, UP)},
                                                   backend=DOWN),
}


def test_views_are_what_their_names_say():
    assert VIEWS["upgrade"].synced and VIEWS["upgrade"].reachable == {B}
    assert VIEWS["upgrade, peer down"].synced and not VIEWS["upgrade, peer down"].reachable
    assert VIEWS["upgrade, peer down"].peers[B].snapshot is V136
    assert VIEWS["two new peers, one down"].reachable == {B}
    never = VIEWS["peer never answered"]
    assert never.synced and never.peers[B].snapshot is None
    assert not VIEWS["peer not polled yet"].synced
    assert VIEWS["backend never answered"].backend.snapshot is None
    down = VIEWS["backend down"]
    assert down.synced and not down.backend.reachable and down.backend.snapshot is V135


# --------------------------------------------------------------------------- the table

def row(rule: str, view: str, method: str, path: str, route: str, peers=(), *,
        query: str = "", peer_proxied: bool = False, credentials: bool = True,
        reason: str | None = None):
    """``credentials``: the downstream is a peer or a certificate user, or sent
    ``Authorization`` (every row but the "no credentials" ones)."""
    return pytest.param(view, method, path, query, peer_proxied, credentials, route,
                        tuple(peers), reason, id=rule)


TABLE = [
    # 1. discovery, from peers too (the handler answers them from the backend, and
    # counts their profile=nopeer polls, as upstream's discovery wrapper does)
    row("peer-proxied discovery goes to the discovery handler", "upgrade", "GET", "/apis",
        DISCOVERY, peer_proxied=True, reason="discovery"),
    row("peer-proxied HEAD /api goes to the discovery handler", "upgrade", "HEAD", "/api",
        DISCOVERY, peer_proxied=True),
    # 2. loop guard
    row("serve locally if already peer-proxied", "upgrade", "GET", PODGROUPS, BACKEND,
        peer_proxied=True, reason="peer-proxied"),
    row("peer-proxied beats an unreachable capable peer", "upgrade, peer down", "GET",
        PODGROUPS, BACKEND, peer_proxied=True),
    row("peer-proxied POST /apis goes to the backend", "upgrade", "POST", "/apis",
        BACKEND, peer_proxied=True, reason="peer-proxied"),
    # discovery
    row("discovery /api", "upgrade", "GET", "/api", DISCOVERY),
    row("discovery /api/ with slash", "upgrade", "GET", "/api/", DISCOVERY),
    row("discovery /apis", "upgrade", "GET", "/apis", DISCOVERY),
    row("discovery /apis/ with slash", "upgrade", "GET", "/apis/", DISCOVERY),
    row("discovery HEAD /apis", "upgrade", "HEAD", "/apis", DISCOVERY),
    row("discovery before the first sync is still the discovery handler's",
        "peer not polled yet", "GET", "/apis", DISCOVERY),
    row("POST /apis is not discovery", "upgrade", "POST", "/apis", BACKEND,
        reason="not an API request"),
    row("DELETE /api is not discovery", "upgrade", "DELETE", "/api", BACKEND),
    # 6. before the first sync
    row("before the first sync everything goes to the backend", "peer not polled yet", "GET",
        PODGROUPS, BACKEND, reason="not synced"),
    row("before the first sync /apis/<g>/<v> goes to the backend", "peer not polled yet",
        "GET", f"{SCHED}/v1alpha2", BACKEND, reason="not synced"),
    row("backend never answered: everything goes to the backend", "backend never answered",
        "GET", PODGROUPS, BACKEND, reason="not synced"),
    # 4. resource requests
    row("resource the backend serves stays local", "upgrade", "GET",
        "/api/v1/namespaces/ns/pods", BACKEND, reason="served locally"),
    row("resource both serve stays local", "upgrade", "GET",
        "/apis/apps/v1/namespaces/ns/deployments/web", BACKEND, reason="served locally"),
    row("resource only a peer serves goes to that peer (list)", "upgrade", "GET", PODGROUPS,
        PEER, [B]),
    row("resource only a peer serves goes to that peer (get by name)", "upgrade", "GET",
        f"{PODGROUPS}/pg-1", PEER, [B]),
    row("create of a peer-only resource goes to the peer", "upgrade", "POST", PODGROUPS,
        PEER, [B]),
    row("deletecollection of a peer-only resource goes to the peer", "upgrade", "DELETE",
        PODGROUPS, PEER, [B]),
    row("cluster-scoped resource of a new version of an existing group goes to the peer",
        "upgrade", "GET", "/apis/resource.k8s.io/v1beta2/devicetaintrules", PEER, [B]),
    row("a version only the backend still serves stays local", "upgrade", "GET",
        WORKLOADS_OLD, BACKEND, reason="served locally"),
    # 4'. what the backend serves, while polling finds the backend unreachable
    row("backend unreachable: what a peer serves too goes to that peer", "backend down",
        "GET", "/api/v1/namespaces/ns/pods", PEER, [B], reason="backend failing"),
    row("backend failing (last poll failed): what a peer serves too goes there",
        "backend failing", "GET", "/api/v1/namespaces/ns/pods", PEER, [B],
        reason="backend failing"),
    row("backend failing after a rollback: what its old snapshot lists, no peer has: "
        "the backend (its genuine answer)", "backend failing", "GET", PODGROUPS, BACKEND,
        reason="served locally"),
    row("backend unreachable: writes too", "backend down", "POST",
        "/apis/apps/v1/namespaces/ns/deployments", PEER, [B], reason="backend failing"),
    row("backend unreachable: only reachable peers", "backend down, two peers", "GET",
        "/api/v1/namespaces/ns/configmaps", PEER, [B], reason="backend failing"),
    row("backend unreachable: what only it serves stays local (its failure answers)",
        "backend down", "GET", WORKLOADS_OLD, BACKEND, reason="served locally"),
    row("backend unreachable: a subresource no peer serves stays local",
        "backend down, resize nowhere else", "PATCH", "/api/v1/namespaces/ns/pods/p/resize",
        BACKEND, reason="served locally"),
    row("backend and peers unreachable: the backend (its failure answers)",
        "backend and peer down", "GET", "/api/v1/namespaces/ns/pods", BACKEND,
        reason="served locally"),
    row("backend unreachable, no credentials: never a peer", "backend down", "GET",
        "/api/v1/namespaces/ns/pods", BACKEND, credentials=False, reason="served locally"),
    row("backend unreachable, peer-proxied: served here (its failure tells the peer)",
        "backend down", "GET", "/api/v1/namespaces/ns/pods", BACKEND, peer_proxied=True,
        reason="peer-proxied"),
    row("backend unreachable: non-resource requests stay with the backend", "backend down",
        "GET", "/version", BACKEND, reason="not an API request"),
    row("downgrade: old version only a peer still serves goes to it", "downgrade", "GET",
        WORKLOADS_OLD, PEER, [B]),
    row("watch via legacy /watch/ prefix is routed by its resource", "upgrade", "GET",
        f"{SCHED}/v1alpha2/watch/namespaces/ns/podgroups", PEER, [B]),
    row("watch via ?watch=1 is routed by its resource", "upgrade", "GET", PODGROUPS, PEER, [B],
        query="watch=1&resourceVersion=0"),
    row("legacy /watch/ of a local resource stays local", "upgrade", "GET",
        "/api/v1/watch/namespaces/ns/pods", BACKEND),
    row("503 when every capable peer is unreachable", "upgrade, peer down", "GET", PODGROUPS,
        UNAVAILABLE, [B], reason="capable peers unreachable"),
    row("503 names every capable peer when all are unreachable", "two new peers, both down",
        "GET", PODGROUPS, UNAVAILABLE, [B, C]),
    row("an unreachable capable peer is skipped when another is reachable",
        "two new peers, one down", "GET", PODGROUPS, PEER, [B]),
    row("genuine 404 when nobody serves it", "upgrade", "GET",
        "/apis/example.com/v1/namespaces/ns/nothings", BACKEND, reason="served by nobody"),
    row("genuine 404 for an unknown resource of a known version", "upgrade", "GET",
        "/api/v1/namespaces/ns/nothings", BACKEND, reason="served by nobody"),
    row("a peer that never answered is not capable: backend 404", "peer never answered", "GET",
        PODGROUPS, BACKEND, reason="served by nobody"),
    row("legacy /watch with nothing after it goes to the backend", "upgrade", "GET",
        "/api/v1/watch", BACKEND),
    # subresources (hand-made snapshots)
    row("new subresource pods/resize goes to the peer that has it", "resize on peer", "PATCH",
        "/api/v1/namespaces/ns/pods/web/resize", PEER, [B]),
    row("new subresource pods/resize with its only peer down is 503", "resize on peer, down",
        "PATCH", "/api/v1/namespaces/ns/pods/web/resize", UNAVAILABLE, [B]),
    row("a subresource the backend has stays local", "resize on peer", "GET",
        "/api/v1/namespaces/ns/pods/web/status", BACKEND, reason="served locally"),
    row("pods/exec the backend has stays local", "resize on peer", "POST",
        "/api/v1/namespaces/ns/pods/web/exec", BACKEND, reason="served locally"),
    row("a subresource nobody has gets the backend's 404", "resize on peer", "GET",
        "/api/v1/namespaces/ns/pods/web/bogus", BACKEND, reason="served by nobody"),
    row("the pod itself stays local though only the peer has resize", "resize on peer", "GET",
        "/api/v1/namespaces/ns/pods/web", BACKEND, reason="served locally"),
    row("a subresource of a peer-only resource goes to the peer", "upgrade", "PUT",
        f"{PODGROUPS}/pg-1/status", PEER, [B]),
    # 3. /apis/<g>, /apis/<g>/<v>, /openapi/v3/apis/<g>/<v>
    row("legacy /apis/<g>/<v> of a peer-only group version goes to the peer", "upgrade", "GET",
        f"{SCHED}/v1alpha2", PEER, [B]),
    row("legacy /apis/<g>/<v>/ with slash goes to the peer too", "upgrade", "GET",
        f"{SCHED}/v1alpha2/", PEER, [B]),
    row("/apis/<g>/<v> the backend serves stays local", "upgrade", "GET", f"{SCHED}/v1alpha1",
        BACKEND, reason="served locally"),
    row("/apis/<g>/<v> nobody serves gets the backend's 404", "upgrade", "GET",
        f"{SCHED}/v9", BACKEND, reason="served by nobody"),
    row("/apis/<g>/<v> of an unreachable peer-only version is 503", "upgrade, peer down", "GET",
        f"{SCHED}/v1alpha2", UNAVAILABLE, [B]),
    row("/openapi/v3/apis/<g>/<v> follows the group version", "upgrade", "GET",
        f"/openapi/v3{SCHED}/v1alpha2", PEER, [B], query="hash=ABC"),
    row("/openapi/v3/apis/<g>/<v> the backend serves stays local", "upgrade", "GET",
        f"/openapi/v3{SCHED}/v1alpha1", BACKEND, reason="served locally"),
    row("/openapi/v3/apis/<g>/<v> of an unreachable peer is 503", "upgrade, peer down", "GET",
        f"/openapi/v3{SCHED}/v1alpha2", UNAVAILABLE, [B]),
    # /apis/<g>: the merged APIGroup, like /apis (discovery/group.go is local upstream)
    row("/apis/<g> for a group only a peer serves is merged group discovery", "group on peer",
        "GET", "/apis/widgets.example.com", DISCOVERY, reason="group discovery"),
    row("/apis/<g> of an unreachable peer's group is merged too (listed, as in /apis)",
        "group on peer, down", "GET", "/apis/widgets.example.com", DISCOVERY),
    row("/apis/<g> the backend serves is merged: a peer has more versions", "upgrade",
        "GET", SCHED, DISCOVERY, reason="group discovery"),
    # Only the exact GET: the authorization probe is that request, and a refusal names
    # the verb and path (an anonymous client must not tell peer-only groups apart).
    row("/apis/<g>/ with slash takes the group route", "upgrade", "GET", f"{SCHED}/",
        BACKEND, reason="served locally"),
    row("HEAD /apis/<g> takes the group route", "upgrade", "HEAD", SCHED, BACKEND,
        reason="served locally"),
    row("HEAD /apis/<g> of a group only a peer serves goes to the peer", "group on peer",
        "HEAD", "/apis/widgets.example.com", PEER, [B]),
    row("/apis/<g> nobody lists: the backend decides, never its ghost APIGroup", "upgrade",
        "GET", "/apis/nothing.example.com", DISCOVERY, reason="group listed by nobody"),
    row("HEAD /apis/<g> nobody lists gets the backend's answer", "upgrade", "HEAD",
        "/apis/nothing.example.com", BACKEND, reason="served by nobody"),
    row("/apis/<g> before the first sync goes to the backend", "peer not polled yet", "GET",
        SCHED, BACKEND, reason="not synced"),
    row("peer-proxied /apis/<g> goes to the backend", "upgrade", "GET", SCHED, BACKEND,
        peer_proxied=True, reason="peer-proxied"),
    row("POST /apis/<g> is not group discovery", "upgrade", "POST", SCHED, BACKEND,
        reason="served locally"),
    row("/apis/<g>// is not group discovery", "upgrade", "GET", f"{SCHED}//", BACKEND),
    row("resource of a group only a peer serves goes to the peer", "group on peer", "GET",
        "/apis/widgets.example.com/v1/widgets", PEER, [B]),
    # 4b. legacy /apis/<g>/<v> of a group/version the backend serves while peers serve
    # more of it: the backend's APIResourceList plus theirs (kr8s, DynamicClient)
    row("GET /api/v1 with a peer-only subresource is merged", "resize on peer", "GET",
        "/api/v1", DISCOVERY, reason="group/version resources merged"),
    row("GET /api/v1/ (slash) is merged too", "resize on peer", "GET", "/api/v1/", DISCOVERY,
        reason="group/version resources merged"),
    row("the peer down: still merged (as aggregated discovery lists it)",
        "resize on peer, down", "GET", "/api/v1", DISCOVERY,
        reason="group/version resources merged"),
    row("no credentials: merged, the backend's answer decides", "resize on peer", "GET",
        "/api/v1", DISCOVERY, credentials=False, reason="group/version resources merged"),
    row("HEAD /api/v1 stays on the backend", "resize on peer", "HEAD", "/api/v1", BACKEND,
        reason="not an API request"),
    row("peer-proxied /api/v1 goes to the backend", "resize on peer", "GET", "/api/v1",
        BACKEND, peer_proxied=True, reason="peer-proxied"),
    row("a group/version whose new subresource only the peer has is merged", "upgrade",
        "GET", "/apis/resource.k8s.io/v1beta2", DISCOVERY,
        reason="group/version resources merged"),
    row("the backend serving more of it: local", "downgrade", "GET",
        "/apis/resource.k8s.io/v1beta2", BACKEND, reason="served locally"),
    row("its OpenAPI document is merged with the peer's", "upgrade", "GET",
        "/openapi/v3/apis/resource.k8s.io/v1beta2", OPENAPI_INDEX, [B],
        query="hash=ABC", reason="openapi group/version merged"),
    row("core v1's OpenAPI document with a peer-only subresource is merged",
        "resize on peer", "GET", "/openapi/v3/api/v1", OPENAPI_INDEX, [B],
        reason="openapi group/version merged"),
    row("an OpenAPI document, the peer down: the backend's", "resize on peer, down", "GET",
        "/openapi/v3/api/v1", BACKEND, reason="served locally"),
    row("an OpenAPI document without credentials: the backend's", "resize on peer", "GET",
        "/openapi/v3/api/v1", BACKEND, credentials=False, reason="served locally"),
    row("an OpenAPI document the backend serves whole: the backend's", "downgrade", "GET",
        "/openapi/v3/apis/resource.k8s.io/v1beta2", BACKEND, reason="served locally"),
    row("HEAD of an OpenAPI document: the backend's", "resize on peer", "HEAD",
        "/openapi/v3/api/v1", BACKEND, reason="served locally"),
    row("an OpenAPI document with a slash: the backend's", "resize on peer", "GET",
        "/openapi/v3/api/v1/", BACKEND),
    row("peer-proxied OpenAPI document: the backend's", "resize on peer", "GET",
        "/openapi/v3/api/v1", BACKEND, peer_proxied=True, reason="peer-proxied"),
    row("two new peers: both may complete the document", "two new peers", "GET",
        "/openapi/v3/apis/resource.k8s.io/v1beta2", OPENAPI_INDEX, [B, C],
        reason="openapi group/version merged"),
    row("nothing peer-only in core v1: local", "group on peer", "GET", "/api/v1", BACKEND,
        reason="served locally"),
    # 5. everything else
    row("/api/v1 stays local", "upgrade", "GET", "/api/v1", BACKEND),
    row("/healthz goes to the backend", "upgrade", "GET", "/healthz", BACKEND,
        reason="not an API request"),
    row("/version goes to the backend", "upgrade", "GET", "/version", BACKEND,
        reason="not an API request"),
    row("/openapi/v2 goes to the backend", "upgrade", "GET", "/openapi/v2", BACKEND,
        reason="not an API request"),
    row("GET /openapi/v3 index is merged with peer-only group versions", "upgrade", "GET",
        "/openapi/v3", OPENAPI_INDEX),
    row("GET /openapi/v3/ index with slash too", "upgrade", "GET", "/openapi/v3/",
        OPENAPI_INDEX),
    row("POST /openapi/v3 is not the index", "upgrade", "POST", "/openapi/v3", BACKEND,
        reason="not an API request"),
    row("peer-proxied /openapi/v3 goes to the backend", "upgrade", "GET", "/openapi/v3",
        BACKEND, peer_proxied=True),
    row("/openapi/v3/api/v1 goes to the backend", "upgrade", "GET", "/openapi/v3/api/v1",
        BACKEND),
    # Without credentials (no peer, no certificate user, no Authorization): never a peer
    # and never a 503, but what a server that does not serve it answers (the backend's
    # 401/403/404), so an anonymous client cannot learn what only peers serve.
    row("no credentials: a peer-only resource goes to the backend", "upgrade", "GET",
        PODGROUPS, BACKEND, credentials=False, reason="no credentials"),
    row("no credentials: a create of a peer-only resource goes to the backend", "upgrade",
        "POST", PODGROUPS, BACKEND, credentials=False, reason="no credentials"),
    row("no credentials: a watch of a peer-only resource goes to the backend", "upgrade",
        "GET", PODGROUPS, BACKEND, query="watch=1", credentials=False, reason="no credentials"),
    row("no credentials: unreachable capable peers are not a 503", "upgrade, peer down", "GET",
        PODGROUPS, BACKEND, credentials=False, reason="no credentials"),
    row("no credentials: every capable peer down is not a 503 either",
        "two new peers, both down", "GET", PODGROUPS, BACKEND, credentials=False),
    row("no credentials: a subresource only a peer has goes to the backend", "resize on peer",
        "PATCH", "/api/v1/namespaces/ns/pods/web/resize", BACKEND, credentials=False,
        reason="no credentials"),
    row("no credentials: a resource of a peer-only group goes to the backend", "group on peer",
        "GET", "/apis/widgets.example.com/v1/widgets", BACKEND, credentials=False),
    row("no credentials: /apis/<g>/<v> of a peer-only version goes to the backend", "upgrade",
        "GET", f"{SCHED}/v1alpha2", BACKEND, credentials=False, reason="no credentials"),
    row("no credentials: /apis/<g>/<v> of an unreachable peer-only version is not a 503",
        "upgrade, peer down", "GET", f"{SCHED}/v1alpha2", BACKEND, credentials=False,
        reason="no credentials"),
    row("no credentials: /openapi/v3/apis/<g>/<v> of a peer-only version goes to the backend",
        "upgrade", "GET", f"/openapi/v3{SCHED}/v1alpha2", BACKEND, credentials=False,
        reason="no credentials"),
    row("no credentials: HEAD /apis/<g> of a peer-only group goes to the backend",
        "group on peer", "HEAD", "/apis/widgets.example.com", BACKEND, credentials=False,
        reason="no credentials"),
    row("no credentials: /apis/<g>/ of an unreachable peer-only group is not a 503",
        "group on peer, down", "GET", "/apis/widgets.example.com/", BACKEND,
        credentials=False, reason="no credentials"),
    # Unchanged without credentials: the discovery handler asks the backend the same
    # request with the client's (lack of) credentials first and relays its refusal.
    row("no credentials: GET /apis/<g> of a peer-only group is still group discovery",
        "group on peer", "GET", "/apis/widgets.example.com", DISCOVERY, credentials=False,
        reason="group discovery"),
    row("no credentials: /apis is still discovery", "upgrade", "GET", "/apis", DISCOVERY,
        credentials=False),
    row("no credentials: the /openapi/v3 index is still merged (from the backend's answer)",
        "upgrade", "GET", "/openapi/v3", OPENAPI_INDEX, credentials=False),
    row("no credentials: a resource the backend serves stays local", "upgrade", "GET",
        "/api/v1/namespaces/ns/pods", BACKEND, credentials=False, reason="served locally"),
    row("no credentials: nobody serves it, still the backend's genuine 404", "upgrade", "GET",
        "/apis/example.com/v1/namespaces/ns/nothings", BACKEND, credentials=False,
        reason="served by nobody"),
    row("no credentials: before the first sync the backend, as for everyone",
        "peer not polled yet", "GET", PODGROUPS, BACKEND, credentials=False,
        reason="not synced"),
]


@pytest.mark.parametrize(
    "view, method, path, query, peer_proxied, credentials, route, peers, reason", TABLE)
def test_decision(view, method, path, query, peer_proxied, credentials, route, peers, reason):
    """The table; ``/apis/<g>`` rows differ from upstream, which serves it locally
    (staging/src/k8s.io/apiserver/pkg/endpoints/discovery/group.go)."""
    info = parse_request_info(method, path, query)
    decision = decide(info, VIEWS[view], peer_proxied=peer_proxied, credentials=credentials,
                      rng=random.Random(0))
    assert (decision.route, decision.peers) == (route, peers), decision
    if reason is not None:
        assert decision.reason == reason
    assert isinstance(decision, Decision)


def test_table_ids_are_unique():
    ids = [p.id for p in TABLE]
    assert len(ids) == len(set(ids))


# --------------------------------------------------------------------------- random choice

def test_two_capable_peers_are_tried_in_both_orders():
    view = VIEWS["two new peers"]
    info = parse_request_info("GET", PODGROUPS)
    rng = random.Random(1234)
    orders = {decide(info, view, peer_proxied=False, credentials=True, rng=rng).peers
              for _ in range(200)}
    assert orders == {(B, C), (C, B)}


def test_an_unreachable_peer_never_appears():
    view = VIEWS["two new peers, one down"]
    info = parse_request_info("GET", PODGROUPS)
    rng = random.Random(1234)
    for _ in range(200):
        assert decide(info, view, peer_proxied=False, credentials=True, rng=rng).peers == (B,)


def test_without_an_rng_the_module_random_is_used():
    view = VIEWS["two new peers"]
    decision = decide(parse_request_info("GET", PODGROUPS), view, peer_proxied=False,
                      credentials=True)
    assert decision.route == PEER and sorted(decision.peers) == [B, C]


def test_same_seed_same_order():
    view = VIEWS["two new peers"]
    info = parse_request_info("GET", PODGROUPS)
    first = [decide(info, view, peer_proxied=False, credentials=True,
                    rng=random.Random(7)).peers for _ in range(3)]
    assert len(set(first)) == 1


# --------------------------------------------------------------------------- cost

class NoIterSet(frozenset):
    """A set that answers membership but refuses to be walked."""

    def __iter__(self):
        raise AssertionError("decide iterated a snapshot index")


class NoIterMap(dict):
    def __iter__(self):
        raise AssertionError("decide iterated the capability index")

    def keys(self):
        raise AssertionError("decide iterated the capability index")

    def items(self):
        raise AssertionError("decide iterated the capability index")

    def values(self):
        raise AssertionError("decide iterated the capability index")


def _unwalkable(snapshot: Snapshot) -> Snapshot:
    copy = Snapshot(core=snapshot.core, groups=snapshot.groups)
    for attr in ("group_versions", "gvrs", "subresources"):
        object.__setattr__(copy, attr, NoIterSet(getattr(snapshot, attr)))
    return copy


@pytest.mark.parametrize("method, path", [
    ("GET", PODGROUPS), ("GET", "/api/v1/namespaces/ns/pods"), ("GET", f"{SCHED}/v1alpha2"),
    ("GET", SCHED), ("GET", f"/openapi/v3{SCHED}/v1alpha2"), ("GET", "/apis/x.example/v1/ys"),
    ("GET", "/apis/resource.k8s.io/v1beta2"), ("GET", "/api/v1"),
    ("PATCH", "/api/v1/namespaces/ns/pods/web/status"),
])
@pytest.mark.parametrize("credentials", [True, False], ids=["credentials", "none"])
def test_decide_only_probes_indexes(method, path, credentials):
    """Every lookup is a set/dict probe: nothing is walked per request."""
    view = VIEWS["two new peers"]
    backend = dataclasses.replace(view.backend, snapshot=_unwalkable(view.backend.snapshot))
    peers = {p: dataclasses.replace(s, snapshot=_unwalkable(s.snapshot))
             for p, s in view.peers.items()}
    probed = dataclasses.replace(
        view, backend=backend, peers=peers, capable=NoIterMap(view.capable),
        capable_gv=NoIterMap(view.capable_gv), capable_group=NoIterMap(view.capable_group),
        local_groups=NoIterSet(view.local_groups))
    expected = decide(parse_request_info(method, path), view, peer_proxied=False,
                      credentials=credentials, rng=random.Random(0))
    got = decide(parse_request_info(method, path), probed, peer_proxied=False,
                 credentials=credentials, rng=random.Random(0))
    assert got == expected


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("route, word", [
    ("BACKEND", "backend"), ("PEER", "peer"), ("DISCOVERY", "discovery"),
    ("UNAVAILABLE", "unavailable"), ("OPENAPI_INDEX", "openapi-index")])
def test_routes_are_an_enum_that_keeps_its_words(route, word):
    """Metric labels, logs and JSON keep the words; a comparison with one still holds."""
    member = routing.Route[route]
    assert getattr(routing, route) is member
    assert (member == word, str(member), f"{member}", json.dumps(member)) == (
        True, word, word, f'"{word}"')
    counter = Counter("t", "t", ["route"], registry=CollectorRegistry())
    counter.labels(member).inc()
    assert counter.labels(word)._value.get() == 1
