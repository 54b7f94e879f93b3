"""Transport: mTLS to loopback test servers, error mapping, and what sessions never do.

Every server is an aiohttp test server on 127.0.0.1 over real TLS (the
``aiohttp_server`` fixture stops it). Handlers that must be "slow" wait on an event
the test sets before it ends, so nothing sleeps for real beyond two 0.1 s timeouts.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from mvproxy import devpki, tls
from mvproxy.errors import (
    MvproxyError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from mvproxy.transport import BodyTooLarge, Transport, Upstream

SLOW = 0.1
"""The only real waits in this file: timeouts that must expire."""


# --------------------------------------------------------------------------- PKI

@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the cluster PKI, an unrelated PKI whose CA nobody trusts)."""
    good = tmp_path_factory.mktemp("pki") / "pki"
    rogue = tmp_path_factory.mktemp("rogue") / "pki"
    devpki.init_pki(good, ["a", "b"], days=2)
    devpki.init_pki(rogue, ["b"], days=2)
    return good, rogue


def server_ctx(root: Path, client_ca: Path):
    return tls.server_context(root / "b" / "mvproxy.crt", root / "b" / "mvproxy.key", client_ca,
                              require_client_cert=True)


@pytest.fixture(scope="module")
def client_ctx(certs):
    good, _ = certs
    return tls.client_context(good / "ca.crt", good / "a" / "front-proxy-client.crt",
                              good / "a" / "front-proxy-client.key")


@pytest.fixture
async def transport():
    t = Transport(connect_timeout=2.0, request_timeout=2.0)
    yield t
    await t.close()


@pytest.fixture
def serve(aiohttp_server, certs):
    """``await serve(app, rogue=False)`` -> an Upstream for a TLS test server."""
    good, rogue = certs

    async def start(app: web.Application, *, rogue_cert: bool = False) -> str:
        ctx = server_ctx(rogue if rogue_cert else good, good / "front-proxy-ca.crt")
        server = await aiohttp_server(app, ssl=ctx)
        return f"https://127.0.0.1:{server.port}"

    return start


def upstream(url: str, ctx) -> Upstream:
    return Upstream("peer-b", url, ctx, is_peer=True)


def app_with(handler, path: str = "/api") -> web.Application:
    app = web.Application()
    app.router.add_get(path, handler)
    return app


def assert_ours(exc: BaseException) -> None:
    assert isinstance(exc, UpstreamError) and isinstance(exc, MvproxyError)
    assert not isinstance(exc, aiohttp.ClientError)
    assert exc.upstream == "peer-b"


def test_error_tree_is_not_aiohttps():
    for cls in (UpstreamError, UpstreamConnectError, UpstreamTimeout, UpstreamProtocolError,
                BodyTooLarge):
        assert not issubclass(cls, aiohttp.ClientError)
        assert not issubclass(cls, OSError)  # nor asyncio/OS errors callers might catch
    assert issubclass(BodyTooLarge, UpstreamProtocolError)


# --------------------------------------------------------------------------- success

async def test_fetch_over_mtls_presents_the_client_certificate(serve, transport, client_ctx):
    seen = {}

    async def handler(request: web.Request) -> web.Response:
        cert = request.transport.get_extra_info("peercert")
        seen["cn"] = dict(x[0] for x in cert["subject"])["commonName"]
        seen["headers"] = dict(request.headers)
        return web.Response(body=b'{"ok":true}', headers={"Etag": '"abc"'},
                            content_type="application/json")

    up = upstream(await serve(app_with(handler)), client_ctx)
    fetched = await transport.fetch(up, "/api", headers={"Accept": "application/json"},
                                    timeout=2, max_bytes=1024)
    assert fetched.status == 200 and fetched.body == b'{"ok":true}'
    assert seen["cn"] == devpki.FRONT_PROXY_CLIENT_CN
    # Go servers spell it "Etag": header lookups must not depend on case.
    assert fetched.headers["ETag"] == '"abc"' and fetched.headers["etag"] == '"abc"'
    assert seen["headers"]["Accept"] == "application/json"
    # Nothing a proxy did not ask for: no User-Agent, no Accept-Encoding of aiohttp's.
    assert "User-Agent" not in seen["headers"]
    assert "Accept-Encoding" not in seen["headers"]


async def test_environment_proxy_settings_are_ignored(serve, transport, client_ctx, monkeypatch):
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text="direct")

    up = upstream(await serve(app_with(handler)), client_ctx)
    fetched = await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=100)
    assert fetched.body == b"direct"


async def test_cookies_are_not_kept_between_requests(serve, transport, client_ctx):
    cookies = []

    async def handler(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        response = web.Response(text="x")
        response.set_cookie("session", "user-one-secret")
        return response

    up = upstream(await serve(app_with(handler)), client_ctx)
    for _ in range(2):
        fetched = await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=100)
        assert "session=user-one-secret" in fetched.headers["Set-Cookie"]
    assert cookies == [None, None]


async def test_content_encoding_passes_through_untouched(serve, transport, client_ctx):
    raw = b'{"kind":"APIGroupDiscoveryList"}' * 20
    compressed = gzip.compress(raw)

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=compressed, headers={"Content-Encoding": "gzip",
                                                      "Content-Type": "application/json"})

    up = upstream(await serve(app_with(handler)), client_ctx)
    fetched = await transport.fetch(up, "/api", headers={"Accept-Encoding": "gzip"},
                                    timeout=2, max_bytes=len(compressed))
    assert fetched.headers["Content-Encoding"] == "gzip"
    assert fetched.body == compressed


# --------------------------------------------------------------------------- connect errors

def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_connection_refused_is_a_connect_error(transport, client_ctx):
    up = upstream(f"https://127.0.0.1:{closed_port()}", client_ctx)
    with pytest.raises(UpstreamConnectError) as info:
        await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=100)
    assert_ours(info.value)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


