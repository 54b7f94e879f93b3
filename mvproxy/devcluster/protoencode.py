"""The protobuf wire format, encoding side: just varints and length-delimited fields.

``/openapi/v2`` answers kubectl older than 1.27 in protobuf (gnostic's OpenAPI v2
messages); every field that document needs is a string, a bool or a nested message,
so these two wire types are all the simulator writes. ``protobuf.fields`` reads them
back.
"""

from __future__ import annotations

_VARINT, _BYTES = 0, 2


def varint(value: int) -> bytes:
    """``value`` (>= 0) as a base-128 varint, low group first."""
    if value < 0:
        raise ValueError("negative varints are not written here")
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes | str) -> bytes:
    """Field ``number`` holding a string, bytes or an encoded sub-message."""
    data = payload.encode() if isinstance(payload, str) else payload
    return key(number, _BYTES) + varint(len(data)) + data


def boolean(number: int, value: bool) -> bytes:
    return key(number, _VARINT) + varint(int(value))
