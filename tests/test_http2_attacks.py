"""An attacker's cases against the HTTP/2 code, both legs: a hostile upstream (a
backend or peer speaking HTTP/2 to mvproxy's upstream sessions, ``h2upstream``) and
hostile clients (``http2``).

Each case asserts what the client sees, then that the daemon is healthy: the next
watch over HTTP/2 upstream is served, nothing was logged at ERROR (an exception that
escaped into asyncio is logged there), and no upstream stream is left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
import pytest
from daemon_support import WAIT
from h2_support import RawH2
from h2_upstream_support import _H2, Backend, h2_backend
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
)
from test_http2_hostile import NAMESPACES, h2_cluster, healthy_h2
from test_http2_hostile import h2 as open_h2
from test_http2_upstream import WATCH, _events, _until, proxy

from mvproxy import h2upstream, tls
from mvproxy.h2frames import goaway_frame

HOSTILE = WATCH + "&hostile="
QUIET = {"discovery.pollInterval": "1h", "discovery.staleAfter": "2h",
         "discovery.forgetAfter": "3h"}
"""One discovery poll only: this test's busy event loop (the backend's too) delays no
later poll into a timeout, which would end every request to the backend."""


def _failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def healthy(base: str, session: aiohttp.ClientSession, daemon, backend: Backend,
                  caplog: pytest.LogCaptureFixture, what: object) -> None:
    """The next watch is served over HTTP/2, nothing was logged at ERROR, and every
    upstream stream ended."""
    assert await _events(session, f"{base}{WATCH}&healthy=1", 2) == [0, 1], what
    await _until(lambda: daemon.transport.http2_sessions()[1] == 0,
                 f"every upstream stream of {what!r} to end")
    assert not _failures(caplog), (what, _failures(caplog))


async def _answer(session: aiohttp.ClientSession, url: str) -> tuple[int, dict, bytes]:
    """Status, headers and body the HTTP/1.1 client got (status 0: the answer broke)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
            headers = {k.lower(): v for k, v in r.headers.items()}
            try:
                body = await r.read()
            except aiohttp.ClientPayloadError:
                return 0, headers, b""
            return r.status, headers, body
    except aiohttp.ClientResponseError:
        return 0, {}, b""


# --------------------------------------------------------------------------- a hostile upstream


def _head(*fields: tuple[bytes, bytes], status: bytes = b"200", body: bytes = b"{}\n",
          end: bool = True):
    """A hostile answer: a head exactly as given, a body, END_STREAM (with ``end``)."""
    async def answer(h2: _H2, sid: int) -> None:
        h2.head(sid, [(b":status", status), *fields])
        h2.raw(DataFrame(sid, body, flags=["END_STREAM"] if end else []))
    return answer


def _trailers(*fields: tuple[bytes, bytes]):
    async def answer(h2: _H2, sid: int) -> None:
        h2.head(sid, [(b":status", b"200"), (b"content-type", b"application/json")])
        h2.raw(DataFrame(sid, b"{}\n"))
        h2.head(sid, list(fields), end_stream=True)
    return answer


def _interim(*fields: tuple[bytes, bytes]):
    async def answer(h2: _H2, sid: int) -> None:
        h2.head(sid, [(b":status", b"103"), *fields])
        await _head()(h2, sid)
    return answer


INJECTED = b"x-injected"
HEADS = {
    # name: the hostile answer; the client must never see INJECTED as a header of its own
    "CR LF in a value": _head((b"x-a", b"1\r\nx-injected: 1")),
    "LF in a value": _head((b"x-a", b"1\nx-injected: 1")),
    "CR LF CR LF in a value (a second response)": _head(
        (b"x-a", b"1\r\ncontent-length: 0\r\n\r\nHTTP/1.1 200 OK\r\nx-injected: 1")),
    "NUL in a value": _head((b"x-a", b"1\x00x-injected: 1")),
    "CR LF in :status": _head(status=b"200 OK\r\nx-injected: 1\r\nx-b:"),
    ":status of two digits": _head(status=b"20"),
    ":status of four digits": _head(status=b"2000"),
    ":status not digits": _head(status=b"abc"),
    "a name with a space": _head((b"x-injected: 1\r\nx-a", b"1")),
    "a name with a colon": _head((b"x-injected:1", b"1")),
    "CR LF in a trailer": _trailers((b"x-t", b"1\r\nx-injected: 1")),
    "a trailer name with CR LF": _trailers((b"x-injected: 1\r\nx-t", b"1")),
    "CR LF in an interim answer": _interim((b"x-a", b"1\r\nx-injected: 1")),
    "a body after 204 (a second response)": _head(
        status=b"204", body=b"HTTP/1.1 200 OK\r\nx-injected: 1\r\ncontent-length: 0\r\n\r\n"),
    "a body after 304": _head(status=b"304", body=b"HTTP/1.1 200 OK\r\nx-injected: 1\r\n\r\n"),
}


