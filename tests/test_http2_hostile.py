"""Hostile HTTP/2 clients against the assembled daemon (``http2.Session``), frame by
frame (``h2_support.RawH2``): what no client library sends.

Each case asserts the exact outcome the client sees (the stream's status, its
``RST_STREAM`` code, or the connection's ``GOAWAY`` code and its closing), that the
backend never saw a request it should not have, and that the daemon stays healthy:
a new connection's request gets 200 over HTTP/1.1 and over HTTP/2, no request is
left in flight, no HTTP/2 stream or connection is left open, nothing was logged at
ERROR (``test_hostile_compiled.healthy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import struct

import pytest
from aiohttp import web
from daemon_support import PODGROUPS, Cluster, cluster, ready
from h2_support import (
    CANCEL,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    INITIAL_WINDOW_SIZE,
    NO_ERROR,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    Answer,
    RawH2,
    get,
)
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from reliability import record
from test_hostile_compiled import healthy
from test_http2 import h2_context
from test_security import client_cert_context

from mvproxy import devpki, http2, tls

SUITE = "HTTP/2 hostile input"
NAMESPACES = "/api/v1/namespaces"
SLOW = "/api/v1/namespaces/default/pods/slow"
BIG = "/api/v1/namespaces/default/pods/big"
BODY = "/api/v1/namespaces/default/configmaps/x"
CODES = {0x0: "NO_ERROR", 0x1: "PROTOCOL_ERROR", 0x2: "INTERNAL_ERROR",
         0x3: "FLOW_CONTROL_ERROR", 0x5: "STREAM_CLOSED", 0x6: "FRAME_SIZE_ERROR",
         0x7: "REFUSED_STREAM", 0x8: "CANCEL", 0x9: "COMPRESSION_ERROR",
         0xB: "ENHANCE_YOUR_CALM"}


class Backend:
    """Routes the fake backend adds, and what it saw of them: ``SLOW`` holds each
    request until ``release`` is set or mvproxy drops its connection, counting how
    many run at once; ``BIG`` answers 3 MB; ``BODY`` reads and echoes its body's
    length."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.running = 0
        self.most = 0
        self.slow_seen = 0

    def routes(self, app: web.Application) -> None:
        async def slow(request: web.Request) -> web.Response:
            self.slow_seen += 1
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                for _ in range(400):  # bounded: 20 s
                    transport = request.transport
                    if self.release.is_set() or transport is None or transport.is_closing():
                        break
                    await asyncio.sleep(0.05)
            finally:
                self.running -= 1
            return web.json_response({"slow": "done"})

        async def big(request: web.Request) -> web.Response:
            return web.Response(body=b"x" * 3_000_000, content_type="application/json")

        async def body(request: web.Request) -> web.Response:
            return web.json_response({"read": len(await request.read())})

        app.router.add_get(SLOW, slow)
        app.router.add_get(BIG, big)
        app.router.add_put(BODY, body)
        app.router.add_post(BODY, body)


@contextlib.asynccontextmanager
async def h2_cluster(aiohttp_server, root, caplog, backend: Backend | None = None,
                     **listener: object):
    caplog.set_level(logging.WARNING)
    backend = backend or Backend()
    async with cluster(aiohttp_server, root, backend_routes=backend.routes,
                       listener=listener or None) as c:
        await ready(c)
        c.backend = backend
        try:
            yield c
        finally:
            backend.release.set()


async def h2(c: Cluster, who: str = "admin", **kw) -> RawH2:
    """A new HTTP/2 connection whose settings exchange is over (the server's limits
    apply from then on: jh2 applies its own once the client acknowledged them)."""
    conn = await RawH2.open(c.port, h2_context(c, who), **kw)
    if kw.get("read", True):
        await settled(conn)
    return conn


async def settled(conn: RawH2) -> None:
    await conn.until(lambda: bool(conn.server_settings) or conn.closed, "the server's SETTINGS")
    await ping(conn)


