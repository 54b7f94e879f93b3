"""Hostile requests through the real listener, run compiled when the venv is (it is:
docs/compiled.md), and the daemon's health after each.

mypyc checks annotated types at run time, so a value of an unexpected type where
Python would carry on raises instead; an exception escaping a protocol callback or
an unawaited task is logged by asyncio, leaves a request in flight or an upstream
connection busy. Each case here asserts what the client sees (a Kubernetes ``Status``
from mvproxy, or the upstream's answer) and that the daemon stays healthy: the next
request is served, no request is left in flight, no pooled connection is left busy,
nothing was logged at ERROR by asyncio or mvproxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import ssl

import pytest
from aiohttp import web
from daemon_support import PODGROUPS, WAIT, Cluster, cluster, synced
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from test_security import client_cert_context

import mvproxy.transport
from mvproxy import compiled

NAMESPACES = "/api/v1/namespaces"


def _failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What asyncio (an exception escaping a callback or a task) or mvproxy (a handler
    that failed) logged at ERROR."""
    return [f"{r.name}: {r.getMessage()[:200]}" for r in caplog.records
            if r.levelno >= logging.ERROR and r.name.split(".")[0] in ("asyncio", "mvproxy")]


async def _quiet(c: Cluster) -> bool:
    """No request in flight on any route, no pooled upstream connection busy."""
    _, text = await c.admin_get("/metrics")
    inflight = sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == "mvproxy_inflight_requests")
    return inflight == 0 and not any(pool.busy for pool in c.daemon.transport._pools.values())


async def healthy(c: Cluster, caplog: pytest.LogCaptureFixture, what: object) -> None:
    """The daemon serves the next request and nothing is left over from ``what``."""
    status, _, _ = await c.get(NAMESPACES)
    assert status == 200, what
    await c.until(lambda: _quiet(c), f"every request of {what!r} to end")
    assert not _failures(caplog), (what, _failures(caplog))


def statuses(answer: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"(?:^|\r\n\r\n|\n)HTTP/1\.[01] (\d{3}) ", answer)]


def mvproxy_status(answer: bytes) -> dict:
    """The Kubernetes ``Status`` mvproxy wrote (the body of a Content-Length answer)."""
    document = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert document["kind"] == "Status", answer[:300]
    return document


