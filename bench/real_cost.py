#!/usr/bin/env python3
"""mvproxy's CPU per request as a share of the real kube-apiserver's, same run (issue
20 §7).

    .venv/bin/python bench/real_cost.py [--rounds 3] [--version 1.36.3] [--quick]

Starts one etcd, one real kube-apiserver and its mvproxy (``realdemo``, on 127.0.0.2;
the binaries from ``python3 scripts/dev.py kube-binaries``) and sends the same client
load twice, straight to kube-apiserver and through mvproxy, with the admin client
certificate over keep-alive mTLS:

- ``get``: GETs of one small ConfigMap (wrk, 16 connections, a fixed request count);
- ``list``: LISTs of a namespace holding 500 ConfigMaps (~300 KiB each answer);
- ``watch``: 10 watches of one ConfigMap while 1,000 updates are written straight to
  kube-apiserver (in both runs), so 10,000 events are delivered per run.

CPU is read from /proc/<pid>/stat (utime + stime, every thread) of kube-apiserver,
etcd and mvproxy around each run, less each process's idle rate measured just before
the round, per request (or per delivered event). The share is mvproxy's CPU divided
by kube-apiserver's, both from the run through mvproxy. Layout, as in bench/run.py:
mvproxy alone on CPU 0; kube-apiserver, etcd (both started there, so Go sees one CPU)
and the load on CPU 1. Rounds alternate which target goes first; the table shows
medians and min–max. Writes ``bench/results/real_cost.json``. Everything it starts is
stopped (also on Ctrl-C); wrk and gcc come from Debian (bench/run.py installs them).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from run import build_shim, cpu_seconds, ensure_tools, group_pids, pin  # noqa: E402

from mvproxy.devcluster.realdemo import start_real_cluster  # noqa: E402

PROXY_CPU, LOAD_CPU = 0, 1
CONNECTIONS = 16
LIST_OBJECTS = 500
WATCHERS = 10
WRITERS = 4
IDLE_SECONDS = 3.0
WRK_LIMIT_S = 600  # a run that has not reached its count by then ends anyway
NS, LIST_NS, WATCH_NS = "bench", "bench-list", "bench-watch"
GET_PATH = f"/api/v1/namespaces/{NS}/configmaps/small"
LIST_PATH = f"/api/v1/namespaces/{LIST_NS}/configmaps"
WATCH_OBJECT = f"/api/v1/namespaces/{WATCH_NS}/configmaps/watched"
PROCESSES = ("kube-apiserver", "etcd", "mvproxy")


@dataclass(frozen=True)
class Counts:
    get: int = 20_000
    list: int = 600
    watch_writes: int = 1_000


QUICK = Counts(get=4_000, list=150, watch_writes=300)


@dataclass
class Run:
    scenario: str
    target: str  # "direct" | "mvproxy"
    round: int
    units: int  # requests answered, or watch events delivered
    seconds: float
    cpu: dict[str, float]  # process -> CPU seconds, idle rate subtracted
    raw_cpu: dict[str, float]
    errors: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    def us_per_unit(self, process: str) -> float:
        return self.cpu[process] / max(1, self.units) * 1e6


# --------------------------------------------------------------------------- processes


def set_affinity(pid: int, cpu: int) -> None:
    """Every thread of ``pid`` onto ``cpu`` (new threads inherit it from theirs)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(task.name), {cpu})