async def ping(conn: RawH2, opaque: bytes = b"roundtr!") -> bool:
    """A round trip: every frame sent before was read by the server (False if the
    connection closed first)."""
    def answered() -> bool:
        return any(isinstance(f, PingFrame) and "ACK" in f.flags and f.opaque_data == opaque
                   for f in conn.frames)
    conn.send(PingFrame(0, opaque))
    await conn.until(lambda: answered() or conn.closed, "the PING's answer")
    return answered()


async def _metric(c: Cluster, name: str, **labels: str) -> float:
    return await c.metric(name, **labels) or 0


async def _inflight(c: Cluster) -> float:
    """Requests in flight on every route."""
    _, text = await c.admin_get("/metrics")
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "mvproxy_inflight_requests")


def _ending(conn: RawH2) -> str:
    if conn.goaway is None:
        return "closed"
    return f"GOAWAY({CODES.get(conn.goaway.error_code, conn.goaway.error_code)})"


async def healthy_h2(c: Cluster, caplog: pytest.LogCaptureFixture, what: object) -> None:
    """``healthy`` over HTTP/1.1, a new HTTP/2 connection served, and no HTTP/2 stream
    or connection left open."""
    await healthy(c, caplog, what)
    answer = await get(c.port, h2_context(c, "admin"), NAMESPACES)
    assert answer.status == 200, what

    async def nothing_open() -> bool:
        return (await _metric(c, "mvproxy_http2_streams") == 0
                and await _metric(c, "mvproxy_http2_connections") == 0)
    await c.until(nothing_open, f"every HTTP/2 stream and connection of {what!r} to end")


async def outcome(conn: RawH2, sid: int) -> str:
    """What the client saw of stream ``sid``: its status, its reset, or the
    connection's GOAWAY."""
    answer = conn.answers.setdefault(sid, Answer())
    await conn.until(lambda: answer.ended or answer.reset is not None or conn.goaway is not None
                     or conn.closed, f"stream {sid} to end")
    if answer.status is not None and answer.ended:
        return str(answer.status)
    if answer.reset is not None:
        return f"RST_STREAM({CODES.get(answer.reset, answer.reset)})"
    if conn.goaway is not None:
        return f"GOAWAY({CODES.get(conn.goaway.error_code, conn.goaway.error_code)})"
    return "closed"


# --------------------------------------------------------------------------- downgrade


def _put(conn: RawH2, fields: list[tuple[str, str]], data: bytes = b"",
         path: str = BODY, method: str = "PUT", authority: str = "127.0.0.1") -> int:
    sid = conn.request(path, method=method, fields=fields, end_stream=False,
                       authority=authority)
    conn.data(sid, data, end_stream=True)
    return sid


SMUGGLED = "x\r\nTransfer-Encoding: chunked"
TARGET = NAMESPACES + "/target"
"""What the cases ask for (``healthy`` asks for ``NAMESPACES``)."""
JH2 = "GOAWAY(PROTOCOL_ERROR)"
"""What jh2 answers a head it finds malformed: a connection error (RFC 9113 §8.1.1 asks
for a stream error; either way nothing is forwarded)."""


def _get(*fields: tuple[str, str]):
    return lambda k: k.request(TARGET, fields=list(fields))


