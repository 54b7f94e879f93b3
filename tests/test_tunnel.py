"""Upgrade tunnels (exec/attach/port-forward, WebSocket watches) through ``tunnel``.

Everything runs on 127.0.0.1 over real TLS with a throwaway PKI: a fake upstream
(an aiohttp WebSocket app, the simulated API server's exec, or a raw
``asyncio.start_server`` speaking "SPDY"), and a bare data-plane ``Listener`` whose
handler calls ``forwarding.forward`` with the headers ``handlers`` would compute.
Every server is stopped by its fixture; every wait is bounded by ``WAIT``, which
only a broken tunnel ever reaches.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from multidict import CIMultiDict
from yarl import URL

from mvproxy import devpki, forwarding, tls
from mvproxy.devcluster.simexec import handle_exec
from mvproxy.errors import UpstreamConnectError, UpstreamProtocolError
from mvproxy.forwarding import ForwardError
from mvproxy.identity import USER, Downstream, IdentityResolver
from mvproxy.listener import Exchange
from mvproxy.requestinfo import parse_request_info
from mvproxy.transport import Transport, Upstream

WAIT = 10.0
"""Upper bound of every wait; a passing test never gets near it."""
EXEC = "/api/v1/namespaces/default/pods/web/exec"
V5 = "v5.channel.k8s.io"


# --------------------------------------------------------------------------- PKI


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pki") / "pki"
    devpki.init_pki(directory, ["a", "b"], days=2)
    return directory


@pytest.fixture(scope="module")
def contexts(root: Path) -> dict[str, Any]:
    """The four TLS ends: upstream server, mvproxy toward it, mvproxy's listener, kubectl."""
    return {
        # kube-apiserver: serving cert, trusts the front-proxy CA for mvproxy's client cert
        "upstream": tls.server_context(root / "b" / "apiserver.crt", root / "b" / "apiserver.key",
                                       root / "front-proxy-ca.crt", require_client_cert=True),
        "to_upstream": tls.client_context(root / "ca.crt", root / "a" / "front-proxy-client.crt",
                                          root / "a" / "front-proxy-client.key"),
        "listener": tls.server_context(root / "a" / "mvproxy.crt", root / "a" / "mvproxy.key",
                                       root / "ca.crt"),
        "user": tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key"),
    }


# --------------------------------------------------------------------------- servers


class Proxy:
    """What the proxy app saw: ForwardErrors raised, and handler completions."""

    def __init__(self) -> None:
        self.errors: list[ForwardError] = []
        self.upgrades: list[bool] = []
        self.finished = asyncio.Event()
        self.transport: Transport | None = None
        self.url = ""


@pytest.fixture
async def start_proxy(listen: Any, root: Path, contexts: dict[str, Any]
                      ) -> AsyncIterator[Callable[..., Awaitable[Proxy]]]:
    """``await start_proxy(upstream_url, to_peer=False, identity=None)``: a TLS listener
    forwarding everything there, with the headers ``handlers`` computes for a backend
    or a peer (``identity`` replaces the certificate check). Each proxy's transport is
    closed at teardown (its deadline task would outlive the test)."""
    transports: list[Transport] = []
    resolver = IdentityResolver(client_ca_file=str(root / "ca.crt"), peer_client_ca_file=None,
                                peer_allowed_names=())

    async def start(upstream_url: str, *, to_peer: bool = False,
                    identity: Callable[[bytes | None], Downstream] | None = None,
                    client_ssl: Any = None) -> Proxy:
        proxy = Proxy()
        upstream = Upstream("backend", upstream_url, client_ssl or contexts["to_upstream"],
                            is_peer=to_peer)
        transport = Transport(connect_timeout=WAIT, request_timeout=WAIT)
        transports.append(transport)
        proxy.transport = transport

        async def handle(exchange: Exchange) -> None:
            try:
                headers = forwarding.request_headers(exchange.fields, exchange.downstream,
                                                     to_peer=to_peer, client="")
                proxy.upgrades.append(exchange.upgrade)
                try:
                    await forwarding.forward(exchange, transport, upstream, headers,
                                             long_running=True)
                except ForwardError as exc:
                    proxy.errors.append(exc)
                    exchange.respond(503, [("Content-Type", "text/plain")], b"unavailable")
            finally:
                proxy.finished.set()

        port = await listen(handle, contexts["listener"], identity=identity or resolver.resolve)
        proxy.url = f"https://127.0.0.1:{port}"
        return proxy

    yield start
    for transport in transports:
        await transport.close()


