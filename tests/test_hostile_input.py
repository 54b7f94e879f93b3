"""Hostile input, standing suite: what can an unauthenticated client make mvproxy do?

1. The pure parsers (request checks, request info, routing, Accept negotiation,
   discovery documents, header encoding) take generated input (hypothesis) and never
   raise anything but their declared errors; the request checks accept no
   ``Transfer-Encoding`` llhttp refuses (a measured table, then generated values).
2. The listener takes generated and mutated request heads, smuggling variants,
   early-ending bodies and slow clients over real TLS: every answer is a 4xx/5xx
   ``Status`` (or the connection closes), never a 500 or a traceback; the backend
   only ever sees origin-form targets and no underscore names; nothing is smuggled
   through; no connection goes anywhere but the backend (a canary listener counts);
   and a well-behaved client is served afterwards. Once a request went upstream, what
   the client sends after it cannot change its answer: the backend's answer arrives
   with ``Connection: close``; a request refused with bytes of the same read never
   reaches the backend (the object exists exactly when the client was told 201); what
   follows a request with ``Connection: close`` is ignored, never refused instead of it.
3. No token, key or body reaches a log line, at any verbosity, in either format.

Example counts are bounded (``max_examples``), and each case records what it tried
for ``docs/reliability.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httptools
import pytest
from aiohttp import web
from daemon_support import (
    PODGROUPS,
    WAIT,
    Cluster,
    body_of,
    cluster,
    read_until_closed,
    ready,
    synced,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import record
from test_routing import VIEWS
from test_security import Canary

from mvproxy import discovery, logs, requestcheck, routing, wire
from mvproxy.discovery import DiscoveryFormatError
from mvproxy.requestinfo import parse_request_info

SUITE = "Hostile input"
PURE = settings(max_examples=400, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

text = st.text(alphabet=st.characters(codec="latin-1"), max_size=200)
path_like = st.lists(st.sampled_from(["/", "//", "api", "apis", "v1", "namespaces", "..",
                                      "%2F", "%00", "watch", "pods", "exec", "?", "&", "=",
                                      "#", " ", "\t", "x", "scheduling.k8s.io"]),
                     max_size=14).map("".join)


# --------------------------------------------------------------------------- 1. pure parsers


@PURE
@given(major=st.integers(0, 3), minor=st.integers(0, 9), target=st.one_of(text, path_like),
       codings=st.lists(text, max_size=3))
def test_check_request_accepts_only_what_can_be_forwarded(major, minor, target, codings):
    refusal = requestcheck.check_request((major, minor), target, codings)
    if refusal is None:
        assert (major, minor) in ((1, 0), (1, 1))
        assert target.startswith("/") and not target.startswith("//")
        assert not any(c in target for c in " #\r\n\0\x7f")
        assert not codings or (len(codings) == 1 and codings[0].strip(" \t").lower()
                               == "chunked" and not codings[0].endswith("\t"))
    else:
        assert refusal.status in (400, 501, 505)


class _Head:
    """What llhttp tells the listener about a request head (its callbacks)."""

    def __init__(self) -> None:
        self.te: list[bytes] = []
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"transfer-encoding":
            self.te.append(value)

    def on_headers_complete(self) -> None:
        self.complete = True


def llhttp_reads(values: list[bytes]) -> tuple[str, list[str]]:
    """llhttp's verdict on a chunked POST with these ``Transfer-Encoding`` field values
    ("accepted", "refused in the head", "refused after the head": the listener had
    already seen the whole head), and the values as the listener gets them."""
    head = _Head()
    parser = httptools.HttpRequestParser(head)
    raw = (b"POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\nHost: x\r\n"
           + b"".join(b"Transfer-Encoding: " + v + b"\r\n" for v in values)
           + b"\r\n3\r\nabc\r\n0\r\n\r\n")
    try:
        parser.feed_data(raw)
        verdict = "accepted"
    except httptools.HttpParserError:
        verdict = "refused after the head" if head.complete else "refused in the head"
    return verdict, [v.decode("latin-1") for v in head.te]


TE_TABLE = {
    # values: (llhttp's verdict, mvproxy's status; None = served)
    (b"chunked",): ("accepted", None),
    (b"Chunked",): ("accepted", None),
    (b" chunked",): ("accepted", None),
    (b"\tchunked",): ("accepted", None),
    (b"chunked ",): ("accepted", None),
    (b"chunked  ",): ("accepted", None),
    (b"chunked\t",): ("refused after the head", 400),
    (b"chunked\t\t",): ("refused after the head", 400),
    (b" \tchunked\t ",): ("refused after the head", 400),
    (b"chunked\xa0",): ("refused after the head", 501),
    (b"chunked\x85",): ("refused after the head", 501),
    (b"chunked;x",): ("refused after the head", 501),
    (b"chunked; x=1",): ("refused after the head", 501),
    (b'"chunked"',): ("refused after the head", 501),
    (b"xchunked",): ("refused after the head", 501),
    (b"identity",): ("refused after the head", 501),
    (b"gzip, chunked",): ("accepted", 501),
    (b"gzip,chunked",): ("accepted", 501),
    (b"identity, chunked",): ("accepted", 501),
    (b", chunked",): ("accepted", 501),
    (b"gzip", b"chunked"): ("accepted", 501),
    (b"chunked, chunked",): ("refused in the head", None),
    (b"chunked,",): ("refused in the head", None),
    (b"chunked, identity",): ("refused in the head", None),
    (b"chunked", b"chunked"): ("refused in the head", None),
    (b"chunked", b"gzip"): ("refused in the head", None),
    (b"",): ("refused in the head", None),
    (b"chunked\x0b",): ("refused in the head", None),
}
"""Measured with httptools 0.9.0 (llhttp 9). "refused in the head": the listener never
sees the head, so mvproxy's status does not apply (None)."""


