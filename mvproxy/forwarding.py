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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, AnyStr

from multidict import CIMultiDict

from mvproxy import failover, tunnel, wire
from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
)
from mvproxy.identity import REMOTE_PREFIX, Downstream, identity_headers
from mvproxy.listener import DownstreamConnection, Exchange
from mvproxy.logs import V, kv
from mvproxy.transport import Pool, Transport, Upstream, UpstreamConnection
from mvproxy.wire import PEER_PROXIED

log = logging.getLogger(__name__)

AUDIT_ID = "Audit-ID"
UNSERVED = failover.UNSERVED
"""Set by an mvproxy on its 503 when nothing reached its backend. Only read on answers
from peers (whose serving certificates mvproxy verified), and never relayed: the
first mvproxy fails over to another capable peer instead."""
IDEMPOTENT = failover.IDEMPOTENT
REPLAY_LIMIT = 1024 * 1024
"""Request-body bytes kept so a request can go to the next peer if the first one says
nothing reached its backend (Kubernetes objects are at most ~1.5 MiB; larger bodies
are not replayed and such a request gets that peer's 503)."""
HOP_BY_HOP = wire.HOP_BY_HOP
REFRAMED = frozenset(("content-length", "expect"))
"""Set by ``forward`` only when it streams the body: a request whose body mvproxy does
not send (discovery probes, OpenAPI index) must not announce one, or the upstream
waits for it, or reads the next request on the connection as that body."""


@dataclass(frozen=True)
class _Names:
    """The names the header filter compares with, as text or as bytes."""

    dropped: frozenset
    underscore: str | bytes
    connection: str | bytes
    remote_prefix: str | bytes
    peer_proxied: str | bytes
    remote_user: str | bytes
    forwarded_for: str | bytes
    host: str | bytes
    set_to_peer: frozenset


def _kept(fields: list, peer: bool, to_peer: bool, n: _Names) -> tuple[list, list, Any]:
    """(lowercased name, name, value) of the client's fields that go upstream, the
    ``X-Forwarded-For`` values the client sent, and its ``Host`` (or None).

    Hop-by-hop fields, those ``Connection`` names, framing (set by ``forward``) and
    names with an underscore are dropped; identity fields too unless a peer sent them
    (it vouches for the user), and a peer's marker when it goes to another peer (set
    again, once); to a peer, the ``X-Forwarded-`` fields mvproxy sets there.
    ``X-Forwarded-For`` is returned apart: the caller appends the client's address.
    One pass; a second only if ``Connection`` names some.
    """
    kept = []
    forwarded: list = []
    host = None
    tokens = None
    for name, value in fields:
        lowered = name.lower()
        if lowered in n.dropped or n.underscore in lowered:
            if lowered == n.connection:
                tokens = (tokens or set()) | wire.connection_tokens(value)
            elif lowered == n.forwarded_for:
                forwarded.append(value)
            elif lowered == n.host:
                host = value
            continue
        if lowered.startswith(n.remote_prefix) or lowered == n.peer_proxied:
            if not peer or (to_peer and lowered == n.peer_proxied):
                continue
        if to_peer and lowered in n.set_to_peer:
            continue
        kept.append((lowered, name, value))
    if tokens:
        kept = [item for item in kept if item[0] not in tokens]
        if n.forwarded_for in tokens:  # Go's ReverseProxy drops it before appending
            forwarded = []
    return kept, forwarded, host


def forwarded_for(prior: list[AnyStr], client: AnyStr, comma: AnyStr) -> AnyStr | None:
    """The ``X-Forwarded-For`` value to send: what came in, then the client's address
    (Go's ``httputil.ReverseProxy``, which kube-apiserver's proxies use). None when
    there is nothing to send."""
    if not client:
        return comma.join(prior) if prior else None
    # mypy rejects a constrained TypeVar's list unpacked in a display (python/mypy#17698)
    return comma.join([*prior, client]) if prior else client  # type: ignore[list-item]


