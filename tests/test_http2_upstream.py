"""HTTP/2 toward the backend: watches multiplexed on one connection, end to end.

The daemon runs in process in front of a backend that speaks HTTP/2 and HTTP/1.1 on
loopback over mutual TLS (``h2_upstream_support``); clients are HTTP/1.1 (aiohttp) and
HTTP/2 (httpx). Each test asserts what the client sees and what the backend saw: which
protocol carried each request, on how many connections, with which identity, and that
a stream ends upstream when its client goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

import aiohttp
import pytest
from daemon_support import WAIT, certificate_settings
from h2_upstream_support import Backend, h2_backend

from mvproxy import tls
from mvproxy.app import build_daemon, running
from mvproxy.configfile import load_config
from mvproxy.devcluster.launcher import free_port

WATCH = "/api/v1/namespaces/default/configmaps?watch=true"


@contextlib.asynccontextmanager
async def proxy(root, backend: Backend, **settings: object):
    overrides = {
        "serverID": "apiserver-a", "bindAddress": "127.0.0.1", "securePort": free_port(),
        **certificate_settings(root),
        "backend.url": f"https://127.0.0.1:{backend.port}",
        "discovery.pollInterval": "100ms",
        "admin.bindAddress": "127.0.0.1", "admin.port": 0,
        "timeouts.connect": "5s", "timeouts.request": "30s",
        "timeouts.shutdownGracePeriod": "1s",
        **settings,
    }
    daemon = build_daemon(load_config(None, overrides=overrides), rng=random.Random(7))
    ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    async with running(daemon) as (port, admin_port), aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx, limit=0)) as session:
        yield f"https://127.0.0.1:{port}", session, daemon


async def _events(session: aiohttp.ClientSession, url: str, count: int) -> list[int]:
    """The first ``count`` events of a watch, then the client leaves."""
    seen: list[int] = []
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
        assert r.status == 200
        async for line in r.content:
            if line.strip():
                seen.append(json.loads(line)["n"])
            if len(seen) == count:
                break
    return seen


async def _until(predicate, what: str, timeout: float = WAIT) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():  # noqa: ASYNC110 - the state is another server's
                await asyncio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"gave up waiting for {what}")


async def test_a_watch_goes_upstream_over_http2_with_the_users_identity(root):
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, _):
        assert await _events(session, base + WATCH, 3) == [0, 1, 2]
        [seen] = backend.h2_requests("watch=true")
        assert seen.headers["x-remote-user"] == ["kubernetes-admin"]
        assert "connection" not in seen.headers and "transfer-encoding" not in seen.headers
        await _until(lambda: backend.open_streams == 0, "the watch to end upstream")
        assert backend.resets == 1  # the client left: its stream was cancelled upstream


async def test_many_watches_share_one_upstream_connection(root):
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, _):
        results = await asyncio.gather(*(_events(session, f"{base}{WATCH}&i={i}", 2)
                                         for i in range(60)))
        assert results == [[0, 1]] * 60
        assert backend.connections["h2"] == 1
        assert backend.most_streams == 60


async def test_the_gauges_count_upstream_http2_connections_and_streams(root):
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, daemon):
        watches = [await session.get(f"{base}{WATCH}&g={i}",
                                     timeout=aiohttp.ClientTimeout(total=WAIT))
                   for i in range(5)]
        try:
            await _until(lambda: backend.open_streams == 5, "five watches upstream")
            families = {f.name: f for f in daemon.metrics.registry.collect()}
            assert families["mvproxy_upstream_http2_connections"].samples[0].value == 1
            assert families["mvproxy_upstream_http2_streams"].samples[0].value == 5
        finally:
            for watch in watches:
                watch.close()
        await _until(lambda: backend.open_streams == 0, "the watches to end upstream")


async def test_past_the_servers_stream_limit_a_second_connection_opens(root):
    async with h2_backend(root, max_streams=10) as backend, \
            proxy(root, backend) as (base, session, _):
        results = await asyncio.gather(*(_events(session, f"{base}{WATCH}&i={i}", 2)
                                         for i in range(25)))
        assert results == [[0, 1]] * 25
        assert 3 <= backend.connections["h2"] <= 4  # 10 + 10 + 5, and a closed one reused
        assert backend.most_streams <= 25


async def test_short_requests_stay_on_http1_unless_all_is_configured(root):
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, _):
        async with session.get(base + "/api/v1/namespaces") as r:
            assert r.status == 200 and (await r.json())["protocol"] == "http/1.1"
    async with h2_backend(root) as backend, \
            proxy(root, backend, upstreamHTTP2="all") as (base, session, _):
        async with session.get(base + "/api/v1/namespaces") as r:
            echoed = await r.json()
            assert r.status == 200 and echoed["protocol"] == "h2"
            assert echoed["headers"]["x-remote-user"] == ["kubernetes-admin"]
        body = b"0123456789" * 50_000
        async with session.put(base + "/api/v1/namespaces/default/configmaps/x",
                               data=body) as r:
            assert r.status == 200 and (await r.json())["body"] == len(body)
        async with session.get(base + "/big?n=3000000") as r:
            assert r.status == 200 and len(await r.read()) == 3_000_000


async def test_off_keeps_every_request_on_http1(root):
    async with h2_backend(root) as backend, \
            proxy(root, backend, upstreamHTTP2="off") as (base, session, _):
        async with session.get(base + WATCH) as r:  # this backend's HTTP/1.1 side echoes
            assert r.status == 200 and (await r.json())["protocol"] == "http/1.1"
        assert backend.connections["h2"] == 0


async def test_a_stalled_watch_does_not_stall_the_others_on_its_connection(root):
    async with h2_backend(root, period=0.001) as backend, \
            proxy(root, backend) as (base, session, _):
        stalled = await session.get(base + WATCH, timeout=aiohttp.ClientTimeout(total=WAIT))
        try:
            assert stalled.status == 200
            await asyncio.sleep(1.0)  # events pile up: its windows fill, nothing is read
            assert await _events(session, f"{base}{WATCH}&second=1", 50) == list(range(50))
            assert backend.connections["h2"] == 1
        finally:
            stalled.close()


async def test_goaway_lets_open_watches_finish_and_sends_new_ones_elsewhere(root):
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, _):
        async with session.get(base + WATCH, timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
            first = json.loads(await r.content.readline())["n"]
            backend.goaway()
            await asyncio.sleep(0.2)
            second = json.loads(await r.content.readline())["n"]
            assert second > first  # still flowing on the old connection
            assert await _events(session, f"{base}{WATCH}&after=1", 2) == [0, 1]
            assert backend.connections["h2"] == 2


async def test_a_dead_upstream_connection_ends_its_watches_and_the_next_one_works(root):
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, _):
        async with session.get(base + WATCH, timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
            await r.content.readline()
            backend.cut()
            with contextlib.suppress(aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
                async with asyncio.timeout(WAIT):
                    while await r.content.readline():
                        pass
        assert await _events(session, f"{base}{WATCH}&again=1", 2) == [0, 1]
        assert backend.connections["h2"] == 2


async def test_after_a_certificate_reload_new_watches_take_a_new_connection(root):
    """kube-apiserver checks the client certificate on every request: once a reload
    replaced it, the old session carries what it has and no new request."""
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, daemon):
        async with session.get(base + WATCH, timeout=aiohttp.ClientTimeout(total=WAIT)) as r:
            assert json.loads(await r.content.readline())["n"] == 0
            front = root / "a" / "front-proxy-client"
            daemon.proxy.backend.h2_context.context = tls.client_context(
                root / "ca.crt", f"{front}.crt", f"{front}.key", http2=True)
            assert await _events(session, f"{base}{WATCH}&after=1", 1) == [0]
            assert json.loads(await r.content.readline())["n"] == 1  # the old one goes on
        assert backend.connections["h2"] == 2


async def test_a_session_idle_past_the_pools_expiry_is_not_reused(root):
    async with h2_backend(root) as backend, proxy(root, backend) as (base, session, daemon):
        assert await _events(session, base + WATCH, 1) == [0]
        await _until(lambda: backend.open_streams == 0, "the watch to end upstream")
        for pool in daemon.transport._pools.values():
            pool.idle_expiry = 0.5  # 30 s by default
        await asyncio.sleep(0.6)
        assert await _events(session, f"{base}{WATCH}&later=1", 1) == [0]
        assert backend.connections["h2"] == 2
        await _until(lambda: len(backend.sessions) == 1, "the idle session to be closed")
