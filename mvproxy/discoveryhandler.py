"""``GET /api``, ``/apis`` and ``/apis/<g>``: the merged (peer-aggregated) discovery.

Which view a client gets (docs/routing.md, "Merged discovery"):

- from a peer, or with ``profile=nopeer`` (JSON or protobuf): the backend's own
  answer, forwarded (a peer polling us must see our backend, not our merge of it);
- aggregated v2 (``/api``, ``/apis`` only): the merged document from the cache;
  aggregated v2beta1 the same, but only while the backend serves v2beta1 itself (asked
  each time): kube-apiserver 1.33+ does not, and answers such a client by its next
  Accept clause (the legacy list) or 406, so mvproxy does too;
- legacy ``GET /apis/<g>`` of a group no server's discovery lists: the backend's answer,
  its ``APIGroup`` turned into a 404 (``_unlisted_group``);
- legacy JSON: the merged ``APIVersions`` / ``APIGroupList`` / ``APIGroup``, so
  ``/apis/<g>`` lists the versions only peers serve, as ``/apis`` does; and
  ``/apis/<g>/<v>`` of a group/version the backend serves while peers serve more of
  it (routing sends only those here): the backend's ``APIResourceList`` plus the
  resources and subresources only peers list;
- anything else, other protobuf included (it would lack the peer-only APIs): 406.

The merged bytes and ETag are rendered once per cache generation. Before answering
from the cache, mvproxy asks the backend the same question with the downstream's
credentials: mvproxy must never show discovery to a client the backend would
refuse, and it cannot judge a bearer token itself. ``/api`` and ``/apis`` are asked
with ``If-None-Match``, so it usually costs a 304; ``/apis/<g>`` is asked exactly as
the client asked it (the backend's 200 or 404 is a yes), so a refusal is the one the
backend gives for that request and tells nobody which groups peers serve. Only
groups of the merged view get that far. A yes is remembered for ``AUTHORIZED_TTL``
per set of credentials and path (kube-apiserver itself caches a successful token
authentication for 10 s), by a hash, never the credentials themselves; a no never is.
One credential holds at most ``AUTHORIZED_PER_CREDENTIAL`` of them (``AuthorizedMemo``).

The common request (a client polling ``/apis`` with the same Accept on a connection
already said yes to) is answered by callbacks from the listener's entry point, without
a task (``handle_now``): per cache generation and Accept value the answer's head and
body are kept ready (``Prepared``), so it costs a scan of the request's fields, the
memo lookups and one write. The yes is checked on every request, as on the slow path.

While the backend is down (the probe cannot connect, or polling ended it) and the
request has credentials, a reachable peer is asked the same question instead: its
mvproxy answers a peer with its own backend's answer, so that backend authorizes the
same credentials under the same RBAC. Discovery through a member whose kube-apiserver
restarts then keeps working, as its resource requests do (``handlers``).
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from multidict import CIMultiDict

from mvproxy import discovery, forwarding, wire
from mvproxy.cache import CacheView, DiscoveryCache
from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from mvproxy.forwarding import ForwardError
from mvproxy.identity import USER, has_credentials
from mvproxy.kubestatus import status_reply, upstream_failure
from mvproxy.listener import Exchange
from mvproxy.live import LiveSettings
from mvproxy.logs import throttled
from mvproxy.metrics import Metrics
from mvproxy.requestinfo import RequestInfo
from mvproxy.transport import Fetched, Transport, Upstream
from mvproxy.wire import RawFields

log = logging.getLogger(__name__)

AUTHORIZED_TTL = 10.0
"""Seconds a backend's yes to a discovery probe is reused for the same credentials."""
AUTHORIZED_MAX = 10_000
"""Yeses remembered at most, (credentials, path) each (oldest forgotten first)."""
AUTHORIZED_PER_CREDENTIAL = 128
"""Yeses one credential may hold at most (its own oldest forgotten first): what
kube-apiserver authenticates of a request is less than the memo's key (it reads
``Bearer <token> <anything>`` as ``<token>`` and ignores other ``Authorization-*``
lines), so one token could otherwise mint entries until every other client's yes is
pushed out. 128 covers ``/api``, ``/apis`` and ``/apis/<g>`` of every group a cluster
lists, in a few spellings; at most half of ``AUTHORIZED_MAX``."""
MEMO_MAX_BYTES = 16 * 1024
"""Credentials larger than this are hashed on every request rather than remembered
(a token is a few KiB; the head limit allows a MiB per request)."""


