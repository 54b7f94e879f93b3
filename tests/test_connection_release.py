"""Ended connections are freed by reference counting alone, on both legs.

Long-lived connections reach the cyclic garbage collector's oldest generation, which
is almost never collected: a connection that is only freed by the collector keeps its
TLS buffers for good. Each test here turns the collector off, runs one kind of
exchange through the in-process daemon (real TLS on 127.0.0.1, fake backend and peer),
ends it, and checks through weak references that every downstream and upstream
connection that ended, every ``Exchange``, their TLS transports and ``SSLObject``s are
gone. The same runs under uvloop, the daemon's loop, in a child process.

The stalled stream: a backend that streams without pause to a client that never
reads (4 KiB receive buffer, reading paused) must be held back within tens of KiB by
the TLS transports' small limits, checked on the transports themselves (in the
uvloop child; ``bench/memory.py`` measures the process's RSS).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import ssl
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from daemon_support import PODGROUPS, WAIT, cluster, ready
from reliability import record

from mvproxy import flow, listener, transport

EVENT = b'{"type":"MODIFIED","object":{"kind":"Pod","data":"' + b"x" * 4000 + b'"}}\n'
FLOOD = "/api/v1/pods?watch=true"
GET = "/api/v1/namespaces/default/configmaps/x"


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

    app.router.add_get("/api/v1/pods", flood)


class Tracked:
    """Weak references to every connection, exchange, transport and SSLObject made;
    a connection's transport and SSLObject are grouped with it."""

    def __init__(self) -> None:
        self.refs: list[tuple[str, weakref.ref, weakref.ref | None]] = []

    def add(self, what: str, obj: object, owner: object = None) -> None:
        if obj is not None:
            self.refs.append((what, weakref.ref(obj),
                              weakref.ref(owner) if owner is not None else None))

    def objects(self, what: str) -> list:
        return [obj for name, ref, _ in self.refs if name == what
                and (obj := ref()) is not None]

    def alive(self) -> list[str]:
        """What is alive though it ended (or belongs to a connection that ended): an
        open connection (a pooled one, a discovery poll's) is left alone, with its
        transport."""
        left = []
        for what, ref, owner_ref in self.refs:
            obj = ref()
            if obj is None:
                continue
            owner = owner_ref() if owner_ref is not None else obj
            if owner is not None and not getattr(owner, "ended", True):
                continue  # still open
            left.append(what)
        return left


@pytest.fixture
def tracked(monkeypatch) -> Iterator[Tracked]:
    seen = Tracked()

    def watch(cls: type, name: str) -> None:
        made = cls.connection_made

        def connection_made(self, transport_: asyncio.BaseTransport) -> None:
            seen.add(name, self)
            seen.add(f"{name} transport", transport_, self)
            seen.add(f"{name} SSLObject", transport_.get_extra_info("ssl_object"), self)
            made(self, transport_)

        monkeypatch.setattr(cls, "connection_made", connection_made)

    watch(listener.DownstreamConnection, "downstream connection")
    watch(transport.UpstreamConnection, "upstream connection")
    init = listener.Exchange.__init__

    def exchange_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        seen.add("exchange", self)

    monkeypatch.setattr(listener.Exchange, "__init__", exchange_init)
    yield seen


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def send(port: int, ctx: ssl.SSLContext, request: bytes, *, read: bool,
               read_for: float = 1.0) -> None:
    """One connection, one request; read the answer's first bytes (or never read at all,
    with a tiny receive buffer); then drop the connection as a client that leaves."""
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
        await asyncio.sleep(read_for)  # every buffer between the backend and us fills
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
    async with cluster(aiohttp_server, root, backend_routes=flood_routes) as c:
        await ready(c)
        for _ in range(3):
            await send(c.port, c.contexts["admin"], data, read=read)
        assert any(what == "exchange" for what, _, _ in tracked.refs)
        assert any(what == "upstream connection" for what, _, _ in tracked.refs)
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


def test_the_same_holds_under_uvloop(root: Path):
    """The daemon's own loop: uvloop's TLS transports are Cython objects, so the child
    checks what it can reach by weak reference (connections, exchanges, SSLObjects)
    and that, with the collector off, a collection afterwards finds nothing of ours;
    and what one stalled stream holds in its transports while stalled."""
    done = subprocess.run([sys.executable, str(UVLOOP_CHILD), str(root)],
                          capture_output=True, text=True, timeout=180,
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