def request_headers(fields: wire.Fields, downstream: Downstream, *,
                    to_peer: bool, client: str) -> CIMultiDict[str]:
    """Headers for the upstream: end-to-end ones, identity as ``identity`` allows,
    ``client`` (the downstream's address) appended to ``X-Forwarded-For``.

    A peer's own identity headers pass through (it vouches for the user); anyone
    else's are dropped and replaced by what mvproxy verified itself (``_kept``).
    """
    kept, prior, host = _kept(fields, downstream.is_peer, to_peer, _TEXT)
    out: CIMultiDict[str] = CIMultiDict([(name, value) for _, name, value in kept])
    chain = forwarded_for(prior, client, ", ")
    if chain is not None:
        out[FORWARDED_FOR] = chain
    for name, value in identity_headers(downstream):
        out.add(name, value)
    if to_peer:
        out[PEER_PROXIED] = "true"
        if AUDIT_ID not in out:
            out[AUDIT_ID] = str(uuid.uuid4())
        out[FORWARDED_PROTO] = "https"
        if host:
            out[FORWARDED_HOST] = host
    return out


def headers_for(exchange: Exchange, *, to_peer: bool) -> CIMultiDict[str]:
    """``request_headers`` for one exchange (its fields, identity and address)."""
    return request_headers(exchange.fields, exchange.downstream, to_peer=to_peer,
                           client=exchange.client_address)


def upstream_head(exchange: Exchange, authority: bytes, *, audit_id: bytes = b""
                  ) -> tuple[bytes, bool]:
    """The request head for an upstream, built from the client's raw fields with the
    same rules as ``request_headers`` (the hot path: nothing is decoded), and whether
    it asserts a user (then it goes to the backend with the front-proxy certificate).
    ``audit_id``: to a peer, marked peer-proxied, with this Audit-ID unless the client
    sent one."""
    downstream = exchange.downstream
    to_peer = bool(audit_id)
    kept, prior, host = _kept(exchange.raw, downstream.is_peer, to_peer, _RAW)
    parts = [b"%b %b HTTP/1.1\r\nHost: %b\r\n" % (exchange.raw_method, exchange.raw_target,
                                                     authority)]
    parts += [name + b": " + value + b"\r\n" for _, name, value in kept]
    parts.append(downstream.header_lines)
    chain = forwarded_for(prior, exchange.conn.raw_client_address, b", ")
    if chain is not None:
        parts.append(b"X-Forwarded-For: " + chain + b"\r\n")
    if to_peer:
        parts.append(b"x-kubernetes-peer-proxied: true\r\nX-Forwarded-Proto: https\r\n")
        if host:
            parts.append(b"X-Forwarded-Host: " + host + b"\r\n")
        if not any(lowered == b"audit-id" for lowered, _, _ in kept):
            parts.append(b"Audit-ID: " + audit_id + b"\r\n")
    if exchange.has_body:
        parts.append(b"Transfer-Encoding: chunked\r\n" if exchange.chunked
                     else b"Content-Length: %d\r\n" % (exchange.body_length or 0))
        parts += [b"Expect: " + v + b"\r\n" for n, v in exchange.raw if n.lower() == b"expect"]
    parts.append(b"\r\n")
    asserts = bool(downstream.header_lines) or any(
        lowered == _RAW.remote_user for lowered, _, _ in kept)
    return b"".join(parts), asserts


FORWARDED_FOR = "X-Forwarded-For"
FORWARDED_PROTO = "X-Forwarded-Proto"
FORWARDED_HOST = "X-Forwarded-Host"
_SET_TO_PEER = ("x-forwarded-proto", "x-forwarded-host")
"""Set by mvproxy on the peer hop, as upstream's peer proxy sets them; a client's own
values are replaced there, and pass through unchanged to the backend."""
_REQUEST_DROPPED = HOP_BY_HOP | REFRAMED | {"x-forwarded-for"}
_TEXT = _Names(frozenset(_REQUEST_DROPPED), "_", "connection", REMOTE_PREFIX,
               PEER_PROXIED, "x-remote-user", "x-forwarded-for", "host",
               frozenset(_SET_TO_PEER))
_RAW = _Names(frozenset(n.encode() for n in _REQUEST_DROPPED), b"_", b"connection",
              REMOTE_PREFIX.encode(), PEER_PROXIED.encode(), b"x-remote-user",
              b"x-forwarded-for", b"host", frozenset(n.encode() for n in _SET_TO_PEER))
RESPONSE_DROPPED = wire.HOP_BY_HOP_RAW | {b"content-length", UNSERVED.encode()}
UNSERVED_RAW = failover.UNSERVED_RAW


def response_headers(fields: wire.Fields) -> wire.Fields:
    """The upstream's fields minus hop-by-hop ones and its framing (each hop frames)."""
    named = {t for n, v in fields if n.lower() == "connection" for t in wire.connection_tokens(v)}
    dropped = HOP_BY_HOP | named | {"content-length", UNSERVED}
    return [(n, v) for n, v in fields if n.lower() not in dropped]