H = b"Host: x\r\n"
CASES: dict[str, tuple[bytes, int, bool]] = {
    # name: (bytes sent, first status the client gets, whether mvproxy wrote it)
    "CONNECT with a path": (b"CONNECT /api HTTP/1.1\r\n" + H + b"\r\n", 405, True),
    "CONNECT host:port": (b"CONNECT 127.0.0.1:443 HTTP/1.1\r\n" + H + b"\r\n", 400, True),
    "absolute-form target": (b"GET https://127.0.0.1/api HTTP/1.1\r\n" + H + b"\r\n",
                             400, True),
    "asterisk-form target": (b"OPTIONS * HTTP/1.1\r\n" + H + b"\r\n", 400, True),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, True),
    "HTTP/0.9": (b"GET /api\r\n\r\n", 400, True),
    "HTTP/2.0 as text": (b"GET /api HTTP/2.0\r\n" + H + b"\r\n", 505, True),
    "HTTP/1.2": (b"GET /api HTTP/1.2\r\n" + H + b"\r\n", 400, True),
    "HTTP/1.0 without Host": (b"GET " + NAMESPACES.encode() + b" HTTP/1.0\r\n\r\n", 200, False),
    "lowercase method": (b"get /api HTTP/1.1\r\n" + H + b"\r\n", 400, True),
    "a TLS record inside TLS": (b"\x16\x03\x01\x00\x05hello", 400, True),
    "Latin-1 bytes in the target": (b"GET /api/\xff HTTP/1.1\r\n" + H + b"\r\n", 400, True),
    "Content-Length past 2**64": (b"POST /api/v1/namespaces HTTP/1.1\r\n" + H
                                  + b"Content-Length: 18446744073709551616\r\n\r\nabc",
                                  400, True),
    "empty Content-Length": (b"POST /api/v1/namespaces HTTP/1.1\r\n" + H
                             + b"Content-Length:\r\n\r\nabc", 400, True),
    "Content-Length with leading zeros": (b"POST /api/v1/namespaces HTTP/1.1\r\n" + H
                                          + b"Content-Length: 0003\r\n\r\nabc", 200, False),
    "chunk extensions": (b"POST /api/v1/namespaces HTTP/1.1\r\n" + H
                         + b"Transfer-Encoding: chunked\r\n\r\n3;a=b;c=\"d\"\r\nabc\r\n"
                           b"0;x=y\r\n\r\n", 200, False),
    "Content-Length in the trailers": (b"POST /api/v1/namespaces HTTP/1.1\r\n" + H
                                       + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
                                         b"0\r\nX-T: 1\r\nContent-Length: 5\r\n\r\n",
                                       400, True),
    "chunked HTTP/1.0": (b"POST /api/v1/namespaces HTTP/1.0\r\nTransfer-Encoding: chunked"
                         b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 200, False),
    "upgrade with a body": (b"POST /api HTTP/1.1\r\n" + H + b"Connection: Upgrade\r\n"
                            b"Upgrade: websocket\r\nContent-Length: 3\r\n\r\nabc", 400, True),
    "upgrade with early bytes, answered by mvproxy": (
        b"GET /api HTTP/1.1\r\n" + H + b"Connection: Upgrade\r\nUpgrade: spdy/3.1\r\n\r\n"
        b"GARBAGE\x00\xff", 200, False),
    "h2c upgrade": (b"GET /api HTTP/1.1\r\n" + H + b"Connection: Upgrade, HTTP2-Settings\r\n"
                    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
                    200, False),
    "41 pipelined requests": ((b"GET /api HTTP/1.1\r\n" + H + b"\r\n") * 41, 400, True),
    "odd Accept on aggregated discovery": (
        b"GET /apis HTTP/1.1\r\n" + H + b"Accept: application/json;g=apidiscovery.k8s.io;"
        b"v=v2;as=APIGroupDiscoveryList;q=nan, */*;q=1e400, a/b;q=-1, ;;;, */*;q=infinity"
        b"\r\n\r\n", 200, False),
    "protobuf aggregated discovery": (
        b"GET /apis HTTP/1.1\r\n" + H + b"Accept: application/vnd.kubernetes.protobuf;"
        b"g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList\r\n\r\n", 406, True),
    "Latin-1 Accept on the OpenAPI index": (b"GET /openapi/v3 HTTP/1.1\r\n" + H
                                            + b"Accept: \xff\r\n\r\n", 200, False),
    "Connection naming identity and framing fields": (
        b"GET /api/v1/namespaces HTTP/1.1\r\n" + H + b"Connection: close, X-Forwarded-For, "
        b"Host, Authorization, , \xff\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n", 200, False),
    "900 empty X-Forwarded-For fields": (b"GET /api/v1/namespaces HTTP/1.1\r\n" + H
                                         + b"X-Forwarded-For: \r\n" * 900 + b"\r\n",
                                         200, False),
    "peer-only watch with a bearer token": (
        f"GET {PODGROUPS}?watch=true HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer x\r\n"
        "Connection: close\r\n\r\n".encode(), 200, False),
    "peer-only chunked POST": (
        f"POST {PODGROUPS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer x\r\n"
        "Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".encode(), 200, False),
    "HEAD of a watch": (b"HEAD /api/v1/pods?watch=1 HTTP/1.1\r\n" + H
                        + b"Connection: close\r\n\r\n", 200, False),
}


async def test_hostile_requests_get_their_answer_and_leave_the_daemon_healthy(
        aiohttp_server, root, caplog):
    caplog.set_level(logging.WARNING)
    async with cluster(aiohttp_server, root, listener={"headerReadTimeout": "2s"}) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        for name, (raw, status, own) in CASES.items():
            for who in ("bearer", "admin"):
                answer = await c.raw(raw, who=who)
                assert statuses(answer)[:1] == [status], (name, who, answer[:300])
                if own:
                    assert mvproxy_status(answer)["code"] == status, name
                await healthy(c, caplog, (name, who))
    # What ran: compiled in the development venv and the image, pure under MVPROXY_PURE.
    assert compiled.describe()


def _ipv6_loopback() -> bool:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        return True
    return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
async def test_an_ipv6_client_is_served_and_named_upstream(aiohttp_server, root, caplog):
    """An IPv6 peer's address is a 4-tuple (``get_extra_info("peername")``): its first
    item is what the backend is told (``X-Forwarded-For``)."""
    caplog.set_level(logging.WARNING)
    async with cluster(aiohttp_server, root, extra={"bindAddress": "::1"}) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        reader, writer = await asyncio.open_connection(
            "::1", c.port, ssl=c.contexts["bearer"], server_hostname="127.0.0.1")
        try:
            writer.write(b"GET /api/v1/namespaces HTTP/1.1\r\nHost: x\r\n"
                         b"Connection: close\r\n\r\n")
            async with asyncio.timeout(WAIT):
                answer = await reader.read()
        finally:
            writer.close()
        assert statuses(answer) == [200]
        echoed = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert ["X-Forwarded-For", "::1"] in echoed["headers"]
        assert not _failures(caplog)


