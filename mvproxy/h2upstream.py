"""HTTP/2 toward upstreams: many requests (watches) on one TLS connection per upstream.

A pool (``transport.Pool``) whose upstream offers ``h2`` keeps ``UpstreamSession`` s:
one TLS connection each, jh2's client state machine on it, up to the server's
``MAX_CONCURRENT_STREAMS`` requests at once. Each request is an ``UpstreamConnection``
as on HTTP/1.1 (the same parser, states, failover facts and flow control), whose
transport is an ``UpstreamStream``: the HTTP/1.1 request it writes is read (llhttp) into
HEADERS and DATA, and the stream's answer is written back to it as HTTP/1.1 (a length,
or chunks; ``Connection: close``: one request per stream). The rest of mvproxy cannot
tell the two apart, so everything it checks on a response is checked here too.

- **flow control**: each stream's window is ``STREAM_WINDOW`` and is credited back
  only while its downstream keeps up (the connection's ``pause_reading``), so one
  stalled watch holds at most that much and never stalls the others; the connection's
  own window covers every stream's.
- **GOAWAY**: streams the server will still answer finish; the others end as
  connections that closed before any response (nothing was processed: failover may
  try elsewhere); new requests go to a new connection.
- **the end**: when the TLS connection ends, every stream on it ends the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
import time
from collections import deque
from typing import Any, cast

import httptools
from jh2.config import H2Configuration
from jh2.connection import H2Connection
from jh2.errors import ErrorCodes
from jh2.events import (
    DataReceived,
    InformationalResponseReceived,
    PingReceived,
    PriorityUpdated,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    UnknownFrameReceived,
    WindowUpdated,
)
from jh2.exceptions import ProtocolError
from jh2.settings import SettingCodes, Settings

from mvproxy.h2frames import (
    BAD_VALUE,
    CONTROL_BUDGET,
    CONTROL_REFILL,
    TOKEN,
    Budget,
    GoawayError,
    GoawaySplitter,
    goaway_frame,
)
from mvproxy.logs import V, kv
from mvproxy.tls import current_context
from mvproxy.transport import H2_RETRY_AFTER, Pool, UpstreamConnection

log = logging.getLogger(__name__)

STREAM_WINDOW = 16 * 1024
"""Response bytes one stream may have in flight before mvproxy credits them back: what a
watch whose client stopped reading holds, at most, on this leg."""
MAX_STREAMS = 100
"""Streams per connection mvproxy opens at most, whatever the server allows."""
LAST_STREAM_ID = 2**31 - 1
"""Stream IDs end there (RFC 9113 §5.1.1): a connection that used them takes no more."""
OUTBOUND_LIMIT = 1 << 20
"""Bytes mvproxy's writes to one upstream connection may queue unread: request DATA
waits for it to drain, so only what jh2 answers on its own piles up (``RST_STREAM``
for each frame on a closed stream reaches no event and no budget)."""
_STATUS = re.compile(rb"[0-9]{3}\Z")
_CONTROL = frozenset((PingReceived, PriorityUpdated, RemoteSettingsChanged,
                      UnknownFrameReceived))
INTERIM_FREE = 2
"""Interim answers (100, 103) a stream gets without spending the budget: an honest
server sends one or two per request, and a busy connection carries many requests."""
_HOP = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                  b"upgrade", b"host", b"te"))


class UpstreamSession:
    """One HTTP/2 connection to an upstream (the protocol of its TLS transport)."""

    def __init__(self, pool: Pool, transport: asyncio.Transport,
                 socket_transport: asyncio.Transport | None, context: ssl.SSLContext):
        self.pool = pool
        self.transport: asyncio.Transport | None = transport
        self.socket_transport = socket_transport
        self.context = context
        self.h2 = H2Connection(H2Configuration(
            client_side=True, header_encoding=None, validate_inbound_headers=True,
            normalize_inbound_headers=True, validate_outbound_headers=False,
            normalize_outbound_headers=False))
        # Replaced, not updated: ``initiate_connection`` advertises the current values;
        # updated ones would apply only once the server acknowledged SETTINGS it never
        # saw, and its first DATA would overrun the window it was not told of.
        self.h2.local_settings = Settings(client=True, initial_values={
            SettingCodes.ENABLE_PUSH: 0, SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            SettingCodes.MAX_CONCURRENT_STREAMS: 0})
        self.streams: dict[int, UpstreamStream] = {}
        self.carrying = 0
        """Requests on this connection, sent or about to be."""
        self.idle_since = time.monotonic()
        self.going_away = False
        self.closed = False
        self.paused = False
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.splitter = GoawaySplitter(preface=False)
        self.budget = Budget(CONTROL_BUDGET, CONTROL_REFILL, time.monotonic())
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(MAX_STREAMS * STREAM_WINDOW)
        transport.set_protocol(cast(asyncio.Protocol, self))  # called by name
        self.flush()

    # ---------------------------------------------------------------- for the pool

    def can_open(self) -> bool:
        """Room for one more request, on a connection made with the client certificate
        in use now (kube-apiserver checks it on every request: one a reload replaced
        would get 401 once it expires; the streams already open finish)."""
        h2_context = self.pool.upstream.h2_context
        if h2_context is not None and current_context(h2_context) is not self.context:
            self.close()
            return False
        if not self.carrying and time.monotonic() - self.idle_since > self.pool.idle_expiry:
            self.close()  # as an idle HTTP/1.1 connection: the server may be closing it
            return False
        if (self.h2.highest_outbound_stream_id or 0) + 2 * (self.carrying + 1) > LAST_STREAM_ID:
            self.close()  # every request taken gets an ID; later ones a new connection
        return (not self.going_away and not self.closed and self.carrying < min(
            MAX_STREAMS, self.h2.remote_settings.max_concurrent_streams))

    def open_stream(self) -> UpstreamConnection:
        """A connection object for one request on this session (busy in its pool)."""
        conn = UpstreamConnection(self.pool)
        conn.context = self.context
        self.carrying += 1
        conn.connection_made(UpstreamStream(self, conn))
        self.pool.busy.add(conn)
        return conn

    def abort(self) -> None:
        self.going_away = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """No new request; closed once the last one ended."""
        self.going_away = True
        self._close_when_done()

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # pragma: no cover
        pass  # made by the pool's dial; ``__init__`` takes the transport over

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            data = self.splitter.feed(data)
            events = self.h2.receive_data(data) if data else []
        except (ProtocolError, GoawayError) as exc:
            log.log(V(2), "upstream HTTP/2 connection broken", extra=kv(
                upstream=self.pool.upstream.name, error=str(exc)[:120]))
            self.flush()
            self.abort()
            return
        for event in events:
            if self.closed:
                return
            kind = type(event)
            if (kind in _CONTROL or (kind is DataReceived and not event.data
                                     and event.stream_ended is None)) and not self._spend():
                return
            stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
            if kind is DataReceived:
                if stream is not None:
                    stream.body(event.data, event.flow_controlled_length)
                else:
                    self.h2.acknowledge_received_data(event.flow_controlled_length,
                                                      event.stream_id)
                if event.stream_ended is not None and stream is not None:
                    stream.end([])
            elif kind is ResponseReceived:
                if stream is not None:
                    stream.head(event.headers, event.stream_ended is not None)
            elif kind is InformationalResponseReceived:
                if stream is not None:
                    stream.interims += 1
                    if stream.interims > INTERIM_FREE and not self._spend():
                        return
                    stream.interim(event.headers)
            elif kind is TrailersReceived:
                if stream is not None:
                    stream.end(event.headers)
            elif kind is StreamEnded:
                if stream is not None:
                    stream.end([])
            elif kind is StreamReset:
                if stream is not None:
                    stream.lost(refused=event.error_code == ErrorCodes.REFUSED_STREAM)
            elif kind is WindowUpdated:
                self._send_waiting()
            elif kind is RemoteSettingsChanged:
                if not self.h2.remote_settings.max_concurrent_streams:
                    # It takes no stream: new requests go over HTTP/1.1 for a while, not
                    # to one more connection that carries nothing (and stays open).
                    self.pool.h2_refused_until = time.monotonic() + H2_RETRY_AFTER
                    self.close()
                if not self.ready.done():
                    self.ready.set_result(None)
                self._send_waiting()
        for last, _ in self.splitter.received:
            self.going_away = True  # the server's GOAWAY (h2frames: jh2 never sees it)
            for stream_id, waiting in list(self.streams.items()):
                if stream_id > last:  # never processed: safe to send elsewhere
                    waiting.lost(refused=True)
        if self.splitter.received:
            self.splitter.received.clear()
            self._close_when_done()
        self.flush()
        transport = self.transport
        if transport is not None and not transport.is_closing() \
                and transport.get_write_buffer_size() > OUTBOUND_LIMIT:
            log.log(V(2), "upstream HTTP/2 connection broken", extra=kv(
                upstream=self.pool.upstream.name, error="it reads nothing mvproxy sends"))
            self.abort()

    def _spend(self) -> bool:
        """One frame that carries no answer; False (the connection aborted) once the
        budget is spent."""
        if self.budget.spend(time.monotonic()):
            return True
        log.log(V(2), "upstream HTTP/2 connection broken", extra=kv(
            upstream=self.pool.upstream.name, error="too many frames that carry no answer"))
        self.h2.clear_outbound_data_buffer()
        self.abort()
        return False

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.going_away = True
        if not self.ready.done():
            self.ready.set_result(None)
        self.pool.forget_session(self)
        for stream in list(self.streams.values()):
            stream.lost()
        self.streams.clear()
        self.transport = self.socket_transport = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._send_waiting()
        self.flush()

    # ---------------------------------------------------------------- frames out

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _send_waiting(self) -> None:
        for stream in list(self.streams.values()):
            if self.paused:
                return
            stream.send()

    def forget(self, stream: UpstreamStream) -> None:
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]
        if stream.unacknowledged and not self.closed:
            # What arrived while its reader stalled: the stream is over, but those
            # bytes still count against the connection's window, every stream's.
            with contextlib.suppress(ProtocolError):
                self.h2.acknowledge_received_data(stream.unacknowledged, stream.stream_id)
            stream.unacknowledged = 0
            self.flush()
        if stream.counted:
            stream.counted = False
            self.carrying -= 1
            if not self.carrying:
                self.idle_since = time.monotonic()
        self._close_when_done()

    def _close_when_done(self) -> None:
        if self.going_away and not self.carrying and self.transport is not None:
            self.flush()
            self.transport.write(goaway_frame(0, ErrorCodes.NO_ERROR))
            self.transport.close()


class UpstreamStream(asyncio.Transport):
    """The transport of one request's ``UpstreamConnection`` on an ``UpstreamSession``."""

    def __init__(self, session: UpstreamSession, conn: UpstreamConnection):
        super().__init__()
        self.session = session
        self.conn: UpstreamConnection | None = conn
        self.stream_id = 0
        self.counted = True
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.pending: deque[bytes] = deque()
        self.pending_size = 0
        self.request_done = False
        self.end_sent = False
        self.chunked = False
        """The answer is written to the connection chunked (it came with no length)."""
        self.answered = False
        self.interims = 0
        self.ended = False
        self.closing = False
        self.reading = True
        self.unacknowledged = 0
        self.high, self.low = 4096, 1024

    # ---------------------------------------------------------------- the request (llhttp)

    def write(self, data: bytes) -> None:  # type: ignore[override]
        if self.parser is None or self.ended:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            log.log(V(1), "upstream HTTP/2 request unreadable", exc_info=True)
            self.abort()
            return
        self.send()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        session, parser = self.session, self.parser
        assert parser is not None
        authority = b""
        headers = [(b":method", parser.get_method()), (b":scheme", b"https"),
                   (b":authority", b""), (b":path", self.url)]
        has_body = False
        for name, value in self.fields:
            if name == b"host":
                authority = value
            elif name == b"content-length":
                has_body = value != b"0"
                headers.append((name, value))
            elif name == b"transfer-encoding":
                has_body = True
            elif name not in _HOP or (name == b"te" and value == b"trailers"):
                headers.append((name, value))
        headers[2] = (b":authority", authority or self.session.pool.upstream.raw_authority)
        self.fields = []
        try:
            self.stream_id = session.h2.get_next_available_stream_id()
            session.h2.send_headers(self.stream_id, headers, end_stream=not has_body)
        except ProtocolError:
            self.lost()
            return
        session.streams[self.stream_id] = self
        self.end_sent = not has_body
        session.flush()

    def on_body(self, body: bytes) -> None:
        self.pending.append(body)
        self.pending_size += len(body)

    def on_message_complete(self) -> None:
        self.request_done = True

    def send(self) -> None:
        """Request body bytes the server's window and the connection take now."""
        session = self.session
        if not self.stream_id or self.ended or session.closed:
            return
        h2 = session.h2
        try:
            while self.pending and not session.paused:
                window = min(h2.local_flow_control_window(self.stream_id),
                             h2.max_outbound_frame_size)
                if window <= 0:
                    break
                piece = self.pending.popleft()
                if len(piece) > window:
                    self.pending.appendleft(piece[window:])
                    piece = piece[:window]
                self.pending_size -= len(piece)
                h2.send_data(self.stream_id, piece)
            if not self.pending and self.request_done:
                self.parser = None
                if not self.end_sent:
                    self.end_sent = True
                    h2.end_stream(self.stream_id)
        except ProtocolError:
            self.lost()
            return
        session.flush()
        conn = self.conn
        if conn is not None:
            if self.pending_size > self.high and not conn.paused_writing:
                conn.pause_writing()
            elif self.pending_size <= self.low and conn.paused_writing:
                conn.resume_writing()

    # ---------------------------------------------------------------- the answer

    def interim(self, headers: list[tuple[bytes, bytes]]) -> None:
        status = next((v for n, v in headers if n == b":status"), b"100")
        if self._malformed(headers):
            return
        self._feed(b"HTTP/1.1 " + status + b" \r\n" + _lines(headers) + b"\r\n")

    def head(self, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        status = next((v for n, v in headers if n == b":status"), b"")
        if self._malformed(headers):
            return
        lines = _lines(headers)
        framing = b""
        if not any(n == b"content-length" for n, _ in headers) \
                and status not in (b"204", b"304"):
            framing = b"Transfer-Encoding: chunked\r\n"
            self.chunked = True
        self.answered = True
        self._feed(b"HTTP/1.1 " + status + b" \r\n" + lines + framing
                   + b"Connection: close\r\n\r\n")
        if ended:
            self.end([])

    def body(self, data: bytes, flow: int) -> None:
        if self.reading:
            self.session.h2.acknowledge_received_data(flow, self.stream_id)
        else:
            self.unacknowledged += flow
        if data:
            self._feed(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    def end(self, trailers: list[tuple[bytes, bytes]]) -> None:
        if self.ended or self._malformed(trailers):
            return
        if self.chunked:
            self._feed(b"0\r\n" + _lines(trailers) + b"\r\n")
        self.ended = True
        self.session.forget(self)

    def _malformed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the server's fields could read differently as the HTTP/1.1 they
        are written as (jh2 checks no value for CR, LF or NUL, no name beyond
        uppercase, no ``:status``): then the stream is reset and its request ends as
        one whose connection broke, the fields never fed to the parser."""
        why = ""
        for name, value in headers:
            if BAD_VALUE.search(value):
                why = "a field value holds CR, LF or NUL"
            elif name == b":status":
                why = "" if _STATUS.match(value) else ":status is not three digits"
            elif not TOKEN.match(name):
                why = "a field name is not a token"
            if why:
                break
        if not why:
            return False
        session = self.session
        log.log(V(2), "upstream HTTP/2 answer malformed", extra=kv(
            upstream=session.pool.upstream.name, error=why))
        if not self.ended and not session.closed:
            with contextlib.suppress(ProtocolError):
                session.h2.reset_stream(self.stream_id, ErrorCodes.PROTOCOL_ERROR)
            session.flush()
        self.lost()
        return True

    def lost(self, *, refused: bool = False) -> None:
        """The stream or its connection ended before the answer did; ``refused``: the
        server says it processed nothing of it."""
        self.ended = True
        self.pending.clear()
        self.session.forget(self)
        conn, self.conn = self.conn, None
        if conn is not None and not conn.closed:
            conn.refused = refused
            conn.connection_lost(None)

    def _feed(self, data: bytes) -> None:
        conn = self.conn
        if conn is not None and not self.closing:
            conn.data_received(data)

    # ---------------------------------------------------------------- asyncio.Transport

    def close(self) -> None:
        """The request is over for its connection (answered, or abandoned)."""
        if self.closing:
            return
        self.closing = True
        if not self.ended:
            self._cancel()
        self._lost_soon()

    def abort(self) -> None:
        self.closing = True
        if not self.ended:
            self._cancel()
        self._lost_soon()

    def _cancel(self) -> None:
        self.ended = True
        self.pending.clear()
        session = self.session
        if self.stream_id and not session.closed:
            with contextlib.suppress(ProtocolError):
                session.h2.reset_stream(self.stream_id, ErrorCodes.CANCEL)
            session.flush()
        session.forget(self)

    def _lost_soon(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            asyncio.get_running_loop().call_soon(_lost, conn)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True
        session = self.session
        if self.unacknowledged and not self.ended and not session.closed:
            with contextlib.suppress(ProtocolError):
                session.h2.acknowledge_received_data(self.unacknowledged, self.stream_id)
            self.unacknowledged = 0
            session.flush()

    def is_reading(self) -> bool:
        return self.reading

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high = 4096 if high is None else high
        self.low = self.high // 4 if low is None else low

    def get_write_buffer_size(self) -> int:
        return self.pending_size

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return None  # the session's socket has its keep-alive already
        transport = self.session.transport
        return default if transport is None else transport.get_extra_info(name, default)


def _lost(conn: UpstreamConnection) -> None:
    if conn.state.value != "closed":
        conn.connection_lost(None)


def _lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(n + b": " + v + b"\r\n" for n, v in headers if n[:1] != b":")


def open_session(pool: Pool, conn: UpstreamConnection) -> UpstreamSession:
    """Take over ``conn``'s TLS connection, whose server chose ``h2``."""
    transport = conn.transport
    assert transport is not None and conn.context is not None
    session = UpstreamSession(pool, transport, conn.socket_transport, conn.context)
    early, conn.early = conn.early or [], None
    conn.transport = conn.socket_transport = None  # the dialled object is dropped
    for data in early:
        session.data_received(data)
    return session