PREPARED_MAX = 64
"""Prepared answers kept per cache generation (keyed by the client's Accept value:
client input, so bounded; beyond it, answers are rendered per request as before)."""
PREPARED_ACCEPT_MAX_BYTES = 1024
"""Longest Accept value an answer is prepared for."""

MEMO_CONNECTIONS = 1024
"""Connections whose last credentials' hash is remembered (oldest forgotten first)."""


class CredentialsMemo:
    """Who is asking, as a hash of the connection's identity and every credential header,
    computed once per connection while its credentials stay the same (a client sends
    the same token on every request of a connection).

    Each connection has its own entry, under its ``connection_id`` (never reused in a
    process), and an entry answers only for the same credential lines: the hash of one
    connection (its TLS identity is in it) never stands for another's request."""

    __slots__ = ("_by_connection", "_max")

    def __init__(self, max_connections: int = MEMO_CONNECTIONS):
        self._by_connection: OrderedDict[int, tuple[tuple[bytes, ...], bytes]] = OrderedDict()
        self._max = max_connections

    def key(self, exchange: Exchange) -> bytes:
        return self.key_of(exchange, _scanned(exchange.raw).credentials)

    def key_of(self, exchange: Exchange, credentials: tuple[bytes, ...]) -> bytes:
        """``key`` for the credential lines ``_scanned`` found in ``exchange``."""
        connection = exchange.connection_id
        memo = self._by_connection.get(connection)
        if memo is not None and memo[0] == credentials:
            self._by_connection.move_to_end(connection)
            return memo[1]
        downstream = exchange.downstream
        digest = hashlib.sha256(repr((downstream.kind, downstream.user,
                                      downstream.groups)).encode())
        for credential in credentials:
            digest.update(credential + b"\0")
        key = digest.digest()
        if sum(map(len, credentials)) <= MEMO_MAX_BYTES:
            self._by_connection[connection] = (credentials, key)
            self._by_connection.move_to_end(connection)
            while len(self._by_connection) > self._max:
                self._by_connection.popitem(last=False)
        else:
            self._by_connection.pop(connection, None)
        return key

    def __len__(self) -> int:
        return len(self._by_connection)


def credential_of(exchange: Exchange, credentials: tuple[bytes, ...]) -> bytes:
    """A hash of what kube-apiserver authenticates ``exchange`` by, whatever else its
    credential lines say: for a certificate user, the identity mvproxy asserts (kube
    reads the front-proxy headers first and the token not at all); else the bearer
    token as kube's token authenticator reads the first ``Authorization`` value
    (trimmed, ``<scheme> <token>[ <ignored>]``, the scheme ``bearer`` in any case), or
    nothing (an anonymous request, however it is spelt). ``Impersonate-*`` lines are
    not in it: an impersonator's yeses count as its own."""
    downstream = exchange.downstream
    digest = hashlib.sha256(repr((downstream.kind, downstream.user,
                                  downstream.groups)).encode())
    if downstream.kind == USER:
        return digest.digest()
    for line in credentials:
        if line.startswith(_AUTHORIZATION_LINE):
            parts = line[len(_AUTHORIZATION_LINE):].strip().split(b" ", 2)
            if len(parts) > 1 and parts[0].lower() == b"bearer" and parts[1]:
                digest.update(b"\0" + parts[1])
            break
    return digest.digest()


_AUTHORIZATION_LINE = b"authorization\0"


