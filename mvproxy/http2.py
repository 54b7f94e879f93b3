"""HTTP/2 toward clients: one TLS connection carries many requests (``h2`` in ALPN).

A connection whose client chose ``h2`` gets a ``Session``: jh2's sans-I/O state machine
reads its frames, and each stream becomes a request to the same engine as an HTTP/1.1
one. The stream's head and body are written as HTTP/1.1 into a ``DownstreamConnection``
of its own (``StreamTransport`` is its transport), so the listener's parser, request
checks, limits, deadlines and handler run unchanged; the HTTP/1.1 answer that
connection writes is read back (llhttp) into HEADERS and DATA frames. The re-framing
costs a few µs per request against the ~120 µs of the HTTP/2 codec itself
(docs/http2.md), and there is one request path to harden, not two.

What this module adds to that path, and owns:

- **downgrade safety**: a stream's head becomes HTTP/1.1 only if every name is a
  lowercase token and no value holds CR, LF or NUL, ``:path`` is origin-form, and no
  connection-specific field came (jh2 refuses those, and ``TE`` other than
  ``trailers``); the body is framed by its ``content-length`` (which jh2 holds DATA
  to) or chunked here. llhttp then parses what was built like any client's bytes.
  ``:authority`` becomes ``Host``, which picks nothing: routing reads the path.
- **concurrency**: ``SETTINGS_MAX_CONCURRENT_STREAMS`` (``maxConcurrentStreams``), and
  a stream the client reset still counts until its handler has ended (the rapid-reset
  defence, CVE-2023-44487); new streams past the limit are refused, and a connection
  that keeps opening them, or keeps resetting streams before their answer ended (the
  reset ends the request at once, so the limit alone would not slow it), gets
  ``GOAWAY(ENHANCE_YOUR_CALM)``.
- **flood limits**: frames that make no request (PING, SETTINGS, PRIORITY, empty DATA,
  unknown types) spend a budget that refills with time; overspent, the connection
  ends. jh2 bounds a header block to 64 CONTINUATION frames, and the decoded list to
  ``maxHeaderBytes``, as HTTP/1.1 heads are.
- **flow control**: a stream's request body is credited back to the client only while
  its consumer keeps up; the connection's own window covers every stream's, so one
  stalled upload never blocks the others. Response DATA waits for the client's window
  and for the TLS connection to drain, and a stream whose answer waits pushes back on
  its own upstream alone (``pause_writing`` of its connection).
- **endings**: idle and first-request deadlines as on HTTP/1.1 (``GOAWAY`` then close);
  ``GOAWAY`` on shutdown (``close_if_idle``), the open streams finishing first; after
  an unauthenticated request's answer (no verified certificate and no
  ``Authorization``, or a 401), as kube-apiserver's ``UnauthenticatedHTTP2DOSMitigation``;
  and at random with ``goawayChance``, so long-lived clients spread over mvproxies.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

import httptools
from jh2.config import H2Configuration
from jh2.connection import H2Connection
from jh2.errors import ErrorCodes
from jh2.events import (
    DataReceived,
    PingReceived,
    PriorityUpdated,
    RemoteSettingsChanged,
    RequestReceived,
    SettingsAcknowledged,
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
from mvproxy.identity import Kind
from mvproxy.kubestatus import status_bytes
from mvproxy.listener import DownstreamConnection, Listener
from mvproxy.logs import V, kv

log = logging.getLogger(__name__)

STREAM_WINDOW = 65_535
"""The window each stream's request body gets (HTTP/2's default): what one stalled
upload holds at most, besides what its consumer buffered (``BODY_HIGH_WATER``)."""
OUTBOUND_LIMIT = 1 << 20
"""Bytes mvproxy's writes to one client may queue unread. DATA waits for the TLS
connection to drain, so only what jh2 answers on its own piles up (``RST_STREAM`` for
each frame on a closed stream, which reaches no event and no budget): a client that
keeps sending those and reads nothing would grow the buffer without bound."""
REFUSED_LIMIT = 2
"""Streams refused at the concurrency limit, or reset by the client before their answer
ended (a budget that refills by the limit per second), as a multiple of that limit,
before the connection ends with ``ENHANCE_YOUR_CALM``: a client that ignores the
limit, or resets its streams to open more (CVE-2023-44487), is not honest."""
_AUTHORITY = re.compile(rb"[A-Za-z0-9\-._~!$&'()*+,;=:@\[\]%]*\Z")
_DROPPED_OUT = frozenset((b"connection", b"keep-alive", b"proxy-connection",
                          b"transfer-encoding", b"upgrade"))
"""HTTP/1.1 response fields HTTP/2 forbids (RFC 9113 §8.2.2): the HTTP/1.1 framing of
the stream's own answer, never the upstream's (forwarding dropped those already)."""


@dataclass(frozen=True)
class Http2Settings:
    """``listener`` keys for HTTP/2 (``config.ListenerConfig``)."""

    max_concurrent_streams: int = 100
    goaway_chance: float = 0.0


class Http2Stats:
    """Counts for metrics and the status page, read at scrape time."""

    def __init__(self) -> None:
        self.sessions = 0
        self.streams = 0
        self.defences: dict[str, int] = {}
        """Streams refused and connections ended for what their client did, by reason."""
        self.goaways: dict[str, int] = {}
        """Connections ended after an answer, by reason (unauthenticated, goaway_chance)."""

    def defended(self, reason: str) -> None:
        self.defences[reason] = self.defences.get(reason, 0) + 1


def open_session(conn: DownstreamConnection, streams: Listener, settings: Http2Settings,
                 stats: Http2Stats) -> Session:
    """The session of a TLS connection whose client chose ``h2``."""
    return Session(conn, streams, settings, stats)


class Session:
    """One HTTP/2 connection: its frames, its streams, its defences."""

    def __init__(self, conn: DownstreamConnection, streams: Listener, settings: Http2Settings,
                 stats: Http2Stats):
        self.conn = conn
        self.streams_listener = streams
        self.settings = settings
        self.stats = stats
        self.loop = conn.loop
        limits = streams.limits
        self.h2 = H2Connection(H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=True,
            normalize_inbound_headers=True, validate_outbound_headers=False,
            normalize_outbound_headers=False))
        # Replaced, not updated: ``initiate_connection`` advertises the current values,
        # and jh2 would apply updated ones only once the client acknowledged SETTINGS
        # it never saw (its default 100 streams and 6 MB stream windows).
        self.h2.local_settings = Settings(client=False, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: settings.max_concurrent_streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_bytes,
            SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            SettingCodes.ENABLE_PUSH: 0,
        })
        # jh2 applies its settings once the client acknowledges them; the decoder's
        # own bound is set now, and above the advertised one: a head between the two is
        # decoded, and the stream's connection answers it 431 as an HTTP/1.1 head is.
        self.h2.decoder.max_header_list_size = 2 * limits.max_header_bytes
        self.streams: dict[int, StreamTransport] = {}
        self.working: list[StreamTransport] = []
        """Streams whose handler has not ended, reset or not: what the limit counts."""
        self.refused = 0
        limit = settings.max_concurrent_streams
        self.resets = Budget(REFUSED_LIMIT * limit, limit, self.loop.time())
        self.budget = Budget(CONTROL_BUDGET, CONTROL_REFILL, self.loop.time())
        self.goaway_sent = False
        self.closed = False
        self.splitter = GoawaySplitter(preface=True)
        self._flushing_waiter = False
        stats.sessions += 1
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(
            settings.max_concurrent_streams * STREAM_WINDOW - 65_535)
        self.flush()
        conn.deadline = self.loop.time() + limits.header_read_timeout

    # ---------------------------------------------------------------- frames in

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            data = self.splitter.feed(data)
            events = self.h2.receive_data(data) if data else []
        except GoawayError as exc:
            self._defend("protocol_error", str(exc), ErrorCodes.PROTOCOL_ERROR)
            return
        except ProtocolError as exc:  # jh2 queued the GOAWAY already
            self._defend("protocol_error", str(exc)[:120])
            return
        for event in events:
            if self.closed:
                return
            kind = type(event)
            if kind is DataReceived:
                stream = self.streams.get(event.stream_id)
                if not event.data and not event.stream_ended and not self._spend():
                    return
                if stream is not None:
                    stream.body(event.data, event.flow_controlled_length)
                else:
                    self.h2.acknowledge_received_data(event.flow_controlled_length,
                                                      event.stream_id)
                if event.stream_ended and stream is not None:
                    stream.body_end()
            elif kind is RequestReceived:
                self._open(event.stream_id, event.headers, event.stream_ended is not None)
            elif kind is StreamEnded:
                stream = self.streams.get(event.stream_id)
                if stream is not None and not stream.body_ended:
                    stream.body_end()
            elif kind is TrailersReceived:
                stream = self.streams.get(event.stream_id)  # not forwarded, as on HTTP/1.1
                if stream is not None and event.stream_ended is not None:
                    stream.body_end()
            elif kind is StreamReset:
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.client_left()
                    if event.remote_reset and not self._reset_allowed():
                        return
            elif kind is WindowUpdated:
                self._send_waiting(event.stream_id)
            elif kind is RemoteSettingsChanged:
                if not self._spend():
                    return
                self._send_waiting(0)
            elif kind in (PingReceived, PriorityUpdated, SettingsAcknowledged,
                          UnknownFrameReceived):
                if not self._spend():
                    return
        if self.splitter.received:  # the client leaves: the streams it opened finish
            self.splitter.received.clear()  # (those of this read too, taken above)
            if not self._spend():
                return
            self.goaway_sent = True  # nothing new is taken; closed once they did
            self.loop.call_soon(self._close_when_done)
        self.flush()
        transport = self.conn.transport
        if transport is not None and not transport.is_closing() \
                and transport.get_write_buffer_size() > OUTBOUND_LIMIT:
            self.stats.defended("flood")
            log.log(V(2), "HTTP/2 connection ended", extra=kv(
                reason="flood", detail="the client reads nothing of what it makes mvproxy send",
                client=self.conn.client_address))
            self.goaway_sent = True
            self.conn.abort()  # closing would wait for the client to read it all

    def _spend(self) -> bool:
        """One frame that makes no request; False (and the connection ending) once the
        budget is spent."""
        if self.budget.spend(self.loop.time()):
            return True
        self._defend("flood", "too many frames that make no request",
                     ErrorCodes.ENHANCE_YOUR_CALM)
        return False

    def _reset_allowed(self) -> bool:
        """The client reset a stream before its answer ended. That ends its request at
        once, so the concurrency limit alone would let a client open and reset streams
        as fast as it writes (CVE-2023-44487): resets spend a budget of
        ``REFUSED_LIMIT`` times the limit that refills by the limit per second."""
        if self.resets.spend(self.loop.time()):
            return True
        self._defend("rapid_reset", "streams reset before their answer ended",
                     ErrorCodes.ENHANCE_YOUR_CALM)
        return False

    def _defend(self, reason: str, detail: str,
                code: int | None = None) -> None:
        """End the connection for what its client did: counted, logged at V(2)."""
        self.stats.defended(reason)
        log.log(V(2), "HTTP/2 connection ended", extra=kv(
            reason=reason, detail=detail, client=self.conn.client_address))
        if code is not None:
            self._goaway(code)
        self.goaway_sent = True
        self.flush()
        self.conn.close()

    # ---------------------------------------------------------------- streams

    def _open(self, stream_id: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        conn = self.conn
        conn.deadline = 0.0
        if self.goaway_sent or conn.closing:
            self.h2.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
            return
        if len(self.working) >= self.settings.max_concurrent_streams:
            self.working = [s for s in self.working if s.working]
        if len(self.working) >= self.settings.max_concurrent_streams:
            self.refused += 1
            self.stats.defended("refused_stream")
            self.h2.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
            if self.refused > REFUSED_LIMIT * self.settings.max_concurrent_streams:
                self._defend("rapid_reset", "streams opened past the concurrency limit",
                             ErrorCodes.ENHANCE_YOUR_CALM)
            return
        streams = self.streams_listener
        if len(streams.connections) + conn.listener.open_connections \
                >= streams.limits.max_connections:
            # Each request may hold an upstream connection, as each HTTP/1.1 client
            # connection may: maxConnections bounds them all, whatever the protocol.
            self.stats.defended("stream_limit")
            self.h2.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
            return
        head, problem, method, has_auth = request_head(headers, ended)
        stream = StreamTransport(self, stream_id, method == b"HEAD")
        self.streams[stream_id] = stream
        self.working.append(stream)
        if problem:
            stream.refuse(400, problem)
            return
        if method == b"CONNECT":
            stream.refuse(405, "CONNECT is not served")
            return
        if not has_auth and conn.downstream.kind not in (Kind.USER, Kind.PEER):
            stream.last = "unauthenticated"  # the connection ends after its answer
        elif self.settings.goaway_chance and random.random() < self.settings.goaway_chance:
            stream.last = "goaway_chance"
        stream.start(head)
        if ended:
            stream.body_end()

    def forget(self, stream: StreamTransport) -> None:
        """``stream`` is over on the wire (ended, reset or refused)."""
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]
        if stream.unacknowledged and not self.closed:
            # Body bytes held while its consumer stalled: they count against the
            # connection's window too, and the stream will never credit them.
            try:
                self.h2.acknowledge_received_data(stream.unacknowledged, stream.stream_id)
            except ProtocolError:
                pass
            stream.unacknowledged = 0
            self.flush()
        if stream.last and not self.goaway_sent:
            self.stats.goaways[stream.last] = self.stats.goaways.get(stream.last, 0) + 1
            self._goaway(ErrorCodes.NO_ERROR)
        self._close_when_done()

    def _close_when_done(self) -> None:
        if self.streams:
            return
        if self.goaway_sent or self.conn.closing:
            self.flush()
            self.conn.close()
        elif not self.closed:
            self.conn.deadline = self.loop.time() + self.streams_listener.limits.idle_timeout

    # ---------------------------------------------------------------- frames out

    def _goaway(self, code: int) -> None:
        """``GOAWAY`` that lets the open streams finish: no stream after the last one
        taken is served (``_open`` refuses it). Written beside jh2 (``h2frames``): its
        ``close_connection`` closes its state machine, so no answer could be sent after
        it, and any frame the client sent meanwhile would be a protocol error."""
        self.goaway_sent = True
        self.flush()
        self.conn.write(goaway_frame(self.h2.highest_inbound_stream_id, code))

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.conn.write(data)

    def can_send(self) -> bool:
        """Whether DATA may go to the TLS connection now; else once it drained."""
        if not self.conn.paused_writing:
            return True
        if not self._flushing_waiter:
            self._flushing_waiter = True
            self.conn.when_writable(self._writable)
        return False

    def _writable(self) -> None:
        self._flushing_waiter = False
        if not self.closed:
            self._send_waiting(0)
            self.flush()

    def _send_waiting(self, stream_id: int) -> None:
        if stream_id:
            stream = self.streams.get(stream_id)
            if stream is not None:
                stream.send()
            return
        for stream in list(self.streams.values()):
            if not self.can_send():
                return
            stream.send()

    # ---------------------------------------------------------------- the connection

    def expired(self, now: float) -> None:
        """The first request, or the next one on an idle connection, did not come."""
        if not self.streams and not self.closed:
            log.log(V(4), "HTTP/2 connection idle: closing", extra=kv(
                client=self.conn.client_address))
            if not self.goaway_sent:
                self.goaway_sent = True
                self._goaway(ErrorCodes.NO_ERROR)
            self.flush()
            self.conn.close()

    def close_if_idle(self) -> bool:
        """Shutdown: ``GOAWAY``, the open streams finish, then the connection closes."""
        if not self.goaway_sent and not self.closed:
            self._goaway(ErrorCodes.NO_ERROR)
        if not self.streams:
            self.conn.close()
            return True
        return False

    def connection_lost(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.stats.sessions -= 1
        for stream in list(self.streams.values()):
            stream.client_left()
        self.streams.clear()


class StreamTransport(asyncio.Transport):
    """The transport of one stream's ``DownstreamConnection``: what that connection
    writes (an HTTP/1.1 answer) goes out as the stream's HEADERS and DATA."""

    def __init__(self, session: Session, stream_id: int, head_request: bool):
        super().__init__()
        self.session = session
        self.stream_id = stream_id
        self.head_request = head_request
        self.conn: DownstreamConnection | None = None
        self.chunked = False
        self.body_ended = False
        self.last = ""
        """Why the connection ends after this stream's answer (``GOAWAY``), if it does."""
        self.reading = True
        self.unacknowledged = 0
        self.pending: deque[bytes] = deque()
        self.pending_size = 0
        self.high, self.low = 4096, 1024
        self.ended = False
        """The stream is over on the wire (ended or reset): nothing more is sent."""
        self.closing = False
        self.end_due = False
        self.trailers: list[tuple[bytes, bytes]] = []
        self.fields: list[tuple[bytes, bytes]] = []
        self.headers_sent = False
        self.in_trailers = False
        self.complete = False
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        session.stats.streams += 1

    @property
    def working(self) -> bool:
        """Whether the stream's handler is still running (it counts against the limit)."""
        return self.conn is not None and (self.conn.busy or not self.conn.closing)

    # ---------------------------------------------------------------- request in

    def start(self, head: bytes) -> None:
        session = self.session
        conn = DownstreamConnection(session.streams_listener)
        self.conn = conn
        self.chunked = b"\r\nTransfer-Encoding: chunked\r\n" in head
        conn.connection_made(self)
        conn.downstream = session.conn.downstream
        conn.data_received(head)

    def body(self, data: bytes, flow: int) -> None:
        if self.reading:
            self.session.h2.acknowledge_received_data(flow, self.stream_id)
        else:
            self.unacknowledged += flow
        if data and self.conn is not None and not self.ended:
            self.conn.data_received(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked
                                    else data)

    def body_end(self) -> None:
        self.body_ended = True
        if self.chunked and self.conn is not None and not self.ended:
            self.conn.data_received(b"0\r\n\r\n")

    def client_left(self) -> None:
        """The client reset the stream (or the connection ended): its request ends."""
        self.ended = True
        self.pending.clear()
        self.pending_size = 0
        conn = self.conn
        self._finish()
        if conn is not None and conn.transport is not None:
            conn.connection_lost(None)

    def refuse(self, status: int, message: str) -> None:
        """Answer ``status`` at once: the request never reached the engine."""
        self.session.stats.defended("malformed" if status == 400 else "not_served")
        body = status_bytes(status, message)
        self.session.h2.send_headers(self.stream_id, [
            (b":status", str(status).encode()), (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())])
        self.pending.append(body)
        self.pending_size = len(body)
        self.end_due = True
        self.headers_sent = True
        self.send()

    # ---------------------------------------------------------------- answer out (llhttp)

    def on_header(self, name: bytes, value: bytes) -> None:
        (self.trailers if self.in_trailers else self.fields).append((name.lower(), value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        assert parser is not None
        status = parser.get_status_code()
        fields = [(b":status", str(status).encode())]
        fields += [(n, v) for n, v in self.fields if n not in _DROPPED_OUT]
        self.fields = []
        h2 = self.session.h2
        if status < 200:
            h2.send_headers(self.stream_id, fields)
            return
        bodiless = self.head_request or status in (204, 304)
        h2.send_headers(self.stream_id, fields, end_stream=bodiless)
        self.headers_sent = True
        self.in_trailers = True
        if status == 401:
            self.last = "unauthenticated"  # its credential failed: as kube-apiserver does
        if bodiless:
            self._done_on_wire()

    def on_body(self, body: bytes) -> None:
        if not self.ended:
            self.pending.append(body)
            self.pending_size += len(body)

    def on_message_complete(self) -> None:
        if self.headers_sent and not self.ended:
            self.complete = True
            self.end_due = True

    # ---------------------------------------------------------------- asyncio.Transport

    def write(self, data: bytes) -> None:  # type: ignore[override]
        if self.ended or self.parser is None:
            return
        try:
            self.parser.feed_data(data)
            self.send()
            self.session.flush()  # a head alone (a quiet watch's) goes out now too
        except (httptools.HttpParserError, ProtocolError) as exc:
            if isinstance(exc, ProtocolError) or isinstance(exc.__context__, ProtocolError):
                self.ended = True  # the client closed the stream meanwhile
                self._finish()
                return
            # Only a bug writes what llhttp cannot read: the stream ends badly, the
            # rest of the connection carries on.
            log.log(V(1), "HTTP/2 stream answer unreadable", exc_info=True)
            self.abort()

    def send(self) -> None:
        """Send what the client's window and the TLS connection take now."""
        if self.ended:
            return
        session = self.session
        h2 = session.h2
        while self.pending and session.can_send():
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
            session.flush()
        if not self.pending and self.end_due:
            if self.trailers:
                h2.send_headers(self.stream_id, self.trailers, end_stream=True)
            else:
                h2.end_stream(self.stream_id)
            self._done_on_wire()
            return
        conn = self.conn
        if conn is not None:
            if self.pending_size > self.high and not conn.paused_writing:
                conn.pause_writing()
            elif self.pending_size <= self.low and conn.paused_writing:
                conn.resume_writing()

    def _done_on_wire(self) -> None:
        self.ended = True
        self.parser = None
        self.session.flush()
        if self.closing:
            self._finish()

    def _finish(self) -> None:
        self.parser = None
        self.session.forget(self)

    def close(self) -> None:
        """The stream's connection ends: after its answer, or the answer was cut."""
        if self.closing:
            return
        self.closing = True
        if self.ended:
            self._finish()
        elif not self.end_due:  # ``_done_on_wire`` finishes a whole answer still queued
            self._reset(ErrorCodes.INTERNAL_ERROR)
        self._lost_soon()

    def abort(self) -> None:
        """The answer is cut. A watch cut between two events ends its stream as
        kube-apiserver ends a watch, so client-go watches again as it does when an
        HTTP/1.1 watch breaks (an early EOF is an end to it, a reset an error); the rest
        is reset, so no client takes a cut answer for a whole one."""
        self.closing = True
        conn = self.conn
        if not self.ended and self.headers_sent and conn is not None \
                and conn.watch_between_events():
            self.end_due = True
            self.send()
        elif not self.ended:
            self._reset(ErrorCodes.INTERNAL_ERROR)
        self._lost_soon()

    def _reset(self, code: int) -> None:
        self.ended = True
        self.pending.clear()
        self.pending_size = 0
        if not self.session.closed:
            try:
                self.session.h2.reset_stream(self.stream_id, code)
            except ProtocolError:
                pass  # the client closed it already
            self.session.flush()
        self._finish()

    def _lost_soon(self) -> None:
        conn = self.conn
        if conn is not None and conn.transport is not None:
            self.session.loop.call_soon(_lost, conn)

    def is_closing(self) -> bool:
        return self.closing or self.ended

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True
        if self.unacknowledged and not self.ended and not self.session.closed:
            self.session.h2.acknowledge_received_data(self.unacknowledged, self.stream_id)
            self.unacknowledged = 0
            self.session.flush()

    def is_reading(self) -> bool:
        return self.reading

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.high = 4096 if high is None else high
        self.low = self.high // 4 if low is None else low

    def get_write_buffer_size(self) -> int:
        return self.pending_size + (1 if self.session.conn.paused_writing else 0)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return None  # the identity is the TLS connection's, set by ``start``
        transport = self.session.conn.transport
        return default if transport is None else transport.get_extra_info(name, default)


def _lost(conn: DownstreamConnection) -> None:
    if conn.transport is not None:
        conn.connection_lost(None)


def request_head(headers: list[tuple[bytes, bytes]],
                 ended: bool) -> tuple[bytes, str, bytes, bool]:
    """A stream's head as an HTTP/1.1 request head (``Connection: close``: one request
    per stream connection), or why it cannot be one; with its method and whether it
    carries ``Authorization``. jh2 validated the pseudo-fields' presence and order and
    refused connection-specific fields; this refuses anything HTTP/1.1 could read
    differently."""
    method = path = authority = b""
    lines: list[bytes] = []
    cookies: list[bytes] = []
    length = b""
    has_auth = False
    for name, value in headers:
        if BAD_VALUE.search(value):
            return b"", "a header value holds CR, LF or NUL", method, has_auth
        if name[:1] == b":":
            if name == b":method":
                method = value
            elif name == b":path":
                path = value
            elif name == b":authority":
                authority = value
            continue
        if not TOKEN.match(name):
            return b"", "a header name is not a lowercase token", method, has_auth
        if name == b"cookie":
            cookies.append(value)
            continue
        if name == b"content-length":
            if length and value != length:  # jh2 holds DATA to the first one
                return b"", "two different content-lengths", method, has_auth
            length = value
            continue
        if name == b"host":
            if not authority:
                authority = value
            continue
        if name == b"authorization":
            has_auth = True
        lines.append(name + b": " + value + b"\r\n")
    if method == b"CONNECT":
        return b"", "", method, has_auth
    if not TOKEN.match(method.lower()):
        return b"", "the method is not a token", method, has_auth
    if not path.startswith(b"/") or b" " in path or b"#" in path:
        return b"", ":path must be an origin-form path (/...)", method, has_auth
    if not _AUTHORITY.match(authority):
        return b"", ":authority is not a host and port", method, has_auth
    if length and (not length.isdigit() or len(length) > 18):
        return b"", "content-length is not a number", method, has_auth
    if cookies:
        lines.append(b"cookie: " + b"; ".join(cookies) + b"\r\n")
    if length:
        lines.append(b"Content-Length: " + length + b"\r\n")
    elif not ended:
        lines.append(b"Transfer-Encoding: chunked\r\n")
    head = b"".join((method, b" ", path, b" HTTP/1.1\r\nHost: ", authority, b"\r\n",
                     *lines, b"Connection: close\r\n\r\n"))
    return head, "", method, has_auth

