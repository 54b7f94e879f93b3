"""The aiohttp surface of the main listener: one catch-all handler.

For each request: who is the downstream (``identity``), what is it (``requestinfo``),
where does it go (``routing``, reading one cache view), then move the bytes
(``forwarding``) or answer discovery from the cache (``discoveryhandler``). Errors
become Kubernetes ``Status`` responses here and only here.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from mvproxy import forwarding, openapi, routing, tunnel
from mvproxy.cache import DiscoveryCache
from mvproxy.discoveryhandler import DiscoveryHandler
from mvproxy.errors import UpstreamError
from mvproxy.forwarding import ForwardError
from mvproxy.identity import REFUSED, Downstream, IdentityResolver, is_peer_proxied
from mvproxy.kubestatus import status_response, upstream_failure
from mvproxy.logs import V, kv
from mvproxy.metrics import Metrics
from mvproxy.requestcheck import check_request
from mvproxy.requestinfo import RequestInfo, is_long_running, parse_request_info
from mvproxy.transport import Transport, Upstream

log = logging.getLogger(__name__)

OPENAPI_INDEX_MAX_BYTES = 4 * 1024 * 1024
"""The index lists one short entry per group/version: megabytes would be garbage."""

@dataclass
class Proxy:
    """Everything the request path needs, assembled once by ``app``."""

    server_id: str
    cache: DiscoveryCache
    transport: Transport
    backend: Upstream
    peers: Callable[[], Mapping[str, Upstream]]
    identity: IdentityResolver
    metrics: Metrics
    discovery: DiscoveryHandler
    rng: random.Random
    retry_after: int
    """Seconds a 503 asks clients to wait: about one discovery poll interval."""
    _active: set[asyncio.Task] = field(default_factory=set)

    def in_flight(self) -> int:
        return len(self._active)

    def cancel_in_flight(self) -> int:
        """End every request still being served (shutdown after the grace period)."""
        for task in self._active:
            task.cancel()
        return len(self._active)

    @web.middleware
    async def checked(self, request: web.Request, handler) -> web.StreamResponse:
        """Refuse what ``requestcheck`` refuses, before routing (aiohttp's router would
        answer ``*`` and CONNECT targets itself)."""
        refusal = check_request(tuple(request.version), request.raw_path,
                                request.headers.getall("Transfer-Encoding", []))
        if refusal is None:
            return await handler(request)
        log.log(V(3), "request refused", extra=kv(status=refusal.status,
                                                  reason=refusal.message))
        response = status_response(refusal.status, refusal.message)
        response.force_close()
        return response

    async def handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        self._active.add(task)
        try:
            return await self._handle(request)
        finally:
            self._active.discard(task)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        downstream = self.identity.resolve(_client_certificate(request))
        if downstream.kind == REFUSED:
            return status_response(401, downstream.reason)
        info = parse_request_info(request.method, request.path, request.query_string)
        decision = routing.decide(info, self.cache.view(),
                                  peer_proxied=is_peer_proxied(downstream, request.headers),
                                  rng=self.rng)
        log.log(V(4), "routed", extra=kv(method=request.method, route=decision.route,
                                         reason=decision.reason, peers=",".join(decision.peers)))
        route = decision.route
        started = time.perf_counter()
        self.metrics.inflight_requests.labels(route).inc()
        try:
            if route == routing.DISCOVERY:
                return await self.discovery.handle(request, downstream, info)
            if route == routing.OPENAPI_INDEX:
                return await self._openapi_index(request, downstream)
            if route == routing.UNAVAILABLE:
                return self._unavailable(info, decision)
            long_running = is_long_running(info, request.query_string)
            if long_running:
                self.metrics.open_watches.inc()
            try:
                if route == routing.PEER:
                    return await self._to_peers(request, downstream, info, decision.peers,
                                                long_running)
                return await self._to_backend(request, downstream, long_running)
            finally:
                if long_running:
                    self.metrics.open_watches.dec()
        finally:
            self.metrics.inflight_requests.labels(route).dec()
            self.metrics.request_duration.labels(route).observe(time.perf_counter() - started)

    async def _to_backend(self, request: web.Request, downstream: Downstream,
                          long_running: bool) -> web.StreamResponse:
        headers = forwarding.request_headers(request, downstream, to_peer=False)
        try:
            return await self._deliver(request, self.backend.for_headers(headers), headers,
                                       long_running)
        except ForwardError as exc:
            log.warning("backend request failed", extra=kv(error=str(exc)[:300]))
            return upstream_failure(exc.cause, "the backend API server", self.retry_after)

    async def _to_peers(self, request: web.Request, downstream: Downstream, info: RequestInfo,
                        candidates: tuple[str, ...], long_running: bool) -> web.StreamResponse:
        """Try capable peers in order; move on only when nothing may have reached one."""
        upstreams = self.peers()
        gvr = _gvr_labels(info)
        last: ForwardError | None = None
        # One Audit-ID for every attempt: the peers' audit logs show one request.
        headers = forwarding.request_headers(request, downstream, to_peer=True)
        for index, peer_id in enumerate(candidates):
            upstream = upstreams.get(peer_id)
            if upstream is None:
                continue
            if index and last is not None:
                self.metrics.peer_failovers.inc()
            try:
                response = await self._deliver(request, upstream, headers, long_running)
            except ForwardError as exc:
                last = exc
                log.warning("peer request failed", extra=kv(peer=peer_id, error=str(exc)[:300],
                                                            retry=exc.retryable))
                if not exc.retryable:
                    break
                continue
            self.metrics.rerouted_requests.labels(str(response.status), *gvr).inc()
            return response
        if last is None:  # membership dropped every candidate since the decision
            return self._unavailable(info, routing.Decision(routing.UNAVAILABLE, "", candidates))
        self.metrics.rerouted_requests.labels("503", *gvr).inc()
        self.metrics.peer_proxy_errors.labels("proxy_transport", *gvr).inc()
        return upstream_failure(last.cause, "every capable peer", self.retry_after)

    async def _deliver(self, request: web.Request, upstream: Upstream, headers,
                       long_running: bool) -> web.StreamResponse:
        """Tunnel an upgrade or stream a plain request; ForwardError if nothing arrived."""
        if tunnel.is_upgrade(request):
            return await tunnel.forward_upgrade(
                request, upstream, headers, connect_timeout=self.transport.connect_timeout,
                response_timeout=self.transport.request_timeout)
        return await forwarding.forward(request, self.transport, upstream, headers,
                                        long_running=long_running)

    async def _openapi_index(self, request: web.Request,
                             downstream: Downstream) -> web.StreamResponse:
        """The backend's OpenAPI v3 index, with entries for peer-only group/versions."""
        headers = forwarding.request_headers(request, downstream, to_peer=False)
        for name in ("Accept-Encoding", "If-None-Match"):  # we rewrite the body
            headers.popall(name, None)
        try:
            answer = await self.transport.fetch(self.backend.for_headers(headers),
                                                request.raw_path, headers=headers,
                                                timeout=self.transport.request_timeout,
                                                max_bytes=OPENAPI_INDEX_MAX_BYTES)
        except UpstreamError as exc:
            log.warning("backend openapi index request failed", extra=kv(error=str(exc)[:300]))
            return upstream_failure(exc, "the backend API server", self.retry_after)
        body = answer.body
        if answer.status == 200:
            body = openapi.merge_index(answer.body, self.cache.view()) or answer.body
        return web.Response(status=answer.status, body=body, headers={
            "Content-Type": answer.headers.get("Content-Type", "application/json")})

    def _unavailable(self, info: RequestInfo, decision: routing.Decision) -> web.Response:
        gvr = _gvr_labels(info)
        self.metrics.peer_proxy_errors.labels("endpoint_resolution", *gvr).inc()
        what = "/".join(p for p in gvr if p)
        return status_response(
            503, f"{what} is served only by peers that are unreachable now "
                 f"({', '.join(decision.peers)}); retry later",
            headers={"Retry-After": str(self.retry_after)})


def _gvr_labels(info: RequestInfo) -> tuple[str, str, str]:
    """Metric labels; only requests some peer's discovery lists get here, so bounded."""
    if info.is_resource_request:
        return info.api_group, info.api_version, info.resource
    group, version = routing.group_version_path(info) or ("", "")
    return group, version, ""


def _client_certificate(request: web.Request) -> bytes | None:
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    return ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
