"""The request path of the main listener: one entry point for every request.

For each ``Exchange`` (``Proxy.handle``, called by the listener with its connection):
who the downstream is (computed once per connection by the listener), what the
request is (``requestinfo``), where it goes (``routing``, reading one cache view and
told ``has_credentials``, so a request without credentials never reaches a peer),
then move the bytes by callbacks (``forwarding.Forward``: the backend, or capable
peers in order, with ``failover`` deciding after each failure) or answer from the
cache (``discoveryhandler``). Only merged discovery and OpenAPI documents that need
upstream reads run in a task. Anything unexpected becomes a ``Status`` in the
listener.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict
from prometheus_client import Gauge, Histogram

from mvproxy import discovery, failover, forwarding, openapi, routing
from mvproxy.cache import DiscoveryCache
from mvproxy.discoveryhandler import DiscoveryHandler, SharedDocuments, respond_in_pieces
from mvproxy.errors import (
    UpstreamError,
)
from mvproxy.identity import REFUSED, Downstream, Kind, has_credentials, is_peer_proxied
from mvproxy.kubestatus import Reply, status_reply, upstream_failure
from mvproxy.listener import DownstreamConnection, Exchange, run_in_task
from mvproxy.logs import V, kv, throttled
from mvproxy.metrics import Metrics
from mvproxy.requestinfo import RequestInfo, is_long_running, parse_request_info
from mvproxy.transport import Fetched, Transport, Upstream

log = logging.getLogger(__name__)

OPENAPI_INDEX_MAX_BYTES = 4 * 1024 * 1024
"""The index lists one short entry per group/version: megabytes would be garbage."""
OPENAPI_DOCUMENT_MAX_BYTES = 64 * 1024 * 1024
"""One group/version's OpenAPI v3 document, read whole to be merged (core v1 of a real
1.36 server: about 1.5 MB; a CRD group with huge schemas is larger)."""


def reply(exchange: Exchange, answer: Reply) -> None:
    exchange.respond(answer.status, answer.fields, answer.body)


@dataclass
class Proxy:
    """Everything the request path needs, assembled once by ``app``."""

    server_id: str
    cache: DiscoveryCache
    transport: Transport
    backend: Upstream
    peers: Callable[[], Mapping[str, Upstream]]
    metrics: Metrics
    discovery: DiscoveryHandler
    rng: random.Random
    _by_route: dict[str, tuple[Gauge, Histogram]] = field(default_factory=dict)
    """Per route: the in-flight gauge and duration histogram children, resolved once."""
    openapi_documents: SharedDocuments = field(default_factory=SharedDocuments)
    """Merged OpenAPI documents, one per set of inputs, shared by the requests for it."""

    @property
    def retry_after(self) -> int:
        """Seconds a 503 asks clients to wait: about one discovery poll interval (read
        from the live settings, so a reload changes it)."""
        return self.discovery.live.retry_after

    def _route_metrics(self, route: str) -> tuple[Gauge, Histogram]:
        found = self._by_route.get(route)
        if found is None:
            found = self._by_route[route] = (self.metrics.inflight_requests.labels(route),
                                             self.metrics.request_duration.labels(route))
        return found

    def handle(self, exchange: Exchange, conn: DownstreamConnection) -> None:
        """The listener's one entry point for a request on ``conn``: route it, then
        forward it by callbacks (``forwarding.Forward``) or answer it here; merged
        discovery and OpenAPI documents that need upstream reads run in a task."""
        downstream = exchange.downstream
        if downstream.kind == REFUSED:
            reply(exchange, status_reply(401, downstream.reason))
            conn.finish(exchange)
            return
        info, long_running = request_info(exchange.method, exchange.path, exchange.query)
        exchange.watch = info.verb == "watch"
        peer_proxied = downstream.is_peer and is_peer_proxied(downstream, exchange.headers)
        credentials = has_credentials(downstream, exchange.raw, upgrade=exchange.upgrade)
        decision = routing.decide(info, self.cache.view(), peer_proxied=peer_proxied,
                                  credentials=credentials, rng=self.rng)
        if decision.reason is routing.BACKEND_FAILING:
            self.metrics.backend_failovers.labels("failing").inc()
        if log.isEnabledFor(_V4):
            log.log(_V4, "routed", extra=kv(method=exchange.method, route=decision.route,
                                             reason=decision.reason,
                                             peers=",".join(decision.peers)))
        route = decision.route
        fallback = failover.may_fall_back(info.is_resource_request, peer_proxied, credentials)
        if route == routing.BACKEND:
            self._to_backend(exchange, conn, info, long_running or exchange.upgrade, fallback)
        elif route == routing.PEER:
            self._to_peers(exchange, conn, info, decision.peers,
                           long_running or exchange.upgrade)
        elif route == routing.UNAVAILABLE:
            self._answer(exchange, conn, route, self.unavailable(info, decision.peers,
                                                                  exchange.downstream))
        elif route == routing.DISCOVERY:
            _, duration = self._route_metrics(route)
            started = time.perf_counter()
            if self.discovery.handle_now(exchange, info):
                duration.observe(time.perf_counter() - started)
                conn.finish(exchange)
                return
            self._in_task(exchange, conn, route, self.discovery.handle(exchange, info))
        elif decision.reason == routing.OPENAPI_MERGED:
            accept = discovery.negotiate(exchange.headers.get("Accept"), aggregated=False)
            if accept.kind != "legacy":  # only JSON is merged
                self._to_backend(exchange, conn, info, False, fallback, route=route)
                return
            self._in_task(exchange, conn, route, self._openapi_document(
                exchange, decision.peers))
        else:
            self._in_task(exchange, conn, route, self._openapi_index(exchange, downstream))

    def _to_backend(self, exchange: Exchange, conn: DownstreamConnection, info: RequestInfo,
                    long_running: bool, fallback: bool, *, route: str = routing.BACKEND
                    ) -> None:
        backend = self.backend
        head, asserts_user = forwarding.upstream_head(exchange, backend.raw_authority,
                                                      client=conn.raw_client_address)
        upstream = backend if asserts_user or backend.anonymous is None else backend.anonymous
        forwarding.Forward(self.transport, exchange, conn, [(upstream.name, upstream)], head,
                           on_end=_finished, long_running=long_running, to_peer=False,
                           services=self, info=info, fallback=fallback,
                           route=self._route_metrics(route)).start()

    def _to_peers(self, exchange: Exchange, conn: DownstreamConnection, info: RequestInfo,
                  candidates: tuple[str, ...], long_running: bool) -> None:
        """Capable peers in order; one Audit-ID for every attempt, so the peers' audit
        logs show one request."""
        upstreams = self.peers()
        targets = [(peer_id, upstreams[peer_id]) for peer_id in candidates
                   if peer_id in upstreams]
        if not targets:  # membership dropped every candidate
            self._answer(exchange, conn, routing.PEER, self.unavailable(info, candidates,
                                                                       exchange.downstream))
            return
        audit_id = str(uuid.uuid4()).encode()
        head, _ = forwarding.upstream_head(exchange, targets[0][1].raw_authority,
                                           client=conn.raw_client_address, audit_id=audit_id)
        forwarding.Forward(self.transport, exchange, conn, targets, head,
                           on_end=_finished, long_running=long_running, to_peer=True,
                           services=self, info=info, audit_id=audit_id,
                           route=self._route_metrics(routing.PEER)).start()

    def _answer(self, exchange: Exchange, conn: DownstreamConnection, route: str,
                answer: Reply) -> None:
        _, duration = self._route_metrics(route)
        started = time.perf_counter()
        reply(exchange, answer)
        duration.observe(time.perf_counter() - started)
        conn.finish(exchange)

    def _in_task(self, exchange: Exchange, conn: DownstreamConnection, route: str,
                 coro: Coroutine[Any, Any, None]) -> None:
        inflight, duration = self._route_metrics(route)
        inflight.inc()
        started = time.perf_counter()

        def done(_: object) -> None:
            inflight.dec()
            duration.observe(time.perf_counter() - started)
        run_in_task(exchange, conn, coro).add_done_callback(done)

    # ---------------------------------------------------------------- forwarding.Services

    def fallback(self, info: RequestInfo) -> tuple[str, ...]:
        return routing.fallback_peers(info, self.cache.view(), self.rng)

    def backend_failed(self, error: str) -> None:
        # Refusing connections, or shutting down: what it listed may change when it is
        # back (another version). Until a poll succeeds, routing sends what a peer
        # serves too to that peer (``routing.BACKEND_FAILING``).
        self.cache.record_failure(self.server_id, error)

    def unavailable(self, info: RequestInfo, peers: tuple[str, ...],
                    downstream: Downstream) -> Reply:
        gvr = forwarding.gvr_labels(info)
        self.metrics.peer_proxy_errors.labels("endpoint_resolution", *gvr).inc()
        what = "/".join(p for p in gvr if p)
        # Which peers only to a client whose certificate mvproxy verified: anyone may
        # send a token mvproxy cannot check (a junk one too), and server IDs name the
        # control plane's members. The log says which to the operator either way.
        log.log(V(2), "no reachable peer serves the request",
                extra=kv(resource=what, peers=",".join(peers)))
        which = f" ({', '.join(peers)})" if downstream.kind in (Kind.USER, Kind.PEER) else ""
        return status_reply(
            503, f"{what} is served only by peers that are unreachable now{which}; "
                 "retry later",
            headers={"Retry-After": str(self.retry_after)})

    async def _openapi_index(self, exchange: Exchange, downstream: Downstream) -> None:
        """The backend's OpenAPI v3 index, with entries for peer-only group/versions."""
        headers = forwarding.headers_for(exchange, to_peer=False)
        for name in ("Accept-Encoding", "If-None-Match"):  # we rewrite the body
            headers.popall(name, None)
        try:
            answer = await self.transport.fetch(self.backend.for_headers(headers),
                                                exchange.target, headers=headers,
                                                timeout=self.transport.request_timeout,
                                                max_bytes=OPENAPI_INDEX_MAX_BYTES)
        except UpstreamError as exc:
            throttled.warning(log, "backend openapi index request failed", error=str(exc)[:300])
            reply(exchange, upstream_failure(exc, "the backend API server", self.retry_after,
                                             idempotent=exchange.method in forwarding.IDEMPOTENT))
            return
        body = answer.body
        if answer.status == 200:
            body = openapi.merge_index(answer.body, self.cache.view()) or answer.body
        exchange.respond(answer.status, [
            ("Content-Type", answer.headers.get("Content-Type", "application/json"))], body)

    async def _openapi_document(self, exchange: Exchange, peers: tuple[str, ...]) -> None:
        """``/openapi/v3/apis/<g>/<v>`` of a group/version the backend serves while
        ``peers`` serve more of it: the backend's document (asked with the client's
        credentials, without the hash, which names the backend's own) plus, from the
        first of ``peers`` that answers, the paths and schemas only peers have
        (``openapi.merge_document``). A refusal, or no peer answering: the backend's
        answer alone (a client that takes no JSON is forwarded: ``handle``).

        Megabytes each: one document per set of inputs is shared by every request for
        it, and written a piece at a time as the client reads
        (``discoveryhandler.respond_in_pieces``), so clients that stop reading do not
        each pin a copy."""
        group, version = routing.group_version_path(
            request_info(exchange.method, exchange.path, "")[0]) or ("", "")

        def asked(to_peer: bool) -> CIMultiDict[str]:
            headers = forwarding.headers_for(exchange, to_peer=to_peer)
            headers["Accept"] = "application/json"
            for name in ("Accept-Encoding", "If-None-Match"):  # the body is rewritten
                headers.popall(name, None)
            return headers

        headers = asked(False)
        try:
            own: Fetched | None = await self.transport.fetch(
                self.backend.for_headers(headers), exchange.path, headers=headers,
                timeout=self.transport.request_timeout, max_bytes=OPENAPI_DOCUMENT_MAX_BYTES)
        except UpstreamError as exc:
            throttled.warning(log, "backend openapi request failed", error=str(exc)[:300])
            reply(exchange, upstream_failure(exc, "the backend API server", self.retry_after,
                                             idempotent=True))
            return
        assert own is not None
        if own.status != 200:
            exchange.respond(own.status, forwarding.response_headers(list(own.headers.items())),
                             own.body)
            return
        fields = [(name, value) for name, value in own.headers.items()
                  if name.lower() in ("audit-id", "x-content-type-options")]
        own_body = own.body
        own = None
        view = self.cache.view()
        peer_only = {(*e["name"].split("/", 1), "")[:2]
                     for e in view.peer_only_resources(group, version)}
        their_body = b""
        theirs: Fetched | None = None
        upstreams = self.peers()
        for peer_id in peers:
            upstream = upstreams.get(peer_id)
            if upstream is None:
                continue
            try:
                theirs = await self.transport.fetch(
                    upstream, exchange.path, headers=asked(True),
                    timeout=self.transport.request_timeout,
                    max_bytes=OPENAPI_DOCUMENT_MAX_BYTES)
            except UpstreamError as exc:
                log.log(V(3), "peer openapi request failed", extra=kv(
                    peer=peer_id, error=str(exc)[:300]))
                continue
            if theirs.status == 200:
                their_body = theirs.body
                break
        theirs = None

        def merged() -> bytes:
            if not their_body:
                return own_body
            return openapi.merge_document(own_body, their_body, group, version,
                                          peer_only) or own_body

        # Every input of the merge is in the key (the view's generation stands for
        # ``peer_only``): requests that would build the same bytes share one document.
        key = (group, version, hashlib.sha256(own_body).digest(),
               hashlib.sha256(their_body).digest() if their_body else b"")
        document = self.openapi_documents.get(view.generation, key, merged)
        own_body = their_body = b""  # the document alone is held while it is written
        fields += [("Content-Type", "application/json"), ("ETag", document.etag),
                   ("Vary", "Accept"), ("Cache-Control", "no-cache, private")]
        if exchange.headers.get("If-None-Match") == document.etag:
            exchange.respond(304, fields)
            return
        await respond_in_pieces(exchange, 200, fields, document.body)


def _finished(forward: forwarding.Forward, cancelled: bool) -> None:
    forward.downstream.finish(forward.exchange, cancelled=cancelled, failure=forward.failure)


_V4 = V(4)

MEMO_KEY_MAX = 512
"""Longest path + query memoised: the keys are client input, and the memo must stay
small whatever clients send (4,096 entries of at most this size)."""


def request_info(method: str, path: str, query: str) -> tuple[RequestInfo, bool]:
    """kube's RequestInfo and whether the request is long-running, memoised for short
    targets: most requests repeat (watches, lists, controllers' gets)."""
    if len(path) + len(query) <= MEMO_KEY_MAX:
        return _request_info(method, path, query)
    return _request_info.__wrapped__(method, path, query)


@functools.lru_cache(maxsize=4096)
def _request_info(method: str, path: str, query: str) -> tuple[RequestInfo, bool]:
    info = parse_request_info(method, path, query)
    return info, is_long_running(info)
