"""The only outbound HTTP: one pooled client session per upstream, mTLS, timeouts.

Every request mvproxy makes to its backend or a peer goes through here, and every
aiohttp exception stops here: callers see only ``UpstreamConnectError`` (nothing
was sent, safe to try another peer), ``UpstreamTimeout`` and
``UpstreamProtocolError``.

Sessions never decompress (``Content-Encoding`` passes through untouched), never
keep cookies (a proxy must not carry one user's cookie to another) and never read
proxy settings from the environment (traffic to the control plane must not detour).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import aiohttp
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from mvproxy.requestcheck import target_problem

log = logging.getLogger(__name__)

# aiohttp's workaround for leaked TLS transports (cpython#118960). On Pythons with the
# fix it is a no-op that warns (DeprecationWarning), so ask for it only where needed.
_CLEANUP_CLOSED = sys.version_info < (3, 12, 8) or (3, 13, 0) <= sys.version_info < (3, 13, 1)


class BodyTooLarge(UpstreamProtocolError):
    """The upstream's body is over the caller's size limit."""


@dataclass(frozen=True)
class Upstream:
    """A server mvproxy talks to: its backend, or one peer."""

    name: str
    """``backend`` or the peer's server ID; used in logs, errors and metrics."""
    url: str
    """Base URL, ``https://host:port`` without a trailing slash."""
    ssl_context: ssl.SSLContext = field(compare=False, repr=False)
    """Client context: the CA that verifies the upstream and our client certificate."""
    is_peer: bool = False
    anonymous: Upstream | None = field(default=None, compare=False, repr=False)
    """The same server reached *without* a client certificate (the backend only): for
    requests mvproxy asserts no identity for, so the backend's own anonymous policy
    applies. With the front-proxy certificate and no ``X-Remote-User``, kube-apiserver
    fails authentication outright (401) instead of treating the request as anonymous."""
    presents_certificate: bool = True
    """False for the ``anonymous`` twin (it also keeps the two pools apart)."""

    def for_headers(self, headers: Mapping[str, str]) -> Upstream:
        """The connection flavour for a request with these upstream headers."""
        if self.anonymous is not None and "X-Remote-User" not in headers:
            return self.anonymous
        return self


@dataclass(frozen=True)
class Fetched:
    """A small, fully read response (discovery documents)."""

    status: int
    headers: Mapping[str, str]
    """Case-insensitive, as HTTP headers are (Go servers send ``Etag``)."""
    body: bytes


