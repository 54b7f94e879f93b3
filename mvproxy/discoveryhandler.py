"""``GET /api`` and ``GET /apis``: the merged (peer-aggregated) discovery documents.

Which view a client gets (DESIGN.md, "Request decision" step 2):

- from a peer, with ``profile=nopeer``, or protobuf-only: the backend's own answer,
  forwarded (a peer polling us must see our backend, not our merge of it);
- aggregated v2/v2beta1: the merged document from the cache;
- legacy JSON: the merged ``APIVersions`` / ``APIGroupList``;
- anything else: 406.

The merged bytes and ETag are rendered once per cache generation. Before answering
from the cache, mvproxy asks the backend the same question with the downstream's
credentials (``If-None-Match``, so it usually costs a 304): mvproxy must never show
discovery to a client the backend would refuse, and it cannot judge a bearer
token itself. A yes is remembered for ``AUTHORIZED_TTL`` per set of credentials
(kube-apiserver itself caches a successful token authentication for 10 s), by a
hash, never the credentials themselves.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from mvproxy import discovery, forwarding
from mvproxy.cache import CacheView, DiscoveryCache
from mvproxy.errors import UpstreamError
from mvproxy.forwarding import ForwardError
from mvproxy.kubestatus import status_reply, upstream_failure
from mvproxy.listener import Exchange
from mvproxy.logs import kv
from mvproxy.metrics import Metrics
from mvproxy.requestinfo import RequestInfo
from mvproxy.transport import Transport, Upstream

log = logging.getLogger(__name__)

AUTHORIZED_TTL = 10.0
"""Seconds a backend's yes to a discovery probe is reused for the same credentials."""
AUTHORIZED_MAX = 10_000
"""Credential sets remembered at most (oldest forgotten first)."""
MEMO_MAX_BYTES = 16 * 1024
"""Credentials larger than this are hashed on every request rather than kept on the
connection (a token is a few KiB; the head limit allows a MiB per idle connection)."""


def _credentials_key(exchange: Exchange) -> bytes:
    """Who is asking: the connection's identity and every credential header, hashed
    (once per connection while its credentials stay the same)."""
    credentials = tuple(name.lower() + b"\0" + value for name, value in exchange.raw
                        if name[:1] in b"aAiI"
                        and name.lower().startswith((b"authorization", b"impersonate-")))
    memo = exchange.conn.credentials_memo
    if memo is not None and memo[0] == credentials:
        return memo[1]
    digest = hashlib.sha256(repr((exchange.downstream.kind, exchange.downstream.user,
                                  exchange.downstream.groups)).encode())
    for credential in credentials:
        digest.update(credential + b"\0")
    key = digest.digest()
    if sum(map(len, credentials)) <= MEMO_MAX_BYTES:  # an idle connection holds it
        exchange.conn.credentials_memo = (credentials, key)
    return key


