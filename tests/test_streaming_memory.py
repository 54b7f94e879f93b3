"""Memory stays flat with the size of what flows through mvproxy.

A fake backend streams a response far larger than any buffer mvproxy should hold, and
swallows an equally large upload. The daemon, the fake backend and the client all run
in this process, so ``tracemalloc``'s peak of traced memory during one transfer (reset
just before it) bounds what mvproxy held at once: a body buffered whole anywhere would
put the peak at the body size or more. Only Python allocations are traced (bodies
are Python bytes wherever they are held); the bound is a memory bound, not a timing one.
"""

from __future__ import annotations

import hashlib
import tracemalloc

from aiohttp import web
from test_app import cluster, synced

BODY = 64 * 1024 * 1024
CHUNK = 256 * 1024
ALLOWED_PEAK = 16 * 1024 * 1024
"""A quarter of the body: buffering it whole, or even a quarter of it, fails."""
PATH = "/api/v1/namespaces/default/configmaps/big"


def add_streaming_routes(app: web.Application) -> None:
    block = b"x" * CHUNK  # made before tracing starts, so the backend adds nothing

    async def download(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = BODY
        await response.prepare(request)
        for _ in range(BODY // CHUNK):
            await response.write(block)
        return response

    async def upload(request: web.Request) -> web.Response:
        digest, size = hashlib.sha256(), 0
        async for chunk in request.content.iter_chunked(CHUNK):
            digest.update(chunk)
            size += len(chunk)
        return web.json_response({"size": size, "sha256": digest.hexdigest()})

    app.router.add_get(PATH, download)
    app.router.add_put(PATH, upload)


class Peak:
    """Peak traced memory over the ``with`` block, in bytes above what was traced at
    its start (tracing is started for the block unless it already runs)."""

    def __enter__(self) -> Peak:
        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start()
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = tracemalloc.get_traced_memory()[1] - self._base
        if self._started:
            tracemalloc.stop()


async def test_large_bodies_stream_through_with_flat_memory(aiohttp_server, root):
    upload_block = b"y" * CHUNK
    expected = hashlib.sha256()
    for _ in range(BODY // CHUNK):
        expected.update(upload_block)

    async def upload_body():
        for _ in range(BODY // CHUNK):
            yield upload_block

    async with cluster(aiohttp_server, root, backend_routes=add_streaming_routes) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")

        size = 0
        with Peak() as down:
            async with c.sessions["admin"].get(c.base + PATH) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_chunked(CHUNK):
                    size += len(chunk)
        assert size == BODY

        with Peak() as up:
            async with c.sessions["admin"].put(
                    c.base + PATH, data=upload_body(),
                    headers={"Content-Type": "application/octet-stream"}) as resp:
                answer = await resp.json()
        assert answer == {"size": BODY, "sha256": expected.hexdigest()}

        assert down.bytes < ALLOWED_PEAK, f"download peak {down.bytes // 2**20} MiB"
        assert up.bytes < ALLOWED_PEAK, f"upload peak {up.bytes // 2**20} MiB"
