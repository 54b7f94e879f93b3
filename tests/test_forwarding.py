"""forwarding: headers toward upstreams, and byte-exact streaming both ways.

Header rules are checked on real aiohttp requests (``make_mocked_request``). The
byte-moving tests run a three-hop chain on 127.0.0.1, all over TLS from a
development PKI: a downstream ``ClientSession`` -> a tiny proxy app that calls
``forwarding.request_headers`` + ``forwarding.forward`` -> an upstream aiohttp app
(which requires the proxy's client certificate, like a peer). Every server is an
``aiohttp_server`` fixture server, stopped at teardown. Streaming is proved with an
event handshake (the upstream sends part N+1 only after the downstream has read part
N), never with timing; the only real wait is one short timeout that must expire.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import random
import re
import socket
import ssl
import uuid
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from mvproxy import devpki, forwarding, tls
from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
)
from mvproxy.forwarding import (
    ForwardError,
    request_headers,
    response_headers,
    upstream_head,
)
from mvproxy.identity import ANONYMOUS_DOWNSTREAM, PEER, USER, Downstream
from mvproxy.listener import DownstreamConnection, Exchange, Limits, Listener
from mvproxy.transport import Transport, Upstream

WAIT = 10.0
"""Upper bound of every wait for something that should happen at once."""

ALICE = Downstream(USER, "alice", ("viewer", "team-x"))
PEER_DS = Downstream(PEER, "front-proxy-client")


# --------------------------------------------------------------------------- request headers

def mocked(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Header fields as the listener hands them over: a list, in arrival order."""
    return list(headers)


def names(headers) -> set[str]:
    return {k.lower() for k in headers}


HOP_BY_HOP = [
    ("Connection", "keep-alive, X-Hop-One"),
    ("Connection", "x-hop-two"),
    ("X-Hop-One", "1"),
    ("X-Hop-Two", "2"),
    ("Keep-Alive", "timeout=5"),
    ("Proxy-Connection", "keep-alive"),
    ("Proxy-Authorization", "Basic Zm9vOmJhcg=="),
    ("Proxy-Authenticate", "Basic"),
    ("TE", "trailers"),
    ("Trailer", "X-Checksum"),
    ("Transfer-Encoding", "chunked"),
    ("Upgrade", "websocket"),
    ("Host", "mvproxy.example:6443"),
]
END_TO_END = [
    ("Accept", "application/json"),
    ("Accept", "application/yaml"),
    ("Accept-Encoding", "gzip"),
    ("Content-Type", "application/merge-patch+json"),
    ("User-Agent", "kubectl/v1.36.0"),
    ("If-None-Match", '"abc"'),
]
FORGED = [
    ("X-Remote-User", "system:admin"),
    ("X-Remote-Group", "system:masters"),
    ("X-Remote-Uid", "0"),
    ("X-Remote-Extra-Scopes", "everything"),
    ("x-kubernetes-peer-proxied", "true"),
]
CREDENTIALS = [
    ("Authorization", "Bearer secret-token"),
    ("Impersonate-User", "bob"),
    ("Impersonate-Group", "devs"),
]


@pytest.mark.parametrize("to_peer", [False, True], ids=["to backend", "to peer"])
def test_hop_by_hop_and_connection_named_headers_are_dropped(to_peer):
    out = request_headers(mocked(HOP_BY_HOP + END_TO_END), ANONYMOUS_DOWNSTREAM,
                          to_peer=to_peer, client="")
    assert not names(out) & {k.lower() for k, _ in HOP_BY_HOP}
    assert out.getall("Accept") == ["application/json", "application/yaml"]  # order kept
    for name, value in END_TO_END[2:]:
        assert out.getall(name) == [value]


@pytest.mark.parametrize("downstream", [ANONYMOUS_DOWNSTREAM, ALICE],
                         ids=["bearer/anonymous", "cert user"])
@pytest.mark.parametrize("to_peer", [False, True], ids=["to backend", "to peer"])
def test_a_non_peers_identity_headers_are_dropped_credentials_kept(downstream, to_peer):
    out = request_headers(mocked(FORGED + CREDENTIALS + END_TO_END), downstream,
                          to_peer=to_peer, client="")
    assert out.getall("X-Remote-User", []) == ([ALICE.user] if downstream is ALICE else [])
    assert out.getall("X-Remote-Group", []) == (list(ALICE.groups) if downstream is ALICE else [])
    assert "X-Remote-Uid" not in out and "X-Remote-Extra-Scopes" not in out
    assert out.getall("x-kubernetes-peer-proxied", []) == (["true"] if to_peer else [])
    for name, value in CREDENTIALS:
        assert out.getall(name) == [value]