@dataclass
class DiscoveryHandler:
    cache: DiscoveryCache
    transport: Transport
    backend: Upstream
    metrics: Metrics
    probe_timeout: float
    max_bytes: int
    retry_after: int
    _probe_etags: dict[str, str] = field(default_factory=dict)
    _authorized: OrderedDict[tuple[bytes, str], float] = field(default_factory=OrderedDict)
    clock: Callable[[], float] = time.monotonic

    def handle_now(self, exchange: Exchange, info: RequestInfo) -> bool:
        """Answer at once when no upstream is needed: a merged document for credentials
        the backend said yes to within ``AUTHORIZED_TTL``. False: use ``handle``."""
        if exchange.downstream.is_peer:
            return False
        negotiated = discovery.negotiate(exchange.headers.get("Accept"))
        if negotiated.nopeer or negotiated.kind not in ("aggregated", "legacy"):
            return False
        view = self.cache.view()
        if not view.synced or view.merged() is None:
            return False
        probe_path = "/api" if _is_core(info.path) else "/apis"
        if self._authorized.get((_credentials_key(exchange), probe_path), 0.0) <= self.clock():
            return False
        self._merged(exchange, view, negotiated, core=_is_core(info.path))
        return True

    async def handle(self, exchange: Exchange, info: RequestInfo) -> None:
        headers = exchange.headers
        negotiated = discovery.negotiate(headers.get("Accept"))
        if negotiated.counts_as_nopeer:  # every one, peers' polls included, as upstream
            self.metrics.nopeer_requests.inc()
        if exchange.downstream.is_peer or negotiated.nopeer or negotiated.kind == "backend":
            await self._from_backend(exchange)
            return
        if negotiated.kind == "not_acceptable":
            answer = status_reply(406, "only aggregated (apidiscovery.k8s.io v2, v2beta1) "
                                       "and legacy JSON discovery are served here")
            exchange.respond(answer.status, answer.fields, answer.body)
            return
        view = self.cache.view()
        if not view.synced or view.merged() is None:
            # Until every server has been polled once, a merge would silently omit
            # peer-only APIs; the backend's own answer is honest about what it knows.
            await self._from_backend(exchange)
            return
        if await self._authorize(exchange, info.path):
            self._merged(exchange, view, negotiated, core=_is_core(info.path))

    def _merged(self, exchange: Exchange, view: CacheView,
                negotiated: discovery.Negotiated, *, core: bool) -> None:
        key = ("api" if core else "apis", negotiated.kind, negotiated.api_version or "")
        document, cached = view.document(key, lambda: _render(view, negotiated, core))
        (self.metrics.aggregated_cache_hits if cached
         else self.metrics.aggregated_cache_misses).inc()
        fields = [("ETag", document.etag), ("Vary", "Accept"), ("Cache-Control", "public")]
        if exchange.headers.get("If-None-Match") == document.etag:
            exchange.respond(304, fields)
            return
        fields.append(("Content-Type", negotiated.content_type))
        exchange.respond(200, fields, document.body)

    async def _from_backend(self, exchange: Exchange) -> None:
        headers = forwarding.request_headers(exchange.fields, exchange.downstream, to_peer=False)
        try:
            await forwarding.forward(exchange, self.transport, self.backend.for_headers(headers),
                                     headers, long_running=False)
        except ForwardError as exc:
            log.warning("backend discovery request failed", extra=kv(error=str(exc)[:300]))
            answer = upstream_failure(exc.cause, "the backend API server", self.retry_after)
            exchange.respond(answer.status, answer.fields, answer.body)

    async def _authorize(self, exchange: Exchange, path: str) -> bool:
        """True if the backend answers this downstream's discovery; else its refusal
        has been relayed."""
        probe_path = "/api" if _is_core(path) else "/apis"
        key = (_credentials_key(exchange), probe_path)
        now = self.clock()
        if self._authorized.get(key, 0.0) > now:
            return True
        headers = forwarding.request_headers(exchange.fields, exchange.downstream,
                                             to_peer=False)
        headers["Accept"] = discovery.PEER_ACCEPT
        headers.popall("If-None-Match", None)
        if self._probe_etags.get(probe_path):
            headers["If-None-Match"] = self._probe_etags[probe_path]
        try:
            answer = await self.transport.fetch(self.backend.for_headers(headers), probe_path,
                                                headers=headers, timeout=self.probe_timeout,
                                                max_bytes=self.max_bytes)
        except UpstreamError as exc:
            log.warning("backend discovery probe failed", extra=kv(error=str(exc)[:300]))
            failure = upstream_failure(exc, "the backend API server", self.retry_after)
            exchange.respond(failure.status, failure.fields, failure.body)
            return False
        if answer.status == 200 and answer.headers.get("ETag"):
            self._probe_etags[probe_path] = answer.headers["ETag"]
        if answer.status in (200, 304):
            self._authorized[key] = now + AUTHORIZED_TTL
            self._authorized.move_to_end(key)
            while len(self._authorized) > AUTHORIZED_MAX:
                self._authorized.popitem(last=False)
            return True
        content_type = answer.headers.get("Content-Type", "application/json")
        exchange.respond(answer.status, [("Content-Type", content_type)], answer.body)
        return False


def _is_core(path: str) -> bool:
    return path.rstrip("/") == "/api"


def _render(view: CacheView, negotiated: discovery.Negotiated, core: bool) -> bytes:
    merged = view.merged()
    groups = merged.core if core else merged.groups
    if negotiated.kind == "aggregated":
        return discovery.render_aggregated(groups, api_version=negotiated.api_version)
    if core:
        return discovery.render_api_versions(groups)
    return discovery.render_api_group_list(groups)
