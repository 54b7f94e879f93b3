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
import contextlib
import random
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from mvproxy import pki
from mvproxy.app import build_daemon, running
from mvproxy.config import load_config
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.discoverydocs import aggregated
from mvproxy.devcluster.launcher import free_port

WAIT = 20.0
"""Upper bound of every wait for the poller."""

SELF, PEER_ID = "apiserver-a", "apiserver-b"
PODGROUPS = "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups"  # 1.36 only
PODGROUPS_GVR = {"group": "scheduling.k8s.io", "version": "v1alpha2", "resource": "podgroups"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki") / "pki"
    pki.init_pki(directory, ["a", "b"], days=2)
    return directory


def fake_server(name: str, version: str, gate: asyncio.Event | None = None,
                routes=None) -> web.Application:
    """Aggregated discovery of ``version`` on /api and /apis; an echo everywhere else.

    With ``gate``, /apis answers only once the gate is set (a first poll in progress).
    """
    catalog = load_catalog(version)
    documents = {"/api": json.dumps(aggregated(catalog, core=True)).encode(),
                 "/apis": json.dumps(aggregated(catalog, core=False)).encode()}

    async def discovery(request: web.Request) -> web.Response:
        if gate is not None and request.path == "/apis":
            await asyncio.wait_for(gate.wait(), WAIT)
        return web.Response(body=documents[request.path], content_type="application/json")

    async def echo(request: web.Request) -> web.Response:
        cert = request.transport.get_extra_info("peercert") or {}
        subject = dict(x[0] for x in cert.get("subject", ()))
        return web.json_response({
            "server": name, "path": request.raw_path, "cn": subject.get("commonName"),
            "headers": [[k, v] for k, v in request.headers.items()]})

    async def slow_create(request: web.Request) -> web.Response:
        await asyncio.sleep(WAIT)  # longer than any request timeout a test sets
        return web.json_response({}, status=201)

    async def endless_watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'{"type":"ADDED","object":{}}\n')
        await asyncio.sleep(WAIT)  # a quiet resource: no further event
        return response

    app = web.Application()
    app.router.add_get("/api", discovery)
    app.router.add_get("/apis", discovery)
    app.router.add_post("/api/v1/namespaces/default/configmaps", slow_create)
    app.router.add_get("/api/v1/configmaps", endless_watch)
    if routes is not None:
        routes(app)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


def header(echoed: dict, name: str) -> list[str]:
    return [v for k, v in echoed["headers"] if k.lower() == name.lower()]


class Cluster:
    """Handles a test needs: URLs, the peer server (to stop it), clients."""

    def __init__(self, root: Path, base: str, admin: str, peer_server, gate: asyncio.Event,
                 sessions: dict[str, aiohttp.ClientSession]):
        self.root, self.base, self.admin = root, base, admin
        self.peer_server, self.gate, self.sessions = peer_server, gate, sessions

    async def get(self, path: str, *, who: str = "admin", **kw):
        async with self.sessions[who].get(self.base + path, **kw) as resp:
            return resp.status, resp.headers.copy(), await resp.read()

    async def admin_get(self, path: str) -> tuple[int, str]:
        async with self.sessions["plain"].get(self.admin + path) as resp:
            return resp.status, await resp.text()

    async def metric(self, name: str, **labels: str) -> float | None:
        _, text = await self.admin_get("/metrics")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v
                                               for k, v in labels.items()):
                    return sample.value
        return None

    async def debug(self) -> dict:
        _, text = await self.admin_get("/debug/mvproxy")
        return json.loads(text)

    async def until(self, predicate, what: str) -> None:
        """Poll ``predicate`` (async) until true; fail after WAIT seconds."""
        try:
            async with asyncio.timeout(WAIT):
                while not await predicate():
                    await asyncio.sleep(0.05)
        except TimeoutError:
            pytest.fail(f"gave up waiting for {what}")


