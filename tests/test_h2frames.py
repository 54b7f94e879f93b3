"""``h2frames``: GOAWAY taken out of an HTTP/2 byte stream by frame headers alone, however
the bytes are split into reads; every other frame passes byte for byte."""

from __future__ import annotations

import hyperframe.frame as hf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mvproxy.h2frames import PREFACE_LENGTH, GoawayError, GoawaySplitter, goaway_frame

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frames() -> tuple[bytes, bytes, list[tuple[int, int]]]:
    """A stream of frames with two GOAWAYs in it: (all bytes, the others, the GOAWAYs)."""
    settings_frame = hf.SettingsFrame(0, settings={hf.SettingsFrame.MAX_CONCURRENT_STREAMS: 5})
    data = hf.DataFrame(1, data=b"x" * 300, flags={"END_STREAM"})
    ping = hf.PingFrame(0, opaque_data=b"12345678")
    first = hf.GoAwayFrame(0, last_stream_id=7, error_code=0, additional_data=b"debug")
    second = hf.GoAwayFrame(0, last_stream_id=3, error_code=11)
    window = hf.WindowUpdateFrame(0, window_increment=1000)
    parts = [settings_frame, data, first, ping, second, window]
    everything = b"".join(p.serialize() for p in parts)
    others = b"".join(p.serialize() for p in parts if not isinstance(p, hf.GoAwayFrame))
    return everything, others, [(7, 0), (3, 11)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), max_size=60), st.booleans())
def test_goaway_is_split_out_however_the_reads_fall(cuts: list[int], preface: bool) -> None:
    everything, others, goaways = _frames()
    stream = (PREFACE if preface else b"") + everything
    splitter = GoawaySplitter(preface=preface)
    passed, at = [], 0
    for cut in cuts:
        passed.append(splitter.feed(stream[at:at + cut]))
        at += cut
    passed.append(splitter.feed(stream[at:]))
    assert b"".join(passed) == (PREFACE if preface else b"") + others
    assert splitter.received == goaways


def test_the_preface_is_passed_as_it_is_even_when_it_looks_like_a_frame() -> None:
    splitter = GoawaySplitter(preface=True)
    assert splitter.feed(PREFACE[:PREFACE_LENGTH]) == PREFACE
    assert splitter.received == []


@pytest.mark.parametrize("length", [0, 7, 16_385, 1 << 20])
def test_a_goaway_too_short_or_too_large_is_refused(length: int) -> None:
    head = length.to_bytes(3, "big") + b"\x07\x00\x00\x00\x00\x00"
    with pytest.raises(GoawayError):
        GoawaySplitter(preface=False).feed(head + b"\x00" * min(length, 64))


def test_the_frame_mvproxy_writes_is_the_frame_a_library_reads() -> None:
    frame, length = hf.Frame.parse_frame_header(memoryview(goaway_frame(12, 2)[:9]))
    frame.parse_body(memoryview(goaway_frame(12, 2)[9:9 + length]))
    assert isinstance(frame, hf.GoAwayFrame)
    assert (frame.last_stream_id, frame.error_code, frame.stream_id) == (12, 2, 0)
