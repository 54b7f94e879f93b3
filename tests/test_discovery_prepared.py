"""Merged discovery's ready answers (``discoveryhandler.Prepared``) through the real
entry point (``Proxy.handle``) and downstream protocol, over a fake transport: what a
client sees is byte for byte what ``Exchange.respond`` writes for the same document,
and the ready answer never reaches a connection the backend has not said yes to.

The backend is a fake ``Transport``: it says yes (304) to a certificate user or to
``Bearer good``, and 401 to anything else, and counts the probes it is asked."""

from __future__ import annotations

import asyncio
import json
import random
import ssl

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from mvproxy import discovery
from mvproxy.cache import DiscoveryCache
from mvproxy.discoveryhandler import PREPARED_MAX, DiscoveryHandler
from mvproxy.handlers import Proxy
from mvproxy.identity import ANONYMOUS_DOWNSTREAM, user_downstream
from mvproxy.listener import DownstreamConnection, Exchange, Limits, Listener
from mvproxy.live import LiveSettings
from mvproxy.metrics import Metrics
from mvproxy.transport import Fetched, Transport, Upstream

AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
ADMIN = user_downstream("admin", ("system:masters",))
UNAUTHORIZED = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {},
                           "status": "Failure", "reason": "Unauthorized",
                           "code": 401}).encode()


def _items(*groups: str) -> bytes:
    return json.dumps({"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2",
                       "metadata": {}, "items": [
                           {"metadata": {"name": g}, "versions": [
                               {"version": "v1", "freshness": "Current", "resources": [
                                   {"resource": "widgets", "scope": "Namespaced",
                                    "verbs": ["get"],
                                    "responseKind": {"group": g, "version": "v1",
                                                     "kind": "Widget"}}]}]}
                           for g in groups]}).encode()


class Backend:
    """The fake ``Transport`` and ``Upstream``: kube's authentication, in one rule."""

    name = "backend"
    anonymous = None

    def __init__(self) -> None:
        self.probes: list[str] = []

    def for_headers(self, headers) -> Backend:
        return self

    async def fetch(self, upstream, target, *, headers, **_) -> Fetched:
        self.probes.append(target)
        yes = "X-Remote-User" in headers or headers.get("Authorization") == "Bearer good"
        if yes:
            return Fetched(304, CIMultiDictProxy(CIMultiDict()), b"")
        return Fetched(401, CIMultiDictProxy(CIMultiDict(
            {"Content-Type": "application/json"})), UNAUTHORIZED)


class Wire(asyncio.Transport):
    """What the connection writes, as one client's socket would receive it."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    abort = close

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


class Client:
    def __init__(self, conn: DownstreamConnection, wire: Wire):
        self.conn, self.wire = conn, wire

    async def send(self, request: bytes) -> bytes:
        self.conn.data_received(request)
        for _ in range(50):  # a fixed number of loop turns: the probe's task, if any
            await asyncio.sleep(0)
        out, self.wire.out = bytes(self.wire.out), bytearray()
        return out


class Setup:
    def __init__(self) -> None:
        self.cache = DiscoveryCache("a", ["b"], stale_after=60, forget_after=600)
        for server, groups in (("a", ("apps",)), ("b", ("apps", "scheduling.k8s.io"))):
            self.cache.record_success(server, discovery.Snapshot(
                groups=discovery.parse_aggregated(_items(*groups), max_bytes=1 << 20)))
        assert self.cache.view().synced
        self.backend = Backend()
        self.metrics = Metrics()
        self.handler = DiscoveryHandler(cache=self.cache, transport=self.backend,
                                        backend=self.backend, metrics=self.metrics,
                                        live=LiveSettings(5, 10.0, 1 << 20))
        # The engine's own transport and backend (compiled, it takes no look-alikes),
        # never used: discovery, all these tests ask for, goes through the handler's.
        unused = Upstream(name="backend", url="https://127.0.0.1:9",
                          ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
        proxy = Proxy(server_id="a", cache=self.cache,
                      transport=Transport(connect_timeout=1.0, request_timeout=1.0),
                      backend=unused, peers=dict, metrics=self.metrics,
                      discovery=self.handler, rng=random.Random(1))
        self.proxy_listener = self._listener(proxy.handle)
        self.reference_listener = self._listener(self._reference)
        self.made: list[DownstreamConnection] = []

    @staticmethod
    def _listener(handler) -> Listener:
        return Listener(handler=handler, limits=Limits(),
                        ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER),
                        resolve_identity=lambda der: ANONYMOUS_DOWNSTREAM,
                        anonymous=ANONYMOUS_DOWNSTREAM, on_refused=lambda *_: None)

    def _reference(self, exchange: Exchange, conn: DownstreamConnection) -> None:
        """The merged document's answer as ``_merged`` wrote it before answers were
        prepared: through ``Exchange.respond``, from the headers multidict."""
        accept = exchange.headers.get("Accept")
        negotiated = discovery.negotiate(accept, aggregated=True)
        key = ("/apis", negotiated.kind, negotiated.api_version or "")
        document = self.cache.view()._documents[key]
        fields = [("ETag", document.etag), ("Vary", "Accept"), ("Cache-Control", "public")]
        if exchange.headers.get("If-None-Match") == document.etag:
            exchange.respond(304, fields)
        else:
            fields.append(("Content-Type", negotiated.content_type))
            exchange.respond(200, fields, document.body)
        conn.finish(exchange)

    def connect(self, downstream=ADMIN, *, reference: bool = False) -> Client:
        listener = self.reference_listener if reference else self.proxy_listener
        conn = DownstreamConnection(listener)
        wire = Wire()
        conn.connection_made(wire)
        conn.downstream = downstream
        self.made.append(conn)
        return Client(conn, wire)

    def hits(self) -> float:
        return self.metrics.registry.get_sample_value(
            "aggregator_discovery_peer_aggregated_cache_hits_total") or 0.0


@pytest.fixture
async def setup():
    made = Setup()
    yield made
    for conn in made.made:
        conn.connection_lost(None)
    await asyncio.sleep(0)


def request(accept: str | None = AGGREGATED, *, method: str = "GET", version: str = "1.1",
            extra: str = "") -> bytes:
    fields = f"Accept: {accept}\r\n" if accept is not None else ""
    return (f"{method} /apis HTTP/{version}\r\nHost: a\r\n{fields}{extra}\r\n").encode()


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_ready_answers_are_the_bytes_respond_writes(setup):
    """GET, HEAD, If-None-Match (304 and a stale tag), HTTP/1.0, Connection: close,
    legacy and no Accept: the ready answer is byte for byte ``Exchange.respond``'s."""
    client = setup.connect()
    assert status(await client.send(request())) == 200  # authorized, rendered, prepared
    documents = setup.cache.view()._documents
    etag = documents[("/apis", "aggregated", discovery.API_VERSION_V2)].etag
    variants = [request(), request(method="HEAD"), request("application/json"),
                request(None), request("application/json", method="HEAD"),
                request(extra=f"If-None-Match: {etag}\r\n"),
                request(extra='If-None-Match: "stale"\r\n'),
                request(version="1.0", extra="Connection: keep-alive\r\n"),
                request(version="1.0",
                        extra=f"Connection: keep-alive\r\nIf-None-Match: {etag}\r\n")]
    for variant in variants:
        first = await client.send(variant)  # prepares this Accept value's answer
        ready = await client.send(variant)
        expected = await setup.connect(reference=True).send(variant)
        assert first == ready == expected, variant
    assert len(setup.handler._prepared) == 3  # aggregated, legacy, no Accept
    closing = request(extra="Connection: close\r\n")
    expected = await setup.connect(reference=True).send(closing)
    assert b"Connection: close\r\n" in expected
    assert await client.send(closing) == expected
    assert setup.backend.probes == ["/apis"]  # one yes for the connection, then memo