@pytest.fixture
def serve_app(aiohttp_server: Any, contexts: dict[str, Any]
              ) -> Callable[[web.Application], Awaitable[str]]:
    async def start(app: web.Application) -> str:
        server = await aiohttp_server(app, ssl=contexts["upstream"])
        return f"https://127.0.0.1:{server.port}"

    return start


RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def serve_raw(contexts: dict[str, Any]) -> AsyncIterator[Callable[[RawHandler],
                                                                        Awaitable[str]]]:
    """``await serve_raw(handler)``: an ``asyncio.start_server`` TLS upstream."""
    servers: list[asyncio.Server] = []

    async def start(handler: RawHandler) -> str:
        async def wrapped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await handler(reader, writer)
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(wrapped, "127.0.0.1", 0, ssl=contexts["upstream"])
        servers.append(server)
        return f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


# --------------------------------------------------------------------------- raw client


async def raw_connect(proxy: Proxy, contexts: dict[str, Any]
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    port = URL(proxy.url).port
    return await asyncio.wait_for(asyncio.open_connection(
        "127.0.0.1", port, ssl=contexts["user"], server_hostname="127.0.0.1"), WAIT)


def spdy_request(path: str, port: int) -> bytes:
    """What client-go's SPDY round tripper sends (a POST with an empty body)."""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
            "X-Stream-Protocol-Version: portforward.k8s.io\r\n"
            "Authorization: Bearer not-a-real-token\r\n"
            "X-Remote-User: mallory\r\nContent-Length: 0\r\n\r\n").encode()


async def read_head(reader: asyncio.StreamReader) -> tuple[int, CIMultiDict[str]]:
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    status_line, *lines = raw.decode("latin-1").split("\r\n")[:-2]
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(":")
        headers.add(name, value.strip())
    return int(status_line.split()[1]), headers


async def read_body(reader: asyncio.StreamReader, headers: CIMultiDict[str]) -> bytes:
    """A response body framed by Content-Length or chunked (a relayed refusal may be
    either, as the upstream framed it)."""
    if "Content-Length" in headers:
        return await reader.readexactly(int(headers["Content-Length"]))
    assert headers["Transfer-Encoding"] == "chunked"
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += await reader.readexactly(size)
        await reader.readexactly(2)
    assert await reader.readuntil(b"\r\n") == b"\r\n"
    return body


async def spdy_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    heads: list[bytes], *, stop_after: int | None = None) -> None:
    """Answer 101 SPDY/3.1, then echo; ``stop_after`` bytes: close mid-tunnel instead."""
    heads.append(await reader.readuntil(b"\r\n\r\n"))
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                 b"Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: portforward.k8s.io\r\n\r\n")
    await writer.drain()
    echoed = 0
    while chunk := await reader.read(65536):
        writer.write(chunk)
        await writer.drain()
        echoed += len(chunk)
        if stop_after is not None and echoed >= stop_after:
            return


def request_target(head: bytes) -> str:
    return head.split(b"\r\n", 1)[0].decode().split(" ")[1]


