"""After a ``101 Switching Protocols``: both connections become a byte tunnel.

exec, attach, port-forward (SPDY/3.1 or WebSocket) and WebSocket watches switch
protocols once the upstream answers ``101``. ``forwarding`` sent the upgrade request
(same identity headers as any request) and parsed the answer with the same parser as
any response; from here on nothing is parsed: the relayed ``101`` goes to the client,
then every byte read on one side is written to the other unchanged, including what
either side sent early (right after its head).

Flow control is per direction: when one side stops reading (its transport pauses
writing), reading from the other side pauses until it drains, so a fast sender
cannot fill memory. Nothing runs per chunk but the two protocols' callbacks.

Ending: when either side ends (EOF, reset, error), both connections are closed after
what was already written is flushed, as kube-apiserver's upgrade-aware proxy does; a
real half-close is not possible over TLS here. This module never logs the tunnelled
bytes (terminal sessions, tokens).
"""

from __future__ import annotations

import asyncio
import logging

from mvproxy import wire
from mvproxy.listener import Exchange
from mvproxy.logs import V, kv
from mvproxy.transport import UpstreamConnection

log = logging.getLogger(__name__)

_NOT_RELAYED_ON_SWITCH = frozenset((b"content-length", b"transfer-encoding", b"keep-alive"))


async def relay(exchange: Exchange, upstream: UpstreamConnection, status: int, reason: bytes,
                raw: wire.RawFields, lowered: list[bytes], early_from_upstream: bytes) -> None:
    """Send the ``101`` downstream, then copy bytes both ways until either side ends."""
    downstream = exchange.conn
    ended = asyncio.get_running_loop().create_future()
    copied = {"up": 0, "down": 0}

    def end() -> None:
        if not ended.done():
            ended.set_result(None)

    def to_upstream(data: bytes) -> None:
        copied["up"] += len(data)
        upstream.write(data)
        if upstream.paused_writing:
            downstream.pause_reading("tunnel")
            upstream.when_writable(lambda: downstream.resume_reading("tunnel"))

    def to_downstream(data: bytes) -> None:
        copied["down"] += len(data)
        downstream.write(data)
        if downstream.paused_writing:
            upstream.pause_reading("tunnel")
            downstream.when_writable(lambda: upstream.resume_reading("tunnel"))

    downstream.write(wire.status_line(status, reason)
                     + wire.raw_lines(raw, lowered, _NOT_RELAYED_ON_SWITCH) + b"\r\n")
    exchange.started = True
    early_from_downstream = exchange.take_over(to_upstream)
    upstream.switch(to_downstream, end)
    downstream.on_eof(end)
    if early_from_downstream:
        to_upstream(early_from_downstream)
    if early_from_upstream:
        to_downstream(early_from_upstream)
    log.log(V(4), "tunnel open", extra=kv(upstream=upstream.upstream.name))
    try:
        await ended
    finally:
        downstream.close()  # flushes what was written, then closes
        upstream.close()
        log.log(V(4), "tunnel closed", extra=kv(upstream=upstream.upstream.name,
                                                bytes_up=copied["up"],
                                                bytes_down=copied["down"]))