@pytest.mark.parametrize("values", list(TE_TABLE), ids=[repr(b", ".join(v))[2:-1] or "empty"
                                                         for v in TE_TABLE])
def test_transfer_encoding_is_accepted_only_as_llhttp_accepts_it(values):
    """``Transfer-Encoding: chunked<TAB>`` passed check_request (str.strip) and reached
    the backend; llhttp refused it only after the head. Never accept what it refuses."""
    verdict, seen = llhttp_reads(list(values))
    status = None
    if verdict != "refused in the head":
        refusal = requestcheck.check_request((1, 1), "/api", seen)
        status = refusal.status if refusal is not None else None
        assert status is not None or verdict == "accepted"
    assert (verdict, status) == TE_TABLE[values]


_ws = st.text(alphabet=" \t\xa0\x0b\x85", max_size=3)
_coding = st.tuples(_ws, st.sampled_from(["chunked", "Chunked", "CHUNKED", "gzip", "identity",
                                          "chunked;x", "chunked=1", '"chunked"', "x", ""]),
                    _ws).map("".join)
te_values = st.lists(st.lists(_coding, min_size=1, max_size=3).map(",".join)
                     .map(lambda v: v.encode("latin-1")), min_size=1, max_size=2)


@PURE
@given(values=te_values)
def test_what_check_request_accepts_llhttp_accepts(values):
    verdict, seen = llhttp_reads(values)
    if verdict != "refused in the head" and requestcheck.check_request((1, 1), "/", seen) is None:
        assert verdict == "accepted", values


@PURE
@given(method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS",
                               "get", "BREW", ""]),
       path=st.one_of(path_like, text), query=st.one_of(text, path_like),
       view=st.sampled_from(sorted(VIEWS)), peer_proxied=st.booleans(),
       credentials=st.booleans())
def test_request_info_and_routing_never_raise(method, path, query, view, peer_proxied,
                                              credentials):
    info = parse_request_info(method, path, query)
    decision = routing.decide(info, VIEWS[view], peer_proxied=peer_proxied,
                              credentials=credentials)
    assert decision.route in (routing.BACKEND, routing.PEER, routing.DISCOVERY,
                              routing.UNAVAILABLE, routing.OPENAPI_INDEX)
    if not credentials and not peer_proxied:  # peers' hops always carry credentials
        assert decision.route not in (routing.PEER, routing.UNAVAILABLE), decision


