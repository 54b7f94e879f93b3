"""Flow control shared by both ends of the data plane (``listener`` and ``transport``).

A connection writes what it is given, remembers when its peer stopped reading
(``pause_writing``) and calls back whoever waits for it to read again; reading is
paused for named reasons, so that one reason's resume never undoes another's pause
(a body waiting for its consumer, a slow upstream, a pipeline, a tunnel).

Both ends keep what sits in their TLS layer small: asyncio's (and uvloop's) TLS
transport accepts 512 KiB of application data before it reports ``pause_writing``,
and reads 256 KiB ahead while its protocol is paused, and OpenSSL's memory buffers
keep the largest size they ever reached. ``WRITE_HIGH`` and ``READ_HIGH`` bound those,
so a client that stops reading makes the upstream stop within tens of KiB.

When a connection ends, ``_flow_release`` drops its references (transport, waiters):
its memory then goes by reference counting at once, never waiting for the cyclic
garbage collector, whose oldest generation (where long-lived connections end up) is
almost never collected.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import cast

WRITE_HIGH = 16 * 1024
"""Bytes buffered in a TLS transport (application data and records not yet sent) above
which the writer is told to stop: a stalled reader costs at most about this much in
the TLS layer, plus the one write that crossed it."""
WRITE_LOW = WRITE_HIGH // 4
READ_HIGH = 16 * 1024
"""Encrypted bytes a paused TLS transport reads ahead from its socket."""


RECEIVE_BUFFER = 16 * 1024
"""``SO_RCVBUF`` of upstream sockets. Every read from a socket may take all the kernel
holds (up to 250 kB), and a read that arrives as the downstream stops reading stays in
memory until it reads again; this bounds one read to about twice this. The cost: one
upstream connection moves at most about this much per round trip (~60 MB/s at 0.5 ms),
well above what a kube-apiserver serializes for one request."""


class _Unwrapped(asyncio.Protocol):
    """An accepted TCP connection before its TLS layer exists: reading pauses at once,
    and whatever arrived before that (the client speaks first) is kept for it."""

    def __init__(self) -> None:
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).pause_reading()

    def data_received(self, data: bytes) -> None:
        self.early.append(data)


async def accept_tls(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                     protocol: asyncio.Protocol, context: ssl.SSLContext, *,
                     handshake_timeout: float) -> None:
    """``connect_accepted_socket`` with TLS, keeping hold of the TCP transport: the TLS
    transport does not expose its socket-side write limit (64 KiB of records queued
    for a client that reads nothing), so the TLS layer is put on the TCP transport
    here, as ``start_tls`` does (``start_tls`` itself would lose the bytes the client
    sent before it runs). ``protocol.connection_made`` follows the handshake."""
    raw, plain = await loop.connect_accepted_socket(_Unwrapped, sock)
    try:
        waiter = loop.create_future()
        tls = _ssl_protocol_type(loop)(loop, protocol, context, waiter, server_side=True,
                                       ssl_handshake_timeout=handshake_timeout)
        raw.set_protocol(tls)
        tls.connection_made(raw)
        for data in plain.early:
            _feed(tls, data)
        limit_buffers(raw)
        raw.resume_reading()
        await waiter
    except BaseException:
        raw.abort()
        raise


def _ssl_protocol_type(loop: asyncio.AbstractEventLoop) -> type:
    """The TLS protocol of this loop's own ``start_tls`` (uvloop has its own)."""
    if type(loop).__module__.startswith("uvloop"):
        import uvloop.loop  # noqa: PLC0415 - only where uvloop runs the loop

        return cast(type, uvloop.loop.SSLProtocol)  # type: ignore[attr-defined]
    return asyncio.sslproto.SSLProtocol


def _feed(protocol: asyncio.BufferedProtocol, data: bytes) -> None:
    """Hand ``data`` to a buffered protocol as if the transport had read it."""
    view = memoryview(data)
    while view:
        buffer = memoryview(protocol.get_buffer(len(view)))
        count = min(len(buffer), len(view))
        buffer[:count] = view[:count]
        protocol.buffer_updated(count)
        view = view[count:]


def limit_buffers(transport: asyncio.BaseTransport) -> None:
    """Small write and read-ahead limits on a new transport, TLS or TCP (see the module
    docstring); transports without such limits (tests' fakes) are left as they are."""
    for name, high, low in (("set_write_buffer_limits", WRITE_HIGH, WRITE_LOW),
                            ("set_read_buffer_limits", READ_HIGH, None)):
        setter = getattr(transport, name, None)
        if setter is not None:
            with contextlib.suppress(NotImplementedError, ValueError):
                setter(high=high, low=low)


class FlowControl(asyncio.Protocol):
    """Mixin for the data plane's protocols; ``_flow_init`` from ``__init__``."""

    transport: asyncio.Transport | None

    def _flow_init(self) -> None:
        self.transport = None
        self._write_paused = False
        self._write_waiters: list[Callable[[], None]] = []
        self._paused_by: set[str] = set()

    @property
    def ended(self) -> bool:
        """The connection is closing or closed: nothing more is written or read."""
        raise NotImplementedError

    def _flow_release(self) -> None:
        """The connection ended: wake whoever waits on it, then let go of the transport
        (and through it the TLS buffers) whatever still refers to this object."""
        self._wake_writers()
        self._paused_by.clear()
        self.transport = None

    # asyncio calls these when the transport's write buffer crosses its high and low marks
    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writers()

    def _wake_writers(self) -> None:
        waiters, self._write_waiters = self._write_waiters, []
        for waiter in waiters:
            waiter()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    @property
    def paused_writing(self) -> bool:
        return self._write_paused

    def when_writable(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the other side reads again (at once if it does)."""
        if self._write_paused and not self.ended:
            self._write_waiters.append(callback)
        else:
            callback()

    def pause_reading(self, reason: str) -> None:
        if not self._paused_by and self.transport is not None:
            with contextlib.suppress(RuntimeError):
                self.transport.pause_reading()
        self._paused_by.add(reason)

    def resume_reading(self, reason: str) -> None:
        if reason in self._paused_by:
            self._paused_by.discard(reason)
            if not self._paused_by and self.transport is not None and not self.ended:
                with contextlib.suppress(RuntimeError):
                    self.transport.resume_reading()
