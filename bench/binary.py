#!/usr/bin/env python3
"""The standalone binary against the installed command: size, start-up, CPU per request.

    .venv/bin/python bench/binary.py dist/mvproxy [NAME=PATH ...] [--requests 3000]

Each target is a ``mvproxy`` executable: ``venv`` (this environment's console script,
always measured, the reference) and every one given (a bare path is called
``binary``). For each it measures, on 127.0.0.1 only:

- **size** of the file;
- **start-up**: wall time of ``mvproxy --version`` (median of ``--starts`` runs under
  ``env -i``, so a onefile build unpacks every time as it does on a host), and of
  ``mvproxy run`` from exec until ``/readyz`` answers 200 (median of three);
- **CPU per request**: ``mvproxy run`` in front of one simulated kube-apiserver
  (``mvproxy sim`` from this environment, the same for every target), ``--requests``
  small GETs over mTLS with keep-alive, 8 at a time; CPU is utime + stime of every
  process of the target (a onefile launcher and its child), read from /proc before
  and after. Rounds alternate the targets' order; the table gives medians and each
  target's ratio to ``venv`` in the same round.

Prints a table and writes ``bench/results/binary.json``. Every process started is
stopped by PID; request loops are bounded by count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from mvproxy import devpki
from mvproxy.devcluster.launcher import SimProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CONCURRENCY = 8


def tree_cpu(pid: int) -> float:
    """utime + stime of ``pid`` and of its live descendants, in seconds."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                todo.extend(int(c) for c in children)
    return total


def config(pki: Path, backend: str, port: int, admin: int) -> dict:
    return {**devpki.sidecar_config(pki, backend, port, admin),
            "timeouts": {"shutdownDelay": "0s", "shutdownGracePeriod": "2s"}}


def clean_env(tmp: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp)}


def version_start(executable: str, tmp: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run([executable, "--version"], env=clean_env(tmp), check=True,
                       stdout=subprocess.DEVNULL, timeout=60)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


class Daemon:
    """One ``mvproxy run`` of a target, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, executable: str, tmp: Path, pki: Path, backend: str) -> None:
        self.port, self.admin = free_port(), free_port()
        path = tmp / f"config-{self.port}.yaml"
        path.write_text(yaml.safe_dump(config(pki, backend, self.port, self.admin)))
        self.argv = [executable, "run", "--config", str(path)]
        self.env = clean_env(tmp)
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Daemon:
        self.began = time.perf_counter()
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        async with aiohttp.ClientSession() as session, asyncio.timeout(60):
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{self.admin}/readyz") as r:
                        if r.status == 200:
                            break
                if self.proc.returncode is not None:
                    raise SystemExit(f"{self.argv[0]} exited {self.proc.returncode}")
                await asyncio.sleep(0.02)
        self.ready_after = time.perf_counter() - self.began
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await asyncio.wait_for(self.proc.wait(), 30)


async def load(url: str, ctx: ssl.SSLContext, requests: int, deadline: float) -> int:
    """``requests`` GETs, CONCURRENCY at a time; how many were answered 200."""
    remaining = iter(range(requests))
    stop_at = time.monotonic() + deadline
    done = 0
    connector = aiohttp.TCPConnector(ssl=ctx, limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal done
            for _ in remaining:
                if time.monotonic() > stop_at:
                    return
                async with session.get(url) as response:
                    await response.read()
                    if response.status != 200:
                        raise SystemExit(f"{url}: HTTP {response.status}")
                    done += 1
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return done


async def cpu_per_request(daemon: Daemon, ctx: ssl.SSLContext, requests: int) -> float:
    url = f"https://127.0.0.1:{daemon.port}/api/v1/namespaces/default"
    assert daemon.proc is not None
    await load(url, ctx, min(300, requests), 60)  # warm: pools, caches, code paths
    before = tree_cpu(daemon.proc.pid)
    done = await load(url, ctx, requests, 120)
    return (tree_cpu(daemon.proc.pid) - before) / done


def measure(targets: dict[str, str], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="mvproxy-bench-binary-") as tmp_name:
        tmp = Path(tmp_name)
        os.chmod(tmp, 0o700)
        pki = tmp / "pki"
        subprocess.run([targets["venv"], "certs", "init", str(pki), "--server-id", "a"],
                       check=True, stdout=subprocess.DEVNULL, timeout=120)
        sim = SimProcess(kubernetes_version="1.35", server_id="a", pki_dir=pki,
                         port=free_port(), store=tmp / "store.db", log_dir=tmp)
        results: dict[str, dict] = {name: {"cpu_us": [], "ratio": [], "ready_s": []}
                                    for name in targets}
        with sim:
            sim.wait_ready(60)
            for name, executable in targets.items():
                results[name]["size_bytes"] = Path(executable).stat().st_size
                results[name]["version_s"] = version_start(executable, tmp, args.starts)
            asyncio.run(rounds(targets, args, tmp, pki, sim, results))
    return results


async def rounds(targets: dict[str, str], args: argparse.Namespace, tmp: Path, pki: Path,
         sim: SimProcess, results: dict[str, dict]) -> None:
    ctx = sim.admin_context()
    for round_ in range(args.rounds):
        order = list(targets) if round_ % 2 == 0 else list(reversed(targets))
        cpu: dict[str, float] = {}
        for name in order:
            async with Daemon(targets[name], tmp, pki, sim.url) as daemon:
                results[name]["ready_s"].append(daemon.ready_after)
                cpu[name] = await cpu_per_request(daemon, ctx, args.requests)
        for name in targets:
            results[name]["cpu_us"].append(cpu[name] * 1e6)
            results[name]["ratio"].append(cpu[name] / cpu["venv"])
        print(f"round {round_ + 1}: " + ", ".join(
            f"{n} {cpu[n] * 1e6:.0f} µs/req" for n in targets), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binaries", nargs="+", metavar="[NAME=]PATH")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--starts", type=int, default=10)
    args = parser.parse_args()
    targets = {"venv": str(Path(sys.executable).with_name("mvproxy"))}
    for item in args.binaries:
        name, sep, path = item.rpartition("=")
        targets[name if sep else "binary"] = str(Path(path).resolve())
    results = measure(targets, args)
    print(f"\n{'target':10} {'size MB':>8} {'--version s':>12} {'ready s':>8}"
          f" {'CPU µs/req':>11} {'× venv':>7}")
    summary = {}
    for name, r in results.items():
        row = {"size_mb": round(r["size_bytes"] / 1e6, 1) if name != "venv" else None,
               "version_s": round(r["version_s"], 3),
               "ready_s": round(statistics.median(r["ready_s"]), 3),
               "cpu_us_per_request": round(statistics.median(r["cpu_us"]), 1),
               "cpu_ratio_to_venv": round(statistics.median(r["ratio"]), 3),
               "cpu_ratio_range": [round(min(r["ratio"]), 3), round(max(r["ratio"]), 3)]}
        summary[name] = row
        size = "-" if name == "venv" else f"{row['size_mb']:.1f}"
        print(f"{name:10} {size:>8} {row['version_s']:12.3f} {row['ready_s']:8.3f}"
              f" {row['cpu_us_per_request']:11.0f} {row['cpu_ratio_to_venv']:7.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "binary.json").write_text(json.dumps(
        {"requests": args.requests, "rounds": args.rounds, "targets": targets,
         "results": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
