"""The admin listener: ``/metrics``, ``/healthz``, ``/livez``, ``/readyz``, ``/debug/mvproxy``
(``/peers``, ``/route``) and ``/``, the status page.

Separate from the main listener so that scraping and probes need no client
certificate and never compete with API traffic. Health endpoints answer like
kube-apiserver's: ``ok``, or with ``?verbose`` one ``[+]check ok`` line per check.

Plain HTTP without authentication, so two rules keep what it shows on the node:

- ``Host`` must be an IP literal (``127.0.0.1:9443``, ``[::1]``), ``localhost`` or a
  name in ``admin.allowedHosts``; anything else gets 421 (``host_allowed``). A
  browser on the node keeps a page's own name in ``Host`` when the attacker's DNS
  rebinds that name to 127.0.0.1, so the page cannot read ``/debug/mvproxy`` or the
  status page; probes, curl and Prometheus use addresses. A request without ``Host``
  (HTTP/1.0) comes from no browser and is answered.
- ``admin.metricsBindAddress`` serves ``/metrics`` alone (``metrics_app``), so the
  node IP can be scraped while the debug endpoints stay on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mvproxy import status, statuspage
from mvproxy.cache import CacheView, DiscoveryCache, ServerState
from mvproxy.logs import throttled
from mvproxy.metrics import Metrics

log = logging.getLogger(__name__)

Check = tuple[str, bool, str]

MISDIRECTED = ("421 Misdirected Request: this listener answers only for an IP address, "
               "localhost or a name in admin.allowedHosts\n")


def host_allowed(host: str | None, allowed: Collection[str]) -> bool:
    """Whether a ``Host`` value names this listener: an IPv4 literal, a bracketed IPv6
    literal or ``localhost``, with or without a port, or one of ``allowed`` (lowercase
    DNS names); None or empty (HTTP/1.0, no authority) too. Names are compared without
    case and a final dot."""
    if not host:
        return True
    host = host.lower()
    if host.startswith("["):
        literal, bracket, port = host[1:].partition("]")
        if not bracket or port and not (port[0] == ":" and _port(port[1:])):
            return False
        return _ip(literal, ipaddress.IPv6Address)
    name, colon, port = host.partition(":")
    if colon and not _port(port):
        return False
    if _ip(name, ipaddress.IPv4Address):
        return True
    name = name.removesuffix(".")
    return name == "localhost" or name in allowed


def _port(text: str) -> bool:
    return 0 < len(text) <= 5 and text.isascii() and text.isdigit()


def _ip(text: str, kind: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address]) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def host_check(allowed: Collection[str]) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Middleware answering 421 to a ``Host`` that ``host_allowed`` refuses (400 to
    several ``Host`` fields), before any handler runs."""
    names = frozenset(allowed)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        hosts = request.headers.getall("Host", [])
        if len(hosts) > 1:
            return _plain(400, "400 Bad Request: more than one Host field\n")
        if hosts and not host_allowed(hosts[0], names):
            throttled.warning(log, "admin request refused: its Host is not an IP address, "
                                   "localhost or in admin.allowedHosts",
                              host=hosts[0][:100], path=request.path[:100])
            return _plain(421, MISDIRECTED)
        return await handler(request)
    return check


def _plain(status_code: int, text: str) -> web.Response:
    return web.Response(status=status_code, text=text, content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff",
                                 "Cache-Control": "no-store"})


def health_response(request: web.Request, name: str, checks: list[Check]) -> web.Response:
    healthy = all(ok for _, ok, _ in checks)
    if "verbose" not in request.query and healthy:
        return web.Response(text="ok", content_type="text/plain")
    lines = [f"[+]{check} ok" if ok else f"[-]{check} failed: {why}" for check, ok, why in checks]
    lines.append(f"{name} check {'passed' if healthy else 'failed'}")
    return web.Response(status=200 if healthy else 503, text="\n".join(lines) + "\n",
                        content_type="text/plain")


def readiness_checks(cache: DiscoveryCache, draining: asyncio.Event) -> list[Check]:
    """Ready = the backend's discovery is held and its polls succeed, until shutdown
    begins (so load balancers drain us first). Peers never make a member unready: a
    member whose peers are down still serves everything its backend serves, and
    taking every member out because one peer is down would take the control plane
    down with it. Until every peer is polled once, requests go to the backend."""
    backend = cache.view().backend
    return [("ping", True, ""),
            ("backend-synced", backend.snapshot is not None,
             "the backend's discovery has not been fetched yet"),
            ("backend-reachable", not backend.polled or backend.reachable,
             "discovery polls of the backend are failing"),
            ("shutdown", not draining.is_set(), "shutting down")]