async def test_ready_answer_counts_as_a_cache_hit(setup):
    client = setup.connect()
    await client.send(request())  # the rendering: a miss
    before = setup.hits()
    for _ in range(3):
        assert status(await client.send(request())) == 200
    assert setup.hits() == before + 3


async def test_a_connection_not_said_yes_to_never_gets_the_ready_answer(setup):
    """The answer is ready for this Accept value, yet a connection without
    credentials, with a bad token, or whose token changed after a yes, is asked for
    at the backend and gets its refusal, each time."""
    admin = setup.connect()
    for _ in range(2):
        assert status(await admin.send(request())) == 200
    assert setup.handler._prepared
    anonymous = setup.connect(ANONYMOUS_DOWNSTREAM)
    for credentials in ("", "Authorization: Bearer bad\r\n"):
        for _ in range(2):
            answer = await anonymous.send(request(extra=credentials))
            assert status(answer) == 401 and answer.endswith(UNAUTHORIZED), answer
    token = setup.connect(ANONYMOUS_DOWNSTREAM)
    assert status(await token.send(request(extra="Authorization: Bearer good\r\n"))) == 200
    assert status(await token.send(request(extra="Authorization: Bearer good\r\n"))) == 200
    answer = await token.send(request(extra="Authorization: Bearer bad\r\n"))
    assert status(answer) == 401
    assert setup.backend.probes.count("/apis") == 7  # admin, 4 refusals, good, bad


async def test_another_connections_yes_never_applies(setup):
    """Two connections sending the same (no) credential headers: the certificate
    user's yes is its connection's alone; an anonymous one is refused."""
    admin = setup.connect()
    assert status(await admin.send(request())) == 200
    assert status(await admin.send(request())) == 200
    other = setup.connect(ANONYMOUS_DOWNSTREAM)
    assert status(await other.send(request())) == 401
    assert setup.backend.probes == ["/apis", "/apis"]


async def test_a_new_generation_prepares_its_own_answers(setup):
    client = setup.connect()
    assert status(await client.send(request())) == 200
    old = setup.handler._prepared_view
    setup.cache.record_success("b", discovery.Snapshot(groups=discovery.parse_aggregated(
        _items("apps", "scheduling.k8s.io", "extra.example.com"), max_bytes=1 << 20)))
    assert setup.cache.view() is not old
    answer = await client.send(request())
    assert b"extra.example.com" in answer
    assert await client.send(request()) == answer
    assert setup.handler._prepared_view is setup.cache.view()


async def test_ready_answers_stay_bounded_whatever_accept_clients_send(setup):
    client = setup.connect()
    for n in range(PREPARED_MAX + 20):
        answer = await client.send(request(f"application/json;q=0.{n % 9 + 1}, */*;n={n}"))
        assert status(answer) == 200
    assert len(setup.handler._prepared) == PREPARED_MAX
    answer = await client.send(request("application/json;n=" + "x" * 2000))
    assert status(answer) == 200 and len(setup.handler._prepared) == PREPARED_MAX


async def test_v2beta1_is_never_answered_ready(setup):
    """Whether the backend serves v2beta1 is asked on every such request."""
    client = setup.connect()
    v2beta1 = AGGREGATED.replace("v=v2", "v=v2beta1")
    for _ in range(3):
        await client.send(request(v2beta1))
    assert setup.backend.probes.count("/apis") == 3
    assert not setup.handler._prepared