@contextlib.asynccontextmanager
async def cluster(aiohttp_server, root: Path, timeouts: dict[str, str] | None = None,
                  backend_routes=None, extra_peers: int = 0, **discovery: str):
    gate = asyncio.Event()
    backend = await aiohttp_server(fake_server("backend", "1.35", routes=backend_routes), ssl=pki.server_context(
        root / "a" / "apiserver.crt", root / "a" / "apiserver.key",
        root / "front-proxy-ca.crt", require_client_cert=True))
    peer_ssl = pki.server_context(root / "b" / "peer.crt", root / "b" / "peer.key",
                                  root / "ca.crt", require_client_cert=True)
    peer = await aiohttp_server(fake_server("peer", "1.36", gate), ssl=peer_ssl)
    others = [await aiohttp_server(fake_server(f"peer-{i}", "1.36"), ssl=peer_ssl)
              for i in range(extra_peers)]
    overrides = {
        "serverID": SELF, "bindAddress": "127.0.0.1", "securePort": free_port(),
        "tlsCertFile": str(root / "a" / "mvproxy.crt"),
        "tlsPrivateKeyFile": str(root / "a" / "mvproxy.key"),
        "clientCAFile": str(root / "ca.crt"),
        "backend.url": f"https://127.0.0.1:{backend.port}",
        "backend.caFile": str(root / "ca.crt"),
        "backend.certFile": str(root / "a" / "front-proxy-client.crt"),
        "backend.keyFile": str(root / "a" / "front-proxy-client.key"),
        "peer.caFile": str(root / "ca.crt"),
        "peer.certFile": str(root / "a" / "peer.crt"),
        "peer.keyFile": str(root / "a" / "peer.key"),
        "peers.static": [{"serverID": PEER_ID, "url": f"https://127.0.0.1:{peer.port}"}] + [
            {"serverID": f"{PEER_ID}-{i}", "url": f"https://127.0.0.1:{other.port}"}
            for i, other in enumerate(others)],
        "discovery.pollInterval": "100ms",
        # Long enough that the gated first poll of the peer is still running when
        # /readyz is asked; set explicitly because the default is min(5s, interval).
        "discovery.timeout": "30s",
        **{f"discovery.{k}": v for k, v in discovery.items()},
        "admin.bindAddress": "127.0.0.1", "admin.port": 0,
        "timeouts.connect": "5s", "timeouts.request": "30s",
        "timeouts.shutdownGracePeriod": "1s",
        **{f"timeouts.{k}": v for k, v in (timeouts or {}).items()},
    }
    # A seeded shuffle: which capable peer is tried first is the same on every run.
    daemon = build_daemon(load_config(None, overrides=overrides), rng=random.Random(7))
    ca = root / "ca.crt"
    sessions = {
        "admin": aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pki.client_context(
            ca, root / "admin.crt", root / "admin.key"))),
        "bearer": aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            ssl=pki.client_context(ca))),
        "peer": aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pki.client_context(
            ca, root / "b" / "peer.crt", root / "b" / "peer.key"))),
        "plain": aiohttp.ClientSession(),
    }
    try:
        async with running(daemon) as (port, admin_port):
            yield Cluster(root, f"https://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}",
                          peer, gate, sessions)
    finally:
        gate.set()
        for session in sessions.values():
            await session.close()


async def synced(c: Cluster) -> bool:
    status, _ = await c.admin_get("/readyz")
    return status == 200


async def test_routes_by_capability_with_verified_identity(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        # The peer's first poll hangs: not ready, and everything goes to the backend.
        status, text = await c.admin_get("/readyz?verbose")
        assert status == 503 and "[-]discovery-synced failed" in text
        status, _, body = await c.get(PODGROUPS)
        assert status == 200 and json.loads(body)["server"] == "backend"
        assert (await c.admin_get("/livez")) == (200, "ok")

        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        status, text = await c.admin_get("/readyz?verbose")
        assert status == 200 and "[+]discovery-synced ok" in text

        # A cert user asking for a GVR only the peer serves: forwarded, vouched for.
        status, _, body = await c.get(PODGROUPS + "?limit=5&labelSelector=a%3Db", headers={
            "X-Remote-User": "system:evil", "X-Remote-Group": "system:masters",
            "x-kubernetes-peer-proxied": "true"})
        echoed = json.loads(body)
        assert status == 200 and echoed["server"] == "peer"
        assert echoed["path"] == PODGROUPS + "?limit=5&labelSelector=a%3Db"
        assert echoed["cn"] == pki.PEER_CN
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
        assert echoed["cn"] == pki.FRONT_PROXY_CLIENT_CN
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


@pytest.mark.parametrize("grace", ["0s", "200ms"])
async def test_shutdown_ends_open_watches_after_the_grace_period(aiohttp_server, root, grace):
    """SIGTERM must finish within shutdownGracePeriod even while a watch stays open."""
    watch_ended = asyncio.Event()

    async def watch(c: Cluster, opened: asyncio.Event) -> None:
        async with c.sessions["admin"].get(c.base + "/api/v1/configmaps?watch=true") as resp:
            await resp.content.readline()
            opened.set()
            with contextlib.suppress(aiohttp.ClientError):
                await resp.content.read()
        watch_ended.set()

    opened = asyncio.Event()
    async with asyncio.timeout(WAIT):
        async with cluster(aiohttp_server, root, timeouts={"shutdownGracePeriod": grace}) as c:
            task = asyncio.create_task(watch(c, opened))
            await opened.wait()
            status, text = await c.admin_get("/readyz?verbose")
            assert "[+]shutdown ok" in text
        # running() has returned: the listener drained and the watch was ended.
        await asyncio.wait_for(watch_ended.wait(), WAIT)
        await task


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
