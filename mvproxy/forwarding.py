"""Moving one request to an upstream and its response back, streaming both ways.

Nothing here decides a route: ``handlers`` passes the upstream (and the headers
``identity`` allows). Bodies are never buffered whole: the request body is read
from the downstream as the upstream consumes it, and the response is written to the
downstream chunk by chunk as it arrives, so a watch event reaches the client when
the upstream sends it and memory stays flat whatever the size of the response.

The path and query are sent byte for byte as received (``raw_path``): upstream
kube-apiserver re-encodes and sorts the query and drops escaped path segments
(upstream-mvp.md §8.9); mvproxy does neither.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

from aiohttp import web
from multidict import CIMultiDict

from mvproxy.errors import UpstreamConnectError, UpstreamError
from mvproxy.logs import kv
from mvproxy.requestcheck import header_name_forwarded
from mvproxy.identity import PEER_PROXIED, Downstream, identity_headers, is_identity_header
from mvproxy.transport import Transport, Upstream

log = logging.getLogger(__name__)

# RFC 9110 §7.6.1 connection-specific headers, plus Host, which the client sets
# for the upstream it connects to.
HOP_BY_HOP = frozenset((
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "host",
))
AUDIT_ID = "Audit-ID"
_CHUNK = 64 * 1024


def _connection_tokens(headers) -> set[str]:
    tokens: set[str] = set()
    for value in headers.getall("Connection", ()):
        tokens.update(t.strip().lower() for t in value.split(",") if t.strip())
    return tokens


def request_headers(request: web.Request, downstream: Downstream, *,
                    to_peer: bool) -> CIMultiDict[str]:
    """Headers for the upstream: end-to-end ones, identity as ``identity`` allows.

    Names with an underscore are dropped (``requestcheck.header_name_forwarded``).

    A peer's own identity headers pass through (it vouches for the user); anyone
    else's are dropped and replaced by what mvproxy verified itself.
    """
    dropped = HOP_BY_HOP | _connection_tokens(request.headers)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
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


def response_headers(headers) -> CIMultiDict[str]:
    dropped = HOP_BY_HOP | _connection_tokens(headers) | {"content-length"}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)


def has_body(request: web.Request) -> bool:
    return bool(request.content_length) or request.headers.get(
        "Transfer-Encoding", "").lower() == "chunked"


class _Body:
    """The downstream body as an async iterator that records whether it was started.

    Failover may resend a request to the next peer only if no body byte was read
    for the first one.
    """

    def __init__(self, request: web.Request):
        self._request = request
        self.started = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.started = True
        async for chunk in self._request.content.iter_chunked(_CHUNK):
            yield chunk


async def forward(request: web.Request, transport: Transport, upstream: Upstream,
                  headers: CIMultiDict[str], *, long_running: bool) -> web.StreamResponse:
    """Send ``request`` to ``upstream`` and stream the answer back to the downstream.

    Raises ``ForwardError`` if no response started, saying whether the request may
    go to another upstream; once the response has started, an upstream failure can
    only end the stream, so the downstream connection is closed instead.
    """
    body = _Body(request) if has_body(request) else None
    try:
        async with transport.open(upstream, request.method, request.raw_path,
                                  headers=headers, data=body.__aiter__() if body else None,
                                  long_running=long_running) as upstream_response:
            response = web.StreamResponse(status=upstream_response.status,
                                          reason=upstream_response.reason,
                                          headers=response_headers(upstream_response.headers))
            if upstream_response.content_length is not None:
                response.content_length = upstream_response.content_length
            await response.prepare(request)
            await _copy(transport.stream(upstream, upstream_response), response, request,
                        upstream)
            return response
    except UpstreamError as exc:
        started = body is not None and body.started
        raise ForwardError(exc, retryable=_may_resend(exc, request.method, started)) from exc


class ForwardError(Exception):
    """No response reached the downstream; ``retryable`` if another upstream may try."""

    def __init__(self, cause: UpstreamError, *, retryable: bool):
        super().__init__(str(cause))
        self.cause = cause
        self.retryable = retryable


def _may_resend(exc: UpstreamError, method: str, body_started: bool) -> bool:
    """Never resend bytes that may have reached a server, unless the method is idempotent.

    A body already read from the downstream is gone: it cannot be sent again, whatever
    the method.
    """
    if body_started:
        return False
    if isinstance(exc, UpstreamConnectError):
        return True
    return method in IDEMPOTENT


IDEMPOTENT = frozenset(("GET", "HEAD", "OPTIONS"))


async def _copy(chunks: AsyncIterator[bytes], response: web.StreamResponse,
                request: web.Request, upstream: Upstream) -> None:
    """Copy until the upstream ends; a failure on either side closes the downstream."""
    try:
        async for chunk in chunks:
            await response.write(chunk)
        await response.write_eof()
    except (UpstreamError, ConnectionError) as exc:
        log.info("stream ended early; closing the downstream connection",
                 extra=kv(upstream=upstream.name, error=str(exc)[:200]))
        if request.transport is not None:
            request.transport.close()
