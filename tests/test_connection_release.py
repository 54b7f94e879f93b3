"""Ended connections are freed by reference counting alone, on both legs.

Long-lived connections reach the cyclic garbage collector's oldest generation, which
is almost never collected: a connection that is only freed by the collector keeps its
TLS buffers for good. Each test here turns the collector off, runs one kind of
exchange through the in-process daemon (real TLS on 127.0.0.1, fake backend and peer),
ends it, and checks that every downstream and upstream connection that ended and every
``Exchange`` are gone from the objects the collector tracks (compiled by mypyc, they
cannot be weakly referenced), and their TLS transports and ``SSLObject``s by weak
reference. The same runs under uvloop, the daemon's loop, in a child process.

The stalled stream: a backend that streams without pause to a client that never
reads (4 KiB receive buffer, reading paused) must be held back within tens of KiB by
the TLS transports' small limits, checked on the transports themselves (in the
uvloop child; ``bench/memory.py`` measures the process's RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import socket
import ssl
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from daemon_support import PODGROUPS, WAIT, cluster, ready
from reliability import record

from mvproxy import flow, listener, transport

EVENT = b'{"type":"MODIFIED","object":{"kind":"Pod","data":"' + b"x" * 4000 + b'"}}\n'
FLOOD = "/api/v1/pods?watch=true"
GET = "/api/v1/namespaces/default/configmaps/x"


OBSERVERS: list[Callable[[], None]] = []
"""Called by the fake backend while it handles each request: the moment every object of
that request's path (both connections, the exchange, their transports) is alive."""


