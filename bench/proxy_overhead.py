#!/usr/bin/env python3
"""What mvproxy costs per request, against the direct backend measured in the same run.

Starts a 1.35 and a 1.36 simulated kube-apiserver sharing one store, an mvproxy in
front of each (``devcluster.demo.start_cluster``), then sends the same small GETs
over mTLS with the admin certificate:

- ``direct``: straight to the 1.35 kube-apiserver (the reference);
- ``local``: through its mvproxy, served by its own backend;
- ``peer``: a 1.36-only resource through the 1.35 server's mvproxy, so two mvproxies
  and the 1.36 backend handle it.

For each it prints requests per second, median and p99 latency, the ratio to the
reference, and the CPU time the mvproxy processes spent per request (read from
/proc), which is the number that does not depend on how slow the simulated backend
is. Loopback only; bounded request counts; everything started is stopped.

    .venv/bin/python bench/proxy_overhead.py [--requests 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from mvproxy.devcluster.demo import start_cluster

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def client_ssl(pki: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    return ctx


async def run_load(url: str, ctx: ssl.SSLContext, requests: int, concurrency: int,
                   deadline_s: float) -> tuple[float, list[float]]:
    """Send ``requests`` GETs with ``concurrency`` workers; (wall seconds, latencies)."""
    latencies: list[float] = []
    remaining = iter(range(requests))
    stop_at = time.monotonic() + deadline_s
    connector = aiohttp.TCPConnector(ssl=ctx, limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            for _ in remaining:
                if time.monotonic() > stop_at:
                    return
                started = time.perf_counter()
                async with session.get(url) as response:
                    await response.read()
                    if response.status != 200:
                        raise SystemExit(f"{url}: HTTP {response.status}")
                latencies.append(time.perf_counter() - started)
        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - began, latencies


async def create_objects(base: str, ctx: ssl.SSLContext) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bench"},
          "data": {"k": "v"}}
    pg = {"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
          "metadata": {"name": "bench"}, "spec": {"minMember": 1}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        for path, body in (("/api/v1/namespaces/default/configmaps", cm),
                           ("/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups", pg)):
            async with session.post(base + path, data=json.dumps(body),
                                    headers={"Content-Type": "application/json"}) as response:
                if response.status not in (201, 409):
                    raise SystemExit(f"setup {path}: HTTP {response.status}")


def report(name: str, wall: float, latencies: list[float], cpu: float | None,
           reference_rps: float | None) -> float:
    rps = len(latencies) / wall
    p50 = statistics.median(latencies) * 1e3
    p99 = statistics.quantiles(latencies, n=100)[98] * 1e3
    ratio = f"{rps / reference_rps:5.2f}x" if reference_rps else "  ref"
    per_request = f"{cpu / len(latencies) * 1e6:8.0f}" if cpu is not None else "       -"
    print(f"{name:8} {len(latencies):6d} {rps:9.0f} {ratio:>7} {p50:8.2f} {p99:8.2f} {per_request}")
    return rps


async def measure(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="mvproxy-bench-") as tmp, \
            start_cluster(Path(tmp), versions=("1.35", "1.36"), base_port=0) as cluster:
        old, new = cluster.servers
        ctx = client_ssl(cluster.pki)
        await create_objects(new.backend_url, ctx)
        cm = "/api/v1/namespaces/default/configmaps/bench"
        pg = "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups/bench"
        scenarios = [("direct", old.backend_url + cm, ()),
                     ("local", old.proxy_url + cm, (old.proxy.pid,)),
                     ("peer", old.proxy_url + pg, (old.proxy.pid, new.proxy.pid))]
        print(f"{'route':8} {'count':>6} {'req/s':>9} {'ratio':>7} {'p50 ms':>8} {'p99 ms':>8}"
              f" {'mvproxy CPU µs/req':>8}")
        reference = None
        for name, url, pids in scenarios:
            await run_load(url, ctx, min(200, args.requests), args.concurrency, 30)  # warm up
            before = sum(cpu_seconds(p) for p in pids)
            wall, latencies = await run_load(url, ctx, args.requests, args.concurrency,
                                             args.deadline)
            cpu = sum(cpu_seconds(p) for p in pids) - before if pids else None
            rps = report(name, wall, latencies, cpu, reference)
            reference = reference or rps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--deadline", type=float, default=120.0,
                        help="stop a scenario after this many seconds")
    asyncio.run(measure(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
