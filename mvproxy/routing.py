"""Where a request goes: the decision order of docs/routing.md, as a pure function.

``decide`` reads one ``CacheView`` and the request's ``RequestInfo`` and returns a
``Decision``; it does no I/O, so it is table-tested without sockets and can move
under a faster byte-moving layer unchanged. Every lookup is a dict or set probe:
the cost does not grow with the number of resources.

1. ``GET``/``HEAD`` ``/api`` or ``/apis`` -> the discovery handler, from peers too (it
   answers them from the backend): as upstream's discovery wrapper, it sees and counts
   every discovery request, a peer's ``profile=nopeer`` poll included.
2. From an authenticated peer with ``x-kubernetes-peer-proxied: true`` -> backend;
   ``GET /openapi/v3`` -> the backend's OpenAPI index plus peer-only group/versions
   (``openapi``).
3. Before the first complete sync -> backend (a cold start never invents a 404 or 503).
4. ``GET /apis/<g>`` -> the discovery handler: for a group some server lists, the
   merged ``APIGroup``, so it agrees with the merged ``/apis``; for any other group,
   the backend's answer, but never its ``APIGroup`` of a group no server's discovery
   lists (``TO_GROUP_UNLISTED``); ``GET /apis/<g>/<v>``
   (``/api/<v>``) of a group/version the backend serves while peers serve resources
   or subresources of it that the backend does not -> the discovery handler (the
   backend's ``APIResourceList`` plus those); ``/apis/<g>/<v>``,
   ``/openapi/v3/apis/<g>/<v>`` (and other forms of ``/apis/<g>``: ``HEAD``, a
   trailing slash) -> backend if it serves the group (version), else a capable peer.
5. Resource requests -> backend if it serves group/version/resource *and* the
   subresource (but while the backend is failing, the reachable peers that serve it
   too, if any: ``BACKEND_FAILING``); else the capable reachable peers in
   random order (the first is tried, the rest are failover); capable peers that are
   all unreachable -> 503; nobody serves it -> backend, whose 404 is then genuine.
   ``fallback_peers`` gives the handler the same peers when a request the backend
   should have served never reached it (or it refused it while shutting down).
6. Anything else -> backend.

**Without credentials** (``credentials=False``: the downstream is neither a peer nor
a certificate user and sent no ``Authorization``), what only peers serve is never
forwarded to a peer nor answered 503 (rules 4 and 5): it goes to the backend, whose
answer under its own anonymous policy (401, 403 or 404) is exactly what it gives for
something nobody serves. Upstream kube-apiserver authorizes before it proxies to a
peer; mvproxy cannot, so otherwise the peer hop's extra time, or the 503 naming
unreachable peers, would tell an anonymous client which group/versions and resources
only peers serve, which merged discovery refuses to show it. ``GET /apis/<g>``, ``/api``,
``/apis`` and the ``/openapi/v3`` index are unchanged: their handlers ask the backend
the same request (query included) with the client's credentials first and relay its
refusal.

A request with a bearer token as kube-apiserver reads one (``identity.has_credentials``:
another scheme is anonymous to it, so here too), valid or not, still goes to peers:
mvproxy does not authenticate tokens (the backend, or the peer's backend, does), so
it cannot tell a junk token from a real one. An invalid token therefore remains an
oracle, if a weaker one: the refusal is the same 401 from any server, but the peer
hop's timing, and the 503 when every capable peer is down, still differ, and anyone
can send a junk token.
It costs the prober a failed authentication in the peer's backend (audited there when
auditing is on). Closing it needs mvproxy to ask its backend about the token first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from mvproxy.cache import CacheView
from mvproxy.requestinfo import RequestInfo


class Route(StrEnum):
    """Where a request goes. The values are the ``route`` label of the request metrics
    and the word in logs: a member equals its string."""

    BACKEND = "backend"
    PEER = "peer"
    DISCOVERY = "discovery"
    UNAVAILABLE = "unavailable"
    OPENAPI_INDEX = "openapi-index"


BACKEND, PEER, DISCOVERY = Route.BACKEND, Route.PEER, Route.DISCOVERY
UNAVAILABLE, OPENAPI_INDEX = Route.UNAVAILABLE, Route.OPENAPI_INDEX


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to send one request, and why (the reason is for V(4) logs and tests)."""

    route: Route
    reason: str
    peers: tuple[str, ...] = ()
    """For ``PEER``: candidates in the order to try; for ``UNAVAILABLE``: the capable peers."""