def test_cert_user_gets_x_remote_headers():
    out = request_headers(mocked(END_TO_END), ALICE, to_peer=False, client="")
    assert out.getall("X-Remote-User") == ["alice"]
    assert out.getall("X-Remote-Group") == ["viewer", "team-x"]
    assert "x-kubernetes-peer-proxied" not in out and "Audit-ID" not in out


def test_to_peer_marks_peer_proxied_once_and_adds_an_audit_id():
    out = request_headers(mocked(END_TO_END), ANONYMOUS_DOWNSTREAM, to_peer=True,
                          client="")
    assert out.getall("x-kubernetes-peer-proxied") == ["true"]
    audit = out.getall("Audit-ID")
    assert len(audit) == 1 and uuid.UUID(audit[0])
    again = request_headers(mocked(END_TO_END), ANONYMOUS_DOWNSTREAM, to_peer=True,
                            client="")
    assert again["Audit-ID"] != audit[0]


@pytest.mark.parametrize("spelling", ["Audit-ID", "audit-id", "AUDIT-ID"])
def test_to_peer_keeps_an_incoming_audit_id(spelling):
    out = request_headers(mocked([(spelling, "abc-123"), *END_TO_END]), ALICE, to_peer=True,
                          client="")
    assert out.getall("Audit-ID") == ["abc-123"]


def test_backend_keeps_an_incoming_audit_id_and_adds_none():
    assert request_headers(mocked([("Audit-ID", "x")]), ALICE, to_peer=False,
                           client="").getall(
        "Audit-ID") == ["x"]
    assert "Audit-ID" not in request_headers(mocked([]), ALICE, to_peer=False,
                                             client="")


def test_peer_downstream_keeps_its_identity_headers_toward_the_backend():
    incoming = [("X-Remote-User", "alice"), ("X-Remote-Group", "viewer"),
                ("X-Remote-Group", "team-x"), ("X-Remote-Extra-Scopes", "s1"),
                ("x-kubernetes-peer-proxied", "true"), ("Audit-ID", "from-peer"),
                *END_TO_END]
    out = request_headers(mocked(incoming), PEER_DS, to_peer=False, client="")
    assert out.getall("X-Remote-User") == ["alice"]
    assert out.getall("X-Remote-Group") == ["viewer", "team-x"]
    assert out.getall("X-Remote-Extra-Scopes") == ["s1"]
    assert out.getall("x-kubernetes-peer-proxied") == ["true"]
    assert out.getall("Audit-ID") == ["from-peer"]


def test_peer_downstream_toward_a_peer_gets_one_peer_proxied_marker():
    incoming = [("X-Remote-User", "alice"), ("x-kubernetes-peer-proxied", "false")]
    out = request_headers(mocked(incoming), PEER_DS, to_peer=True, client="")
    assert out.getall("X-Remote-User") == ["alice"]
    assert out.getall("x-kubernetes-peer-proxied") == ["true"]


def _exchange(raw, downstream: Downstream) -> Exchange:
    """A real ``Exchange`` (the compiled engine takes no look-alike) for ``GET
    /api/v1/pods`` with ``raw`` fields, on a connection of ``downstream``."""
    async def made() -> Exchange:
        listener = Listener(handler=lambda exchange, conn: None, limits=Limits(),
                            ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER),
                            resolve_identity=lambda der: downstream, anonymous=downstream,
                            on_refused=lambda status: None)
        return Exchange(DownstreamConnection(listener), "GET", "/api/v1/pods", (1, 1), raw,
                        True, False)

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(made())
    finally:
        loop.close()


def _via_raw_head(fields, downstream, *, to_peer: bool, client: str) -> CIMultiDict:
    """The hot path's filter (``upstream_head``, bytes) on the same input, as headers."""
    exchange = _exchange([(n.encode(), v.encode()) for n, v in fields], downstream)
    head, _ = upstream_head(exchange, b"peer.example:6443", client=client.encode(),
                            audit_id=b"id-1" if to_peer else b"")
    lines = head.decode().split("\r\n")[1:-2]
    return CIMultiDict(line.split(": ", 1) for line in lines if not line.startswith("Host:"))


BOTH_FILTERS = pytest.mark.parametrize("headers_of", [request_headers, _via_raw_head],
                                       ids=["text", "raw"])


