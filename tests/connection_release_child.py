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
    OBSERVERS,
    SCENARIOS,
    Tracked,
    ended_connections_are_gone,
    flood_routes,
    ours,
    request,
    send,
    stalled_bounds,
)

from mvproxy import listener, transport


async def main(root: Path) -> None:
    servers: list[TestServer] = []

    async def server(app, ssl=None) -> TestServer:
        made = TestServer(app, host="127.0.0.1")
        await made.start_server(ssl=ssl)
        servers.append(made)
        return made

    seen = Tracked(transports=False)  # uvloop's (Cython) cannot be weakly referenced
    OBSERVERS.append(seen.observe)
    try:
        async with cluster(server, root, backend_routes=flood_routes,
                           peer_routes=flood_routes) as c:
            await ready(c)
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            for data, read in SCENARIOS.values():
                await send(c.port, c.contexts["admin"], data, read=read)
            leave = asyncio.Event()  # the client stays until measured, however slow
            stalled = asyncio.create_task(send(c.port, c.contexts["admin"], request(FLOOD),
                                               read=False, read_for=120.0, leave=leave))
            # Stalled once every buffer between the backend and the client is full: the
            # upstream pauses and resumes while the kernel still takes bytes (longer on
            # a loaded machine), so it must stay paused across a check half a second
            # later. Bounded by time, not by scans, which a loaded machine slows.
            deadline = asyncio.get_running_loop().time() + 90.0
            paused: list = []
            while asyncio.get_running_loop().time() < deadline:
                paused = [conn for conn in ours(transport.UpstreamConnection)
                          if conn._paused_by]
                if paused:
                    await asyncio.sleep(0.5)
                    if paused[0]._paused_by:
                        break
                    paused = []
                await asyncio.sleep(0.05)
            assert paused, "no upstream connection stayed paused within 90 s"
            await asyncio.sleep(0.2)  # whatever was in flight has landed
            [down] = [conn for conn in ours(listener.DownstreamConnection) if not conn.ended]
            up = paused[0]
            del paused
            print("stalled:", json.dumps(stalled_bounds(down, up)))
            del down, up
            leave.set()
            await stalled
            print("alive:", await ended_connections_are_gone(c, seen))
            gc.collect()
            garbage = [o for o in gc.garbage if type(o).__module__.split(".")[0]
                       in ("mvproxy", "ssl", "_ssl") or "SSLProtocol" in type(o).__name__]
            print("unreachable of ours:", len(garbage),
                  sorted({type(o).__name__ for o in garbage}))
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    finally:
        for made in servers:
            await made.close()


if __name__ == "__main__":
    uvloop.run(main(Path(sys.argv[1])))
