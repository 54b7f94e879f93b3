"""``pods/portforward`` for the simulated API server: SPDY, SPDY-in-WebSocket, WebSocket.

There are no pods, so every forwarded port of every pod has the same small HTTP server
behind it (``http_answer``): one request per connection, answered with a page naming
the pod and port, then the connection ends (``Connection: close``). Three carriers:

* SPDY/3.1 (``X-Stream-Protocol-Version: portforward.k8s.io``, kubectl < 1.31 and the
  fallback of newer ones): per local connection the client opens an ``error`` stream
  then a ``data`` stream, both with ``port`` and ``requestID`` headers;
* client-go ≥ 1.30's tunnel: the same SPDY frames inside WebSocket binary messages
  (subprotocol ``SPDY/3.1+portforward.k8s.io``);
* the channel protocol (``v4.channel.k8s.io`` / ``portforward.k8s.io`` subprotocols,
  the Python client): ports from the ``ports`` query; port i has data channel 2i and
  error channel 2i+1, each opened by the server with the port (2 bytes, little endian).
"""

from __future__ import annotations

import asyncio
import html
from collections.abc import Mapping
from typing import Any

from aiohttp import WSMsgType, web

from .apistatus import status_response
from .simexec import is_spdy, spdy_protocol
from .spdysession import Session, Stream, serve_upgrade

__all__ = ["handle_portforward", "http_answer"]

SPDY_PROTOCOL = "portforward.k8s.io"
TUNNEL_PROTOCOL = "SPDY/3.1+portforward.k8s.io"
CHANNEL_PROTOCOLS = ("v4.channel.k8s.io", "portforward.k8s.io")
MAX_REQUEST_HEAD = 16 << 10   # bytes of an HTTP request head the pod reads
MAX_PORTS = 16                # ports in one channel-protocol request
MAX_QUEUED = 256              # frames waiting for a slow tunnel client
IDLE_TIMEOUT = 60.0           # seconds a session or a connection may sit idle


def http_answer(head: bytes, pod: Mapping[str, Any], port: int) -> bytes:
    """The pretend pod's whole HTTP response to the request head ``head``."""
    meta = pod.get("metadata") or {}
    line = head.split(b"\r\n", 1)[0].split(b" ")
    if len(line) != 3 or not line[2].startswith(b"HTTP/1."):
        status, body = "400 Bad Request", "bad request\n"
    elif len(head) > MAX_REQUEST_HEAD:
        status, body = "431 Request Header Fields Too Large", "request head too large\n"
    else:
        name = html.escape(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
        status, body = "200 OK", (
            f"<!doctype html><title>{name}</title>\n<p>Hello from pod {name}, "
            f"port {port} (mvproxy simulated cluster).</p>\n")
    payload = b"" if line[0] == b"HEAD" else body.encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: text/html; charset=utf-8\r\n"
            f"Content-Length: {len(body.encode())}\r\nConnection: close\r\n\r\n"
            ).encode() + payload


class _Head:
    """Collects one request head from a byte stream, bounded by MAX_REQUEST_HEAD."""

    def __init__(self) -> None:
        self.data = bytearray()

    def add(self, chunk: bytes) -> bool:
        """True once the head is complete (or too long to wait for)."""
        self.data += chunk
        return b"\r\n\r\n" in self.data or len(self.data) > MAX_REQUEST_HEAD


def _port(value: str) -> int | None:
    return int(value) if value.isdigit() and 0 < int(value) < 65536 else None


async def handle_portforward(request: web.Request, pod: Mapping[str, Any]) -> web.StreamResponse:
    """Serve one ``pods/portforward`` upgrade for ``pod``."""
    if is_spdy(request):
        if spdy_protocol(request, (SPDY_PROTOCOL,)) is None:
            return status_response(400, "unable to upgrade: no supported stream protocol "
                                        f"(supports {SPDY_PROTOCOL})")
        return await serve_upgrade(request, SPDY_PROTOCOL, lambda s: _spdy(s, pod))
    if request.headers.get("Upgrade", "").lower() != "websocket":
        return status_response(400, "Upgrade request required")
    ws = web.WebSocketResponse(protocols=(TUNNEL_PROTOCOL, *CHANNEL_PROTOCOLS))
    if ws.can_prepare(request).protocol is None:
        return status_response(400, "requested protocol(s) are not supported; supports "
                                    f"{[TUNNEL_PROTOCOL, *CHANNEL_PROTOCOLS]}")
    ports = [_port(p) for p in request.query.getall("ports", ())]
    if ws.can_prepare(request).protocol != TUNNEL_PROTOCOL and (
            not ports or None in ports or len(ports) > MAX_PORTS):
        return status_response(400, f"ports: 1 to {MAX_PORTS} ports, each 1-65535")
    await ws.prepare(request)
    if ws.ws_protocol == TUNNEL_PROTOCOL:
        await _tunnel(ws, pod)
    else:
        await _channels(ws, pod, [p for p in ports if p is not None])
    await ws.close()
    return ws


