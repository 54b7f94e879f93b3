#!/usr/bin/env python3
"""A small GET over HTTP/2 through mvproxy and through nginx with ``http2`` on, same run.

    python3 bench/h2proxy.py [--rounds 3] [--duration 10] [--quick]

Issue 23's end-to-end CPU measurement. On 127.0.0.1 only, with ``bench/run.py``'s
PKI, backend (nginx, static Kubernetes-shaped JSON over mTLS) and config writers:

- **nginx** as the reference reverse proxy, ``http2`` offered in ALPN, mTLS in, a
  keep-alive HTTP/1.1 pool to the backend (``bench/h2nginx.py``'s setup);
- **mvproxy** "a" in front of backend "a" (and "b" beside it, the peer run.py starts),
  ``listener.http2`` at its default (on), its upstream leg HTTP/1.1 (pooled).

Each is loaded with the same three loads of a 453-byte ConfigMap GET: h2load (Debian's
``nghttp2-client``) at 1 connection × 100 streams and at 32 connections × 10 streams,
and wrk over HTTP/1.1 at 32 connections (run.py's small GET) and at 100 (as many
requests in flight as one h2load connection's 100 streams), all with the admin client
certificate through ``clientcert_shim.c``; h2load's negotiated protocol is checked.
The backend's ``stub_status`` counts the connections each load made the proxy open to
it (the upstream pool's churn). The proxy under test runs alone on CPU 0;
the load generator and the backend share CPU 1; CPU per request is utime + stime of the
proxy's processes from /proc, as run.py reads it. Every (proxy, load) pair runs in
every round, the order reversed each round; ratios are taken inside a round (mvproxy
against nginx under the same load; each proxy's HTTP/2 against its own HTTP/1.1) and
the table shows their medians (min–max). Writes ``bench/results/h2proxy.json`` and
``h2proxy.md`` (not with ``--quick``, a smoke test of 1 round of 3 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path

import h2nginx  # bench/ is on sys.path when this file runs as a script
import run

HERE = Path(__file__).resolve().parent
TARGETS = ("nginx", "mvproxy")
POOLED = "mvproxy pool×{}"
LAUNCH_WITH_POOL = """
import runpy, sys
import mvproxy.app as app
made = app.Transport
# the upstream pool's idle cap is a constructor default (64), not a config key: a
# bench-only diagnosis, the pollers' own explicit 2 kept
app.Transport = lambda **kw: made(**{{"max_idle_per_upstream": {idle}, **kw}})
sys.argv = ["mvproxy", *sys.argv[1:]]
runpy.run_module("mvproxy", run_name="__main__", alter_sys=True)
"""
HTTP1 = h2nginx.LOADS[-1][0]
# HTTP/1.1 at the concurrency one h2load connection brings (100 streams): what the
# same number of requests in flight costs without HTTP/2
LOADS = (*h2nginx.LOADS, ("HTTP/1.1 100 (wrk)", 100, 0))


def backend_conf(work: Path, pki: Path, roots: dict[str, Path], ports: dict[str, int]) -> Path:
    """run.py's backend plus nginx's ``stub_status`` on its own port: its ``accepts``
    count is how many connections each proxy opened to the backend during a load."""
    conf = run.backend_conf(work, pki, roots, ports)
    text = conf.read_text().rstrip()
    assert text.endswith("}")
    status = (f"\n    server {{ listen 127.0.0.1:{ports['status']}; "
              "location / { stub_status; } }\n}\n")
    conf.write_text(text[:-1] + status)
    return conf


def backend_accepts(port: int) -> int:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return int(lines[2].split()[0])  # "server accepts handled requests" / "a h r"


def run_all(args: argparse.Namespace, work: Path) -> dict:
    sys.path.insert(0, str(run.ROOT))
    from mvproxy import devpki

    run.ensure_tools(h2nginx.TOOLS)
    work.chmod(0o755)  # nginx's workers drop to an unprivileged user and read the files
    shim = run.build_shim(work)
    pki = work / "pki"
    devpki.init_pki(pki, ["a"], days=2)
    roots = run.write_roots(work)
    ports = {k: run.free_port() for k in ("a", "b", "static", "nginx", "mva", "mvb", "admina",
                                          "adminb", "status")}
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    procs = run.Processes()
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    try:
        procs.start([nginx, "-c", str(backend_conf(work, pki, roots, ports))],
                    run.LOAD_CPU, work / "backend.log")
        proxy = procs.start([nginx, "-c", str(run.proxy_conf(work, pki, ports, http2=True))],
                            run.PROXY_CPU, work / "nginx-proxy.log")
        env = {**os.environ, "PYTHONPATH": str(run.ROOT)}
        mvs = {m: procs.start([sys.executable, "-m", "mvproxy", "run", "--config",
                               str(run.mvproxy_conf(work, pki, m, ports))], run.PROXY_CPU,
                              work / f"mvproxy-{m}.log", env=env)
               for m in ("a", "b")}
        urls = {"nginx": f"https://127.0.0.1:{ports['nginx']}{run.CM_PATH}",
                "mvproxy": f"https://127.0.0.1:{ports['mva']}{run.CM_PATH}"}
        pids = {"nginx": run.group_pids(proxy.pid), "mvproxy": [mvs["a"].pid]}
        targets = list(TARGETS)
        if args.pool_idle:
            # a second mvproxy "a" (its own ports, same backend and peer) whose upstream
            # pool keeps up to --pool-idle idle connections
            pooled = POOLED.format(args.pool_idle)
            extra = {**ports, "mva": run.free_port(), "admina": run.free_port()}
            (work / "pool").mkdir()
            conf = run.mvproxy_conf(work / "pool", pki, "a", extra)
            proc = procs.start([sys.executable, "-c", LAUNCH_WITH_POOL.format(
                idle=args.pool_idle), "run", "--config", str(conf)], run.PROXY_CPU,
                work / "pool" / "mvproxy.log", env=env)
            urls[pooled] = f"https://127.0.0.1:{extra['mva']}{run.CM_PATH}"
            pids[pooled] = [proc.pid]
            targets.append(pooled)
            ports["adminpool"] = extra["admina"]
        for url in urls.values():
            run.wait_ready(url, ctx)
        for admin in ("admina", "adminb", "adminpool"):
            if admin in ports:
                run.wait_ready(f"http://127.0.0.1:{ports[admin]}/readyz", None)
        bench = run.Bench(work, shim, pki, args.duration, args.warmup)
        pairs = [(target, load) for target in targets for load in LOADS]
        runs: dict[tuple[str, str], list[dict]] = {(t, load[0]): [] for t, load in pairs}
        for round_ in range(1, args.rounds + 1):
            print(f"round {round_}", flush=True)
            for target, load in pairs if round_ % 2 else reversed(pairs):
                print(f"  {target:8}", end="", flush=True)
                accepts = backend_accepts(ports["status"])
                row = h2nginx.measure(load, bench, urls[target], pids[target], args.duration,
                                      args.warmup)
                # warm-up included: both runs of the load; pollers add a few
                row["upstream_connections_opened"] = backend_accepts(ports["status"]) - accepts
                print(f"            upstream connections opened: "
                      f"{row['upstream_connections_opened']}", flush=True)
                runs[target, load[0]].append(row)
        profiles = (perf_by_library(args, bench, urls, pids, targets[-1])
                    if args.perf else {})
        versions = {
            "nginx": subprocess.run([nginx, "-v"], capture_output=True, text=True,
                                    timeout=30).stderr.strip(),
            "h2load": subprocess.run(["h2load", "--version"], capture_output=True, text=True,
                                     timeout=30).stdout.strip(),
            "wrk": subprocess.run(["wrk", "-v"], capture_output=True, text=True,
                                  timeout=30).stdout.split("\n", 1)[0].strip()}
    finally:
        procs.stop()
    return {"rows": summarize(runs), "runs": [{"target": t, "load": load, **r}
                                              for (t, load), rs in runs.items() for r in rs],
            "perf": profiles, **versions,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": run.machine(), "rounds": args.rounds, "duration_s": args.duration}


PROFILED = ("h2 1 × 100", "HTTP/1.1 100 (wrk)")


def perf_by_library(args: argparse.Namespace, bench: run.Bench, urls: dict[str, str],
                    pids: dict[str, list[int]], target: str) -> dict[str, dict]:
    """Where ``target``'s CPU goes by library (perf, sampling only its process) under the
    same number of requests in flight over HTTP/2 and over HTTP/1.1: one extra run of
    each after the rounds, so sampling adds nothing to the table's figures."""
    perf = shutil.which("perf")
    if perf is None:
        return {"note": {"perf": "not available"}}
    out: dict[str, dict] = {}
    for load in (load for load in LOADS if load[0] in PROFILED):
        data = bench.work / f"perf-{len(out)}.data"
        recorder = subprocess.Popen([perf, "record", "-F", "999", "-p", str(pids[target][0]),
                                     "-o", str(data), "--", "sleep", f"{args.duration:g}"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"  perf {target:8}", end="", flush=True)
        row = h2nginx.measure(load, bench, urls[target], pids[target], args.duration, 1.0)
        recorder.wait(args.duration + 60)
        report = subprocess.run([perf, "report", "-i", str(data), "--sort", "dso", "--stdio"],
                                capture_output=True, text=True, timeout=120).stdout
        shares = {}
        for line in report.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith("%") and not line.lstrip().startswith("#"):
                shares[parts[1]] = float(parts[0][:-1])
        top = dict(sorted(shares.items(), key=lambda kv: -kv[1])[:8])
        out[load[0]] = {"target": target, "cpu_us": row["cpu_us"], "shares": top,
                        "us_per_request": {lib: round(share / 100 * row["cpu_us"], 1)
                                           for lib, share in top.items()}}
    return out


def span(values: list[float]) -> list[float]:
    return [statistics.median(values), min(values), max(values)]


def summarize(runs: dict[tuple[str, str], list[dict]]) -> list[dict]:
    """One row per (proxy, load): its medians, its CPU against nginx's under the same
    load in the same round, and its CPU against its own HTTP/1.1 in the same round."""
    rows = []
    for (target, load), mine in runs.items():
        ref = runs["nginx", load]
        own_h1 = runs[target, HTTP1]
        rows.append({
            "target": target, "load": load, "rounds": len(mine),
            "rps": span([r["rps"] for r in mine]),
            "cpu_us": span([r["cpu_us"] for r in mine]),
            # nginx's CPU per request / mvproxy's: 1.0 is as cheap as nginx
            "cpu_efficiency_vs_nginx": span([n["cpu_us"] / m["cpu_us"]
                                             for n, m in zip(ref, mine, strict=True)]),
            # this load's CPU per request / the same proxy's over HTTP/1.1: > 1 costs more
            "cpu_vs_own_http1": span([m["cpu_us"] / h["cpu_us"]
                                      for m, h in zip(mine, own_h1, strict=True)]),
            "errors": sum(r["errors"] for r in mine),
            "upstream_connections_opened": span([r["upstream_connections_opened"]
                                                 for r in mine]),
            "details": [r["detail"] for r in mine]})
    return rows


def render(result: dict) -> str:
    m = result["machine"]

    def fmt(v: list[float], f: str) -> str:
        return f"{v[0]:{f}} ({v[1]:{f}}–{v[2]:{f}})"
    lines = [f"{result['when']}, {m.get('model', '?')}, {m['cpus']} vCPUs, kernel "
             f"{m['kernel']}, Python {m['python']}; load average {result['load_before']} "
             f"before, {result['load_after']} after; {result['nginx']}, {result['h2load']}, "
             f"{result['wrk']}; medians of {result['rounds']} rounds of "
             f"{result['duration_s']:g} s (min–max), ratios inside each round.", "",
             "| proxy | load | req/s | CPU µs/req | CPU efficiency × nginx (same load) "
             "| CPU × own HTTP/1.1 (32 conns) | upstream connections opened | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for row in sorted(result["rows"], key=lambda r: (r["load"], r["target"] != "nginx")):
        lines.append(f"| {row['target']} | {row['load']} | {fmt(row['rps'], '.0f')} | "
                     f"{fmt(row['cpu_us'], '.1f')} | "
                     f"{fmt(row['cpu_efficiency_vs_nginx'], '.2f')} | "
                     f"{fmt(row['cpu_vs_own_http1'], '.2f')} | "
                     f"{fmt(row['upstream_connections_opened'], '.0f')} | {row['errors']} |")
    for load, got in result.get("perf", {}).items():
        if "shares" not in got:
            continue
        lines += ["", f"perf, {got['target']}, {load} ({got['cpu_us']:.0f} µs/req, one extra "
                      "run): " + ", ".join(f"{lib} {share:.1f} % ≈ "
                                          f"{got['us_per_request'][lib]:.0f} µs"
                                          for lib, share in got["shares"].items())]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s: a smoke test")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--pool-idle", type=int, default=512,
                        help="also a mvproxy whose upstream pool keeps this many idle "
                             "connections (a bench-only launcher; 0: leave it out)")
    parser.add_argument("--perf", action="store_true",
                        help="then perf by library of the last mvproxy under h2 1 × 100 "
                             "and HTTP/1.1 100")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration, args.warmup = 1, 3.0, 1.0
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench: needs two CPUs (the proxy alone on one)")
    result = run.bounded_run(args, "mvproxy-h2proxy-", run_all)
    result["table"] = render(result)
    print("\n" + result["table"])
    if not args.quick:
        out = HERE / "results"
        out.mkdir(exist_ok=True)
        (out / "h2proxy.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "h2proxy.md").write_text("# HTTP/2 small GET: mvproxy and nginx, same run "
                                        "(bench/h2proxy.py)\n\n" + result["table"] + "\n")
        print(f"\nwrote {out / 'h2proxy.json'} and {out / 'h2proxy.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
