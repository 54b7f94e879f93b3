"""Metrics that dashboards and alerts written for upstream can use, on a running daemon.

Upstream kube-apiserver 1.36 defines its MVP metrics in
``staging/src/k8s.io/apiserver/pkg/util/peerproxy/metrics/metrics.go`` (the
``apiserver_*`` three) and ``staging/src/k8s.io/apiserver/pkg/endpoints/discovery/
aggregated/metrics.go`` (the ``aggregator_discovery_*`` ones); docs/operations.md ("Upstream's MVP
metrics, compared") is the table read from them. The daemon runs between the fakes of
``daemon_support`` (loopback only; every server is stopped at teardown); waits are bounded loops.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
from aiohttp import web
from daemon_support import (
    PEER_ID,
    PODGROUPS,
    PODGROUPS_GVR,
    WAIT,
    Cluster,
    cluster,
    cut_short,
    ready,
)
from prometheus_client.parser import text_string_to_metric_families

from mvproxy.discovery import AGGREGATED_V2, AGGREGATED_V2BETA1, PEER_ACCEPT

GVR = ("group", "version", "resource")
SAME = "same"
UPSTREAM_136 = (
    # (name, type, label names, the values upstream gives ``type``, what mvproxy exports)
    ("apiserver_rerouted_request_total", "counter", {"code", *GVR}, None, SAME),
    ("apiserver_peer_proxy_errors_total", "counter", {"type", *GVR},
     {"endpoint_resolution", "proxy_transport"}, SAME),
    ("apiserver_peer_discovery_sync_errors_total", "counter", {"type"},
     {"lease_list", "hostport_resolution", "fetch_discovery"}, SAME),
    ("aggregator_discovery_peer_aggregated_cache_hits_total", "counter", set(), None, SAME),
    ("aggregator_discovery_peer_aggregated_cache_misses_total", "counter", set(), None, SAME),
    ("aggregator_discovery_nopeer_requests_total", "counter", set(), None, SAME),
    ("aggregator_discovery_aggregation_count_total", "counter", set(), None,
     "not exported: it counts regenerations of the local aggregated document; mvproxy "
     "regenerates none (the backend's own /metrics has it; merges are cache misses)"),
)
"""Upstream 1.36's MVP metrics and every deliberate difference in what mvproxy exports;
docs/operations.md ("Upstream's MVP metrics, compared") also says when each one moves."""
OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"

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
        return await cut_short(request, b'{"kind":"PodGroup"')

    app.router.add_get("/apis/scheduling.k8s.io/v1alpha2/podgroups", watch)
    app.router.add_post(PODGROUPS, slow_create)
    app.router.add_get(PODGROUPS + "/cut", cut)


def exported(text: str) -> dict[str, tuple[str, set[str], list[dict[str, str]]]]:
    """Sample name -> (type, label names, label sets) of one exposition."""
    found = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = [sample.labels for sample in family.samples]
        found[name] = (family.type, {k for sample in labels for k in sample}, labels)
    return found


async def test_exported_names_types_and_labels_match_upstream_136(aiohttp_server, root):
    """Every metric of upstream's metrics.go files (module docstring) is exported with
    its name, type and label names, ``type`` only takes upstream's values, and every
    difference is stated in ``UPSTREAM_136``. Each labelled metric gets a sample first."""
    async with cluster(aiohttp_server, root, staleAfter="300ms") as c:
        await ready(c)
        assert (await c.get(PODGROUPS))[0] == 200
        assert (await c.get("/apis", headers={"Accept": AGGREGATED_V2}))[0] == 200
        assert (await c.get("/apis", headers={"Accept": NOPEER_V2}))[0] == 200
        c.health["mode"] = "garbage"  # the peer's discovery breaks: counted, then unreachable

        async def peer_unreachable() -> bool:
            return not (await c.debug())["peers"][PEER_ID]["reachable"]

        await c.until(peer_unreachable, "the peer to be marked unreachable")
        assert (await c.get(PODGROUPS))[0] == 503  # capable peer unreachable

        _, text = await c.admin_get("/metrics")
        found = exported(text)
        for name, kind, labels, type_values, exports in UPSTREAM_136:
            if exports != SAME:
                assert exports.startswith("not exported") and name not in found, name
                continue
            assert name in found, name
            got_kind, got_labels, samples = found[name]
            assert got_kind == kind, name
            assert samples, f"{name}: no sample to read its labels from"
            assert got_labels == labels, name
            if type_values is not None:
                assert {sample["type"] for sample in samples} <= type_values, name


def test_the_operations_page_compares_every_upstream_metric():
    """docs/operations.md's table has a row per metric of upstream's
    peerproxy/metrics/metrics.go and discovery/aggregated/metrics.go, with its type and
    any difference in export."""
    page = OPERATIONS.read_text()
    table = page[page.index("\n## Upstream's MVP metrics, compared"):]
    for name, kind, _, _, exports in UPSTREAM_136:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"| {kind} |" in row, name
        assert ("| not exported" in row) == (exports != SAME), name


async def test_every_nopeer_discovery_request_is_counted_once(aiohttp_server, root):
    """Upstream's discovery wrapper counts ``aggregator_discovery_nopeer_requests_total``
    for every aggregated v2 request with ``profile=nopeer``, on ``/apis`` and ``/api``,
    whatever the method or serializer, and peers' polls are such requests
    (staging/src/k8s.io/apiserver/pkg/endpoints/discovery/aggregated/metrics.go,
    wrapper.go)."""
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