class AuthorizedMemo:
    """The backend's yeses to discovery probes: per (credentials key, path), until when
    it holds. At most ``max_entries`` in all, oldest forgotten first, and at most
    ``per_credential`` for one credential (``credential_of``), its own oldest
    forgotten first, so no client's yeses can be pushed out by another's flood unless
    the memo is full of distinct credentials the backend said yes to."""

    __slots__ = ("_by_credential", "_entries", "_max", "_share")

    def __init__(self, max_entries: int | None = None, per_credential: int | None = None):
        self._max = AUTHORIZED_MAX if max_entries is None else max_entries
        share = AUTHORIZED_PER_CREDENTIAL if per_credential is None else per_credential
        self._share = max(1, min(share, self._max // 2))
        self._entries: OrderedDict[tuple[bytes, str], tuple[float, bytes]] = OrderedDict()
        self._by_credential: dict[bytes, OrderedDict[tuple[bytes, str], None]] = {}

    def until(self, key: tuple[bytes, str]) -> float:
        """When the yes for ``key`` (credentials key, path) ends; 0.0 if there is none."""
        entry = self._entries.get(key)
        return 0.0 if entry is None else entry[0]

    def remember(self, key: tuple[bytes, str], credential: bytes, until: float) -> None:
        self._forget(key)
        self._entries[key] = (until, credential)
        own = self._by_credential.setdefault(credential, OrderedDict())
        own[key] = None
        while len(own) > self._share:
            self._forget(next(iter(own)))
        while len(self._entries) > self._max:
            self._forget(next(iter(self._entries)))

    def _forget(self, key: tuple[bytes, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        own = self._by_credential[entry[1]]
        del own[key]
        if not own:
            del self._by_credential[entry[1]]

    def held_by(self, credential: bytes) -> int:
        """How many yeses ``credential`` holds now."""
        return len(self._by_credential.get(credential, ()))

    def __iter__(self) -> Iterator[tuple[bytes, str]]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class DiscoveryHandler:
    cache: DiscoveryCache
    transport: Transport
    backend: Upstream
    metrics: Metrics
    live: LiveSettings
    """Retry-After, probe timeout and document limit: a reload changes them in place."""
    peers: Callable[[], Mapping[str, Upstream]] = dict
    """The current peers (to authorize at one while the backend is down)."""
    _probe_etags: dict[str, str] = field(default_factory=dict)
    _authorized: AuthorizedMemo = field(default_factory=AuthorizedMemo)
    credentials: CredentialsMemo = field(default_factory=CredentialsMemo)
    clock: Callable[[], float] = time.monotonic
    _prepared: dict[tuple[str, bytes | None], Prepared] = field(default_factory=dict)
    """Ready answers of ``_prepared_view``, by (path, the client's Accept value)."""
    _prepared_view: CacheView | None = None

    def handle_now(self, exchange: Exchange, info: RequestInfo) -> bool:
        """Answer at once when no upstream is needed: a merged document for credentials
        the backend said yes to within ``AUTHORIZED_TTL``. False: use ``handle``."""
        if exchange.downstream.is_peer or info.api_version:
            return False
        scanned = _scanned(exchange.raw)
        path = _probe_path(info)
        view = self.cache.view()
        if view is not self._prepared_view:  # a new generation: new documents
            self._prepared = {}
            self._prepared_view = view
        prepared = self._prepared.get((path, scanned.accept))
        if prepared is None:  # not yet prepared, or not preparable: decide it all
            accept = scanned.accept
            negotiated = discovery.negotiate(
                None if accept is None else accept.decode("latin-1"),
                aggregated=path in _TOP_LEVEL)
            if negotiated.nopeer or negotiated.kind not in ("aggregated", "legacy"):
                return False
            if negotiated.api_version == discovery.API_VERSION_V2BETA1:
                return False  # whether the backend serves it is asked every time
            if not _answerable(view, path):
                return False
        key = self.credentials.key_of(exchange, scanned.credentials)
        if self._authorized.until((key, path)) <= self.clock():
            return False
        if prepared is None:
            self._merged(exchange, view, negotiated, path, prepare=True)
            return True
        self.metrics.aggregated_cache_hits.inc()
        prepared.answer(exchange, scanned.if_none_match)
        return True

    async def handle(self, exchange: Exchange, info: RequestInfo) -> None:
        if info.api_version:  # routing.TO_RESOURCE_LIST
            await self._resource_list(exchange, info)
            return
        path = _probe_path(info)
        negotiated = _negotiate(exchange, path)
        if negotiated.counts_as_nopeer:  # every one, peers' polls included, as upstream
            self.metrics.nopeer_requests.inc()
        if exchange.downstream.is_peer or negotiated.nopeer:  # "backend" is nopeer too
            await self._from_backend(exchange)
            return
        view = self.cache.view()
        if not _answerable(view, path):
            if path not in _TOP_LEVEL and view.synced and view.merged() is not None:
                await self._unlisted_group(exchange)
            else:
                await self._from_backend(exchange)
            return
        # Authorization first, as in kube-apiserver: an unauthenticated client learns
        # nothing here, not even which Accept values a group path would take.
        asked_v2beta1 = negotiated.api_version == discovery.API_VERSION_V2BETA1
        if asked_v2beta1:
            served = await self._backend_serves_v2beta1(exchange, path)
            if served is None:
                return
            if not served:  # as the backend: the client's next clause, else its 406
                negotiated = discovery.negotiate(exchange.headers.get("Accept"),
                                                 v2beta1=False)
                if negotiated.kind not in ("aggregated", "legacy") or negotiated.nopeer:
                    await self._from_backend(exchange)
                    return
        elif not await self._authorize(exchange, path):
            return
        if negotiated.kind == "not_acceptable":
            offered = ("aggregated (apidiscovery.k8s.io v2, v2beta1) and legacy JSON"
                       if path in _TOP_LEVEL else "legacy JSON")
            answer = status_reply(406, f"only {offered} discovery is served here")
            exchange.respond(answer.status, answer.fields, answer.body)
        else:
            self._merged(exchange, view, negotiated, path, prepare=not asked_v2beta1)

    def _merged(self, exchange: Exchange, view: CacheView,
                negotiated: discovery.Negotiated, path: str, *, prepare: bool) -> None:
        """The merged document, 200 or 304. ``prepare``: ``negotiated`` is what the
        client's Accept gives by itself (not after asking the backend), so the answer
        may be kept ready for it in this generation."""
        key = (path, negotiated.kind, negotiated.api_version or "")
        document, cached = view.document(key, lambda: _render(view, negotiated, path))
        (self.metrics.aggregated_cache_hits if cached
         else self.metrics.aggregated_cache_misses).inc()
        prepared = Prepared.of(document.etag, negotiated.content_type, document.body)
        scanned = _scanned(exchange.raw)
        accept = scanned.accept
        if prepare and view is self._prepared_view and len(self._prepared) < PREPARED_MAX \
                and (accept is None or len(accept) <= PREPARED_ACCEPT_MAX_BYTES):
            self._prepared[(path, accept)] = prepared
        prepared.answer(exchange, scanned.if_none_match)

    async def _resource_list(self, exchange: Exchange, info: RequestInfo) -> None:
        """``GET /apis/<g>/<v>`` (``/api/<v>``) of a group/version the backend serves
        while peers serve more of it: the backend's own ``APIResourceList``, asked with
        the downstream's credentials (so its refusal is the answer), plus the entries
        only peers list, so a client on legacy discovery (kr8s, the Python
        ``DynamicClient``) finds them as in the merged ``/apis``. Asked as JSON when
        the client takes JSON (its protobuf preference is passed over, as for
        ``/apis``); a client that takes only other encodings gets the backend's
        answer as it is, and so does anything but a 200 APIResourceList."""
        view = self.cache.view()
        extra = view.peer_only_resources(info.api_group, info.api_version)
        accept = discovery.negotiate(exchange.headers.get("Accept"), aggregated=False)
        if not extra or accept.kind != "legacy":
            await self._from_backend(exchange)
            return
        headers = forwarding.headers_for(exchange, to_peer=False)
        headers["Accept"] = "application/json"
        for name in ("Accept-Encoding", "If-None-Match"):  # the body is rewritten
            headers.popall(name, None)
        answer = await self._fetch_from_backend(exchange, headers)
        if answer is None:
            return
        group_version = (f"{info.api_group}/{info.api_version}" if info.api_group
                         else info.api_version)
        merged = (discovery.merge_resource_list(answer.body, extra, group_version)
                  if answer.status == 200 else None)
        fields = forwarding.response_headers(list(answer.headers.items()))
        if merged is not None and merged is not answer.body:
            fields = [(n, v) for n, v in fields if n.lower() not in _REWRITTEN]
            exchange.respond(200, fields, merged)
            return
        exchange.respond(answer.status, fields, answer.body)

    async def _fetch_from_backend(self, exchange: Exchange,
                                  headers: CIMultiDict[str]) -> Fetched | None:
        """The backend's whole answer to ``exchange.target``; None when it could not be
        reached, after answering the client with the 503/504 ``Status`` that says why."""
        try:
            return await self.transport.fetch(self.backend.for_headers(headers),
                                              exchange.target, headers=headers,
                                              timeout=self.live.probe_timeout,
                                              max_bytes=self.live.max_document_bytes)
        except UpstreamError as exc:
            throttled.warning(log, "backend discovery request failed", error=str(exc)[:300])
            failure = upstream_failure(exc, "the backend API server", self.live.retry_after,
                                       idempotent=True)
            exchange.respond(failure.status, failure.fields, failure.body)
            return None

    async def _unlisted_group(self, exchange: Exchange) -> None:
        """``GET /apis/<g>`` of a group no server's discovery lists: the backend's
        answer, asked as the client asked it (so a refusal is its own), except that its
        ``APIGroup`` becomes kube's 404 for an unknown group.

        kube-apiserver answers ``/apis/<g>`` from the APIService objects in etcd, where
        every server registers its groups (measured: 1.36.3 beside 1.37.2 describes
        ``storagemigration.k8s.io``, then 404s ``/apis/<g>/v1``); such an object
        outlives the server that served it until a server starts and removes it.
        mvproxy answers what its ``/apis`` lists, and anything it lists can be got."""
        headers = forwarding.headers_for(exchange, to_peer=False)
        answer = await self._fetch_from_backend(exchange, headers)
        if answer is None:
            return
        if answer.status == 200:
            exchange.respond(404, list(_NOT_FOUND_FIELDS), _NOT_FOUND_BODY)
            return
        exchange.respond(answer.status,
                         forwarding.response_headers(list(answer.headers.items())),
                         answer.body)

    async def _backend_serves_v2beta1(self, exchange: Exchange, path: str) -> bool | None:
        """Whether the backend answers this client aggregated v2beta1 (kube-apiserver
        1.33+ does not: 406, or its next clause); None: its refusal has been relayed.

        Asked on every v2beta1 request, with the client's credentials (it authorizes,
        as ``_authorize`` does): an operator expects mvproxy to offer what its backend
        offers, and a backend replaced by another release must not be misjudged. Only
        clients that prefer v2beta1 to v2 pay this round trip (kubectl 1.27 and older)."""
        headers = forwarding.headers_for(exchange, to_peer=False)
        headers["Accept"] = discovery.AGGREGATED_V2BETA1
        headers.popall("If-None-Match", None)
        target = f"{path}?{exchange.query}" if exchange.query else path
        try:
            answer = await self.transport.fetch(self.backend.for_headers(headers), target,
                                                headers=headers, timeout=self.live.probe_timeout,
                                                max_bytes=self.live.max_document_bytes)
        except UpstreamError as exc:
            if not isinstance(exc, UpstreamTimeout) or \
                    self._authorized.until((self.credentials.key(exchange), path)) \
                    > self.clock():
                # Down or broken, or a yes within AUTHORIZED_TTL: authorized as for v2
                # (a peer may say yes); legacy is always served.
                return False if await self._authorize(exchange, path) else None
            # Late: asking it again would double an overloaded backend's load for
            # each such request, and the client's wait.
            throttled.warning(log, "backend discovery probe failed", error=str(exc)[:300])
            failure = upstream_failure(exc, "the backend API server", self.live.retry_after,
                                       idempotent=True)
            exchange.respond(failure.status, failure.fields, failure.body)
            return None
        if answer.status == 406:  # kube authorizes before it negotiates
            return False
        if answer.status == 200:
            served = answer.headers.get("Content-Type", "").split(";profile")[0]
            return served == discovery.AGGREGATED_V2BETA1
        exchange.respond(answer.status,
                         forwarding.response_headers(list(answer.headers.items())),
                         answer.body)
        return None

    async def _from_backend(self, exchange: Exchange) -> None:
        headers = forwarding.headers_for(exchange, to_peer=False)
        try:
            await forwarding.forward(exchange, self.transport, self.backend.for_headers(headers),
                                     headers, long_running=False)
        except ForwardError as exc:
            throttled.warning(log, "backend discovery request failed", error=str(exc)[:300])
            answer = upstream_failure(exc.cause, "the backend API server", self.live.retry_after,
                                      idempotent=exchange.method in forwarding.IDEMPOTENT)
            exchange.respond(answer.status, answer.fields, answer.body)

    async def _authorize(self, exchange: Exchange, path: str) -> bool:
        """True if the backend (while it is down, a peer) answers this downstream's
        ``path``; else its refusal has been relayed. ``path`` is ``/api``, ``/apis``
        or a merged group's ``/apis/<g>`` (the memo stays bounded by the groups servers
        list, not by what clients send)."""
        key = (self.credentials.key(exchange), path)
        now = self.clock()
        if self._authorized.until(key) > now:
            return True
        headers = forwarding.headers_for(exchange, to_peer=False)
        top_level = path in _TOP_LEVEL
        if top_level:
            headers["Accept"] = discovery.PEER_ACCEPT
            headers.popall("If-None-Match", None)
            if self._probe_etags.get(path):
                headers["If-None-Match"] = self._probe_etags[path]
        # The probe carries the client's query: kube-apiserver checks some of it (a bad
        # ``timeout``: 400) before authorization, and a group only peers serve must be
        # refused exactly as an unknown one, whose request goes to the backend whole.
        target = f"{path}?{exchange.query}" if exchange.query else path
        from_backend = True
        try:
            answer = await self.transport.fetch(self.backend.for_headers(headers), target,
                                                headers=headers, timeout=self.live.probe_timeout,
                                                max_bytes=self.live.max_document_bytes)
        except UpstreamError as exc:
            throttled.warning(log, "backend discovery probe failed", error=str(exc)[:300])
            at_peer = await self._authorize_at_peer(exchange, target, exc)
            if at_peer is None:
                failure = upstream_failure(exc, "the backend API server", self.live.retry_after,
                                           idempotent=exchange.method in forwarding.IDEMPOTENT)
                exchange.respond(failure.status, failure.fields, failure.body)
                return False
            answer, from_backend = at_peer, False  # a peer's ETag is not the backend's
        if top_level and from_backend and answer.status == 200 and answer.headers.get("ETag"):
            self._probe_etags[path] = answer.headers["ETag"]
        # A 404 for a group: authorized, the backend just does not serve it (peers do).
        if answer.status in (200, 304) or answer.status == 404 and not top_level:
            credential = credential_of(exchange, _scanned(exchange.raw).credentials)
            self._authorized.remember(key, credential, now + AUTHORIZED_TTL)
            return True
        # The backend's refusal with its own fields, as if it had been forwarded.
        exchange.respond(answer.status,
                         forwarding.response_headers(list(answer.headers.items())),
                         answer.body)
        return False

    async def _authorize_at_peer(self, exchange: Exchange, target: str,
                                 cause: UpstreamError) -> Fetched | None:
        """The same probe at a reachable peer, when the backend is down and the request
        has credentials (anonymous ones are the backend's alone); None: no answer."""
        if not isinstance(cause, (UpstreamConnectError, UpstreamUnreachable)) or \
                not has_credentials(exchange.downstream, exchange.raw, upgrade=False):
            return None
        upstreams = self.peers()
        for peer_id in sorted(self.cache.view().reachable):
            upstream = upstreams.get(peer_id)
            if upstream is None:
                continue
            headers = forwarding.headers_for(exchange, to_peer=True)
            headers.popall("If-None-Match", None)
            headers["Accept"] = discovery.PEER_ACCEPT
            try:
                return await self.transport.fetch(upstream, target, headers=headers,
                                                  timeout=self.live.probe_timeout,
                                                  max_bytes=self.live.max_document_bytes)
            except UpstreamError as exc:
                throttled.warning(log, "peer discovery probe failed", peer=peer_id,
                                  error=str(exc)[:300])
        return None


class Scanned(NamedTuple):
    """What discovery reads of a request's fields, in one pass over the raw bytes."""

    accept: bytes | None
    """The first ``Accept`` value (what ``exchange.headers.get`` gives, undecoded)."""
    if_none_match: bytes | None
    credentials: tuple[bytes, ...]
    """Every ``Authorization*`` and ``Impersonate-*`` line, lowercased name, NUL, value."""


def _scanned(raw: RawFields) -> Scanned:
    accept = if_none_match = None
    credentials = []
    for name, value in raw:
        first = name[:1]
        if first in b"aAiI":
            lowered = name.lower()
            if lowered.startswith((b"authorization", b"impersonate-")):
                credentials.append(lowered + b"\0" + value)
            elif lowered == b"accept":
                if accept is None:
                    accept = value
            elif lowered == b"if-none-match" and if_none_match is None:
                if_none_match = value
    return Scanned(accept, if_none_match, tuple(credentials))


class Prepared:
    """A merged document's answer, ready to write: the heads of its 200 and its 304
    (what ``Exchange.respond`` would send before the framing), and the body."""

    __slots__ = ("body", "etag", "length", "modified_head", "not_modified_head")

    def __init__(self, etag: bytes, modified_head: bytes, not_modified_head: bytes,
                 body: bytes):
        self.etag = etag
        self.modified_head = modified_head
        self.not_modified_head = not_modified_head
        self.body = body
        self.length = str(len(body)).encode()

    @classmethod
    def of(cls, etag: str, content_type: str, body: bytes) -> Prepared:
        fields = [("ETag", etag), ("Vary", "Accept"), ("Cache-Control", "public")]
        not_modified = wire.response_head(304, "", fields)[:-2]  # framing follows
        modified = wire.response_head(200, "", [*fields, ("Content-Type", content_type)])
        return cls(etag.encode("latin-1"), modified[:-2], not_modified, body)

    def answer(self, exchange: Exchange, if_none_match: bytes | None) -> None:
        """A 304 if the client has this ETag, else the 200 (no body for HEAD); the
        listener adds the framing and ``Connection`` as for any answer."""
        if if_none_match == self.etag:
            exchange.start_raw(304, self.not_modified_head, length=None, bodiless=True)
            exchange.end()
            return
        head = exchange.method == "HEAD"
        exchange.start_raw(200, self.modified_head, length=self.length, bodiless=head)
        exchange.write(b"" if head else self.body, end=True)


_TOP_LEVEL = frozenset(("/api", "/apis"))
#: kube-apiserver's answer for a group it does not know (Go's NotFound handler).
_NOT_FOUND_BODY = b"404 page not found\n"
_NOT_FOUND_FIELDS = (("Content-Type", "text/plain; charset=utf-8"),
                     ("X-Content-Type-Options", "nosniff"),
                     ("Cache-Control", "no-cache, private"))
#: Fields of the backend's answer that describe its own bytes, not the merged ones.
_REWRITTEN = frozenset(("etag", "content-md5", "content-encoding"))


def _probe_path(info: RequestInfo) -> str:
    """The discovery document asked for: ``/api``, ``/apis`` or ``/apis/<g>``."""
    if info.api_group:
        return f"/apis/{info.api_group}"
    return "/api" if info.path.rstrip("/") == "/api" else "/apis"


def _negotiate(exchange: Exchange, path: str) -> discovery.Negotiated:
    return discovery.negotiate(exchange.headers.get("Accept"), aggregated=path in _TOP_LEVEL)


def _answerable(view: CacheView, path: str) -> bool:
    """Whether the merged view may answer: not before every server has been polled once
    (a merge would silently omit peer-only APIs; the backend's own answer is honest
    about what it knows), and for ``/apis/<g>`` only if it lists the group."""
    if not view.synced or view.merged() is None:
        return False
    return path in _TOP_LEVEL or view.merged_group(path[len("/apis/"):]) is not None


def _render(view: CacheView, negotiated: discovery.Negotiated, path: str) -> bytes:
    # Only called after _answerable(view, path), and a view never changes: both exist.
    if path not in _TOP_LEVEL:
        group = view.merged_group(path[len("/apis/"):])
        assert group is not None
        return discovery.render_api_group(group)
    merged = view.merged()
    assert merged is not None
    groups = merged.core if path == "/api" else merged.groups
    if negotiated.kind == "aggregated":
        return discovery.render_aggregated(groups, api_version=negotiated.api_version)
    if path == "/api":
        return discovery.render_api_versions(groups)
    return discovery.render_api_group_list(groups)


# --------------------------------------------------------------------------- large answers
# A merged OpenAPI v3 document (``handlers.Proxy._openapi_document``) is megabytes.
# Handed to the connection whole, it sat in the TLS layer, encrypted, for as long as
# its client did not read, and one was built per request: every connection allowed to
# read OpenAPI could pin a copy. Now one document is built per set of inputs and shared
# by every request that would get the same bytes, and it is written a piece at a time,
# each once the client has read the one before (tests/test_openapi_memory.py).

PIECE = 16 * 1024
"""Bytes of a large answer handed to the connection at once (one TLS record): a client
that stops reading holds about two pieces in its TLS layer, not the document."""
SHARED_KEEP = 4
"""Shared documents kept after their last request ended, newest first (per cache
generation); those being written are found again as long as any request holds them."""
SHARED_KEEP_BYTES = 64 * 1024 * 1024
"""Bytes those kept documents may add up to (one may be larger: it is kept alone)."""


class SharedDocument:
    """One built document, its bytes and ETag, shared by every request that would
    produce the same bytes."""

    __slots__ = ("__weakref__", "body", "etag")

    def __init__(self, body: bytes):
        self.body = body
        self.etag = discovery.etag(body)


class SharedDocuments:
    """Documents by what they are built from (``key``: every input of the build, so a
    hit is the bytes a build would give), for one cache generation at a time: those a
    request still holds (weakly referenced, so a stalled client never costs a second
    copy) and the ``SHARED_KEEP`` most recent."""

    __slots__ = ("_alive", "_generation", "_kept")

    def __init__(self) -> None:
        self._alive: weakref.WeakValueDictionary[Hashable, SharedDocument] = \
            weakref.WeakValueDictionary()
        self._kept: OrderedDict[Hashable, SharedDocument] = OrderedDict()
        self._generation = -1

    def get(self, generation: int, key: Hashable,
            build: Callable[[], bytes]) -> SharedDocument:
        """The document of ``key`` in ``generation``, built by ``build`` unless a request
        holds it or it is kept."""
        if generation != self._generation:  # new inputs from the cache: start afresh
            self._generation = generation
            self._alive = weakref.WeakValueDictionary()
            self._kept.clear()
        document = self._alive.get(key)
        if document is None:
            document = self._alive[key] = SharedDocument(build())
        self._kept[key] = document
        self._kept.move_to_end(key)
        size = sum(len(kept.body) for kept in self._kept.values())
        while len(self._kept) > 1 and (len(self._kept) > SHARED_KEEP
                                       or size > SHARED_KEEP_BYTES):
            _, dropped = self._kept.popitem(last=False)
            size -= len(dropped.body)
        return document


async def respond_in_pieces(exchange: Exchange, status: int, fields: wire.Fields,
                            body: bytes) -> None:
    """``exchange.respond`` for a body that may be large: ``PIECE`` bytes at a time,
    the next only once the connection is writable again, so a client that stops reading
    holds a piece in the TLS layer, never the whole answer. The connection ending
    stops it (the listener closes it then: the answer is cut, never completed wrongly)."""
    if len(body) <= PIECE or exchange.method == "HEAD":
        exchange.respond(status, fields, body)
        return
    exchange.start(status, [*fields, ("Content-Length", str(len(body)))], hold=True)
    conn = exchange.conn
    for start in range(0, len(body), PIECE):
        if conn.paused_writing:
            await _writable(exchange)
        if conn.ended:
            return
        exchange.write(body[start:start + PIECE], end=start + PIECE >= len(body))


async def _writable(exchange: Exchange) -> None:
    """Until ``exchange``'s connection takes writes again (or ends)."""
    waiter = exchange.conn.loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)
    exchange.conn.when_writable(wake)
    await waiter
