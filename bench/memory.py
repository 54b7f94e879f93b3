#!/usr/bin/env python3
"""Memory that mvproxy holds per idle connection and per open watch.

Starts, on 127.0.0.1 only, a small TLS backend (aiohttp, in a child process: it
answers any GET with a 453-byte ConfigMap and holds ``?watch=true`` streams open
after one event) and ``mvproxy run`` in front of it. Then, from this process:

1. ``--connections`` mTLS connections that each send one GET and stay open, idle;
2. as many watches (one connection each, one event received, then quiet);
3. ``--stalled`` watches whose backend streams events without pause while their
   clients (4 KiB receive buffer) never read: memory held per stalled stream; then the
   clients abandon them (abort) and the RSS left afterwards is compared with where it
   started (is every ended connection freed by reference counting alone?).

After each step it waits for the daemon's RSS (``/proc/<pid>/status`` VmRSS) to
settle and prints the growth per connection and per watch, the daemon's CPU while
everything sat idle for ``--idle`` seconds, and the RSS after everything closed (is
memory returned?). Writes the numbers as JSON next to this file. Every process it
starts is stopped by PID; every wait is bounded.

    .venv/bin/python bench/memory.py [--connections 2000] [--idle 5] [--stalled 300]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from mvproxy import devpki

HERE = Path(__file__).resolve().parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CONFIGMAP = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
    "name": "bench", "namespace": "default", "uid": "0" * 36, "resourceVersion": "1",
    "creationTimestamp": "2026-01-01T00:00:00Z"}, "data": {"k": "v" * 250}}).encode()

BACKEND = r'''
import asyncio, json, ssl, sys
from aiohttp import web
body = sys.stdin.buffer.read()
ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
ctx.load_cert_chain(sys.argv[2], sys.argv[3])
EVENT = b'{"type":"MODIFIED","object":{"kind":"Pod","data":"' + b"x" * 4000 + b'"}}\n'
async def flood(request):
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    try:
        for _ in range(16384):  # 64 MiB at most: far beyond what any buffer holds
            await response.write(EVENT)
    except ConnectionError:  # the client abandoned the stream
        pass
    return response
async def handle(request):
    if request.path == "/api/v1/pods":
        return await flood(request)
    if request.query.get("watch") == "true":
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"type":"ADDED","object":{}}\n')
        await asyncio.sleep(3600)
        return response
    if request.path in ("/api", "/apis"):
        kind = "APIGroupDiscoveryList"
        doc = {"kind": kind, "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}, "items": []}
        return web.Response(body=json.dumps(doc).encode(), headers={
            "Content-Type": "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"})
    return web.Response(body=body, content_type="application/json")
app = web.Application()
app.router.add_route("*", "/{tail:.*}", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), ssl_context=ctx, print=None,
            access_log=None)
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


async def settled_rss(pid: int, timeout: float = 10.0) -> int:
    """RSS once two readings 0.5 s apart agree within 1 % (or after ``timeout``)."""
    last = rss_kib(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = rss_kib(pid)
        if abs(now - last) <= max(64, last // 100):
            return now
        last = now
    return last


async def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port}")


async def open_idle(port: int, ctx: ssl.SSLContext, path: str, count: int):
    """``count`` connections that each sent one request and read its first bytes."""
    request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").encode()
    held, sem = [], asyncio.Semaphore(64)

    async def one() -> None:
        async with sem:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1"), 30)
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            if b" 200 " not in head.split(b"\r\n", 1)[0]:
                raise SystemExit(f"unexpected answer: {head[:80]!r}")
            await asyncio.wait_for(reader.read(1), 30)
            held.append(writer)

    await asyncio.gather(*(one() for _ in range(count)))
    return held


class _Stalled(asyncio.Protocol):
    """A client that sends its request and then never reads (a 4 KiB receive buffer,
    and reading paused from the first byte on)."""

    def __init__(self, request: bytes, first: asyncio.Future):
        self.request, self.first = request, first

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.transport.pause_reading()  # type: ignore[attr-defined]
        # ... and the TLS layer stops reading from the socket soon after.
        self.transport.set_read_buffer_limits(high=16384)  # type: ignore[attr-defined]
        if not self.first.done():
            self.first.set_result(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.first.done():
            self.first.set_exception(ConnectionError("closed before any answer"))


async def open_stalled(port: int, ctx: ssl.SSLContext, path: str, count: int) -> list:
    """``count`` streams whose response started and whose clients then stopped reading."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    loop = asyncio.get_running_loop()
    held, sem = [], asyncio.Semaphore(32)

    async def one() -> None:
        async with sem:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
            first = loop.create_future()
            transport, _ = await asyncio.wait_for(loop.create_connection(
                lambda: _Stalled(request, first), sock=sock, ssl=ctx,
                server_hostname="127.0.0.1"), 30)
            data = await asyncio.wait_for(first, 30)
            if b" 200 " not in data.split(b"\r\n", 1)[0]:
                raise SystemExit(f"unexpected answer: {data[:80]!r}")
            held.append(transport)

    await asyncio.gather(*(one() for _ in range(count)))
    return held