DOWNGRADE = {
    # name: (how the stream is sent, what the client sees, whether the backend sees it)
    "CR LF in a value": (_get(("x-a", SMUGGLED)), "400", False),
    "LF in a value": (_get(("x-a", "a\nb")), "400", False),
    "CR in a value": (_get(("x-a", "a\rb")), "400", False),
    "NUL in a value": (_get(("x-a", "a\0b")), "400", False),
    "CR LF in :path": (lambda k: k.request(TARGET + "\r\nX-B: 1"), "400", False),
    "uppercase name": (_get(("X-Upper", "1")), JH2, False),
    "name with a space": (_get(("x a", "1")), "400", False),
    "name with a colon": (_get(("x:a", "1")), "400", False),
    "empty name": (_get(("", "1")), JH2, False),
    "connection": (_get(("connection", "close")), JH2, False),
    "keep-alive": (_get(("keep-alive", "1")), JH2, False),
    "transfer-encoding": (lambda k: _put(k, [("transfer-encoding", "chunked")],
                                         b"3\r\nabc\r\n0\r\n\r\n"), JH2, False),
    "upgrade": (_get(("upgrade", "websocket")), JH2, False),
    "proxy-connection": (_get(("proxy-connection", "x")), JH2, False),
    "te: gzip": (_get(("te", "gzip")), JH2, False),
    "te: trailers (allowed)": (_get(("te", "trailers")), "200", True),
    ":path *": (lambda k: k.request("*", method="OPTIONS"), "400", False),
    ":path absolute-form": (lambda k: k.request("http://evil/x"), "400", False),
    ":path without a slash": (lambda k: k.request("x"), "400", False),
    ":path with a space": (lambda k: k.request(TARGET + " HTTP/1.1"), "400", False),
    ":path empty": (lambda k: k.request(""), JH2, False),
    ":authority with a slash": (lambda k: k.request(TARGET, authority="evil/x"), "400", False),
    ":authority with a space": (lambda k: k.request(TARGET, authority="a b"), "400", False),
    "host beside :authority": (_get(("host", "evil")), JH2, False),
    "content-length above the DATA": (lambda k: _put(k, [("content-length", "10")], b"12345"),
                                      JH2, False),
    "content-length below the DATA": (lambda k: _put(k, [("content-length", "3")],
                                                     b"1234567890"), JH2, False),
    "content-length not a number": (lambda k: _put(k, [("content-length", "1, 1")], b"1"),
                                    JH2, False),
    "two equal content-lengths": (
        lambda k: _put(k, [("content-length", "1"), ("content-length", "1")], b"1"), "200", True),
    # jh2 holds DATA to the first; the head must not announce another.
    "two content-lengths, the smaller first": (
        lambda k: _put(k, [("content-length", "1"), ("content-length", "5")], b"1"),
        "400", False),
    "two content-lengths, the larger first": (
        lambda k: _put(k, [("content-length", "41"), ("content-length", "0")],
                       b"GET /api/v1/secrets HTTP/1.1\r\nHost: x\r\n\r\n"), "400", False),
    # jh2 resets the stream (StreamReset, not remote): the request ends before it is sent.
    "END_STREAM on HEADERS, then DATA": (lambda k: _after_end(k), "RST_STREAM(STREAM_CLOSED)",
                                         False),
    "CONNECT": (lambda k: _connect(k), JH2, False),
    "CONNECT with :scheme and :path": (lambda k: k.request(TARGET, method="CONNECT"),
                                       "405", False),
    "a body with content-length (allowed)": (
        lambda k: _put(k, [("content-length", "5")], b"12345"), "200", True),
}


def _after_end(conn: RawH2) -> int:
    sid = conn.request(TARGET, fields=[("content-length", "0")], end_stream=True)
    conn.data(sid, b"smuggled: GET /api/v1/secrets HTTP/1.1\r\n\r\n", end_stream=True)
    return sid


def _connect(conn: RawH2) -> int:
    sid = conn.stream_id()
    conn.headers(sid, [(":method", "CONNECT"), (":authority", "127.0.0.1:443")])
    return sid


@pytest.mark.parametrize("name", list(DOWNGRADE))
async def test_a_head_http11_could_read_differently_never_reaches_the_backend(
        aiohttp_server, root, caplog, name):
    send, expected, forwarded = DOWNGRADE[name]
    async with h2_cluster(aiohttp_server, root, caplog) as c:
        c.seen["backend"].clear()
        async with await h2(c) as conn:
            sid = send(conn)
            seen = await outcome(conn, sid)
        assert seen == expected, (name, seen, conn.answers.get(sid))
        await healthy_h2(c, caplog, name)
        targets = [target for _, target in c.seen["backend"] if target != NAMESPACES]
        assert len(targets) == (1 if forwarded else 0), c.seen["backend"]
        assert not any("secrets" in target or "evil" in target for target in targets)
        record(SUITE, f"downgrade: {name}", 1, f"{seen}; "
               + ("served as sent" if forwarded else "nothing reached the backend"))


