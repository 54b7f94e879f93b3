"""Clients that ask for a large merged OpenAPI v3 document and stop reading do not
each pin a copy of it.

``/openapi/v3/apis/<g>/<v>`` of a group/version the backend serves while a peer serves
more of it is merged by mvproxy (``handlers.Proxy._openapi_document``): megabytes for a
real group (core v1 of 1.36 is ~1.5 MB). Handed to the connection whole, each such
answer sat in the TLS layer, encrypted, for as long as its client did not read: any
client allowed to read OpenAPI could pin one document per connection. Here ``CLIENTS``
clients with 4 KiB receive buffers ask for a ~4 MiB merged document and stop reading;
the daemon, the fake upstreams and the clients all run in this process, so
``tracemalloc``'s traced memory, taken once every client is stalled, bounds what the
daemon holds for them (Python allocations only: the document and its pieces are Python
bytes wherever they are held; OpenSSL's own buffers are not traced, and are bounded by
the same pieces). The bound is a memory bound, not a timing one.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import tracemalloc
from asyncio.sslproto import SSLProtocol

from aiohttp import web
from daemon_support import Cluster, cluster, ready
from reliability import record
from test_discovery_daemon import (
    OPENAPI_WIDGETS,
    WIDGETS,
    WIDGETS_V1,
    _group,
    _with_sprockets,
    kube_like_resource_list,
)

from mvproxy import discovery, openapi
from mvproxy.discoveryhandler import SharedDocuments
from mvproxy.listener import DownstreamConnection

CLIENTS = 20
DOCUMENT = 4 * 1024 * 1024
"""About the size of the merged document: a real core v1 is ~1.5 MB, CRD groups more."""
PER_CLIENT = 2 * SSLProtocol.max_size + 256 * 1024
"""What one stalled client may cost beyond the shared document: asyncio's TLS layer
reads into a buffer of ``max_size`` (256 KiB) per connection, on its end and on the
daemon's (uvloop's is outside Python's heap); then its connection, exchange and task
and the pieces in its TLS layer (measured: ~80 KiB; a copy of the document is 4 MiB)."""


def _document(resources: list[str]) -> bytes:
    """An OpenAPI v3 document of widgets v1 with ``resources``, padded to ``DOCUMENT``
    by schemas the backend and the peer share (as real ones share most of theirs)."""
    filler = {f"io.example.Filler{i}": {"description": "x" * 4000, "type": "object"}
              for i in range(DOCUMENT // 4050)}
    return json.dumps({
        "openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.35.4"},
        "paths": {f"{WIDGETS_V1}/{r}": {"get": {"responses": {"200": {"content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{r}List"}}}}}}}
            for r in resources},
        "components": {"schemas": {**filler, **{f"{r}List": {"type": "object"}
                                                for r in resources}}}}).encode()


def big_openapi(resources: list[str]):
    body = _document(resources)  # made before tracing starts: the fakes add nothing

    def routes(app: web.Application) -> None:
        async def document(request: web.Request) -> web.Response:
            if "X-Remote-User" not in request.headers:
                return web.Response(status=401)
            return web.Response(body=body, content_type="application/json")

        app.router.add_get(OPENAPI_WIDGETS, document)
        kube_like_resource_list(app)
    return routes


def big_openapi_cluster(aiohttp_server, root):
    return cluster(aiohttp_server, root, backend_routes=big_openapi(["widgets"]),
                   peer_routes=big_openapi(["widgets", "sprockets"]),
                   backend_groups=[_group(WIDGETS, "v1")],
                   peer_groups=[_with_sprockets(_group(WIDGETS, "v1"))],
                   # No poll while memory is measured: each would replace a snapshot
                   # (allocated while traced, the one it replaces was not).
                   pollInterval="60s", staleAfter="120s")


REQUEST = (f"GET {OPENAPI_WIDGETS} HTTP/1.1\r\nHost: mvproxy\r\n"
           "Accept: application/json\r\n\r\n").encode()


async def stalled_client(c: Cluster) -> tuple[asyncio.StreamWriter, DownstreamConnection]:
    """A client with a 4 KiB receive buffer that asks for the merged document and reads
    nothing; returned once the daemon's side of it has started answering and is
    waiting for it to read."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", c.port))
    _, writer = await asyncio.open_connection(sock=sock, ssl=c.contexts["admin"],
                                              server_hostname="127.0.0.1")
    writer.transport.pause_reading()
    writer.write(REQUEST)
    address = writer.get_extra_info("sockname")
    found: list[DownstreamConnection] = []

    def answered() -> bool:  # the answer reached the client's socket (unread)
        try:
            return bool(sock.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            return False

    async def stalled() -> bool:
        found[:] = [conn for conn in gc.get_objects()
                    if isinstance(conn, DownstreamConnection) and not conn.closing
                    and conn.transport is not None
                    and conn.transport.get_extra_info("peername") == address
                    and conn.writes_behind()]
        return bool(found) and answered()

    await c.until(stalled, "the daemon to answer and wait for the client")
    return writer, found[0]


async def read_whole(c: Cluster) -> bytes:
    status, _, body = await c.get(OPENAPI_WIDGETS, headers={"Accept": "application/json"})
    assert status == 200
    return body


async def test_stalled_clients_of_a_merged_openapi_document_share_one_copy(
        aiohttp_server, root):
    async with big_openapi_cluster(aiohttp_server, root) as c:
        await ready(c)
        merged = await read_whole(c)  # warm: pools, memos, the first merge
        assert {f"{WIDGETS_V1}/widgets", f"{WIDGETS_V1}/sprockets"} <= set(
            json.loads(merged)["paths"])
        assert len(merged) > DOCUMENT * 0.9
        writers: list[asyncio.StreamWriter] = []
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(CLIENTS):
                writer, _ = await stalled_client(c)
                writers.append(writer)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            for writer in writers:
                writer.transport.abort()
        # Those stalled answers were real ones: a client that reads gets it all.
        assert await read_whole(c) == merged
        await asyncio.sleep(0)
    bound = int(len(merged) * 1.5) + CLIENTS * PER_CLIENT
    record("Memory", f"{CLIENTS} clients stall on a {len(merged) >> 20} MiB merged OpenAPI "
                     "document", CLIENTS,
           f"daemon holds {held / 2**20:.1f} MiB for them (bound {bound / 2**20:.1f}; "
           f"a copy each: {CLIENTS * len(merged) / 2**20:.0f})")
    print(f"held {held} bytes for {CLIENTS} stalled clients of a {len(merged)}-byte "
          f"document ({held / CLIENTS:.0f} per client)")
    assert held < bound, (held, bound)



async def test_requests_for_the_same_inputs_share_one_merge(aiohttp_server, root, monkeypatch):
    """A merge is built once per set of inputs (the cache generation, group/version and
    both documents' bytes): again only when an input changes."""
    merges: list[int] = []
    merge = openapi.merge_document

    def counted(*args, **kwargs):
        merges.append(1)
        return merge(*args, **kwargs)
    monkeypatch.setattr(openapi, "merge_document", counted)
    async with big_openapi_cluster(aiohttp_server, root) as c:
        await ready(c)
        first = await read_whole(c)
        assert [await read_whole(c) for _ in range(3)] == [first] * 3
        assert len(merges) == 1
        _, headers, _ = await c.get(OPENAPI_WIDGETS, headers={"Accept": "application/json"})
        status, _, body = await c.get(OPENAPI_WIDGETS, headers={
            "Accept": "application/json", "If-None-Match": headers["ETag"]})
        assert (status, body) == (304, b"")
        assert len(merges) == 1


def test_shared_documents_are_found_while_held_or_kept_and_per_generation():
    documents = SharedDocuments()
    built: list[str] = []

    def build(name: str):
        def make() -> bytes:
            built.append(name)
            return name.encode() * 10
        return make

    held = documents.get(1, "a", build("a"))
    assert documents.get(1, "a", build("a")) is held and built == ["a"]
    assert held.etag == discovery.etag(b"a" * 10)
    for name in "bcdefg":  # more than SHARED_KEEP: "a" leaves the kept ones...
        documents.get(1, name, build(name))
    assert documents.get(1, "a", build("a")) is held  # ...but is held, so still shared
    assert built == ["a", *"bcdefg"]
    del held
    for name in "hijkl":
        documents.get(1, name, build(name))
    documents.get(1, "a", build("a"))  # neither held nor kept: built again
    assert built.count("a") == 2
    documents.get(2, "l", build("l"))  # a new generation: nothing of the old one
    assert built.count("l") == 2
