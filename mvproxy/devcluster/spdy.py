"""SPDY/3.1 framing: the multiplexing layer under kubectl's SPDY exec and port-forward.

client-go streams exec, attach and port-forward as SPDY/3.1 after an HTTP upgrade
(and, since 1.30, port-forward as SPDY tunnelled in WebSocket binary messages). A
connection carries frames of 8-byte headers: a control frame (SYN_STREAM opens a
stream, SYN_REPLY accepts it, RST_STREAM, SETTINGS, PING, GOAWAY, HEADERS,
WINDOW_UPDATE) or a DATA frame for one stream; FIN half-closes a stream. Header
blocks are deflated with one zlib stream per direction, primed with the fixed
dictionary of the SPDY/3 draft (below, as the draft defines it: words each prefixed
by a 32-bit length, then a tail without lengths).

Everything the peer sends is untrusted: a frame longer than ``MAX_FRAME``, a header
block that inflates past ``MAX_HEADER_BLOCK``, a bad length or version, or corrupt
zlib data raises ``SpdyError`` (the caller ends the connection); nothing is buffered
beyond one frame in progress.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

__all__ = ["DATA", "DICTIONARY", "FIN", "GOAWAY", "HEADERS", "MAX_FRAME", "PING",
           "RST_STREAM", "SETTINGS", "SYN_REPLY", "SYN_STREAM", "WINDOW_UPDATE",
           "Frame", "Framer", "SpdyError"]

VERSION = 3
DATA, SYN_STREAM, SYN_REPLY, RST_STREAM, SETTINGS = 0, 1, 2, 3, 4
PING, GOAWAY, HEADERS, WINDOW_UPDATE = 6, 7, 8, 9
FIN = 0x01
#: RST_STREAM / GOAWAY status codes this module sends.
PROTOCOL_ERROR, REFUSED_STREAM = 1, 3

MAX_FRAME = 1 << 20          # bytes of one frame's payload (client-go sends ≤ 32 KiB)
MAX_HEADER_BLOCK = 64 << 10  # bytes of one inflated header block
MAX_HEADERS = 64             # name/value pairs in one header block

_WORDS = (
    "options head post put delete trace accept accept-charset accept-encoding "
    "accept-language accept-ranges age allow authorization cache-control connection "
    "content-base content-encoding content-language content-length content-location "
    "content-md5 content-range content-type date etag expect expires from host "
    "if-match if-modified-since if-none-match if-range if-unmodified-since "
    "last-modified location max-forwards pragma proxy-authenticate proxy-authorization "
    "range referer retry-after server te trailer transfer-encoding upgrade user-agent "
    "vary via warning www-authenticate method get status"
).split() + ["200 OK"] + "version HTTP/1.1 url public set-cookie keep-alive origin".split()
_TAIL = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417"
    "502504505203 Non-Authoritative Information204 No Content301 Moved Permanently"
    "400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error"
    "501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct "
    "Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,"
    "image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,"
    "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8"
    "charset=iso-8859-1,utf-,*,enq=0."
)
#: The SPDY/3 header compression dictionary (1423 bytes).
DICTIONARY = b"".join(struct.pack(">I", len(w)) + w.encode() for w in _WORDS) + _TAIL.encode()


class SpdyError(Exception):
    """The peer broke the protocol; the connection cannot go on."""


@dataclass(frozen=True)
class Frame:
    """One frame. ``value``: RST_STREAM/GOAWAY status, PING id or WINDOW_UPDATE delta."""

    type: int
    stream_id: int = 0
    flags: int = 0
    headers: tuple[tuple[str, str], ...] = ()
    data: bytes = b""
    value: int = 0

    @property
    def fin(self) -> bool:
        return bool(self.flags & FIN) and self.type in (DATA, SYN_STREAM, SYN_REPLY, HEADERS)

    def header(self, name: str) -> str:
        return next((v for n, v in self.headers if n == name), "")


def encode_headers(headers: tuple[tuple[str, str], ...]) -> bytes:
    out = [struct.pack(">I", len(headers))]
    for name, value in headers:
        n, v = name.lower().encode(), value.encode()
        out += [struct.pack(">I", len(n)), n, struct.pack(">I", len(v)), v]
    return b"".join(out)


def decode_headers(block: bytes) -> tuple[tuple[str, str], ...]:
    """Name/value pairs of an inflated header block; SpdyError if malformed."""
    def take(at: int) -> tuple[bytes, int]:
        if at + 4 > len(block):
            raise SpdyError("truncated header block")
        (size,) = struct.unpack_from(">I", block, at)
        if at + 4 + size > len(block):
            raise SpdyError("header length past the end of the block")
        return block[at + 4:at + 4 + size], at + 4 + size

    if len(block) < 4:
        raise SpdyError("truncated header block")
    (count,) = struct.unpack_from(">I", block, 0)
    if count > MAX_HEADERS:
        raise SpdyError(f"more than {MAX_HEADERS} headers")
    at, pairs, seen = 4, [], set()
    for _ in range(count):
        name, at = take(at)
        value, at = take(at)
        try:
            n, v = name.decode("ascii"), value.decode("utf-8")
        except UnicodeDecodeError:
            raise SpdyError("header is not text") from None
        if not n or n != n.lower() or n in seen:
            raise SpdyError("empty, upper-case or repeated header name")
        seen.add(n)
        pairs.append((n, v))
    if at != len(block):
        raise SpdyError("bytes after the last header")
    return tuple(pairs)


class Framer:
    """Both directions of one connection: ``feed`` parses, ``encode`` builds frames."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._inflate = zlib.decompressobj(zdict=DICTIONARY)
        self._deflate = zlib.compressobj(zdict=DICTIONARY)
        self.broken = False

    # --- writing ------------------------------------------------------------------

    def _block(self, headers: tuple[tuple[str, str], ...]) -> bytes:
        return self._deflate.compress(encode_headers(headers)) + \
            self._deflate.flush(zlib.Z_SYNC_FLUSH)

    def encode(self, frame: Frame) -> bytes:
        t, sid = frame.type, frame.stream_id & 0x7FFFFFFF
        if t == DATA:
            payload = frame.data
            head = struct.pack(">I", sid)
        else:
            if t == SYN_STREAM:
                payload = struct.pack(">IIBB", sid, 0, 0, 0) + self._block(frame.headers)
            elif t in (SYN_REPLY, HEADERS):
                payload = struct.pack(">I", sid) + self._block(frame.headers)
            elif t in (RST_STREAM, WINDOW_UPDATE, GOAWAY):
                payload = struct.pack(">II", sid, frame.value)
            elif t == PING:
                payload = struct.pack(">I", frame.value)
            elif t == SETTINGS:
                payload = struct.pack(">I", 0)
            else:
                payload = frame.data
            head = struct.pack(">HH", 0x8000 | VERSION, t)
        if len(payload) > 0xFFFFFF:
            raise ValueError("frame payload too large")
        return head + struct.pack(">I", (frame.flags & 0xFF) << 24 | len(payload)) + payload

    # --- reading ------------------------------------------------------------------

    def feed(self, data: bytes) -> list[Frame]:
        """Every frame completed by ``data``; SpdyError (then always) on bad input."""
        if self.broken:
            raise SpdyError("connection already failed")
        self._buffer += data
        frames = []
        try:
            while len(self._buffer) >= 8:
                word, flags_length = struct.unpack_from(">II", self._buffer, 0)
                length = flags_length & 0xFFFFFF
                if length > MAX_FRAME:
                    raise SpdyError(f"frame of {length} bytes (limit {MAX_FRAME})")
                if len(self._buffer) < 8 + length:
                    break
                payload = bytes(self._buffer[8:8 + length])
                del self._buffer[:8 + length]
                frame = self._parse(word, flags_length >> 24, payload)
                if frame is not None:
                    frames.append(frame)
        except SpdyError:
            self.broken = True
            self._buffer.clear()
            raise
        return frames

    def _inflated(self, compressed: bytes) -> tuple[tuple[str, str], ...]:
        try:
            block = self._inflate.decompress(compressed, MAX_HEADER_BLOCK + 1)
        except zlib.error as exc:
            raise SpdyError(f"bad header compression: {exc}") from None
        if len(block) > MAX_HEADER_BLOCK or self._inflate.unconsumed_tail:
            raise SpdyError(f"header block over {MAX_HEADER_BLOCK} bytes")
        return decode_headers(block)

    def _parse(self, word: int, flags: int, payload: bytes) -> Frame | None:
        if not word & 0x80000000:
            sid = word & 0x7FFFFFFF
            if sid == 0:
                raise SpdyError("DATA frame on stream 0")
            return Frame(DATA, sid, flags, data=payload)
        version, t = (word >> 16) & 0x7FFF, word & 0xFFFF
        if version != VERSION:
            raise SpdyError(f"SPDY version {version} (only {VERSION})")
        fixed = {SYN_STREAM: 10, SYN_REPLY: 4, HEADERS: 4, RST_STREAM: 8, GOAWAY: 8,
                 WINDOW_UPDATE: 8, PING: 4, SETTINGS: 4}.get(t)
        if fixed is None:
            return None  # unknown control frames are ignored (SPDY/3 §2.2.1)
        if len(payload) < fixed:
            raise SpdyError(f"control frame {t} too short")
        (first,) = struct.unpack_from(">I", payload, 0)
        if t in (SYN_STREAM, SYN_REPLY, HEADERS):
            sid = first & 0x7FFFFFFF
            if sid == 0:
                raise SpdyError("stream id 0")
            return Frame(t, sid, flags, headers=self._inflated(payload[fixed:]))
        if t == SETTINGS:
            if len(payload) != 4 + 8 * first:
                raise SpdyError("SETTINGS length does not match its count")
            return Frame(t, flags=flags)
        if len(payload) != fixed:
            raise SpdyError(f"control frame {t} has the wrong length")
        if t == PING:
            return Frame(t, flags=flags, value=first)
        (second,) = struct.unpack_from(">I", payload, 4)
        return Frame(t, first & 0x7FFFFFFF, flags, value=second & 0x7FFFFFFF
                     if t == WINDOW_UPDATE else second)