# --------------------------------------------------------------------------- generated heads

_FIELD_NAMES = [b"Content-Length", b"Transfer-Encoding", b"Upgrade", b"Connection",
                b"Expect", b"Authorization", b"Accept", b"Sec-WebSocket-Protocol",
                b"X-Remote-User", b"X_Remote_User", b"Impersonate-User", b"Host",
                b"x-kubernetes-peer-proxied", b"X-Forwarded-For", b"Audit-ID"]
_VALUES = st.one_of(
    st.sampled_from([b"", b"0", b"3", b"-1", b"+3", b"18446744073709551615",
                     b"99999999999999999999999", b"chunked", b"chunked, chunked",
                     b"gzip, chunked", b"websocket", b"h2c", b"spdy/3.1", b"Upgrade",
                     b"close", b"keep-alive", b"upgrade, close", b"100-continue",
                     b"Bearer x", b"Bearer ", b"Basic eA==", b"true", b"\xff\xfe",
                     b"application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList",
                     b"*/*;q=nan", b"base64url.bearer.authorization.k8s.io.eA"]),
    st.binary(max_size=24).filter(lambda v: not any(b in v for b in b"\r\n\x00")))
_TARGETS = st.sampled_from([b"/api", b"/apis", b"/api/v1/namespaces", b"/openapi/v3",
                            b"/openapi/v3/apis/scheduling.k8s.io/v1alpha2",
                            PODGROUPS.encode(), PODGROUPS.encode() + b"?watch=1",
                            b"/api/v1/pods?watch=1&timeoutSeconds=99999999999999999999",
                            b"/apis/%2F/v1/%zz", b"/version"])
_BODIES = st.sampled_from([b"", b"abc", b"3\r\nabc\r\n0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n",
                           b"3;e=1\r\nab", b"\x00\xff"])


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """A request head with framing, upgrade and identity fields set at random, then a
    body that may or may not fit them; the connection's last (``Connection: close``)."""
    method = draw(st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"PATCH"]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]))
    fields = draw(st.lists(st.tuples(st.sampled_from(_FIELD_NAMES), _VALUES), max_size=6))
    head = b"%b %b %b\r\n" % (method, draw(_TARGETS), version)
    head += b"".join(name + b": " + value + b"\r\n" for name, value in fields)
    return head + b"Connection: close\r\n\r\n" + draw(_BODIES)


async def test_generated_framing_leaves_the_daemon_healthy(aiohttp_server, root, caplog):
    """Generated heads mixing every field that frames, upgrades or identifies a request:
    whatever the client gets, the next request is served and nothing is left over."""
    caplog.set_level(logging.WARNING)
    async with cluster(aiohttp_server, root, listener={"headerReadTimeout": "1s"}) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        examples: list[bytes] = []

        @settings(max_examples=120, deadline=None, database=None)
        @given(raw=_requests())
        def collect(raw: bytes) -> None:
            examples.append(raw)

        collect()
        for raw in examples:
            answer = await c.raw(raw, who="bearer")
            # The fake backend may fail itself (aiohttp on some Expect values): only
            # mvproxy's own 500 would be a failure here.
            assert b"internal error in mvproxy" not in answer, (raw, answer[:300])
            await healthy(c, caplog, raw)


# --------------------------------------------------------------------------- dialling


async def test_a_failure_while_dialling_is_answered_and_ends_the_request(
        aiohttp_server, root, caplog, monkeypatch):
    """An exception other than a connect error while a new upstream connection is made
    (here: a peer certificate check that raises) ends the request with a 500; it used
    to leave the request hanging in flight until the client left, the dialling task's
    exception never retrieved."""
    caplog.set_level(logging.WARNING)
    async with cluster(aiohttp_server, root) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        for pool in c.daemon.transport._pools.values():
            pool.reset()  # the next request to the peer dials

        def broken(*_: object, **__: object) -> str | None:
            raise ValueError("a certificate extension cryptography cannot parse")
        monkeypatch.setattr(mvproxy.transport, "peer_serving_problem", broken)
        answer = await c.raw(f"GET {PODGROUPS} HTTP/1.1\r\nHost: x\r\n"
                             "Authorization: Bearer x\r\n\r\n".encode(), who="bearer")
        assert statuses(answer) == [500], answer[:300]
        assert mvproxy_status(answer)["code"] == 500
        monkeypatch.undo()
        caplog.clear()  # the failure itself is logged at ERROR, as it should be
        await healthy(c, caplog, "a failure while dialling")