# --------------------------------------------------------------------------- concurrency


async def test_rapid_reset_is_bounded_by_the_stream_limit_then_ends_the_connection(
        aiohttp_server, root, caplog):
    """CVE-2023-44487: streams opened and reset at once, 20 times the limit. A reset
    ends its request at once (nothing reached the backend), and resets spend a budget
    of twice the limit; with the limit's streams held upstream, the streams opened and
    reset past it are refused, and so many refusals end the connection too."""
    async with h2_cluster(aiohttp_server, root, caplog, maxConcurrentStreams=5) as c:
        async with await h2(c) as conn:
            for _ in range(100):
                conn.reset(conn.request(SLOW), CANCEL)
            first = await conn.closed_with()
        async with await h2(c) as conn:
            held = [conn.request(SLOW) for _ in range(5)]

            async def five_upstream() -> bool:
                return c.backend.running == 5
            await c.until(five_upstream, "five requests upstream")
            for _ in range(100):  # each reset frees a place the next stream takes
                conn.reset(held.pop(0), CANCEL)
                held.append(conn.request(SLOW))
            second = await conn.closed_with()
        assert (first, second) == (ENHANCE_YOUR_CALM, ENHANCE_YOUR_CALM)
        assert c.backend.most == 5 and c.backend.slow_seen == 5
        assert await _metric(c, "mvproxy_http2_refusals_total", reason="rapid_reset") == 2
        await healthy_h2(c, caplog, "rapid reset")
    record(SUITE, "rapid reset (CVE-2023-44487): 100 streams opened and reset at once, "
           "maxConcurrentStreams 5", 100, "none reached the backend; the 11th reset "
           "ended the connection: GOAWAY(ENHANCE_YOUR_CALM)")
    record(SUITE, "rapid reset with 5 streams (the limit) held upstream, each reset "
           "followed by a new stream", 100, "the backend saw the 5 only; the 11th reset "
           "ended the connection: GOAWAY(ENHANCE_YOUR_CALM)")


async def test_a_stream_past_the_limit_while_all_are_open_ends_the_connection(
        aiohttp_server, root, caplog):
    """jh2 takes a stream past SETTINGS_MAX_CONCURRENT_STREAMS as a connection error
    (RFC 9113 allows a stream error; an honest client never sends it): GOAWAY
    (PROTOCOL_ERROR), and every stream's upstream request ends with the connection."""
    async with h2_cluster(aiohttp_server, root, caplog, maxConcurrentStreams=5) as c:
        async with await h2(c) as conn:
            # What the client was told is what is enforced (jh2 advertised its defaults).
            assert conn.server_settings == {
                SettingsFrame.MAX_CONCURRENT_STREAMS: 5,
                SettingsFrame.INITIAL_WINDOW_SIZE: http2.STREAM_WINDOW,
                SettingsFrame.MAX_HEADER_LIST_SIZE: 1 << 20, SettingsFrame.ENABLE_PUSH: 0,
                SettingsFrame.HEADER_TABLE_SIZE: 65536}
            for _ in range(5):
                conn.request(SLOW)

            async def five_upstream() -> bool:
                return c.backend.running == 5
            await c.until(five_upstream, "five requests upstream")
            conn.request(SLOW)
            code = await conn.closed_with()
        assert code == PROTOCOL_ERROR
        assert all(a.status is None for a in conn.answers.values())

        async def none_upstream() -> bool:
            return c.backend.running == 0
        await c.until(none_upstream, "the upstream requests to end")
        assert await _metric(c, "mvproxy_http2_refusals_total", reason="protocol_error") == 1
        await healthy_h2(c, caplog, "past the limit")
        record(SUITE, "a 6th stream while 5 (maxConcurrentStreams) are open", 1,
               "GOAWAY(PROTOCOL_ERROR), the 5 upstream requests ended with the connection")