@PURE
@given(accept=st.one_of(st.none(), text, st.lists(st.sampled_from([
    "application/json", "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList",
    "profile=nopeer", "q=0", "q=abc", ";", ",", "*/*", "application/vnd.kubernetes.protobuf",
    "v=v2beta1", "g=", "as="]), max_size=8).map(";".join)))
def test_accept_negotiation_never_raises(accept):
    discovery.negotiate(accept)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["kind", "items", "metadata", "name", "versions",
                                       "version", "resources", "resource", "verbs",
                                       "subresources", "freshness", "x"]), children,
                      max_size=5), max_leaves=30)


@PURE
@given(doc=st.one_of(json_values.map(lambda v: json.dumps(v).encode()),
                     st.binary(max_size=300)))
def test_garbage_discovery_documents_are_refused_cleanly(doc):
    try:
        discovery.parse_aggregated(doc, max_bytes=10_000)
    except DiscoveryFormatError:
        pass


@PURE
@given(fields=st.lists(st.tuples(text, text), max_size=5))
def test_header_encoding_never_emits_a_line_break_inside_a_field(fields):
    try:
        encoded = wire.encode_fields(fields)
    except wire.UnsafeHeader:
        assert any(c in n + v for n, v in fields for c in "\r\n\0")
        return
    assert encoded.count(b"\r\n") == len(fields)


def test_record_pure_parsers():
    record(SUITE, "pure parsers (request checks, request info + routing, Accept, discovery "
                  "documents, header encoding), generated input", 5 * 400,
           "only declared errors raised")
    record(SUITE, "Transfer-Encoding values, llhttp's verdict against check_request's "
                  f"(a measured table of {len(TE_TABLE)}, then generated values)",
           len(TE_TABLE) + 400, "nothing llhttp refuses is accepted")


# --------------------------------------------------------------------------- 2. the listener

ALLOWED = {200, 201, 400, 401, 404, 405, 408, 411, 413, 414, 417, 431, 501, 505}

