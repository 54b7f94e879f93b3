"""Failures handled where a healthy server exists (the reliability issue's "Medium").

- A peer's 503 that means "nothing reached my backend" carries ``x-mvproxy-unserved``;
  the first mvproxy then tries the next capable peer, POSTs included (their body was
  kept), and never relays the marker. A plain 503 is the peer backend's own answer and
  is relayed as it is.
- An mvproxy whose backend cannot be reached marks its 503 that way for peers only.
- A watch through a peer that stops answering its polls ends once the peer is marked
  unreachable, so the client re-establishes it elsewhere instead of stalling.

Against the assembled daemon with fake upstreams on loopback; waits are bounded.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from daemon_support import (
    PODGROUPS,
    WAIT,
    cluster,
    ready,
    )
from reliability import record

from mvproxy.forwarding import UNSERVED

PODGROUP = {"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
            "metadata": {"name": "gang", "namespace": "default"}}



def first_answer_unserved(answers: list[str], marker: bool = True):
    """Peer routes: the first POST to any peer gets 503 (marked unless ``marker`` is
    False), later ones are created; ``answers`` records which server said what."""
    async def create(server: str, request: web.Request) -> web.Response:
        body = await request.read()
        if not answers:
            answers.append(f"{server}:503")
            headers = {UNSERVED: "backend-unreachable"} if marker else {}
            return web.json_response({"kind": "Status", "code": 503}, status=503,
                                     headers={**headers, "Retry-After": "1"})
        answers.append(f"{server}:201")
        return web.json_response({"server": server, "body": json.loads(body)}, status=201)

    servers: list[str] = []

    def routes(app: web.Application) -> None:
        server = f"peer{len(servers)}"
        servers.append(server)

        async def handle(request: web.Request) -> web.Response:
            return await create(server, request)
        app.router.add_post(PODGROUPS, handle)
    return routes


async def test_a_peer_whose_backend_is_unreachable_hands_the_request_to_the_next(
        aiohttp_server, root):
    answers: list[str] = []
    async with cluster(aiohttp_server, root, extra_peers=1,
                       peer_routes=first_answer_unserved(answers)) as c:
        await ready(c)
        async with c.sessions["admin"].post(c.base + PODGROUPS, json=PODGROUP) as resp:
            assert resp.status == 201, await resp.text()
            assert UNSERVED not in resp.headers
            created = await resp.json()
        assert created["body"] == PODGROUP  # the body reached the second peer whole
        first, second = answers
        assert first.endswith(":503") and second.endswith(":201")
        assert first.split(":")[0] != second.split(":")[0]
        assert await c.metric("mvproxy_peer_failovers_total") == 1
        record("Failover", "peer answers 503 'nothing reached my backend' to a POST", 1,
               "sent to the next capable peer with its body; created")


async def test_a_plain_503_from_a_peer_is_relayed(aiohttp_server, root):
    """Without the marker the 503 came from the peer's backend: the request may have
    been seen there, so it is not sent anywhere else."""
    answers: list[str] = []
    async with cluster(aiohttp_server, root, extra_peers=1,
                       peer_routes=first_answer_unserved(answers, marker=False)) as c:
        await ready(c)
        async with c.sessions["admin"].post(c.base + PODGROUPS, json=PODGROUP) as resp:
            assert resp.status == 503
        assert len(answers) == 1


async def test_an_unreachable_backend_is_marked_unserved_for_peers_only(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        await c.backend_server.close()
        path = "/api/v1/namespaces/default/configmaps"
        status, headers, _ = await c.get(path, who="peer",
                                         headers={"x-kubernetes-peer-proxied": "true"})
        assert status == 503 and headers[UNSERVED] == "backend-unreachable"
        status, headers, _ = await c.get(path)
        assert status == 503 and UNSERVED not in headers
        assert "Retry-After" in headers


def endless_watch(opened: asyncio.Event):
    async def watch(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"type":"ADDED","object":{}}\n')
        opened.set()
        await asyncio.sleep(WAIT * 2)  # a frozen peer: nothing more, ever
        return response

    def routes(app: web.Application) -> None:
        app.router.add_get(PODGROUPS, watch)
    return routes


async def test_a_watch_through_a_peer_that_stops_answering_ends(aiohttp_server, root):
    """19 of 40 watches through a frozen peer got neither events nor an end for 30 s;
    now the poller's verdict ends them and the client reconnects elsewhere."""
    opened = asyncio.Event()
    async with cluster(aiohttp_server, root, peer_routes=endless_watch(opened),
                       staleAfter="300ms", forgetAfter="10m") as c:
        await ready(c)
        async with c.sessions["admin"].get(c.base + PODGROUPS + "?watch=true",
                                           timeout=aiohttp.ClientTimeout(total=WAIT)) as resp:
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b'{"type":"ADDED"')
            await asyncio.wait_for(opened.wait(), WAIT)
            loop = asyncio.get_running_loop()
            began = loop.time()
            c.health["discovery"] = False  # the peer stops answering its polls
            try:
                rest = await asyncio.wait_for(resp.content.read(), WAIT)
                assert rest == b""  # the stream ended (cleanly or cut, never hung)
            except aiohttp.ClientPayloadError:
                pass
            assert loop.time() - began < WAIT / 2
        record("Failover", "watch through a peer that stops answering polls", 1,
               f"ended after {loop.time() - began:.1f}s (staleAfter 0.3s)")