# --------------------------------------------------------------------------- cancellation


async def test_a_client_leaving_a_task_answer_cancels_its_upstream_read(aiohttp_server, root,
                                                                        caplog):
    """The OpenAPI index is answered by a task (compiled coroutines: ``handlers``,
    ``transport.fetch`` inside ``asyncio.timeout``): a client that leaves while the
    backend has not answered cancels it, and the cancellation ends the request (not in
    flight any more) and discards the upstream connection it held (none stays busy)."""
    caplog.set_level(logging.WARNING)
    asked = asyncio.Event()

    async def stalled(request: web.Request) -> web.Response:
        asked.set()
        await asyncio.sleep(WAIT)
        return web.json_response({})

    def routes(app: web.Application) -> None:
        app.router.add_get("/openapi/v3", stalled)

    async with cluster(aiohttp_server, root, backend_routes=routes) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        for _ in range(3):
            asked.clear()
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", c.port, ssl=c.contexts["bearer"], server_hostname="127.0.0.1")
            writer.write(b"GET /openapi/v3 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer x\r\n\r\n")
            async with asyncio.timeout(WAIT):
                await asked.wait()
            assert not await _quiet(c)  # in flight while the backend is asked
            writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                await writer.wait_closed()
            await healthy(c, caplog, "a client that left its OpenAPI index")


# --------------------------------------------------------------------------- certificates


@pytest.mark.parametrize(("cns", "orgs", "ca", "status", "user"), [
    ((), ("system:masters",), "ca", 200, None),  # no CN: anonymous, its O claims nothing
    ((), (), "front-proxy-ca", 200, None),  # the peer CA, no CN: no peer
    (("ユーザー",), (), "ca", 401, None),  # not Latin-1: cannot be sent as a header
    (("admin ",), (), "ca", 401, None),  # the backend would trim it to another name
    (("a\u0085b",), ("g\u00a0",), "ca", 200, "a\u0085b"),  # Latin-1, sent byte for byte
])
async def test_client_certificates_without_the_expected_fields(aiohttp_server, root, tmp_path,
                                                                caplog, cns, orgs, ca, status,
                                                                user):
    """What the connection's identity becomes (``connection_made`` resolves it) for
    certificates the CA may issue without a usable subject: the client's own identity
    claims never pass, and the daemon stays healthy."""
    caplog.set_level(logging.WARNING)
    async with cluster(aiohttp_server, root) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        c.contexts["odd"] = client_cert_context(root, tmp_path, *cns, ca=ca, orgs=orgs)
        answer = await c.raw(b"GET /api/v1/namespaces HTTP/1.1\r\nHost: x\r\n"
                             b"X-Remote-User: system:admin\r\nConnection: close\r\n\r\n",
                             who="odd")
        assert statuses(answer) == [status], answer[:300]
        if status == 200:
            echoed = json.loads(answer.partition(b"\r\n\r\n")[2])
            sent = [v for k, v in echoed["headers"] if k.lower() == "x-remote-user"]
            assert sent == ([] if user is None else
                            [user.encode("latin-1").decode("utf-8", "surrogateescape")])
        else:
            assert mvproxy_status(answer)["code"] == status
        await healthy(c, caplog, cns)


# --------------------------------------------------------------------------- upstream answers


async def test_a_101_to_a_request_that_asked_no_upgrade_is_a_broken_response(
        aiohttp_server, root, caplog):
    """An upstream that switches protocols for a plain GET: the client gets a 502
    ``Status``, not a ``101`` it never asked for; before, the 101 was relayed and the
    listener's state check then raised inside the upstream's protocol callback (asyncio
    logged "Fatal error on SSL protocol")."""
    caplog.set_level(logging.WARNING)

    async def switch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=101, headers={"Upgrade": "websocket",
                                                           "Connection": "Upgrade"})
        await response.prepare(request)
        await response.write(b"another protocol")
        return response

    def routes(app: web.Application) -> None:
        app.router.add_get("/switch", switch)

    async with cluster(aiohttp_server, root, backend_routes=routes) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        answer = await c.raw(b"GET /switch HTTP/1.1\r\nHost: x\r\n\r\n", who="bearer")
        assert statuses(answer) == [502], answer[:300]
        assert "broken response" in mvproxy_status(answer)["message"]
        assert b"another protocol" not in answer
        await healthy(c, caplog, "a 101 unasked")
