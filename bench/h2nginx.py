#!/usr/bin/env python3
"""nginx with HTTP/2 on, as the record an HTTP/2 mvproxy will be compared against.

    python3 bench/h2nginx.py [--rounds 3] [--duration 10]

Issue 23 asks for a small GET over HTTP/2 at 1 connection × 100 streams and 32
connections × 10 streams, CPU per request against nginx with ``http2`` on. This is
nginx's half of that: ``bench/run.py``'s nginx reverse proxy (its config writer, PKI
and backend, mTLS on both legs, HTTP/1.1 keep-alive pool to the backend) with h2
offered in ALPN, loaded by h2load (Debian's ``nghttp2-client``, installed here like
run.py's tools) with the admin client certificate through run.py's
``clientcert_shim.c``, and in the same rounds by wrk over HTTP/1.1 at 32 connections (run.py's
small GET) for the ratio. nginx runs alone on CPU 0, h2load or wrk and the backend
on CPU 1; CPU is utime + stime of nginx's processes from /proc, as in run.py. Rounds
alternate the order; medians (min–max). Writes ``bench/results/h2nginx.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path

import run  # bench/ is on sys.path when this file runs as a script

HERE = Path(__file__).resolve().parent
TOOLS = (("nginx", "nginx-light"), ("h2load", "nghttp2-client"), ("wrk", "wrk"), ("gcc", "gcc"))
LOADS = (("h2 1 × 100", 1, 100), ("h2 32 × 10", 32, 10), ("HTTP/1.1 32 (wrk)", 32, 0))


def h2load(shim: Path, pki: Path, url: str, connections: int, streams: int,
           seconds: float) -> dict:
    """One h2load run: requests done and succeeded, and its own timing."""
    argv = ["h2load", "-D", f"{seconds:g}", "-c", str(connections), "-m", str(streams),
            "-t", "1", "-H", "accept: application/json", url]
    env = {**os.environ, "LD_PRELOAD": str(shim), "BENCH_CLIENT_CERT": str(pki / "admin.crt"),
           "BENCH_CLIENT_KEY": str(pki / "admin.key")}
    done = subprocess.run(argv, capture_output=True, text=True, env=env,
                          preexec_fn=run.pin(run.LOAD_CPU), timeout=seconds + 60)
    out = done.stdout
    counts = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                       r"(\d+) failed, (\d+) errored, (\d+) timeout", out)
    finished = re.search(r"finished in ([\d.]+)(m?s)", out)
    protocol = re.search(r"Application protocol: (\S+)", out)
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+(\S+)", out)
    if done.returncode != 0 or not counts or not finished:
        raise SystemExit(f"bench: h2load failed on {url}: {out[-800:]} {done.stderr[-500:]}")
    elapsed = float(finished.group(1)) / (1000 if finished.group(2) == "ms" else 1)
    total, _, requests, succeeded = (int(counts.group(i)) for i in range(1, 5))
    return {"requests": requests, "succeeded": succeeded, "seconds": elapsed,
            "errors": requests - succeeded + int(counts.group(6)) + int(counts.group(7)),
            "protocol": protocol.group(1) if protocol else "?",
            "mean_request": mean.group(1) if mean else "?"}


def measure(load: tuple[str, int, int], bench: run.Bench, url: str, pids: list[int],
            duration: float, warmup: float) -> dict:
    name, connections, streams = load
    if streams:
        h2load(bench.shim, bench.pki, url, connections, streams, warmup)
        before = run.cpu_seconds(pids)
        got = h2load(bench.shim, bench.pki, url, connections, streams, duration)
        cpu = run.cpu_seconds(pids) - before
        if got["protocol"] != "h2":
            raise SystemExit(f"bench: h2load spoke {got['protocol']}, not h2")
        requests, rps, errors = max(1, got["succeeded"]), got["succeeded"] / got["seconds"], \
            got["errors"]
        detail = f"mean request {got['mean_request']}"
    else:
        bench.wrk(url, connections, warmup, [])
        before = run.cpu_seconds(pids)
        result = bench.wrk(url, connections, duration, [])
        cpu = run.cpu_seconds(pids) - before
        requests = max(1, result["requests"])
        rps = requests / (result["duration_us"] / 1e6)
        errors = sum(result[k] for k in ("connect_errors", "read_errors", "write_errors",
                                         "status_errors", "timeouts"))
        detail = f"p50 {result['p50_us'] / 1e3:.2f} ms, p99 {result['p99_us'] / 1e3:.2f} ms"
    row = {"load": name, "rps": rps, "cpu_us": cpu / requests * 1e6, "errors": errors,
           "detail": detail}
    print(f"  {name:18} {rps:9.0f} req/s {row['cpu_us']:6.1f} µs/req  errors {errors}  "
          f"{detail}", flush=True)
    return row


def run_all(args: argparse.Namespace, work: Path) -> dict:
    sys.path.insert(0, str(run.ROOT))
    from mvproxy import devpki

    run.ensure_tools(TOOLS)
    work.chmod(0o755)  # nginx's workers drop to an unprivileged user and read the files
    shim = run.build_shim(work)
    pki = work / "pki"
    devpki.init_pki(pki, ["a"], days=2)
    roots = run.write_roots(work)
    ports = {k: run.free_port() for k in ("a", "b", "static", "nginx")}
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    procs = run.Processes()
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    try:
        procs.start([nginx, "-c", str(run.backend_conf(work, pki, roots, ports))],
                    run.LOAD_CPU, work / "backend.log")
        proxy = procs.start([nginx, "-c", str(run.proxy_conf(work, pki, ports, http2=True))],
                            run.PROXY_CPU, work / "nginx-proxy.log")
        url = f"https://127.0.0.1:{ports['nginx']}{run.CM_PATH}"
        run.wait_ready(url, ctx)
        pids = run.group_pids(proxy.pid)
        bench = run.Bench(work, shim, pki, args.duration, args.warmup)
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in LOADS}
        for round_ in range(1, args.rounds + 1):
            print(f"round {round_}", flush=True)
            for load in LOADS if round_ % 2 else reversed(LOADS):
                runs[load[0]].append(measure(load, bench, url, pids, args.duration,
                                             args.warmup))
        version = subprocess.run([nginx, "-v"], capture_output=True, text=True,
                                 timeout=30).stderr.strip()
        h2load_version = subprocess.run(["h2load", "--version"], capture_output=True,
                                        text=True, timeout=30).stdout.strip()
    finally:
        procs.stop()
    reference = runs[LOADS[-1][0]]
    rows = []
    for name, rounds in runs.items():
        ratio = [ref["cpu_us"] / mine["cpu_us"] for ref, mine in zip(reference, rounds,
                                                                     strict=True)]
        rows.append({"load": name, "rounds": len(rounds),
                     "rps": span([r["rps"] for r in rounds]),
                     "cpu_us": span([r["cpu_us"] for r in rounds]),
                     "cpu_efficiency_vs_http1": span(ratio),
                     "errors": sum(r["errors"] for r in rounds),
                     "details": [r["detail"] for r in rounds]})
    return {"rows": rows, "nginx": version, "h2load": h2load_version,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": run.machine()}


def span(values: list[float]) -> list[float]:
    return [statistics.median(values), min(values), max(values)]


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"{result['when']}, {m.get('model', '?')}, {m['cpus']} vCPUs, kernel "
             f"{m['kernel']}; load average {result['load_before']} before, "
             f"{result['load_after']} after; {result['nginx']}, {result['h2load']}; "
             f"medians of {result['rows'][0]['rounds']} rounds (min–max).", "",
             "| nginx, small GET (453 B), mTLS in, HTTP/1.1 pool out | req/s | CPU µs/req "
             "| CPU efficiency × its HTTP/1.1 | errors |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        def fmt(m: list[float], f: str) -> str:
            return f"{m[0]:{f}} ({m[1]:{f}}–{m[2]:{f}})"
        lines.append(f"| {row['load']} | {fmt(row['rps'], '.0f')} | "
                     f"{fmt(row['cpu_us'], '.1f')} | "
                     f"{fmt(row['cpu_efficiency_vs_http1'], '.2f')} | {row['errors']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s: a smoke test")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 3.0, 1.0
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench: needs two CPUs (the proxy alone on one)")
    result = run.bounded_run(args, "mvproxy-h2nginx-", run_all)
    result["table"] = render(result)
    print("\n" + result["table"])
    if not args.quick:
        out = HERE / "results"
        out.mkdir(exist_ok=True)
        (out / "h2nginx.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {out / 'h2nginx.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
