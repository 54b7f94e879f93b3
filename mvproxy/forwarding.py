"""Moving one request to an upstream and its response back, streaming both ways.

Nothing here decides a route: ``handlers`` passes the upstreams to try (the backend,
or capable peers in order) and the request head ``identity`` allows; ``Forward``, one
object per request, moves it by protocol callbacks alone and asks ``failover`` what
follows a failure before any answer (a fresh connection, the next candidate, a peer
instead of the backend, or a ``Status``). Bodies are never buffered whole: the
request body goes to the upstream as the client sends it (reading pauses while the
upstream is behind), and the response goes to the client as it arrives, one write
per read from the upstream, so a small answer is one write and a watch event reaches
the client when the upstream sends it.

The request target goes out byte for byte as received: upstream kube-apiserver
re-encodes and sorts the query and drops escaped path segments (measured in
docs/upstream-comparison.md);
mvproxy does neither, and it only ever sends an origin-form target (``requestcheck``)
to the upstream it was given.

``Connection: Upgrade`` requests (exec, attach, port-forward, WebSocket watches) use
the same path up to the upstream's answer; on a ``101`` both connections switch to
raw byte relaying (``tunnel``), with the same identity headers as a plain request
(upstream's own upgrade path drops them: docs/upstream-comparison.md, Identity).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast, overload

from multidict import CIMultiDict
from prometheus_client import Gauge, Histogram

from mvproxy import failover, tunnel, wire
from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from mvproxy.identity import REMOTE_PREFIX, Downstream, identity_headers
from mvproxy.kubestatus import Reply
from mvproxy.listener import DownstreamConnection, Exchange
from mvproxy.logs import V, kv
from mvproxy.metrics import Metrics
from mvproxy.requestinfo import RequestInfo
from mvproxy.routing import group_version_path
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


@overload
def forwarded_for(prior: list[str], client: str, comma: str) -> str | None: ...
@overload
def forwarded_for(prior: list[bytes], client: bytes, comma: bytes) -> bytes | None: ...
def forwarded_for(prior: list[str] | list[bytes], client: str | bytes,
                  comma: str | bytes) -> str | bytes | None:
    """The ``X-Forwarded-For`` value to send: what came in, then the client's address
    (Go's ``httputil.ReverseProxy``, which kube-apiserver's proxies use). None when
    there is nothing to send. Overloads, not ``AnyStr``: mypyc compiles this module and
    cannot narrow a type variable."""
    if isinstance(comma, bytes):
        raw = cast("list[bytes]", prior)
        if not client:
            return comma.join(raw) if raw else None
        return comma.join([*raw, cast(bytes, client)]) if raw else client
    text = cast("list[str]", prior)
    if not client:
        return comma.join(text) if text else None
    return comma.join([*text, cast(str, client)]) if text else client


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


def upstream_head(exchange: Exchange, authority: bytes, *, client: bytes,
                  audit_id: bytes = b"") -> tuple[bytes, bool]:
    """The request head for an upstream, built from the client's raw fields with the
    same rules as ``request_headers`` (the hot path: nothing is decoded), and whether
    it asserts a user (then it goes to the backend with the front-proxy certificate).
    ``audit_id``: to a peer, marked peer-proxied, with this Audit-ID unless the client
    sent one. ``client``: the downstream's address, appended to ``X-Forwarded-For``."""
    downstream = exchange.downstream
    to_peer = bool(audit_id)
    kept, prior, host = _kept(exchange.raw, downstream.is_peer, to_peer, _RAW)
    parts = [b"%b %b HTTP/1.1\r\nHost: %b\r\n" % (exchange.raw_method, exchange.raw_target,
                                                     authority)]
    parts += [name + b": " + value + b"\r\n" for _, name, value in kept]
    parts.append(downstream.header_lines)
    chain = forwarded_for(prior, client, b", ")
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
    if exchange.upgrade:  # never with a body: the listener refuses those
        parts.append(b"Connection: Upgrade\r\nUpgrade: " + b", ".join(
            v for n, v in exchange.raw if n.lower() == b"upgrade") + b"\r\n")
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
    """No response reached the downstream (``forward``); ``retryable`` if another
    upstream may try."""

    def __init__(self, cause: UpstreamError, *, retryable: bool):
        super().__init__(str(cause))
        self.cause = cause
        self.retryable = retryable


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


