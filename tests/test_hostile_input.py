"""Hostile input, standing suite: what can an unauthenticated client make mvproxy do?

1. The pure parsers (request checks, request info, routing, Accept negotiation,
   discovery documents, header encoding) take generated input (hypothesis) and never
   raise anything but their declared errors.
2. The listener takes generated and mutated request heads, smuggling variants,
   early-ending bodies and slow clients over real TLS: every answer is a 4xx/5xx
   ``Status`` (or the connection closes), never a 500 or a traceback; the backend
   only ever sees origin-form targets and no underscore names; nothing is smuggled
   through; no connection goes anywhere but the backend (a canary listener counts);
   and a well-behaved client is served afterwards.
3. No token, key or body reaches a log line, at any verbosity, in either format.

Example counts are bounded (``max_examples``), and each case records what it tried
for ``docs/reliability.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from daemon_support import (
    PODGROUPS,
    Cluster,
    cluster,
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
        assert not codings or [c.strip().lower() for v in codings
                               for c in v.split(",")] == ["chunked"]
    else:
        assert refusal.status in (400, 501, 505)


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
        async with c.sessions["bearer"].post(c.base + "/api/v1/namespaces" + query, data=body,
                                             headers=secret_headers) as resp:
            assert resp.status == 503
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