@pytest.mark.parametrize("name", list(HEADS))
async def test_a_response_head_http11_could_read_differently_is_a_broken_response(
        root, caplog, name):
    """jh2 checks neither header values nor names for CR, LF and NUL, nor ``:status``:
    the head is written as HTTP/1.1 bytes into mvproxy's own parser, so a hostile
    upstream's field became headers (or a second response) of its choosing."""
    caplog.set_level(logging.WARNING)
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, daemon):
        backend.hostile["hostile=1"] = HEADS[name]
        status, headers, body = await _answer(session, base + HOSTILE + "1")
        assert INJECTED.decode() not in headers, (name, headers)
        # 0: the answer was cut (a trailer); a 204 or 304 is answered without its DATA
        assert status in (0, 502) or (status in (204, 304) and body == b""), (name, status)
        await healthy(base, session, daemon, backend, caplog, name)


def _then(first, *frames: Callable[[int], Frame | bytes]):
    """``first``'s answer, then ``frames`` on the stream."""
    async def answer(h2: _H2, sid: int) -> None:
        await first(h2, sid)
        h2.raw(*(f(sid) for f in frames))
    return answer


def _before(*frames: Callable[[int], Frame | bytes], then=None):
    """``frames`` before the answer (``then``, else the ordinary one)."""
    async def answer(h2: _H2, sid: int) -> None:
        h2.raw(*(f(sid) for f in frames))
        await (then or _head())(h2, sid)
    return answer


def _continuations(count: int):
    async def answer(h2: _H2, sid: int) -> None:
        frame = HeadersFrame(sid, h2.conn.encoder.encode([(b":status", b"200")]))
        h2.raw(frame, *(ContinuationFrame(sid, b"\x40\x01a\x01b" * 3000)
                        for _ in range(count)))
    return answer


def _interims(count: int):
    async def answer(h2: _H2, sid: int) -> None:
        for _ in range(count):
            h2.head(sid, [(b":status", b"103"), (b"link", b"</a>; rel=preload")])
        await _head()(h2, sid)
    return answer


def _goaway(last: int) -> Callable[[int], bytes]:
    return lambda sid: goaway_frame(last, 0)


OTHERS = {
    # name: (the hostile answer, the statuses the client may see); each held already
    "PUSH_PROMISE (push is off)": (_before(lambda sid: PushPromiseFrame(
        sid, promised_stream_id=2, data=b"\x82\x84\x87\x41\x01a", flags=["END_HEADERS"])),
        (0, 502)),
    "DATA beyond the stream's window": (_then(
        _head(body=b"{", end=False),
        lambda sid: DataFrame(sid, b"x" * (h2upstream.STREAM_WINDOW + 1))),
        (0, 200)),
    "DATA after END_STREAM": (_then(_head(), lambda sid: DataFrame(sid, b"more")), (200,)),
    "RST_STREAM after END_STREAM": (_then(_head(), lambda sid: RstStreamFrame(sid)), (200,)),
    "endless CONTINUATION": (_continuations(200), (0, 502)),
    "SETTINGS at their largest": (_before(lambda sid: SettingsFrame(
        0, {0x1: 2**32 - 1, 0x3: 2**32 - 1, 0x4: 2**31 - 1, 0x5: 2**24 - 1, 0x6: 2**32 - 1})),
        (200,)),
    "SETTINGS with a window past 2**31-1": (_before(lambda sid: SettingsFrame(
        0, {0x4: 2**31})), (0, 502)),
    "GOAWAY naming every stream": (_before(_goaway(2**31 - 1)), (200,)),
    # the answer (in the same read) may still be taken, or the stream refused
    "GOAWAY naming none, the answer sent anyway": (_before(_goaway(0)), (0, 200, 502, 503)),
    ":status 101": (_head(status=b"101"), (0, 502)),
    "two interim answers (allowed)": (_interims(2), (200,)),
    "3,000 interim answers (the budget)": (_interims(3000), (0, 502)),
    "content-length below the DATA": (_head((b"content-length", b"1")), (0, 502)),
    "content-length not a number": (_head((b"content-length", b"1_0")), (0, 502)),
}


