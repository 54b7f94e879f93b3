"""Upgrade requests (exec, attach, port-forward, WebSocket watches): a byte tunnel.

``Connection: Upgrade`` requests cannot go through ``forwarding``: aiohttp's client
speaks WebSocket at most, never SPDY/3.1, and would strip the ``Upgrade`` header. So
this module owns the whole exchange with the upstream itself:

1. open a TLS connection to the upstream (bounded by the connect timeout); a failure
   here is ``UpstreamConnectError`` and retryable, since nothing was sent;
2. write the request head: method and raw path+query byte for byte, ``Host``, the
   headers the caller computed (``forwarding.request_headers``: the same identity
   headers as a plain request, upstream-mvp.md §8.1 is the bug we must not repeat),
   plus ``Connection: Upgrade`` and the client's ``Upgrade`` value;
3. read the response head (bounded in size and time). Not ``101``: the response is
   read whole (bounded) and relayed as an ordinary response, and the downstream
   connection is not reused. ``101``: the switch is relayed, and from then on bytes
   are copied both ways unchanged until one side ends.

Taking over the downstream: aiohttp's server protocol hands every byte it receives
to a "payload parser" once one is installed (``RequestHandler.set_parser``; that is
how ``WebSocketResponse`` takes over), including bytes it buffered after a WebSocket
upgrade request. ``_DownstreamBytes`` is such a parser: it queues chunks and pauses
the transport until the tunnel has forwarded them. It is installed before the ``101``
goes out, so no byte of the switched protocol reaches aiohttp's HTTP parser. The
response returned to aiohttp is already sent, refuses keep-alive, and its
``write_eof`` writes nothing: aiohttp closes the connection after the handler.

One limit: aiohttp's parser recognises only ``websocket`` as an upgrade, so for
``SPDY/3.1`` bytes a client sends *before* it has read the ``101`` are lost (its C
parser drops them). Clients must not send before the switch anyway, and client-go's
SPDY dialer reads the response first.

Ending: when either direction ends (EOF or error), both connections are closed,
after the bytes already copied are flushed, as kube-apiserver's upgrade-aware proxy
does. A real half-close is not possible here: asyncio cannot half-close TLS, and
aiohttp's server protocol closes the downstream transport as soon as it reads EOF.

This module never decides a route, never changes a byte of the tunnelled stream,
holds at most about one chunk per direction beyond the transports' own flow-control
buffers, and never logs headers, bodies or tunnelled bytes (they carry tokens and
terminal sessions).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import hdrs, web
from multidict import CIMultiDict
from yarl import URL

from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from mvproxy.forwarding import ForwardError, has_body, response_headers
from mvproxy.logs import V, kv
from mvproxy.transport import Upstream

log = logging.getLogger(__name__)

HEAD_LIMIT = 64 * 1024
"""Largest response head accepted from an upstream (and a chunk-size line)."""
REFUSAL_BODY_LIMIT = 1024 * 1024
"""Largest body of a non-101 answer relayed to the downstream (a Status is ~1 KiB)."""
CHUNK = 64 * 1024
CLOSE_TIMEOUT = 5.0
"""How long closing the upstream TLS connection may take (close_notify exchange)."""
_MAX_INTERIM = 8
"""1xx answers (other than 101) skipped before the real one."""


# --------------------------------------------------------------------------- entry points


def is_upgrade(request: web.Request) -> bool:
    """``Connection: upgrade`` with an ``Upgrade`` protocol, and no request body.

    An upgrade request with a body (not something kubectl sends) goes the plain
    way; ``forwarding`` strips ``Upgrade``, so the upstream sees a normal request.
    """
    tokens = {t.strip().lower() for v in request.headers.getall(hdrs.CONNECTION, ())
              for t in v.split(",")}
    return ("upgrade" in tokens and bool(request.headers.get(hdrs.UPGRADE, "").strip())
            and not has_body(request))


async def forward_upgrade(request: web.Request, upstream: Upstream, headers: CIMultiDict[str],
                          *, connect_timeout: float,
                          response_timeout: float = 60.0) -> web.StreamResponse:
    """Tunnel ``request`` to ``upstream``; returns when the tunnel (or refusal) is over.

    ``headers`` are the upstream request headers from ``forwarding.request_headers``.
    Raises ``ForwardError`` if nothing reached the downstream: retryable only when the
    connection could not be made. ``response_timeout`` bounds the wait for the
    upstream's answer (kube-apiserver answers an exec after reaching the kubelet).
    """
    try:
        head = _request_head(request, upstream, headers)
    except ValueError as exc:
        raise ForwardError(UpstreamProtocolError(upstream.name, str(exc)),
                           retryable=False) from exc
    reader, writer = await _connect(upstream, connect_timeout)
    try:
        answer, body = await _exchange(reader, writer, head, upstream, response_timeout)
        if answer.status != 101:
            await _close_upstream(writer)
            return _refusal(answer, body)
        try:
            response, downstream = await _switch_downstream(request, answer)
        except ConnectionResetError:
            # The downstream left while the upstream was switching: nothing to tunnel.
            log.log(V(4), "downstream left before the protocol switch",
                    extra=kv(upstream=upstream.name))
            await _close_upstream(writer)
            return web.Response(status=499, reason="Client Closed Request")
    except BaseException:
        await _close_upstream(writer)
        raise
    await _run_tunnel(request, response, downstream, reader, writer, upstream)
    return response


# --------------------------------------------------------------------------- upstream side


@dataclass(frozen=True)
class _Head:
    status: int
    reason: str
    headers: CIMultiDict[str]


def _request_head(request: web.Request, upstream: Upstream,
                  headers: CIMultiDict[str]) -> bytes:
    """The upstream request head; ``ValueError`` if a header cannot be sent as is."""
    url = URL(upstream.url)
    lines = [f"{request.method} {request.raw_path} HTTP/1.1",
             f"Host: {url.host_port_subcomponent}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines += ["Connection: Upgrade",
              f"Upgrade: {', '.join(request.headers.getall(hdrs.UPGRADE))}"]
    for line in lines:
        if any(c in line for c in "\r\n\0"):
            raise ValueError("a request header contains a line break or NUL")
    # aiohttp decoded the request with surrogateescape: this restores the bytes.
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


async def _connect(upstream: Upstream, timeout: float
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = URL(upstream.url)
    host, port = url.host or "", url.port or 443
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.open_connection(
                host, port, ssl=upstream.ssl_context, server_hostname=host,
                ssl_handshake_timeout=timeout, limit=HEAD_LIMIT)
    except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
        what = "connect timed out" if isinstance(exc, TimeoutError) else f"cannot connect: {exc}"
        raise ForwardError(UpstreamConnectError(upstream.name, what), retryable=True) from exc


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                    upstream: Upstream, timeout: float) -> tuple[_Head, bytes]:
    """Send the head, read the answer; the body too unless it is a 101."""
    try:
        async with asyncio.timeout(timeout):
            writer.write(head)
            await writer.drain()
            answer = await _read_answer(reader)
            body = b"" if answer.status == 101 else await _read_body(reader, answer)
            return answer, body
    except TimeoutError as exc:
        raise _failed(UpstreamTimeout(upstream.name, "timed out waiting for the upgrade "
                                                     "response")) from exc
    except asyncio.LimitOverrunError as exc:
        raise _failed(UpstreamProtocolError(upstream.name, "response head too large")) from exc
    except asyncio.IncompleteReadError as exc:
        raise _failed(UpstreamProtocolError(upstream.name, "connection closed before the "
                                                           "response was complete")) from exc
    except (ValueError, OSError) as exc:  # ValueError: unparsable; OSError: reset, TLS
        raise _failed(UpstreamProtocolError(upstream.name,
                                            f"broken upgrade response: {exc}")) from exc


def _failed(cause: UpstreamError) -> ForwardError:
    return ForwardError(cause, retryable=False)


async def _read_answer(reader: asyncio.StreamReader) -> _Head:
    for _ in range(_MAX_INTERIM):
        answer = _parse_head(await reader.readuntil(b"\r\n\r\n"))
        if answer.status == 101 or not 100 <= answer.status < 200:
            return answer
    raise ValueError("too many interim responses")


def _parse_head(raw: bytes) -> _Head:
    """Status line and header fields of an HTTP/1.x response head (``ValueError`` if bad)."""
    status_line, *fields = raw[:-4].split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    code, _, reason = rest.partition(b" ")
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise ValueError("not an HTTP/1.x status line")
    headers: CIMultiDict[str] = CIMultiDict()
    for field in fields:
        name, sep, value = field.partition(b":")
        if not sep or not name or name != name.strip() or b"\n" in field:
            raise ValueError("malformed header field")
        headers.add(name.decode("ascii"), value.strip(b" \t").decode("latin-1"))
    return _Head(int(code), reason.decode("latin-1"), headers)


async def _read_body(reader: asyncio.StreamReader, answer: _Head) -> bytes:
    """The body of a refusal, by Content-Length, chunked, or until close; bounded."""
    if answer.status in (204, 304):
        return b""
    if "chunked" in answer.headers.get(hdrs.TRANSFER_ENCODING, "").lower():
        return await _read_chunked(reader)
    length = answer.headers.get(hdrs.CONTENT_LENGTH)
    if length is not None:
        if not length.isdigit():
            raise ValueError("bad Content-Length")
        return await reader.readexactly(_within_limit(int(length)))
    body = await reader.read(REFUSAL_BODY_LIMIT + 1)
    while len(body) <= REFUSAL_BODY_LIMIT and (more := await reader.read(CHUNK)):
        body += more
    _within_limit(len(body))
    return body


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, dropped
                pass
            return b"".join(parts)
        total = _within_limit(total + size)
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise ValueError("bad chunk terminator")


def _within_limit(size: int) -> int:
    if size > REFUSAL_BODY_LIMIT:
        raise ValueError(f"response body over {REFUSAL_BODY_LIMIT} bytes")
    return size


async def _close_upstream(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(CLOSE_TIMEOUT):
            await writer.wait_closed()


# --------------------------------------------------------------------------- downstream side


def _refusal(answer: _Head, body: bytes) -> web.Response:
    """The upstream declined the upgrade: relay its answer, then close the connection."""
    response = web.Response(status=answer.status, reason=answer.reason or None, body=body,
                            headers=response_headers(answer.headers))
    response.force_close()
    return response


class _TunnelResponse(web.StreamResponse):
    """The relayed ``101``; after it the connection is the tunnel's, not HTTP's."""

    async def write_eof(self, data: bytes = b"") -> None:
        """Nothing ends a switched protocol at the HTTP level: write nothing."""


class _DownstreamBytes:
    """Receives the downstream's raw bytes in the place of aiohttp's payload parser.

    aiohttp calls ``feed_data`` for every chunk read from the connection and
    ``feed_eof`` when the connection is lost. Reading pauses while a chunk waits to be
    forwarded, so a fast client cannot fill memory.
    """

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._chunks: deque[bytes] = deque()
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if data:
            self._chunks.append(bytes(data))
            with contextlib.suppress(RuntimeError, AttributeError):
                self._transport.pause_reading()
            self._wake()
        return False, b""

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self) -> bytes:
        """The next chunk, or ``b""`` once the downstream connection has ended."""
        while not self._chunks:
            if self._eof:
                return b""
            with contextlib.suppress(RuntimeError, AttributeError):
                self._transport.resume_reading()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._chunks.popleft()


_NOT_RELAYED_ON_SWITCH = frozenset(("content-length", "transfer-encoding", "keep-alive"))


async def _switch_downstream(request: web.Request, answer: _Head
                             ) -> tuple[_TunnelResponse, _DownstreamBytes]:
    """Take over the downstream connection, then send it the upstream's 101."""
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("downstream connection lost")
    headers = CIMultiDict((k, v) for k, v in answer.headers.items()
                          if k.lower() not in _NOT_RELAYED_ON_SWITCH)
    response = _TunnelResponse(status=101, reason=answer.reason or None, headers=headers)
    response.force_close()
    downstream = _DownstreamBytes(transport)
    request.protocol.set_parser(downstream)  # type: ignore[arg-type]
    request.protocol.keep_alive(False)
    await response.prepare(request)
    return response, downstream


