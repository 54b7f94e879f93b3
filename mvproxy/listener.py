"""The main listener: TLS connections from downstreams, parsed with llhttp (httptools).

What this module owns, and nothing above it does:

- **accepting** on its own socket, up to ``maxConnections`` at once and
  ``maxPendingHandshakes`` TLS handshakes in progress; at either limit, or
  when the process is out of file descriptors, it stops accepting (the kernel's backlog
  holds new clients) and resumes when a connection ends or after a back-off, logging
  once per episode, so descriptors stay free for discovery polls and upstreams;
- **limits** like kube-apiserver's: the TLS handshake and the request head must arrive
  within ``headerReadTimeout``, an idle keep-alive connection is closed after
  ``idleTimeout``, a head larger than ``maxHeaderBytes`` gets 431. Deadlines are plain
  numbers checked by one sweep per listener, not a timer object per request;
- **state**: what a connection's next bytes are is one ``State`` (idle, head,
  body, last, upgrading, tunnel, refused, closing, closed), changed only along
  ``TRANSITIONS`` (``tests/test_listener.py`` drives them byte by byte);
- **parsing** each request into an ``Exchange`` (plain values: method, raw target,
  decoded path, query, header fields, the connection's verified identity) and running
  the handler for it; requests pipelined behind it wait their turn. A request is
  dispatched only once llhttp has parsed everything read so far, so its verdict on a
  read comes before anything from that read goes upstream. A request that is the
  connection's last (``Connection: close``, HTTP/1.0 without keep-alive) is answered,
  then the connection closes; what the client sent after it is ignored, neither
  parsed nor refused (RFC 9112 §9.6);
- **truthful answers**: once a request has gone upstream, the client gets its real
  answer. A refusal of what the client sent after it (unparseable bytes, a pipelined
  head too large, too slow or not served, too many pipelined) ends parsing (what
  follows is read and discarded, so a client that leaves is still noticed): that
  request finishes, its answer says ``Connection: close``, then the connection
  closes; requests queued behind it were never sent and are dropped. Only a refusal
  of the active request's own body (its chunk framing, a body byte that did not come)
  abandons it upstream and is answered instead, if no response started. With no
  request upstream the refusal itself is the answer;
- **flow control**: request bodies are handed on as they arrive and reading pauses
  while the consumer is behind; responses are written as given, and the writer learns
  when the client stops reading (``paused_writing``);
- **framing** answers: ``respond`` for a whole answer in one write, ``start``/``write``/
  ``end`` for a streamed one (chunked, or close-delimited for HTTP/1.0), ``take_over``
  for a protocol switch (the connection's bytes then go to a tunnel untouched); an
  HTTP/1.0 client whose connection stays open is told ``Connection: keep-alive``.

An exception from a handler becomes a 500 ``Status`` here if nothing was sent yet,
else the connection is closed (the client sees a truncated response, never a lie).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any, Protocol, cast
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from mvproxy import wire
from mvproxy.flow import NOTSENT_LOWAT, FlowControl, accept_tls, limit_buffers
from mvproxy.identity import Downstream
from mvproxy.kubestatus import status_bytes
from mvproxy.logs import V, kv, throttled
from mvproxy.requestcheck import Refusal, check_request
from mvproxy.tls import SwappableContext, current_context

log = logging.getLogger(__name__)

BODY_HIGH_WATER = 256 * 1024
"""Request-body bytes held for a consumer before reading from the client pauses."""
PIPELINE_PAUSE = 2
"""Requests parsed ahead of the one being answered before reading pauses."""
MAX_PIPELINED = 32
"""More than this parsed ahead (one read can hold thousands of tiny requests, and llhttp
parses all it is given; the requests of one read all wait for its verdict, so they
count too): the connection ends, after the answer of the request already upstream if
there is one, else with a 400."""
_FRAMING_RAW = frozenset((b"content-length", b"transfer-encoding"))
_FRAMING_LENGTHS = frozenset(len(name) for name in _FRAMING_RAW)
MAX_HEADER_FIELDS = 1000
"""Header fields per request head (each costs Python objects far beyond its bytes)."""
_ACCEPT_BATCH = 32
TRIM_DELAY = 2.0
"""Seconds after a large drop in connections before freed memory is returned."""
STARVED_LOG_INTERVAL = 60.0
"""Seconds between two "not accepting new connections" warnings."""
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True)
class Limits:
    """Per-listener resource limits (``listener`` in the configuration)."""

    header_read_timeout: float = 32.0
    """Seconds for the TLS handshake, and for a request head once its first byte came."""
    idle_timeout: float = 90.0
    """Seconds a keep-alive connection may wait for its next request."""
    max_header_bytes: int = 1 << 20
    """Largest request line plus header fields (431 beyond)."""
    max_connections: int = 10_000
    """Connections open at once; beyond it new clients wait in the kernel's backlog."""
    max_pending_handshakes: int = 256
    """TLS handshakes in progress at once; beyond, new clients wait in the backlog too
    (a stalled handshake holds its ClientHello, up to ~100 KiB, for headerReadTimeout)."""


class Multiplexed(Protocol):
    """What a connection whose client chose ``h2`` hands its bytes and its ending to
    (``http2.Session``): the streams are requests of their own, on ``Listener.streams``."""

    def data_received(self, data: bytes) -> None: ...
    def expired(self, now: float) -> None: ...
    def close_if_idle(self) -> bool: ...
    def connection_lost(self) -> None: ...


Handler = Callable[["Exchange", "DownstreamConnection"], None]
"""The one entry point for each request: it answers ``exchange`` on the connection it
is given, by callbacks or in a task of its own (``run_in_task``), and calls
``DownstreamConnection.finish`` once when the request is over; while it runs,
``exchange.cancel_hook`` ends it (the client left, shutdown)."""


