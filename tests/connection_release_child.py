"""Child process of ``test_connection_release``: its scenarios under uvloop.

Prints ``alive: [...]`` (tracked objects still alive once everything ended, with the
cyclic collector off) and ``unreachable of ours: N`` (objects of mvproxy, ``ssl`` and
uvloop's TLS layer that only the collector could free).
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from pathlib import Path

import uvloop
from aiohttp.test_utils import TestServer
from daemon_support import cluster, ready
from test_connection_release import (
    FLOOD,
    SCENARIOS,
    Tracked,
    ended_connections_are_gone,
    flood_routes,
    request,
    send,
    stalled_bounds,
)

from mvproxy import listener, transport


def track(seen: Tracked) -> None:
    for cls, name in ((listener.DownstreamConnection, "downstream connection"),
                      (transport.UpstreamConnection, "upstream connection")):
        def made(self, transport_, _made=cls.connection_made, _name=name) -> None:
            seen.add(_name, self)
            seen.add(f"{_name} SSLObject", transport_.get_extra_info("ssl_object"), self)
            _made(self, transport_)
        cls.connection_made = made  # type: ignore[method-assign]
    init = listener.Exchange.__init__

    def exchange_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        seen.add("exchange", self)
    listener.Exchange.__init__ = exchange_init  # type: ignore[method-assign]


async def main(root: Path) -> None:
    servers: list[TestServer] = []

    async def server(app, ssl=None) -> TestServer:
        made = TestServer(app, host="127.0.0.1")
        await made.start_server(ssl=ssl)
        servers.append(made)
        return made

    seen = Tracked()
    track(seen)
    try:
        async with cluster(server, root, backend_routes=flood_routes) as c:
            await ready(c)
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            for data, read in SCENARIOS.values():
                await send(c.port, c.contexts["admin"], data, read=read)
            stalled = asyncio.create_task(send(c.port, c.contexts["admin"], request(FLOOD),
                                               read=False, read_for=12.0))
            for _ in range(200):  # stalled once the kernel's buffers are full (≤ 10 s)
                up = [conn for conn in seen.objects("upstream connection") if conn._paused_by]
                if up:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # whatever was in flight has landed
            [down] = [conn for conn in seen.objects("downstream connection")
                      if not conn.ended]
            [up] = [conn for conn in seen.objects("upstream connection") if conn._paused_by]
            print("stalled:", json.dumps(stalled_bounds(down, up)))
            del down, up
            await stalled
            print("alive:", await ended_connections_are_gone(c, seen))
            gc.collect()
            ours = [o for o in gc.garbage if type(o).__module__.split(".")[0]
                    in ("mvproxy", "ssl", "_ssl") or "SSLProtocol" in type(o).__name__]
            print("unreachable of ours:", len(ours), sorted({type(o).__name__ for o in ours}))
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    finally:
        for made in servers:
            await made.close()


if __name__ == "__main__":
    uvloop.run(main(Path(sys.argv[1])))