class Services(Protocol):
    """What the engine needs from the request path above it (``handlers.Proxy``)."""

    transport: Transport
    metrics: Metrics

    @property
    def retry_after(self) -> int:
        """Seconds a 503 asks clients to wait (reload may change it)."""

    def peers(self) -> Mapping[str, Upstream]:
        """The peers mvproxy knows now, by server ID."""

    def fallback(self, info: RequestInfo) -> tuple[str, ...]:
        """Capable peers, in order, for a request the backend did not take."""

    def unavailable(self, info: RequestInfo, peers: tuple[str, ...],
                    downstream: Downstream) -> Reply:
        """The 503 when membership has none of ``peers`` any more (``downstream``: who
        asks, which decides whether the answer names them)."""

    def backend_failed(self, error: str) -> None:
        """The backend is down or going (routing prefers peers until it polls well)."""


Target = tuple[str, Upstream]
Ended = Callable[["Forward", bool], None]
"""Told once when the request is over: ``(forward, cancelled)``."""


class Forward:
    """One forwarded request, moved by protocol callbacks alone (no task, except one
    per new upstream connection being dialled): the attempt list (the backend, or
    capable peers in order), the pooled connection and its relay, the failover rules
    on each failure before an answer (``failover.decide``), and one ``finish`` that
    records the request's metrics and hands the connections back."""

    __slots__ = (
        "audit_id", "conn", "dial", "downstream", "duration", "ended", "exchange",
        "failure", "fallback", "head", "index", "inflight", "info",
        "long_running", "on_end", "pool", "relay", "report", "rerouted", "retried_fresh",
        "services", "started", "targets", "to_peer", "transport", "tunnel", "verdict",
    )

    def __init__(self, transport: Transport, exchange: Exchange,
                 downstream: DownstreamConnection, targets: list[Target], head: bytes, *,
                 on_end: Ended, long_running: bool, to_peer: bool,
                 services: Services | None = None, info: RequestInfo | None = None,
                 fallback: bool = False, audit_id: bytes = b"",
                 route: tuple[Gauge, Histogram] | None = None, report: bool = False):
        self.transport, self.exchange, self.downstream = transport, exchange, downstream
        self.targets, self.index, self.head, self.to_peer = targets, 0, head, to_peer
        self.on_end, self.long_running, self.services, self.info = (
            on_end, long_running, services, info)
        self.fallback = fallback
        """The backend's failure may send the request to a peer (``may_fall_back``)."""
        self.audit_id = audit_id
        self.inflight: Gauge | None = route[0] if route is not None else None
        self.duration: Histogram | None = route[1] if route is not None else None
        self.report = report
        """Report the verdict (``forward``) instead of answering with it."""
        self.started = 0.0
        self.pool: Pool | None = None
        self.conn: UpstreamConnection | None = None
        self.relay: _Relay | None = None
        self.dial: asyncio.Task | None = None
        self.tunnel: tunnel.Tunnel | None = None
        self.retried_fresh = self.rerouted = self.ended = False
        self.verdict: failover.Verdict | None = None
        self.failure: Exception | None = None
        """A bug in mvproxy met inside the dialling task: the listener answers 500."""

    @property
    def from_peer(self) -> bool:
        """The downstream is a peer mvproxy (told when nothing reached the backend)."""
        return not self.report and self.exchange.downstream.is_peer

    # ---------------------------------------------------------------- attempts

    def start(self) -> None:
        if not self.report:  # else the awaiting task is what gets cancelled
            self.exchange.cancel_hook = self.cancel
        if self.inflight is not None:
            self.started = time.perf_counter()
            self.inflight.inc()
        if self.long_running and self.services is not None:
            self.services.metrics.open_watches.inc()
        if self.to_peer:
            self.rerouted = True
        self._attempt(again=False)

    def _attempt(self, *, again: bool = True) -> None:
        """Send to the current target. ``again``: not the first attempt, so the body
        may be gone already."""
        exchange = self.exchange
        upstream = self.targets[self.index][1]
        if again and not exchange.replayable():
            # After the body went to a connection that died, with no copy kept:
            # announcing it again would leave the upstream waiting for bytes never sent.
            self._failed(UpstreamProtocolError(
                upstream.name, "the connection closed after the request body was sent"))
            return
        if upstream.is_peer and exchange.has_body:
            exchange.keep_body_copy(REPLAY_LIMIT)
        transport = self.transport
        pool = self.pool = transport.pool(upstream)
        stream = upstream.h2_context is not None and not exchange.upgrade \
            and (self.long_running or transport.http2_all)
        conn = pool.take_stream() if stream else pool.take_idle()
        if conn is None:
            self.dial = transport.loop.create_task(self._connect(pool, stream))
            return
        self._send(conn)

    async def _connect(self, pool: Pool, stream: bool) -> None:
        """The one task of a request, while a new connection is dialled (or an HTTP/2
        one with room for it is found)."""
        try:
            conn = await (pool.connect_stream() if stream else pool.connect())
        except UpstreamConnectError as exc:
            self.dial = None
            self._guarded(self._failed, exc)
            return
        except Exception as exc:  # noqa: BLE001 - reported by the listener
            # A bug met while dialling: nobody awaits this task, so unanswered here the
            # request would hang in flight until the client left.
            self.dial = None
            self.failure = exc
            self.finish()
            return
        self.dial = None
        if self.ended:
            pool.release(conn)
            return
        self._guarded(self._send, conn)

    def _guarded(self, step: Callable[[Any], None], arg: Any) -> None:
        """Run ``step`` from the dialling task: nobody awaits it, so an exception
        ends the request here (the listener answers 500 if nothing went out)."""
        try:
            step(arg)
        except Exception as exc:  # noqa: BLE001 - reported by the listener
            self.failure = exc
            self.finish()

    def _send(self, conn: UpstreamConnection) -> None:
        self.conn = conn
        exchange, transport = self.exchange, self.transport
        relay = self.relay = _Relay(self, exchange, self.downstream, conn)
        transport.deadlines.add(relay, transport.loop.time() + transport.request_timeout,
                                relay.expire, transport.loop)
        conn.send(self.head, relay, method=exchange.method)
        if exchange.has_body and not exchange.upgrade:
            exchange.attach_body(relay.body_sink)

    # ---------------------------------------------------------------- relay reports

    def head_ok(self) -> None:
        relay, conn, pool = self.relay, self.conn, self.pool
        assert relay is not None and conn is not None and pool is not None
        if self.long_running:
            self.transport.deadlines.discard(relay)  # may stay open for hours
        if relay.upgraded is not None:
            self.transport.deadlines.discard(relay)
            pool.forget(conn)  # the tunnel owns the connection now
            self.conn = None
            self.exchange.detach_body()
            self.tunnel = tunnel.open_tunnel(
                self.exchange, self.downstream, conn, relay.status, relay.reason, relay.raw,
                relay.lowered, relay.upgraded, self.finish)

    def head_failed(self, error: UpstreamError) -> None:
        conn = self.conn
        assert conn is not None
        cause, stale = failover.classify(error, conn.upstream.name,
                                         method=self.exchange.method, reset=conn.reset,
                                         received=conn.received,
                                         reused=conn.requests > 1 or conn.refused)
        self._drop(release=False)
        self._failed(cause, stale=stale)

    def body_done(self, error: UpstreamError | None) -> None:
        relay = self.relay
        if error is None:
            self._drop(release=relay is not None and not relay.body_pending())
        else:
            log.log(V(3), "stream ended early; closing the downstream connection",
                    extra=kv(upstream=self.targets[self.index][1].name,
                             error=str(error)[:200]))
            self.exchange.abort()
            self._drop(release=False)
        self.finish()

    # ---------------------------------------------------------------- failover

    def _failed(self, cause: UpstreamError, *, stale: bool = False) -> None:
        exchange = self.exchange
        alternatives = self.index + 1 < len(self.targets) if self.to_peer else self.fallback
        failed = failover.Failed(cause, exchange.method, to_peer=self.to_peer,
                                 replayable=exchange.replayable(), stale=stale,
                                 retried_fresh=self.retried_fresh, alternatives=alternatives,
                                 from_peer=self.from_peer, body_started=exchange.body_started)
        services = self.services
        retry_after = services.retry_after if services is not None else 0
        verdict = failover.decide(failed, retry_after)
        name = self.targets[self.index][0]
        if verdict.action is failover.Action.RETRY_FRESH:
            # A pooled connection the upstream had closed: the other idle ones
            # probably died with it (the server restarted or left).
            self.retried_fresh = True
            self.transport.drop_idle_of(self.targets[self.index][1])
            log.log(V(4), "retrying on a fresh connection", extra=kv(upstream=name))
            self._attempt()
            return
        # Per request, so not a warning: during an outage there is one per request;
        # polling reports the upstream's state change once.
        if self.to_peer:
            log.log(V(3), "peer request failed", extra=kv(
                peer=name, error=str(verdict.cause)[:300], retry=verdict.retryable))
        else:
            log.log(V(3), "backend request failed", extra=kv(
                error=str(verdict.cause)[:300], retry=verdict.retryable))
        if not self.to_peer and verdict.backend_down and services is not None:
            services.backend_failed(f"request: {str(verdict.cause)[:200]}")
        if verdict.action is failover.Action.NEXT:
            if self.to_peer:
                if services is not None:
                    services.metrics.peer_failovers.inc()
                self._next_target(self.index + 1)
                return
            if services is not None and self.info is not None:
                if self._fall_back(services, self.info, verdict):
                    return
            verdict = failover.decide(replace(failed, alternatives=False), retry_after)
        self.verdict = verdict
        if self.to_peer and services is not None:
            services.metrics.peer_proxy_errors.labels("proxy_transport",
                                                      *gvr_labels(self.info)).inc()
        if not self.report and verdict.answer is not None:
            answer = verdict.answer
            exchange.respond(answer.status, answer.fields, answer.body)
        self.finish()

    def _fall_back(self, services: Services, info: RequestInfo,
                   verdict: failover.Verdict) -> bool:
        """The backend did not take it: the peers serving the same resource do."""
        ids = services.fallback(info)
        if not ids:
            return False
        services.metrics.backend_failovers.labels(verdict.failover).inc()
        upstreams = services.peers()
        self.targets = [(peer_id, upstreams[peer_id]) for peer_id in ids
                        if peer_id in upstreams]
        if not self.targets:  # membership dropped every candidate
            answer = services.unavailable(info, ids, self.exchange.downstream)
            self.exchange.respond(answer.status, answer.fields, answer.body)
            self.finish()
            return True
        self.to_peer = self.rerouted = True
        self.audit_id = str(uuid.uuid4()).encode()
        self._next_target(0)
        return True

    def _next_target(self, index: int) -> None:
        self.index, self.retried_fresh = index, False
        self.head = upstream_head(self.exchange, self.targets[index][1].raw_authority,
                                  client=self.downstream.raw_client_address,
                                  audit_id=self.audit_id)[0]
        self._attempt()

    # ---------------------------------------------------------------- the end

    def cancel(self) -> None:
        """The client left, or shutdown ends the request: drop the upstream side."""
        if self.tunnel is not None:
            self.tunnel.close()  # calls ``finish``
            return
        self._drop(release=False)
        self.finish(cancelled=True)

    def _drop(self, *, release: bool) -> None:
        """Hand the upstream connection back (``release``) or abort it."""
        relay, conn, pool = self.relay, self.conn, self.pool
        self.exchange.detach_body()
        if relay is not None:
            self.transport.deadlines.discard(relay)
            relay.engine = None  # nothing more is reported
            self.relay = None
        if conn is not None and pool is not None:
            self.conn = None
            if release:
                pool.release(conn)
            else:
                pool.discard(conn)

    def finish(self, cancelled: bool = False) -> None:
        """The request is over (answered, cut, tunnelled and closed, or cancelled):
        its metrics, then whoever started it is told, once."""
        if self.ended:
            return
        self.ended = True
        if self.dial is not None:
            self.dial.cancel()
            self.dial = None
        if self.relay is not None or self.conn is not None:
            self._drop(release=False)
        if not self.report:
            self.exchange.cancel_hook = None
        services = self.services
        if self.inflight is not None and self.duration is not None:
            self.inflight.dec()
            self.duration.observe(time.perf_counter() - self.started)
        if services is not None:
            if self.long_running:
                services.metrics.open_watches.dec()
            if self.rerouted and self.exchange.started:
                # Counted by the status line the client received (also when the body
                # was then cut or the client left); none received (left, or shutdown,
                # before any answer) is not counted: upstream would count the 503 it
                # writes to a client already gone.
                services.metrics.rerouted_requests.labels(
                    str(self.exchange.status), *gvr_labels(self.info)).inc()
        self.on_end(self, cancelled)


