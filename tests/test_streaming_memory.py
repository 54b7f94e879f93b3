"""Memory stays flat with the size of what flows through mvproxy.

A fake backend streams a response far larger than any buffer mvproxy should hold,
and swallows an equally large upload; the daemon runs in this process, so the
process's peak resident set size (``ru_maxrss``, which only ever grows) would jump
by the body size if either direction were buffered whole. The bound is a memory
bound, not a timing one.
"""

from __future__ import annotations

import hashlib
import resource

from aiohttp import web

from test_app import cluster, synced

BODY = 192 * 1024 * 1024
CHUNK = 256 * 1024
ALLOWED_GROWTH = 48 * 1024 * 1024


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def add_streaming_routes(app: web.Application) -> None:
    async def download(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = BODY
        await response.prepare(request)
        block = b"x" * CHUNK
        for _ in range(BODY // CHUNK):
            await response.write(block)
        return response

    async def upload(request: web.Request) -> web.Response:
        digest, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_chunked(CHUNK):
            digest.update(chunk)
            size += len(chunk)
        return web.json_response({"size": size, "sha256": digest.hexdigest()})

    app.router.add_get("/api/v1/namespaces/default/configmaps/big", download)
    app.router.add_put("/api/v1/namespaces/default/configmaps/big", upload)


async def test_large_bodies_stream_through_with_flat_memory(aiohttp_server, root):
    async with cluster(aiohttp_server, root, backend_routes=add_streaming_routes) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        before = peak_rss()

        size = 0
        async with c.sessions["admin"].get(
                c.base + "/api/v1/namespaces/default/configmaps/big") as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_chunked(CHUNK):
                size += len(chunk)
        assert size == BODY

        async def body():
            block = b"y" * CHUNK
            for _ in range(BODY // CHUNK):
                yield block
        expected = hashlib.sha256()
        for _ in range(BODY // CHUNK):
            expected.update(b"y" * CHUNK)
        async with c.sessions["admin"].put(
                c.base + "/api/v1/namespaces/default/configmaps/big", data=body(),
                headers={"Content-Type": "application/octet-stream"}) as resp:
            answer = await resp.json()
        assert answer == {"size": BODY, "sha256": expected.hexdigest()}

        growth = peak_rss() - before
        assert growth < ALLOWED_GROWTH, f"peak RSS grew by {growth // 2**20} MiB"