def run_in_task(exchange: Exchange, conn: DownstreamConnection,
                coro: Coroutine[Any, Any, None]) -> asyncio.Task:
    """Answer ``exchange`` in a task running ``coro`` (discovery, OpenAPI, status
    pages): cancelled by ``cancel_hook``, finished when it ends; an exception becomes
    a 500 (or a closed connection once the answer started)."""
    task = conn.loop.create_task(coro)

    def cancel() -> None:
        task.cancel()
    exchange.cancel_hook = cancel

    def ended(task: asyncio.Task) -> None:
        cancelled = task.cancelled()
        conn.finish(exchange, cancelled=cancelled,
                    failure=None if cancelled else task.exception())
    task.add_done_callback(ended)
    return task


class State(Enum):
    """What the next bytes from a downstream connection are (its read side); answers
    go out in request order whatever the state (``_next``). ``TRANSITIONS`` lists
    every change a connection may make."""

    IDLE = "idle"
    """Between requests (or before the first): the next byte starts a request head."""
    HEAD = "head"
    """A request head is arriving; its bytes are counted against ``maxHeaderBytes``."""
    BODY = "body"
    """A request head ended: its body, if any, is arriving."""
    LAST = "last"
    """The connection's last request ended (``Connection: close``, or HTTP/1.0 without
    keep-alive): it is answered, then the connection closes; later bytes are read and
    discarded, not parsed (RFC 9112 §9.6: ignored, never an error instead of it)."""
    UPGRADING = "upgrading"
    """An upgrade request's head ended: later bytes are held, unparsed, for a tunnel."""
    TUNNEL = "tunnel"
    """A ``101`` went out: every byte goes to the tunnel (``take_over``)."""
    REFUSED = "refused"
    """A refusal ended parsing: later bytes are read and discarded (``_refuse``)."""
    CLOSING = "closing"
    """``close``/``abort`` was called: later bytes are discarded."""
    CLOSED = "closed"
    """The transport is gone."""


# Enum members as module names: a member read through its class costs ~0.3 µs here.
_IDLE, _HEAD, _BODY, _UPGRADING = State.IDLE, State.HEAD, State.BODY, State.UPGRADING
_LAST = State.LAST
_TUNNEL, _REFUSED, _CLOSING, _CLOSED = State.TUNNEL, State.REFUSED, State.CLOSING, State.CLOSED
_ENDING = frozenset((State.CLOSING, State.CLOSED))
TRANSITIONS: dict[State, frozenset[State]] = {
    State.IDLE: frozenset((State.HEAD, State.REFUSED)) | _ENDING,
    State.HEAD: frozenset((State.BODY, State.REFUSED)) | _ENDING,
    State.BODY: frozenset((State.IDLE, State.LAST, State.UPGRADING, State.REFUSED)) | _ENDING,
    State.LAST: frozenset((State.REFUSED,)) | _ENDING,  # refused: its body's end failed
    State.UPGRADING: frozenset((State.TUNNEL, State.REFUSED)) | _ENDING,
    State.TUNNEL: _ENDING,
    State.REFUSED: _ENDING,
    State.CLOSING: frozenset((State.CLOSED,)),
    State.CLOSED: frozenset(),
}
"""The state changes a downstream connection makes; anything else is a bug."""


class Deadline(StrEnum):
    """What a connection's one deadline waits for (``DownstreamConnection.deadline``)."""

    HEAD = "head"
    """A request head (``headerReadTimeout``, from its first byte; the TLS handshake too)."""
    BODY = "body"
    """The next byte of a request body (``headerReadTimeout``)."""
    IDLE = "idle"
    """The next request on a keep-alive connection (``idleTimeout``)."""


_DUE_HEAD, _DUE_BODY, _DUE_IDLE = Deadline.HEAD, Deadline.BODY, Deadline.IDLE


class _Ended(Exception):
    """Raised in a parser callback to stop parsing a connection that is closing."""


