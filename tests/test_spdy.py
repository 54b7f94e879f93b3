"""The SPDY/3.1 framer of the simulated API server: round trips, the zlib dictionary,
and hostile input refused with SpdyError (never another exception, never unbounded
buffering)."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mvproxy.devcluster import spdy
from mvproxy.devcluster.spdy import Frame, Framer, SpdyError


def control(t: int, payload: bytes, flags: int = 0, version: int = 3) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, t, flags << 24 | len(payload)) + payload


def deflated(block: bytes) -> bytes:
    c = zlib.compressobj(zdict=spdy.DICTIONARY)
    return c.compress(block) + c.flush(zlib.Z_SYNC_FLUSH)


def _other_dictionary() -> bytes:
    c = zlib.compressobj(zdict=b"not the spdy dictionary")
    return c.compress(b"\0\0\0\0") + c.flush(zlib.Z_SYNC_FLUSH)


def syn_stream(sid: int, block: bytes) -> bytes:
    return control(spdy.SYN_STREAM, struct.pack(">IIBB", sid, 0, 0, 0) + deflated(block))


def test_dictionary_is_the_spdy3_one() -> None:
    # The draft's dictionary: 1423 bytes, first word "options", tail ends "enq=0.";
    # its Adler-32 is the dictionary id every SPDY/3 zlib stream header carries.
    d = spdy.DICTIONARY
    assert len(d) == 1423
    assert d.startswith(b"\x00\x00\x00\x07options\x00\x00\x00\x04head")
    assert d.endswith(b",utf-,*,enq=0.")
    assert zlib.adler32(d) == 0xE3C6A7C2
    frame = Framer().encode(Frame(spdy.SYN_REPLY, 1, headers=(("a", "b"),)))
    assert struct.unpack(">I", frame[14:18])[0] == 0xE3C6A7C2  # FDICT id in the stream


@pytest.mark.parametrize("frame", [
    Frame(spdy.SYN_STREAM, 1, spdy.FIN, headers=(("streamtype", "error"), ("port", "80"))),
    Frame(spdy.SYN_REPLY, 3, headers=(("x", "a\x00b"),)),
    Frame(spdy.HEADERS, 5, headers=()),
    Frame(spdy.DATA, 7, spdy.FIN, data=b"hello"),
    Frame(spdy.DATA, 9, data=b""),
    Frame(spdy.RST_STREAM, 1, value=spdy.REFUSED_STREAM),
    Frame(spdy.PING, value=7),
    Frame(spdy.GOAWAY, 11, value=1),
    Frame(spdy.WINDOW_UPDATE, 1, value=65536),
    Frame(spdy.SETTINGS),
])
def test_round_trip(frame: Frame) -> None:
    assert Framer().feed(Framer().encode(frame)) == [frame]


def test_header_compression_is_one_stream_per_direction() -> None:
    client, server = Framer(), Framer()
    frames = [Frame(spdy.SYN_STREAM, sid, headers=(("streamtype", t),))
              for sid, t in ((1, "error"), (3, "stdout"), (5, "stderr"))]
    wire = b"".join(client.encode(f) for f in frames)
    got = []
    for i in range(len(wire)):  # one byte at a time: nothing is lost between reads
        got += server.feed(wire[i:i + 1])
    assert got == frames
    second = wire[len(Framer().encode(frames[0])):]
    with pytest.raises(SpdyError):  # the second block continues the first one's zlib stream
        Framer().feed(second)


def test_unknown_control_frames_are_ignored() -> None:
    assert Framer().feed(control(0x0F, b"1234") + Framer().encode(Frame(spdy.PING, value=1))) \
        == [Frame(spdy.PING, value=1)]


HOSTILE = {
    "oversized frame": struct.pack(">II", 1, spdy.MAX_FRAME + 1),
    "data on stream 0": struct.pack(">II", 0, 1) + b"x",
    "SPDY/2": control(spdy.PING, b"\x00\x00\x00\x01", version=2),
    "short SYN_STREAM": control(spdy.SYN_STREAM, b"\x00\x00\x00\x01"),
    "SYN_STREAM for stream 0": syn_stream(0, struct.pack(">I", 0)),
    "not zlib": control(spdy.SYN_STREAM, struct.pack(">IIBB", 1, 0, 0, 0) + b"garbage!"),
    "zlib with another dictionary": control(
        spdy.SYN_STREAM, struct.pack(">IIBB", 1, 0, 0, 0) + _other_dictionary()),
    "decompression bomb": syn_stream(1, struct.pack(">I", 1) + b"\0" * (1 << 20)),
    "truncated block": syn_stream(1, b"\x00\x00"),
    "name past the end": syn_stream(1, struct.pack(">II", 1, 99) + b"abc"),
    "too many headers": syn_stream(1, struct.pack(">I", 1000)),
    "upper-case name": syn_stream(1, struct.pack(">II", 1, 1) + b"A" + struct.pack(">I", 0)),
    "repeated name": syn_stream(1, struct.pack(">I", 2) + 2 * (
        struct.pack(">I", 1) + b"a" + struct.pack(">I", 0))),
    "bytes after the block": syn_stream(1, struct.pack(">I", 0) + b"junk"),
    "binary name": syn_stream(1, struct.pack(">II", 1, 1) + b"\xff" + struct.pack(">I", 0)),
    "SETTINGS count lies": control(spdy.SETTINGS, struct.pack(">I", 5)),
    "PING too long": control(spdy.PING, b"\x00" * 8),
    "RST_STREAM too short": control(spdy.RST_STREAM, b"\x00" * 4),
}


@pytest.mark.parametrize("wire", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_frames_raise_spdy_error_and_the_framer_stays_broken(wire: bytes) -> None:
    framer = Framer()
    with pytest.raises(SpdyError):
        framer.feed(wire)
    with pytest.raises(SpdyError):  # no resynchronising on garbage
        framer.feed(Framer().encode(Frame(spdy.PING, value=1)))


def test_an_incomplete_frame_is_the_only_thing_buffered() -> None:
    framer = Framer()
    header = struct.pack(">II", 1, spdy.MAX_FRAME)
    assert framer.feed(header + b"x" * 1000) == []
    assert len(framer._buffer) == 8 + 1000  # noqa: SLF001 - the bound under test
    with pytest.raises(SpdyError):  # a length over the limit fails before any payload
        Framer().feed(struct.pack(">II", 1, spdy.MAX_FRAME + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_give_frames_or_spdy_error(data: bytes) -> None:
    try:
        frames = Framer().feed(data)
    except SpdyError:
        return
    assert all(isinstance(f, Frame) for f in frames)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
                          st.text(max_size=50)), max_size=10, unique_by=lambda p: p[0]))
def test_any_header_set_round_trips(headers: list[tuple[str, str]]) -> None:
    frame = Frame(spdy.SYN_STREAM, 1, headers=tuple(headers))
    assert Framer().feed(Framer().encode(frame)) == [frame]