def head_headers(head: bytes) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for line in head.decode("latin-1").split("\r\n")[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.add(name, value.strip())
    return headers


# --------------------------------------------------------------------------- (1) WebSocket


async def test_websocket_round_trips_with_subprotocol_and_identity(
        serve_app: Any, start_proxy: Any, contexts: dict[str, Any]) -> None:
    seen: list[tuple[str, CIMultiDict[str]]] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        seen.append((request.raw_path, CIMultiDict(request.headers)))
        ws = web.WebSocketResponse(protocols=("v4.channel.k8s.io", V5))
        await ws.prepare(request)
        async for msg in ws:
            if msg.type is WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
            elif msg.type is WSMsgType.TEXT:
                await ws.send_str(msg.data)
        return ws

    app = web.Application()
    app.router.add_get(EXEC, echo)
    proxy = await start_proxy(await serve_app(app))
    # escaped bytes and repeated keys must reach the upstream exactly as sent
    target = f"{EXEC}?command=sh&command=-c&command=echo%20a%2Fb&stdin=true&stdout=1"
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(
                URL(proxy.url + target, encoded=True), protocols=(V5,), ssl=contexts["user"],
                headers={"X-Remote-User": "mallory", "X-Remote-Group": "forged",
                         "Authorization": "Bearer not-a-real-token"},
                timeout=aiohttp.ClientWSTimeout(ws_close=WAIT)) as ws:
            assert ws.protocol == V5
            payload = bytes(range(256)) * 300  # several frames' worth, every byte value
            await ws.send_bytes(b"\x00" + payload)
            assert (await ws.receive(timeout=WAIT)).data == b"\x00" + payload
            await ws.send_str("hello")
            assert (await ws.receive(timeout=WAIT)).data == "hello"
    await asyncio.wait_for(proxy.finished.wait(), WAIT)

    [(raw_path, headers)] = seen
    assert raw_path == target
    assert headers.getall("X-Remote-User") == [devpki.ADMIN_CN]  # mallory was dropped
    assert headers.getall("X-Remote-Group") == [devpki.ADMIN_GROUP]  # "forged" was dropped
    assert headers["Authorization"] == "Bearer not-a-real-token"
    assert headers["Sec-WebSocket-Protocol"] == V5
    assert "x-kubernetes-peer-proxied" not in headers
    assert proxy.errors == []


async def test_simulated_apiserver_exec_through_the_tunnel(
        serve_app: Any, start_proxy: Any, contexts: dict[str, Any]) -> None:
    """The devcluster's exec (what kubectl ≥1.31 talks to) works end to end."""
    pod = {"metadata": {"name": "web", "namespace": "default"},
           "spec": {"containers": [{"name": "app"}]}}

    async def exec_handler(request: web.Request) -> web.StreamResponse:
        info = parse_request_info(request.method, request.path, request.query_string)
        return await handle_exec(request, info, pod)

    app = web.Application()
    app.router.add_get(EXEC, exec_handler)
    proxy = await start_proxy(await serve_app(app))
    channels: dict[int, bytes] = {}
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(
                proxy.url + EXEC, params=[("stdout", "true"), ("command", "echo"),
                                          ("command", "hi")],
                protocols=(V5,), ssl=contexts["user"],
                timeout=aiohttp.ClientWSTimeout(ws_close=WAIT)) as ws:
            async with asyncio.timeout(WAIT):
                async for msg in ws:
                    channels[msg.data[0]] = channels.get(msg.data[0], b"") + msg.data[1:]
            assert ws.protocol == V5
            assert ws.close_code == aiohttp.WSCloseCode.OK
    assert channels[1] == b"hi\n"
    assert json.loads(channels[3])["status"] == "Success"
    await asyncio.wait_for(proxy.finished.wait(), WAIT)


# --------------------------------------------------------------------------- (2) raw SPDY


async def test_spdy_upgrade_echoes_bytes_exactly_including_one_mebibyte(
        serve_raw: Any, start_proxy: Any, contexts: dict[str, Any]) -> None:
    heads: list[bytes] = []
    upstream_url = await serve_raw(lambda r, w: spdy_echo(r, w, heads))
    proxy = await start_proxy(upstream_url)
    reader, writer = await raw_connect(proxy, contexts)
    path = "/api/v1/namespaces/default/pods/web/portforward?ports=8080&x=%2F"
    writer.write(spdy_request(path, URL(proxy.url).port or 0))

    status, headers = await read_head(reader)
    assert status == 101
    assert headers["Upgrade"] == "SPDY/3.1"
    assert headers["X-Stream-Protocol-Version"] == "portforward.k8s.io"
    assert "Content-Length" not in headers and "Transfer-Encoding" not in headers

    # a few awkward bytes first, then 1 MiB written while it is read back
    odd = b"\x80\x03\x00\x01\r\n\r\nHTTP/1.1 200 OK\r\n\r\n\x00\xff"
    writer.write(odd)
    assert await asyncio.wait_for(reader.readexactly(len(odd)), WAIT) == odd
    payload = hashlib.shake_256(b"tunnel").digest(1024 * 1024)

    async def send() -> None:
        for offset in range(0, len(payload), 16384):
            writer.write(payload[offset:offset + 16384])
            await writer.drain()

    sender = asyncio.create_task(send())
    echoed = hashlib.sha256()
    received = 0
    while received < len(payload):
        chunk = await asyncio.wait_for(reader.read(65536), WAIT)
        assert chunk, "tunnel closed early"
        echoed.update(chunk)
        received += len(chunk)
    await asyncio.wait_for(sender, WAIT)
    assert received == len(payload)
    assert echoed.digest() == hashlib.sha256(payload).digest()

    writer.close()  # the downstream ends: the upstream sees EOF, the handler returns
    await asyncio.wait_for(proxy.finished.wait(), WAIT)

    [head] = heads
    assert request_target(head) == path
    sent = head_headers(head)
    assert sent["Upgrade"] == "SPDY/3.1"
    assert sent["Connection"] == "Upgrade"
    assert sent["Host"] == f"127.0.0.1:{URL(upstream_url).port}"
    assert sent.getall("X-Remote-User") == [devpki.ADMIN_CN]
    assert sent["Authorization"] == "Bearer not-a-real-token"
    assert sent["X-Stream-Protocol-Version"] == "portforward.k8s.io"


async def test_upgrade_to_a_peer_carries_identity_and_peer_marker(
        serve_raw: Any, start_proxy: Any, contexts: dict[str, Any]) -> None:
    """Upstream drops the identity on upgrades (docs/upstream-comparison.md); we must not."""
    heads: list[bytes] = []
    proxy = await start_proxy(await serve_raw(lambda r, w: spdy_echo(r, w, heads)),
                              to_peer=True)
    reader, writer = await raw_connect(proxy, contexts)
    writer.write(spdy_request(EXEC + "?command=sh", URL(proxy.url).port or 0))
    assert (await read_head(reader))[0] == 101
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), WAIT) == b"ping"
    writer.close()
    await asyncio.wait_for(proxy.finished.wait(), WAIT)
    sent = head_headers(heads[0])
    assert sent.getall("x-kubernetes-peer-proxied") == ["true"]
    assert sent.getall("X-Remote-User") == [devpki.ADMIN_CN]
    assert sent.getall("X-Remote-Group") == [devpki.ADMIN_GROUP]
    assert len(sent.getall("Audit-ID")) == 1