class BadRequest(Exception):
    """The request cannot be parsed or is not served: answered, then the connection ends."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


# --------------------------------------------------------------------------- exchange


class Exchange:
    """One request on a downstream connection, and the way to answer it."""

    __slots__ = (
        "_body_done",
        "_buffered",
        "_chunks",
        "_close_after",
        "_consumed",
        "_copy",
        "_copy_limit",
        "_copy_size",
        "_early",
        "_head_pending",
        "_headers",
        "_sink",
        "_started_at",
        "cancel_hook",
        "body_length",
        "chunked",
        "chunked_out",
        "conn",
        "line_ended",
        "watch",
        "raw",
        "raw_method",
        "raw_target",
        "_fields",
        "finished",
        "keep_alive",
        "method",
        "path",
        "query",
        "started",
        "status",
        "target",
        "upgrade",
        "version",
    )

    def __init__(self, conn: DownstreamConnection, method: str, target: str,
                 version: tuple[int, int], raw: wire.RawFields, keep_alive: bool,
                 upgrade: bool):
        self.conn = conn
        self.method = method
        self.target = target
        raw_path, _, self.query = target.partition("?")
        self.path = unquote(raw_path) if "%" in raw_path else raw_path
        self.version = version
        self.raw = raw
        """Header fields as llhttp gave them (bytes: the hot path never decodes them)."""
        self.raw_method = method.encode("latin-1")
        self.raw_target = target.encode("latin-1")
        self._fields: wire.Fields | None = None
        self.keep_alive = keep_alive
        self.upgrade = upgrade
        self.body_length: int | None = None
        self.chunked = False
        self._headers: CIMultiDictProxy[str] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._sink: Callable[[bytes], None] | None = None
        self._body_done = True
        self._copy: list[bytes] | None = None
        self._copy_size = 0
        self._copy_limit = 0
        self._consumed = False
        self.started = False
        """The response head went out: nothing else can be said about this request."""
        self.finished = False
        self.status = 0
        self.chunked_out = False
        self.line_ended = True
        """Whether the body so far ends a line: a JSON watch is between events."""
        self.watch = False
        """Set by the handler for a watch: shutdown may end it cleanly between events."""
        self._head_pending = b""
        self._close_after = upgrade
        """Set for upgrade requests: unless the connection is taken over, the bytes
        after their head cannot be read as HTTP."""
        self._early: bytearray | None = None
        self._started_at = time.monotonic()
        self.cancel_hook: Callable[[], None] | None = None
        """Set by the handler while it runs: ends the request (the client left, shutdown)."""

    # ---------------------------------------------------------------- request side

    @property
    def fields(self) -> wire.Fields:
        """The header fields as text (decoded on first use)."""
        if self._fields is None:
            self._fields = wire.decoded(self.raw)
        return self._fields

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The fields as a case-insensitive multidict (built on first use)."""
        if self._headers is None:
            self._headers = CIMultiDictProxy(CIMultiDict(self.fields))
        return self._headers

    @property
    def downstream(self) -> Downstream:
        return self.conn.downstream

    @property
    def client_address(self) -> str:
        return self.conn.client_address

    @property
    def connection_id(self) -> int:
        return self.conn.id

    @property
    def has_body(self) -> bool:
        return self.chunked or bool(self.body_length)

    @property
    def body_complete(self) -> bool:
        return self._body_done and not self._chunks

    @property
    def body_started(self) -> bool:
        """Whether any body byte has been handed to a consumer (it is gone then,
        unless ``keep_body_copy`` kept it)."""
        return self._consumed

    def keep_body_copy(self, limit: int) -> None:
        """Remember the body (up to ``limit`` bytes) so it can be sent again."""
        if self._copy is None and not self._consumed:
            self._copy, self._copy_size, self._copy_limit = [], 0, limit

    def replayable(self) -> bool:
        """Whether the whole body so far is in the copy (so it can be sent again)."""
        return self._copy is not None or not self._consumed

    def attach_body(self, sink: Callable[[bytes], None]) -> None:
        """Stream the body into ``sink`` from the start (again, after ``detach_body``,
        if a copy was kept); ``sink(b"")`` marks its end."""
        self._sink = sink
        if self._copy is not None and self._consumed:
            for piece in self._copy:
                sink(piece)
        self._drain_into_sink()

    def detach_body(self) -> None:
        self._sink = None

    def _drain_into_sink(self) -> None:
        while self._chunks and self._sink is not None:
            self._pass(self._chunks.popleft())
        self._buffered = 0
        self.conn.resume_reading("body")
        if self._body_done and self._sink is not None:
            self._sink(b"")

    def _pass(self, data: bytes) -> None:
        self._consumed = True
        if self._copy is not None:
            self._copy_size += len(data)
            if self._copy_size > self._copy_limit:
                self._copy = None
            else:
                self._copy.append(data)
        assert self._sink is not None
        self._sink(data)

    def _body(self, data: bytes) -> None:
        if self._sink is not None and not self._chunks:
            self._pass(data)
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > BODY_HIGH_WATER:
            self.conn.pause_reading("body")

    def _body_end(self) -> None:
        self._body_done = True
        if self._sink is not None and not self._chunks:
            self._sink(b"")

    # ---------------------------------------------------------------- response side

    def respond(self, status: int, fields: wire.Fields, body: bytes = b"",
                reason: str = "") -> None:
        """The whole answer, in one write."""
        framing = [] if status in (204, 304) or 100 <= status < 200 else [
            ("Content-Length", str(len(body)))]
        self.start(status, fields + framing, reason=reason, hold=True)
        with_body = self.method != "HEAD" and status not in (204, 304)
        self.conn.write(self._head_pending + body if with_body else self._head_pending)
        self._head_pending = b""
        self._end_response()

    def start(self, status: int, fields: wire.Fields, *, reason: str = "",
              hold: bool = False) -> None:
        """The response head. ``fields`` must frame the body (``Content-Length``, or
        ``Transfer-Encoding: chunked`` which is replaced by close-delimiting for
        HTTP/1.0 clients). ``Connection: close`` when the connection ends after it (also
        when the request's body is not all read yet: what follows it cannot be parsed
        as the next request), else ``Connection: keep-alive`` for HTTP/1.0 (whose
        default is to close).
        ``hold`` keeps the head for the first write."""
        if self.started:
            raise RuntimeError("response already started")
        names = {name.lower() for name, _ in fields}
        if "transfer-encoding" in names:
            if self.version < (1, 1):
                fields = [(n, v) for n, v in fields if n.lower() != "transfer-encoding"]
                self._close_after = True
            else:
                self.chunked_out = True
        if self._close_after or not self.keep_alive or self.conn.closing \
                or not self._body_done or self._chunks:  # its body not all read: no next
            fields = [*fields, ("Connection", "close")]
            self._close_after = True
        elif self.version < (1, 1):
            fields = [*fields, ("Connection", "keep-alive")]  # else a 1.0 client closes
        head = wire.response_head(status, reason, fields)  # may raise: nothing started yet
        self.started = True
        self.status = status
        if hold:
            self._head_pending = head
        else:
            self.conn.write(head)

    def start_raw(self, status: int, head: bytes, *, length: bytes | None,
                  bodiless: bool) -> None:
        """A relayed response head: ``head`` is its status line and end-to-end fields as
        bytes; this adds the framing (the upstream's ``length``, else chunked, or
        close-delimited for HTTP/1.0) and ``Connection: close`` when due (else
        ``Connection: keep-alive`` for HTTP/1.0), and holds it for the first write.
        ``bodiless``: HEAD, 1xx, 204, 304 (a length passes as is)."""
        if self.started:
            raise RuntimeError("response already started")
        if length is not None and status != 204:  # a 204 has no Content-Length (RFC 9110)
            head += b"Content-Length: " + length + b"\r\n"
        elif not bodiless:
            if self.version < (1, 1):
                self._close_after = True
            else:
                head += b"Transfer-Encoding: chunked\r\n"
                self.chunked_out = True
        if self._close_after or not self.keep_alive or self.conn.closing \
                or not self._body_done or self._chunks:  # its body not all read: no next
            head += b"Connection: close\r\n"
            self._close_after = True
        elif self.version < (1, 1):
            head += b"Connection: keep-alive\r\n"  # else a 1.0 client closes
        self._head_pending = head + b"\r\n"
        self.started = True
        self.status = status

    def write(self, data: bytes, *, end: bool = False,
              trailers: Sequence[tuple[str, str]] = ()) -> None:
        """Body bytes (framed here when chunked), with a held head before them and the
        end after them if ``end``: one write to the connection either way."""
        out = self._head_pending
        self._head_pending = b""
        if data:
            out += wire.chunk(data) if self.chunked_out else data
            self.line_ended = data[-1:] == b"\n"
        if end:
            if self.chunked_out:
                out += wire.last_chunk(list(trailers))
            self._end_response()
        if out:
            self.conn.write(out)

    def end(self, trailers: Sequence[tuple[str, str]] = ()) -> None:
        """The end of the body (the last chunk, with any trailers)."""
        self.write(b"", end=True, trailers=trailers)

    def _end_response(self) -> None:
        self.finished = True

    def abort(self) -> None:
        """End the response badly: the connection closes without a proper ending."""
        self.finished = True
        self._close_after = True
        self.conn.abort()

    def take_over(self, sink: Callable[[bytes], None]) -> bytes:
        """After a ``101``: every further byte from the client goes to ``sink``
        unparsed; returns what the client sent early (after the request head)."""
        self.finished = True
        self._close_after = True
        early = bytes(self._early or b"")
        self._early = None
        self.conn.switch(sink)
        return early

    def elapsed(self) -> float:
        return time.monotonic() - self._started_at