# --------------------------------------------------------------------------- floods


def _unknown(count: int) -> bytes:
    """``count`` frames of a type nobody defined (0xFA), 4 bytes each."""
    return (struct.pack(">IBI", (4 << 8) | 0xFA, 0, 0) + b"abcd") * count


def _continuations(conn: RawH2) -> list:
    block = conn.block([(":method", "GET"), (":scheme", "https"), (":path", NAMESPACES),
                        (":authority", "127.0.0.1"), ("x-a", "b" * 200)])
    sid = conn.stream_id()
    frames: list = [HeadersFrame(sid, block[:10])]
    rest = block[10:]
    for _ in range(200):
        piece, rest = (rest[:1], rest[1:]) if rest else (b"", b"")
        frames.append(ContinuationFrame(sid, piece))
    return frames


def _big_head(conn: RawH2) -> list:
    frame = HeadersFrame(conn.stream_id(), conn.block([
        (":method", "GET"), (":scheme", "https"), (":path", NAMESPACES),
        (":authority", "127.0.0.1"), ("x-big", "y" * 9000)]))
    frame.flags = {"END_HEADERS", "END_STREAM"}
    return [frame]


def _settings(conn: RawH2) -> list:
    return [SettingsFrame(0) for _ in range(2000)]


PINGS = 20_000


def _pings(conn: RawH2) -> list:
    return [PingFrame(0, struct.pack(">Q", i)) for i in range(PINGS)]


def _empty_data(conn: RawH2) -> list:
    sid = conn.request(BODY, method="POST", end_stream=False)
    return [DataFrame(sid, b"") for _ in range(2000)]


def _priority(conn: RawH2) -> list:
    return [PriorityFrame(2 * i + 1, depends_on=0, stream_weight=15) for i in range(2000)]


def _window_overflow(conn: RawH2) -> list:
    return [WindowUpdateFrame(0, window_increment=2**31 - 1)] * 2


FLOODS = {
    # name: (frames, GOAWAY code, what "bounded" means)
    "CONTINUATION flood (200 after a HEADERS without END_HEADERS)": (
        _continuations, PROTOCOL_ERROR, "jh2 holds at most 64 frames of one header block"),
    "a header list beyond 2x maxHeaderBytes": (
        _big_head, ENHANCE_YOUR_CALM, "the decoder stops at 2x maxHeaderBytes"),
    "SETTINGS flood (2,000)": (_settings, ENHANCE_YOUR_CALM, "the control-frame budget"),
    "PING flood (20,000), the client reading nothing": (
        _pings, ENHANCE_YOUR_CALM, "the control-frame budget (the PING ACKs queued are those "
        "of the frames read with the 1,001st)"),
    "empty DATA flood (2,000 on one stream)": (
        _empty_data, ENHANCE_YOUR_CALM, "the control-frame budget"),
    "PRIORITY flood (2,000)": (_priority, ENHANCE_YOUR_CALM, "the control-frame budget"),
    "unknown-frame flood (2,000)": (lambda conn: [_unknown(2000)], ENHANCE_YOUR_CALM,
                                    "the control-frame budget"),
    "WINDOW_UPDATE overflowing the connection window": (
        _window_overflow, FLOW_CONTROL_ERROR, "a connection error at once"),
}


@pytest.mark.parametrize("name", list(FLOODS))
async def test_a_flood_ends_the_connection(aiohttp_server, root, caplog, name):
    frames_of, expected, bound = FLOODS[name]
    reading = "reading nothing" not in name
    async with h2_cluster(aiohttp_server, root, caplog, maxHeaderBytes=4096) as c:
        conn = await h2(c, read=reading)
        async with conn:
            conn.send(*frames_of(conn))
            await conn.drain()
            conn.start_reading()
            code = await conn.closed_with()
        assert code == expected, (name, CODES.get(code or 0, code))
        acks = sum(1 for f in conn.frames if isinstance(f, PingFrame) and "ACK" in f.flags)
        if frames_of is _pings:  # jh2 answers every PING of one read before mvproxy counts
            assert http2.CONTROL_BUDGET < acks < PINGS, acks
        await healthy_h2(c, caplog, name)
        record(SUITE, name, 1, f"GOAWAY({CODES[expected]}), connection closed; bounded by "
               f"{bound}")