class ForwardError(Exception):
    """No response reached the downstream; ``retryable`` if another upstream may try."""

    def __init__(self, cause: UpstreamError, *, retryable: bool):
        super().__init__(str(cause))
        self.cause = cause
        self.retryable = retryable


async def forward(exchange: Exchange, transport: Transport, upstream: Upstream,
                  headers: CIMultiDict[str], *, long_running: bool,
                  reroutable: bool = False) -> None:
    """Send the request to ``upstream`` and stream the answer to the downstream.

    Raises ``ForwardError`` if no response started, saying whether the request may
    go to another upstream; once the response has started, an upstream failure can
    only end the stream, so the downstream connection is closed instead.
    ``reroutable``: another server could take the request, so the backend's refusal
    while shutting down (``_Relay.on_head``) is a ``ForwardError`` too, not relayed.
    """
    head = request_head(exchange, upstream, headers)
    if not exchange.replayable():
        # A retry after the body went to a connection that died, with no copy kept:
        # announcing it again would leave the upstream waiting for bytes never sent.
        raise ForwardError(UpstreamProtocolError(
            upstream.name, "the connection closed after the request body was sent"),
            retryable=False)
    if upstream.is_peer and exchange.has_body:
        exchange.keep_body_copy(REPLAY_LIMIT)
    pool = transport.pool(upstream)
    for attempt in (1, 2):
        try:
            conn, _ = await pool.acquire()
        except UpstreamConnectError as exc:
            raise ForwardError(exc, retryable=exchange.replayable()) from exc
        try:
            await _exchange(exchange, pool, conn, head, transport, long_running, reroutable)
            return
        except _StaleConnection:
            # A pooled connection the upstream had closed: nothing of this request was
            # answered; an idempotent one goes once more, on a fresh connection (the
            # other idle ones probably died with it: the server restarted or left).
            cause = UpstreamProtocolError(upstream.name, "connection closed before any response")
            if attempt == 2 or not exchange.replayable():
                raise ForwardError(cause, retryable=failover.may_resend(
                    cause, exchange.method, not exchange.replayable())) from None
            for idle in list(pool.idle):
                idle.close()
            pool.idle.clear()
            log.log(V(4), "retrying on a fresh connection", extra=kv(upstream=upstream.name))


def request_head(exchange: Exchange, upstream: Upstream, headers: CIMultiDict[str]) -> bytes:
    """The upstream request head: ``headers`` plus the framing of a streamed body, or the
    upgrade fields; ForwardError if a value cannot be sent (a line break, say)."""
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
        return wire.request_head(exchange.method, exchange.target, upstream.authority, fields)
    except wire.UnsafeHeader as exc:
        raise ForwardError(UpstreamProtocolError(upstream.name, str(exc)),
                           retryable=False) from exc


class _StaleConnection(Exception):
    """A reused connection ended before any response byte (idempotent requests only)."""


HeadFailure = ForwardError | _StaleConnection
"""Why ``forward_now`` answered nothing: a failure, or a dead pooled connection (the
caller tries a fresh one)."""


def _head_failure(error: BaseException, exchange: Exchange, conn: UpstreamConnection
                  ) -> HeadFailure:
    """What a failure before the response head means for the request."""
    assert isinstance(error, (UpstreamError, _TimedOut))
    cause, stale = failover.classify(
        None if isinstance(error, _TimedOut) else error, conn.upstream.name,
        method=exchange.method, reset=conn.reset, received=conn.received,
        reused=conn.requests > 1)
    if stale:
        return _StaleConnection()
    body_gone = exchange.body_started if isinstance(error, _TimedOut) \
        else not exchange.replayable()
    return ForwardError(cause, retryable=failover.may_resend(cause, exchange.method,
                                                             body_gone))


def forward_now(exchange: Exchange, transport: Transport, upstream: Upstream,
                head: bytes, *, long_running: bool,
                finished: Callable[[HeadFailure | None, bool], None],
                reroutable: bool = False) -> _Inline | None:
    """The common case without a coroutine: a plain request on an idle pooled
    connection, moved entirely by protocol callbacks. None: nothing was done (no idle
    connection, or an upgrade), use ``forward``. ``finished(failure,
    cancelled)`` is called once: failure None when the answer went out (or was cut),
    else what stopped it before any answer (the caller continues in a coroutine).
    ``reroutable`` as for ``forward``."""
    if exchange.upgrade:
        return None
    pool = transport.pool(upstream)
    conn = pool.take_idle()
    if conn is None:
        return None
    if upstream.is_peer and exchange.has_body:
        exchange.keep_body_copy(REPLAY_LIMIT)
    inline = _Inline(exchange, transport, pool, conn, long_running, finished, reroutable)
    inline.start(head)
    return inline


