"""The only outbound HTTP: pooled TLS connections to the backend and peers, llhttp-parsed.

Every request mvproxy makes (forwarded requests, discovery polls, discovery probes)
goes through here, and every socket, TLS and parser error stops here: callers see
only ``UpstreamConnectError`` (nothing was sent, safe to try another peer),
``UpstreamTimeout`` and ``UpstreamProtocolError``.

- **Pools**: one per upstream, idle connections reused most-recent-first and capped
  (``max_idle``); a connection idle longer than ``idle_expiry`` is closed instead of
  reused, well inside kube-apiserver's 90 s idle timeout, so a reused connection is
  rarely one the server is closing. A connection made with a client context that a
  certificate reload has since replaced is never reused either: kube-apiserver checks
  the client certificate's validity on every request, so a pooled connection still
  presenting the old certificate would get 401 once it expires. ``reset`` drops a pool
  and aborts the requests on it: polling calls it when a peer (or the backend) stops
  answering, so nothing waits on a frozen server.
- **Sockets** carry TCP keep-alive and ``TCP_USER_TIMEOUT``: a peer that vanished from
  the network (no RST ever comes) is noticed within about ``keepalive`` seconds even on
  a quiet watch.
- **Responses** are parsed with llhttp and handed to a ``ResponseHandler`` as they
  arrive (head, body pieces, end), one ``flush`` per read, so a small answer can be
  written to the downstream in one go and a large one streams with flow control.
- Nothing is decompressed, no cookie is kept, no proxy setting from the environment is
  read: bytes and headers pass as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Protocol, TypeVar, cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from mvproxy import wire
from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnresolved,
)
from mvproxy.flow import FlowControl, connect_tls, limit_buffers
from mvproxy.requestcheck import target_problem
from mvproxy.tls import SwappableContext, current_context, peer_serving_problem

log = logging.getLogger(__name__)

KEEPALIVE_IDLE = 15
"""Seconds of silence before TCP keep-alive probes start on an upstream socket."""
KEEPALIVE_COUNT = 3
KEEPALIVE_INTERVAL = 5
USER_TIMEOUT_MS = 30_000
"""Unacknowledged data for this long ends the connection (TCP_USER_TIMEOUT)."""
BODY_HIGH_WATER = 256 * 1024
"""Response bytes buffered for a slow reader before reading from the upstream pauses."""


_Error = TypeVar("_Error", bound=BaseException)


def _caused_by(error: _Error, cause: BaseException) -> _Error:
    """``error`` with ``cause`` as its ``__cause__``, as ``raise error from cause``
    would set it: compiled by mypyc, ``from cause`` is dropped (a plain ``raise``)."""
    error.__cause__ = cause
    return error


class BodyTooLarge(UpstreamProtocolError):
    """The upstream's body is over the caller's size limit."""


@dataclass(frozen=True)
class Upstream:
    """A server mvproxy talks to: its backend, or one peer."""

    name: str
    """``backend`` or the peer's server ID; used in logs, errors and metrics."""
    url: str
    """Base URL, ``https://host:port`` without a trailing slash."""
    ssl_context: ssl.SSLContext | SwappableContext = field(compare=False, repr=False)
    """Client context: the CA that verifies the upstream and our client certificate.
    Read at each new connection, so a reloaded certificate is used from then on while
    pooled connections keep theirs."""
    is_peer: bool = False
    anonymous: Upstream | None = field(default=None, compare=False, repr=False)
    """The same server reached *without* a client certificate (the backend only): for
    requests mvproxy asserts no identity for, so the backend's own anonymous policy
    applies. With the front-proxy certificate and no ``X-Remote-User``, kube-apiserver
    fails authentication outright (401) instead of treating the request as anonymous."""
    presents_certificate: bool = True
    """False for the ``anonymous`` twin (it also keeps the two pools apart)."""
    must_name_itself: bool = False
    """A peer found through a Lease or DNS: its serving certificate must carry its
    server ID (``tls.peer_serving_problem``); checked once per new connection."""
    h2_context: ssl.SSLContext | SwappableContext | None = field(
        default=None, compare=False, repr=False)
    """The same client material offering ``h2`` in ALPN, for requests carried over
    HTTP/2 (``upstreamHTTP2``); None: this upstream is reached over HTTP/1.1 only."""

    def for_headers(self, headers: Mapping[str, str]) -> Upstream:
        """The connection flavour for a request with these upstream headers."""
        if self.anonymous is not None and "X-Remote-User" not in headers:
            return self.anonymous
        return self

    @cached_property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @cached_property
    def port(self) -> int:
        return urlsplit(self.url).port or 443

    @cached_property
    def authority(self) -> str:
        """The ``Host`` header value: ``host:port`` (IPv6 in brackets)."""
        return urlsplit(self.url).netloc

    @cached_property
    def raw_authority(self) -> bytes:
        return self.authority.encode("ascii")


