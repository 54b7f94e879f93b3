"""After a ``101 Switching Protocols``: both connections become a byte tunnel.

exec, attach, port-forward (SPDY/3.1 or WebSocket) and WebSocket watches switch
protocols once the upstream answers ``101``. ``forwarding`` sent the upgrade request
(same identity headers as any request) and parsed the answer with the same parser as
any response; from here on nothing is parsed: the relayed ``101`` goes to the client,
then every byte read on one side is written to the other unchanged, including what
either side sent early (right after its head).

Flow control is per direction: when one side stops reading (its transport pauses
writing), reading from the other side pauses until it drains, so a fast sender
cannot fill memory. Nothing runs per chunk but the two protocols' callbacks, and no
task waits for the end: the request engine learns it from ``on_close``.

Ending: when either side ends (EOF, reset, error), both connections are closed after
what was already written is flushed, as kube-apiserver's upgrade-aware proxy does; a
real half-close is not possible over TLS here. This module never logs the tunnelled
bytes (terminal sessions, tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mvproxy import wire
from mvproxy.listener import DownstreamConnection, Exchange
from mvproxy.logs import V, kv
from mvproxy.transport import UpstreamConnection

log = logging.getLogger(__name__)

_NOT_RELAYED_ON_SWITCH = frozenset((b"content-length", b"transfer-encoding", b"keep-alive"))


class Tunnel:
    """Copies bytes both ways between two switched connections until either ends."""

    __slots__ = ("closed", "down", "downstream", "on_close", "up", "upstream")

    def __init__(self, downstream: DownstreamConnection, upstream: UpstreamConnection,
                 on_close: Callable[[], None]):
        self.downstream, self.upstream, self.on_close = downstream, upstream, on_close
        self.up = self.down = 0
        self.closed = False

    def to_upstream(self, data: bytes) -> None:
        upstream, downstream = self.upstream, self.downstream
        self.up += len(data)
        upstream.write(data)
        if upstream.paused_writing:
            downstream.pause_reading("tunnel")
            upstream.when_writable(lambda: downstream.resume_reading("tunnel"))

    def to_downstream(self, data: bytes) -> None:
        upstream, downstream = self.upstream, self.downstream
        self.down += len(data)
        downstream.write(data)
        if downstream.paused_writing:
            upstream.pause_reading("tunnel")
            downstream.when_writable(lambda: upstream.resume_reading("tunnel"))

    def close(self) -> None:
        """Either side ended (or the request is cancelled): close both after what was
        written is flushed, once."""
        if self.closed:
            return
        self.closed = True
        self.downstream.close()
        self.upstream.close()
        log.log(V(4), "tunnel closed", extra=kv(upstream=self.upstream.upstream.name,
                                                bytes_up=self.up, bytes_down=self.down))
        self.on_close()


def open_tunnel(exchange: Exchange, downstream: DownstreamConnection,
                upstream: UpstreamConnection, status: int, reason: bytes,
                raw: wire.RawFields, lowered: list[bytes], early_from_upstream: bytes,
                on_close: Callable[[], None]) -> Tunnel:
    """Send the ``101`` downstream, then copy bytes both ways until either side ends;
    ``on_close()`` then."""
    tunnel = Tunnel(downstream, upstream, on_close)
    downstream.write(wire.status_line(status, reason)
                     + wire.raw_lines(raw, lowered, _NOT_RELAYED_ON_SWITCH) + b"\r\n")
    exchange.started = True
    early_from_downstream = exchange.take_over(tunnel.to_upstream)
    upstream.switch(tunnel.to_downstream, tunnel.close)
    downstream.on_eof(tunnel.close)
    log.log(V(4), "tunnel open", extra=kv(upstream=upstream.upstream.name))
    if early_from_downstream and not tunnel.closed:
        tunnel.to_upstream(early_from_downstream)
    if early_from_upstream and not tunnel.closed:
        tunnel.to_downstream(early_from_upstream)
    return tunnel
