"""The assembled daemon in process, between fake upstreams: shared by test modules.

A fake backend (1.35 discovery; requires a client certificate, like a kube-apiserver)
and a fake peer (1.36 discovery; requires a front-proxy-CA client certificate, like a
peer's mvproxy) run as aiohttp servers on 127.0.0.1 over TLS from a development PKI.
Both echo what they received, so a test sees where a request went and with which
identity. Every server is an ``aiohttp_server`` fixture server (stopped at teardown);
the daemon runs inside ``app.running``, which stops its listeners and poller on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from mvproxy import devpki, tls
from mvproxy.app import build_daemon, running
from mvproxy.configfile import load_config
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.discoverydocs import aggregated
from mvproxy.devcluster.launcher import free_port

QUIET = 1.0
"""How long ``Cluster.raw`` waits for more bytes before it takes the answer as complete."""
WAIT = 20.0
"""Upper bound of every wait for the poller."""

SELF, PEER_ID = "apiserver-a", "apiserver-b"
PODGROUPS = "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups"  # 1.36 only
PODGROUPS_GVR = {"group": "scheduling.k8s.io", "version": "v1alpha2", "resource": "podgroups"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki") / "pki"
    devpki.init_pki(directory, ["a", "b"], days=2)
    return directory


def fake_server(name: str, version: str, gate: asyncio.Event | None = None,
                routes=None, seen: list[tuple[str, str]] | None = None,
                health: dict | None = None, groups: list[dict] | None = None
                ) -> web.Application:
    """Aggregated discovery of ``version`` (plus ``groups``, aggregated group entries)
    on /api and /apis; an echo everywhere else.

    With ``gate``, /apis answers only once the gate is set (a first poll in progress).
    ``seen`` collects (method, raw target) of every request but the discovery polls.
    """

    @web.middleware
    async def record(request: web.Request, handler):
        if seen is not None and request.path not in ("/api", "/apis"):
            seen.append((request.method, request.raw_path))
        elif seen is not None and "Authorization" in request.headers:  # discovery probes
            seen.append(("PROBE " + request.path, request.headers["Authorization"]))
        return await handler(request)

    catalog = load_catalog(version)
    apis = aggregated(catalog, core=False)
    apis["items"] += groups or []
    documents = {"/api": json.dumps(aggregated(catalog, core=True)).encode(),
                 "/apis": json.dumps(apis).encode()}

    async def discovery(request: web.Request) -> web.StreamResponse:
        if health is not None and not health["discovery"]:
            return web.Response(status=500, text="discovery is failing")
        mode = health.get("mode", "ok") if health is not None else "ok"
        if mode != "ok":
            return await misbehave(request, mode)
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

    app = web.Application(middlewares=[record])
    app.router.add_get("/api", discovery)
    app.router.add_get("/apis", discovery)
    app.router.add_post("/api/v1/namespaces/default/configmaps", slow_create)
    app.router.add_get("/api/v1/configmaps", endless_watch)
    if routes is not None:
        routes(app)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


async def misbehave(request: web.Request, mode: str) -> web.StreamResponse:
    """Discovery answers a broken peer might give (``Cluster.health["mode"]``)."""
    if mode == "garbage":
        return web.Response(body=b'{"kind": "APIGroupDiscoveryList", "items": [{"nope',
                            content_type="application/json")
    if mode == "not-discovery":
        return web.json_response({"kind": "Status", "items": 7})
    if mode == "huge":
        return web.Response(body=b" " * (10 * 1024 * 1024), content_type="application/json")
    if mode == "slow":
        await asyncio.sleep(WAIT)
        return web.Response(status=200)
    if mode == "truncated":
        return await cut_short(request, b'{"kind":"APIGroupDiscoveryList","items":[')
    raise AssertionError(f"unknown mode {mode}")


async def cut_short(request: web.Request, first: bytes) -> web.StreamResponse:
    """A response that announces 100,000 bytes, sends ``first`` and drops the connection."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = 100_000
    await response.prepare(request)
    await response.write(first)
    request.transport.close()
    return response


def header(echoed: dict, name: str) -> list[str]:
    return [v for k, v in echoed["headers"] if k.lower() == name.lower()]


class Cluster:
    """Handles a test needs: URLs, the peer server (to stop it), clients."""

    def __init__(self, root: Path, base: str, admin: str, peer_server, gate: asyncio.Event,
                 sessions: dict[str, aiohttp.ClientSession], contexts: dict[str, ssl.SSLContext],
                 seen: dict[str, list[tuple[str, str]]], health: dict):
        self.root, self.base, self.admin = root, base, admin
        self.peer_server, self.gate, self.sessions = peer_server, gate, sessions
        self.contexts = contexts
        self.seen = seen
        self.health = health
        """The first peer's discovery: ``health["discovery"] = False`` answers 500;
        ``health["mode"]`` = garbage, not-discovery, huge, slow or truncated misbehaves."""
        """(method, raw target) each fake received, by "backend" and "peer" (no polls);
        discovery requests with a bearer token as ("PROBE <path>", Authorization)."""
        self.port = int(base.rsplit(":", 1)[1])

    async def raw(self, data: bytes, *, who: str = "admin", limit: int = 1 << 20) -> bytes:
        """Send ``data`` as is over a new TLS connection; everything read until the
        server closes it or goes quiet for a second (bounded by WAIT and ``limit``)."""
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.port, ssl=self.contexts[who], server_hostname="127.0.0.1")
        received = b""
        try:
            writer.write(data)
            async with asyncio.timeout(WAIT):
                while len(received) < limit:
                    try:
                        chunk = await asyncio.wait_for(reader.read(65536), QUIET)
                    except TimeoutError:
                        break
                    if not chunk:
                        break
                    received += chunk
                    if _complete(received):
                        break
        except (ConnectionError, ssl.SSLError):
            pass  # the server may close while we still write; what it said is kept
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        return received

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
                while not await predicate():  # noqa: ASYNC110 - the state is another server's
                    await asyncio.sleep(0.05)
        except TimeoutError:
            pytest.fail(f"gave up waiting for {what}")