@dataclass(frozen=True)
class Fetched:
    """A small, fully read response (discovery documents)."""

    status: int
    headers: Mapping[str, str]
    """Case-insensitive, as HTTP headers are (Go servers send ``Etag``)."""
    body: bytes


class ResponseHandler(Protocol):
    """Receives one response as it is parsed (all calls come from the event loop)."""

    def on_interim(self, status: int, reason: bytes, raw: wire.RawFields,
                   lowered: list[bytes]) -> None: ...
    def on_head(self, status: int, reason: bytes, raw: wire.RawFields,
                lowered: list[bytes]) -> None: ...
    def on_body(self, data: bytes) -> None: ...
    def on_end(self, trailers: wire.RawFields) -> None: ...
    def on_upgrade(self, early: bytes) -> None: ...
    def on_error(self, error: UpstreamError) -> None: ...
    def flush(self) -> None: ...


# --------------------------------------------------------------------------- connection


class State(Enum):
    """Where one upstream connection is in its request/response cycle."""

    IDLE = "idle"
    """No request in flight: a new one may be sent (if the last answer kept it alive)."""
    AWAITING_HEAD = "awaiting head"
    """A request was sent; its final response head has not come (1xx ones may)."""
    BODY = "body"
    """The final head came; its body is being read."""
    SWITCHED = "switched"
    """A ``101``: the bytes are no longer HTTP (a tunnel reads them)."""
    CLOSED = "closed"
    """The connection ended; nothing more is sent or parsed."""


TRANSITIONS: Mapping[State, frozenset[State]] = {
    State.IDLE: frozenset((State.AWAITING_HEAD, State.CLOSED)),
    State.AWAITING_HEAD: frozenset((State.BODY, State.SWITCHED, State.CLOSED)),
    State.BODY: frozenset((State.IDLE, State.CLOSED)),
    State.SWITCHED: frozenset((State.CLOSED,)),
    State.CLOSED: frozenset(),
}
"""The moves ``UpstreamConnection`` makes: a request out of ``IDLE``; its final head
(``BODY``, or ``SWITCHED`` for a ``101``), then its end (a HEAD's answer ends at its
head); ``CLOSED`` when the connection ends, from anywhere, for good. llhttp's callbacks
make the moves of a response (in its order); a request sent out of turn is a bug in
mvproxy (``RuntimeError``); bytes nobody asked for end the connection."""


