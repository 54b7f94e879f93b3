"""Metrics that dashboards and alerts written for upstream can use, on a running daemon.

Upstream kube-apiserver 1.36 defines its MVP metrics in
``staging/src/k8s.io/apiserver/pkg/util/peerproxy/metrics/metrics.go`` (the
``apiserver_*`` three) and ``staging/src/k8s.io/apiserver/pkg/endpoints/discovery/
aggregated/metrics.go`` (the ``aggregator_discovery_*`` ones); upstream-mvp.md §6 is
the table read from them. The daemon runs between the fakes of ``daemon_support``
(loopback only; every server is stopped at teardown); waits are bounded loops.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web
from daemon_support import (  # root: the module's PKI fixture
    PODGROUPS,
    PODGROUPS_GVR,
    WAIT,
    Cluster,
    cluster,
    ready,
    root,  # noqa: F401
)

from mvproxy.discovery import AGGREGATED_V2, AGGREGATED_V2BETA1, PEER_ACCEPT

NOPEER_V2 = AGGREGATED_V2 + ";profile=nopeer"
PROTOBUF_NOPEER_V2 = NOPEER_V2.replace("application/json", "application/vnd.kubernetes.protobuf")
EVENT = b'{"type":"ADDED","object":{}}\n'


def peer_routes(app: web.Application) -> None:
    """Peer answers for the rerouted-request cases: a quiet watch, a slow create, a
    response cut after its head."""

    async def watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(EVENT)
        await asyncio.sleep(WAIT)
        return response

    async def slow_create(request: web.Request) -> web.Response:
        await asyncio.sleep(WAIT)
        return web.json_response({}, status=201)

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 100_000
        await response.prepare(request)
        await response.write(b'{"kind":"PodGroup"')
        request.transport.close()
        return response

    app.router.add_get("/apis/scheduling.k8s.io/v1alpha2/podgroups", watch)
    app.router.add_post(PODGROUPS, slow_create)
    app.router.add_get(PODGROUPS + "/cut", cut)


async def test_every_nopeer_discovery_request_is_counted_once(aiohttp_server, root):
    """Upstream's discovery wrapper counts ``aggregator_discovery_nopeer_requests_total``
    for every aggregated v2 request with ``profile=nopeer``, on ``/apis`` and ``/api``,
    whatever the method or serializer, and peers' polls are such requests
    (staging/src/k8s.io/apiserver/pkg/endpoints/discovery/aggregated/metrics.go,
    wrapper.go; upstream-mvp.md §4.3, §5.1)."""
    name = "aggregator_discovery_nopeer_requests_total"
    polled = {"x-kubernetes-peer-proxied": "true", "Accept": PEER_ACCEPT}
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        before = await c.metric(name) or 0
        counted = [("GET", "/apis", "peer", polled), ("GET", "/api", "peer", polled),
                   ("GET", "/apis", "admin", {"Accept": NOPEER_V2}),
                   ("HEAD", "/apis", "admin", {"Accept": NOPEER_V2}),
                   ("GET", "/api", "admin", {"Accept": NOPEER_V2}),
                   ("GET", "/apis", "admin", {"Accept": PROTOBUF_NOPEER_V2})]
        not_counted = [("GET", "/apis", "admin", {"Accept": AGGREGATED_V2}),
                       ("GET", "/apis", "admin", {"Accept": AGGREGATED_V2BETA1
                                                  + ";profile=nopeer"})]
        for method, path, who, headers in counted + not_counted:
            async with c.sessions[who].request(method, c.base + path, headers=headers) as r:
                assert r.status == 200, (method, path, who, headers)
        assert await c.metric(name) == before + len(counted)


async def test_rerouted_requests_count_the_status_the_client_received(aiohttp_server, root):
    """``apiserver_rerouted_request_total{code}`` is the status the client got
    (upstream counts its response writer's status when the proxy returns:
    staging/src/k8s.io/apiserver/pkg/util/peerproxy/metrics/metrics.go): a timeout is
    504, a response cut after its head keeps its 200, and a watch the client closes
    counts when it ends."""
    async with cluster(aiohttp_server, root, timeouts={"request": "500ms"},
                       peer_routes=peer_routes) as c:
        await ready(c)

        async def rerouted(code: str) -> float:
            return await c.metric("apiserver_rerouted_request_total", code=code,
                                  **PODGROUPS_GVR) or 0

        async with c.sessions["admin"].post(c.base + PODGROUPS, json={}) as resp:
            assert resp.status == 504
        assert await rerouted("504") == 1

        with contextlib.suppress(aiohttp.ClientError):
            async with c.sessions["admin"].get(c.base + PODGROUPS + "/cut") as resp:
                assert resp.status == 200
                await resp.read()
        await c.until(lambda: _at_least(rerouted("200"), 1), "the cut response counted")

        # Two watches: one may go on the pooled connection (callbacks), the other
        # opens a connection (coroutine); the client closes both.
        watch = c.base + "/apis/scheduling.k8s.io/v1alpha2/podgroups?watch=true"
        await open_and_close_watches(c, watch, count=2)
        await c.until(lambda: _at_least(rerouted("200"), 3), "both closed watches counted")
        assert await rerouted("503") == 0


async def open_and_close_watches(c: Cluster, url: str, *, count: int) -> None:
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(count):
            resp = await stack.enter_async_context(c.sessions["admin"].get(url))
            assert resp.status == 200 and await resp.content.readline() == EVENT
            resp.close()  # the client leaves; mvproxy learns it when the socket closes


async def _at_least(value, expected: float) -> bool:
    return await value >= expected