# --------------------------------------------------------------------------- flow control


async def test_a_stream_never_credited_blocks_only_itself(aiohttp_server, root, caplog):
    """INITIAL_WINDOW_SIZE 0: a big answer on a stream never credited waits (its
    upstream paused); another stream credited by WINDOW_UPDATE completes; resetting the
    stalled stream ends its upstream request."""
    async with h2_cluster(aiohttp_server, root, caplog) as c:
        async with await h2(c, settings={INITIAL_WINDOW_SIZE: 0}) as conn:
            stalled = conn.request(BIG)
            conn.held.add(stalled)

            async def upstream() -> bool:
                return await _inflight(c) == 1
            await c.until(upstream, "the big answer upstream")
            credited = conn.request(NAMESPACES)
            conn.window_update(credited, 1 << 20)
            answer = await conn.response(credited)
            assert answer.status == 200
            assert json.loads(bytes(answer.body))["server"] == "backend"
            assert conn.answers[stalled].status == 200
            assert conn.answers[stalled].body == b"" and not conn.answers[stalled].ended
            conn.reset(stalled, CANCEL)
            await healthy(c, caplog, "the reset stalled stream")
            assert await ping(conn)  # the connection carries on
        await healthy_h2(c, caplog, "window exhaustion")
        record(SUITE, "a stream never credited (INITIAL_WINDOW_SIZE 0, a 3 MB answer) beside "
               "a credited one", 1, "the credited stream completed; resetting the stalled "
               "one ended its upstream request")


# --------------------------------------------------------------------------- deadlines


async def test_idle_connections_and_stalled_bodies_meet_their_deadlines(aiohttp_server, root,
                                                                        caplog):
    async with h2_cluster(aiohttp_server, root, caplog, headerReadTimeout="500ms",
                          idleTimeout="1s") as c:
        async with await h2(c) as conn:  # the preface, no request
            assert await conn.closed_with() == NO_ERROR
        async with await h2(c) as conn:  # requests, then nothing
            assert (await conn.response(conn.request(NAMESPACES))).status == 200
            assert await conn.closed_with() == NO_ERROR
        async with await h2(c) as conn:
            sid = conn.request(BODY, method="POST", fields=[("content-length", "100")],
                               end_stream=False)
            conn.data(sid, b"0123456789")
            answer = await conn.response(sid)
            assert answer.status == 408, answer
            assert b"no request body byte" in bytes(answer.body)
            assert await conn.closed_with() == NO_ERROR
        await healthy_h2(c, caplog, "deadlines")
    for case, outcome_ in (
            ("an idle connection: the preface, no request", "GOAWAY(NO_ERROR) after "
             "headerReadTimeout, then closed"),
            ("an idle connection after a request", "GOAWAY(NO_ERROR) after idleTimeout, "
             "then closed"),
            ("a stream whose request body stalls", "408 Status on the stream; the "
             "connection then idles out")):
        record(SUITE, case, 1, outcome_)


# --------------------------------------------------------------------------- identity

SPOOFED = [("x-kubernetes-peer-proxied", "true"), ("x-remote-user", "system:admin"),
           ("x-remote-group", "system:masters"), ("x-remote-extra-scopes", "all")]
CLIENTS = {"bearer": "a client without credentials", "token": "a bearer-token client",
           "admin": "a certificate user", "csr": "a certificate user named like a peer",
           "peer": "a peer (front-proxy CA, believed)"}
IDENTITY = ("x-remote-", "x-kubernetes-peer-proxied", "authorization", "impersonate-")


def _identity(echoed: dict) -> tuple:
    return (echoed["server"], echoed["cn"], sorted(
        (k.lower(), v) for k, v in echoed["headers"] if k.lower().startswith(IDENTITY)))