class _Inline:
    """One request forwarded by callbacks alone (see ``forward_now``)."""

    __slots__ = ("exchange", "transport", "pool", "conn", "long_running", "finished", "relay")

    def __init__(self, exchange: Exchange, transport: Transport, pool: Pool,
                 conn: UpstreamConnection, long_running: bool,
                 finished: Callable[[HeadFailure | None, bool], None],
                 reroutable: bool = False):
        self.exchange, self.transport, self.pool, self.conn = exchange, transport, pool, conn
        self.long_running, self.finished = long_running, finished
        self.relay = _Relay(exchange, conn, transport.loop,
                            check_unserved=pool.upstream.is_peer, notify=self.settled,
                            check_shutdown=reroutable)

    def start(self, head: bytes) -> None:
        transport, relay, exchange = self.transport, self.relay, self.exchange
        transport.deadlines.add(relay, transport.loop.time() + transport.request_timeout,
                                relay.expire, transport.loop)
        self.conn.send(head, relay, method=exchange.method)
        if exchange.has_body:
            exchange.attach_body(relay.body_sink)

    def settled(self, stage: str, error: BaseException | None) -> None:
        if stage == "head":
            if error is None:
                if self.long_running:
                    self.transport.deadlines.discard(self.relay)  # may stay open for hours
                return
            failure = _head_failure(error, self.exchange, self.conn)
            self._cleanup(release=False)
            self.finished(failure, False)
            return
        if error is None:
            self._cleanup(release=not self.relay.body_pending())
        else:
            log.log(V(3), "stream ended early; closing the downstream connection",
                    extra=kv(upstream=self.pool.upstream.name, error=str(error)[:200]))
            self.exchange.abort()
            self._cleanup(release=False)
        self.finished(None, False)

    def cancel(self) -> None:
        """The client left, or shutdown ends the request: drop the upstream side."""
        self._cleanup(release=False)
        self.finished(None, True)

    def _cleanup(self, *, release: bool) -> None:
        self.transport.deadlines.discard(self.relay)
        self.exchange.detach_body()
        self.relay.notify = None  # nothing more is reported
        if release:
            self.pool.release(self.conn)
        else:
            self.pool.discard(self.conn)


async def _exchange(exchange: Exchange, pool: Pool, conn: UpstreamConnection, head: bytes,
                    transport: Transport, long_running: bool, reroutable: bool) -> None:
    upstream = pool.upstream
    loop = transport.loop
    relay = _Relay(exchange, conn, loop, check_unserved=upstream.is_peer,
                   check_shutdown=reroutable)
    assert relay.head is not None and relay.done is not None  # no notify: future mode
    deadlines = transport.deadlines
    deadlines.add(relay, loop.time() + transport.request_timeout, relay.expire, loop)
    conn.send(head, relay, method=exchange.method)
    if exchange.has_body and not exchange.upgrade:
        exchange.attach_body(relay.body_sink)
    released = False
    try:
        try:
            await relay.head
        except (UpstreamError, _TimedOut) as error:
            raise _head_failure(error, exchange, conn) from error
        if long_running:
            deadlines.discard(relay)  # a watch may stay open for hours
        if relay.upgraded is not None:
            released = True  # the tunnel owns the connection now
            pool.forget(conn)
            await tunnel.relay(exchange, conn, relay.status, relay.reason, relay.raw,
                               relay.lowered, relay.upgraded)
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


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class _TimedOut(Exception):
    """The request's deadline passed (``Transport.deadlines``)."""


