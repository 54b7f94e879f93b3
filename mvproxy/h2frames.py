"""HTTP/2 ``GOAWAY`` frames, read and written beside jh2.

jh2's connection state machine (h2's) closes the whole connection when a ``GOAWAY`` is
sent or received: every later frame of a stream still open is then a protocol error.
RFC 9113 §6.8 wants the opposite: streams up to the last one named finish, only new
ones go elsewhere. That is how kube-apiserver's ``--goaway-chance`` rebalances clients,
and how a graceful shutdown ends a connection. So mvproxy keeps ``GOAWAY`` away from
jh2: ``GoawaySplitter`` takes it out of what arrives (by frame headers alone, nothing
else is parsed), and ``goaway_frame`` builds the one mvproxy sends.
"""

from __future__ import annotations

import re

GOAWAY = 0x7
PREFACE_LENGTH = 24
"""The client's connection preface (``PRI * HTTP/2.0...``), before its first frame."""
MAX_GOAWAY_PAYLOAD = 16_384
"""A ``GOAWAY`` larger than the default frame size is refused: its debug data is
all a peer could make mvproxy hold."""


CONTROL_BUDGET = 1_000
"""Frames that carry no request or answer (PING, SETTINGS, PRIORITY, unknown types, empty
DATA) a peer may send in a burst, on either leg; ``CONTROL_REFILL`` per second come
back. Each PING and SETTINGS makes mvproxy write an ACK, read or not. client-go sends a
PING per 30 s idle and a few SETTINGS: honest peers never come near it."""
CONTROL_REFILL = 100.0
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
"""A header name HTTP/1.1 reads as one (lowercase, as HTTP/2 requires)."""
BAD_VALUE = re.compile(rb"[\r\n\x00]")
"""What a header value must not hold to be written into HTTP/1.1 bytes."""


class Budget:
    """A token bucket: ``size`` spent at once at most, ``refill`` back per second."""

    __slots__ = ("at", "left", "refill", "size")

    def __init__(self, size: float, refill: float, now: float):
        self.size, self.refill, self.left, self.at = size, refill, size, now

    def spend(self, now: float) -> bool:
        """One more; False once the budget is spent."""
        self.left = min(self.size, self.left + (now - self.at) * self.refill) - 1
        self.at = now
        return self.left >= 0


class GoawayError(ValueError):
    """A ``GOAWAY`` frame that breaks the protocol (too short, too large)."""


class GoawaySplitter:
    """Passes every frame but ``GOAWAY`` through, as the bytes arrive; the ``GOAWAY`` s
    go to ``received`` as (last stream ID, error code)."""

    __slots__ = ("_goaway", "_head", "_left", "_skip", "received")

    def __init__(self, *, preface: bool):
        self._skip = PREFACE_LENGTH if preface else 0
        self._head = b""
        self._left = 0
        """Payload bytes of the current frame still to come."""
        self._goaway: bytearray | None = None
        """The payload of a ``GOAWAY`` being read (it is never passed on)."""
        self.received: list[tuple[int, int]] = []

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` goes to jh2 (``GoawayError`` for a broken ``GOAWAY``)."""
        out: list[bytes] = []
        i, n = 0, len(data)
        if self._skip:
            take = min(self._skip, n)
            out.append(data[:take])
            self._skip -= take
            i = take
        while i < n:
            if self._left:
                take = min(self._left, n - i)
                if self._goaway is None:
                    out.append(data[i:i + take])
                else:
                    self._goaway += data[i:i + take]
                self._left -= take
                i += take
                if not self._left and self._goaway is not None:
                    self._end_goaway()
                continue
            piece = data[i:i + 9 - len(self._head)]
            self._head += piece
            i += len(piece)
            if len(self._head) < 9:
                break
            length = int.from_bytes(self._head[:3], "big")
            if self._head[3] == GOAWAY:
                if not 8 <= length <= MAX_GOAWAY_PAYLOAD:
                    raise GoawayError(f"a GOAWAY frame of {length} bytes")
                self._goaway = bytearray()
            else:
                out.append(self._head)
            self._left = length
            self._head = b""
        return out[0] if len(out) == 1 else b"".join(out)

    def _end_goaway(self) -> None:
        payload, self._goaway = bytes(self._goaway or b""), None
        self.received.append((int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF,
                              int.from_bytes(payload[4:8], "big")))


def goaway_frame(last_stream_id: int, error_code: int) -> bytes:
    """A ``GOAWAY`` on stream 0 with no debug data."""
    return (b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + last_stream_id.to_bytes(4, "big")
            + error_code.to_bytes(4, "big"))
