"""A small Kubernetes API client for mvproxy's own requests to its backend (Leases).

mvproxy reaches its backend as a front proxy (the ``backend.certFile`` client
certificate) and names itself in ``X-Remote-User: system:mvproxy:<serverID>`` with
group ``system:mvproxies``: the backend authorizes that user through RBAC (docs/membership.md,
"RBAC"). Every answer is size-bounded, since a Lease list is written by whoever
may write Leases: a list body over ``max_bytes`` or a watch line over ``max_line``
is an error, never an unbounded buffer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import weakref
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import aiohttp

from mvproxy.tls import SwappableContext, current_context

USER_PREFIX = "system:mvproxy:"
GROUP = "system:mvproxies"


class KubeError(Exception):
    """A request failed; ``status`` is the HTTP status (0: no answer), ``reason`` a
    short metric label."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status = status
        self.reason = reason


class KubeClient:
    def __init__(self, base_url: str, ssl_context: ssl.SSLContext | SwappableContext,
                 server_id: str, *,
                 timeout: float, max_bytes: int = 8 << 20, max_line: int = 1 << 20):
        self.base_url = base_url.rstrip("/")
        self._ssl = ssl_context
        self._headers = {"X-Remote-User": USER_PREFIX + server_id, "X-Remote-Group": GROUP,
                         "Accept": "application/json", "User-Agent": "mvproxy"}
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.max_line = max_line
        self._session: aiohttp.ClientSession | None = None
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()

    def _socket(self, addr_info: Any) -> socket.socket:
        """Sockets are remembered so ``close`` can wait until each is really closed."""
        family, kind, proto, _, _ = addr_info
        sock = socket.socket(family, kind, proto)
        self._sockets.add(sock)
        return sock

    def _context(self) -> ssl.SSLContext:
        """The context in use now: a rotated backend certificate takes effect on the
        next connection (aiohttp keys its pool by context)."""
        return current_context(self._ssl)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=4, socket_factory=self._socket),
                headers=self._headers, auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
        # A connection cancelled mid-handshake is closed by asyncio a few loop turns
        # later; wait for that (bounded), so no socket outlives the client.
        for _ in range(100):
            if all(sock.fileno() == -1 for sock in list(self._sockets)):
                return
            await asyncio.sleep(0.01)

    async def request(self, method: str, path: str, *, body: Any = None,
                      params: Mapping[str, str] | None = None) -> tuple[int, Any]:
        """(status, decoded JSON or None); raises KubeError when there is no answer."""
        try:
            async with self._open().request(
                    method, self.base_url + path, params=params, ssl=self._context(),
                    data=None if body is None else json.dumps(body),
                    headers={"Content-Type": "application/json"} if body is not None else None,
                    timeout=aiohttp.ClientTimeout(total=self.timeout)) as response:
                data = await _read_bounded(response, self.max_bytes)
                return response.status, _decode(data)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeError(0, "unreachable", f"{method} {path}: {type(exc).__name__}") from None

    async def watch(self, path: str, params: Mapping[str, str],
                    idle_timeout: float) -> AsyncGenerator[dict[str, Any], None]:
        """The events of one watch request, until the server ends it or says nothing
        for ``idle_timeout`` (a silently dead connection ends like a finished watch)."""
        session = self._open()
        try:
            response = await session.get(
                self.base_url + path, params={**params, "watch": "true"}, ssl=self._context(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout,
                                              sock_read=idle_timeout))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise KubeError(0, "unreachable", f"watch {path}: {type(exc).__name__}") from None
        async with response:
            if response.status != 200:
                data = await _read_bounded(response, self.max_bytes)
                raise KubeError(response.status, f"http_{response.status}",
                                f"watch {path}: HTTP {response.status} {_message(_decode(data))}")
            buffer = b""
            try:
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    if len(buffer) > self.max_line:
                        raise KubeError(200, "too_large", f"watch {path}: an event exceeds "
                                                          f"{self.max_line} bytes")
                    for line in lines:
                        if line.strip():
                            event = _decode(line)
                            if not isinstance(event, dict):
                                raise KubeError(200, "malformed", f"watch {path}: not an event")
                            yield event
            except TimeoutError:
                return  # idle past idle_timeout: the caller watches again
            except (aiohttp.ClientError, OSError) as exc:
                raise KubeError(0, "unreachable", f"watch {path}: {type(exc).__name__}") from None


async def _read_bounded(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    if (response.content_length or 0) > max_bytes:
        raise KubeError(response.status, "too_large", f"answer over {max_bytes} bytes")
    data = bytearray()
    async for chunk in response.content.iter_any():
        data += chunk
        if len(data) > max_bytes:
            raise KubeError(response.status, "too_large", f"answer over {max_bytes} bytes")
    return bytes(data)


def _decode(data: bytes) -> Any:
    if not data:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise KubeError(0, "malformed", "answer is not JSON") from None


def _message(status: object) -> str:
    """kube's Status message, bounded (it names the resource, never a body we sent)."""
    if isinstance(status, dict) and isinstance(status.get("message"), str):
        return status["message"][:200]
    return ""