@pytest.mark.parametrize("who", ["bearer", "token", "admin", "csr", "peer"])
async def test_identity_headers_are_treated_as_over_http11(aiohttp_server, root, caplog,
                                                           tmp_path, who):
    """X-Remote-* and x-kubernetes-peer-proxied from a client that is not a peer are
    replaced or dropped, exactly as over HTTP/1.1 (tests/test_security.py): the same
    request over both gets the same identity upstream, from the same server."""
    fields = list(SPOOFED) + ([("authorization", "Bearer t0ken")] if who == "token" else [])
    context = "bearer" if who == "token" else who
    async with h2_cluster(aiohttp_server, root, caplog) as c:
        c.contexts["csr"] = client_cert_context(root, tmp_path, devpki.FRONT_PROXY_CLIENT_CN)
        ctx = h2_context(c, context) if who != "csr" else tls.client_context(
            root / "ca.crt", tmp_path / "client.crt", tmp_path / "client.key")
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        for path in (NAMESPACES, PODGROUPS):
            over_h1 = await c.raw(
                f"GET {path} HTTP/1.1\r\nHost: mvproxy\r\n".encode()
                + b"".join(f"{k}: {v}\r\n".encode() for k, v in fields) + b"\r\n",
                who=context)
            h1 = _identity(json.loads(over_h1.partition(b"\r\n\r\n")[2]))
            async with await RawH2.open(c.port, ctx) as conn:
                answer = await conn.response(conn.request(path, fields=fields))
            assert answer.status == 200, answer
            h2_seen = _identity(json.loads(bytes(answer.body)))
            assert h2_seen == h1, (who, path)
            server, cn, headers = h2_seen
            # Only a peer's x-kubernetes-peer-proxied keeps a request here; without
            # credentials what only peers serve is the backend's to answer (issue 19).
            assert server == ("peer" if path == PODGROUPS and who not in ("bearer", "peer")
                              else "backend"), (who, path)
            users = [v for k, v in headers if k == "x-remote-user"]
            if who != "peer":  # only a peer's claims are believed
                assert ("x-remote-extra-scopes", "all") not in headers
                assert users == {"admin": ["kubernetes-admin"], "bearer": [], "token": [],
                                 "csr": [devpki.FRONT_PROXY_CLIENT_CN]}[who], headers
            else:
                assert users == ["system:admin"]
            if who in ("bearer", "token", "csr"):
                assert ("x-remote-group", "system:masters") not in headers
            if who in ("bearer", "token") and path == NAMESPACES:
                assert cn is None  # no front-proxy certificate without an asserted user
        await healthy_h2(c, caplog, who)
        record(SUITE, f"identity headers spoofed over h2 by {CLIENTS[who]}", 2,
               "the same identity upstream as over HTTP/1.1")


# --------------------------------------------------------------------------- endings


def _sessions() -> list[http2.Session]:
    return [s for s in gc.get_objects() if isinstance(s, http2.Session) and not s.closed]


async def test_shutdown_goaway_lets_open_streams_finish_and_refuses_new_ones(
        aiohttp_server, root, caplog):
    async with h2_cluster(aiohttp_server, root, caplog) as c:
        async with await h2(c) as conn:
            open_stream = conn.request(SLOW)

            async def upstream() -> bool:
                return c.backend.running == 1
            await c.until(upstream, "the slow request upstream")
            [session] = _sessions()
            assert session.conn.close_if_idle() is False  # a stream is open
            assert await conn.goaway_code() == NO_ERROR
            assert conn.goaway is not None and conn.goaway.last_stream_id == open_stream
            late = conn.request(NAMESPACES)
            await conn.until(lambda: conn.answers[late].reset is not None, "the late stream")
            assert conn.answers[late].reset == REFUSED_STREAM
            assert not conn.closed
            c.backend.release.set()
            answer = await conn.response(open_stream)
            assert answer.status == 200 and answer.ended
            assert bytes(answer.body) == b'{"slow": "done"}'
            assert await conn.closed_with() == NO_ERROR
        assert c.seen["backend"].count(("GET", NAMESPACES)) == 0
        await healthy_h2(c, caplog, "graceful GOAWAY")
        record(SUITE, "shutdown (close_if_idle) with a stream open", 1,
               "GOAWAY(NO_ERROR, last stream = the open one); a new stream got "
               "RST_STREAM(REFUSED_STREAM); the open one finished whole; then closed")


