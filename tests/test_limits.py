"""Resource limits of the main listener, against the assembled daemon on loopback.

Reproductions from the security issue: 500 slowloris connections stayed open 130 s,
idle TLS connections were never closed, and nothing capped connections. Each test
sets small limits through the configuration (``listener.*``) and asserts what a
client sees: its connection closed (with 408 when a head was begun), 431 for a huge
head, a client beyond ``maxConnections`` kept waiting until a slot frees, and
well-behaved clients served all along. Every wait is bounded by ``WAIT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import pytest
from daemon_support import (
    WAIT,
    Cluster,
    body_of,
    cluster,
    read_until_closed,
    ready,
    status_of,
)
from reliability import record

SHORT = {"headerReadTimeout": "500ms", "idleTimeout": "500ms"}



async def tls_connect(c: Cluster, who: str = "admin"):
    return await asyncio.open_connection("127.0.0.1", c.port, ssl=c.contexts[who],
                                         server_hostname="127.0.0.1")


async def served(c: Cluster) -> bool:
    status, _, _ = await c.get("/api/v1/namespaces")
    return status == 200


async def test_slowloris_connections_are_closed_while_others_are_served(aiohttp_server, root):
    async with cluster(aiohttp_server, root, listener=SHORT) as c:
        await ready(c)
        async def trickle(writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                for _ in range(100):  # a header byte every 50 ms, never the end
                    await asyncio.sleep(0.05)
                    writer.write(b"X")

        slow, tricklers = [], []
        for _ in range(40):
            # The head begins as soon as each connection is up: on a loaded machine the
            # 40 handshakes together can outlast headerReadTimeout, and a connection
            # that never sent a byte is closed without a word (not a 408).
            reader, writer = await tls_connect(c)
            writer.write(b"GET /api/v1/namespaces HTTP/1.1\r\nHost: x\r\n")
            slow.append((reader, writer))
            tricklers.append(asyncio.create_task(trickle(writer)))
        assert await served(c)  # a well-behaved client is not held up
        answers = await asyncio.gather(*(read_until_closed(r) for r, _ in slow))
        for answer in answers:
            assert status_of(answer) == 408, answer[:200]
            assert body_of(answer)["reason"] == "Timeout"
        for task in tricklers:
            task.cancel()
        await asyncio.gather(*tricklers, return_exceptions=True)
        for _, writer in slow:
            writer.close()
        assert await c.metric("mvproxy_refused_requests_total", code="408") == 40
        assert await served(c)
        record("Resource limits", "slowloris connections (a header byte every 50 ms)", 40,
               "408 after headerReadTimeout; other clients served meanwhile")


async def test_an_idle_connection_is_closed(aiohttp_server, root):
    """Never a request, or no next request after one: closed, without a word."""
    async with cluster(aiohttp_server, root, listener=SHORT) as c:
        await ready(c)
        reader, writer = await tls_connect(c)
        assert await read_until_closed(reader) == b""
        writer.close()
        reader, writer = await tls_connect(c)
        writer.write(b"GET /api/v1/namespaces HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await read_until_closed(reader)  # answered, then closed when idle
        assert status_of(answer) == 200
        writer.close()


def quiet_streams(routes_seen: list[str]):
    """A watch and a ``logs -f`` that send a line, stay silent for four idle timeouts,
    then send another and end: alive upstream, quiet downstream."""
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        routes_seen.append(request.path)
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(b"first\n")
        await asyncio.sleep(2.0)
        await response.write(b"second\n")
        return response

    def routes(app: web.Application) -> None:
        app.router.add_get("/api/v1/namespaces/default/secrets", stream)
        app.router.add_get("/api/v1/namespaces/default/pods/p/log", stream)
    return routes


@pytest.mark.parametrize("target", [
    "/api/v1/namespaces/default/secrets?watch=true",
    "/api/v1/namespaces/default/pods/p/log?follow=true",
], ids=["watch", "logs -f"])
async def test_a_silent_stream_outlives_the_idle_timeout(aiohttp_server, root, target):
    """idleTimeout (500 ms here) is for a connection between requests, never for a
    long-running one whose upstream is alive but silent (2 s here): the stream's later
    bytes arrive and it ends as the upstream ends it. Proven against real
    kube-apiservers too (tests/test_real_faults.py, a 3 s timeout, watches silent 7 s)."""
    seen: list[str] = []
    async with cluster(aiohttp_server, root, listener=SHORT,
                       backend_routes=quiet_streams(seen)) as c:
        await ready(c)
        reader, writer = await tls_connect(c)
        try:
            writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = await read_until_closed(reader)
        finally:
            writer.close()
        assert status_of(answer) == 200 and seen, answer
        body = answer.partition(b"\r\n\r\n")[2]
        assert b"first" in body and b"second" in body, answer


async def test_a_connection_that_never_starts_tls_is_closed(aiohttp_server, root):
    async with cluster(aiohttp_server, root, listener=SHORT) as c:
        await ready(c)
        reader, writer = await asyncio.open_connection("127.0.0.1", c.port)
        writer.write(b"\x16\x03\x01")  # the start of a ClientHello, and then nothing
        assert await read_until_closed(reader) == b""
        writer.close()


@pytest.mark.parametrize("shape", ["one huge header", "many headers", "huge target"])
async def test_a_head_over_max_header_bytes_gets_431(aiohttp_server, root, shape):
    async with cluster(aiohttp_server, root, listener={"maxHeaderBytes": 4096}) as c:
        await ready(c)
        if shape == "one huge header":
            head = b"GET /api HTTP/1.1\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"
        elif shape == "many headers":
            head = b"GET /api HTTP/1.1\r\n" + b"".join(
                b"X-H%d: v\r\n" % i for i in range(600)) + b"\r\n"
        else:
            head = b"GET /api/v1/namespaces?x=" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n"
        answer = await c.raw(head)
        assert status_of(answer) == 431, answer[:200]
        assert body_of(answer)["kind"] == "Status"
        assert c.seen == {"backend": [], "peer": []}
        assert await served(c)
        record("Resource limits", f"request head over maxHeaderBytes ({shape})", 1, "431 Status")


async def test_clients_beyond_max_connections_wait_for_a_free_slot(aiohttp_server, root):
    async with cluster(aiohttp_server, root, listener={"maxConnections": 8}) as c:
        await ready(c)
        held = [await tls_connect(c) for _ in range(8)]
        assert await c.metric("mvproxy_open_connections") == 8
        waiting = asyncio.create_task(tls_connect(c))
        done, _ = await asyncio.wait([waiting], timeout=0.5)
        assert not done, "a ninth connection was accepted past maxConnections"
        held[0][1].close()
        reader, writer = await asyncio.wait_for(waiting, WAIT)
        writer.write(b"GET /api/v1/namespaces HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status_of(await read_until_closed(reader)) == 200
        writer.close()
        for _, other in held[1:]:
            other.close()
        record("Resource limits", "connections beyond maxConnections", 1,
               "waited in the backlog; served once a slot freed")


async def test_clients_beyond_max_pending_handshakes_wait_until_one_ends(aiohttp_server, root):
    """Review of issue 19: a client that sends most of a huge ClientHello and stalls
    holds ~0.5 MB until headerReadTimeout; handshakes in progress are capped like
    connections, the rest wait in the backlog."""
    async with cluster(aiohttp_server, root,
                       listener={"maxPendingHandshakes": 3, "headerReadTimeout": "30s"}) as c:
        await ready(c)
        stalled = [await asyncio.open_connection("127.0.0.1", c.port) for _ in range(3)]
        for _, writer in stalled:
            writer.write(b"\x16\x03\x01\x40\x00")  # a 16 KiB handshake record begins...
        async def pending() -> bool:
            return await c.metric("mvproxy_open_connections") == 3
        await c.until(pending, "three handshakes in progress")
        waiting = asyncio.create_task(tls_connect(c))
        done, _ = await asyncio.wait([waiting], timeout=0.5)
        assert not done, "a fourth handshake ran past maxPendingHandshakes"
        stalled[0][1].close()  # one ends: the waiting client's handshake starts
        reader, writer = await asyncio.wait_for(waiting, WAIT)
        writer.write(b"GET /api/v1/namespaces HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status_of(await read_until_closed(reader)) == 200
        writer.close()
        for _, other in stalled[1:]:
            other.close()
        record("Resource limits", "TLS handshakes beyond maxPendingHandshakes (stalled "
               "ClientHellos)", 3, "waited in the backlog; served once a handshake ended")
