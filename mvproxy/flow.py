"""Flow control shared by both ends of the data plane (``listener`` and ``transport``).

A connection writes what it is given, remembers when its peer stopped reading
(``pause_writing``) and calls back whoever waits for it to read again; reading is
paused for named reasons, so that one reason's resume never undoes another's pause
(a body waiting for its consumer, a slow upstream, a pipeline, a tunnel).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


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