# --------------------------------------------------------------------------- (3) refusal


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_refused_upgrade_relays_status_and_body(
        serve_app: Any, start_proxy: Any, contexts: dict[str, Any], chunked: bool) -> None:
    status_body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                              "reason": "Forbidden", "code": 403,
                              "message": "pods \"web\" is forbidden"}).encode()

    async def forbid(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(status=403, body=status_body, content_type="application/json")
        response = web.StreamResponse(status=403, headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(status_body[:10])
        await response.write(status_body[10:])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_route("*", EXEC, forbid)
    proxy = await start_proxy(await serve_app(app))
    reader, writer = await raw_connect(proxy, contexts)
    writer.write(spdy_request(EXEC + "?command=ls", URL(proxy.url).port or 0))
    status, headers = await read_head(reader)
    body = await asyncio.wait_for(read_body(reader, headers), WAIT)
    assert status == 403
    assert headers["Content-Type"].startswith("application/json")
    assert headers["Connection"].lower() == "close"
    assert json.loads(body) == json.loads(status_body)
    assert await asyncio.wait_for(reader.read(), WAIT) == b""  # not kept for reuse
    writer.close()
    await asyncio.wait_for(proxy.finished.wait(), WAIT)
    assert proxy.errors == []


# --------------------------------------------------------------------------- (4) no upstream


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def refused_upgrade(proxy: Proxy, contexts: dict[str, Any]) -> ForwardError:
    """Send an upgrade through ``proxy``; it answers 503 and records why."""
    reader, writer = await raw_connect(proxy, contexts)
    writer.write(spdy_request(EXEC, URL(proxy.url).port or 0))
    status, _ = await read_head(reader)
    writer.close()
    await asyncio.wait_for(proxy.finished.wait(), WAIT)
    assert status == 503
    [error] = proxy.errors
    return error


async def test_refused_connection_is_a_retryable_connect_error(
        start_proxy: Any, contexts: dict[str, Any]) -> None:
    proxy = await start_proxy(f"https://127.0.0.1:{_free_port()}", to_peer=True)
    error = await refused_upgrade(proxy, contexts)
    assert error.retryable
    assert isinstance(error.cause, UpstreamConnectError)


async def test_untrusted_upstream_certificate_is_a_connect_error(
        serve_raw: Any, start_proxy: Any, contexts: dict[str, Any]) -> None:
    """TLS failures count as "could not connect": nothing was sent."""
    url = await serve_raw(lambda r, w: r.read(1))
    stranger = tls.client_context(None)  # system trust: does not know the test CA
    error = await refused_upgrade(await start_proxy(url, to_peer=True, client_ssl=stranger),
                                  contexts)
    assert error.retryable
    assert isinstance(error.cause, UpstreamConnectError)


async def test_garbage_answer_is_a_protocol_error_not_retryable(
        serve_raw: Any, start_proxy: Any, contexts: dict[str, Any]) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-nope\r\n\r\n")
        await writer.drain()

    proxy = await start_proxy(await serve_raw(garbage))
    error = await refused_upgrade(proxy, contexts)
    assert not error.retryable
    assert isinstance(error.cause, UpstreamProtocolError)


async def test_header_with_line_break_is_refused_before_connecting(
        start_proxy: Any, contexts: dict[str, Any]) -> None:
    """A certificate CN holding CR LF must not smuggle a header into the upstream request."""
    smuggler = Downstream(USER, "a\r\nX-Remote-Group: system:masters")
    proxy = await start_proxy(f"https://127.0.0.1:{_free_port()}",
                              identity=lambda der: smuggler)
    error = await refused_upgrade(proxy, contexts)
    assert not error.retryable
    assert isinstance(error.cause, UpstreamProtocolError)  # not "cannot connect"


# --------------------------------------------------------------------------- (5) endings


async def test_upstream_closing_mid_tunnel_closes_the_downstream(
        serve_raw: Any, start_proxy: Any, contexts: dict[str, Any]) -> None:
    heads: list[bytes] = []
    proxy = await start_proxy(await serve_raw(
        lambda r, w: spdy_echo(r, w, heads, stop_after=5)))
    reader, writer = await raw_connect(proxy, contexts)
    writer.write(spdy_request(EXEC, URL(proxy.url).port or 0))
    assert (await read_head(reader))[0] == 101
    writer.write(b"hello")
    assert await asyncio.wait_for(reader.readexactly(5), WAIT) == b"hello"
    # the upstream hung up: the downstream sees EOF, and the handler has returned
    assert await asyncio.wait_for(reader.read(), WAIT) == b""
    await asyncio.wait_for(proxy.finished.wait(), WAIT)
    writer.close()


async def test_downstream_closing_mid_tunnel_closes_the_upstream(
        serve_raw: Any, start_proxy: Any, contexts: dict[str, Any]) -> None:
    upstream_saw_eof = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n"
                     b"Upgrade: SPDY/3.1\r\n\r\n")
        await writer.drain()
        while await reader.read(65536):
            pass
        upstream_saw_eof.set()

    proxy = await start_proxy(await serve_raw(hold))
    reader, writer = await raw_connect(proxy, contexts)
    writer.write(spdy_request(EXEC, URL(proxy.url).port or 0))
    assert (await read_head(reader))[0] == 101
    writer.write(b"some bytes")
    await writer.drain()
    writer.close()
    await asyncio.wait_for(upstream_saw_eof.wait(), WAIT)
    await asyncio.wait_for(proxy.finished.wait(), WAIT)


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(("headers", "expected"), [
    ("Connection: Upgrade\r\nUpgrade: websocket\r\n", True),
    ("Connection: keep-alive, upgrade\r\nUpgrade: SPDY/3.1\r\n", True),
    ("Connection: Upgrade\r\n", False),
    ("Upgrade: websocket\r\n", False),
])
async def test_what_counts_as_an_upgrade(serve_app: Any, start_proxy: Any,
                                         contexts: dict[str, Any], headers: str,
                                         expected: bool) -> None:
    app = web.Application()
    async def plain(request: web.Request) -> web.Response:
        return web.Response(text="plain")

    app.router.add_route("*", "/{tail:.*}", plain)
    proxy = await start_proxy(await serve_app(app))
    reader, writer = await raw_connect(proxy, contexts)
    writer.write(f"GET /x HTTP/1.1\r\nHost: a\r\n{headers}\r\n".encode())
    await read_head(reader)
    writer.close()
    await asyncio.wait_for(proxy.finished.wait(), WAIT)
    assert proxy.upgrades == [expected]