@pytest.mark.parametrize("name", list(OTHERS))
async def test_other_hostile_answers_end_their_stream_or_connection_only(root, caplog, name):
    """What a hostile upstream can send beside the head: each ends at worst its stream
    or its connection, and the next watch is served."""
    caplog.set_level(logging.WARNING)
    answer, statuses = OTHERS[name]
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, daemon):
        backend.hostile["hostile=1"] = answer
        status, headers, body = await _answer(session, base + HOSTILE + "1")
        assert status in statuses, (name, status, body[:200])
        backend.hostile.clear()
        await healthy(base, session, daemon, backend, caplog, name)


def _ctx(root) -> ssl.SSLContext:
    ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


def _stalled(backend: Backend) -> bool:
    """A stream of the backend's waits for mvproxy's window."""
    for server in backend.sessions:
        for sid in list(server.tasks):
            with contextlib.suppress(Exception):
                if server.conn.local_flow_control_window(sid) <= 0:
                    return True
    return False


async def test_streams_left_while_their_reader_stalled_give_their_window_back(
        root, caplog, monkeypatch):
    """A stream whose downstream stopped reading holds its DATA uncredited; when its
    client left, those bytes were never credited on the connection either, so each
    such watch took up to ``STREAM_WINDOW`` from the connection's window for good: a
    token client that opens watches, stops reading and leaves starved every request
    sharing that upstream connection. (``MAX_STREAMS`` 2 makes the connection's window
    98 KB: a few such clients spend it, as ~100 do by default.)"""
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(h2upstream, "MAX_STREAMS", 2)
    async with h2_backend(root) as backend, \
            proxy(root, backend, upstreamHTTP2="all") as (base, session, daemon):
        port = urlsplit(base).port
        assert port is not None
        async with await RawH2.open(port, _ctx(root), settings={0x4: 0}) as client:
            for i in range(12):  # each leaves up to 16 KB uncredited
                sid = client.request(f"/big?i={i}&n=400000")
                await _until(lambda: _stalled(backend), f"stream {i} to stall upstream")
                client.reset(sid)
                await _until(lambda: daemon.transport.http2_sessions()[1] == 0,
                             f"stream {i} to end upstream")
        assert backend.connections["h2"] == 1
        async with session.get(base + "/big?n=300000",
                               timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
            assert r.status == 200 and len(await r.read()) == 300_000
        assert backend.connections["h2"] == 1  # the same connection carried it
        await healthy(base, session, daemon, backend, caplog, "stalled streams left")


async def test_an_upstream_allowing_no_stream_is_not_dialled_again_and_again(root, caplog):
    """``SETTINGS_MAX_CONCURRENT_STREAMS`` 0: each watch dialled new connections
    (up to ``MAX_DIAL_ROUNDS``) that could carry nothing, and kept every one open in
    the pool, for as long as the upstream kept them: a connection (TLS, jh2 state) per
    dial, held by mvproxy, and a longer list walked by every later request."""
    caplog.set_level(logging.WARNING)
    async with h2_backend(root, max_streams=0) as backend, \
            proxy(root, backend) as (base, session, daemon):
        for i in range(5):
            status, _, body = await _answer(session, f"{base}{WATCH}&i={i}")
            assert status == 200 and json.loads(body)["protocol"] == "http/1.1", body[:200]
        assert backend.connections["h2"] <= 1, backend.connections
        await _until(lambda: daemon.transport.http2_sessions()[0] == 0,
                     "the connection that carries nothing to close")
        assert not _failures(caplog)


def _flood(frame: Callable[[int], Frame], count: int):
    """Reads nothing while it sends ``count`` frames that each make mvproxy write one
    (an ACK), then waits for mvproxy to drop the connection."""
    async def answer(h2: _H2, sid: int) -> None:
        h2.conn.send_headers(sid, [(":status", "200")])
        h2.flush()
        h2.writer.transport.pause_reading()
        try:
            for i in range(0, count, 1000):
                h2.raw(*(frame(i + j) for j in range(1000)))
                await h2.writer.drain()
        finally:
            h2.writer.transport.resume_reading()
        await _until(lambda: h2.backend.dropped > 0, "mvproxy to drop the connection")
    return answer


def _ping(n: int) -> Frame:
    return PingFrame(0, n.to_bytes(8, "big"))


def _settings(n: int) -> Frame:
    return SettingsFrame(0, {0x3: 100})


@pytest.mark.parametrize("frame", [_ping, _settings])
async def test_an_upstream_flooding_control_frames_loses_its_connection(root, caplog, frame):
    """PING and SETTINGS each make mvproxy write an ACK, whether the upstream reads
    them or not: a hostile upstream that floods them and reads nothing grew mvproxy's
    write buffer without bound (the client side has a budget, this side had none).
    """
    caplog.set_level(logging.WARNING)
    async with h2_backend(root) as backend, proxy(root, backend, **QUIET) as (
            base, session, daemon):
        backend.hostile["hostile=flood"] = _flood(frame, 20_000)
        status, _, _ = await _answer(session, base + HOSTILE + "flood")
        await _until(lambda: backend.dropped > 0, "mvproxy to drop the flooding connection")
        assert status == 0  # the watch broke with its connection
        await healthy(base, session, daemon, backend, caplog, frame.__name__)
        assert backend.connections["h2"] == 2


async def test_a_head_answer_without_a_length_leaves_the_stream_clean(root, caplog):
    """A HEAD answered with no ``content-length`` is written chunked to mvproxy's
    parser, which reads no body after a HEAD: the chunk end that follows must not be
    read as the start of another answer."""
    caplog.set_level(logging.WARNING)
    async with h2_backend(root) as backend, \
            proxy(root, backend, upstreamHTTP2="all") as (base, session, daemon):
        async def bare(h2: _H2, sid: int) -> None:
            h2.head(sid, [(b":status", b"200"), (b"x-a", b"1")], end_stream=True)
        backend.hostile["hostile=head"] = bare
        for _ in range(3):
            async with session.head(base + HOSTILE + "head",
                                    timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
                assert r.status == 200 and r.headers.get("x-a") == "1"
        await healthy(base, session, daemon, backend, caplog, "HEAD")


def _closed_stream_flood(count: int):
    """A whole answer, then ``count`` empty DATA frames on its closed stream, read
    nothing (its receive buffer kept small: loopback's grows to tens of MB): jh2 answers
    each with ``RST_STREAM`` (no event, no budget)."""
    async def answer(h2: _H2, sid: int) -> None:
        await _head()(h2, sid)
        h2.writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF,
                                                      1 << 16)
        h2.writer.transport.pause_reading()
        try:
            frame = DataFrame(sid, b"").serialize()
            for _ in range(0, count, 5000):
                h2.raw(frame * 5000)
                await h2.writer.drain()
        finally:
            h2.writer.transport.resume_reading()
        await _until(lambda: h2.backend.dropped > 0, "mvproxy to drop the connection")
    return answer


@pytest.mark.timeout(300)  # frames go through jh2 one by one: slow under CI's coverage
async def test_an_upstream_that_reads_nothing_of_what_its_frames_make_mvproxy_send(
        root, caplog):
    """Frames on a closed stream make jh2 queue ``RST_STREAM`` for each: an upstream
    that sends those and reads nothing grew mvproxy's write buffer without bound."""
    caplog.set_level(logging.WARNING)
    async with h2_backend(root) as backend, proxy(root, backend, **QUIET) as (
            base, session, daemon):
        # The session first, its socket's send buffer small: the kernel would take
        # megabytes of replies on loopback before mvproxy's own buffer grows.
        assert await _events(session, base + WATCH, 1) == [0]
        [pool_session] = [s for pool in daemon.transport._pools.values()
                          for s in pool.sessions]
        pool_session.socket_transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        backend.hostile["hostile=closed"] = _closed_stream_flood(1_000_000)
        status, _, body = await _answer(session, base + HOSTILE + "closed")
        assert status == 200 and body == b"{}\n"  # the answer came whole first
        await _until(lambda: backend.dropped > 0, "mvproxy to drop the connection",
                     timeout=12 * WAIT)
        backend.hostile.clear()
        await healthy(base, session, daemon, backend, caplog, "frames on a closed stream")
        assert backend.connections["h2"] == 2


@pytest.mark.parametrize("who", ["admin", "bearer"])
async def test_a_client_that_reads_nothing_of_what_its_frames_make_mvproxy_send(
        aiohttp_server, root, caplog, who):
    """The same from a client (``http2.Session``): empty DATA on a closed stream costs
    it 9 bytes and no budget, and mvproxy queued 13 bytes of ``RST_STREAM`` for each,
    never read, until the connection ended (100,000 left 325 KB in mvproxy's buffer
    beside what the kernel took). Now the connection is aborted once 1 MiB waits."""
    async with h2_cluster(aiohttp_server, root, caplog) as c:
        conn = await open_h2(c, who)
        sid = conn.request(NAMESPACES)
        # bearer: no credential at all, answered 200 here (the fake backend does not
        # authenticate), then GOAWAY and the close: nothing more is read (it held
        # before the bound too; a credential is what the attack needs)
        assert (await conn.response(sid)).status == 200
        assert conn._task is not None
        conn._task.cancel()  # read nothing from now on
        with contextlib.suppress(asyncio.CancelledError):
            await conn._task
        conn.writer.transport.pause_reading()
        frame = DataFrame(sid, b"").serialize()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            for _ in range(80):
                conn.writer.write(frame * 5000)
                await conn.writer.drain()
        conn.writer.transport.resume_reading()
        try:
            async with asyncio.timeout(WAIT):  # the RST_STREAMs queued, then the end
                while await conn.reader.read(1 << 20):
                    pass
        except (ConnectionError, ssl.SSLError):
            pass  # reset: as good as the end (a TimeoutError fails the test)
        conn.writer.transport.abort()
        await healthy_h2(c, caplog, "frames on a closed stream")


async def test_a_connection_whose_stream_ids_ran_out_gives_way_to_a_new_one(root, caplog):
    """Stream IDs end at 2**31-1: a session that has used them (a billion requests,
    some 30 hours at 10,000 per second with ``all``) could open no more, yet stayed
    the pool's choice while its upstream kept it open, so every later request failed.
    (The IDs used are set on the live session: nothing else reaches the end.)"""
    caplog.set_level(logging.WARNING)
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, daemon):
        assert await _events(session, f"{base}{WATCH}&first=1", 1) == [0]
        [upstream] = [s for p in daemon.transport._pools.values() for s in p.sessions]
        upstream.h2.highest_outbound_stream_id = 2**31 - 5
        for i in range(4):  # IDs 2**31-3 and 2**31-1, then a new connection's
            assert await _events(session, f"{base}{WATCH}&i={i}", 1) == [0], i
        assert backend.connections["h2"] == 2
        await healthy(base, session, daemon, backend, caplog, "stream IDs ran out")


