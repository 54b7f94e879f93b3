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
import contextlib
from collections.abc import Callable

WRITE_HIGH = 16 * 1024
"""Bytes buffered in a TLS transport (application data and records not yet sent) above
which the writer is told to stop: a stalled reader costs at most about this much in
the TLS layer, plus the one write that crossed it."""
WRITE_LOW = WRITE_HIGH // 4
READ_HIGH = 16 * 1024
"""Encrypted bytes a paused TLS transport reads ahead from its socket."""


SOCKET_READ_MAX = 256 * 1024
"""What one read from a socket may bring (uvloop reads up to 250 kB, asyncio 256 KiB):
the data that crossed a limit before the pause took effect. A smaller ``SO_RCVBUF``
upstream would bound it, but windows that small meet delayed ACKs: measured, a 64 MiB
LIST then slowed until it hit the request timeout."""


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
