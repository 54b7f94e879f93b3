#!/usr/bin/env python3
"""Where a small GET's time goes inside mvproxy: the profile the engine refactor and
mypyc are judged against (issue 22: "profile first, compile what the profile names").

    python3 bench/profile_request.py [--seconds 10] [--top 25]

Starts ``bench/run.py``'s backend and mvproxy "a" and "b" on 127.0.0.1, mvproxy pinned
to the proxy CPU, and drives the small GET (``bench/run.py``'s, 32 keep-alive
connections, mTLS) with wrk from the other CPU, twice:

1. **py-spy** (PyPI, installed into the bench's environment on demand) samples the
   running mvproxy: own time per Python function, as a share of the samples. The C under
   a frame (TLS, llhttp, uvloop) is charged to that frame.
2. **cProfile**: mvproxy restarted under ``python -m cProfile``; calls per request of
   each function = its call count / requests served (startup and the readiness probe add
   a few thousand calls to millions, which is below the printed precision).

Prints both as Markdown tables; stops every process it started.
"""

from __future__ import annotations

import argparse
import marshal
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import run as bench  # bench/ is on sys.path when this file runs as a script

SPY_PACKAGE = "py-spy"


def ensure_py_spy() -> str:
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", SPY_PACKAGE],
                       check=True, timeout=600)
    return str(spy)


def _where(func: tuple) -> str:
    """``module.py:line name`` with the path made short."""
    filename, line, name = func
    if filename == "~":
        return name  # a builtin, e.g. <method 'write' of ...>
    path = Path(filename)
    short = "/".join(path.parts[-2:]) if "mvproxy" in path.parts else path.name
    return f"{short}:{line} {name}"


class Counted:
    """cProfile's numbers per request served."""

    def __init__(self, stats_file: Path, requests: int) -> None:
        stats = marshal.loads(stats_file.read_bytes())
        # (function, calls per request, own µs per request under the profiler, file)
        self.rows = [(_where(func), ncalls / requests, tottime / requests * 1e6, func[0])
                     for func, (_cc, ncalls, tottime, _cum, _callers) in stats.items()]
        self.calls = sum(row[1] for row in self.rows)

    def by_own_time(self, top: int) -> list[tuple[str, float, float, str]]:
        return sorted(self.rows, key=lambda row: -row[2])[:top]

    def project_by_calls(self, top: int) -> list[tuple[str, float, float, str]]:
        mine = [row for row in self.rows if "/mvproxy/" in row[3]]
        return sorted(mine, key=lambda row: -row[1])[:top]

    def by_module(self) -> list[tuple[str, float, int]]:
        """mvproxy modules: (module, calls per request, distinct functions entered)."""
        modules: dict[str, list[float]] = {}
        for _function, per, _own, filename in self.rows:
            if "/mvproxy/" in filename and per >= 0.5:
                modules.setdefault(Path(filename).name, []).append(per)
        return sorted(((m, sum(v), len(v)) for m, v in modules.items()), key=lambda r: -r[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    bench.in_project_env()
    spy = ensure_py_spy()
    with tempfile.TemporaryDirectory(prefix="mvproxy-profile-") as tmp:
        work = Path(tmp)
        sys.path.insert(0, str(bench.ROOT))
        from mvproxy import devpki
        bench.ensure_tools()
        work.chmod(0o755)
        shim = bench.build_shim(work)
        pki = work / "pki"
        devpki.init_pki(pki, ["a"], days=2)
        roots = bench.write_roots(work)
        ports = {k: bench.free_port() for k in ("a", "b", "static", "mva", "mvb", "admina",
                                                "adminb")}
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        procs = bench.Processes()
        env = {**os.environ, "PYTHONPATH": str(bench.ROOT)}
        configs = {m: bench.mvproxy_conf(work, pki, m, ports) for m in ("a", "b")}
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(pki / "admin.crt", pki / "admin.key")
        runner = bench.Bench(work, shim, pki, args.seconds, 2.0)
        url = f"https://127.0.0.1:{ports['mva']}{bench.CM_PATH}"

        def start_a(*prefix: str) -> subprocess.Popen:
            proc = procs.start([sys.executable, *prefix, "-m", "mvproxy", "run", "--config",
                                str(configs["a"])], bench.PROXY_CPU, work / "mvproxy-a.log",
                               env=env)
            bench.wait_ready(f"http://127.0.0.1:{ports['admina']}/readyz", None)
            return proc

        try:
            procs.start([nginx, "-c", str(bench.backend_conf(work, pki, roots, ports))],
                        bench.LOAD_CPU, work / "backend.log")
            procs.start([sys.executable, "-m", "mvproxy", "run", "--config",
                         str(configs["b"])], bench.PROXY_CPU, work / "mvproxy-b.log", env=env)
            proc = start_a()
            runner.wrk(url, 32, 3, [])  # warm: pools filled, caches loaded
            raw = work / "spy.raw"
            recorder = subprocess.Popen([spy, "record", "--pid", str(proc.pid), "--duration",
                                         f"{args.seconds:g}", "--rate", "250", "--format",
                                         "raw", "--function", "--output", str(raw)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            served = runner.wrk(url, 32, args.seconds + 1, [])
            recorder.wait(120)
            spied, samples = bench.own_shares(raw, args.top)
            before = bench.cpu_seconds([proc.pid])
            plain = runner.wrk(url, 32, args.seconds, [])
            plain_us = (bench.cpu_seconds([proc.pid]) - before) / plain["requests"] * 1e6
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)

            stats = work / "cprofile.out"
            proc = start_a("-m", "cProfile", "-o", str(stats))
            profiled = runner.wrk(url, 32, args.seconds, [])
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
            counted = Counted(stats, profiled["requests"])
        finally:
            procs.stop()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {bench.machine()}; "
          f"load average {bench.load_average()}")
    print(f"\nsmall GET through mvproxy without a profiler: {plain['requests'] / args.seconds:.0f}"
          f" req/s, {plain_us:.0f} µs CPU/req (py-spy run: {served['requests']} requests)")
    print(f"\npy-spy, {samples} samples at 250 Hz, own time (Python frames):\n")
    print("| own % | function |\n|---|---|")
    for frame, share in spied:
        print(f"| {share:.1f} | `{frame}` |")
    print(f"\ncProfile, {profiled['requests']} requests, {counted.calls:.0f} Python-level "
          "calls per request (builtins included); own time is under the profiler, so only "
          "its proportions mean anything.\n\nBy own time:\n")
    table = "| own µs/request (profiled) | calls/request | function |\n|---|---|---|"
    print(table)
    for where, per, own_us, _file in counted.by_own_time(args.top):
        print(f"| {own_us:.1f} | {per:.2f} | `{where}` |")
    print("\nmvproxy's functions by calls per request:\n")
    print(table)
    for where, per, own_us, _file in counted.project_by_calls(args.top):
        print(f"| {own_us:.1f} | {per:.2f} | `{where}` |")
    print("\nmvproxy's modules (functions called at least every other request):\n")
    print("| module | calls/request | functions |\n|---|---|---|")
    for module, per, functions in counted.by_module():
        print(f"| {module} | {per:.1f} | {functions} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
