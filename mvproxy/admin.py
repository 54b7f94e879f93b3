"""The admin listener: ``/metrics``, ``/healthz``, ``/livez``, ``/readyz``, ``/debug/mvproxy``
(``/peers``, ``/route``) and ``/``, the status page.

Separate from the main listener so that scraping and probes need no client
certificate and never compete with API traffic. Health endpoints answer like
kube-apiserver's: ``ok``, or with ``?verbose`` one ``[+]check ok`` line per check.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mvproxy import status, statuspage
from mvproxy.cache import CacheView, DiscoveryCache, ServerState
from mvproxy.metrics import Metrics

Check = tuple[str, bool, str]


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


def build_admin_app(cache: DiscoveryCache, metrics: Metrics, draining: asyncio.Event,
                    sources: status.Sources | None = None) -> web.Application:
    async def metrics_handler(request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(metrics.registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def livez(request: web.Request) -> web.Response:
        return health_response(request, request.path.strip("/"), [("ping", True, "")])

    async def readyz(request: web.Request) -> web.Response:
        return health_response(request, "readyz", readiness_checks(cache, draining))

    async def debug(request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(debug_state(cache), indent=2) + "\n",
                            content_type="application/json")

    def peers_document() -> dict:
        return status.peers_document(cache.view(), sources=sources() if sources else None,
                                     reroutes=status.reroutes(metrics.registry.collect()))

    async def peers(request: web.Request) -> web.Response:
        return json_response(peers_document())

    async def route(request: web.Request) -> web.Response:
        return route_response(cache.view(), request.query)

    async def page(request: web.Request) -> web.Response:
        return page_response(peers_document())

    return admin_app(page=page, peers=peers, route=route, metrics=metrics_handler,
                     livez=livez, readyz=readyz, debug=debug)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_app(*, page: Handler, peers: Handler, route: Handler, metrics: Handler,
              livez: Handler, readyz: Handler, debug: Handler) -> web.Application:
    """The admin listener's paths, one table for a single process and for the
    ``--workers`` supervisor alike, so the two can never serve different paths."""
    app = web.Application()
    for path, handler in (("/", page), ("/debug/mvproxy/peers", peers),
                          ("/debug/mvproxy/route", route), ("/metrics", metrics),
                          ("/healthz", livez), ("/livez", livez), ("/readyz", readyz),
                          ("/debug/mvproxy", debug)):
        app.router.add_get(path, handler)
    return app