async def test_server_certificate_from_another_ca_is_a_connect_error(serve, transport,
                                                                   client_ctx):
    reached = []

    async def handler(request: web.Request) -> web.Response:
        reached.append(True)
        return web.Response(text="should not be read")

    up = upstream(await serve(app_with(handler), rogue_cert=True), client_ctx)
    with pytest.raises(UpstreamConnectError) as info:
        await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=100)
    assert_ours(info.value)
    assert "certificate" in str(info.value).lower()
    assert reached == []


# --------------------------------------------------------------------------- timeouts

async def test_slow_answer_is_a_timeout(serve, transport, client_ctx):
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        arrived.set()
        await asyncio.wait_for(release.wait(), 5)
        return web.Response(text="late")

    up = upstream(await serve(app_with(handler)), client_ctx)
    try:
        with pytest.raises(UpstreamTimeout) as info:
            await transport.fetch(up, "/api", headers={}, timeout=SLOW, max_bytes=100)
        assert_ours(info.value)
        assert arrived.is_set()  # it was sent: a timeout, not a connect error
    finally:
        release.set()


async def test_body_that_stalls_is_a_timeout(serve, transport, client_ctx):
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = 100
        await response.prepare(request)
        await response.write(b"{" * 10)
        await asyncio.wait_for(release.wait(), 5)
        return response

    up = upstream(await serve(app_with(handler)), client_ctx)
    try:
        with pytest.raises(UpstreamTimeout) as info:
            await transport.fetch(up, "/api", headers={}, timeout=SLOW, max_bytes=1000)
        assert_ours(info.value)
    finally:
        release.set()


# --------------------------------------------------------------------------- bodies

async def test_body_over_cap_with_content_length(serve, transport, client_ctx):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 5000)

    up = upstream(await serve(app_with(handler)), client_ctx)
    with pytest.raises(UpstreamProtocolError) as info:
        await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=4999)
    assert isinstance(info.value, BodyTooLarge) and "5000 bytes" in str(info.value)
    assert_ours(info.value)
    # Exactly at the cap is fine.
    fetched = await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=5000)
    assert len(fetched.body) == 5000


async def test_body_over_cap_without_content_length(serve, transport, client_ctx):
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(10):
            await response.write(b"y" * 1000)
        await response.write_eof()
        return response

    up = upstream(await serve(app_with(handler)), client_ctx)
    with pytest.raises(BodyTooLarge) as info:
        await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=2500)
    assert_ours(info.value)
    fetched = await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=10_000)
    assert fetched.body == b"y" * 10_000


async def test_connection_dropped_mid_body_is_a_protocol_error(serve, transport, client_ctx):
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = 1000
        await response.prepare(request)
        await response.write(b"z" * 10)
        request.transport.close()
        return response

    up = upstream(await serve(app_with(handler)), client_ctx)
    with pytest.raises(UpstreamProtocolError) as info:
        await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=5000)
    assert_ours(info.value)
    assert not isinstance(info.value, BodyTooLarge)


async def test_non_200_is_returned_not_raised(serve, transport, client_ctx):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=503, text="unavailable")

    up = upstream(await serve(app_with(handler)), client_ctx)
    fetched = await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=100)
    assert fetched.status == 503 and fetched.body == b"unavailable"


# --------------------------------------------------------------------------- pooling


def peer_ports(seen: list[int]):
    async def handler(request: web.Request) -> web.Response:
        seen.append(request.transport.get_extra_info("peername")[1])
        return web.Response(text="ok")
    return handler


async def test_connections_are_reused(serve, transport, client_ctx):
    """Peers used to get a fresh connection (and TLS handshake) per request: 9,169
    TIME_WAIT sockets in 30 s under load. Now one connection carries them all."""
    seen: list[int] = []
    up = upstream(await serve(app_with(peer_ports(seen))), client_ctx)
    for _ in range(5):
        assert (await transport.fetch(up, "/api", headers={}, timeout=2,
                                      max_bytes=10)).body == b"ok"
    assert len(seen) == 5 and len(set(seen)) == 1
    assert repr(transport.pool(up)) == "<Pool peer-b: 0 busy, 1 idle>"


async def test_reset_drops_the_pool(serve, transport, client_ctx):
    seen: list[int] = []
    up = upstream(await serve(app_with(peer_ports(seen))), client_ctx)
    await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=10)
    assert transport.reset("peer-b") == 0  # nothing was in flight
    await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=10)
    assert len(set(seen)) == 2


async def test_a_pooled_connection_the_server_closed_is_not_reused(aiohttp_server, certs,
                                                                   transport, client_ctx):
    """The upstream ends idle keep-alive connections on its own schedule; the next
    request must neither fail nor wait on such a connection."""
    good, _ = certs
    seen: list[int] = []
    server = await aiohttp_server(app_with(peer_ports(seen)), ssl=server_ctx(
        good, good / "front-proxy-ca.crt"), keepalive_timeout=0.05)
    up = upstream(f"https://127.0.0.1:{server.port}", client_ctx)
    for _ in range(3):
        await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=10)
        await asyncio.sleep(SLOW * 2)  # longer than the server's keep-alive
    assert len(set(seen)) == 3


async def test_upstream_sockets_carry_keepalive_and_user_timeout(serve, transport, client_ctx):
    """A peer that vanished from the network (no RST) is noticed by the kernel."""
    up = upstream(await serve(app_with(peer_ports([]))), client_ctx)
    await transport.fetch(up, "/api", headers={}, timeout=2, max_bytes=10)
    conn = transport.pool(up).idle[0]
    sock = conn.transport.get_extra_info("socket")
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) > 0
