"""A hand-driven HTTP/2 client over TLS on loopback, for tests that send what no
client library would: malformed heads, frames out of order, floods.

``RawH2`` writes frames itself (``hyperframe``, heads encoded with ``hpack``) and
reads every frame the server sends into per-stream ``Answer``s, so a test can assert
the exact outcome: the status and body of a stream, its ``RST_STREAM`` code, the
connection's ``GOAWAY`` code, and when the server closed the connection. Nothing is
validated on the way out (httpx and the ``h2`` state machine would refuse the
malformed heads and the streams past the server's limit these tests are about).
Every wait is bounded by ``WAIT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

WAIT = 20.0
"""Upper bound of every wait for the server."""
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
INITIAL_WINDOW_SIZE = SettingsFrame.INITIAL_WINDOW_SIZE
Fields = Iterable[tuple[bytes | str, bytes | str]]


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass
class Answer:
    """What the server sent on one stream."""

    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    ended: bool = False
    """The server ended the stream (END_STREAM)."""
    reset: int | None = None
    """The ``RST_STREAM`` code the server sent, if it did."""

    def header(self, name: bytes) -> list[bytes]:
        return [v for n, v in self.headers if n == name]


class RawH2:
    """One HTTP/2 connection to the daemon, driven frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 24
        self.answers: dict[int, Answer] = {}
        self.frames: list[Frame] = []
        """Every frame the server sent, in order."""
        self.goaway: GoAwayFrame | None = None
        self.closed = False
        """The server closed the connection (or it broke)."""
        self.server_settings: dict[int, int] = {}
        self.credit = True
        """Give back every DATA byte as it arrives (both windows); streams in ``held``
        are never credited (their window stays spent)."""
        self.held: set[int] = set()
        self.answer_pings = True
        self._next = 1
        self._block: tuple[int, bytearray] | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    @classmethod
    async def open(cls, port: int, ctx: ssl.SSLContext, *,
                   settings: dict[int, int] | None = None, read: bool = True) -> RawH2:
        """Connect, check ALPN chose ``h2``, send the preface and ``settings``; with
        ``read`` the server's frames are read (and SETTINGS and PING acknowledged)
        as they come, else nothing is read until ``start_reading``."""
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
        conn = cls(reader, writer)
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
        preface = SettingsFrame(0)
        preface.settings = dict(settings or {})
        writer.write(PREFACE + preface.serialize())
        if read:
            conn.start_reading()
        return conn

    def start_reading(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._read())

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def __aenter__(self) -> RawH2:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------- sending

    def stream_id(self) -> int:
        """The next client stream id (odd, increasing)."""
        sid, self._next = self._next, self._next + 2
        return sid

    def send(self, *frames: Frame | bytes) -> None:
        """Write frames (or raw bytes) as they are; a closed connection takes nothing."""
        if self.writer.is_closing():
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            self.writer.write(b"".join(f if isinstance(f, bytes) else f.serialize()
                                       for f in frames))

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError, RuntimeError):
            await asyncio.wait_for(self.writer.drain(), WAIT)

    def block(self, fields: Fields) -> bytes:
        """``fields`` HPACK-encoded with this connection's encoder, names and values
        exactly as given (no lowercasing, no checks)."""
        return self.encoder.encode([(_bytes(n), _bytes(v)) for n, v in fields])

    def headers(self, stream_id: int, fields: Fields, *, end_stream: bool = False,
                end_headers: bool = True) -> None:
        frame = HeadersFrame(stream_id, self.block(fields))
        frame.flags = {f for f, on in (("END_STREAM", end_stream),
                                        ("END_HEADERS", end_headers)) if on}
        self.send(frame)

    def request(self, path: str | bytes, *, method: str | bytes = "GET",
                fields: Fields = (), end_stream: bool = True,
                authority: str | bytes = "127.0.0.1") -> int:
        """Open a stream with a request head; returns its id."""
        sid = self.stream_id()
        self.answers.setdefault(sid, Answer())
        self.headers(sid, [(":method", method), (":scheme", "https"), (":path", path),
                           (":authority", authority), *fields], end_stream=end_stream)
        return sid

    def data(self, stream_id: int, payload: bytes, *, end_stream: bool = False) -> None:
        frame = DataFrame(stream_id, payload)
        if end_stream:
            frame.flags.add("END_STREAM")
        self.send(frame)

    def reset(self, stream_id: int, code: int = CANCEL) -> None:
        self.send(RstStreamFrame(stream_id, error_code=code))

    def window_update(self, stream_id: int, increment: int) -> None:
        self.send(WindowUpdateFrame(stream_id, window_increment=increment))

    # ---------------------------------------------------------------- reading

    async def _read(self) -> None:
        buffer = bytearray()
        try:
            while True:
                chunk = await self.reader.read(65536)
                if not chunk:
                    break
                buffer += chunk
                while len(buffer) >= 9:
                    frame, length = Frame.parse_frame_header(memoryview(buffer[:9]))
                    if len(buffer) < 9 + length:
                        break
                    frame.parse_body(memoryview(buffer[9:9 + length]))
                    del buffer[:9 + length]
                    self._received(frame)
                self._changed.set()
        except (ConnectionError, ssl.SSLError, OSError):
            pass
        finally:
            self.closed = True
            self._changed.set()

    def _received(self, frame: Frame) -> None:
        self.frames.append(frame)
        sid = frame.stream_id
        if isinstance(frame, SettingsFrame):
            if "ACK" not in frame.flags:
                self.server_settings.update(frame.settings)
                ack = SettingsFrame(0)
                ack.flags.add("ACK")
                self.send(ack)
        elif isinstance(frame, PingFrame):
            if "ACK" not in frame.flags and self.answer_pings:
                pong = PingFrame(0, frame.opaque_data)
                pong.flags.add("ACK")
                self.send(pong)
        elif isinstance(frame, GoAwayFrame):
            self.goaway = frame
        elif isinstance(frame, RstStreamFrame):
            self.answers.setdefault(sid, Answer()).reset = frame.error_code
        elif isinstance(frame, (HeadersFrame, ContinuationFrame)):
            if isinstance(frame, HeadersFrame):
                self._block = (sid, bytearray())
            assert self._block is not None and self._block[0] == sid, frame
            self._block[1].extend(frame.data)
            if "END_HEADERS" in frame.flags:
                self._head(sid, self.decoder.decode(bytes(self._block[1]), raw=True))
                self._block = None
            if "END_STREAM" in frame.flags:
                self.answers.setdefault(sid, Answer()).ended = True
        elif isinstance(frame, DataFrame):
            answer = self.answers.setdefault(sid, Answer())
            answer.body += frame.data
            size = frame.flow_controlled_length
            if self.credit and size:
                self.window_update(0, size)
                if sid not in self.held and "END_STREAM" not in frame.flags:
                    self.window_update(sid, size)
            if "END_STREAM" in frame.flags:
                answer.ended = True

    def _head(self, sid: int, fields: list[tuple[bytes, bytes]]) -> None:
        answer = self.answers.setdefault(sid, Answer())
        status = dict(fields).get(b":status")
        if status is not None and int(status) < 200:
            return  # an interim answer
        if answer.status is None and status is not None:
            answer.status = int(status)
            answer.headers = [(n, v) for n, v in fields if not n.startswith(b":")]

    async def until(self, predicate: Callable[[], bool], what: str,
                    timeout: float = WAIT) -> None:
        """Wait (bounded) until ``predicate()`` holds; fail with ``what`` if it does not."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    self._changed.clear()
                    if self.closed and not predicate():
                        raise AssertionError(f"the connection closed before {what}")
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"gave up waiting for {what}") from None

    async def response(self, stream_id: int) -> Answer:
        """The stream's answer once the server ended or reset it."""
        answer = self.answers.setdefault(stream_id, Answer())
        await self.until(lambda: answer.ended or answer.reset is not None,
                         f"stream {stream_id} to end")
        return answer

    async def closed_with(self) -> int | None:
        """Wait until the server closes the connection; its GOAWAY code (None if it
        sent none)."""
        await self.until(lambda: self.closed, "the server to close the connection")
        return None if self.goaway is None else self.goaway.error_code

    async def goaway_code(self) -> int:
        await self.until(lambda: self.goaway is not None, "a GOAWAY")
        assert self.goaway is not None
        return self.goaway.error_code


async def get(port: int, ctx: ssl.SSLContext, path: str) -> Answer:
    """One GET on a new HTTP/2 connection."""
    async with await RawH2.open(port, ctx) as conn:
        return await conn.response(conn.request(path))