@BOTH_FILTERS
@pytest.mark.parametrize(("incoming", "client", "expected"), [
    ([], "127.0.0.2", "127.0.0.2"),
    ([("X-Forwarded-For", "127.0.0.9")], "127.0.0.2", "127.0.0.9, 127.0.0.2"),
    ([("X-Forwarded-For", "127.0.0.9, 127.0.0.8"), ("x-forwarded-for", "127.0.0.7")],
     "::1", "127.0.0.9, 127.0.0.8, 127.0.0.7, ::1"),
    ([("Connection", "X-Forwarded-For"), ("X-Forwarded-For", "127.0.0.9")], "127.0.0.2",
     "127.0.0.2"),
    ([("X-Forwarded-For", "127.0.0.9")], "", "127.0.0.9"),
    ([], "", None),
], ids=["none sent", "one sent", "several fields joined", "named by Connection",
        "no address", "nothing"])
@pytest.mark.parametrize("to_peer", [False, True], ids=["to backend", "to peer"])
def test_x_forwarded_for_appends_the_client_address(headers_of, incoming, client, expected,
                                                    to_peer):
    """As Go's ``httputil.ReverseProxy`` (net/http/httputil/reverseproxy.go), which
    kube-apiserver's proxies use (staging/src/k8s.io/apimachinery/pkg/util/proxy/
    upgradeaware.go): prior values joined with ", ", then the downstream's address, in
    one field; hop-by-hop ones removed first."""
    out = headers_of(mocked(incoming), ANONYMOUS_DOWNSTREAM, to_peer=to_peer, client=client)
    assert out.getall("X-Forwarded-For", []) == ([expected] if expected else [])


@BOTH_FILTERS
def test_the_peer_hop_sets_forwarded_proto_and_host(headers_of):
    """Upstream's peer proxy sends ``X-Forwarded-Proto: https`` and ``X-Forwarded-Host``
    (staging/src/k8s.io/apiserver/pkg/util/peerproxy/peerproxy_handler.go); a client's
    own values are replaced there. mvproxy sends the Host the client asked for."""
    incoming = [("Host", "api.example:6443"), ("X-Forwarded-Proto", "http"),
                ("X-Forwarded-Host", "evil.example")]
    out = headers_of(mocked(incoming), ANONYMOUS_DOWNSTREAM, to_peer=True, client="127.0.0.2")
    assert out.getall("X-Forwarded-Proto") == ["https"]
    assert out.getall("X-Forwarded-Host") == ["api.example:6443"]


@BOTH_FILTERS
def test_the_backend_hop_passes_forwarded_fields_through(headers_of):
    """kube-apiserver ignores them; what a client sends reaches its backend as it
    would without mvproxy."""
    incoming = [("Host", "api.example:6443"), ("X-Forwarded-Proto", "http")]
    out = headers_of(mocked(incoming), ANONYMOUS_DOWNSTREAM, to_peer=False,
                     client="127.0.0.2")
    assert out.getall("X-Forwarded-Proto") == ["http"]
    assert "X-Forwarded-Host" not in out


def test_response_headers_drop_hop_by_hop_and_length_keep_repeats():
    upstream = CIMultiDict([
        ("Connection", "keep-alive, X-Hop"), ("X-Hop", "1"), ("Keep-Alive", "timeout=5"),
        ("Transfer-Encoding", "chunked"), ("Content-Length", "10"), ("Content-Type", "a/b"),
        ("Content-Encoding", "gzip"), ("Warning", "299 - one"), ("Warning", "299 - two"),
        ("Audit-Id", "abc"), ("ETag", '"e"'),
    ])
    out = CIMultiDict(response_headers(list(upstream.items())))
    assert names(out) == {"content-type", "content-encoding", "warning", "audit-id", "etag"}
    assert out.getall("Warning") == ["299 - one", "299 - two"]


# --------------------------------------------------------------------------- loopback chain

@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki") / "pki"
    devpki.init_pki(directory, ["a", "b"], days=2)
    return directory


@pytest.fixture
async def transport():
    t = Transport(connect_timeout=WAIT, request_timeout=WAIT)
    yield t
    await t.close()