def debug_state(cache: DiscoveryCache) -> dict:
    """The cache as an operator wants to see it while debugging routing."""
    view, now = cache.view(), time.monotonic()

    def describe(state: ServerState) -> dict[str, object]:
        return {"polled": state.polled, "reachable": state.reachable,
                "hasSnapshot": state.snapshot is not None,
                "secondsSinceSuccess": None if state.last_success is None
                else round(now - state.last_success, 3),
                "groupVersions": 0 if state.snapshot is None
                else len(state.snapshot.group_versions)}
    return {"serverID": cache.server_id, "generation": view.generation, "synced": view.synced,
            "backend": describe(view.backend),
            "peers": {peer_id: describe(state) for peer_id, state in view.peers.items()}}


def json_response(document: dict, status_code: int = 200) -> web.Response:
    return web.Response(status=status_code, text=json.dumps(document, indent=2) + "\n",
                        content_type="application/json",
                        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"})


def route_response(view: CacheView, query: Mapping[str, str]) -> web.Response:
    """``/debug/mvproxy/route``: 400 with a JSON error for unusable input, never a 500."""
    try:
        return json_response(status.explain_route(view, query))
    except status.BadQuery as exc:
        return json_response({"error": str(exc)}, 400)


def page_response(document: dict) -> web.Response:
    return web.Response(text=statuspage.render(document), content_type="text/html",
                        charset="utf-8", headers=statuspage.HEADERS)


def metrics_handler(metrics: Metrics) -> Handler:
    """``/metrics`` of this process's registry."""
    async def handler(request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response
    return handler


def build_admin_app(cache: DiscoveryCache, metrics: Metrics, draining: asyncio.Event,
                    sources: status.Sources | None = None, *,
                    allowed_hosts: Collection[str] | None) -> web.Application:
    """The admin listener of one process; ``allowed_hosts`` None: no ``Host`` check
    (a worker's abstract Unix socket, which only its supervisor reaches)."""

    async def livez(request: web.Request) -> web.Response:
        return health_response(request, request.path.strip("/"), [("ping", True, "")])

    async def readyz(request: web.Request) -> web.Response:
        return health_response(request, "readyz", readiness_checks(cache, draining))

    async def debug(request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(debug_state(cache), indent=2) + "\n",
                            content_type="application/json")

    def peers_document() -> dict:
        families = list(metrics.registry.collect())
        return status.peers_document(cache.view(), sources=sources() if sources else None,
                                     reroutes=status.reroutes(families),
                                     connections=status.connections(families))

    async def peers(request: web.Request) -> web.Response:
        return json_response(peers_document())

    async def route(request: web.Request) -> web.Response:
        return route_response(cache.view(), request.query)

    async def page(request: web.Request) -> web.Response:
        return page_response(peers_document())

    return admin_app(page=page, peers=peers, route=route, metrics=metrics_handler(metrics),
                     livez=livez, readyz=readyz, debug=debug, allowed_hosts=allowed_hosts)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_app(*, page: Handler, peers: Handler, route: Handler, metrics: Handler,
              livez: Handler, readyz: Handler, debug: Handler,
              allowed_hosts: Collection[str] | None) -> web.Application:
    """The admin listener's paths, one table for a single process and for the
    ``--workers`` supervisor alike, so the two can never serve different paths.
    ``allowed_hosts``: checked on every request (``host_check``) unless None."""
    app = web.Application(middlewares=[] if allowed_hosts is None
                          else [host_check(allowed_hosts)])
    for path, handler in (("/", page), ("/debug/mvproxy/peers", peers),
                          ("/debug/mvproxy/route", route), ("/metrics", metrics),
                          ("/healthz", livez), ("/livez", livez), ("/readyz", readyz),
                          ("/debug/mvproxy", debug)):
        app.router.add_get(path, handler)
    return app


def metrics_app(metrics: Handler, *, allowed_hosts: Collection[str]) -> web.Application:
    """``admin.metricsBindAddress``: ``/metrics`` and nothing else (404), behind the
    same ``Host`` check, for a scraper off the node."""
    app = web.Application(middlewares=[host_check(allowed_hosts)])
    app.router.add_get("/metrics", metrics)
    return app