class Transport:
    """Pooled sessions keyed by upstream, with one set of timeouts.

    ``connect_timeout`` bounds TCP connect plus TLS handshake; ``request_timeout``
    bounds a whole short request. Long-running requests (watch, exec, logs -f) get
    only the connect timeout: they may legitimately stay open for hours.

    No connection limit by default (``limit_per_upstream=0``): every open watch holds
    one HTTP/1.1 connection, a control plane has thousands, and a capped pool would
    turn the next request into a connect timeout. The backend enforces its own
    limits (max-in-flight, APF).
    """

    def __init__(self, *, connect_timeout: float, request_timeout: float,
                 limit_per_upstream: int = 0):
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._limit = limit_per_upstream
        self._sessions: dict[Upstream, aiohttp.ClientSession] = {}

    def _session(self, upstream: Upstream) -> aiohttp.ClientSession:
        session = self._sessions.get(upstream)
        if session is None or session.closed:
            # Peers get a fresh connection per request: on a pooled one, a frozen peer
            # (SIGSTOP, paused VM) takes the request and never answers, holding it for
            # the whole request timeout (a watch: forever). A new connection fails
            # within connect_timeout instead (TLS handshake), so the request fails over
            # or gets its 503 promptly. The backend keeps its pool.
            reuse = {"force_close": True} if upstream.is_peer else {"keepalive_timeout": 30}
            connector = aiohttp.TCPConnector(ssl=upstream.ssl_context, limit=self._limit,
                                             enable_cleanup_closed=_CLEANUP_CLOSED, **reuse)
            session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"))
            self._sessions[upstream] = session
        return session

    def _timeout(self, long_running: bool, total: float | None = None) -> aiohttp.ClientTimeout:
        # ``connect`` covers TCP connect *and* the TLS handshake: a peer that accepts
        # the TCP connection but is frozen must not hold a request for the whole
        # request timeout; it fails over (or gets a 503) after connect_timeout.
        return aiohttp.ClientTimeout(
            total=None if long_running else (total or self.request_timeout),
            sock_connect=self.connect_timeout, connect=self.connect_timeout)

    async def fetch(self, upstream: Upstream, path: str, *, headers: Mapping[str, str],
                    timeout: float, max_bytes: int) -> Fetched:
        """GET ``path`` and read the body whole, refusing bodies over ``max_bytes``."""
        async with self.open(upstream, "GET", path, headers=headers,
                             timeout=self._timeout(False, timeout)) as response:
            body = await _read_capped(upstream, response, max_bytes)
            headers = CIMultiDictProxy(CIMultiDict(response.headers))
            return Fetched(response.status, headers, body)

    @contextlib.asynccontextmanager
    async def open(self, upstream: Upstream, method: str, path_qs: str, *,
                   headers: Mapping[str, str], data=None, long_running: bool = False,
                   timeout: aiohttp.ClientTimeout | None = None
                   ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send a request and yield the response with its body still unread (streaming).

        ``path_qs`` goes out byte for byte: ``encoded=True`` stops yarl from requoting
        it (``%7E`` -> ``~``, ``%2f`` -> ``%2F``), which would change what the upstream
        authorizes and audits.
        """
        if target_problem(path_qs):
            # Callers pass only checked targets; this keeps the URL from ever naming
            # another host (an absolute or '//host' target replaces the base URL).
            raise UpstreamProtocolError(upstream.name, "refusing a target that is not "
                                                       "an origin-form path")
        session = self._session(upstream)
        # Joined by hand: yarl's join with a base URL removes dot segments (RFC 3986
        # §5.2), and '/a/../b' must reach the upstream as sent.
        target = URL(upstream.url + path_qs, encoded=True)
        with _mapped(upstream):
            async with session.request(method, target, headers=headers, data=data,
                                       allow_redirects=False, compress=None,
                                       timeout=timeout or self._timeout(long_running)) as resp:
                yield resp

    @staticmethod
    async def stream(upstream: Upstream, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The response body as it arrives, with errors mapped like everything else."""
        with _mapped(upstream):
            async for chunk in response.content.iter_any():
                yield chunk

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)


async def _read_capped(upstream: Upstream, response: aiohttp.ClientResponse,
                       max_bytes: int) -> bytes:
    declared = response.content_length
    if declared is not None and declared > max_bytes:
        raise BodyTooLarge(upstream.name,
                           f"body of {declared} bytes exceeds the {max_bytes}-byte limit")
    chunks, size = [], 0
    with _mapped(upstream):
        async for chunk in response.content.iter_chunked(65536):
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(upstream.name, f"body exceeds the {max_bytes}-byte limit")
            chunks.append(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def _mapped(upstream: Upstream):
    """Translate aiohttp/OS errors into mvproxy's, most specific first."""
    try:
        yield
    except UpstreamError:
        raise
    except (aiohttp.ClientConnectorError, aiohttp.ClientSSLError) as exc:
        raise UpstreamConnectError(upstream.name, f"cannot connect: {exc}") from exc
    except (aiohttp.ConnectionTimeoutError, aiohttp.SocketTimeoutError) as exc:
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            raise UpstreamConnectError(upstream.name, "connect timed out") from exc
        raise UpstreamTimeout(upstream.name, "timed out waiting for data") from exc
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout(upstream.name, "timed out") from exc
    except aiohttp.ClientResponseError as exc:
        # Its text holds the request URL with its query (exec commands, selectors):
        # keep only what identifies the failure.
        raise UpstreamProtocolError(upstream.name, f"broken response: {type(exc).__name__} "
                                                   f"(status {exc.status})") from exc
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError) as exc:
        raise UpstreamProtocolError(upstream.name, f"broken response: {exc}") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamProtocolError(upstream.name, type(exc).__name__) from exc