# --------------------------------------------------------------------------- fuzz

FRAME_TYPES = [0x0, 0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7, 0x8, 0x9, 0xFA]


@st.composite
def _frames(draw) -> list[tuple[str, int, int, int, bytes]]:
    ops = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            ops.append(("request", 0, draw(st.integers(0, 255)), 0, b""))
        else:
            ops.append(("raw", draw(st.sampled_from(FRAME_TYPES)), draw(st.integers(0, 255)),
                        draw(st.sampled_from([0, 1, 3, 5, 2, 0x7FFFFFFF])),
                        draw(st.binary(max_size=24))))
    return ops


def _wire(conn: RawH2, ops: list[tuple[str, int, int, int, bytes]]) -> bytes:
    out = []
    for kind, type_, flags, sid, payload in ops:
        if kind == "request":
            frame = HeadersFrame(conn.stream_id(), conn.block(
                [(":method", "GET"), (":scheme", "https"), (":path", NAMESPACES),
                 (":authority", "127.0.0.1")]))
            frame.flags = {"END_HEADERS"} | ({"END_STREAM"} if flags & 1 else set())
            out.append(frame.serialize())
        else:
            out.append(struct.pack(">IBI", (len(payload) << 8) | type_, flags, sid) + payload)
    return b"".join(out)


async def test_generated_frames_leave_the_daemon_healthy(aiohttp_server, root, caplog):
    examples: list = []

    @settings(max_examples=60, deadline=None, database=None)
    @given(ops=_frames())
    def collect(ops) -> None:
        examples.append(ops)

    collect()
    endings: dict[str, int] = {}
    async with h2_cluster(aiohttp_server, root, caplog) as c:
        for ops in examples:
            async with await h2(c) as conn:
                conn.send(_wire(conn, ops))
                answered = await ping(conn, b"fuzzdone")
                ending = "carried on" if answered else _ending(conn)
            endings[ending] = endings.get(ending, 0) + 1
            await healthy_h2(c, caplog, ops)
    record(SUITE, "generated frame sequences after the preface (HEADERS, DATA, RST_STREAM, "
           "SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION, PRIORITY, unknown; random "
           "flags, stream ids, payloads)", len(examples),
           ", ".join(f"{k}: {v}" for k, v in sorted(endings.items())) + "; healthy after each")


async def test_the_goaway_after_an_unauthenticated_answer_lets_other_streams_finish(
        aiohttp_server, root, caplog):
    """No credentials: the connection ends after an answer (kube-apiserver's
    UnauthenticatedHTTP2DOSMitigation), but gracefully: a stream still open then gets
    its whole answer, and nothing new is taken."""
    async with h2_cluster(aiohttp_server, root, caplog) as c:
        async with await h2(c, "bearer") as conn:
            slow = conn.request(SLOW)

            async def upstream() -> bool:
                return c.backend.running == 1
            await c.until(upstream, "the slow request upstream")
            quick = await conn.response(conn.request(NAMESPACES))
            assert quick.status == 200
            assert await conn.goaway_code() == NO_ERROR
            c.backend.release.set()
            answer = await conn.response(slow)
            assert answer.status == 200 and bytes(answer.body) == b'{"slow": "done"}'
            assert await conn.closed_with() == NO_ERROR
        assert await _metric(c, "mvproxy_http2_goaways_total", reason="unauthenticated") == 1
        await healthy_h2(c, caplog, "unauthenticated GOAWAY")
    record(SUITE, "the GOAWAY after an unauthenticated answer, another stream open", 1,
           "GOAWAY(NO_ERROR); the open stream finished whole; then closed")