# --------------------------------------------------------------------------- connection


_connection_ids = itertools.count(1)


class DownstreamConnection(FlowControl):
    """One client connection: parses requests, runs the handler for each in turn."""

    def __init__(self, listener: Listener):
        self._flow_init()
        self.listener = listener
        self.loop = listener.loop
        self.id = next(_connection_ids)
        """Unique in the process (never reused): what handlers may key per-connection
        state by, without holding the connection."""
        self.downstream: Downstream = listener.anonymous
        self.client_address = ""
        self.raw_client_address = b""
        """The downstream's IP address, appended to ``X-Forwarded-For`` upstream."""
        self.deadline = 0.0
        self.closing = False
        """Ending: the current answer says ``Connection: close``, no other starts."""
        self.state = _IDLE
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._url = bytearray()
        self._fields: wire.RawFields = []
        self._framing: list[tuple[bytes, str]] = []
        self._head_bytes = 0
        self._tail = b""
        self._deadline_kind = _DUE_HEAD
        self._parsing: Exchange | None = None
        self._active: Exchange | None = None
        self._queue: deque[Exchange] = deque()
        self._upgrading: Exchange | None = None
        self._next_waiting = False
        self._fed_body = self._framing_bytes = 0
        self._raw_sink: Callable[[bytes], None] | None = None
        self._eof_sink: Callable[[], None] | None = None
        self._feeding = False
        """llhttp is parsing a read: nothing is dispatched until its verdict on all of it."""
        self.session: Multiplexed | None = None
        """Set when the client chose ``h2``: every byte goes to it."""

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # TCP or TLS: a Transport
        limit_buffers(transport)
        peer = transport.get_extra_info("peername")
        self.client_address = peer[0] if isinstance(peer, tuple) else ""
        self.raw_client_address = self.client_address.encode("ascii", "replace")
        ssl_object = transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        self.downstream = self.listener.resolve_identity(der)
        self.listener.opened(self)
        if ssl_object is not None and self.listener.open_session is not None \
                and ssl_object.selected_alpn_protocol() == "h2":
            session = self.session = self.listener.open_session(self)
            self._raw_sink = session.data_received
            return
        # The first request head is due like any other (Go's ReadHeaderTimeout).
        self._expect(_DUE_HEAD, self.listener.limits.header_read_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.state is not _CLOSED:
            self._to(_CLOSED)
        self.listener.closed(self)
        if self.session is not None:
            session, self.session = self.session, None
            session.connection_lost()
        if self._eof_sink is not None:
            sink, self._eof_sink = self._eof_sink, None
            sink()
        self.cancel()  # the client left: stop its request upstream too
        self._release()

    def _release(self) -> None:
        """Drop every reference this connection holds (transport, parser, requests,
        sinks), so it and its TLS buffers are freed by reference counting once the
        last handler lets go of it: no cycle through it outlives the connection."""
        self._flow_release()
        self._parser = None
        self._queue.clear()
        self._parsing = self._upgrading = None
        if self._active is None or self._active.cancel_hook is None:
            self._active = None  # else its handler's end clears it (``_complete``)
        self._raw_sink = self._eof_sink = None

    def eof_received(self) -> bool | None:
        if self._eof_sink is not None:
            sink, self._eof_sink = self._eof_sink, None
            sink()
        return False  # TLS cannot half-close: the connection ends

    def data_received(self, data: bytes) -> None:
        if self._raw_sink is not None:
            self._raw_sink(data)
            return
        if self._parser is None:
            return  # the connection ended (``_release``)
        state = self.state
        if state is _IDLE:  # first: the one test a keep-alive request's read makes
            self.state = _HEAD  # in TRANSITIONS; the per-request changes skip ``_to``
            self._head_bytes, self._tail = 0, b""
            self._expect(_DUE_HEAD, self.listener.limits.header_read_timeout)
        elif state is _UPGRADING:
            assert self._upgrading is not None
            self._early_bytes(self._upgrading, data)
            return
        elif state is _LAST or state is _REFUSED or state is _CLOSING:
            return
        if self.state is _HEAD and self._count_head(data):
            return
        body = self._parsing
        self._fed_body = 0
        self._feeding = True
        try:
            self._parser.feed_data(data)
            if body is not None and body is self._parsing:
                self._count_framing(len(data))
        except httptools.HttpParserUpgrade as upgrade:
            if self._upgrading is not None:
                self._early_bytes(self._upgrading, data[upgrade.args[0]:])
        except BadRequest as bad:
            self._refuse(bad.refusal)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if not isinstance(cause, _Ended):
                self._refuse(cause.refusal if isinstance(cause, BadRequest)
                             else Refusal(400, "the request could not be parsed"))
        except httptools.HttpParserError as exc:
            if self.state is not _LAST:  # else llhttp's "data after Connection: close"
                self._refuse(_parse_refusal(exc))
        finally:
            self._feeding = False
        # Only now, with llhttp's verdict on the whole read: a request parsed from it
        # goes upstream only if nothing after it in the read was refused (what follows
        # the connection's last request is not refused: it is ignored).
        self._next()

    def _count_head(self, data: bytes) -> bool:
        """Count head bytes as they arrive (llhttp reports a header only once it ended,
        so one endless header would otherwise be read without limit); True if refused.
        ``_tail`` keeps the last bytes of the previous read: a CRLF CRLF may straddle."""
        joined = self._tail + data
        end = joined.find(b"\r\n\r\n")
        if end < 0:
            self._head_bytes += len(data)
            self._tail = joined[-3:]
        else:
            self._head_bytes += max(0, end + 4 - len(self._tail))
            self._tail = b""
        if self._head_bytes > self.listener.limits.max_header_bytes:
            self._refuse(Refusal(431, "the request head is larger than the "
                                      f"{self.listener.limits.max_header_bytes}-byte limit"))
            return True
        return False

    def _count_framing(self, fed: int) -> None:
        """Bound what a body carries besides its bytes: chunk-size lines, extensions and
        trailers, which llhttp also reports only once they end. Counted since the last
        body byte, against the head limit; refused with 431 past it."""
        overhead = fed - self._fed_body
        self._framing_bytes = overhead if self._fed_body else self._framing_bytes + overhead
        if self._framing_bytes > self.listener.limits.max_header_bytes:
            raise BadRequest(Refusal(431, "the body's chunk framing or trailers are larger "
                                          f"than the {self.listener.limits.max_header_bytes}"
                                          "-byte head limit"))

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        state = self.state
        if state is _IDLE:  # a head pipelined in the same read
            self.state = _HEAD
        elif state is not _HEAD:
            if state in _ENDING:
                raise _Ended  # closed while this read was parsed: nothing more is read
            self._to(_HEAD)
        self._expect(_DUE_HEAD, self.listener.limits.header_read_timeout)  # pipelined ones too
        self._url.clear()
        self._fields = []
        self._framing = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Sizes are counted as bytes arrive (``_count_head``); this bounds the objects.
        fields = self._fields
        if len(fields) >= MAX_HEADER_FIELDS:
            raise BadRequest(Refusal(431, f"more than {MAX_HEADER_FIELDS} header fields"))
        fields.append((name, value))
        if len(name) in _FRAMING_LENGTHS and name.lower() in _FRAMING_RAW:
            self._framing.append((name.lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self.state is _HEAD:
            self.state = _BODY
        else:
            if self.state in _ENDING:
                raise _Ended
            self._to(_BODY)
        self._head_bytes, self._tail = 0, b""  # a head pipelined behind counts afresh
        self._framing_bytes = 0
        parser = cast(httptools.HttpRequestParser, self._parser)  # parsing: not released
        version = parser.get_http_version()
        exchange = Exchange(self, parser.get_method().decode("latin-1"),
                            self._url.decode("latin-1"),
                            (int(version[0]), int(version[2])) if len(version) == 3 else (0, 0),
                            self._fields, parser.should_keep_alive(), parser.should_upgrade())
        te = [v for n, v in self._framing if n == b"transfer-encoding"]
        length = next((v for n, v in self._framing if n == b"content-length"), "")
        refusal = check_request(exchange.version, exchange.target, te)
        if refusal is not None:
            raise BadRequest(refusal)
        if exchange.method == "CONNECT":
            raise BadRequest(Refusal(405, "CONNECT is not served"))
        if exchange.upgrade and (te or length not in ("", "0")):
            raise BadRequest(Refusal(400, "an upgrade request cannot carry a body"))
        if te:
            exchange.chunked = True
            exchange._body_done = False
        else:
            if length:
                exchange.body_length = int(length)  # llhttp validated it
                exchange._body_done = exchange.body_length == 0
        self._fields = []  # trailers, if any, are collected apart
        if exchange.upgrade:
            exchange._early = bytearray()
            self._upgrading = exchange
            self._to(_UPGRADING)
        self._parsing = exchange
        self._queue.append(exchange)
        if len(self._queue) > MAX_PIPELINED:
            raise BadRequest(Refusal(400, f"more than {MAX_PIPELINED} pipelined requests"))
        if len(self._queue) >= PIPELINE_PAUSE:
            self.pause_reading("pipeline")
        if exchange.body_complete:
            self.deadline = 0.0
        else:
            self._expect(_DUE_BODY, self.listener.limits.header_read_timeout)
        # Dispatched by ``data_received`` once the whole read is parsed, never from here.

    def on_body(self, body: bytes) -> None:
        self._fed_body += len(body)
        if self._parsing is not None:
            self._expect(_DUE_BODY, self.listener.limits.header_read_timeout)
            self._parsing._body(body)

    def on_message_complete(self) -> None:
        exchange, self._parsing = self._parsing, None
        if self.state is _BODY:  # UPGRADING stays: nothing more is parsed
            # Not kept alive: the last request (llhttp would refuse what follows it).
            self.state = _IDLE if exchange is None or exchange.keep_alive else _LAST
        if self._deadline_kind is _DUE_BODY:
            self.deadline = 0.0
        if exchange is not None:
            # llhttp reports trailer fields as headers after the body; they are not
            # forwarded (Kubernetes uses none, and they would skip header filtering).
            self._fields = []
            exchange._body_end()

    def _early_bytes(self, exchange: Exchange, data: bytes) -> None:
        assert exchange._early is not None
        exchange._early += data
        if len(exchange._early) > BODY_HIGH_WATER:
            self.pause_reading("upgrade")

    # ---------------------------------------------------------------- running handlers

    def _next(self) -> None:
        """Start the next queued request: one at a time, answers in request order; never
        while llhttp parses a read (``data_received`` calls this once it is done)."""
        if not self._queue or self.closing or self._active is not None or self._feeding:
            return
        if self._write_paused:
            # The client reads nothing: answer its next request once it does (one
            # waiter however many requests arrive meanwhile).
            if not self._next_waiting:
                self._next_waiting = True
                self.when_writable(self._next_when_writable)
            return
        exchange = self._active = self._queue.popleft()
        if len(self._queue) < PIPELINE_PAUSE:
            self.resume_reading("pipeline")
        try:
            self.listener.handler(exchange, self)
        except Exception as failure:  # noqa: BLE001 - becomes this request's answer
            # Possibly inside another connection's callback: never let it escape.
            exchange.cancel_hook = None
            self._complete(exchange, failure, False)

    def _next_when_writable(self) -> None:
        self._next_waiting = False
        self._next()

    def finish(self, exchange: Exchange, *, cancelled: bool = False,
               failure: BaseException | None = None) -> None:
        """The handler is done with ``exchange`` (its answer written, or cut, or
        ``failure`` raised)."""
        exchange.cancel_hook = None
        self._complete(exchange, failure, cancelled)

    def _complete(self, exchange: Exchange, failure: BaseException | None,
                  cancelled: bool) -> None:
        """The one place a handler's failure becomes an answer (or a closed connection)."""
        if cancelled:
            # Cancelled because the request was refused mid-body (its answer is written:
            # flush it) or because the client left or shutdown came (nothing to flush).
            self._active = None
            self.close() if exchange.finished else self.abort()
            return
        if failure is not None:
            throttled.log(log, logging.ERROR, "request handler failed", exc_info=failure,
                          method=exchange.method, started=exchange.started)
        if failure is not None or not exchange.finished:
            if exchange.started:
                self.abort()  # a truncated response, never a wrong one
                return
            exchange._close_after = True
            exchange.respond(500, [("Content-Type", "application/json")],
                             status_bytes(500, "internal error in mvproxy; see its log"))
        self._active = None
        if exchange is self._upgrading:
            self._upgrading = None
        if exchange._close_after or not exchange.body_complete or self.closing:
            self.close()
            return
        if self._queue:
            self._next()
        elif self.state is not _HEAD:
            self._idle()

    def _idle(self) -> None:
        self._expect(_DUE_IDLE, self.listener.limits.idle_timeout)

    def _to(self, state: State) -> None:
        """A state change, checked against ``TRANSITIONS``. The three every request
        makes (idle -> head -> body -> idle) are assigned where they happen, after a
        test of the state that makes them legal: checked, they cost a request ~0.8 µs."""
        assert state in TRANSITIONS[self.state], f"{self.state.name} -> {state.name}"
        self.state = state

    def _expect(self, kind: Deadline, seconds: float) -> None:
        """Something (a head, a body byte, a request) must come within ``seconds``."""
        self._deadline_kind = kind
        self.deadline = self.loop.time() + seconds

    def _refuse(self, refusal: Refusal) -> None:
        """Nothing more is parsed on this connection: what follows cannot be trusted.
        Requests queued behind the active one were never sent anywhere: dropped.

        - The refusal concerns the active request's own body (its framing, a body byte
          that did not come): that request is abandoned upstream and the refusal is
          its answer, unless its response started (then the connection just closes).
        - It concerns bytes after the active request, whose body is whole upstream:
          that request finishes, and the client gets the upstream's real answer
          (with ``Connection: close`` when it had not started), then the connection
          closes. The refusal is counted and logged, not written. Meanwhile reading
          goes on, discarding, so a client that leaves still ends its request.
        - No request is active: the refusal is written, then the connection closes.
        """
        if self.state in _ENDING:
            return  # closed already (the handler ended it while its body was parsed)
        log.log(V(3), "request refused", extra=kv(status=refusal.status, reason=refusal.message))
        self.listener.refused(refusal.status)
        self._to(_REFUSED)
        self.deadline = 0.0
        self._queue.clear()
        parsing, self._parsing = self._parsing, None
        active = self._active
        if self._upgrading is not active:  # an upgrade queued behind it, dropped too
            self._upgrading = None
        if active is not None and active is not parsing:
            active._close_after = True  # its answer says so, then ``_complete`` closes
            self.resume_reading("pipeline")  # nothing is queued any more
            return
        self.pause_reading("refused")
        if active is None or not active.started:
            # Nothing was answered yet (a bad body of a request being forwarded counts:
            # its upstream request is abandoned, the client learns why).
            body = status_bytes(refusal.status, refusal.message)
            self.write(wire.response_head(refusal.status, "", [
                ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                ("Connection", "close")]) + body)
            if active is not None:  # after the write: a callback handler ends at once
                active.started = active.finished = True
                active.status = refusal.status  # what the client got, for metrics
                self.cancel()
        self.close()

    # ---------------------------------------------------------------- I/O helpers

    @property
    def ended(self) -> bool:
        return self.closing

    def switch(self, sink: Callable[[bytes], None]) -> None:
        """Raw mode: bytes go to ``sink`` from now on (a tunnel)."""
        if self.state not in _ENDING:  # else the client left first: nothing will come
            self._to(_TUNNEL)
        self._raw_sink = sink
        self.deadline = 0.0
        self.resume_reading("upgrade")

    def on_eof(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the client's side ends (tunnels)."""
        if self.closing:
            callback()
        else:
            self._eof_sink = callback

    def close(self) -> None:
        """Close after what was written is flushed."""
        self.closing = True
        if self.state not in _ENDING:
            self._to(_CLOSING)
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closing = True
        if self.state not in _ENDING:
            self._to(_CLOSING)
        if self.transport is not None:
            self.transport.abort()

    @property
    def busy(self) -> bool:
        return self._active is not None and self._active.cancel_hook is not None

    def cancel(self) -> None:
        if self._active is not None and self._active.cancel_hook is not None:
            self._active.cancel_hook()

    def watch_between_events(self) -> bool:
        """Whether the request being answered is a JSON watch whose answer so far ends
        between two events: ending it there is how kube-apiserver ends a watch, and
        the client simply watches again (``end_for_shutdown``; HTTP/2 streams whose
        upstream failed, where a reset would be an error to client-go, not an end)."""
        active = self._active
        return (active is not None and active.watch and active.started
                and active.chunked_out and active.line_ended)

    def end_for_shutdown(self) -> None:
        """Shutdown ends this request: a chunked watch between two JSON events gets its
        last chunk, so the client sees the watch end as kube-apiserver ends it and
        simply watches again; anything else (a LIST, a log, a protobuf watch cut
        mid-frame) is cut, so no client takes a truncated body for a whole one."""
        active = self._active
        if (active is not None and active.watch and active.started and not active.finished
                and active.chunked_out and active.line_ended):
            active.write(b"", end=True)
        self.cancel()

    def close_if_idle(self) -> bool:
        """Close now if no request is in progress (shutdown); True if it was idle."""
        if self.session is not None:
            return self.session.close_if_idle()
        if self._active is None and self._parsing is None and not self._queue:
            self.close()
            return True
        self.closing = True  # the current response carries Connection: close
        return False

    def expired(self, now: float) -> None:
        if self.session is not None:
            if not self.closing:
                self.session.expired(now)
            return
        if self.closing or self.state in _QUIET:
            return
        timeout = self.listener.limits.header_read_timeout
        kind = self._deadline_kind
        if kind is _DUE_HEAD and self.state is _HEAD:
            self._refuse(Refusal(408, f"the request head did not arrive within {timeout:g}s"))
        elif kind is _DUE_BODY and self._parsing is not None:
            if self._paused_by:
                self._expect(_DUE_BODY, timeout)  # mvproxy stopped reading, not the client
            else:
                self._refuse(Refusal(408, f"no request body byte for {timeout:g}s"))
        elif self._active is None and self._parsing is None and not self._queue \
                and self.state is not _HEAD:
            self.close()  # idle, or never sent a byte: nothing to say


_QUIET = frozenset((_LAST, _TUNNEL, _REFUSED)) | _ENDING
"""States without a deadline of their own: nothing more is read as HTTP."""


def release_free_memory() -> None:
    """glibc keeps freed heap for reuse; ``malloc_trim`` returns what it can (no-op
    where glibc is not the allocator)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _parse_refusal(exc: httptools.HttpParserError) -> Refusal:
    """400 for whatever llhttp refuses (smuggling attempts included); the reason is
    llhttp's own short text, which names the construct, never echoes the input."""
    return Refusal(400, f"the request could not be parsed as HTTP/1.1: {str(exc)[:80]}")


# --------------------------------------------------------------------------- listener


class Listener:
    """Accepts TLS connections up to the limit and runs ``handler`` for each request."""

    def __init__(self, *, handler: Handler, limits: Limits,
                 ssl_context: ssl.SSLContext | SwappableContext,
                 resolve_identity: Callable[[bytes | None], Downstream],
                 anonymous: Downstream, on_refused: Callable[[int], None] | None = None):
        self.handler = handler
        self.limits = limits
        self.ssl_context = ssl_context
        """Read at each handshake: a reloaded certificate serves new connections."""
        self.resolve_identity = resolve_identity
        self.anonymous = anonymous
        self.loop = asyncio.get_running_loop()
        self.connections: set[DownstreamConnection] = set()
        self._on_refused = on_refused
        self._socket: socket.socket | None = None
        self._accepting = False
        self._pending = 0
        """Accepted sockets still in their TLS handshake (they count as connections)."""
        self._handshakes: set[asyncio.Task] = set()
        self._resume_handle: asyncio.TimerHandle | None = None
        self._sweeper: asyncio.Task | None = None
        self._starved_since: float | None = None
        self._peak = 0
        self._trim: asyncio.TimerHandle | None = None
        self._starved_logged_at = -STARVED_LOG_INTERVAL
        self._starved_episodes = 0
        self._recovery_unlogged = False
        self.streams: Listener | None = None
        """HTTP/2 streams, each a connection of its own (``serve_http2``): their own
        count, deadlines and drain; ``connections`` holds the TLS connections."""
        self.open_session: Callable[[DownstreamConnection], Multiplexed] | None = None

    def serve_http2(self, open_session: Callable[[DownstreamConnection], Multiplexed]) -> None:
        """Offer ``h2`` (the TLS context must list it in ALPN): a connection whose
        client chose it is handed to ``open_session``."""
        self.streams = Listener(handler=self.handler, limits=self.limits,
                                ssl_context=self.ssl_context,
                                resolve_identity=self.resolve_identity,
                                anonymous=self.anonymous, on_refused=self._on_refused)
        self.open_session = open_session

    # ---------------------------------------------------------------- lifecycle

    def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Bind and listen; returns the port (for port 0). ``reuse_port``: share the port
        with the other workers (the kernel spreads new connections among them)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._socket = sock
        self._resume_accepting()
        self._start_sweeping()
        if self.streams is not None:
            self.streams._start_sweeping()
        return sock.getsockname()[1]

    def _start_sweeping(self) -> None:
        self._sweeper = self.loop.create_task(self._sweep(), name="mvproxy-listener-sweep")

    def stop_accepting(self) -> None:
        """Close the listening socket (shutdown): new clients are refused by the kernel."""
        self._pause_accepting()
        if self._resume_handle is not None:
            self._resume_handle.cancel()
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def close_idle(self) -> None:
        for conn in list(self.connections):
            conn.close_if_idle()

    async def close(self) -> None:
        """Stop everything: the socket, handshakes in progress, every connection."""
        self.stop_accepting()
        for task in list(self._handshakes):
            task.cancel()
        await asyncio.gather(*self._handshakes, return_exceptions=True)
        if self.streams is not None:
            await self.streams.close()
        for conn in list(self.connections):
            conn.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)

    @property
    def open_connections(self) -> int:
        return len(self.connections) + self._pending

    def in_flight(self) -> int:
        """Requests being handled now (for the shutdown drain), HTTP/2 streams too."""
        streams = 0 if self.streams is None else self.streams.in_flight()
        return streams + sum(1 for conn in self.connections if conn.busy)

    def cancel_in_flight(self) -> int:
        """End every request still being handled (shutdown after the grace period)."""
        busy = [conn for conn in self.connections if conn.busy]
        for conn in busy:
            conn.end_for_shutdown()
        streams = 0 if self.streams is None else self.streams.cancel_in_flight()
        return streams + len(busy)

    # ---------------------------------------------------------------- accepting

    def _resume_accepting(self) -> None:
        self._resume_handle = None
        if self._socket is not None and not self._accepting:
            self._accepting = True
            self.loop.add_reader(self._socket.fileno(), self._accept)

    def _pause_accepting(self) -> None:
        if self._accepting and self._socket is not None:
            self._accepting = False
            self.loop.remove_reader(self._socket.fileno())

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            if self.open_connections >= self.limits.max_connections:
                self._starved("the connection limit",
                              f"maxConnections={self.limits.max_connections}")
                self._pause_accepting()
                return
            if self._pending >= self.limits.max_pending_handshakes:
                self._starved("the limit of TLS handshakes in progress",
                              f"maxPendingHandshakes={self.limits.max_pending_handshakes}")
                self._pause_accepting()
                return
            try:
                sock, _ = self._socket.accept()  # type: ignore[union-attr]  # read while open
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self._starved("file descriptors", exc.strerror or str(exc))
                    self._pause_accepting()
                    self._resume_handle = self.loop.call_later(1.0, self._resume_accepting)
                    return
                log.log(V(4), "accept failed", extra=kv(error=str(exc)))
                return
            if self._starved_since is not None:
                if self._recovery_unlogged:
                    self._recovery_unlogged = False
                    log.info("accepting connections again", extra=kv(
                        after_seconds=round(time.monotonic() - self._starved_since, 1)))
                self._starved_since = None
            self._pending += 1
            task = self.loop.create_task(self._handshake(sock))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    def _starved(self, what: str, detail: str) -> None:
        """Log at most once per ``STARVED_LOG_INTERVAL``, never per failed accept (a
        client controls that rate); the recovery after a logged episode is logged once."""
        now = time.monotonic()
        if self._starved_since is None:
            self._starved_since = now
            self._starved_episodes += 1
        if now - self._starved_logged_at >= STARVED_LOG_INTERVAL:
            log.warning(f"not accepting new connections: out of {what}; clients wait in "
                        "the backlog until connections end",
                        extra=kv(detail=detail, open=self.open_connections,
                                 episodes=self._starved_episodes))
            self._starved_logged_at = now
            self._starved_episodes = 0
            self._recovery_unlogged = True

    async def _handshake(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError, AttributeError):  # Linux only
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
            conn = DownstreamConnection(self)
            conn.socket_transport = await accept_tls(
                self.loop, sock, conn, current_context(self.ssl_context),
                handshake_timeout=self.limits.header_read_timeout)
        except (OSError, TimeoutError, asyncio.CancelledError, ConnectionError) as exc:
            sock.close()
            log.log(V(4), "TLS handshake failed", extra=kv(error=type(exc).__name__))
        except Exception:  # a broken client must not stop accepting
            sock.close()
            log.log(V(4), "TLS handshake failed unexpectedly", exc_info=True)
        finally:
            self._pending -= 1
            if not self._accepting and self._starved_since is not None \
                    and self._resume_handle is None:
                self._resume_accepting()

    # ---------------------------------------------------------------- bookkeeping

    def opened(self, conn: DownstreamConnection) -> None:
        self.connections.add(conn)

    def closed(self, conn: DownstreamConnection) -> None:
        self.connections.discard(conn)
        self._peak = max(self._peak, len(self.connections) + 1)
        if self._trim is None and len(self.connections) < self._peak // 2 and self._peak >= 256:
            # Many connections ended (a wave of watches moved elsewhere): hand the
            # freed heap back to the system once things calm down.
            self._trim = self.loop.call_later(TRIM_DELAY, self._return_memory)
        if not self._accepting and self._resume_handle is None and self._socket is not None:
            self._resume_accepting()

    def _return_memory(self) -> None:
        self._trim = None
        self._peak = len(self.connections)
        release_free_memory()

    def refused(self, status: int) -> None:
        if self._on_refused is not None:
            self._on_refused(status)

    async def _sweep(self) -> None:
        """Enforce the idle and header deadlines, a few times per shortest timeout."""
        period = max(0.05, min(1.0, self.limits.header_read_timeout / 4,
                               self.limits.idle_timeout / 4))
        while True:
            await asyncio.sleep(period)
            self._expire_due(self.loop.time())

    def _expire_due(self, now: float) -> None:
        """One sweep; a function of its own so that no connection stays referenced by
        the sweeper's loop variable until the next sweep."""
        for conn in list(self.connections):
            if conn.deadline and conn.deadline < now:
                conn.deadline = 0.0
                conn.expired(now)