TO_BACKEND_PEER_PROXIED = Decision(BACKEND, "peer-proxied")
TO_DISCOVERY = Decision(DISCOVERY, "discovery")
TO_GROUP_DISCOVERY = Decision(DISCOVERY, "group discovery")
TO_GROUP_UNLISTED = Decision(DISCOVERY, "group listed by nobody")
"""``GET /apis/<g>`` of a group no server's discovery lists: the backend decides (its
refusal or 404 is relayed), but its ``APIGroup`` becomes a 404, since nothing of the
group can be got (see ``discoveryhandler``)."""
TO_RESOURCE_LIST = Decision(DISCOVERY, "group/version resources merged")
"""``GET /apis/<g>/<v>`` of a group/version the backend serves while peers serve more
of it: the backend's ``APIResourceList`` plus what only peers list."""
TO_OPENAPI_INDEX = Decision(OPENAPI_INDEX, "openapi index")
OPENAPI_MERGED = "openapi group/version merged"
"""``GET /openapi/v3/apis/<g>/<v>`` of a group/version the backend serves while a
reachable peer serves more of it: the backend's document plus the peer's paths and
schemas for what only peers serve (``Decision.peers``: those peers, to try in order)."""
TO_BACKEND_UNSYNCED = Decision(BACKEND, "not synced")
TO_BACKEND_LOCAL = Decision(BACKEND, "served locally")
TO_BACKEND_NOBODY = Decision(BACKEND, "served by nobody")
TO_BACKEND_NO_CREDENTIALS = Decision(BACKEND, "no credentials")
"""Only peers serve it, and the client sent no credentials: answered as by a server
that does not serve it (see the module docstring)."""
TO_BACKEND_OTHER = Decision(BACKEND, "not an API request")
BACKEND_FAILING = "backend failing"
"""The reason of a ``PEER`` decision for what the backend serves, taken while the
backend is failing: its last discovery poll failed, or a request found it refusing
connections or shutting down, and no poll has succeeded since (compared by identity).
Its snapshot is not to be trusted then: a backend that restarted as another version
(a rolling upgrade's step, a rollback) may no longer serve what it listed, and a
request sent there would get its 404 until the next poll."""

_DISCOVERY_PATHS = frozenset(("/api", "/api/", "/apis", "/apis/"))
_OPENAPI_INDEX_PATHS = frozenset(("/openapi/v3", "/openapi/v3/"))
_OPENAPI_V3 = ("openapi", "v3", "apis")
_OPENAPI_V3_CORE = ("openapi", "v3", "api")


def decide(info: RequestInfo, view: CacheView, *, peer_proxied: bool, credentials: bool,
           rng: random.Random | None = None) -> Decision:
    """The route for one request (see the module docstring for the order).

    ``credentials``: the downstream is a peer or a certificate user, or the request
    carries ``Authorization`` (``identity.has_credentials``); without, nothing goes to
    a peer. Required, so that no caller forgets what an anonymous client may learn."""
    if info.path in _DISCOVERY_PATHS and info.verb in ("get", "head"):
        return TO_DISCOVERY
    if peer_proxied:
        return TO_BACKEND_PEER_PROXIED
    if info.path in _OPENAPI_INDEX_PATHS and info.verb == "get":
        return TO_OPENAPI_INDEX
    local = view.backend.snapshot
    if not view.synced or local is None:
        return TO_BACKEND_UNSYNCED
    if info.is_resource_request:
        if local.serves(info.api_group, info.api_version, info.resource, info.subresource):
            backend = view.backend
            if backend.reachable and backend.last_error is None or not credentials:
                return TO_BACKEND_LOCAL
            peers = fallback_peers(info, view, rng)
            return Decision(PEER, BACKEND_FAILING, peers) if peers else TO_BACKEND_LOCAL
        capable = view.capable_peers(info.api_group, info.api_version, info.resource,
                                     info.subresource)
        return _among(capable, view, credentials, rng)
    if is_group_discovery(info):
        known = info.api_group in view.local_groups or view.capable_group_peers(info.api_group)
        return TO_GROUP_DISCOVERY if known else TO_GROUP_UNLISTED
    if is_resource_list(info) and local.serves_group_version(info.api_group, info.api_version):
        if view.peer_only_resources(info.api_group, info.api_version):
            return TO_RESOURCE_LIST
        return TO_BACKEND_LOCAL
    group_version = group_version_path(info)
    if group_version is None:
        return TO_BACKEND_OTHER
    if credentials and info.verb == "get" and is_openapi_document(info.path):
        peers = openapi_peers(view, *group_version)
        if peers:
            return Decision(OPENAPI_INDEX, OPENAPI_MERGED, peers)
    return _decide_group_version(*group_version, view, credentials, rng)


