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
        # A user's request for what the peer serves too goes there instead ...
        status, _, body = await c.get(path)
        assert status == 200 and json.loads(body)["server"] == "peer", body
        assert await c.metric("mvproxy_backend_failovers_total", reason="unanswered") == 1
        # ... a peer's gets 503 "unserved" (it sent it here: it may try another) ...
        status, headers, _ = await c.get(path, who="peer",
                                         headers={"x-kubernetes-peer-proxied": "true"})
        assert status == 503 and headers[UNSERVED] == "backend-unreachable"
        # ... a client without credentials the backend's failure (never a peer) ...
        status, headers, _ = await c.get(path, who="bearer")
        assert status == 503 and UNSERVED not in headers
        assert "Retry-After" in headers
        # ... and now that the backend is failing, routing sends the user to the peer
        # directly, without trying the backend first.
        status, _, body = await c.get(path)
        assert status == 200 and json.loads(body)["server"] == "peer", body
        assert await c.metric("mvproxy_backend_failovers_total", reason="failing") == 1
        assert await c.metric("mvproxy_backend_failovers_total", reason="unanswered") == 1


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


# --------------------------------------------------------------------------- backend shutdown

SECRETS = "/api/v1/namespaces/default/secrets"  # served by the backend and the peer
SHUTTING_DOWN = "The apiserver is shutting down, please try again later.\n"


def backend_shutting_down(answers: list[str], *, close: bool = True):
    """The backend's secrets answer as kube-apiserver does after its shutdown delay with
    ``--shutdown-send-retry-after`` (429, ``Retry-After: 5``, ``Connection: close``,
    plain text); ``close`` False: a load-shedding 429 (priority and fairness) instead."""
    async def refuse(request: web.Request) -> web.Response:
        await request.read()
        answers.append(request.method)
        headers = {"Retry-After": "5", "Connection": "close"} if close else {"Retry-After": "1"}
        return web.Response(status=429, text=SHUTTING_DOWN if close else "Too many requests",
                            headers=headers)

    def routes(app: web.Application) -> None:
        app.router.add_route("*", SECRETS, refuse)
    return routes


async def test_a_backend_shutting_down_hands_what_a_peer_serves_to_the_peer(aiohttp_server, root):
    """kube-apiserver drains with 429 + Connection: close: the request was not processed,
    so a GET goes to a peer serving secrets too; the client's connection to mvproxy stays
    open. The backend is then failing for routing: the next request goes to the peer
    without asking it, until a poll of the backend succeeds."""
    answers: list[str] = []
    async with cluster(aiohttp_server, root,
                       backend_routes=backend_shutting_down(answers)) as c:
        await ready(c)
        # A pooled backend connection first: the request then goes out on it without
        # dialling, the path most requests take.
        assert (await c.get("/api/v1/namespaces/default/pods"))[0] == 200
        for _ in range(2):  # the second on the same client connection
            status, headers, body = await c.get(SECRETS)
            assert status == 200 and json.loads(body)["server"] == "peer", body
            assert "Connection" not in headers or headers["Connection"] != "close"
        assert answers == ["GET"]
        assert await c.metric("mvproxy_backend_failovers_total", reason="shutting_down") == 1
        assert await c.metric("mvproxy_backend_failovers_total", reason="failing") == 1
        # The backend's discovery polls still succeed: routing trusts it again.
        await c.until(lambda: _backend_trusted(c), "a successful poll of the backend")
        assert (await c.get(SECRETS))[0] == 200 and answers == ["GET", "GET"]
        record("Failover", "backend answers 429 shutting down to a GET a peer can serve", 1,
               "served by the peer")


async def _backend_trusted(c) -> bool:
    """Whether a request for what both serve goes to the backend again."""
    before = len(c.seen["backend"])
    assert (await c.get("/api/v1/namespaces/default/pods"))[0] == 200
    return len(c.seen["backend"]) > before


async def test_a_backend_shutting_down_is_relayed_where_nobody_else_may_take_it(
        aiohttp_server, root):
    """A POST whose body went to the backend (no copy is kept for the backend), and a
    request without credentials (never sent to a peer): kube-apiserver's own 429 with
    its Retry-After, as a client sees it directly, minus Connection: close (mvproxy keeps
    the client's connection). A peer's request gets 503 "unserved", so that peer tries
    another capable one."""
    answers: list[str] = []
    async with cluster(aiohttp_server, root,
                       backend_routes=backend_shutting_down(answers)) as c:
        await ready(c)
        async with c.sessions["admin"].post(c.base + SECRETS, json={"kind": "Secret"}) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "5"
            assert await resp.text() == SHUTTING_DOWN
        status, headers, body = await c.get(SECRETS, who="bearer")
        assert (status, headers["Retry-After"], body.decode()) == (429, "5", SHUTTING_DOWN)
        status, headers, _ = await c.get(SECRETS, who="peer",
                                         headers={"x-kubernetes-peer-proxied": "true"})
        assert status == 503 and headers[UNSERVED] == "backend-unreachable"
        assert answers == ["POST", "GET", "GET"]
        assert await c.metric("mvproxy_backend_failovers_total", reason="shutting_down") is None


def go_busy_before_the_body(answers: list[str]):
    """The backend's secrets answer a POST at once with 429 and ``Retry-After``
    without reading its body, as priority and fairness (or a pod behind
    ``pods/proxy``) do; Go's server then says ``Connection: close`` itself, since the
    unread body (256 KiB or more, or one behind ``Expect: 100-continue``) stands
    between it and the next request. Nothing says it is shutting down."""
    async def busy(request: web.Request) -> web.Response:
        answers.append(request.method)
        return web.Response(status=429, text="Too many requests, please try again later.\n",
                            headers={"Retry-After": "1", "Connection": "close"})

    def routes(app: web.Application) -> None:
        app.router.add_post(SECRETS, busy)
    return routes


async def test_a_429_said_before_the_body_came_is_relayed_not_taken_for_a_shutdown(
        aiohttp_server, root):
    """A client sends a create's head and holds its body back (a 100-continue client,
    or a slow one): the backend's 429 with ``Connection: close`` is the busy server's
    answer, not a drain, and it may have acted on the request (a pod behind
    ``pods/proxy`` did). The client gets it; the create goes nowhere else and the
    backend is not marked failing, whoever sends such requests."""
    answers: list[str] = []
    async with cluster(aiohttp_server, root, backend_routes=go_busy_before_the_body(answers)
                       ) as c:
        await ready(c)
        head = (f"POST {SECRETS} HTTP/1.1\r\nHost: mvproxy\r\n"
                "Content-Type: application/json\r\nContent-Length: 300000\r\n\r\n")
        answer = await c.raw(head.encode(), who="admin")
        assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 429 Too Many Requests", answer[:300]
        assert answers == ["POST"]
        assert ("POST", SECRETS) not in c.seen["peer"]
        assert await c.metric("mvproxy_backend_failovers_total", reason="shutting_down") is None


async def test_a_load_shedding_429_is_relayed(aiohttp_server, root):
    """Priority and fairness' 429 has no Connection: close: the backend is busy, not
    leaving; its answer is the client's, and no peer is asked."""
    answers: list[str] = []
    async with cluster(aiohttp_server, root,
                       backend_routes=backend_shutting_down(answers, close=False)) as c:
        await ready(c)
        status, headers, body = await c.get(SECRETS)
        assert (status, headers["Retry-After"], body) == (429, "1", b"Too many requests")
        assert c.seen["peer"] == []