def gvr_labels(info: RequestInfo | None) -> tuple[str, str, str]:
    """Metric labels; only requests some peer's discovery lists get here, so bounded."""
    if info is None:
        return "", "", ""
    if info.is_resource_request:
        return info.api_group, info.api_version, info.resource
    group, version = group_version_path(info) or ("", "")
    return group, version, ""


async def forward(exchange: Exchange, transport: Transport, upstream: Upstream,
                  headers: CIMultiDict[str], *, long_running: bool,
                  reroutable: bool = False) -> None:
    """``Forward`` to one upstream, awaited, for a handler that already runs in a task
    (discovery passed through to the backend): ForwardError if no response started,
    saying whether another upstream may take the request. ``reroutable``: the
    backend's refusal while shutting down is such an error too, not relayed."""
    head = request_head(exchange, upstream, headers)
    ended: asyncio.Future[bool] = transport.loop.create_future()

    def on_end(_: Forward, cancelled: bool) -> None:
        if not ended.done():
            ended.set_result(cancelled)

    engine = Forward(transport, exchange, exchange.conn, [(upstream.name, upstream)], head,
                     on_end=on_end, long_running=long_running, to_peer=upstream.is_peer,
                     fallback=reroutable, report=True)
    engine.start()
    try:
        await ended
    except asyncio.CancelledError:
        engine.cancel()
        raise
    if engine.failure is not None:
        raise engine.failure
    if engine.verdict is not None:
        raise ForwardError(engine.verdict.cause, retryable=engine.verdict.retryable)


