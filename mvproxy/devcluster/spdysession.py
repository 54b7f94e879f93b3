"""One SPDY/3.1 connection of the simulated API server: streams in, frames out.

The session accepts every stream the client opens (SYN_REPLY, as kubelet does), keeps
what arrives on each until its handler reads it, answers PINGs and ends on GOAWAY,
EOF or a protocol error. It is fed bytes by whichever carrier holds the connection:
a raw upgraded socket (``serve_upgrade``: exec/attach/port-forward after ``Upgrade:
SPDY/3.1``) or WebSocket binary messages (client-go's port-forward tunnel).

Bounds against a hostile client: at most ``MAX_STREAMS`` open streams (more are
refused), at most ``MAX_STREAM_BUFFER`` unread bytes per stream (more resets it), and
the connection is dropped when the client stops reading what the server writes
(``MAX_WRITE_BUFFER``), so PING floods cannot grow memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from . import spdy
from .spdy import Frame

__all__ = ["Session", "Stream", "serve_upgrade"]

log = logging.getLogger(__name__)

MAX_STREAMS = 64
MAX_STREAM_BUFFER = 256 << 10
MAX_WRITE_BUFFER = 4 << 20


class Stream:
    """One client-opened stream: its headers and the bytes not yet read."""

    def __init__(self, frame: Frame) -> None:
        self.id = frame.stream_id
        self.headers = dict(frame.headers)
        self.type = self.headers.get("streamtype", "")
        self._buffer = bytearray()
        self.remote_closed = frame.fin
        self.local_closed = False
        self._changed = asyncio.Event()

    def _arrived(self, data: bytes, fin: bool) -> bool:
        """Keep ``data``; False if the reader is too far behind (the stream is reset)."""
        if len(self._buffer) + len(data) > MAX_STREAM_BUFFER:
            return False
        self._buffer += data
        self.remote_closed = self.remote_closed or fin
        self._changed.set()
        return True

    def _ended(self) -> None:
        self.remote_closed = self.local_closed = True
        self._changed.set()

    async def read(self, timeout: float) -> bytes:
        """What arrived (b"" at the client's FIN or reset); TimeoutError if nothing came."""
        while not self._buffer and not self.remote_closed:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), timeout)
        data = bytes(self._buffer)
        self._buffer.clear()
        return data


class Session:
    """The server side of one SPDY connection; ``send`` writes bytes to the client."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._framer = spdy.Framer()
        self.streams: dict[int, Stream] = {}
        self.opened: asyncio.Queue[Stream] = asyncio.Queue()
        self.closed = asyncio.Event()
        self._changed = asyncio.Event()

    # --- input ----------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        if self.closed.is_set():
            return
        try:
            frames = self._framer.feed(data)
        except spdy.SpdyError as exc:
            log.info("SPDY client broke the protocol: %s", exc)
            self._write(Frame(spdy.GOAWAY, 0, value=spdy.PROTOCOL_ERROR))
            self.close()
            return
        for frame in frames:
            self._handle(frame)

    def eof(self) -> None:
        self.close()

    def _handle(self, frame: Frame) -> None:
        t, sid = frame.type, frame.stream_id
        stream: Stream | None
        if t == spdy.SYN_STREAM:
            if sid in self.streams or sid % 2 == 0 or len(self.streams) >= MAX_STREAMS:
                self._write(Frame(spdy.RST_STREAM, sid, value=spdy.REFUSED_STREAM))
                return
            stream = Stream(frame)
            self.streams[sid] = stream
            self._write(Frame(spdy.SYN_REPLY, sid))
            self.opened.put_nowait(stream)
        elif t == spdy.DATA:
            stream = self.streams.get(sid)
            if stream is None or stream.remote_closed:
                return  # late data for a stream already finished or reset: dropped
            if not stream._arrived(frame.data, frame.fin):
                self._write(Frame(spdy.RST_STREAM, sid, value=spdy.PROTOCOL_ERROR))
                self._forget(stream)
            elif stream.local_closed and stream.remote_closed:
                self._forget(stream)
        elif t == spdy.RST_STREAM:
            if (stream := self.streams.get(sid)) is not None:
                self._forget(stream)
        elif t == spdy.PING:
            if frame.value % 2 == 1:  # the client's ping: echoed; never our own
                self._write(frame)
        elif t == spdy.GOAWAY:
            self.close()
        self._changed.set()

    def _forget(self, stream: Stream) -> None:
        stream._ended()
        self.streams.pop(stream.id, None)

    # --- output ---------------------------------------------------------------------

    def _write(self, frame: Frame) -> None:
        if not self.closed.is_set():
            self._send(self._framer.encode(frame))

    def write(self, stream: Stream, data: bytes = b"", fin: bool = False) -> None:
        """Send ``data`` on ``stream`` (in frames of at most 32 KiB), FIN if asked."""
        if stream.local_closed:
            return
        for at in range(0, len(data), 32 << 10):
            self._write(Frame(spdy.DATA, stream.id, data=data[at:at + (32 << 10)]))
        if fin:
            self._write(Frame(spdy.DATA, stream.id, spdy.FIN))
            stream.local_closed = True
            if stream.remote_closed:
                self.streams.pop(stream.id, None)

    def close(self) -> None:
        self.closed.set()
        for stream in list(self.streams.values()):
            stream._ended()
        self.streams.clear()

    async def next_stream(self, timeout: float) -> Stream | None:
        """The next stream the client opens; None once the connection ended."""
        get = asyncio.ensure_future(self.opened.get())
        ended = asyncio.ensure_future(self.closed.wait())
        try:
            done, _ = await asyncio.wait({get, ended}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not get.done():
                get.cancel()
        if get in done:
            return get.result()
        if not done:
            raise TimeoutError
        return None


class _Carrier(asyncio.Protocol):
    """The upgraded socket's protocol: every byte read goes to the session."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def data_received(self, data: bytes) -> None:
        self.session.receive(data)

    def eof_received(self) -> bool:
        self.session.eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.session.eof()


async def serve_upgrade(request: web.Request, protocol: str,
                        run: Callable[[Session], Awaitable[None]]) -> web.StreamResponse:
    """Answer ``101`` (SPDY/3.1, stream protocol ``protocol``), then ``run`` the session.

    aiohttp only hands WebSocket upgrades to a handler, so after the 101 the socket's
    protocol is replaced: from then on the session reads it. client-go sends nothing
    before it has read the 101, so no byte is left in aiohttp's parser.
    """
    response = web.StreamResponse(status=101, headers={
        "Connection": "Upgrade", "Upgrade": "SPDY/3.1", "X-Stream-Protocol-Version": protocol})
    response.force_close()
    await response.prepare(request)
    transport = request.transport
    assert transport is not None

    def send(data: bytes) -> None:
        if transport.is_closing():
            session.close()
        elif transport.get_write_buffer_size() > MAX_WRITE_BUFFER:
            log.info("SPDY client stopped reading; dropping the connection")
            session.close()
            transport.abort()
        else:
            transport.write(data)

    session = Session(send)
    transport.set_protocol(_Carrier(session))
    try:
        await run(session)
    finally:
        session.close()
    return response