async def test_an_answer_that_ends_before_the_upload_does_frees_its_stream(root, caplog):
    """An upstream may answer (403, 413) and end its side before a request body is
    all sent. The stream is then half-closed on mvproxy's side, still open in jh2's
    count of streams against the server's ``MAX_CONCURRENT_STREAMS``; unless mvproxy
    ends or resets its own side, a few such uploads would fill that count, and every
    later request on the connection would fail as jh2 refuses to open a stream. (It
    held: mvproxy resets each, the backend counts the resets.)"""
    caplog.set_level(logging.WARNING)
    async with h2_backend(root, max_streams=3) as backend, \
            proxy(root, backend, upstreamHTTP2="all") as (base, session, daemon):
        async def early(h2: _H2, sid: int) -> None:
            body = b'{"kind":"Status","code":403}'
            h2.conn.send_headers(sid, [(":status", "403"), ("content-length", str(len(body)))])
            h2.conn.send_data(sid, body, end_stream=True)
            h2.flush()
        backend.hostile["early"] = early
        for i in range(6):
            async with session.put(base + f"/api/v1/namespaces/default/configmaps/early{i}",
                                   data=b"x" * 1_000_000,
                                   timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
                assert r.status == 403, (i, r.status)
        await _until(lambda: backend.resets == 6, "mvproxy to reset each early-answered stream")
        backend.hostile.clear()
        async with session.get(base + "/api/v1/namespaces",
                               timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
            assert r.status == 200 and (await r.json())["protocol"] == "h2"
        await healthy(base, session, daemon, backend, caplog, "early answers")
