"""The request path of the main listener: one handler for every request.

For each ``Exchange``: who the downstream is (computed once per connection by the
listener), what the request is (``requestinfo``), where it goes (``routing``,
reading one cache view; both paths, ``handle_now`` and ``handle``, tell it
``has_credentials``, so a request without credentials never reaches a peer), then
move the bytes (``forwarding``) or answer from the cache (``discoveryhandler``).
Failures to reach an upstream become Kubernetes ``Status`` answers here; anything
unexpected becomes one in the listener.
"""

from __future__ import annotations

import functools
import logging
import random
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from multidict import CIMultiDict
from prometheus_client import Gauge, Histogram

from mvproxy import discovery, failover, forwarding, openapi, routing
from mvproxy.cache import DiscoveryCache
from mvproxy.discoveryhandler import DiscoveryHandler
from mvproxy.errors import (
    UpstreamError,
)
from mvproxy.forwarding import ForwardError, HeadFailure
from mvproxy.identity import REFUSED, Downstream, has_credentials, is_peer_proxied
from mvproxy.kubestatus import Reply, status_reply, upstream_failure
from mvproxy.listener import Exchange
from mvproxy.logs import V, kv, throttled
from mvproxy.metrics import Metrics
from mvproxy.requestinfo import RequestInfo, is_long_running, parse_request_info
from mvproxy.transport import Transport, Upstream

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
    retry_after: int
    """Seconds a 503 asks clients to wait: about one discovery poll interval."""
    _by_route: dict[str, tuple[Gauge, Histogram]] = field(default_factory=dict)
    """Per route: the in-flight gauge and duration histogram children, resolved once."""

    def _route_metrics(self, route: str) -> tuple[Gauge, Histogram]:
        found = self._by_route.get(route)
        if found is None:
            found = self._by_route[route] = (self.metrics.inflight_requests.labels(route),
                                             self.metrics.request_duration.labels(route))
        return found

    def handle_now(self, exchange: Exchange) -> bool:
        """The common case without a coroutine: a plain request the backend serves,
        forwarded on an idle pooled connection by callbacks alone (``forward_now``).
        False: nothing was done; ``handle`` takes the request."""
        downstream = exchange.downstream
        if downstream.kind == REFUSED or exchange.upgrade:
            return False
        info, long_running = request_info(exchange.method, exchange.path, exchange.query)
        exchange.watch = info.verb == "watch"
        peer_proxied = downstream.is_peer and is_peer_proxied(downstream, exchange.headers)
        credentials = has_credentials(downstream, exchange.raw, upgrade=exchange.upgrade)
        decision = routing.decide(info, self.cache.view(), peer_proxied=peer_proxied,
                                  credentials=credentials, rng=self.rng)
        if decision.route == routing.PEER:
            if self._peer_now(exchange, info, decision.peers, long_running):
                if decision.reason is routing.BACKEND_FAILING:
                    self.metrics.backend_failovers.labels("failing").inc()
                return True
            return False
        if decision.route == routing.DISCOVERY:
            return self._discovery_now(exchange, info)
        if decision.route != routing.BACKEND:
            return False
        backend = self.backend
        head, asserts_user = forwarding.upstream_head(exchange, backend.raw_authority)
        upstream = backend if asserts_user or backend.anonymous is None else backend.anonymous
        fallback = _may_fall_back(info, peer_proxied, credentials)
        return self._inline(exchange, upstream, head, routing.BACKEND, long_running,
                            ended=None, reroutable=fallback or downstream.is_peer,
                            failed=lambda failure: self._recover(
                                exchange, info, upstream, failure, long_running, fallback))

    def _peer_now(self, exchange: Exchange, info: RequestInfo, candidates: tuple[str, ...],
                  long_running: bool) -> bool:
        """``handle_now`` for the peer route: the first capable peer, if it has an idle
        pooled connection; a failure before any answer continues with the others in a
        coroutine (``_to_peers``), with the same Audit-ID."""
        first = self.peers().get(candidates[0]) if candidates else None
        if first is None:
            return False
        audit_id = str(uuid.uuid4())
        head, _ = forwarding.upstream_head(exchange, first.raw_authority,
                                           audit_id=audit_id.encode())
        gvr = _gvr_labels(info)
        return self._inline(
            exchange, first, head, routing.PEER, long_running,
            ended=lambda: self._rerouted(exchange, gvr),
            failed=lambda failure: self._peers_after(exchange, info, candidates, failure,
                                                     audit_id, long_running))

    def _inline(self, exchange: Exchange, upstream: Upstream, head: bytes, route: str,
                long_running: bool, *, ended: Callable[[], None] | None,
                failed: Callable[[HeadFailure], Coroutine[Any, Any, None]],
                reroutable: bool = False) -> bool:
        """Start ``forward_now``; when the answer went out, was cut or the client left,
        ``ended()``; on a failure before any answer continue in the coroutine
        ``failed(failure)``. False: nothing started."""
        inflight, duration = self._route_metrics(route)
        started = time.perf_counter()

        def finished(failure: HeadFailure | None, cancelled: bool) -> None:
            if failure is None:
                if ended is not None:
                    ended()
                self._done(inflight, duration, started, long_running)
                exchange.conn.finish(exchange, cancelled=cancelled)
            else:
                # Accounted when the task ends, even if cancelled before it started.
                exchange.conn.continue_with(exchange, failed(failure)).add_done_callback(
                    lambda _: self._done(inflight, duration, started, long_running))
        inline = forwarding.forward_now(exchange, self.transport, upstream, head,
                                        long_running=long_running, finished=finished,
                                        reroutable=reroutable)
        if inline is None:
            return False
        exchange.cancel_hook = inline.cancel
        inflight.inc()
        if long_running:
            self.metrics.open_watches.inc()
        return True

    async def _peers_after(self, exchange: Exchange, info: RequestInfo,
                           candidates: tuple[str, ...], failure: HeadFailure, audit_id: str,
                           long_running: bool) -> None:
        """The first peer failed before any answer: as ``_to_peers`` would go on. A stale
        pooled connection tries that peer again afresh; otherwise the next ones."""
        headers = forwarding.headers_for(exchange, to_peer=True)
        headers[forwarding.AUDIT_ID] = headers.get(forwarding.AUDIT_ID, audit_id)
        if isinstance(failure, ForwardError):
            log.log(V(3), "peer request failed", extra=kv(
                peer=candidates[0], error=str(failure)[:300], retry=failure.retryable))
            await self._to_peers(exchange, info, candidates[1:], long_running,
                                 headers=headers, last=failure)
            return
        self._drop_idle(self.peers()[candidates[0]])
        await self._to_peers(exchange, info, candidates, long_running, headers=headers)

    def _drop_idle(self, upstream: Upstream) -> None:
        """After a stale pooled connection: the others to that upstream likely died too."""
        pool = self.transport.pool(upstream)
        for idle in list(pool.idle):
            idle.close()
        pool.idle.clear()

    def _discovery_now(self, exchange: Exchange, info: RequestInfo) -> bool:
        _, duration = self._route_metrics(routing.DISCOVERY)
        started = time.perf_counter()
        if not self.discovery.handle_now(exchange, info):
            return False
        duration.observe(time.perf_counter() - started)
        exchange.conn.finish(exchange)
        return True

    def _done(self, inflight: Gauge, duration: Histogram, started: float,
              long_running: bool) -> None:
        inflight.dec()
        duration.observe(time.perf_counter() - started)
        if long_running:
            self.metrics.open_watches.dec()

    async def _recover(self, exchange: Exchange, info: RequestInfo, upstream: Upstream,
                       failure: HeadFailure, long_running: bool, fallback: bool) -> None:
        """After ``handle_now`` failed before any answer: a stale pooled connection is
        retried once on a fresh one; anything else is handled as ``_to_backend``
        would."""
        try:
            if isinstance(failure, ForwardError):
                raise failure
            self._drop_idle(upstream)
            headers = forwarding.headers_for(exchange, to_peer=False)
            await forwarding.forward(exchange, self.transport, upstream, headers,
                                     long_running=long_running,
                                     reroutable=fallback or exchange.downstream.is_peer)
        except ForwardError as exc:
            await self._backend_failed(exchange, info, exc, long_running, fallback)

    async def _backend_failed(self, exchange: Exchange, info: RequestInfo, exc: ForwardError,
                              long_running: bool, fallback: bool) -> None:
        """Nothing the backend did reached the client. If the request never reached it
        (or it refused it while shutting down) and a reachable peer serves the same
        resource, the peer takes it: during the backend's restart this member keeps
        serving what its peers can. Otherwise the failure is the answer."""
        log.log(V(3), "backend request failed", extra=kv(error=str(exc)[:300],
                                                         retry=exc.retryable))
        failed = failover.Failed(exc.cause, exchange.method, to_peer=False,
                                 replayable=exc.retryable, alternatives=fallback,
                                 from_peer=exchange.downstream.is_peer)
        verdict = failover.decide(failed, self.retry_after)
        if verdict.backend_down:
            # Refusing connections, or shutting down: what it listed may change when
            # it is back (another version). Until a poll succeeds, routing sends what a
            # peer serves too to that peer (``routing.BACKEND_FAILING``).
            self.cache.record_failure(self.server_id, f"request: {str(exc)[:200]}")
        if verdict.action is failover.Action.NEXT:
            peers = routing.fallback_peers(info, self.cache.view(), self.rng)
            if peers:
                self.metrics.backend_failovers.labels(verdict.failover).inc()
                await self._to_peers(exchange, info, peers, long_running)
                return
            verdict = failover.decide(replace(failed, alternatives=False), self.retry_after)
        assert verdict.answer is not None
        reply(exchange, verdict.answer)

    async def handle(self, exchange: Exchange) -> None:
        downstream = exchange.downstream
        if downstream.kind == REFUSED:
            reply(exchange, status_reply(401, downstream.reason))
            return
        info, long_running = request_info(exchange.method, exchange.path, exchange.query)
        exchange.watch = info.verb == "watch"
        peer_proxied = downstream.is_peer and is_peer_proxied(downstream, exchange.headers)
        credentials = has_credentials(downstream, exchange.raw, upgrade=exchange.upgrade)
        decision = routing.decide(info, self.cache.view(), peer_proxied=peer_proxied,
                                  credentials=credentials, rng=self.rng)
        if decision.reason is routing.BACKEND_FAILING:
            self.metrics.backend_failovers.labels("failing").inc()
        if log.isEnabledFor(V(4)):
            log.log(V(4), "routed", extra=kv(method=exchange.method, route=decision.route,
                                             reason=decision.reason,
                                             peers=",".join(decision.peers)))
        route = decision.route
        started = time.perf_counter()
        inflight, duration = self._route_metrics(route)
        inflight.inc()
        try:
            if route == routing.DISCOVERY:
                await self.discovery.handle(exchange, info)
            elif route == routing.OPENAPI_INDEX and decision.reason == routing.OPENAPI_MERGED:
                await self._openapi_document(exchange, info, decision.peers,
                                             _may_fall_back(info, peer_proxied, credentials))
            elif route == routing.OPENAPI_INDEX:
                await self._openapi_index(exchange, downstream)
            elif route == routing.UNAVAILABLE:
                reply(exchange, self._unavailable(info, decision))
            else:
                await self._forward(exchange, info, decision, route,
                                    long_running or exchange.upgrade,
                                    _may_fall_back(info, peer_proxied, credentials))
        finally:
            inflight.dec()
            duration.observe(time.perf_counter() - started)

    async def _forward(self, exchange: Exchange, info: RequestInfo,
                       decision: routing.Decision, route: str, long_running: bool,
                       fallback: bool) -> None:
        if long_running:
            self.metrics.open_watches.inc()
        try:
            if route == routing.PEER:
                await self._to_peers(exchange, info, decision.peers, long_running)
            else:
                await self._to_backend(exchange, info, long_running, fallback)
        finally:
            if long_running:
                self.metrics.open_watches.dec()

    async def _to_backend(self, exchange: Exchange, info: RequestInfo, long_running: bool,
                          fallback: bool) -> None:
        headers = forwarding.headers_for(exchange, to_peer=False)
        try:
            await forwarding.forward(exchange, self.transport, self.backend.for_headers(headers),
                                     headers, long_running=long_running,
                                     reroutable=fallback or exchange.downstream.is_peer)
        except ForwardError as exc:
            await self._backend_failed(exchange, info, exc, long_running, fallback)

    async def _to_peers(self, exchange: Exchange, info: RequestInfo,
                        candidates: tuple[str, ...], long_running: bool, *,
                        headers: CIMultiDict[str] | None = None,
                        last: ForwardError | None = None) -> None:
        """Try capable peers in order; move on only when nothing may have reached one.
        ``last``: an earlier attempt's failure (from ``_peer_now``)."""
        upstreams = self.peers()
        gvr = _gvr_labels(info)
        if last is not None and not last.retryable:
            candidates = ()
        targets = [(peer_id, upstreams[peer_id]) for peer_id in candidates
                   if peer_id in upstreams]
        if not targets and last is None:  # membership dropped every candidate
            reply(exchange, self._unavailable(info, routing.Decision(
                routing.UNAVAILABLE, "", candidates)))
            return
        # One Audit-ID for every attempt: the peers' audit logs show one request.
        if headers is None:
            headers = forwarding.headers_for(exchange, to_peer=True)
        try:
            await self._try_peers(exchange, targets, headers, long_running, last, gvr)
        finally:  # however it ended: answered, cut, failed, or the client left
            self._rerouted(exchange, gvr)

    async def _try_peers(self, exchange: Exchange, targets: list[tuple[str, Upstream]],
                         headers: CIMultiDict[str], long_running: bool,
                         last: ForwardError | None,
                         gvr: tuple[str, str, str]) -> None:
        for index, (peer_id, upstream) in enumerate(targets):
            if last is not None:
                self.metrics.peer_failovers.inc()
            try:
                await forwarding.forward(exchange, self.transport, upstream, headers,
                                         long_running=long_running)
            except ForwardError as exc:
                last = exc
                # Per request, so not a warning: during an outage there is one per
                # request; polling reports the peer's state change once.
                log.log(V(3), "peer request failed", extra=kv(
                    peer=peer_id, error=str(exc)[:300], retry=exc.retryable))
                if self._peer_verdict(exchange, exc, index + 1 < len(targets)).action \
                        is failover.Action.NEXT:
                    continue
                break
            return
        assert last is not None
        self.metrics.peer_proxy_errors.labels("proxy_transport", *gvr).inc()
        answer = self._peer_verdict(exchange, last, False).answer
        assert answer is not None
        reply(exchange, answer)

    def _peer_verdict(self, exchange: Exchange, exc: ForwardError,
                      alternatives: bool) -> failover.Verdict:
        return failover.decide(failover.Failed(
            exc.cause, exchange.method, to_peer=True, replayable=exc.retryable,
            alternatives=alternatives), self.retry_after)

    def _rerouted(self, exchange: Exchange, gvr: tuple[str, str, str]) -> None:
        """Count a request sent to peers once, when it ends, by the status line the
        client received (also when the body was then cut or the client left). One that
        received none (left, or shutdown, before any answer) is not counted: upstream
        would count the 503 it writes to a client already gone."""
        if exchange.started:
            self.metrics.rerouted_requests.labels(str(exchange.status), *gvr).inc()

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

    async def _openapi_document(self, exchange: Exchange, info: RequestInfo,
                                peers: tuple[str, ...], fallback: bool) -> None:
        """``/openapi/v3/apis/<g>/<v>`` of a group/version the backend serves while
        ``peers`` serve more of it: the backend's document (asked with the client's
        credentials, without the hash, which names the backend's own) plus, from the
        first of ``peers`` that answers, the paths and schemas only peers have
        (``openapi.merge_document``). A client that takes no JSON, a refusal, or no
        peer answering: the backend's answer alone."""
        accept = discovery.negotiate(exchange.headers.get("Accept"), aggregated=False)
        if accept.kind != "legacy":
            await self._to_backend(exchange, info, False, fallback)
            return
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
            own = await self.transport.fetch(self.backend.for_headers(headers), exchange.path,
                                             headers=headers,
                                             timeout=self.transport.request_timeout,
                                             max_bytes=OPENAPI_DOCUMENT_MAX_BYTES)
        except UpstreamError as exc:
            throttled.warning(log, "backend openapi request failed", error=str(exc)[:300])
            reply(exchange, upstream_failure(exc, "the backend API server", self.retry_after,
                                             idempotent=True))
            return
        if own.status != 200:
            exchange.respond(own.status, forwarding.response_headers(list(own.headers.items())),
                             own.body)
            return
        peer_only = {(*e["name"].split("/", 1), "")[:2]
                     for e in self.cache.view().peer_only_resources(group, version)}
        body = own.body
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
                body = openapi.merge_document(own.body, theirs.body, group, version,
                                              peer_only) or own.body
                break
        tag = discovery.etag(body)
        fields = [(name, value) for name, value in own.headers.items()
                  if name.lower() in ("audit-id", "x-content-type-options")]
        fields += [("Content-Type", "application/json"), ("ETag", tag), ("Vary", "Accept"),
                   ("Cache-Control", "no-cache, private")]
        if exchange.headers.get("If-None-Match") == tag:
            exchange.respond(304, fields)
            return
        exchange.respond(200, fields, body)

    def _unavailable(self, info: RequestInfo, decision: routing.Decision) -> Reply:
        gvr = _gvr_labels(info)
        self.metrics.peer_proxy_errors.labels("endpoint_resolution", *gvr).inc()
        what = "/".join(p for p in gvr if p)
        return status_reply(
            503, f"{what} is served only by peers that are unreachable now "
                 f"({', '.join(decision.peers)}); retry later",
            headers={"Retry-After": str(self.retry_after)})


def _may_fall_back(info: RequestInfo, peer_proxied: bool, credentials: bool) -> bool:
    return failover.may_fall_back(resource_request=info.is_resource_request,
                                  peer_proxied=peer_proxied, credentials=credentials)


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


def _gvr_labels(info: RequestInfo) -> tuple[str, str, str]:
    """Metric labels; only requests some peer's discovery lists get here, so bounded."""
    if info.is_resource_request:
        return info.api_group, info.api_version, info.resource
    group, version = routing.group_version_path(info) or ("", "")
    return group, version, ""