heads = st.builds(
    lambda method, target, version, lines, body: (
        f"{method} {target} {version}\r\n".encode("latin-1")
        + b"".join(f"{n}: {v}\r\n".encode("latin-1") for n, v in lines) + b"\r\n" + body),
    method=st.sampled_from(["GET", "POST", "PUT", "CONNECT", "OPTIONS", "get", "G ET", "PRI",
                            "DELETE", "TRACE"]),
    target=st.one_of(st.sampled_from([
        "/api/v1/namespaces", "http://127.0.0.1:{canary}/x", "https://127.0.0.1:{canary}/",
        "//127.0.0.1:{canary}/x", "127.0.0.1:{canary}", "*", "/api/../../x", "/%00",
        "/api?x=1#frag", "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups"]),
        path_like),
    version=st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/0.9", "HTTP/2.0", "HTTP/1.2",
                             "HTTP/1", "", "http/1.1"]),
    lines=st.lists(st.tuples(
        st.sampled_from(["Host", "Content-Length", "Transfer-Encoding", "X_Remote_User",
                         "X-Remote-User", "Connection", "Upgrade", "Expect",
                         "x-kubernetes-peer-proxied", "Te", " Host", "Host ", "X"]),
        st.sampled_from(["x", "0", "5", "-1", "+5", " 5", "chunked", "gzip, chunked",
                         "chunked, identity", "upgrade", "websocket", "100-continue",
                         "system:masters", "true", "\tchunked", "1" * 30])), max_size=6),
    body=st.sampled_from([b"", b"hello", b"5\r\nhello\r\n0\r\n\r\n",
                          b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"]))


def origin_form(target: str) -> bool:
    return target.startswith("/") and not target.startswith("//")


async def answers_of(c: Cluster, raw: bytes) -> list[int]:
    """Every status line in what the server sent back (pipelined answers included)."""
    answer = await c.raw(raw, who="bearer")
    return [int(m) for m in re.findall(rb"(?:^|\r\n\r\n|\n)HTTP/1\.[01] (\d{3}) ", answer)]


async def test_generated_requests_never_reach_beyond_the_backend(aiohttp_server, root):
    async with Canary() as canary, cluster(aiohttp_server, root,
                                           listener={"headerReadTimeout": "1s"}) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        examples: list[bytes] = []

        @settings(max_examples=150, deadline=None, database=None)
        @given(head=heads)
        def collect(head: bytes) -> None:
            examples.append(head.replace(b"{canary}", str(canary.port).encode()))

        collect()
        statuses: dict[int, int] = {}
        for raw in examples:
            before = len(c.seen["backend"]) + len(c.seen["peer"])
            answers = await answers_of(c, raw)
            for status in answers:
                assert status in ALLOWED, (status, raw[:200])
                statuses[status] = statuses.get(status, 0) + 1
            # Every request an upstream saw is one mvproxy parsed and answered itself
            # (a pipelined second request is fine; one hidden in a body is not).
            reached = len(c.seen["backend"]) + len(c.seen["peer"]) - before
            assert reached <= len(answers), (raw, answers, c.seen["backend"][-3:])
        assert canary.connections == 0
        seen = c.seen["backend"] + c.seen["peer"]
        assert all(origin_form(target) for _, target in seen), seen
        status, _, _ = await c.get("/api/v1/namespaces")
        assert status == 200
        record(SUITE, "generated request heads (methods, targets incl. absolute, authority "
                      "and '//', versions, CL/TE combinations, identity and underscore "
                      "headers, smuggled bodies)", len(examples),
               f"answers {dict(sorted(statuses.items()))}; canary dialled 0 times; "
               f"{len(seen)} reached an upstream, all origin-form, each answered as "
               "its own request")


SMUGGLING = {
    "CL.TE": b"POST /api/v1/namespaces HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n"
             b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nG",
    "TE.CL": b"POST /api/v1/namespaces HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
             b"Content-Length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
    "TE with a space before the colon": b"POST /api HTTP/1.1\r\nHost: x\r\n"
                                        b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "TE xchunked": b"POST /api HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "two TE fields": b"POST /api HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Transfer-Encoding: identity\r\n\r\n0\r\n\r\n",
    "two Content-Lengths": b"POST /api HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                           b"Content-Length: 5\r\n\r\nhello",
    "Content-Length with sign": b"POST /api HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\nhello",
    "obs-fold": b"GET /api HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n",
    "bare LF line ends": b"GET /api HTTP/1.1\nHost: x\n\n",
    "NUL in a header": b"GET /api HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "huge chunk size": b"POST /api HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"ffffffffffffffffffff\r\nx\r\n0\r\n\r\n",
    "chunk without CRLF": b"POST /api HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                          b"5\r\nhelloGET /smuggled HTTP/1.1\r\n\r\n",
    "request line with a tab": b"GET\t/api HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("name", list(SMUGGLING))
async def test_smuggling_variants_are_refused_and_nothing_slips_through(aiohttp_server, root,
                                                                        name):
    async with cluster(aiohttp_server, root) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        statuses = await answers_of(c, SMUGGLING[name])
        assert statuses and statuses[0] in (400, 501), statuses
        targets = [t for _, t in c.seen["backend"] + c.seen["peer"]]
        assert not any("smuggled" in t.lower() for t in targets)
        assert len(targets) <= 1
        record(SUITE, f"smuggling: {name}", 1, f"{statuses[0]}, nothing smuggled")


async def test_bodies_that_end_early_hurt_nobody_else(aiohttp_server, root):
    """A client promising 100 bytes and leaving after 10, or a chunked body cut off:
    the upstream request ends with it; mvproxy keeps serving."""
    async with cluster(aiohttp_server, root) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        cut = [b"POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\nHost: x\r\n"
               b"Content-Length: 100\r\n\r\n0123456789",
               b"POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\nHost: x\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n10\r\n01234",
               b"POST " + PODGROUPS.encode() + b" HTTP/1.1\r\nHost: x\r\n"
               b"Content-Length: 100\r\n\r\n0123456789"]
        for raw in cut * 10:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", c.port, ssl=c.contexts["admin"], server_hostname="127.0.0.1")
            writer.write(raw)
            await writer.drain()
            writer.close()
        for _ in range(5):
            status, _, _ = await c.get("/api/v1/namespaces")
            assert status == 200
        record(SUITE, "request bodies that end early (Content-Length and chunked, to the "
                      "backend and through a peer)", 30, "others served throughout")


# --------------------------------------------------------------------------- 2b. truthful answers
# Once a request went upstream the client gets the backend's answer, whatever it sent
# after it; a request mvproxy refuses (or drops unanswered) never reached the backend.

TRUTH = "/api/v1/namespaces/truth/secrets"


class Objects:
    """The backend's side of ``TRUTH``: a POST creates the object its body names (once
    ``gate`` is set), a GET of ``TRUTH/<name>`` finds it; ``bodies`` counts bodies read
    whole, ``broken`` bodies that ended early."""

    def __init__(self) -> None:
        self.created: dict[str, bytes] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        self.patience = WAIT
        """How long a create waits for ``gate`` before it fails."""
        self.bodies = self.broken = 0

    def routes(self, app: web.Application) -> None:
        async def create(request: web.Request) -> web.Response:
            try:
                body = await request.read()
            except BaseException:  # a reset, or aiohttp cancels the handler
                self.broken += 1
                raise
            self.bodies += 1
            await asyncio.wait_for(self.gate.wait(), self.patience)
            name = json.loads(body)["metadata"]["name"]
            self.created[name] = body
            return web.json_response({"kind": "Secret", "metadata": {"name": name}},
                                     status=201)

        async def get(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            if name not in self.created:
                return web.json_response({"kind": "Status", "code": 404}, status=404)
            return web.json_response({"kind": "Secret", "metadata": {"name": name}})

        app.router.add_post(TRUTH, create)
        app.router.add_get(TRUTH + "/{name}", get)


def create_request(name: str, *, fields: bytes = b"") -> bytes:
    body = json.dumps({"kind": "Secret", "metadata": {"name": name}}).encode()
    return (b"POST " + TRUTH.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
            b"application/json\r\n" + fields + b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def exists(c: Cluster, name: str) -> bool:
    status, _, _ = await c.get(f"{TRUTH}/{name}")
    assert status in (200, 404), status
    return status == 200


def creates_seen(c: Cluster) -> int:
    return sum(1 for method, target in c.seen["backend"] if (method, target) == ("POST", TRUTH))


async def warm(c: Cluster) -> None:
    """A pooled backend connection: the request goes out by callbacks alone (the path
    that sent a request upstream from inside llhttp's parse of the read)."""
    status, _, _ = await c.get("/api/v1/namespaces/warm")
    assert status == 200


async def test_a_request_refused_with_what_follows_it_in_one_read_never_reaches_the_backend(
        aiohttp_server, root):
    """A valid create, then bytes llhttp refuses, in one write: the create went upstream
    from inside the parse and was answered 400 while the backend created the object.
    llhttp's verdict on a read now comes before anything from it is sent."""
    objects = Objects()
    async with cluster(aiohttp_server, root, backend_routes=objects.routes) as c:
        await ready(c)
        await warm(c)
        answer = await c.raw(create_request("one-read") + b"\x01\x02 not HTTP\r\n\r\n")
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"400"], answer[:300]
        assert "could not be parsed" in body_of(answer)["message"]
        assert not await exists(c, "one-read")
        assert creates_seen(c) == 0 and objects.bodies == 0
        record(SUITE, "a valid create followed in the same write by unparseable bytes", 1,
               "400 Status; the backend never saw the create")


PIPELINED = b"GET /api/v1/namespaces/pipelined HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("later", [False, True], ids=["same-write", "later-write"])
async def test_what_follows_a_request_with_connection_close_is_ignored(aiohttp_server, root,
                                                                        later):
    """RFC 9112 §9.6: a create saying ``Connection: close``, then a GET, over real TLS:
    the client gets the backend's 201 (with ``Connection: close``), then the connection
    ends; the GET is neither sent nor refused. In one write the 400 for the GET was the
    only answer and the create never ran; in a later write a 400 was counted."""
    objects = Objects()
    async with cluster(aiohttp_server, root, backend_routes=objects.routes) as c:
        await ready(c)
        await warm(c)
        create = create_request("last", fields=b"Connection: close\r\n")
        if later:
            objects.gate.clear()
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", c.port, ssl=c.contexts["admin"], server_hostname="127.0.0.1")
        try:
            if later:
                writer.write(create)
                await c.until(lambda: _true(objects.bodies == 1), "the backend to read the body")
                writer.write(PIPELINED)
                await writer.drain()
                objects.gate.set()
            else:
                writer.write(create + PIPELINED)
            answer = await read_until_closed(reader)
        finally:
            objects.gate.set()
            writer.close()
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"201"], answer[:300]
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert b"\r\nconnection: close" in head, head
        assert await exists(c, "last")
        assert creates_seen(c) == 1
        assert not any("pipelined" in target for _, target in c.seen["backend"])
        assert await c.metric("mvproxy_refused_requests_total", code="400") in (None, 0)
        when = "in a later write" if later else "in the same write"
        record(SUITE, f"a request {when} after a create with Connection: close", 1,
               "ignored, not refused: the client got the backend's 201 with "
               "Connection: close, then the connection ended; nothing after it was sent")


AFTER = {
    # tail, the refusal counted, listener settings, fields of the create itself
    "unparseable bytes": (b"\x01\x02 not HTTP\r\n\r\n", "400", {}, b""),
    "a pipelined request mvproxy refuses": (
        b"GET http://127.0.0.1/api/v1/namespaces/pipelined HTTP/1.1\r\nHost: x\r\n\r\n", "400",
        {}, b""),
    "a pipelined head over maxHeaderBytes": (
        b"GET /api/v1/namespaces/pipelined HTTP/1.1\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n",
        "431", {"maxHeaderBytes": 4096}, b""),
    "more requests pipelined than allowed": (
        b"GET /api/v1/namespaces/pipelined HTTP/1.1\r\nHost: x\r\n\r\n" * 40, "400", {}, b""),
    "a pipelined head that stops arriving": (
        b"GET /api/v1/namespaces/pipelined HTTP/1.1\r\nHost: x\r\n", "408",
        {"headerReadTimeout": "500ms"}, b""),
}


@pytest.mark.parametrize("name", list(AFTER))
async def test_what_follows_a_forwarded_request_cannot_change_its_answer(aiohttp_server, root,
                                                                         name):
    """The create is upstream, its body whole, the backend not done: a refusal of what
    the client sent next was written as the create's answer (400, 408, 431) and the
    backend created the object anyway. Now the client gets the backend's 201 with
    ``Connection: close``, then the connection ends; nothing after the create is sent."""
    objects = Objects()
    tail, code, limits, fields = AFTER[name]
    async with cluster(aiohttp_server, root, backend_routes=objects.routes,
                       listener=limits) as c:
        await ready(c)
        await warm(c)
        objects.gate.clear()
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", c.port, ssl=c.contexts["admin"], server_hostname="127.0.0.1")
        try:
            writer.write(create_request("after", fields=fields))
            await c.until(lambda: _true(objects.bodies == 1), "the backend to read the body")
            writer.write(tail)
            await c.until(lambda: _metric_is(c, code), f"the {code} refusal")
            objects.gate.set()
            answer = await read_until_closed(reader)
        finally:
            objects.gate.set()
            writer.close()
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"201"], answer[:300]
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert b"\r\nconnection: close" in head, head
        assert await exists(c, "after")
        assert creates_seen(c) == 1
        assert not any("pipelined" in target for _, target in c.seen["backend"])
        record(SUITE, f"{name} while a create is upstream", 1,
               f"{code} counted, not written: the client got the backend's 201 with "
               "Connection: close, then the connection ended; nothing after it was sent")


async def test_an_answer_under_way_is_finished_before_the_connection_closes(aiohttp_server,
                                                                            root):
    """The answer had started (a stream) when the client sent bytes llhttp refuses: the
    connection closed at once, cutting the answer. Now it ends whole, then closes."""
    gate = asyncio.Event()

    def streaming(app: web.Application) -> None:
        async def stream(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            await response.write(b'{"part":1}\n')
            await asyncio.wait_for(gate.wait(), WAIT)
            await response.write(b'{"part":2}\n')
            await response.write_eof()
            return response
        app.router.add_get(TRUTH + "/stream", stream)

    async with cluster(aiohttp_server, root, backend_routes=streaming) as c:
        await ready(c)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", c.port, ssl=c.contexts["admin"], server_hostname="127.0.0.1")
        try:
            writer.write(b"GET " + TRUTH.encode() + b"/stream HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            async with asyncio.timeout(WAIT):
                while b'{"part":1}' not in received:
                    chunk = await reader.read(65536)
                    assert chunk, received
                    received += chunk
            writer.write(b"\x01\x02 not HTTP\r\n\r\n")
            await c.until(lambda: _metric_is(c, "400"), "the 400 refusal")
            gate.set()
            received += await read_until_closed(reader)
        finally:
            gate.set()
            writer.close()
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"200"], received[:300]
        body = received.partition(b"\r\n\r\n")[2]
        assert b'{"part":2}' in body and body.endswith(b"\r\n0\r\n\r\n"), body
        record(SUITE, "unparseable bytes while an answer is being streamed", 1,
               "400 counted, not written: the answer ended whole, then the connection "
               "closed")


async def test_a_client_that_leaves_after_refused_bytes_ends_its_request(aiohttp_server,
                                                                          root):
    """The request upstream is let finish, but not for a client that is gone: its
    connection is still read (and what comes discarded), so its leaving is seen."""
    objects = Objects()
    objects.patience = 3 * WAIT  # the backend's answer must not be what ends it
    async with cluster(aiohttp_server, root, backend_routes=objects.routes) as c:
        await ready(c)
        objects.gate.clear()
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", c.port, ssl=c.contexts["admin"], server_hostname="127.0.0.1")
        try:
            writer.write(create_request("left"))
            await c.until(lambda: _true(objects.bodies == 1), "the backend to read the body")
            writer.write(b"\x01\x02 not HTTP\r\n\r\n")
            await c.until(lambda: _metric_is(c, "400"), "the 400 refusal")
            assert await c.metric("mvproxy_inflight_requests", route="backend") == 1
            writer.transport.abort()  # gone, without a word
            await c.until(lambda: _inflight_is(c, 0), "the request to end with the client")
        finally:
            objects.gate.set()
            writer.close()
        record(SUITE, "a client that leaves after refused bytes, its create upstream", 1,
               "its request ended with it (the connection is still read, discarding)")


async def _inflight_is(c: Cluster, value: float) -> bool:
    return await c.metric("mvproxy_inflight_requests", route="backend") == value


async def test_a_refused_body_of_a_forwarded_request_abandons_it(aiohttp_server, root):
    """Bad chunk framing in the body being streamed upstream: the refusal is the answer
    (no response had started) and the upstream request is abandoned, never completed."""
    objects = Objects()
    async with cluster(aiohttp_server, root, backend_routes=objects.routes) as c:
        await ready(c)
        await warm(c)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", c.port, ssl=c.contexts["admin"], server_hostname="127.0.0.1")
        try:
            writer.write(b"POST " + TRUTH.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n3\r\n{\"k\r\n")
            await c.until(lambda: _true(creates_seen(c) == 1), "the create to go upstream")
            writer.write(b"zz\r\n")
            answer = await read_until_closed(reader)
        finally:
            writer.close()
        assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"400"], answer[:300]
        await c.until(lambda: _true(objects.broken == 1), "the backend to see the body end")
        assert objects.bodies == 0 and objects.created == {}
        record(SUITE, "bad chunk framing in the body of a request being forwarded", 1,
               "400 Status; the upstream request abandoned with its body incomplete")


async def _true(value: bool) -> bool:
    return value


async def _metric_is(c: Cluster, code: str) -> bool:
    return await c.metric("mvproxy_refused_requests_total", code=code) == 1


# --------------------------------------------------------------------------- 3. secrets

PLANTED = {
    "token": "PLANTED-TOKEN-9f3a1c",
    "api key": "PLANTED-APIKEY-77d2",
    "body": "PLANTED-BODY-4e1b",
    "query": "PLANTED-QUERY-c0de",
}


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_no_token_key_or_body_in_any_log_line(aiohttp_server, root, caplog, fmt):
    caplog.set_level(logging.DEBUG)
    async with cluster(aiohttp_server, root, listener={"headerReadTimeout": "500ms"}) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        secret_headers = {"Authorization": f"Bearer {PLANTED['token']}",
                          "X-Api-Key": PLANTED["api key"], "Cookie": f"s={PLANTED['token']}"}
        body = json.dumps({"data": {"password": PLANTED["body"]}})
        query = f"?fieldSelector=metadata.name%3D{PLANTED['query']}"
        for who in ("bearer", "admin"):
            for path in ("/api/v1/namespaces/default/secrets", PODGROUPS, "/apis", "/api"):
                async with c.sessions[who].post(c.base + path + query, data=body,
                                                headers=secret_headers) as resp:
                    await resp.read()
        # failure paths log more: a refused request, a broken one, a dead backend
        await c.raw(f"GET http://x/{PLANTED['query']} HTTP/1.1\r\nAuthorization: Bearer "
                    f"{PLANTED['token']}\r\n\r\n".encode())
        await c.raw(f"POST /api HTTP/1.1\r\nX-Api-Key: {PLANTED['api key']}\r\n"
                    f"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
                    f"{PLANTED['body']}".encode())
        await c.backend_server.close()
        # What only the backend serves (1.35's workloads): 503; what the peer serves too
        # goes there instead (the backend failover path logs too).
        only_here = "/apis/scheduling.k8s.io/v1alpha1/namespaces/default/workloads"
        for path, status in ((only_here, 503), ("/api/v1/namespaces", 200)):
            async with c.sessions["bearer"].post(c.base + path + query, data=body,
                                                 headers=secret_headers) as resp:
                assert resp.status == status
    formatter = logs.JSONFormatter() if fmt == "json" else logs.TextFormatter()
    # mvproxy's own lines (the test's fake upstreams log with aiohttp's access logger)
    lines = [formatter.format(r) for r in caplog.records if r.name.startswith("mvproxy")]
    assert len(lines) > 5  # the run did log (at DEBUG, everything)
    for line in lines:
        for what, secret in PLANTED.items():
            assert secret not in line, f"the {what} reached the log: {line[:300]}"
    record(SUITE, f"planted token, API key, body and query secrets, DEBUG level, {fmt} logs",
           len(lines), "no secret in any line")


def test_memos_keyed_by_client_input_stay_small():
    """Request info and Accept negotiation are memoised; keys are client input, so only
    short ones are kept (4,096 and 256 entries of at most 512 characters)."""
    from mvproxy import handlers
    before = handlers._request_info.cache_info().currsize
    handlers.request_info("GET", "/api/v1/namespaces/" + "x" * 5000, "")
    handlers.request_info("GET", "/api/v1/pods", "watch=" + "1" * 5000)
    assert handlers._request_info.cache_info().currsize == before
    assert handlers._request_info.cache_info().maxsize == 4096
    before = discovery._negotiate_memo.cache_info().currsize
    discovery.negotiate("application/json;" + "x=y;" * 500)
    assert discovery._negotiate_memo.cache_info().currsize == before