@pytest.fixture
async def downstream_client(root):
    """The downstream: verifies the proxy, never decompresses, sends paths as given."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=tls.client_context(root / "ca.crt")),
        auto_decompress=False, timeout=aiohttp.ClientTimeout(total=60))
    yield session
    await session.close()


def proxy_handler(transport: Transport, upstream: Upstream, *, downstream=ANONYMOUS_DOWNSTREAM,
                  to_peer=True, long_running=True):
    """What ``handlers`` does for one chosen upstream, minus routing."""
    async def handle(exchange) -> None:
        headers = request_headers(exchange.fields, downstream, to_peer=to_peer, client="")
        try:
            await forwarding.forward(exchange, transport, upstream, headers,
                                     long_running=long_running)
        except ForwardError as exc:
            body = json.dumps({"retryable": exc.retryable,
                               "cause": type(exc.cause).__name__}).encode()
            exchange.respond(599, [("Content-Type", "application/json")], body)

    return handle


@pytest.fixture
def chain(aiohttp_server, root, transport, listen):
    """``await chain(upstream_app, **proxy_kw)`` -> base URL of the proxy."""
    async def start(upstream_app: web.Application | None, *, upstream_url: str | None = None,
                    **proxy_kw) -> str:
        if upstream_app is not None:
            up_server = await aiohttp_server(upstream_app, ssl=tls.server_context(
                root / "b" / "mvproxy.crt", root / "b" / "mvproxy.key", root / "front-proxy-ca.crt",
                require_client_cert=True))
            upstream_url = f"https://127.0.0.1:{up_server.port}"
        up = Upstream("apiserver-b", upstream_url, tls.client_context(
            root / "ca.crt", root / "a" / "front-proxy-client.crt",
            root / "a" / "front-proxy-client.key"), is_peer=True)
        port = await listen(proxy_handler(transport, up, **proxy_kw), tls.server_context(
            root / "a" / "mvproxy.crt", root / "a" / "mvproxy.key"))
        return f"https://127.0.0.1:{port}"
    return start


def catch_all(handler) -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


async def test_response_is_streamed_part_by_part(chain, downstream_client):
    parts = [b'{"type":"ADDED"}\n', b'{"type":"MODIFIED"}\n', b'{"type":"DELETED"}\n']
    read = [asyncio.Event() for _ in parts]

    async def watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for part, done in zip(parts, read, strict=True):
            await response.write(part)
            await asyncio.wait_for(done.wait(), WAIT)  # the downstream has it before the next
        await response.write_eof()
        return response

    base = await chain(catch_all(watch))
    try:
        async with downstream_client.get(f"{base}/apis/x/v1/things?watch=1") as resp:
            assert resp.status == 200
            assert resp.headers["Transfer-Encoding"] == "chunked"
            for part, done in zip(parts, read, strict=True):
                assert await asyncio.wait_for(resp.content.readline(), WAIT) == part
                done.set()
            assert await asyncio.wait_for(resp.content.read(), WAIT) == b""
    finally:
        for done in read:
            done.set()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_large_request_body_arrives_intact(chain, downstream_client, chunked):
    body = random.Random(42).randbytes(8 * 1024 * 1024)
    seen = {}

    async def upload(request: web.Request) -> web.Response:
        digest, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_chunked(256 * 1024):
            digest.update(chunk)
            size += len(chunk)
        seen.update(sha=digest.hexdigest(), size=size, length=request.headers.get("Content-Length"),
                    te=request.headers.get("Transfer-Encoding"))
        return web.json_response({"size": size}, status=201)

    async def pieces():
        for i in range(0, len(body), 1_000_003):  # odd sizes: no alignment luck
            yield body[i:i + 1_000_003]

    base = await chain(catch_all(upload))
    async with downstream_client.post(f"{base}/api/v1/namespaces/ns/configmaps",
                                      data=pieces() if chunked else io.BytesIO(body)) as resp:
        assert resp.status == 201 and await resp.json() == {"size": len(body)}
    assert seen["sha"] == hashlib.sha256(body).hexdigest() and seen["size"] == len(body)
    if chunked:
        assert seen["te"] == "chunked" and seen["length"] is None
    else:
        assert seen["length"] == str(len(body)) and seen["te"] is None


async def test_gzip_response_passes_through_byte_for_byte(chain, downstream_client):
    raw = b'{"kind":"PodList","items":[]}' * 500
    compressed = gzip.compress(raw, mtime=0)
    seen = {}

    async def gzipped(request: web.Request) -> web.Response:
        seen["accept_encoding"] = request.headers.get("Accept-Encoding")
        return web.Response(body=compressed, headers={"Content-Encoding": "gzip",
                                                      "Content-Type": "application/json"})

    base = await chain(catch_all(gzipped))
    async with downstream_client.get(f"{base}/api/v1/pods",
                                     headers={"Accept-Encoding": "gzip"}) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        assert resp.headers["Content-Length"] == str(len(compressed))
        assert await resp.read() == compressed
    assert seen["accept_encoding"] == "gzip"


@pytest.mark.parametrize("raw", [
    "/api/v1/namespaces/ns/configmaps/a%2Fb?z=1&a=2&a=1",
    "/apis/x.example/v1/things/%7Efoo%2f%41/sub?b=%2F+x&a=%zz&fieldSelector=metadata.name%3Dx",
    "/api/v1/namespaces/ns/pods/p/proxy/a%20b/?q=a%20b;c&&",
], ids=["escaped slash, unsorted query", "escapes yarl would requote", "spaces and odd query"])
async def test_path_and_query_arrive_byte_for_byte(chain, downstream_client, raw):
    seen = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.Response(text="ok")

    base = await chain(catch_all(record))
    async with downstream_client.get(URL(base + raw, encoded=True)) as resp:
        assert resp.status == 200
    assert seen == [raw]


async def test_status_and_headers_of_an_error_pass_through(chain, downstream_client):
    body = b'{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}'
    seen = {}

    async def not_found(request: web.Request) -> web.Response:
        seen.update(request.headers)
        return web.Response(status=404, body=body, headers={
            "Content-Type": "application/json", "Warning": "299 - deprecated",
            "Audit-Id": "upstream-audit"})

    base = await chain(catch_all(not_found))
    async with downstream_client.get(f"{base}/api/v1/namespaces/ns/pods/missing", headers={
            "Connection": "keep-alive, X-Hop", "X-Hop": "secret", "Audit-ID": "mine",
            "X-Remote-User": "system:admin"}) as resp:
        assert resp.status == 404 and await resp.read() == body
        assert resp.headers["Warning"] == "299 - deprecated"
        assert resp.headers["Audit-Id"] == "upstream-audit"
    assert "X-Hop" not in seen and "X-Remote-User" not in seen
    assert seen["x-kubernetes-peer-proxied"] == "true" and seen["Audit-ID"] == "mine"


async def test_head_and_not_modified_have_no_body(chain, downstream_client):
    async def conditional(request: web.Request) -> web.Response:
        if request.headers.get("If-None-Match") == '"v1"':
            return web.Response(status=304, headers={"ETag": '"v1"'})
        return web.Response(body=b"x" * 100, headers={"ETag": '"v1"',
                                                      "Content-Type": "application/json"})

    base = await chain(catch_all(conditional))
    async with downstream_client.head(f"{base}/openapi/v3/apis/x/v1") as resp:
        assert resp.status == 200 and resp.headers["Content-Length"] == "100"
        assert await resp.read() == b""
    async with downstream_client.get(f"{base}/openapi/v3/apis/x/v1",
                                     headers={"If-None-Match": '"v1"'}) as resp:
        assert resp.status == 304 and resp.headers["ETag"] == '"v1"'
        assert await resp.read() == b""
    async with downstream_client.get(f"{base}/openapi/v3/apis/x/v1") as resp:
        assert resp.status == 200 and await resp.read() == b"x" * 100


# --------------------------------------------------------------------------- HTTP/1.0 keep-alive
# A 1.0 client closes after each answer unless it says ``Connection: keep-alive``.


async def one_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of the next response: a Content-Length body, else up to the end."""
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"\r\ncontent-length: *(\d+)", head.lower())
        body = await (reader.readexactly(int(length[1])) if length else reader.read())
    return head, body