def certificate_settings(root: Path) -> dict[str, str]:
    """Every certificate setting of member ``a`` of the development PKI at ``root``
    (overrides by dotted path)."""
    member, front = root / "a", root / "a" / "front-proxy-client"
    return {
        "tlsCertFile": str(member / "mvproxy.crt"),
        "tlsPrivateKeyFile": str(member / "mvproxy.key"),
        "clientCAFile": str(root / "ca.crt"),
        "backend.caFile": str(root / "ca.crt"),
        "backend.certFile": f"{front}.crt", "backend.keyFile": f"{front}.key",
        "peer.caFile": str(root / "ca.crt"),
        "peer.clientCAFile": str(root / "front-proxy-ca.crt"),
        "peer.certFile": f"{front}.crt", "peer.keyFile": f"{front}.key",
    }


@contextlib.asynccontextmanager
async def cluster(aiohttp_server, root: Path, timeouts: dict[str, str] | None = None,
                  backend_routes=None, extra_peers: int = 0, peer_routes=None,
                  listener: dict[str, object] | None = None,
                  extra: dict[str, object] | None = None,
                  backend_groups: list[dict] | None = None,
                  peer_groups: list[dict] | None = None, **discovery: str):
    gate = asyncio.Event()
    health: dict = {"discovery": True, "mode": "ok"}
    seen: dict[str, list[tuple[str, str]]] = {"backend": [], "peer": []}
    backend_ssl = tls.server_context(
        root / "a" / "apiserver.crt", root / "a" / "apiserver.key",
        root / "front-proxy-ca.crt")  # optional, like kube-apiserver (anonymous, tokens)
    backend = await aiohttp_server(fake_server("backend", "1.35", routes=backend_routes,
                                               seen=seen["backend"], groups=backend_groups),
                                   ssl=backend_ssl)
    peer_ssl = tls.server_context(root / "b" / "mvproxy.crt", root / "b" / "mvproxy.key",
                                  root / "front-proxy-ca.crt", require_client_cert=True)
    peer = await aiohttp_server(fake_server("peer", "1.36", gate, seen=seen["peer"],
                                            routes=peer_routes, health=health,
                                            groups=peer_groups), ssl=peer_ssl)
    others = [await aiohttp_server(fake_server(f"peer-{i}", "1.36", routes=peer_routes),
                                   ssl=peer_ssl) for i in range(extra_peers)]
    overrides = {
        "serverID": SELF, "bindAddress": "127.0.0.1", "securePort": free_port(),
        **certificate_settings(root),
        "backend.url": f"https://127.0.0.1:{backend.port}",
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
        **{f"listener.{k}": v for k, v in (listener or {}).items()},
        **(extra or {}),  # any other setting, by dotted path
    }
    # A seeded shuffle: which capable peer is tried first is the same on every run.
    daemon = build_daemon(load_config(None, overrides=overrides), rng=random.Random(7))
    ca = root / "ca.crt"
    contexts = {
        "admin": tls.client_context(ca, root / "admin.crt", root / "admin.key"),
        "bearer": tls.client_context(ca),
        "peer": tls.client_context(ca, root / "b" / "front-proxy-client.crt",
                                   root / "b" / "front-proxy-client.key"),
    }
    sessions = {who: aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx))
                for who, ctx in contexts.items()}
    sessions["plain"] = aiohttp.ClientSession()
    try:
        async with running(daemon) as (port, admin_port):
            made = Cluster(root, f"https://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}",
                           peer, gate, sessions, contexts, seen, health)
            made.backend_server = backend
            made.daemon = daemon
            yield made
    finally:
        gate.set()
        for session in sessions.values():
            await session.close()


def _complete(received: bytes) -> bool:
    """Whether ``received`` holds one whole response with a Content-Length body."""
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return len(body) >= int(value)
    return False


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (bounded by WAIT)."""
    received = b""
    async with asyncio.timeout(WAIT):
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while chunk := await reader.read(65536):
                received += chunk
    return received


def status_of(answer: bytes) -> int:
    """The status code of a raw HTTP/1.x answer (0 if there is none)."""
    parts = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def body_of(answer: bytes) -> dict:
    """The JSON body of a raw answer with a Content-Length."""
    return json.loads(answer.partition(b"\r\n\r\n")[2])


async def ready(c: Cluster) -> None:
    """Let the first peer poll finish and wait for the first complete sync."""
    c.gate.set()
    await c.until(lambda: synced(c), "the first complete sync")


async def synced(c: Cluster) -> bool:
    """Every server polled once (routing's "synced"; readiness only needs the backend)."""
    return bool((await c.debug()).get("synced"))


async def backend_synced(c: Cluster) -> bool:
    """Ready: the backend's discovery is held."""
    status, _ = await c.admin_get("/readyz")
    return status == 200