class UpstreamConnection(FlowControl):
    """One TLS connection to an upstream, carrying one request at a time (``State``)."""

    def __init__(self, pool: Pool):
        self._flow_init()
        self.pool = pool
        self.upstream = pool.upstream
        self.state = State.IDLE
        self.closed = False
        """Closing or closed (by either side); ``state`` becomes ``CLOSED`` once it ended."""
        self.requests = 0
        self.idle_since = 0.0
        self.received = False
        """Some byte of the current response arrived."""
        self.reset = False
        """Aborted by ``Pool.reset`` (its server stopped answering): not worth retrying."""
        self.refused = False
        """An HTTP/2 server said it processed nothing of this request (``REFUSED_STREAM``,
        or ``GOAWAY`` below its stream): like a stale pooled connection, worth a retry."""
        self.context: ssl.SSLContext | None = None
        """The client context of its handshake: once a reload replaced it, the
        connection finishes what it carries and is not reused."""
        self._handler: ResponseHandler | None = None
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._head_request = False
        self._reason = b""
        self._fields: wire.RawFields = []
        self._interim = False
        self._until_close = False
        self._keep_alive = True
        self._raw_sink: Callable[[bytes], None] | None = None
        self._eof_sink: Callable[[], None] | None = None
        self.early: list[bytes] | None = None
        """Set while an HTTP/2 dial completes: the server's first frames (its SETTINGS,
        sent with the handshake) are kept for the session, not taken as stray bytes."""

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # TCP or TLS: a Transport
        limit_buffers(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _keepalive(sock)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        was = self.state
        self.state = State.CLOSED
        self.pool.forget(self)
        if self._eof_sink is not None:
            sink, self._eof_sink = self._eof_sink, None
            sink()
        handler, self._handler = self._handler, None
        # Nothing refers back to this connection once it ended: freed by reference
        # counting, with its TLS buffers, as soon as its last user lets go.
        self._flow_release()
        self._parser = None
        self._raw_sink = None
        if handler is None or was not in (State.AWAITING_HEAD, State.BODY):
            return
        if self._until_close and was is State.BODY:
            handler.on_end([])  # a close-delimited body ends with the connection
            handler.flush()
            return
        what = "connection closed before the response was complete" if self.received \
            else "connection closed before any response"
        handler.on_error(UpstreamProtocolError(self.upstream.name, what))

    def eof_received(self) -> bool | None:
        if self._eof_sink is not None:
            sink, self._eof_sink = self._eof_sink, None
            sink()
        return False

    def data_received(self, data: bytes) -> None:
        if self._raw_sink is not None:
            self._raw_sink(data)
            return
        handler = self._handler
        if handler is None:
            if self.early is not None:
                self.early.append(data)
                return
            # Bytes nobody asked for: the connection's framing is lost.
            self.abort()
            return
        parser = self._parser
        if parser is None:
            return  # ended (``connection_lost``)
        self.received = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self.state = State.SWITCHED  # already, from its 101 head
            self._handler = None
            handler.on_upgrade(data[upgrade.args[0]:])
            return
        except httptools.HttpParserError as exc:
            self._fail(handler, UpstreamProtocolError(
                self.upstream.name, f"broken response: {str(exc)[:80]}"))
            return
        handler.flush()

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._reason = b""
        self._fields = []

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = cast(httptools.HttpResponseParser, self._parser)  # parsing: not released
        status = parser.get_status_code()
        raw, self._fields = self._fields, []
        handler = self._handler
        if handler is None:
            return
        lowered = [name.lower() for name, _ in raw]
        if 100 <= status < 200 and status != 101:
            self._interim = True
            handler.on_interim(status, self._reason, raw, lowered)
            return
        self.state = State.SWITCHED if status == 101 else State.BODY  # from AWAITING_HEAD
        self._keep_alive = parser.should_keep_alive()
        self._until_close = (not self._head_request and status not in (204, 304)
                             and b"content-length" not in lowered
                             and b"transfer-encoding" not in lowered and status != 101)
        handler.on_head(status, self._reason, raw, lowered)
        if self._head_request and status != 101:
            # llhttp cannot be told "no body" from here: end the response ourselves
            # and give the next request a fresh parser.
            self._parser = httptools.HttpResponseParser(self)
            self._finish(handler, [])

    def on_body(self, body: bytes) -> None:
        if self._handler is not None:
            self._handler.on_body(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        handler = self._handler
        if handler is not None:
            trailers, self._fields = self._fields, []
            self._finish(handler, trailers)

    def _finish(self, handler: ResponseHandler, trailers: wire.RawFields) -> None:
        if self.state is State.BODY:  # (llhttp ends a 101's message too: still SWITCHED)
            self.state = State.IDLE
        self._handler = None
        handler.on_end(trailers)

    def _fail(self, handler: ResponseHandler, error: UpstreamError) -> None:
        self._handler = None
        self.abort()
        handler.on_error(error)

    # ---------------------------------------------------------------- the request side

    def send(self, head: bytes, handler: ResponseHandler, *, method: str) -> None:
        """Write a request head; the response goes to ``handler``."""
        if self.state is not State.IDLE:  # the only state ``TRANSITIONS`` sends from
            raise RuntimeError(f"upstream connection: {self.state.value} -> "
                               f"{State.AWAITING_HEAD.value}")
        self.state = State.AWAITING_HEAD
        self.requests += 1
        self.received = False
        self._handler = handler
        self._head_request = method == "HEAD"
        self._until_close = False
        self._interim = False
        self.write(head)

    @property
    def ended(self) -> bool:
        return self.closed

    @property
    def reusable(self) -> bool:
        return (self.state is State.IDLE and self._keep_alive and not self.closed
                and not self._until_close)

    def switch(self, sink: Callable[[bytes], None], on_eof: Callable[[], None]) -> None:
        """Raw mode after a 101: bytes go to ``sink``; ``on_eof`` once it ends."""
        self._raw_sink = sink
        self._eof_sink = on_eof
        self.pool.forget(self)

    def reads_behind(self) -> bool:
        """Read in small pieces while the downstream this response goes to is behind
        (``flow.READ_CHUNK_BEHIND``)."""
        handler = self._handler
        downstream = getattr(handler, "downstream", None)
        return downstream is not None and downstream.writes_behind()

    def pause_reading(self, reason: str) -> None:
        """Also stop reading the socket at once: the TLS transport alone would read
        ahead (``flow.READ_HIGH``) before it stops, and a stalled downstream must not
        make the upstream leg hold more than what is already in flight."""
        super().pause_reading(reason)
        if self.socket_transport is not None:
            with contextlib.suppress(RuntimeError):
                self.socket_transport.pause_reading()

    def resume_reading(self, reason: str) -> None:
        super().resume_reading(reason)
        if not self._paused_by and self.socket_transport is not None and not self.closed:
            with contextlib.suppress(RuntimeError):
                self.socket_transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _keepalive(sock: socket.socket) -> None:
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)


# --------------------------------------------------------------------------- pool


class StreamSession(Protocol):
    """An HTTP/2 connection carrying requests as streams (``h2upstream.UpstreamSession``)."""

    ready: asyncio.Future[None]
    """Done once the server's SETTINGS came (its stream limit is known)."""
    carrying: int
    """Requests on it now."""

    def can_open(self) -> bool: ...
    def open_stream(self) -> UpstreamConnection: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


SessionOpener = Callable[["Pool", UpstreamConnection], StreamSession]
"""Takes over a dialled connection whose server chose ``h2`` (``h2upstream.open_session``)."""
MAX_IDLE = 512
"""Idle connections kept per upstream. One HTTP/2 client brings up to 100 requests at
once, each on a pooled HTTP/1.1 connection upstream (short requests): with 64 kept, a
burst of 100 closed 36 and dialled them again on the next (bench/h2proxy.py: 675 new
mTLS connections a run, 1.7x the CPU per request). An idle one costs ~40 KiB and is
closed after ``idle_expiry``."""
MAX_DIAL_ROUNDS = 32
"""Sessions a request waits to be dialled for it before it goes over HTTP/1.1 (a burst
of watches fills one session after another; each round is one dial)."""
H2_RETRY_AFTER = 60.0
"""Seconds an upstream that answered ``http/1.1`` to ``h2`` is reached over HTTP/1.1
before ``h2`` is offered again (it may be upgraded meanwhile)."""


class Pool:
    """Connections to one upstream: idle ones to reuse, busy ones to abort on reset;
    and HTTP/2 sessions, each carrying many requests."""

    def __init__(self, upstream: Upstream, *, connect_timeout: float, max_idle: int,
                 idle_expiry: float, open_session: SessionOpener | None = None):
        self.upstream = upstream
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle_expiry = idle_expiry
        self.idle: deque[UpstreamConnection] = deque()
        self.busy: set[UpstreamConnection] = set()
        self.open_session = open_session
        self.sessions: list[StreamSession] = []
        self.h2_refused_until = 0.0
        self._dialing: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return f"<Pool {self.upstream.name}: {len(self.busy)} busy, {len(self.idle)} idle>"

    def take_idle(self) -> UpstreamConnection | None:
        """The most recently used idle connection still worth reusing, if any: open,
        not idle too long, made with the client context in use now."""
        now = time.monotonic()
        context = current_context(self.upstream.ssl_context)
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_expiry \
                    and conn.context is context:
                self.busy.add(conn)
                return conn
            conn.close()
        return None

    async def acquire(self) -> tuple[UpstreamConnection, bool]:
        """A connection for one request, and whether it was reused."""
        conn = self.take_idle()
        if conn is not None:
            return conn, True
        conn = await self._connect()
        self.busy.add(conn)
        return conn, False

    async def connect(self) -> UpstreamConnection:
        """A new connection for one request (busy until released)."""
        conn = await self._connect()
        self.busy.add(conn)
        return conn

    def take_stream(self) -> UpstreamConnection | None:
        """A request on an HTTP/2 session that has room for one, if any."""
        for session in self.sessions:
            if session.can_open():
                return session.open_stream()
        return None

    async def connect_stream(self) -> UpstreamConnection:
        """A request on HTTP/2: on a session with room, else on a new one (one dial at a
        time: the requests that wait for it share it); over HTTP/1.1 when the upstream
        does not speak ``h2`` (``H2_RETRY_AFTER``)."""
        for _ in range(MAX_DIAL_ROUNDS):
            conn = self.take_stream()
            if conn is not None:
                return conn
            context = self.upstream.h2_context
            if context is None or self.open_session is None \
                    or time.monotonic() < self.h2_refused_until:
                break
            if self._dialing is not None:
                await asyncio.shield(self._dialing)
                continue
            dialing = self._dialing = asyncio.get_running_loop().create_future()
            try:
                conn = await self._connect(current_context(context), early=True)
                ssl_object = conn.transport.get_extra_info("ssl_object") \
                    if conn.transport else None
                if ssl_object is None or ssl_object.selected_alpn_protocol() != "h2":
                    self.h2_refused_until = time.monotonic() + H2_RETRY_AFTER
                    conn.early = None
                    self.busy.add(conn)  # this request on it; never pooled (its context)
                    return conn
                session = self.open_session(self, conn)
                self.sessions.append(session)
                # Its stream limit first, so the requests waiting share it rightly.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(session.ready), self.connect_timeout)
            finally:
                self._dialing = None
                dialing.set_result(None)
        return await self.connect()

    def forget_session(self, session: StreamSession) -> None:
        with contextlib.suppress(ValueError):
            self.sessions.remove(session)

    async def _connect(self, context: ssl.SSLContext | None = None, *,
                       early: bool = False) -> UpstreamConnection:
        upstream = self.upstream
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                conn = UpstreamConnection(self)
                conn.context = context or current_context(upstream.ssl_context)
                if early:
                    conn.early = []
                conn.socket_transport = await connect_tls(
                    loop, upstream.host, upstream.port, conn, conn.context,
                    server_hostname=upstream.host, handshake_timeout=self.connect_timeout)
        except TimeoutError as exc:
            raise _caused_by(UpstreamConnectError(upstream.name, "connect timed out"),
                             exc) from exc
        except socket.gaierror as exc:
            raise _caused_by(UpstreamUnresolved(upstream.name, f"cannot resolve: {exc}"),
                             exc) from exc
        except (OSError, ssl.SSLError) as exc:
            raise _caused_by(UpstreamConnectError(upstream.name, f"cannot connect: {exc}"),
                             exc) from exc
        if upstream.is_peer:
            ssl_object = conn.transport.get_extra_info("ssl_object") if conn.transport else None
            der = ssl_object.getpeercert(binary_form=True) if ssl_object else None
            try:
                problem = (peer_serving_problem(der, upstream.name,
                                                must_name=upstream.must_name_itself)
                           if der else "it presented no certificate")
            except Exception:
                conn.abort()  # never pooled: nothing else would close it
                raise
            if problem:
                conn.abort()
                raise UpstreamConnectError(upstream.name, f"not a peer: {problem}")
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """Back to the idle list if it can carry another request, else closed (also
        when a certificate reload replaced its client context meanwhile)."""
        self.busy.discard(conn)
        if conn.reusable and len(self.idle) < self.max_idle \
                and conn.context is current_context(self.upstream.ssl_context):
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn.close()

    def discard(self, conn: UpstreamConnection) -> None:
        self.busy.discard(conn)
        conn.abort()

    def forget(self, conn: UpstreamConnection) -> None:
        self.busy.discard(conn)
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)

    def reset(self) -> int:
        """Close idle connections and abort busy ones; returns how many were busy."""
        busy = list(self.busy)
        for conn in [*self.idle, *busy]:
            conn.reset = True
            conn.abort()
        sessions, self.sessions = self.sessions, []
        for session in sessions:
            session.abort()
        self.idle.clear()
        self.busy.clear()
        return len(busy)


