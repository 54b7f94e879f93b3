"""Metrics that dashboards and alerts written for upstream can use, on a running daemon.

Upstream kube-apiserver 1.36 defines its MVP metrics in
``staging/src/k8s.io/apiserver/pkg/util/peerproxy/metrics/metrics.go`` (the
``apiserver_*`` three) and ``staging/src/k8s.io/apiserver/pkg/endpoints/discovery/
aggregated/metrics.go`` (the ``aggregator_discovery_*`` ones); upstream-mvp.md §6 is
the table read from them. The daemon runs between the fakes of ``daemon_support``
(loopback only; every server is stopped at teardown); waits are bounded loops.
"""

from __future__ import annotations

from daemon_support import (  # root: the module's PKI fixture
    cluster,
    ready,
    root,  # noqa: F401
)

from mvproxy.discovery import AGGREGATED_V2, AGGREGATED_V2BETA1, PEER_ACCEPT

NOPEER_V2 = AGGREGATED_V2 + ";profile=nopeer"
PROTOBUF_NOPEER_V2 = NOPEER_V2.replace("application/json", "application/vnd.kubernetes.protobuf")


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
