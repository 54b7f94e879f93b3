"""The assembled daemon, in process: ``app.running(build_daemon(cfg))`` between fakes.

A fake backend (1.35 discovery; requires the front-proxy client certificate, like a
kube-apiserver with requestheader authentication) and a fake peer (1.36 discovery;
requires a cluster-CA client certificate, like a peer's mvproxy) run as aiohttp
servers on 127.0.0.1 over TLS from a development PKI. Both echo what they received,
so a test sees where a request went and with which identity. Every server is an
``aiohttp_server`` fixture server (stopped at teardown); the daemon runs inside
``running``, which stops its listeners and poller on exit. Waits for the poller are
bounded loops; nothing asserts on durations.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging

import aiohttp
import pytest
from aiohttp import web
from daemon_support import (
    PEER_ID,
    PODGROUPS,
    PODGROUPS_GVR,
    WAIT,
    Cluster,
    backend_synced,
    cluster,
    header,
    synced,
)

from mvproxy import devpki
from mvproxy.app import _peer_upstreams, build_daemon, freeze_startup_heap
from mvproxy.configfile import load_config
from mvproxy.membership import Peer, StaticMembership


async def test_routes_by_capability_with_verified_identity(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        # The peer's first poll hangs: everything goes to the backend, and the member
        # is ready once its backend is synced (peers never make it unready).
        await c.until(lambda: backend_synced(c), "the backend's first poll")
        status, text = await c.admin_get("/readyz?verbose")
        assert status == 200 and "[+]backend-synced ok" in text
        status, _, body = await c.get(PODGROUPS)
        assert status == 200 and json.loads(body)["server"] == "backend"
        assert (await c.admin_get("/livez")) == (200, "ok")

        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")

        # A cert user asking for a GVR only the peer serves: forwarded, vouched for.
        status, _, body = await c.get(PODGROUPS + "?limit=5&labelSelector=a%3Db", headers={
            "X-Remote-User": "system:evil", "X-Remote-Group": "system:masters",
            "x-kubernetes-peer-proxied": "true"})
        echoed = json.loads(body)
        assert status == 200 and echoed["server"] == "peer"
        assert echoed["path"] == PODGROUPS + "?limit=5&labelSelector=a%3Db"
        assert echoed["cn"] == devpki.FRONT_PROXY_CLIENT_CN
        assert header(echoed, "x-kubernetes-peer-proxied") == ["true"]
        assert header(echoed, "X-Remote-User") == ["kubernetes-admin"]
        assert header(echoed, "X-Remote-Group") == ["system:masters"]
        assert len(header(echoed, "Audit-ID")) == 1

        # A bearer client: the token goes through, no identity is asserted for it.
        status, _, body = await c.get(PODGROUPS, who="bearer",
                                      headers={"Authorization": "Bearer t0ken"})
        echoed = json.loads(body)
        assert status == 200 and echoed["server"] == "peer"
        assert header(echoed, "Authorization") == ["Bearer t0ken"]
        assert header(echoed, "X-Remote-User") == []

        # What the backend serves stays local, asserted with the front-proxy certificate.
        status, _, body = await c.get("/api/v1/namespaces/default/pods")
        echoed = json.loads(body)
        assert status == 200 and echoed["server"] == "backend"
        assert echoed["cn"] == devpki.FRONT_PROXY_CLIENT_CN
        assert header(echoed, "X-Remote-User") == ["kubernetes-admin"]
        assert header(echoed, "x-kubernetes-peer-proxied") == []

        # A peer's mvproxy that already chose us: served locally, its identity believed.
        status, _, body = await c.get(PODGROUPS, who="peer", headers={
            "x-kubernetes-peer-proxied": "true", "X-Remote-User": "alice",
            "X-Remote-Group": "viewer", "Audit-ID": "from-peer"})
        echoed = json.loads(body)
        assert status == 200 and echoed["server"] == "backend"
        assert header(echoed, "X-Remote-User") == ["alice"]
        assert header(echoed, "X-Remote-Group") == ["viewer"]
        assert header(echoed, "x-kubernetes-peer-proxied") == ["true"]
        assert header(echoed, "Audit-ID") == ["from-peer"]

        assert await c.metric("apiserver_rerouted_request_total", code="200",
                              **PODGROUPS_GVR) == 2
        assert await c.metric("mvproxy_peer_up", peer=PEER_ID) == 1


@pytest.mark.parametrize("known_down", [False, True], ids=[
    "peer stops between polls: connect failure, 503",
    "peer known unreachable: 503 without trying it"])
async def test_peer_gone_gives_503_with_retry_after(aiohttp_server, root, known_down):
    # staleAfter decides whether the cache notices the peer is gone before the request.
    stale = {"staleAfter": "300ms"} if known_down else {"staleAfter": "1h", "forgetAfter": "2h"}
    async with cluster(aiohttp_server, root, **stale) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        status, _, _ = await c.get(PODGROUPS)
        assert status == 200

        await c.peer_server.close()
        if known_down:
            async def peer_unreachable() -> bool:
                return not (await c.debug())["peers"][PEER_ID]["reachable"]
            await c.until(peer_unreachable, "the peer to be marked unreachable")

        status, headers, body = await c.get(PODGROUPS)
        assert status == 503
        assert headers["Retry-After"].isdigit() and int(headers["Retry-After"]) > 0
        assert headers["Content-Type"] == "application/json"
        status_body = json.loads(body)
        assert {k: status_body[k] for k in ("kind", "apiVersion", "status", "reason", "code")} \
            == {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "ServiceUnavailable", "code": 503}

        errors = {kind: await c.metric("apiserver_peer_proxy_errors_total", type=kind,
                                       **PODGROUPS_GVR)
                  for kind in ("endpoint_resolution", "proxy_transport")}
        rerouted_503 = await c.metric("apiserver_rerouted_request_total", code="503",
                                      **PODGROUPS_GVR)
        if known_down:
            assert errors == {"endpoint_resolution": 1, "proxy_transport": None}
            assert rerouted_503 is None
            assert await c.metric("mvproxy_peer_up", peer=PEER_ID) == 0
        else:
            assert errors == {"endpoint_resolution": None, "proxy_transport": 1}
            assert rerouted_503 == 1
        assert await c.metric("apiserver_rerouted_request_total", code="200",
                              **PODGROUPS_GVR) == 1

        # The backend still serves what it has.
        status, _, body = await c.get("/api/v1/namespaces/default/pods")
        assert status == 200 and json.loads(body)["server"] == "backend"


async def test_metrics_expose_the_upstream_names(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        status, text = await c.admin_get("/metrics")
        assert status == 200
        for name in ("apiserver_rerouted_request_total", "apiserver_peer_proxy_errors_total",
                     "apiserver_peer_discovery_sync_errors_total",
                     "aggregator_discovery_peer_aggregated_cache_hits_total",
                     "aggregator_discovery_peer_aggregated_cache_misses_total",
                     "aggregator_discovery_nopeer_requests_total",
                     "mvproxy_peer_up", "mvproxy_request_duration_seconds"):
            assert f"# TYPE {name.removesuffix('_total')}" in text or \
                f"# TYPE {name}" in text, name
        assert "_created" not in text


async def test_a_request_that_timed_out_upstream_is_504_without_retry_after(aiohttp_server, root):
    """It may have been applied: Retry-After would make client-go send the POST again."""
    async with cluster(aiohttp_server, root, timeouts={"request": "300ms"}) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        async with c.sessions["admin"].post(c.base + "/api/v1/namespaces/default/configmaps",
                                            json={"kind": "ConfigMap"}) as resp:
            body = await resp.json()
            assert resp.status == 504 and "Retry-After" not in resp.headers
            assert "Server" not in resp.headers  # no stack banner
        assert body["reason"] == "Timeout" and body["code"] == 504


LONG_RUNNING = {
    # kube-apiserver's set (pkg/controlplane/apiserver/config.go, with
    # staging/src/k8s.io/apiserver/pkg/server/filters/longrunning.go): the watch and
    # proxy verbs, the attach, exec, log, portforward and proxy subresources, pprof.
    "log": "/api/v1/namespaces/ns/pods/p/log",
    "log follow": "/api/v1/namespaces/ns/pods/p/log?follow=true",
    "watch": "/api/v1/namespaces/ns/pods?watch=true",
    "exec": "/api/v1/namespaces/ns/pods/p/exec?command=date",
    "attach": "/api/v1/namespaces/ns/pods/p/attach",
    "portforward": "/api/v1/namespaces/ns/pods/p/portforward",
    "proxy subresource": "/api/v1/namespaces/ns/services/s/proxy/metrics",
    "proxy verb": "/api/v1/proxy/namespaces/ns/services/s",
    "pprof": "/debug/pprof/profile?seconds=30",
}
CONTROL = "/api/v1/namespaces/ns/pods/p"


async def test_long_running_requests_outlive_the_request_timeout(aiohttp_server, root):
    """Every request kube-apiserver treats as long-running streams past
    ``timeouts.request``; a plain GET streaming as slowly is cut (the control proves
    the deadline passed while every stream was open: no timing assumption)."""
    release = asyncio.Event()

    async def slow_stream(request):
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(b"first\n")
        await asyncio.wait_for(release.wait(), WAIT)
        await response.write(b"last\n")
        await response.write_eof()
        return response

    def routes(app):
        for path in {p.split("?")[0] for p in (*LONG_RUNNING.values(), CONTROL)}:
            app.router.add_route("*", path, slow_stream)

    async def fetch(c, path: str) -> bytes | str:
        try:
            async with c.sessions["admin"].get(c.base + path) as resp:
                assert resp.status == 200, (path, resp.status)
                return await resp.read()
        except aiohttp.ClientPayloadError as exc:
            return f"cut: {exc}"

    async with asyncio.timeout(WAIT), cluster(aiohttp_server, root, backend_routes=routes,
                                              timeouts={"request": "300ms"}) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        streams = {name: asyncio.create_task(fetch(c, path))
                   for name, path in LONG_RUNNING.items()}
        control = await fetch(c, CONTROL)
        assert isinstance(control, str) and control.startswith("cut"), control
        release.set()
        results = {name: await task for name, task in streams.items()}
    assert results == dict.fromkeys(LONG_RUNNING, b"first\nlast\n")


@pytest.mark.parametrize("grace", ["0s", "200ms"])
async def test_shutdown_ends_open_watches_after_the_grace_period(aiohttp_server, root, grace):
    """SIGTERM must finish within shutdownGracePeriod even while a watch stays open, and
    ends the watch cleanly."""
    watch_ended = asyncio.Event()

    async def watch(c: Cluster, opened: asyncio.Event) -> bytes:
        async with c.sessions["admin"].get(c.base + "/api/v1/configmaps?watch=true") as resp:
            await resp.content.readline()
            opened.set()
            try:
                return await resp.content.read()  # the stream's end, or ClientError
            finally:
                watch_ended.set()

    opened = asyncio.Event()
    async with asyncio.timeout(WAIT):
        async with cluster(aiohttp_server, root, timeouts={"shutdownGracePeriod": grace}) as c:
            task = asyncio.create_task(watch(c, opened))
            await opened.wait()
            status, text = await c.admin_get("/readyz?verbose")
            assert "[+]shutdown ok" in text
        # running() has returned: the listener drained and the watch was ended, between
        # two events, cleanly (the last chunk), as kube-apiserver ends a watch: the
        # client sees the stream end, not a broken connection, and simply watches again.
        await asyncio.wait_for(watch_ended.wait(), WAIT)
        assert await task == b""


async def test_metrics_expose_certificate_expiry_by_role(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        expiry = await c.metric("mvproxy_certificate_expiry_timestamp_seconds", role="serving")
        assert expiry is not None and expiry > 0
        assert await c.metric("mvproxy_certificate_expiry_timestamp_seconds",
                              role="peer-client") is not None


async def test_a_peer_that_refuses_connections_fails_over_to_the_next(aiohttp_server, root):
    """Two capable peers, one stopped before the cache notices: every request still
    succeeds, through the other one, and each detour is counted."""
    async with cluster(aiohttp_server, root, extra_peers=1, staleAfter="1h",
                       forgetAfter="2h") as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        await c.peer_server.close()
        served_by = set()
        for _ in range(12):  # shuffled per request (seeded): the dead one is first
            status, _, body = await c.get(PODGROUPS)  # in some of them
            assert status == 200
            served_by.add(json.loads(body)["server"])
        assert served_by == {"peer-0"}
        failovers = await c.metric("mvproxy_peer_failovers_total")
        assert failovers is not None and failovers >= 1
        assert await c.metric("apiserver_rerouted_request_total", code="200",
                              **PODGROUPS_GVR) == 12


async def test_a_dead_backend_writes_one_warning_not_one_per_request(aiohttp_server, root,
                                                                     caplog, monkeypatch):
    """Request-path warnings are throttled (``logs.throttled``): 20 discovery requests
    that the stopped backend cannot answer give 20 503s and one warning line."""
    from mvproxy.logs import throttled

    monkeypatch.setattr(throttled, "_last", {})
    monkeypatch.setattr(throttled, "_suppressed", {})
    nopeer = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList;profile=nopeer"
    async with cluster(aiohttp_server, root) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        await c.backend_server.close()
        with caplog.at_level(logging.WARNING):
            for _ in range(20):
                status, _, _ = await c.get("/apis", headers={"Accept": nopeer})
                assert status == 503
    lines = [r for r in caplog.records if r.getMessage() == "backend discovery request failed"]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


async def test_shutdown_cuts_a_stream_that_is_not_a_watch(aiohttp_server, root):
    """A log (or LIST) stream between two lines is not whole: shutdown cuts it, so the
    client cannot take the truncated body for a complete one."""
    async def log_stream(request):
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(b"line 1\n")
        await asyncio.sleep(WAIT)
        return response

    def routes(app):
        app.router.add_get("/api/v1/namespaces/ns/pods/p/log", log_stream)

    got: list[object] = []
    opened = asyncio.Event()

    async def read_log(c: Cluster) -> None:
        async with c.sessions["admin"].get(c.base + "/api/v1/namespaces/ns/pods/p/log") as resp:
            got.append(await resp.content.readline())
            opened.set()
            try:
                got.append(await resp.content.read())
            except aiohttp.ClientPayloadError as exc:
                got.append(exc)

    async with asyncio.timeout(WAIT):
        async with cluster(aiohttp_server, root, backend_routes=routes,
                           timeouts={"shutdownGracePeriod": "0s"}) as c:
            c.gate.set()
            await c.until(lambda: synced(c), "the first complete sync")
            task = asyncio.create_task(read_log(c))
            await opened.wait()
        await task
    assert got[0] == b"line 1\n" and isinstance(got[1], aiohttp.ClientPayloadError), got


# --------------------------------------------------------------------------- peer TLS


def _config_with(root, **settings):
    return load_config(None, overrides={
        "serverID": "a", "tlsCertFile": str(root / "a" / "mvproxy.crt"),
        "tlsPrivateKeyFile": str(root / "a" / "mvproxy.key"),
        "backend.url": "https://127.0.0.1:1", "backend.caFile": str(root / "ca.crt"),
        "backend.certFile": str(root / "a" / "front-proxy-client.crt"),
        "backend.keyFile": str(root / "a" / "front-proxy-client.key"), **settings})


PEER_FILES = {"peer.caFile": "ca.crt", "peer.clientCAFile": "front-proxy-ca.crt",
              "peer.certFile": "a/front-proxy-client.crt",
              "peer.keyFile": "a/front-proxy-client.key"}


@pytest.mark.parametrize("membership", [
    pytest.param({"peers.dns.name": "localhost"}, id="dns"),
    pytest.param({"peers.leases.enabled": True, "peer.advertiseURL": "https://127.0.0.1:2"},
                 id="leases"),
])
async def test_dynamic_membership_without_static_peers_reaches_peers_over_peer_tls(
        root, membership):
    """The issue's suspicion (peers get ssl_context=None without static peers): a
    dynamic source alone still builds the peer client context, and every peer the
    membership names becomes an Upstream with it."""
    files = {key: str(root / name) for key, name in PEER_FILES.items()}
    daemon = build_daemon(_config_with(root, **files, **membership))
    assert daemon.config.peers == ()
    assert daemon.peer_ssl is not None
    assert (daemon.dns, daemon.leases) != (None, None)
    peers = _peer_upstreams(StaticMembership([Peer("b", "https://127.0.0.1:3")]),
                            daemon.peer_ssl)()
    assert peers["b"].ssl_context is daemon.peer_ssl
    await daemon.transport.close()
    await daemon.poll_transport.close()


async def test_without_peer_tls_material_no_peer_becomes_an_upstream(root):
    """Unreachable through a validated configuration (the peer files are required with
    any membership source), so the daemon defends it: an Upstream without a client
    context could only fail each connection."""
    daemon = build_daemon(_config_with(root))
    assert daemon.peer_ssl is None
    membership = StaticMembership([Peer("b", "https://127.0.0.1:3")])
    assert _peer_upstreams(membership, daemon.peer_ssl)() == {}
    await daemon.transport.close()
    await daemon.poll_transport.close()


def test_start_up_objects_are_left_out_of_full_collections() -> None:
    """What exists when serving starts is frozen: a full collection walks only what
    serving made since (``serve`` calls this once the listeners are up)."""
    assert gc.get_freeze_count() == 0
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 1000
        assert len(gc.get_objects()) < gc.get_freeze_count()
    finally:
        gc.unfreeze()