# --------------------------------------------------------------------------- the tunnel


@dataclass
class _Copied:
    """What one direction of the tunnel did: bytes copied, and whether it saw EOF."""

    size: int = 0
    clean: bool = False


async def _run_tunnel(request: web.Request, response: _TunnelResponse,
                      downstream: _DownstreamBytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter, upstream: Upstream) -> None:
    """Copy both ways until either direction ends; then close both connections."""

    async def to_upstream(chunk: bytes) -> None:
        writer.write(chunk)
        await writer.drain()

    to_down, to_up = _Copied(), _Copied()
    pumps = (asyncio.create_task(_pump(lambda: reader.read(CHUNK), response.write, to_down)),
             asyncio.create_task(_pump(downstream.read, to_upstream, to_up)))
    log.log(V(4), "tunnel open", extra=kv(upstream=upstream.name))
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        if request.transport is not None:
            request.transport.close()  # flushes what was written, then closes
        await _close_upstream(writer)
        log.log(V(4), "tunnel closed", extra=kv(upstream=upstream.name, bytes_down=to_down.size,
                                                bytes_up=to_up.size,
                                                eof=to_down.clean or to_up.clean))


async def _pump(read: Callable[[], Awaitable[bytes]], write: Callable[[bytes], Awaitable[None]],
                copied: _Copied) -> None:
    """Copy chunks until EOF (``clean``) or until either side fails."""
    try:
        while chunk := await read():
            await write(chunk)
            copied.size += len(chunk)
        copied.clean = True
    except (OSError, RuntimeError) as exc:  # resets, TLS errors, writes after close
        log.log(V(5), "tunnel direction ended", extra=kv(error=type(exc).__name__))
