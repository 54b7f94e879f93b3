#!/usr/bin/env python3
"""The pure core, pure Python against mypyc-compiled: where a small GET's CPU goes, and
what compiling each module buys (issue 22, "Then compile the hot path").

    .venv/bin/python bench/compiled.py [--requests 2000] [--seconds 0.3] [--rounds 3]

1. **Profile** (pure Python, ``MVPROXY_PURE=1``): the assembled daemon in this process,
   between a fake kube-apiserver (aiohttp, mTLS, 1.35 discovery, a 453-byte ConfigMap)
   and a keep-alive mTLS client on 127.0.0.1, serves ``--requests`` small GETs under
   cProfile. Per mvproxy module: calls per request and own CPU time per request (the
   profiler's overhead inflates both alike; the shares are what counts).
2. **Microbenchmarks**: the hot functions of each compiled-candidate module on the
   inputs a small GET gives them, timed in fresh interpreters with ``MVPROXY_PURE=1``
   and compiled (the modules ``mvproxy.compiled`` names, as the development venv
   builds them), in alternating rounds; each case keeps its best round.

Prints both tables with the date and the machine and writes
``bench/results/compiled.json``. Loopback only; bounded; every server it starts is
stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import platform
import pstats
import random
import subprocess
import sys
import tempfile
import time
import timeit
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "compiled.json"
TARGET = "/api/v1/namespaces/default/configmaps/bench"
CONFIGMAP = json.dumps({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {
    "name": "bench", "namespace": "default", "uid": "6c2a4f4e-0000-4000-8000-000000000000",
    "resourceVersion": "12345", "creationTimestamp": "2026-01-01T00:00:00Z"},
    "data": {"key": "x" * 200}}).encode()


# --------------------------------------------------------------------------- profile


async def _profile(requests: int) -> dict:
    from aiohttp import web

    from mvproxy import devpki, tls
    from mvproxy.app import build_daemon, running
    from mvproxy.configfile import load_config
    from mvproxy.devcluster.catalog import load_catalog
    from mvproxy.devcluster.discoverydocs import aggregated
    from mvproxy.devcluster.launcher import free_port

    with tempfile.TemporaryDirectory(prefix="mvproxy-bench-") as tmp:
        root = Path(tmp) / "pki"
        devpki.init_pki(root, ["a"], days=1)
        catalog = load_catalog("1.35")
        docs = {"/api": json.dumps(aggregated(catalog, core=True)).encode(),
                "/apis": json.dumps(aggregated(catalog, core=False)).encode()}

        async def discovery(request: web.Request) -> web.Response:
            return web.Response(body=docs[request.path], content_type="application/json")

        async def configmap(request: web.Request) -> web.Response:
            return web.Response(body=CONFIGMAP, content_type="application/json")

        app = web.Application()
        app.router.add_get("/api", discovery)
        app.router.add_get("/apis", discovery)
        app.router.add_get(TARGET, configmap)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        backend_port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", backend_port, ssl_context=tls.server_context(
            root / "a" / "apiserver.crt", root / "a" / "apiserver.key",
            root / "front-proxy-ca.crt"))
        await site.start()
        front = root / "a" / "front-proxy-client"
        overrides = {
            "serverID": "apiserver-a", "bindAddress": "127.0.0.1", "securePort": free_port(),
            "tlsCertFile": str(root / "a" / "mvproxy.crt"),
            "tlsPrivateKeyFile": str(root / "a" / "mvproxy.key"),
            "clientCAFile": str(root / "ca.crt"), "backend.caFile": str(root / "ca.crt"),
            "backend.certFile": f"{front}.crt", "backend.keyFile": f"{front}.key",
            "peer.caFile": str(root / "ca.crt"),
            "peer.clientCAFile": str(root / "front-proxy-ca.crt"),
            "peer.certFile": f"{front}.crt", "peer.keyFile": f"{front}.key",
            "backend.url": f"https://127.0.0.1:{backend_port}", "peers.static": [],
            "admin.bindAddress": "127.0.0.1", "admin.port": 0,
        }
        daemon = build_daemon(load_config(None, overrides=overrides), rng=random.Random(7))
        try:
            async with running(daemon) as (port, _admin):
                ctx = tls.client_context(root / "ca.crt", root / "admin.crt",
                                         root / "admin.key")
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
                request = (f"GET {TARGET} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           "Accept: application/json\r\nUser-Agent: bench\r\n\r\n").encode()

                async def one() -> int:
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:"))
                    await reader.readexactly(length)
                    return int(head.split(b" ", 2)[1])

                async with asyncio.timeout(60):
                    for _ in range(200):  # warm: the pool, the discovery sync, memos
                        assert await one() == 200
                    profiler = cProfile.Profile()
                    profiler.enable()
                    for _ in range(requests):
                        await one()
                    profiler.disable()
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        finally:
            await runner.cleanup()
    return _per_module(pstats.Stats(profiler), requests)


def _per_module(stats: pstats.Stats, requests: int) -> dict:
    """Calls and own CPU time per request, by mvproxy module, and the top functions."""
    package = str(ROOT / "mvproxy") + os.sep
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    functions = []
    total = 0.0
    for (path, line, name), (_, calls, own, _cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += own
        if not path.startswith(package):
            continue
        module = path[len(package):].removesuffix(".py").replace(os.sep, ".")
        modules[module][0] += calls
        modules[module][1] += own
        functions.append((own, calls, f"{module}.{name}:{line}"))
    functions.sort(reverse=True)
    return {
        "requests": requests,
        "profiled_us_per_request": total / requests * 1e6,
        "modules": {m: {"calls_per_request": c / requests, "own_us_per_request": t / requests
                        * 1e6} for m, (c, t) in sorted(modules.items(), key=lambda i: -i[1][1])},
        "top_functions": [{"function": f, "calls_per_request": c / requests,
                           "own_us_per_request": t / requests * 1e6}
                          for t, c, f in functions[:15]],
    }


# --------------------------------------------------------------------------- microbenchmarks


def _cases() -> dict[str, tuple[str, object]]:
    """name -> (module, a no-argument callable): a small GET's calls into the core."""
    from mvproxy import accept, discovery, requestinfo, routing, wire
    from mvproxy.cache import DiscoveryCache
    from mvproxy.devcluster.catalog import load_catalog
    from mvproxy.devcluster.discoverydocs import aggregated

    def snapshot(version: str) -> discovery.Snapshot:
        catalog = load_catalog(version)
        return discovery.Snapshot(aggregated(catalog, core=True)["items"],
                                  aggregated(catalog, core=False)["items"])

    old, new = snapshot("1.35"), snapshot("1.36")
    cache = DiscoveryCache("a", ["b"], stale_after=60, forget_after=600)
    cache.record_success("a", old)
    cache.record_success("b", new)
    view = cache.view()
    get = requestinfo.parse_request_info("GET", TARGET)
    podgroups = requestinfo.parse_request_info(
        "GET", "/apis/scheduling.k8s.io/v1alpha2/namespaces/ns/podgroups")
    rng = random.Random(7)
    fields = [("Content-Type", "application/json"), ("Audit-Id", "0b0c3f3e-aaaa"),
              ("Cache-Control", "no-cache, private"), ("Date", "Wed, 02 Dec 2026 07:00:00 GMT"),
              ("X-Kubernetes-Pf-Flowschema-Uid", "4e1b"), ("Content-Length", "453")]
    upstream = [("Accept", "application/json"), ("User-Agent", "kubectl/v1.36.0"),
                ("X-Remote-User", "admin"), ("X-Remote-Group", "system:masters"),
                ("X-Remote-Group", "system:authenticated"), ("Audit-Id", "0b0c3f3e-aaaa")]
    raw = [(n.encode(), v.encode()) for n, v in fields] + [(b"Connection", b"keep-alive")]
    lowered = [n.lower() for n, _ in raw]
    table = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
    groups = discovery.merge({"a": old, "b": new}).groups
    return {
        "requestinfo.parse_request_info (GET one)": (
            "requestinfo", lambda: requestinfo.parse_request_info("GET", TARGET)),
        "requestinfo.parse_request_info (LIST, query)": (
            "requestinfo", lambda: requestinfo.parse_request_info(
                "GET", "/apis/apps/v1/namespaces/default/deployments",
                "limit=500&labelSelector=app%3Dweb&resourceVersion=0")),
        "routing.decide (local)": ("routing", lambda: routing.decide(
            get, view, peer_proxied=False, credentials=True, rng=rng)),
        "routing.decide (peer-only)": ("routing", lambda: routing.decide(
            podgroups, view, peer_proxied=False, credentials=True, rng=rng)),
        "wire.response_head (6 fields)": (
            "wire", lambda: wire.response_head(200, "OK", fields)),
        "wire.request_head (6 fields)": (
            "wire", lambda: wire.request_head("GET", TARGET, "127.0.0.1:6443", upstream)),
        "wire.raw_lines (relayed head)": (
            "wire", lambda: wire.raw_lines(raw, lowered, wire.HOP_BY_HOP_RAW)),
        "accept.parse_accept (Table)": ("accept", lambda: accept.parse_accept(table)),
        "discovery.merge (1.35 + 1.36)": (
            "discovery", lambda: discovery.merge({"a": old, "b": new})),
        "discovery.render_aggregated (merged /apis)": (
            "discovery", lambda: discovery.render_aggregated(groups)),
    }