class Meter:
    """CPU seconds of kube-apiserver, etcd and mvproxy (with any children)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def sample(self) -> dict[str, float]:
        return {name: cpu_seconds(group_pids(pid)) for name, pid in self.pids.items()}

    def idle_rates(self, seconds: float = IDLE_SECONDS) -> dict[str, float]:
        before = self.sample()
        time.sleep(seconds)
        after = self.sample()
        return {name: (after[name] - before[name]) / seconds for name in self.pids}


def measured(meter: Meter, idle: dict[str, float], work) -> tuple[Any, float, dict, dict]:
    """Run ``work()``; (its result, wall seconds, CPU less idle, raw CPU)."""
    before, started = meter.sample(), time.monotonic()
    result = work()
    seconds = time.monotonic() - started
    after = meter.sample()
    raw = {name: after[name] - before[name] for name in before}
    cpu = {name: max(0.0, raw[name] - idle[name] * seconds) for name in raw}
    return result, seconds, cpu, raw


# --------------------------------------------------------------------------- clients


def context(pki: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return ctx


def call(url: str, ctx: ssl.SSLContext, method: str, path: str, body: Any = None,
         ctype: str = "application/json") -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPSConnection(parts.hostname, parts.port, context=ctx, timeout=30)
    try:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), ctype
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def configmap(name: str, size: int = 200) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
            "data": {"config.yaml": "x" * size}}


def seed(url: str, ctx: ssl.SSLContext) -> None:
    """The objects the scenarios read: one small ConfigMap, 500 in a namespace of their
    own, and the one the watches follow."""
    for ns in (NS, LIST_NS, WATCH_NS):
        call(url, ctx, "POST", "/api/v1/namespaces",
             {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    call(url, ctx, "POST", f"/api/v1/namespaces/{NS}/configmaps", configmap("small"))
    call(url, ctx, "POST", f"/api/v1/namespaces/{WATCH_NS}/configmaps", configmap("watched", 50))
    names = iter(range(LIST_OBJECTS))
    lock = threading.Lock()

    def create() -> None:
        while True:
            with lock:
                i = next(names, None)
            if i is None:
                return
            status, body = call(url, ctx, "POST", LIST_PATH, configmap(f"cm-{i:04d}"))
            if status not in (201, 409):
                raise SystemExit(f"bench: seeding failed: {status} {body[:200]!r}")

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    status, body = call(url, ctx, "GET", LIST_PATH)
    count = len(json.loads(body)["items"])
    if count != LIST_OBJECTS:
        raise SystemExit(f"bench: expected {LIST_OBJECTS} ConfigMaps, found {count}")


def wrk(url: str, requests: int, shim: Path, pki: Path) -> dict:
    """``requests`` keep-alive GETs of ``url`` by wrk (one thread, 16 connections): its
    thread says when it has them all, then wrk is interrupted, which ends the run and
    prints the report."""
    env = {**os.environ, "LD_PRELOAD": str(shim),
           "BENCH_CLIENT_CERT": str(pki / "admin.crt"), "BENCH_CLIENT_KEY": str(pki / "admin.key"),
           "BENCH_REPORT_LUA": str(HERE / "wrk_report.lua"),
           "BENCH_REQUESTS_PER_THREAD": str(requests)}
    argv = ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{WRK_LIMIT_S}s", "--timeout", "10s",
            "-H", "Accept: application/json", "-s", str(HERE / "wrk_fixed_count.lua"), url]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=pin(LOAD_CPU))
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("BENCH-LIMIT"):
                proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reports = [line for line in lines if line.startswith("{")]
    if not reports:
        raise SystemExit(f"bench: wrk failed on {url}: {''.join(lines)[-400:]}")
    result = json.loads(reports[-1])
    result["errors"] = sum(result[k] for k in ("connect_errors", "read_errors", "write_errors",
                                               "status_errors", "timeouts"))
    return result


def watch_events(watch_url: str, write_url: str, ctx: ssl.SSLContext, writes: int,
                 watchers: int = WATCHERS) -> tuple[int, int]:
    """Open ``watchers`` watches of the watched ConfigMap through ``watch_url``, then
    write it ``writes`` times straight to kube-apiserver; (events delivered, errors)."""
    status, body = call(write_url, ctx, "GET", WATCH_OBJECT)
    rv = json.loads(body)["metadata"]["resourceVersion"]
    parts = urlsplit(watch_url)
    path = (f"/api/v1/namespaces/{WATCH_NS}/configmaps?watch=1&resourceVersion={rv}"
            "&fieldSelector=metadata.name%3Dwatched")
    streams = []
    for _ in range(watchers):
        conn = http.client.HTTPSConnection(parts.hostname, parts.port, context=ctx, timeout=60)
        conn.request("GET", path, headers={"Accept": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"bench: watch through {watch_url}: {response.status}")
        streams.append((conn, response))
    seen = [0] * watchers
    errors = [0]

    def read(i: int) -> None:
        response = streams[i][1]
        try:
            while seen[i] < writes:
                line = response.readline()
                if not line:
                    break
                if json.loads(line).get("type") == "MODIFIED":
                    seen[i] += 1
        except (OSError, ValueError, http.client.HTTPException):
            errors[0] += 1

    counter = iter(range(writes))
    lock = threading.Lock()

    def write() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            status, _ = call(write_url, ctx, "PATCH", WATCH_OBJECT, {"data": {"n": str(i)}},
                             "application/merge-patch+json")
            if status != 200:
                with lock:
                    errors[0] += 1

    readers = [threading.Thread(target=read, args=(i,)) for i in range(watchers)]
    writers = [threading.Thread(target=write) for _ in range(WRITERS)]
    for t in readers + writers:
        t.start()
    for t in writers + readers:
        t.join(timeout=300)
    for conn, _ in streams:
        conn.close()
    return sum(seen), errors[0]


# --------------------------------------------------------------------------- a round


def run_round(round_: int, counts: Counts, targets: dict[str, str], direct: str,
              meter: Meter, shim: Path, pki: Path, ctx: ssl.SSLContext) -> list[Run]:
    order = ["direct", "mvproxy"] if round_ % 2 else ["mvproxy", "direct"]
    idle = meter.idle_rates()
    print(f"round {round_}: idle CPU/s " + ", ".join(f"{k} {v:.3f}" for k, v in idle.items()),
          flush=True)
    runs: list[Run] = []
    for scenario in ("get", "list", "watch"):
        for target in order:
            base = targets[target]
            if scenario == "watch":
                watch_events(base, direct, ctx, max(20, counts.watch_writes // 10))  # warm-up
                (units, errors), seconds, cpu, raw = measured(
                    meter, idle, partial(watch_events, base, direct, ctx, counts.watch_writes))
                notes = {"writes": counts.watch_writes, "watchers": WATCHERS}
            else:
                path, n = (GET_PATH, counts.get) if scenario == "get" else (LIST_PATH, counts.list)
                wrk(base + path, max(10, n // 10), shim, pki)  # warm-up
                result, seconds, cpu, raw = measured(meter, idle,
                                                     partial(wrk, base + path, n, shim, pki))
                units, errors = result["requests"], result["errors"]
                notes = {"p50_ms": result["p50_us"] / 1e3, "p99_ms": result["p99_us"] / 1e3,
                         "bytes_per_response": result["bytes"] / max(1, result["requests"])}
            run = Run(scenario, target, round_, units, seconds, cpu, raw, errors, notes)
            runs.append(run)
            print(f"  {scenario:5} {target:7} {units:6d} in {seconds:5.1f}s  "
                  + "  ".join(f"{p} {run.us_per_unit(p):7.1f}" for p in PROCESSES)
                  + f" µs/unit  errors {errors}", flush=True)
    return runs


# --------------------------------------------------------------------------- summary


def _mrange(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for scenario in ("get", "list", "watch"):
        direct = [r for r in runs if r.scenario == scenario and r.target == "direct"]
        via = [r for r in runs if r.scenario == scenario and r.target == "mvproxy"]
        pairs = sorted(zip(sorted(direct, key=lambda r: r.round),
                           sorted(via, key=lambda r: r.round), strict=True),
                       key=lambda p: p[0].round)
        share = [v.cpu["mvproxy"] / max(1e-9, v.cpu["kube-apiserver"]) for _, v in pairs]
        extra = [(v.us_per_unit("mvproxy") + v.us_per_unit("kube-apiserver")
                  + v.us_per_unit("etcd")) - (d.us_per_unit("kube-apiserver")
                                              + d.us_per_unit("etcd")) for d, v in pairs]
        rows.append({
            "scenario": scenario,
            "unit": "delivered event" if scenario == "watch" else "request",
            "units_per_run": _mrange([float(r.units) for r in via + direct]),
            "kube_apiserver_us_direct": _mrange([d.us_per_unit("kube-apiserver")
                                                 for d, _ in pairs]),
            "kube_apiserver_us_via": _mrange([v.us_per_unit("kube-apiserver")
                                              for _, v in pairs]),
            "etcd_us_direct": _mrange([d.us_per_unit("etcd") for d, _ in pairs]),
            "etcd_us_via": _mrange([v.us_per_unit("etcd") for _, v in pairs]),
            "mvproxy_us": _mrange([v.us_per_unit("mvproxy") for _, v in pairs]),
            "share": _mrange(share),
            "extra_us_total": _mrange(extra),
            "errors": sum(r.errors for r in direct + via),
        })
    return rows


SCENARIO_TEXT = {"get": "small GET (one ConfigMap)", "list": f"LIST of {LIST_OBJECTS} ConfigMaps",
                 "watch": f"watch events ({WATCHERS} watches)"}


def render(rows: list[dict[str, Any]]) -> str:
    def cell(m: dict[str, float], fmt: str = "{:.0f}") -> str:
        return f"{fmt.format(m['median'])} ({fmt.format(m['min'])}–{fmt.format(m['max'])})"

    lines = ["| scenario | CPU µs per | kube-apiserver direct | kube-apiserver through "
             "mvproxy | etcd (direct / through) | mvproxy | mvproxy ÷ kube-apiserver | "
             "errors |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {SCENARIO_TEXT[row['scenario']]} | {row['unit']} | "
            f"{cell(row['kube_apiserver_us_direct'])} | {cell(row['kube_apiserver_us_via'])} | "
            f"{row['etcd_us_direct']['median']:.0f} / {row['etcd_us_via']['median']:.0f} | "
            f"{cell(row['mvproxy_us'])} | {cell(row['share'], '{:.2f}')} | {row['errors']} |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in
                    Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    return {"cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg": os.getloadavg()}


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--version", default="1.36.3", help="kube-apiserver release")
    parser.add_argument("--quick", action="store_true", help="1 round, fewer requests")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "real_cost.json")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the cluster on SIGTERM too
    counts = QUICK if args.quick else Counts()
    rounds = 1 if args.quick else args.rounds
    ensure_tools()
    started = datetime.now(timezone.utc)
    before = machine()
    # Everything started from here on inherits CPU 1: kube-apiserver and etcd run there
    # (so their Go runtimes size themselves for one CPU), mvproxy is moved to CPU 0.
    os.sched_setaffinity(0, {LOAD_CPU})
    with tempfile.TemporaryDirectory(prefix="mvproxy-real-cost-") as tmp:
        work = Path(tmp)
        cluster = start_real_cluster(work / "cluster", [args.version], base_port=0,
                                     poll_interval="60s")
        try:
            server = cluster.servers[0]
            set_affinity(server.proxy.pid, PROXY_CPU)
            pki = cluster.pki
            ctx = context(pki)
            seed(server.backend_url, ctx)
            shim = build_shim(work)
            meter = Meter({"kube-apiserver": server.backend.pid, "etcd": cluster.etcd.pid,
                           "mvproxy": server.proxy.pid})
            targets = {"direct": server.backend_url, "mvproxy": server.proxy_url}
            runs: list[Run] = []
            for round_ in range(1, rounds + 1):
                runs += run_round(round_, counts, targets, server.backend_url, meter, shim,
                                  pki, ctx)
        finally:
            cluster.stop()
    rows = summarize(runs)
    table = render(rows)
    result = {
        "when": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {**before, "loadavg_after": os.getloadavg()},
        "kube_apiserver": args.version,
        "layout": "mvproxy alone on CPU 0; kube-apiserver, etcd and the load on CPU 1",
        "counts": asdict(counts), "rounds": rounds, "connections": CONNECTIONS,
        "summary": rows, "runs": [asdict(r) for r in runs], "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{table}\n\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
