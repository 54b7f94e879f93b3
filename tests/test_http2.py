"""HTTP/2 toward clients, end to end: the assembled daemon between the fake backend and
peer (``daemon_support``), a real HTTP/2 client (httpx with h2) over TLS on loopback.

Each test asserts what an HTTP/2 client sees: the protocol it got, the answer, where the
request went and with which identity, how many connections it took, and how the
connection ends (``GOAWAY``) when it should.
"""

from __future__ import annotations

import asyncio
import json
import ssl

import httpx
from aiohttp import web
from daemon_support import PODGROUPS, WAIT, Cluster, cluster, header, synced
from h2_support import RawH2
from jh2.errors import ErrorCodes

from mvproxy import tls

NAMESPACES = "/api/v1/namespaces"


def h2_context(c: Cluster, who: str) -> ssl.SSLContext:
    """A client context offering ``h2`` then ``http/1.1``, as client-go's does."""
    root = c.root
    ca = root / "ca.crt"
    ctx = {"admin": lambda: tls.client_context(ca, root / "admin.crt", root / "admin.key"),
           "bearer": lambda: tls.client_context(ca),
           "peer": lambda: tls.client_context(ca, root / "b" / "front-proxy-client.crt",
                                              root / "b" / "front-proxy-client.key")}[who]()
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