class _Relay:
    """Moves one upstream response to the downstream exchange (a ResponseHandler)."""

    def __init__(self, exchange: Exchange, conn: UpstreamConnection,
                 loop: asyncio.AbstractEventLoop, *, check_unserved: bool,
                 notify: Callable[[str, BaseException | None], None] | None = None,
                 check_shutdown: bool = False):
        self.exchange = exchange
        self.conn = conn
        self.check_unserved = check_unserved
        self.check_shutdown = check_shutdown
        """A 429 with ``Connection: close`` (kube-apiserver shutting down) fails the
        head instead of being relayed, when the request could be sent elsewhere."""
        self.notify = notify
        """Callback mode (``_Inline``): told ("head" | "done", error) instead of futures."""
        self.head: asyncio.Future[None] | None = None
        self.done: asyncio.Future[None] | None = None
        if notify is None:
            self.head, self.done = loop.create_future(), loop.create_future()
            # A failure may settle a future nobody awaits any more (the head failed and
            # the connection then closed): without this asyncio reports it at exit as
            # "Future exception was never retrieved".
            self.head.add_done_callback(_retrieved)
            self.done.add_done_callback(_retrieved)
        self._head_settled = self._done_settled = False
        self.status = 0
        self.reason = b""
        self.raw: wire.RawFields = []
        self.lowered: list[bytes] = []
        self.upgraded: bytes | None = None
        self._out: list[bytes] = []
        self._ended: wire.Fields | None = None
        self._with_body = exchange.method != "HEAD"
        self._body_sent = not exchange.has_body or exchange.upgrade
        self._chunked_body = exchange.chunked

    @property
    def downstream(self) -> DownstreamConnection:
        """Where the response goes (the upstream connection reads in small pieces
        while it is behind: ``flow.READ_CHUNK_BEHIND``)."""
        return self.exchange.conn

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

    def on_interim(self, status: int, reason: bytes, raw: wire.RawFields,
                   lowered: list[bytes]) -> None:
        if self.exchange.version >= (1, 1) and not self.exchange.started:
            dropped = RESPONSE_DROPPED | wire.raw_connection_tokens(raw, lowered)
            self.exchange.conn.write(wire.status_line(status, reason)
                                     + wire.raw_lines(raw, lowered, dropped) + b"\r\n")

    def on_head(self, status: int, reason: bytes, raw: wire.RawFields,
                lowered: list[bytes]) -> None:
        self.status, self.reason, self.raw, self.lowered = status, reason, raw, lowered
        if (status == 503 and self.check_unserved) or (status == 429 and self.check_shutdown):
            refused = failover.refusal(status, raw, lowered, self.conn.upstream.name,
                                       to_peer=self.check_unserved,
                                       reroutable=self.check_shutdown,
                                       replayable=self.exchange.replayable())
            if refused is not None:
                self._settle("head", refused)
                return
        if status == 101:
            return  # on_upgrade follows
        dropped = RESPONSE_DROPPED
        if b"connection" in lowered:  # every Connection field names fields to drop
            dropped = dropped | wire.raw_connection_tokens(raw, lowered)
        length = None
        if b"content-length" in lowered:
            length = raw[lowered.index(b"content-length")][1]
        self.exchange.start_raw(status, wire.status_line(status, reason)
                                + wire.raw_lines(raw, lowered, dropped), length=length,
                                bodiless=not self._with_body or status in (204, 304))
        self._settle("head", None)

    def on_body(self, data: bytes) -> None:
        if self._with_body and self.exchange.started:
            self._out.append(data)

    def on_end(self, trailers: wire.RawFields) -> None:
        self._ended = wire.decoded(trailers) if trailers else []
        if not self._head_settled:  # e.g. the unserved marker's body ended
            self._settle("head", None)

    def on_upgrade(self, early: bytes) -> None:
        self.upgraded = early
        self._settle("head", None)

    def expire(self) -> None:
        """The request timeout passed: whichever wait is current ends with _TimedOut."""
        self._settle("done" if self._head_settled else "head", _TimedOut())

    def on_error(self, error: UpstreamError) -> None:
        self._settle("done" if self._head_settled else "head", error)

    def flush(self) -> None:
        """Everything parsed from one read goes out in one write."""
        exchange = self.exchange
        if not exchange.started or exchange.finished:
            return
        data = b"".join(self._out) if len(self._out) != 1 else self._out[0]
        self._out.clear()
        if self._ended is not None:
            exchange.write(data, end=True, trailers=self._ended)
            self._settle("done", None)
            return
        exchange.write(data)
        downstream = exchange.conn
        if downstream.paused_writing:
            conn = self.conn
            conn.pause_reading("downstream")
            downstream.when_writable(lambda: conn.resume_reading("downstream"))

    def _settle(self, stage: str, error: BaseException | None) -> None:
        """Report the head ("head") or the end ("done"), once each, to the future or
        to ``notify``."""
        if stage == "head":
            if self._head_settled:
                return
            self._head_settled = True
            future = self.head
        else:
            if self._done_settled:
                return
            self._done_settled = True
            future = self.done
        if self.notify is not None:
            self.notify(stage, error)
        elif future is not None and not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