# --------------------------------------------------------------------------- transport


class Deadlines:
    """Deadlines of requests in flight, checked by one periodic task instead of a timer
    object per request (CPython's timer and ``asyncio.timeout`` each ask the kernel for
    the process ID, a system call per request that showed as a quarter of the CPU)."""

    def __init__(self, period: float):
        self.period = period
        self._entries: dict[object, tuple[float, Callable[[], None]]] = {}
        self._task: asyncio.Task | None = None

    def add(self, key: object, deadline: float, expire: Callable[[], None],
            loop: asyncio.AbstractEventLoop) -> None:
        self._entries[key] = (deadline, expire)
        if self._task is None:
            self._task = loop.create_task(self._sweep(loop), name="mvproxy-deadlines")

    def discard(self, key: object) -> None:
        self._entries.pop(key, None)

    async def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            await asyncio.sleep(self.period)
            self._expire_due(loop.time())

    def _expire_due(self, now: float) -> None:
        """One sweep (a function of its own: the sweeper's locals would otherwise keep
        the last request expired alive until the next sweep)."""
        due = [(key, expire) for key, (deadline, expire) in self._entries.items()
               if deadline <= now]
        for key, expire in due:
            self._entries.pop(key, None)
            expire()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


class Transport:
    """Pools keyed by upstream, with one set of timeouts.

    ``connect_timeout`` bounds TCP connect plus TLS handshake; ``request_timeout``
    bounds a whole short request. Long-running requests (watch, exec, logs -f) get a
    deadline only for their response head. There is no cap on busy connections: every
    open watch holds one, and a capped pool would turn the next request into a
    timeout; the backend enforces its own limits (max-in-flight, APF).
    """

    def __init__(self, *, connect_timeout: float, request_timeout: float,
                 max_idle_per_upstream: int = MAX_IDLE, idle_expiry: float = 30.0):
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._max_idle = max_idle_per_upstream
        self._idle_expiry = idle_expiry
        self._pools: dict[Upstream, Pool] = {}
        self._by_id: dict[int, Pool] = {}
        self.deadlines = Deadlines(period=max(0.02, min(1.0, request_timeout / 8)))
        self._loop: asyncio.AbstractEventLoop | None = None
        self.open_session: SessionOpener | None = None
        """Set when requests may go over HTTP/2 (``upstreamHTTP2``)."""
        self.http2_all = False
        """Every request over HTTP/2 where the upstream speaks it, not only the
        long-running ones (``upstreamHTTP2: all``)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop, looked up once (each lookup is a system call on CPython 3.11)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def set_timeouts(self, *, connect: float, request: float) -> None:
        """New timeouts (a configuration reload): for requests and connections that
        start from now on."""
        self.connect_timeout, self.request_timeout = connect, request
        for pool in self._pools.values():
            pool.connect_timeout = connect

    def pool(self, upstream: Upstream) -> Pool:
        # By identity first: hashing the frozen dataclass costs more than the rest of
        # the lookup, and the same Upstream objects come back on every request.
        pool = self._by_id.get(id(upstream))
        if pool is not None and pool.upstream is upstream:
            return pool
        pool = self._pools.get(upstream)
        if pool is None:
            pool = self._pools[upstream] = Pool(
                upstream, connect_timeout=self.connect_timeout, max_idle=self._max_idle,
                idle_expiry=self._idle_expiry, open_session=self.open_session)
        self._by_id[id(upstream)] = pool
        return pool

    def drop_idle_of(self, upstream: Upstream) -> None:
        """After a stale pooled connection: the others to that upstream likely died too."""
        pool = self.pool(upstream)
        for idle in pool.idle:
            idle.close()
        pool.idle.clear()

    def drop_idle(self, name: str) -> None:
        """Close the idle connections to upstream ``name``: the next request connects
        afresh, and a server that stopped answering then fails within the connect
        timeout instead of holding a request on an old connection."""
        for upstream, pool in self._pools.items():
            if upstream.name == name:
                for conn in pool.idle:
                    conn.close()
                pool.idle.clear()
                sessions, pool.sessions = pool.sessions, []
                for session in sessions:
                    session.close()  # what they carry finishes; nothing new goes there

    def reset(self, name: str) -> int:
        """Drop every pool of upstream ``name`` (both flavours); returns the requests
        aborted."""
        return sum(pool.reset() for upstream, pool in self._pools.items()
                   if upstream.name == name)

    def http2_sessions(self) -> tuple[int, int]:
        """HTTP/2 connections open to every upstream, and the requests they carry."""
        sessions = [s for pool in self._pools.values() for s in pool.sessions]
        return len(sessions), sum(s.carrying for s in sessions)

    async def fetch(self, upstream: Upstream, path: str, *, headers: Mapping[str, str],
                    timeout: float, max_bytes: int) -> Fetched:
        """GET ``path`` and read the body whole, refusing bodies over ``max_bytes``.

        A reused connection that fails before any response byte is retried once on a
        fresh one (GET is idempotent).
        """
        if target_problem(path):
            raise UpstreamProtocolError(upstream.name, "refusing a target that is not an "
                                                       "origin-form path")
        head = wire.request_head("GET", path, upstream.authority, list(headers.items()))
        pool = self.pool(upstream)
        try:
            async with asyncio.timeout(timeout):
                for attempt in (1, 2):
                    conn, reused = await pool.acquire()
                    collector = _Collector(upstream.name, max_bytes, self.loop)
                    conn.send(head, collector, method="GET")
                    try:
                        await collector.done
                    except UpstreamProtocolError:
                        pool.discard(conn)
                        if attempt == 1 and reused and not conn.received:
                            continue
                        raise
                    except BaseException:
                        pool.discard(conn)
                        raise
                    pool.release(conn)
                    return collector.result()
        except TimeoutError as exc:
            raise _caused_by(UpstreamTimeout(upstream.name, "timed out"), exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        pools, self._pools, self._by_id = list(self._pools.values()), {}, {}
        for pool in pools:
            pool.reset()
        await self.deadlines.close()
        await asyncio.sleep(0)  # let the transports run their close callbacks


class _Collector:
    """Reads a whole (bounded) response for ``fetch``."""

    def __init__(self, name: str, max_bytes: int, loop: asyncio.AbstractEventLoop):
        self.name = name
        self.max_bytes = max_bytes
        self.done: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.fields: wire.Fields = []
        self.body = bytearray()

    def result(self) -> Fetched:
        return Fetched(self.status, CIMultiDictProxy(CIMultiDict(self.fields)), bytes(self.body))

    def on_interim(self, status: int, reason: bytes, raw: wire.RawFields,
                   lowered: list[bytes]) -> None:
        pass

    def on_head(self, status: int, reason: bytes, raw: wire.RawFields,
                lowered: list[bytes]) -> None:
        fields = wire.decoded(raw)
        self.status, self.fields = status, fields
        declared = wire.first(fields, "content-length")
        if declared.isdigit() and int(declared) > self.max_bytes:
            self.on_error(BodyTooLarge(self.name, f"body of {declared} bytes exceeds the "
                                                  f"{self.max_bytes}-byte limit"))

    def on_body(self, data: bytes) -> None:
        if self.done.done():
            return
        self.body += data
        if len(self.body) > self.max_bytes:
            self.on_error(BodyTooLarge(self.name, f"body exceeds the {self.max_bytes}-byte limit"))

    def on_end(self, trailers: wire.RawFields) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def on_upgrade(self, early: bytes) -> None:
        self.on_error(UpstreamProtocolError(self.name, "unexpected protocol switch"))

    def on_error(self, error: UpstreamError) -> None:
        if not self.done.done():
            self.done.set_exception(error)
            self.body = bytearray()

    def flush(self) -> None:
        pass