def flood_routes(app: web.Application) -> None:
    async def flood(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            for _ in range(4096):  # 16 MiB at most, far beyond every buffer on the way
                await response.write(EVENT)
        except ConnectionError:
            pass  # the client left
        return response

    @web.middleware
    async def observed(request: web.Request, handler):  # noqa: ANN001 - aiohttp's
        for observe in OBSERVERS:
            observe()
        return await handler(request)

    app.router.add_get("/api/v1/pods", flood)
    app.middlewares.append(observed)


KINDS = {listener.DownstreamConnection: "downstream connection",
         transport.UpstreamConnection: "upstream connection",
         listener.Exchange: "exchange"}


def ours(kind: type) -> list:
    """The live instances of one of ``KINDS``, found among the objects the collector
    tracks (it need not run for that): compiled, they cannot be weakly referenced."""
    return [obj for obj in gc.get_objects() if type(obj) is kind]


class Tracked:
    """What was seen of each of ``KINDS`` while a request was in flight (``observe``),
    with weak references to the connections' TLS transports and SSLObjects, each
    grouped with its connection."""

    def __init__(self, *, transports: bool = True) -> None:
        self.transports = transports
        self.seen: dict[str, int] = dict.fromkeys(KINDS.values(), 0)
        self.refs: dict[tuple[str, int], weakref.ref] = {}

    def observe(self) -> None:
        for kind, name in KINDS.items():
            found = ours(kind)
            self.seen[name] += len(found)
            if kind is listener.Exchange:
                continue
            for conn in found:
                if conn.transport is None:
                    continue
                parts = {"SSLObject": conn.transport.get_extra_info("ssl_object")}
                if self.transports:
                    parts["transport"] = conn.transport
                for part, obj in parts.items():
                    if obj is not None:
                        self.refs.setdefault((f"{name} {part}", id(conn)), weakref.ref(obj))

    def alive(self) -> list[str]:
        """What is alive though it ended (or belongs to a connection that ended): an
        open connection (a pooled one, a discovery poll's) is left alone, with its
        transport."""
        left, open_ids = [], set()
        for kind, name in KINDS.items():
            for obj in ours(kind):
                if kind is not listener.Exchange and not obj.ended:
                    open_ids.add(id(obj))
                else:
                    left.append(name)
        left += [what for (what, owner), ref in self.refs.items()
                 if ref() is not None and owner not in open_ids]
        return left


@pytest.fixture
def tracked() -> Iterator[Tracked]:
    seen = Tracked()
    OBSERVERS.append(seen.observe)
    try:
        yield seen
    finally:
        OBSERVERS.remove(seen.observe)


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def send(port: int, ctx: ssl.SSLContext, request: bytes, *, read: bool,
               read_for: float = 1.0, leave: asyncio.Event | None = None) -> None:
    """One connection, one request; read the answer's first bytes (or never read at all,
    with a tiny receive buffer, for ``read_for`` seconds or until ``leave`` is set); then
    drop the connection as a client that leaves."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock, ssl=ctx,
                                                   server_hostname="127.0.0.1")
    writer.write(request)
    if read:
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        await asyncio.sleep(0.2)  # a watch: let events flow for a while
    else:
        writer.transport.pause_reading()
        if leave is None:
            await asyncio.sleep(read_for)  # every buffer between the backend and us fills
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(leave.wait(), read_for)
    writer.transport.abort()


def request(path: str, *extra: str) -> bytes:
    return "\r\n".join([f"GET {path} HTTP/1.1", "Host: mvproxy", *extra, "", ""]).encode()


SCENARIOS = {
    "keep-alive GET": (request(GET), True),
    "Connection: close GET": (request(GET, "Connection: close"), True),
    "watch, client leaves": (request("/api/v1/configmaps?watch=true"), True),
    "streaming watch, client leaves mid-stream": (request(FLOOD), True),
    "stalled watch, then abandoned": (request(FLOOD), False),
    "request through a peer": (request(PODGROUPS), True),
}


async def ended_connections_are_gone(c, tracked: Tracked) -> list[str]:
    """Close every pooled upstream connection of the request path too, then wait
    (bounded) for every tracked object that ended to go; returns what is still alive."""
    for pool in list(c.daemon.transport._pools.values()):
        pool.reset()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while tracked.alive() and loop.time() < deadline:  # noqa: ASYNC110 - freed by others
        await asyncio.sleep(0.05)
    return tracked.alive()


IN_PROCESS = ("keep-alive GET", "Connection: close GET", "request through a peer")
"""Under asyncio's own loop (pytest's) a watch ended by cancelling its coroutine is
still left for the collector by that loop's transports; the daemon runs uvloop, where
``test_the_same_holds_under_uvloop`` checks every scenario."""


@pytest.mark.parametrize("scenario", IN_PROCESS)
async def test_ended_connections_are_freed_without_the_collector(
        aiohttp_server, root, tracked, no_collector, scenario):
    data, read = SCENARIOS[scenario]
    async with cluster(aiohttp_server, root, backend_routes=flood_routes,
                       peer_routes=flood_routes) as c:
        await ready(c)
        for _ in range(3):
            await send(c.port, c.contexts["admin"], data, read=read)
        assert tracked.seen["exchange"] > 0
        assert tracked.seen["upstream connection"] > 0
        assert await ended_connections_are_gone(c, tracked) == []
    assert gc.isenabled() is False  # nothing above turned the collector back on
    record("Memory", f"ended connections, collector off, asyncio loop: {scenario}", 3,
           "connections, exchanges, TLS transports and SSLObjects freed by reference "
           "counting")


def stalled_bounds(down, up) -> dict[str, int]:
    """What a stalled stream holds in its TLS transports, and the bounds: the write that
    crossed the limit is at most one upstream socket read (with TLS records' framing),
    and nothing more was taken."""
    one_read = flow.READ_CHUNK + 1024  # and its TLS record's framing
    return {"downstream paused": int(down.paused_writing),
            "upstream paused for it": int(up._paused_by == {"downstream"}),
            "downstream buffered": down.transport.get_write_buffer_size(),
            "downstream bound": flow.WRITE_HIGH + one_read,
            "upstream read ahead": up.transport.get_read_buffer_size(),
            "upstream bound": flow.READ_HIGH + one_read}


UVLOOP_CHILD = Path(__file__).with_name("connection_release_child.py")


@pytest.mark.timeout(240)  # the child waits up to 90 s for the stall on a loaded machine
def test_the_same_holds_under_uvloop(root: Path):
    """The daemon's own loop: uvloop's TLS transports are Cython objects, so the child
    checks what it can reach by weak reference (connections, exchanges, SSLObjects)
    and that, with the collector off, a collection afterwards finds nothing of ours;
    and what one stalled stream holds in its transports while stalled."""
    done = subprocess.run([sys.executable, str(UVLOOP_CHILD), str(root)],
                          capture_output=True, text=True, timeout=220,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "alive: []" in done.stdout, done.stdout
    assert "unreachable of ours: 0" in done.stdout, done.stdout
    stalled = json.loads(done.stdout.split("stalled: ", 1)[1].splitlines()[0])
    assert stalled["downstream paused"] == stalled["upstream paused for it"] == 1, stalled
    assert stalled["downstream buffered"] <= stalled["downstream bound"], stalled
    assert stalled["upstream read ahead"] <= stalled["upstream bound"], stalled
    record("Memory", "ended connections, collector off, uvloop: every scenario above, "
           "watches and a stalled-then-abandoned stream included", len(SCENARIOS),
           "all freed by reference counting; a collection afterwards finds none of ours")
    record("Memory", "stalled stream (client never reads, backend streams on)", 1,
           f"paused both ways; downstream TLS buffer {stalled['downstream buffered']} B "
           f"(limit {flow.WRITE_HIGH} + one socket read), upstream read-ahead "
           f"{stalled['upstream read ahead']} B")