def client(c: Cluster, who: str = "admin", **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(http2=True, verify=h2_context(c, who), base_url=c.base,
                             timeout=WAIT, **kw)


async def _connections(c: Cluster) -> tuple[float | None, float | None]:
    return (await c.metric("mvproxy_open_connections"),
            await c.metric("mvproxy_http2_connections"))


async def test_a_request_over_http2_is_served_with_the_clients_identity(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c, client(c) as http:
        r = await http.get(NAMESPACES)
        assert r.http_version == "HTTP/2"
        assert r.status_code == 200
        echoed = r.json()
        assert echoed["server"] == "backend"
        assert header(echoed, "X-Remote-User") == ["kubernetes-admin"]
        assert "Connection" not in r.headers and "transfer-encoding" not in r.headers
        assert await c.metric("mvproxy_http2_connections") == 1


async def test_many_requests_share_one_connection(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c, client(c) as http:
        answers = await asyncio.gather(*(http.get(f"{NAMESPACES}/ns-{i}") for i in range(60)))
        assert [a.status_code for a in answers] == [200] * 60
        assert {a.json()["path"] for a in answers} == {f"{NAMESPACES}/ns-{i}" for i in range(60)}
        assert await _connections(c) == (1, 1)
        assert await c.metric("mvproxy_http2_streams") == 0


async def test_a_bearer_token_is_relayed_and_spoofed_identity_headers_are_not(
        aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c, client(c, "bearer") as http:
        r = await http.get(NAMESPACES, headers={"Authorization": "Bearer abc",
                                                "X-Remote-User": "system:admin",
                                                "X-Remote-Group": "system:masters",
                                                "Impersonate-User": "someone"})
        assert r.status_code == 200
        echoed = r.json()
        assert header(echoed, "Authorization") == ["Bearer abc"]
        assert header(echoed, "X-Remote-User") == []
        assert header(echoed, "X-Remote-Group") == []
        assert header(echoed, "Impersonate-User") == ["someone"]  # kube-apiserver decides
        second = await http.get(NAMESPACES, headers={"Authorization": "Bearer abc"})
        assert second.status_code == 200
        assert await _connections(c) == (1, 1)  # a token keeps its connection


async def test_an_unauthenticated_clients_connection_ends_after_its_request(
        aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c, client(c, "bearer") as http:
        for _ in range(3):
            r = await http.get(NAMESPACES)
            assert r.status_code == 200
        assert await c.metric("mvproxy_http2_goaways_total", reason="unauthenticated") == 3


async def test_request_bodies_with_and_without_a_length(aiohttp_server, root):
    def routes(app: web.Application) -> None:
        async def echo_body(request: web.Request) -> web.Response:
            body = await request.read()
            return web.json_response({"length": len(body), "te": request.headers.get(
                "Transfer-Encoding"), "first": body[:10].decode()})
        app.router.add_put("/api/v1/namespaces/default/configmaps/x", echo_body)

    async with cluster(aiohttp_server, root, backend_routes=routes) as c, client(c) as http:
        path = "/api/v1/namespaces/default/configmaps/x"
        sized = await http.put(path, content=b"0123456789" * 50_000)
        assert sized.status_code == 200
        assert sized.json() == {"length": 500_000, "te": None, "first": "0123456789"}

        async def pieces():
            for _ in range(20):
                yield b"abcdefghij" * 1000
                await asyncio.sleep(0)
        streamed = await http.put(path, content=pieces())
        assert streamed.status_code == 200
        assert streamed.json() == {"length": 200_000, "te": "chunked", "first": "abcdefghij"}


async def test_a_large_response_and_a_watch_stream(aiohttp_server, root):
    def routes(app: web.Application) -> None:
        async def big(request: web.Request) -> web.Response:
            return web.Response(body=b"x" * 3_000_000, content_type="application/json")

        async def watch(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            for i in range(5):
                await response.write(json.dumps({"type": "ADDED", "n": i}).encode() + b"\n")
                await asyncio.sleep(0.01)
            return response
        app.router.add_get("/api/v1/namespaces/default/pods", big)
        app.router.add_get("/api/v1/namespaces/default/events", watch)

    async with cluster(aiohttp_server, root, backend_routes=routes) as c, client(c) as http:
        big = await http.get("/api/v1/namespaces/default/pods")
        assert big.status_code == 200 and big.content == b"x" * 3_000_000
        lines = []
        async with http.stream("GET", "/api/v1/namespaces/default/events?watch=true") as r:
            assert r.http_version == "HTTP/2"
            async for line in r.aiter_lines():
                if line:
                    lines.append(json.loads(line)["n"])
        assert lines == [0, 1, 2, 3, 4]
        head = await http.head("/api/v1/namespaces/default/pods")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == "3000000"


async def test_the_peer_route_and_discovery_over_http2(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c, client(c) as http:
        c.gate.set()
        await c.until(lambda: synced(c), "the peer's discovery")
        routed = await http.get(PODGROUPS)
        assert routed.status_code == 200 and routed.json()["server"] == "peer"
        apis = await http.get("/apis", headers={
            "Accept": "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"})
        assert apis.status_code == 200
        groups = {g["metadata"]["name"] for g in apis.json()["items"]}
        assert "scheduling.k8s.io" in groups
        assert await _connections(c) == (1, 1)


async def test_a_head_over_the_header_limit_gets_431_and_the_connection_carries_on(
        aiohttp_server, root):
    async with cluster(aiohttp_server, root, listener={"maxHeaderBytes": 4096}) as c, \
            client(c) as http:
        big = await http.get(NAMESPACES, headers={"X-Big": "y" * 5000})
        assert big.status_code == 431
        assert big.headers["content-type"] == "application/json"
        assert big.json()["kind"] == "Status"
        good = await http.get(NAMESPACES)
        assert good.status_code == 200
        assert await _connections(c) == (1, 1)


async def test_http2_off_makes_clients_fall_back(aiohttp_server, root):
    async with cluster(aiohttp_server, root, listener={"http2": False}) as c, client(c) as http:
        r = await http.get(NAMESPACES)
        assert r.status_code == 200 and r.http_version == "HTTP/1.1"
        assert await c.metric("mvproxy_http2_connections") is None


async def test_max_connections_bounds_requests_over_http2_too(aiohttp_server, root):
    """Each request may hold an upstream connection, as each HTTP/1.1 connection may:
    past ``maxConnections`` in all, a new stream is refused (the client may retry)."""
    release = asyncio.Event()

    def routes(app: web.Application) -> None:
        async def slow(request: web.Request) -> web.Response:
            await asyncio.wait_for(release.wait(), WAIT)
            return web.json_response({"done": True})
        app.router.add_get("/api/v1/namespaces/default/secrets", slow)

    async with cluster(aiohttp_server, root, backend_routes=routes,
                       listener={"maxConnections": 4, "headerReadTimeout": "1s"}) as c:
        # The start-up check's probe of the port counts until its deadline: let it go.
        await c.until(lambda: _open_connections_are(c, 0), "no connection open")
        async with await RawH2.open(c.port, h2_context(c, "admin")) as conn:
            # One answer first: the connection is then counted once, not also as the
            # handshake that its first frames arrive with.
            assert (await conn.response(conn.request(NAMESPACES))).status == 200
            held = [conn.request("/api/v1/namespaces/default/secrets") for _ in range(3)]
            await c.until(lambda: _streams_at_least(c, 3), "three requests in flight")
            refused = await conn.response(conn.request(NAMESPACES))  # 1 + 3: the limit
            assert refused.reset == ErrorCodes.REFUSED_STREAM and refused.status is None
            assert await c.metric("mvproxy_http2_refusals_total", reason="stream_limit") == 1
            release.set()
            assert [(await conn.response(s)).status for s in held] == [200] * 3
            again = await conn.response(conn.request(NAMESPACES))
            assert again.status == 200


async def _streams_at_least(c: Cluster, n: int) -> bool:
    return (await c.metric("mvproxy_http2_streams") or 0) >= n


async def _open_connections_are(c: Cluster, n: int) -> bool:
    return await c.metric("mvproxy_open_connections") == n


async def test_goaway_chance_ends_the_connection_after_the_answer(aiohttp_server, root,
                                                                 monkeypatch):
    """``goawayChance``: the answer comes whole, then GOAWAY(NO_ERROR) naming its stream,
    and the connection closes; the client reconnects (to any mvproxy)."""
    import mvproxy.http2

    monkeypatch.setattr(mvproxy.http2.random, "random", lambda: 0.0)  # always, here
    async with cluster(aiohttp_server, root, listener={"goawayChance": 0.02}) as c:
        async with await RawH2.open(c.port, h2_context(c, "admin")) as conn:
            sid = conn.request(NAMESPACES)
            answer = await conn.response(sid)
            assert answer.status == 200 and answer.ended
            assert await conn.goaway_code() == ErrorCodes.NO_ERROR
            assert conn.goaway is not None and conn.goaway.last_stream_id == sid
            assert await conn.closed_with() == ErrorCodes.NO_ERROR
        assert await c.metric("mvproxy_http2_goaways_total", reason="goaway_chance") == 1


async def test_the_status_document_counts_connections_by_protocol(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c, client(c) as http:
        assert (await http.get(NAMESPACES)).status_code == 200
        assert (await c.get(NAMESPACES))[0] == 200  # and one over HTTP/1.1, kept alive
        _, text = await c.admin_get("/debug/mvproxy/peers")
        counted = json.loads(text)["connections"]
        assert counted["downstreamHTTP2"] == 1
        assert counted["downstreamHTTP1"] >= 1
        _, page = await c.admin_get("/")
        assert 'id="connections"' in page and "1 HTTP/2 connections" in page


async def test_a_watch_whose_upstream_dies_between_events_ends_and_a_list_is_reset(
        aiohttp_server, root):
    """A watch cut between two events ends its stream (client-go then watches again, as
    after an HTTP/1.1 watch's early EOF); any other cut answer is reset, never ended."""
    def routes(app: web.Application) -> None:
        async def dying(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"type":"ADDED","object":{}}\n')
            await asyncio.sleep(0.2)
            request.transport.abort()  # the backend dies
            return response
        app.router.add_get("/api/v1/namespaces/default/events", dying)

    async with cluster(aiohttp_server, root, backend_routes=routes) as c:
        async with await RawH2.open(c.port, h2_context(c, "admin")) as conn:
            watch = await conn.response(
                conn.request("/api/v1/namespaces/default/events?watch=true"))
            assert watch.status == 200 and watch.ended and watch.reset is None
            assert bytes(watch.body) == b'{"type":"ADDED","object":{}}\n'
            listed = await conn.response(conn.request("/api/v1/namespaces/default/events"))
            assert listed.status == 200 and listed.reset == ErrorCodes.INTERNAL_ERROR
            assert not listed.ended