async def stalled_then_abandoned(pid: int, port: int, ctx: ssl.SSLContext, count: int) -> dict:
    """RSS before, while ``count`` streams are stalled, and after their clients left."""
    start = await settled_rss(pid)
    streams = await open_stalled(port, ctx, "/api/v1/pods?watch=true", count)
    await asyncio.sleep(2)  # let every buffer between backend and client fill
    stalled = await settled_rss(pid)
    for transport in streams:
        transport.abort()
    await asyncio.sleep(4)  # the daemon returns freed memory ~2 s after a large drop
    after = await settled_rss(pid)
    return {"stalled_streams": count, "rss_before_stalled_kib": start,
            "per_stalled_stream_kib": round((stalled - start) / count, 1),
            "rss_after_abandoned_kib": after,
            "rss_after_abandoned_vs_before": round(after / start, 3)}


def measure(args: argparse.Namespace, root: Path) -> dict:
    """Start a backend and mvproxy, measure them (``_measure``), stop them. Starting and
    stopping processes blocks, so it happens here, outside the event loop."""
    devpki.init_pki(root / "pki", ["a"], days=2)
    p = root / "pki"
    backend_port, port, admin = free_port(), free_port(), free_port()
    config = {
        **devpki.sidecar_config(p, f"https://127.0.0.1:{backend_port}", port, admin),
        "listener": {"idleTimeout": "1h",
                     "maxConnections": 4 * max(args.connections, args.stalled) + 100},
    }
    (root / "mvproxy.yaml").write_text(yaml.safe_dump(config))
    procs: list[subprocess.Popen] = []
    try:
        backend = subprocess.Popen(
            [sys.executable, "-c", BACKEND, str(backend_port), str(p / "a" / "apiserver.crt"),
             str(p / "a" / "apiserver.key")], stdin=subprocess.PIPE)
        procs.append(backend)
        backend.stdin.write(CONFIGMAP)  # type: ignore[union-attr]
        backend.stdin.close()  # type: ignore[union-attr]
        daemon = subprocess.Popen([sys.executable, "-m", "mvproxy", "run", "--config",
                                   str(root / "mvproxy.yaml"), "-v", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(daemon)
        ctx = ssl.create_default_context(cafile=str(p / "ca.crt"))
        ctx.load_cert_chain(p / "admin.crt", p / "admin.key")
        return asyncio.run(_measure(args, daemon.pid, ctx, backend_port, port))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def _measure(args: argparse.Namespace, pid: int, ctx: ssl.SSLContext,
                   backend_port: int, port: int) -> dict:
    await wait_port(backend_port)
    await wait_port(port)
    await open_idle(port, ctx, "/api/v1/namespaces/default/configmaps/bench", 50)  # warm-up
    base = await settled_rss(pid)
    idle = await open_idle(port, ctx, "/api/v1/namespaces/default/configmaps/bench",
                           args.connections)
    with_idle = await settled_rss(pid)
    watches = await open_idle(port, ctx, "/api/v1/configmaps?watch=true", args.connections)
    with_watches = await settled_rss(pid)
    cpu_before = cpu_seconds(pid)
    await asyncio.sleep(args.idle)
    idle_cpu = (cpu_seconds(pid) - cpu_before) / args.idle
    for writer in idle + watches:
        writer.close()
    await asyncio.sleep(4)  # the daemon returns freed memory ~2 s after a large drop
    after = await settled_rss(pid)
    n = args.connections
    stalled = await stalled_then_abandoned(pid, port, ctx, args.stalled) if args.stalled else {}
    return {
        "connections": n, "baseline_rss_kib": base,
        "per_idle_connection_kib": round((with_idle - base) / n, 1),
        "per_watch_kib": round((with_watches - with_idle) / n, 1),
        "projected_10000_watches_mib": round(((with_watches - with_idle) / n * 10000) / 1024),
        "idle_cpu_percent": round(idle_cpu * 100, 2),
        "rss_after_close_kib": after,
        **stalled,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--idle", type=float, default=5.0)
    parser.add_argument("--stalled", type=int, default=300,
                        help="stalled, then abandoned streams (0: skip)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 3 * args.connections + 100:
        raise SystemExit(f"the open-file limit ({hard}) is too low for {args.connections}")
    with tempfile.TemporaryDirectory(prefix="mvproxy-bench-memory-") as tmp:
        result = measure(args, Path(tmp))
    print(f"{'measure':34} value")
    for key, value in result.items():
        print(f"{key:34} {value}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "memory.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