class _Relay:
    """Moves one upstream response to the downstream exchange (a ResponseHandler) and
    reports its head and its end to the engine (``Forward``), once each."""

    __slots__ = (
        "_body_sent", "_chunked_body", "_done_settled", "_ended", "_head_settled", "_out",
        "_with_body", "check_shutdown", "check_unserved", "conn", "downstream", "engine",
        "exchange", "lowered", "raw", "reason", "status", "upgraded",
    )

    def __init__(self, engine: Forward, exchange: Exchange, downstream: DownstreamConnection,
                 conn: UpstreamConnection):
        self.engine: Forward | None = engine
        self.exchange = exchange
        self.downstream = downstream
        """Where the response goes (the upstream connection reads in small pieces
        while it is behind: ``flow.READ_CHUNK_BEHIND``)."""
        self.conn = conn
        self.check_unserved = engine.to_peer
        self.check_shutdown = not engine.to_peer and (engine.fallback or engine.from_peer)
        """A 429 with ``Connection: close`` (kube-apiserver shutting down) fails the
        head instead of being relayed, when the request could be sent elsewhere."""
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
            downstream = self.downstream
            downstream.pause_reading("upstream")
            conn.when_writable(lambda: downstream.resume_reading("upstream"))

    def body_pending(self) -> bool:
        return not self._body_sent

    # ---------------------------------------------------------------- ResponseHandler

    def on_interim(self, status: int, reason: bytes, raw: wire.RawFields,
                   lowered: list[bytes]) -> None:
        if self.exchange.version >= (1, 1) and not self.exchange.started:
            dropped = RESPONSE_DROPPED | wire.raw_connection_tokens(raw, lowered)
            self.downstream.write(wire.status_line(status, reason)
                                  + wire.raw_lines(raw, lowered, dropped) + b"\r\n")

    def on_head(self, status: int, reason: bytes, raw: wire.RawFields,
                lowered: list[bytes]) -> None:
        self.status, self.reason, self.raw, self.lowered = status, reason, raw, lowered
        if (status == 503 and self.check_unserved) or (status == 429 and self.check_shutdown):
            refused = failover.refusal(status, raw, lowered, self.conn.upstream.name,
                                       to_peer=self.check_unserved,
                                       reroutable=self.check_shutdown,
                                       replayable=self.exchange.replayable(),
                                       body_pending=self.body_pending())
            if refused is not None:
                self._head(refused)
                return
        if status == 101:
            if not self.exchange.upgrade:
                # Relayed, it would tell the client its connection switched protocols
                # when it asked for no such thing (and the listener has no tunnel state
                # to enter from there): a broken response.
                self._head(UpstreamProtocolError(self.conn.upstream.name,
                                                 "switched protocols unasked (101)"))
            return  # else on_upgrade follows
        dropped = RESPONSE_DROPPED
        if b"connection" in lowered:  # every Connection field names fields to drop
            dropped = dropped | wire.raw_connection_tokens(raw, lowered)
        length = None
        if b"content-length" in lowered:
            length = raw[lowered.index(b"content-length")][1]
        self.exchange.start_raw(status, wire.status_line(status, reason)
                                + wire.raw_lines(raw, lowered, dropped), length=length,
                                bodiless=not self._with_body or status in (204, 304))
        self._head(None)

    def on_body(self, data: bytes) -> None:
        if self._with_body and self.exchange.started:
            self._out.append(data)

    def on_end(self, trailers: wire.RawFields) -> None:
        self._ended = wire.decoded(trailers) if trailers else []
        if not self._head_settled and self.status != 101:  # e.g. the unserved marker's
            self._head(None)  # body ended (a 101's end comes before ``on_upgrade``)

    def on_upgrade(self, early: bytes) -> None:
        self.upgraded = early
        self._head(None)

    def expire(self) -> None:
        """The request timeout passed: whichever wait is current ends with a timeout."""
        self.on_error(UpstreamTimeout(self.conn.upstream.name,
                                      "timed out waiting for the response"))

    def on_error(self, error: UpstreamError) -> None:
        if self._head_settled:
            self._done(error)
        else:
            self._head(error)

    def flush(self) -> None:
        """Everything parsed from one read goes out in one write."""
        exchange = self.exchange
        if not exchange.started or exchange.finished:
            return
        data = b"".join(self._out) if len(self._out) != 1 else self._out[0]
        self._out.clear()
        if self._ended is not None:
            exchange.write(data, end=True, trailers=self._ended)
            self._done(None)
            return
        exchange.write(data)
        downstream = self.downstream
        if downstream.paused_writing:
            conn = self.conn
            conn.pause_reading("downstream")
            downstream.when_writable(lambda: conn.resume_reading("downstream"))

    def _head(self, error: UpstreamError | None) -> None:
        if self._head_settled:
            return
        self._head_settled = True
        engine = self.engine
        if engine is None:
            return
        if error is None:
            engine.head_ok()
        else:
            engine.head_failed(error)

    def _done(self, error: UpstreamError | None) -> None:
        if self._done_settled:
            return
        self._done_settled = True
        if self.engine is not None:
            self.engine.body_done(error)
