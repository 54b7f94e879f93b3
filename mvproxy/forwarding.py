"""Moving one request to an upstream and its response back, streaming both ways.

Nothing here decides a route: ``handlers`` passes the upstream (and the headers
``identity`` allows). Bodies are never buffered whole: the request body goes to the
upstream as the client sends it (reading pauses while the upstream is behind), and
the response goes to the client as it arrives, one write per read from the
upstream, so a small answer is one write and a watch event reaches the client when
the upstream sends it. Flow control runs in the protocols' callbacks; the handler
coroutine only waits for the head and for the end.

The request target goes out byte for byte as received: upstream kube-apiserver
re-encodes and sorts the query and drops escaped path segments (upstream-mvp.md §8.9);
mvproxy does neither, and it only ever sends an origin-form target (``requestcheck``)
to the upstream it was given.

``Connection: Upgrade`` requests (exec, attach, port-forward, WebSocket watches) use
the same path up to the upstream's answer; on a ``101`` both connections switch to
raw byte relaying (``tunnel``), with the same identity headers as a plain request
(upstream-mvp.md §8.1 is the bug mvproxy must not repeat).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from multidict import CIMultiDict

from mvproxy import tunnel, wire
from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
    UpstreamUnserved,
)
from mvproxy.identity import (
    PEER_PROXIED,
    Downstream,
    identity_headers,
    is_identity_header,
)
from mvproxy.listener import Exchange
from mvproxy.logs import V, kv
from mvproxy.requestcheck import header_name_forwarded
from mvproxy.transport import Pool, Transport, Upstream, UpstreamConnection

log = logging.getLogger(__name__)

AUDIT_ID = "Audit-ID"
UNSERVED = "x-mvproxy-unserved"
"""Set by an mvproxy on its 503 when nothing reached its backend. Only read on answers
from peers (whose serving certificates mvproxy verified), and never relayed: the
first mvproxy fails over to another capable peer instead."""
IDEMPOTENT = frozenset(("GET", "HEAD", "OPTIONS"))
REPLAY_LIMIT = 1024 * 1024
"""Request-body bytes kept so a request can go to the next peer if the first one says
nothing reached its backend (Kubernetes objects are at most ~1.5 MiB; larger bodies
are not replayed and such a request gets that peer's 503)."""
HOP_BY_HOP = wire.HOP_BY_HOP
REFRAMED = frozenset(("content-length", "expect"))
"""Set by ``forward`` only when it streams the body: a request whose body mvproxy does
not send (discovery probes, OpenAPI index) must not announce one, or the upstream
waits for it, or reads the next request on the connection as that body."""


def request_headers(fields: wire.Fields, downstream: Downstream, *,
                    to_peer: bool) -> CIMultiDict[str]:
    """Headers for the upstream: end-to-end ones, identity as ``identity`` allows.

    A peer's own identity headers pass through (it vouches for the user); anyone
    else's are dropped and replaced by what mvproxy verified itself. Names with an
    underscore are dropped (``requestcheck.header_name_forwarded``).
    """
    dropped = HOP_BY_HOP | REFRAMED | wire.connection_tokens(fields)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in fields:
        lowered = name.lower()
        if lowered in dropped or not header_name_forwarded(lowered):
            continue
        if is_identity_header(lowered) and not downstream.is_peer:
            continue
        if lowered == PEER_PROXIED and to_peer:
            continue  # set below, exactly once
        out.add(name, value)
    for name, value in identity_headers(downstream):
        out.add(name, value)
    if to_peer:
        out[PEER_PROXIED] = "true"
        if AUDIT_ID not in out:
            out[AUDIT_ID] = str(uuid.uuid4())
    return out


def response_headers(fields: wire.Fields) -> wire.Fields:
    """The upstream's fields minus hop-by-hop ones and its framing (each hop frames)."""
    dropped = HOP_BY_HOP | wire.connection_tokens(fields) | {"content-length", UNSERVED}
    return [(n, v) for n, v in fields if n.lower() not in dropped]


class ForwardError(Exception):
    """No response reached the downstream; ``retryable`` if another upstream may try."""

    def __init__(self, cause: UpstreamError, *, retryable: bool):
        super().__init__(str(cause))
        self.cause = cause
        self.retryable = retryable


def _may_resend(exc: UpstreamError, method: str, body_started: bool) -> bool:
    """Never resend bytes that may have reached a server, unless the method is idempotent.

    A body already read from the downstream is gone: it cannot be sent again, whatever
    the method (unless a copy was kept, which the caller checks).
    """
    if body_started:
        return False
    if isinstance(exc, (UpstreamConnectError, UpstreamUnserved)):
        return True
    return method in IDEMPOTENT


async def forward(exchange: Exchange, transport: Transport, upstream: Upstream,
                  headers: CIMultiDict[str], *, long_running: bool) -> None:
    """Send the request to ``upstream`` and stream the answer to the downstream.

    Raises ``ForwardError`` if no response started, saying whether the request may
    go to another upstream; once the response has started, an upstream failure can
    only end the stream, so the downstream connection is closed instead.
    """
    fields = list(headers.items())
    if exchange.has_body:  # never an upgrade: the listener refuses upgrades with a body
        if exchange.chunked:
            fields.append(("Transfer-Encoding", "chunked"))
        else:
            fields.append(("Content-Length", str(exchange.body_length)))
        fields += [("Expect", value) for value in wire.values(exchange.fields, "expect")]
    if exchange.upgrade:
        fields += [("Connection", "Upgrade"),
                   ("Upgrade", ", ".join(wire.values(exchange.fields, "upgrade")))]
    try:
        head = wire.request_head(exchange.method, exchange.target, upstream.authority, fields)
    except wire.UnsafeHeader as exc:
        raise ForwardError(UpstreamProtocolError(upstream.name, str(exc)),
                           retryable=False) from exc
    if upstream.is_peer and exchange.has_body:
        exchange.keep_body_copy(REPLAY_LIMIT)
    pool = transport.pool(upstream)
    for attempt in (1, 2):
        try:
            conn, _ = await pool.acquire()
        except UpstreamConnectError as exc:
            raise ForwardError(exc, retryable=exchange.replayable()) from exc
        try:
            await _exchange(exchange, pool, conn, head, transport, long_running)
            return
        except _StaleConnection:
            # A pooled connection the upstream had closed: nothing of this request was
            # answered; an idempotent one goes once more, on a fresh connection (the
            # other idle ones probably died with it: the server restarted or left).
            cause = UpstreamProtocolError(upstream.name, "connection closed before any response")
            if attempt == 2 or not exchange.replayable():
                raise ForwardError(cause, retryable=_may_resend(
                    cause, exchange.method, not exchange.replayable())) from None
            for idle in list(pool.idle):
                idle.close()
            pool.idle.clear()
            log.log(V(4), "retrying on a fresh connection", extra=kv(upstream=upstream.name))


class _StaleConnection(Exception):
    """A reused connection ended before any response byte (idempotent requests only)."""


async def _exchange(exchange: Exchange, pool: Pool, conn: UpstreamConnection, head: bytes,
                    transport: Transport, long_running: bool) -> None:
    upstream = pool.upstream
    loop = transport.loop
    relay = _Relay(exchange, conn, loop, check_unserved=upstream.is_peer)
    deadlines = transport.deadlines
    deadlines.add(relay, loop.time() + transport.request_timeout, relay.expire, loop)
    conn.send(head, relay, method=exchange.method)
    if exchange.has_body and not exchange.upgrade:
        exchange.attach_body(relay.body_sink)
    released = False
    try:
        try:
            await relay.head
        except UpstreamError as error:
            cause: UpstreamError = error
            if conn.reset and not conn.received:
                cause = UpstreamUnreachable(upstream.name, "stopped answering; polling found "
                                                           "it unreachable")
            elif (isinstance(error, UpstreamProtocolError) and not conn.received
                  and conn.requests > 1 and exchange.method in IDEMPOTENT):
                raise _StaleConnection() from error
            raise ForwardError(cause, retryable=_may_resend(
                cause, exchange.method, not exchange.replayable())) from error
        except _TimedOut as exc:
            cause = UpstreamTimeout(upstream.name, "timed out waiting for the response")
            raise ForwardError(cause, retryable=_may_resend(
                cause, exchange.method, exchange.body_started)) from exc
        if long_running:
            deadlines.discard(relay)  # a watch may stay open for hours
        if relay.upgraded is not None:
            released = True  # the tunnel owns the connection now
            pool.forget(conn)
            await tunnel.relay(exchange, conn, relay.status, relay.reason, relay.fields,
                               relay.upgraded)
            return
        try:
            await relay.done
        except (UpstreamError, _TimedOut) as exc:
            log.log(V(3), "stream ended early; closing the downstream connection",
                    extra=kv(upstream=upstream.name, error=str(exc)[:200]))
            exchange.abort()
            return
        if relay.body_pending():
            released = True
            pool.discard(conn)  # the upstream answered before taking the whole body
        else:
            released = True
            pool.release(conn)
    finally:
        deadlines.discard(relay)
        exchange.detach_body()
        if not released:
            pool.discard(conn)


class _TimedOut(Exception):
    """The request's deadline passed (``Transport.deadlines``)."""


class _Relay:
    """Moves one upstream response to the downstream exchange (a ResponseHandler)."""

    def __init__(self, exchange: Exchange, conn: UpstreamConnection,
                 loop: asyncio.AbstractEventLoop, *, check_unserved: bool):
        self.exchange = exchange
        self.conn = conn
        self.check_unserved = check_unserved
        self.head: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.reason = ""
        self.fields: wire.Fields = []
        self.upgraded: bytes | None = None
        self._out: list[bytes] = []
        self._ended: wire.Fields | None = None
        self._with_body = exchange.method != "HEAD"
        self._body_sent = not exchange.has_body or exchange.upgrade
        self._chunked_body = exchange.chunked

    # ---------------------------------------------------------------- request body

    def body_sink(self, data: bytes) -> None:
        conn = self.conn
        if not data:
            if self._chunked_body:
                conn.write(wire.LAST_CHUNK)
            self._body_sent = True
            return
        conn.write(wire.chunk(data) if self._chunked_body else data)
        if conn.paused_writing:
            downstream = self.exchange.conn
            downstream.pause_reading("upstream")
            conn.when_writable(lambda: downstream.resume_reading("upstream"))

    def body_pending(self) -> bool:
        return not self._body_sent

    # ---------------------------------------------------------------- ResponseHandler

    def on_interim(self, status: int, reason: str, fields: wire.Fields) -> None:
        if self.exchange.version >= (1, 1) and not self.exchange.started:
            self.exchange.conn.write(wire.response_head(status, reason, response_headers(fields)))

    def on_head(self, status: int, reason: str, fields: wire.Fields) -> None:
        self.status, self.reason, self.fields = status, reason, fields
        if self.check_unserved and status == 503 and wire.first(fields, UNSERVED):
            self._settle(self.head, UpstreamUnserved(self.conn.upstream.name,
                                                     "nothing reached its backend"))
            return
        if status == 101:
            return  # on_upgrade follows
        out = response_headers(fields)
        length = wire.first(fields, "content-length")
        if length and (status not in (204, 304)):
            out.append(("Content-Length", length))
        elif self._with_body and status not in (204, 304) and not 100 <= status < 200:
            out.append(("Transfer-Encoding", "chunked"))
        self.exchange.start(status, out, reason=reason, hold=True)
        self._settle(self.head, None)

    def on_body(self, data: bytes) -> None:
        if self._with_body and self.exchange.started:
            self._out.append(data)

    def on_end(self, trailers: wire.Fields) -> None:
        self._ended = trailers
        if not self.head.done():  # e.g. the unserved marker's body ended
            self._settle(self.head, None)

    def on_upgrade(self, early: bytes) -> None:
        self.upgraded = early
        self._settle(self.head, None)

    def expire(self) -> None:
        """The request timeout passed: whichever wait is current ends with _TimedOut."""
        self._settle(self.head if not self.head.done() else self.done, _TimedOut())

    def on_error(self, error: UpstreamError) -> None:
        if not self.head.done():
            self._settle(self.head, error)
        else:
            self._settle(self.done, error)

    def flush(self) -> None:
        """Everything parsed from one read goes out in one write."""
        exchange = self.exchange
        if not exchange.started or exchange.finished:
            return
        data = b"".join(self._out) if len(self._out) != 1 else self._out[0]
        self._out.clear()
        if self._ended is not None:
            exchange.write(data, end=True, trailers=self._ended)
            self._settle(self.done, None)
            return
        exchange.write(data)
        downstream = exchange.conn
        if downstream.paused_writing:
            conn = self.conn
            conn.pause_reading("downstream")
            downstream.when_writable(lambda: conn.resume_reading("downstream"))

    @staticmethod
    def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
