"""Flow control shared by both ends of the data plane (``listener`` and ``transport``).

A connection writes what it is given, remembers when its peer stopped reading
(``pause_writing``) and calls back whoever waits for it to read again; reading is
paused for named reasons, so that one reason's resume never undoes another's pause
(a body waiting for its consumer, a slow upstream, a pipeline, a tunnel).

Both ends keep what sits in their buffers small. Left alone, asyncio's (and uvloop's)
TLS transport takes 512 KiB of application data before it reports ``pause_writing``,
its socket side queues 64 KiB more, every socket read brings up to 256 KiB, and
OpenSSL's memory buffers keep the largest size they ever reached: a client that
stopped reading pinned 1.5-2 MB. So mvproxy puts the loop's own TLS protocol on TCP
transports it keeps (``accept_tls``, ``connect_tls``): small write limits on both
layers (``WRITE_HIGH``), reads capped at one TLS record and smaller while the other leg
is behind (``READ_CHUNK``, ``READ_CHUNK_BEHIND``), the upstream socket paused itself
when its downstream stops, and downstream sockets that push back early
(``NOTSENT_LOWAT``).

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

WRITE_HIGH = 4 * 1024
"""Bytes buffered in a TLS transport (application data and records not yet sent) above
which the writer is told to stop: a stalled reader costs at most about this much in
the TLS layer, plus the one write that crossed it."""
WRITE_LOW = WRITE_HIGH // 4
READ_HIGH = 16 * 1024
"""Encrypted bytes a paused TLS transport reads ahead from its socket."""
READ_CHUNK = 16 * 1024
"""The most one read from an upstream socket brings into the TLS layer (asyncio and
uvloop read up to 256 KiB at a time): one TLS record. Measured (2026-12-01, this
machine, ``bench/run.py`` 3 rounds, noisy): a stalled stream holds ~195 KiB with 16
KiB reads, ~410 KiB with 64 KiB; a 64 KiB LIST cost 109 µs/req with uncapped reads,
142 with 16 KiB and 136 with 64 KiB (the cap is two Python calls per read). Smaller
reads split records: the in-process 64 MiB transfer each way took ~35 % (8 KiB) and
~50 % (4 KiB) more CPU than with 16 KiB; in ``bench/run.py`` (same hour, 3 rounds) a 64 KiB
LIST took 201 µs/req with 4 KiB reads against 151 with 16 KiB, for 143-154 KiB per
stalled stream instead of ~196."""
READ_CHUNK_BEHIND = 4 * 1024
"""The most one read brings while whoever the bytes go to is behind (``reads_behind``):
what arrives after the other leg stopped reading, before the pause takes effect. Each
KiB read then costs several in the buffers it passes through (measured: 4 KiB here
gave 143 KiB of RSS per stalled stream, 8 KiB 176, 32 KiB 375), so reads shrink only
while the other leg is behind: a stream that keeps up reads whole records."""
NOTSENT_LOWAT = 16 * 1024
"""``TCP_NOTSENT_LOWAT`` of downstream sockets: the kernel takes at most this much
that it has not sent yet, so a client that stops reading is noticed (the socket
pushes back) within 16 KiB, not after the kernel's send buffer (up to MBs) filled;
upstream reads then shrink (``READ_CHUNK_BEHIND``) before much more arrives."""


class _Unwrapped(asyncio.Protocol):
    """A TCP connection before its TLS layer exists: reading pauses at once, and what
    arrived before that (a client speaks first) is kept for the TLS layer."""

    def __init__(self) -> None:
        self.early: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).pause_reading()

    def data_received(self, data: bytes) -> None:
        self.early.append(data)


class _CappedReads(asyncio.BufferedProtocol):
    """Between the TCP transport and the loop's own TLS protocol: reads of at most
    ``READ_CHUNK`` (``READ_CHUNK_BEHIND`` while ``behind()``), everything else passed
    on as it is."""

    __slots__ = ("tls", "behind")

    def __init__(self, tls: asyncio.BufferedProtocol, behind: Callable[[], bool] | None):
        self.tls = tls
        self.behind = behind

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tls.connection_made(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        behind = self.behind
        limit = READ_CHUNK_BEHIND if behind is not None and behind() else READ_CHUNK
        return memoryview(self.tls.get_buffer(sizehint))[:limit]

    def buffer_updated(self, nbytes: int) -> None:
        self.tls.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return self.tls.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.tls.connection_lost(exc)

    def pause_writing(self) -> None:
        self.tls.pause_writing()

    def resume_writing(self) -> None:
        self.tls.resume_writing()


async def accept_tls(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                     protocol: FlowControl, context: ssl.SSLContext, *,
                     handshake_timeout: float) -> asyncio.Transport:
    """``connect_accepted_socket`` with TLS, the TCP transport kept (returned): see
    ``_wrap``. ``protocol.connection_made`` follows the handshake."""
    raw, plain = await loop.connect_accepted_socket(_Unwrapped, sock)
    await _wrap(loop, raw, plain.early, protocol, context, server_side=True,
                server_hostname=None, handshake_timeout=handshake_timeout, capped=False)
    return raw


async def connect_tls(loop: asyncio.AbstractEventLoop, host: str, port: int,
                      protocol: FlowControl, context: ssl.SSLContext, *,
                      server_hostname: str, handshake_timeout: float) -> asyncio.Transport:
    """``create_connection`` with TLS, the TCP transport kept (returned)."""
    raw, plain = await loop.create_connection(_Unwrapped, host, port)
    await _wrap(loop, raw, plain.early, protocol, context, server_side=False,
                server_hostname=server_hostname, handshake_timeout=handshake_timeout,
                capped=True, behind=getattr(protocol, "reads_behind", None))
    return raw


async def _wrap(loop: asyncio.AbstractEventLoop, raw: asyncio.Transport, early: list[bytes],
                protocol: FlowControl, context: ssl.SSLContext, *, server_side: bool,
                server_hostname: str | None, handshake_timeout: float, capped: bool,
                behind: Callable[[], bool] | None = None) -> None:
    """Put the loop's own TLS protocol on ``raw`` as ``start_tls`` does, with a small
    socket-side write limit (the TLS transport's socket side takes 64 KiB before it
    pushes back) and, if ``capped``, reads capped (``_CappedReads``; ``behind``: the
    protocol's ``reads_behind``). Only upstream reads are capped: downstream reads
    carry requests, and the shim costs two Python calls per read (uvloop's own TLS
    protocol is called from C).
    ``start_tls`` itself cannot be used on an accepted socket: it would lose the bytes
    the client sent before it ran."""
    try:
        waiter = loop.create_future()
        tls = _tls_protocol_type(loop)(loop, protocol, context, waiter, server_side=server_side,
                                       server_hostname=server_hostname,
                                       ssl_handshake_timeout=handshake_timeout)
        under: asyncio.BufferedProtocol = _CappedReads(tls, behind) if capped else tls
        raw.set_protocol(under)
        under.connection_made(raw)
        for data in early:
            _feed(under, data)
        early.clear()  # held by the TLS layer now; not twice for the whole handshake
        limit_buffers(raw)
        raw.resume_reading()
        await waiter
    except BaseException:
        raw.abort()
        raise


def _tls_protocol_type(loop: asyncio.AbstractEventLoop) -> type:
    """The TLS protocol of this loop's own ``start_tls`` (uvloop has its own)."""
    if type(loop).__module__.startswith("uvloop"):
        import uvloop.loop

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


class FlowControl:
    """Base of the data plane's protocols; ``_flow_init`` from ``__init__``.

    Not an ``asyncio.Protocol`` subclass: the loop calls protocols by name, and a
    class compiled by mypyc that derives from a Python class crashes the interpreter
    when an instance that had a weak reference is freed (docs/compiled.md). Compiled,
    its instances cannot be weakly referenced at all (a ``TypeError``, not a crash)."""

    transport: asyncio.Transport | None

    def _flow_init(self) -> None:
        self.transport = None
        self.socket_transport: asyncio.Transport | None = None
        """The TCP transport under the TLS one (``accept_tls``, ``connect_tls``)."""
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
        self.transport = self.socket_transport = None

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

    def writes_behind(self) -> bool:
        """Whether what was written is not all on its way (the TLS layer or the socket
        still holds some): whoever feeds this connection should read in small pieces."""
        transport, raw = self.transport, self.socket_transport
        return self._write_paused or (transport is not None and (
            transport.get_write_buffer_size() > 0
            or (raw is not None and raw.get_write_buffer_size() > 0)))

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
