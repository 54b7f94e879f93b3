"""HTTP/1.1 framing shared by the listener and the upstream client (pure, no I/O).

Header names and values travel as ``str`` decoded from Latin-1, which maps every
byte to one character and back, so what a client sent reaches the upstream byte for
byte. Everything mvproxy writes goes through ``encode_fields``, which refuses a CR,
LF or NUL anywhere: no value, whatever its source (a certificate's CN, a peer's
header), can start a header or a request of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import overload

Fields = list[tuple[str, str]]
"""Header fields in order, names as received (HTTP names are case-insensitive)."""
RawFields = list[tuple[bytes, bytes]]
"""The same as bytes, as llhttp hands them over: an upstream's answer is relayed without
decoding (llhttp already refused CR, LF and NUL in names and values)."""

# RFC 9110 §7.6.1 connection-specific fields, plus Host (each hop sets its own) and
# the framing fields (each hop frames the body itself).
HOP_BY_HOP = frozenset((
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate",
    "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "host",
))
PEER_PROXIED = "x-kubernetes-peer-proxied"
"""kube-apiserver's mark on a request one server sent to a peer: the peer answers from
its own backend. Set by forwarding and by the discovery poller, read by identity."""
HOP_BY_HOP_RAW = frozenset(name.encode() for name in HOP_BY_HOP)

LAST_CHUNK = b"0\r\n\r\n"
_UNSAFE = ("\r", "\n", "\0")


class UnsafeHeader(ValueError):
    """A header name or value holds a line break or NUL: it cannot be sent."""


_REASONS = {
    100: "Continue", 101: "Switching Protocols", 200: "OK", 201: "Created",
    202: "Accepted", 204: "No Content", 206: "Partial Content", 301: "Moved Permanently",
    302: "Found", 304: "Not Modified", 307: "Temporary Redirect", 400: "Bad Request",
    401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    406: "Not Acceptable", 408: "Request Timeout", 409: "Conflict", 410: "Gone",
    413: "Content Too Large", 415: "Unsupported Media Type", 422: "Unprocessable Content",
    429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 502: "Bad Gateway",
    503: "Service Unavailable", 504: "Gateway Timeout", 505: "HTTP Version Not Supported",
}


def reason_phrase(status: int) -> str:
    """The standard phrase for the codes mvproxy writes itself ("" for others: the
    phrase is optional in HTTP/1.1 and clients ignore it)."""
    return _REASONS.get(status, "")


@overload
def connection_tokens(value: str) -> set[str]: ...
@overload
def connection_tokens(value: bytes) -> set[bytes]: ...
def connection_tokens(value: str | bytes) -> set[str] | set[bytes]:
    """The lowercased names one ``Connection`` field value lists: fields that end at this
    hop. The only parser of that header: the text and the raw (bytes) header filters
    must agree, so only HTTP's whitespace (SP, HTAB) is stripped (``str.strip`` would
    also take \\x85 and \\xa0). Overloads, not ``AnyStr``: mypyc compiles this module
    and cannot narrow a type variable."""
    if isinstance(value, bytes):
        return {token for part in value.split(b",") if (token := part.strip(b" \t").lower())}
    return {name for part in value.split(",") if (name := part.strip(" \t").lower())}


def raw_connection_tokens(raw: RawFields, lowered: list[bytes]) -> set[bytes]:
    """``connection_tokens`` of every raw ``Connection`` field (``lowered``: the names,
    lowercased)."""
    tokens: set[bytes] = set()
    for (_, value), name in zip(raw, lowered, strict=True):
        if name == b"connection":
            tokens |= connection_tokens(value)
    return tokens


def decoded(raw: RawFields) -> Fields:
    return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in raw]


def status_line(status: int, reason: bytes) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, reason or reason_phrase(status).encode())


def raw_lines(raw: RawFields, lowered: list[bytes], dropped: frozenset[bytes] | set[bytes]
              ) -> bytes:
    """The fields whose lowercased name is not in ``dropped``, as header lines."""
    return b"".join([n + b": " + v + b"\r\n" for (n, v), low in zip(raw, lowered, strict=True)
                     if low not in dropped])


def values(fields: Fields, name: str) -> list[str]:
    """Every value of ``name`` (case-insensitive), in order."""
    lowered = name.lower()
    return [v for n, v in fields if n.lower() == lowered]


def first(fields: Fields, name: str, default: str = "") -> str:
    lowered = name.lower()
    for n, v in fields:
        if n.lower() == lowered:
            return v
    return default


def encode_fields(fields: Iterable[tuple[str, str]]) -> bytes:
    fields = list(fields)
    text = "".join([f"{name}: {value}\r\n" for name, value in fields])
    # Each field adds exactly one CR LF: any other CR, LF or NUL came from a name or value.
    if text.count("\r") != len(fields) or text.count("\n") != len(fields) or "\0" in text:
        bad = next((n for n, v in fields if any(c in n + v for c in _UNSAFE)), "?")
        raise UnsafeHeader(f"header {bad[:40]!r} holds a line break or NUL")
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        raise UnsafeHeader("a header holds characters outside Latin-1") from None


def response_head(status: int, reason: str, fields: Iterable[tuple[str, str]]) -> bytes:
    """``HTTP/1.1 <status> <reason>`` and the fields, ending with the blank line."""
    reason = reason if reason and not any(c in reason for c in _UNSAFE) else reason_phrase(status)
    return (b"HTTP/1.1 %d %s\r\n" % (status, reason.encode("latin-1", "replace"))
            + encode_fields(fields) + b"\r\n")


def request_head(method: str, target: str, host: str, fields: Iterable[tuple[str, str]]) -> bytes:
    """``<method> <target> HTTP/1.1``, ``Host`` and the fields, ending with the blank line."""
    if any(c in target for c in " \r\n\0") or any(c in method for c in " \r\n\0"):
        raise UnsafeHeader("the request line holds a space, line break or NUL")
    return (f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")
            + encode_fields(fields) + b"\r\n")


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (never empty: an empty chunk ends the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def last_chunk(trailers: Fields) -> bytes:
    return b"0\r\n" + encode_fields(trailers) + b"\r\n" if trailers else LAST_CHUNK