def connection_field(head: bytes) -> list[bytes]:
    return re.findall(rb"\r\nconnection: *([^\r]*)", head.lower())


async def open_tls(base: str, root: Path):
    return await asyncio.open_connection(
        "127.0.0.1", int(base.rsplit(":", 1)[1]), ssl=tls.client_context(root / "ca.crt"),
        server_hostname="127.0.0.1")


def one_point_zero(path: str, fields: bytes = b"Connection: keep-alive\r\n") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.0\r\nHost: x\r\n" + fields + b"\r\n"


async def test_a_relayed_answer_to_an_http10_keep_alive_request_says_keep_alive(chain, root):
    """The connection was kept open but the answer lacked ``Connection: keep-alive``, so
    the 1.0 client closed it anyway (``start_raw``)."""
    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    base = await chain(catch_all(answer))
    reader, writer = await open_tls(base, root)
    try:
        for path in ("/api/v1/namespaces/one", "/api/v1/namespaces/two"):
            writer.write(one_point_zero(path))
            head, body = await one_response(reader)
            assert head.startswith(b"HTTP/1.1 200 ") and connection_field(head) == [
                b"keep-alive"], head
            assert json.loads(body) == {"path": path}
        writer.write(one_point_zero("/api/v1/namespaces/last", b""))  # 1.0's default
        head, body = await one_response(reader)
        assert connection_field(head) == [b"close"] and await reader.read() == b""
    finally:
        writer.close()