# --- SPDY --------------------------------------------------------------------------


async def _spdy(session: Session, pod: Mapping[str, Any]) -> None:
    """Each data stream gets one HTTP answer; its error stream ends with it."""
    tasks: set[asyncio.Task[None]] = set()
    try:
        while (stream := await session.next_stream(IDLE_TIMEOUT)) is not None:
            if stream.type == "data":
                task = asyncio.create_task(_answer(session, stream, pod))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif stream.type != "error":
                session.write(stream, b"unknown streamType\n", fin=True)
    except TimeoutError:
        pass
    finally:
        for task in tasks:
            task.cancel()


def _error_stream(session: Session, data: Stream) -> Stream | None:
    request_id = data.headers.get("requestid")
    return next((s for s in session.streams.values() if s.type == "error"
                 and s.headers.get("requestid") == request_id), None)


async def _answer(session: Session, stream: Stream, pod: Mapping[str, Any]) -> None:
    error = _error_stream(session, stream)
    port = _port(stream.headers.get("port", ""))
    if port is None:
        if error is not None:
            session.write(error, b"invalid port header\n")
    else:
        head = _Head()
        try:
            while not head.add(chunk := await stream.read(IDLE_TIMEOUT)) and chunk:
                pass
        except TimeoutError:
            pass
        if head.data:
            session.write(stream, http_answer(bytes(head.data), pod, port))
    session.write(stream, fin=True)
    if error is not None:
        session.write(error, fin=True)


async def _tunnel(ws: web.WebSocketResponse, pod: Mapping[str, Any]) -> None:
    """SPDY carried in binary messages (client-go's tunnelling port-forward)."""
    out: asyncio.Queue[bytes] = asyncio.Queue()

    def send(data: bytes) -> None:  # in order, through one writer; a client that stops
        if out.qsize() >= MAX_QUEUED:  # reading loses the connection, not our memory
            session.close()
        else:
            out.put_nowait(data)

    async def writer() -> None:
        while True:
            await ws.send_bytes(await out.get())

    session = Session(send)
    runner = asyncio.create_task(_spdy(session, pod))
    pump = asyncio.create_task(writer())
    try:
        async for msg in ws:
            if msg.type is not WSMsgType.BINARY:
                break
            session.receive(msg.data)
            if session.closed.is_set():
                break
    finally:
        session.close()
        runner.cancel()
        while not out.empty() and not ws.closed:  # what the session already wrote
            await ws.send_bytes(out.get_nowait())
        pump.cancel()


# --- channel protocol ----------------------------------------------------------------


async def _channels(ws: web.WebSocketResponse, pod: Mapping[str, Any], ports: list[int]) -> None:
    """One connection per port: announce the channels, answer each port's first request."""
    for i, port in enumerate(ports):
        number = port.to_bytes(2, "little")
        await ws.send_bytes(bytes((2 * i,)) + number)
        await ws.send_bytes(bytes((2 * i + 1,)) + number)
    heads = [_Head() for _ in ports]
    answered: set[int] = set()
    while True:  # until the client closes (kubelet keeps the socket as long), or idles
        try:
            msg = await ws.receive(timeout=IDLE_TIMEOUT)
        except TimeoutError:
            return
        if msg.type is not WSMsgType.BINARY:
            return
        data = msg.data
        if not data or data[0] % 2 or data[0] // 2 >= len(ports):
            continue  # error channels and unknown channels carry nothing for the pod
        i = data[0] // 2
        if i not in answered and heads[i].add(data[1:]):
            answered.add(i)  # one request per connection; later bytes are dropped
            await ws.send_bytes(bytes((2 * i,)) + http_answer(bytes(heads[i].data), pod,
                                                              ports[i]))