def fallback_peers(info: RequestInfo, view: CacheView,
                   rng: random.Random | None = None) -> tuple[str, ...]:
    """The reachable peers that serve this resource request (and subresource), in
    random order: where a request the backend serves may go when the backend cannot
    take it. Empty for anything but a resource request. The caller checks that the
    request has credentials (an anonymous one never reaches a peer)."""
    if not info.is_resource_request:
        return ()
    reachable = [peer for peer in view.capable_peers(info.api_group, info.api_version,
                                                     info.resource, info.subresource)
                 if peer in view.reachable]
    if len(reachable) > 1:
        (rng or random).shuffle(reachable)
    return tuple(reachable)


def is_group_discovery(info: RequestInfo) -> bool:
    """``GET /apis/<g>``: a legacy ``APIGroup`` request, as clients send it.

    Only this exact form: the backend is asked the same request first to authorize the
    client, and kube-apiserver's refusal names the verb and the path, so a ``HEAD`` or
    ``/apis/<g>/`` answered from a ``GET /apis/<g>`` probe would refuse differently for
    a group only peers serve than for an unknown one (an anonymous oracle). Those
    forms take the group/version route instead, where a request without credentials
    goes to the backend. This form needs no such rule: without credentials the probe
    gets the backend's own refusal, relayed as is, the same as for an unknown group
    (which goes to the backend), and no peer is asked."""
    group = info.api_group
    return bool(group) and info.verb == "get" and info.path == f"/apis/{group}"


def is_resource_list(info: RequestInfo) -> bool:
    """``GET /apis/<g>/<v>`` or ``GET /api/<v>`` (a trailing slash too): a legacy
    ``APIResourceList`` request (kr8s, the Python ``DynamicClient``, kubectl before
    aggregated discovery)."""
    if info.verb != "get" or info.is_resource_request or not info.api_version:
        return False
    if info.api_prefix == "apis" and info.api_group:
        expected = f"/apis/{info.api_group}/{info.api_version}"
    elif info.api_prefix == "api" and not info.api_group:
        expected = f"/api/{info.api_version}"
    else:
        return False
    return info.path in (expected, expected + "/")


def group_version_path(info: RequestInfo) -> tuple[str, str] | None:
    """(group, version or "") for ``/apis/<g>[/<v>]``, ``/openapi/v3/apis/<g>/<v>`` and
    ``/openapi/v3/api/<v>`` (the core group)."""
    if info.api_prefix == "apis" and info.api_group:
        return info.api_group, info.api_version
    segments = info.path.strip("/").split("/")
    if len(segments) == 5 and tuple(segments[:3]) == _OPENAPI_V3:
        return segments[3], segments[4]
    if len(segments) == 4 and tuple(segments[:3]) == _OPENAPI_V3_CORE:
        return "", segments[3]
    return None


def is_openapi_document(path: str) -> bool:
    """``/openapi/v3/apis/<g>/<v>`` or ``/openapi/v3/api/<v>`` (no trailing slash)."""
    segments = path.split("/")
    return (len(segments) == 6 and tuple(segments[1:4]) == _OPENAPI_V3) or \
        (len(segments) == 5 and tuple(segments[1:4]) == _OPENAPI_V3_CORE)


def openapi_peers(view: CacheView, group: str, version: str) -> tuple[str, ...]:
    """Reachable peers that serve everything of ``group``/``version`` that only peers
    serve, when the backend serves it too (then its OpenAPI document lacks those):
    whose document completes the backend's. Empty otherwise."""
    local = view.backend.snapshot
    if not view.synced or local is None or not local.serves_group_version(group, version):
        return ()
    extra = view.peer_only_resources(group, version)
    if not extra:
        return ()
    wanted = {tuple(e["name"].split("/", 1)) for e in extra}
    peers = [peer for peer in sorted(view.reachable) if all(
        peer in view.capable_peers(group, version, *gvr) for gvr in wanted)]
    return tuple(peers)


def _decide_group_version(group: str, version: str, view: CacheView, credentials: bool,
                          rng: random.Random | None) -> Decision:
    local = view.backend.snapshot
    if version:
        if local is not None and local.serves_group_version(group, version):
            return TO_BACKEND_LOCAL
        return _among(view.capable_group_version_peers(group, version), view, credentials,
                      rng)
    if local is not None and group in view.local_groups:
        return TO_BACKEND_LOCAL
    return _among(view.capable_group_peers(group), view, credentials, rng)


def _among(capable: tuple[str, ...], view: CacheView, credentials: bool,
           rng: random.Random | None) -> Decision:
    if not capable:
        return TO_BACKEND_NOBODY
    if not credentials:  # before reachability: an outage must not show either
        return TO_BACKEND_NO_CREDENTIALS
    reachable = [peer for peer in capable if peer in view.reachable]
    if not reachable:
        return Decision(UNAVAILABLE, "capable peers unreachable", capable)
    if len(reachable) > 1:
        (rng or random).shuffle(reachable)
    return Decision(PEER, "served by peers", tuple(reachable))