async def test_a_streamed_answer_to_an_http10_keep_alive_request_still_closes(chain, root):
    """No chunked coding in 1.0: the body ends with the connection, which says so."""
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b'{"type":"ADDED"}\n')
        await response.write_eof()
        return response

    base = await chain(catch_all(stream))
    reader, writer = await open_tls(base, root)
    try:
        writer.write(one_point_zero("/api/v1/pods?watch=1"))
        head, body = await one_response(reader)
    finally:
        writer.close()
    assert connection_field(head) == [b"close"] and b"transfer-encoding" not in head.lower()
    assert body == b'{"type":"ADDED"}\n'


async def test_an_answer_mvproxy_writes_to_an_http10_keep_alive_request_says_keep_alive(
        listen, root):
    """``respond`` (and ``start`` under it): discovery, Status answers."""
    async def handle(exchange) -> None:
        exchange.respond(200, [("Content-Type", "application/json")],
                         json.dumps({"path": exchange.path}).encode())

    port = await listen(handle, tls.server_context(root / "a" / "mvproxy.crt",
                                                   root / "a" / "mvproxy.key"))
    reader, writer = await open_tls(f"https://127.0.0.1:{port}", root)
    try:
        for path in ("/apis", "/api"):
            writer.write(one_point_zero(path))
            head, body = await one_response(reader)
            assert connection_field(head) == [b"keep-alive"], head
            assert json.loads(body) == {"path": path}
        writer.write(one_point_zero("/version", b""))
        head, _ = await one_response(reader)
        assert connection_field(head) == [b"close"] and await reader.read() == b""
    finally:
        writer.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("method, body", [("GET", None), ("POST", b'{"kind":"Pod"}')],
                         ids=["GET", "POST with body"])
async def test_connect_failure_is_retryable_because_nothing_was_sent(chain, downstream_client,
                                                                      method, body):
    base = await chain(None, upstream_url=f"https://127.0.0.1:{closed_port()}")
    async with downstream_client.request(method, f"{base}/api/v1/namespaces/ns/pods",
                                         data=body) as resp:
        assert resp.status == 599
        assert await resp.json() == {"retryable": True, "cause": "UpstreamConnectError"}


@pytest.fixture
async def short_transport():
    t = Transport(connect_timeout=WAIT, request_timeout=0.2)
    yield t
    await t.close()


@pytest.mark.parametrize("method, body, retryable", [
    ("GET", None, True), ("POST", b'{"kind":"Pod"}', False), ("POST", None, False),
], ids=["GET may go to another peer", "POST whose body was sent may not",
        "POST without body may not either"])
async def test_timeout_is_retryable_only_when_safe(aiohttp_server, root, short_transport,
                                                   downstream_client, listen, method, body,
                                                   retryable):
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.wait_for(release.wait(), WAIT)
        return web.Response(text="too late")

    up_server = await aiohttp_server(catch_all(hang), ssl=tls.server_context(
        root / "b" / "mvproxy.crt", root / "b" / "mvproxy.key", root / "front-proxy-ca.crt",
        require_client_cert=True))
    up = Upstream("apiserver-b", f"https://127.0.0.1:{up_server.port}", tls.client_context(
        root / "ca.crt", root / "a" / "front-proxy-client.crt",
        root / "a" / "front-proxy-client.key"), is_peer=True)
    port = await listen(proxy_handler(short_transport, up, long_running=False),
                        tls.server_context(root / "a" / "mvproxy.crt", root / "a" / "mvproxy.key"))
    try:
        async with downstream_client.request(
                method, f"https://127.0.0.1:{port}/api/v1/namespaces/ns/pods",
                data=body) as resp:
            assert resp.status == 599
            assert await resp.json() == {"retryable": retryable, "cause": "UpstreamTimeout"}
    finally:
        release.set()


def test_forward_error_keeps_its_cause():
    cause = UpstreamConnectError("apiserver-b", "cannot connect: refused")
    error = ForwardError(cause, retryable=True)
    assert error.cause is cause and error.retryable and "apiserver-b" in str(error)
    assert not isinstance(error, UpstreamError)