def _time_cases(seconds: float) -> dict[str, dict]:
    """ns per call of each case (best of 5 runs of about ``seconds`` each)."""
    from mvproxy import compiled

    out = {}
    for name, (module, call) in _cases().items():
        timer = timeit.Timer(call)  # type: ignore[arg-type]
        number, _ = timer.autorange()
        number = max(1, int(number * seconds / 0.2))
        best = min(timer.repeat(repeat=5, number=number)) / number
        out[name] = {"module": module, "ns": best * 1e9}
    return {"compiled": list(compiled.in_use()), "cases": out}


def _child(mode: str, seconds: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MVPROXY_PURE"}
    if mode == "pure":
        env["MVPROXY_PURE"] = "1"
    done = subprocess.run([sys.executable, __file__, "--child", "micro", "--seconds",
                           str(seconds)], env=env, capture_output=True, text=True,
                          check=True, timeout=600, cwd=ROOT)
    result: dict = json.loads(done.stdout)
    return result


def _best(results: list[dict]) -> dict:
    """One mode's rounds as one result: each case's fastest round."""
    cases = {name: {**case, "ns": min(r["cases"][name]["ns"] for r in results)}
             for name, case in results[0]["cases"].items()}
    return {"compiled": results[0]["compiled"], "cases": cases}


# --------------------------------------------------------------------------- report


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()} CPUs, {cpu}, {platform.system()} {platform.release()}, "
            f"CPython {platform.python_version()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="about how long each microbenchmark run takes")
    parser.add_argument("--rounds", type=int, default=3,
                        help="microbenchmark rounds, alternating pure and compiled")
    parser.add_argument("--child", choices=["micro", "profile"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "micro":
        print(json.dumps(_time_cases(args.seconds)))
        return 0
    if args.child == "profile":
        print(json.dumps(asyncio.run(_profile(args.requests))))
        return 0
    env = {**os.environ, "MVPROXY_PURE": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", "profile", "--requests",
                           str(args.requests)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    if done.returncode:
        sys.stderr.write(done.stderr)
        return done.returncode
    profile = json.loads(done.stdout)
    # Rounds alternate the two modes and each case keeps its best: on a shared machine
    # the other processes' load comes and goes, and the minimum is the least disturbed.
    runs: dict[str, list[dict]] = {"pure": [], "compiled": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(_child(mode, args.seconds))
    pure, fast = (_best(runs[mode]) for mode in ("pure", "compiled"))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"# bench/compiled.py, {when}; {machine()}")
    print(f"\n## Profile: {profile['requests']} small GETs, pure Python, under cProfile "
          f"({profile['profiled_us_per_request']:.0f} µs/req profiled, whole process)\n")
    print("| module | calls/req | own µs/req | share of mvproxy |")
    print("|---|---|---|---|")
    ours = sum(m["own_us_per_request"] for m in profile["modules"].values())
    for name, m in profile["modules"].items():
        print(f"| {name} | {m['calls_per_request']:.1f} | {m['own_us_per_request']:.1f} | "
              f"{m['own_us_per_request'] / ours:.0%} |")
    print(f"\n## Microbenchmarks: ns per call, best of {args.rounds} alternating rounds "
          "of 5 runs\n")
    print(f"compiled: {', '.join(fast['compiled']) or 'nothing (no extensions built)'}\n")
    print("| function (input) | pure ns | compiled ns | speed-up |")
    print("|---|---|---|---|")
    rows = []
    for name, case in pure["cases"].items():
        compiled_ns = fast["cases"][name]["ns"]
        rows.append({"case": name, "module": case["module"], "pure_ns": case["ns"],
                     "compiled_ns": compiled_ns, "speedup": case["ns"] / compiled_ns})
        print(f"| {name} | {case['ns']:.0f} | {compiled_ns:.0f} | "
              f"{case['ns'] / compiled_ns:.2f}× |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"date": when, "machine": machine(), "rounds": args.rounds,
                                   "profile": profile,
                                   "compiled": fast["compiled"], "micro": rows},
                                  indent=2) + "\n")
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
