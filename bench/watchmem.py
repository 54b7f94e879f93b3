#!/usr/bin/env python3
"""mvproxy's memory for many open watches, over HTTP/1.1 and over HTTP/2.

    python3 bench/watchmem.py [--steps 1000,5000,10000] [--idle 500] [--cases a,b,c]
                              [--set KEY=VALUE ...] [--upstream-http2 KEY=VALUE] [--quick]

Issue 23's target is 10,000 watches under 300 MB of proxy RSS with HTTP/2 on both legs.
Clients and backend are Go's standard library (``bench/watchload``, built here with
``go build`` into ``~/.cache/mvproxy/bench/``), which speaks HTTP/2 over TLS by default
as client-go does: ``watchload server`` is the TLS backend (watch streams that stay
open, one event every ``--interval``; the discovery documents mvproxy's poller reads;
100 streams per HTTP/2 connection, as kube-apiserver); ``watchload client`` first opens
``--idle`` connections that each make one GET and stay open, then watches, all on one
transport like one client-go program's informers, up to each count in ``--steps``,
and says how many connections it dialled. After each step the proxy's RSS
(``/proc/<pid>/status`` VmRSS, once settled) and open descriptors are read.

Cases, each a fresh ``mvproxy run`` (mTLS in, front-proxy client certificate out):

- **a**: HTTP/1.1 on both legs (``listener.http2: false``, ``upstreamHTTP2: off``,
  client ``-h1``): one downstream and one upstream connection per watch;
- **b**: HTTP/2 downstream, HTTP/1.1 upstream (``upstreamHTTP2: off``);
- **c**: HTTP/2 on both legs: case b plus ``--upstream-http2`` (a config override,
  ``KEY=VALUE`` with a dotted key; default ``upstreamHTTP2=longRunning``). Skipped, and
  said so, when mvproxy refuses the key (it exits 2 naming an unknown key).

``--set KEY=VALUE`` overrides any config key in every case (values are YAML). A
step the open-file limit cannot hold (HTTP/1.1 needs two descriptors per watch in
mvproxy) is left out and the reason recorded. Writes ``bench/results/h2watchmem.json``
and ``h2watchmem.md`` (not with ``--quick``). Every process is stopped by PID, every
wait is bounded (``--timeout``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import select
import subprocess
import sys
import time
from pathlib import Path

import run  # bench/ is on sys.path when this file runs as a script

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "watchload"
CASES = {
    "a": "HTTP/1.1 both legs",
    "b": "HTTP/2 downstream, HTTP/1.1 upstream",
    "c": "HTTP/2 both legs",
}
FD_RESERVE = 300  # listener, admin, discovery polls, logs, the interpreter's own


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mvproxy" / "bench"


def build_watchload() -> Path:
    """The watchload binary built from the current sources (one per source digest,
    outside the clone; Go's own build cache makes a rebuild quick)."""
    digest = hashlib.sha256()
    for source in sorted(SOURCE.glob("*")):
        if source.suffix in (".go", ".mod"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    binary = cache_dir() / f"watchload-{digest.hexdigest()[:16]}"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["go", "build", "-trimpath", "-o", str(binary), "."], cwd=SOURCE,
                       check=True, timeout=600, env={**os.environ, "CGO_ENABLED": "0"})
    return binary


def parse_overrides(pairs: list[str]) -> list[tuple[list[str], object]]:
    import yaml
    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"bench: --set wants KEY=VALUE, not {pair!r}")
        out.append((key.split("."), yaml.safe_load(value)))
    return out


def apply(doc: dict, overrides: list[tuple[list[str], object]]) -> dict:
    for path, value in overrides:
        node = doc
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return doc


class Lines:
    """A child's stdout read line by line, each wait bounded."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.buffer = proc, b""

    def next(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"bench: no line from pid {self.proc.pid} in {timeout:g} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
                if not chunk:
                    raise SystemExit(f"bench: pid {self.proc.pid} ended "
                                     f"(exit {self.proc.wait(10)})")
                self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)


def settled_rss(pid: int, timeout: float = 20.0) -> int:
    """VmRSS (KiB) once two readings 1 s apart agree within 0.5 % (or at ``timeout``)."""
    last = run.rss_kib(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = run.rss_kib(pid)
        if abs(now - last) <= max(256, last // 200):
            return now
        last = now
    return last


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_mvproxy(work: Path, case: str, doc: dict, procs: run.Processes,
                  admin: int) -> tuple[subprocess.Popen | None, str]:
    """``mvproxy run`` with ``doc``; (None, why) when it refuses the config (exit 2)."""
    import urllib.request

    import yaml
    config = work / f"mvproxy-{case}.yaml"
    config.write_text(yaml.safe_dump(doc))
    log = work / f"mvproxy-{case}.log"
    proc = procs.start([sys.executable, "-m", "mvproxy", "run", "--config", str(config)],
                       run.PROXY_CPU, log, env={**os.environ, "PYTHONPATH": str(run.ROOT)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = log.read_text(errors="replace")
            if proc.returncode == 2:  # "<file>: N problem(s) <key>: unknown key"
                words = " ".join(said.split())
                return None, words.split("problem", 1)[-1].lstrip("s ")[-300:]
            raise SystemExit(f"bench: mvproxy (case {case}) exited {proc.returncode}: "
                             f"{said[-800:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=2) as resp:
                if resp.status == 200:
                    return proc, ""
        time.sleep(0.3)
    raise SystemExit(f"bench: mvproxy (case {case}) never became ready")


def warm_up(port: int, pki: Path) -> None:
    """A few GETs before the baseline: the first requests load code and open the pool."""
    import ssl
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    for _ in range(20):
        run.fetch(f"https://127.0.0.1:{port}/api/v1/namespaces/default/configmaps/bench", ctx,
                  "application/json")


def measure_case(args: argparse.Namespace, work: Path, case: str, binary: Path,
                 backend: str, pki: Path, procs: run.Processes) -> dict:
    from mvproxy import devpki

    fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    h1 = case == "a"
    steps = [int(s) for s in args.steps.split(",")]
    # mvproxy's descriptors: a downstream and (pooled) an upstream socket per idle
    # connection; per watch two over HTTP/1.1, about one (its upstream) otherwise
    per_watch = 2 if h1 else 1
    if case == "c":
        per_watch = 0.1
    budget = fd_limit - FD_RESERVE - 2 * args.idle
    fits = [s for s in steps if s * per_watch <= budget]
    left_out = [s for s in steps if s not in fits]
    most = int(budget / per_watch) // 500 * 500  # the most the limit holds, as a step
    if left_out and most > max(fits, default=0):
        fits.append(most)
    if not fits:
        return {"case": case, "name": CASES[case], "skipped": f"the open-file limit "
                f"({fd_limit}) holds none of the steps {steps}"}
    port, admin = run.free_port(), run.free_port()
    doc = {**devpki.sidecar_config(pki, backend, port, admin),
           "logging": {"verbosity": 1},
           "listener": {"idleTimeout": "1h", "maxConnections": fd_limit - FD_RESERVE,
                        "http2": not h1},
           "upstreamHTTP2": "off"}  # case c turns it on (``--upstream-http2``)
    overrides = parse_overrides(args.set + (args.upstream_http2 if case == "c" else []))
    apply(doc, overrides)
    proxy, refused = start_mvproxy(work, case, doc, procs, admin)
    if proxy is None:
        return {"case": case, "name": CASES[case], "skipped": f"mvproxy refused the config "
                f"(exit 2): {refused}", "overrides": args.upstream_http2}
    warm_up(port, pki)
    base_rss, base_fds = settled_rss(proxy.pid), open_fds(proxy.pid)
    argv = [str(binary), "client", "-url", f"https://127.0.0.1:{port}",
            "-ca", str(pki / "ca.crt"), "-cert", str(pki / "admin.crt"),
            "-key", str(pki / "admin.key"), "-idle", str(args.idle),
            "-steps", ",".join(map(str, fits)), "-parallel", str(args.parallel)]
    if h1:
        argv.append("-h1")
    client = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(work / f"client-{case}.log", "wb"),  # noqa: SIM115
                              preexec_fn=run.pin(run.LOAD_CPU), start_new_session=True)
    procs.started.append(client)
    lines = Lines(client)
    points = []
    try:
        idle = lines.next(args.step_timeout)
        idle_rss, idle_fds = settled_rss(proxy.pid), open_fds(proxy.pid)
        print(f"  case {case}: baseline {base_rss / 1024:.1f} MiB; {args.idle} idle "
              f"connections → {idle_rss / 1024:.1f} MiB", flush=True)
        for _ in fits:
            client.stdin.write(b"next\n")  # type: ignore[union-attr]
            client.stdin.flush()  # type: ignore[union-attr]
            got = lines.next(args.step_timeout)
            time.sleep(2)
            rss, fds = settled_rss(proxy.pid), open_fds(proxy.pid)
            point = {"watches": got["watches"], "client_connections": got["connections"],
                     "rss_kib": rss, "open_fds": fds, "events": got["events"],
                     "errors": got["errors"], "ended": got["ended"],
                     "open_seconds": round(got["seconds"], 1),
                     "per_watch_kib": round((rss - idle_rss) / got["watches"], 1)}
            if got.get("last_error"):
                point["last_error"] = got["last_error"][:300]
            points.append(point)
            print(f"  case {case}: {got['watches']:6} watches on {got['connections']:5} "
                  f"client connections → {rss / 1024:7.1f} MiB, {fds} fds, "
                  f"{point['per_watch_kib']} KiB/watch, errors {got['errors']}", flush=True)
        cpu_before = run.cpu_seconds([proxy.pid])
        time.sleep(args.hold)
        hold_cpu = (run.cpu_seconds([proxy.pid]) - cpu_before) / args.hold
    finally:
        with contextlib.suppress(OSError):
            client.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(subprocess.TimeoutExpired):
            client.wait(20)
        if client.poll() is None:
            client.kill()
            client.wait(10)
        proxy.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proxy.wait(30)
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait(10)
    return {"case": case, "name": CASES[case], "overrides": args.set + (
                args.upstream_http2 if case == "c" else []),
            "baseline_rss_kib": base_rss, "baseline_fds": base_fds,
            "idle_connections": args.idle, "idle_client_connections": idle["connections"],
            "idle_errors": idle["errors"], "rss_with_idle_kib": idle_rss,
            "idle_fds": idle_fds,
            "per_idle_connection_kib": round((idle_rss - base_rss) / max(1, args.idle), 1),
            "points": points,
            "hold_cpu_percent": round(hold_cpu * 100, 2), "hold_seconds": args.hold,
            "event_interval": args.interval,
            "left_out": ({"steps": left_out, "why": f"open-file limit {fd_limit} (hard "
                          f"{resource.getrlimit(resource.RLIMIT_NOFILE)[1]}): mvproxy "
                          f"needs ~{per_watch} descriptors per watch"}
                         if left_out else None)}


def run_all(args: argparse.Namespace, work: Path) -> dict:
    sys.path.insert(0, str(run.ROOT))
    from mvproxy import devpki

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    binary = build_watchload()
    pki = work / "pki"
    devpki.init_pki(pki, ["a"], days=2)
    procs = run.Processes()
    cases = []
    try:
        server = subprocess.Popen(
            [str(binary), "server", "-listen", "127.0.0.1:0",
             "-cert", str(pki / "a" / "apiserver.crt"), "-key", str(pki / "a" / "apiserver.key"),
             "-interval", args.interval], stdout=subprocess.PIPE,
            stderr=open(work / "server.log", "wb"),  # noqa: SIM115
            stdin=subprocess.DEVNULL, preexec_fn=run.pin(run.LOAD_CPU), start_new_session=True)
        procs.started.append(server)
        listening = Lines(server).next(30)["listening"]
        for case in args.cases.split(","):
            print(f"case {case}: {CASES[case]}", flush=True)
            cases.append(measure_case(args, work, case, binary, f"https://{listening}", pki,
                                      procs))
            if cases[-1].get("skipped"):
                print(f"  case {case} skipped: {cases[-1]['skipped']}", flush=True)
        go = subprocess.run(["go", "version"], capture_output=True, text=True,
                            timeout=30).stdout.strip()
    finally:
        procs.stop()
    return {"cases": cases, "go": go, "open_file_limit": [soft, hard],
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": run.machine()}


def render(result: dict) -> str:
    m = result["machine"]
    lines = [f"{result['when']}, {m.get('model', '?')}, {m['cpus']} vCPUs, kernel "
             f"{m['kernel']}, Python {m['python']}, {result['go']} (watchload); load average "
             f"{result['load_before']} before, {result['load_after']} after; open-file limit "
             f"{result['open_file_limit'][1]}.", "",
             "| case | watches | client connections | proxy RSS MiB | KiB per watch "
             "(over idle) | proxy fds | errors |", "|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        if case.get("skipped"):
            lines.append(f"| {case['case']}: {case['name']} | skipped: {case['skipped']} "
                         "| | | | | |")
            continue
        lines.append(f"| {case['case']}: {case['name']} | 0 (baseline) | – | "
                     f"{case['baseline_rss_kib'] / 1024:.1f} | – | {case['baseline_fds']} | – |")
        lines.append(f"| | 0, {case['idle_connections']} idle connections | "
                     f"{case['idle_client_connections']} | "
                     f"{case['rss_with_idle_kib'] / 1024:.1f} | "
                     f"{case['per_idle_connection_kib']} per connection | "
                     f"{case['idle_fds']} | {case['idle_errors']} |")
        for p in case["points"]:
            lines.append(f"| | {p['watches']:,} | {p['client_connections']:,} | "
                         f"{p['rss_kib'] / 1024:.1f} | {p['per_watch_kib']} | "
                         f"{p['open_fds']:,} | {p['errors']} |")
        if case.get("left_out"):
            lines.append(f"| | {', '.join(f'{s:,}' for s in case['left_out']['steps'])}: "
                         f"not run ({case['left_out']['why']}) | | | | | |")
    lines += ["", "Proxy CPU while holding the last step (one event per watch every "
              f"{result['cases'][0].get('event_interval', '?')}): " + ", ".join(
                  f"{c['case']} {c['hold_cpu_percent']} %" for c in result["cases"]
                  if not c.get("skipped"))]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="1000,5000,10000")
    parser.add_argument("--idle", type=int, default=500, help="idle connections first")
    parser.add_argument("--cases", default="a,b,c")
    parser.add_argument("--interval", default="30s", help="time between a watch's events")
    parser.add_argument("--parallel", type=int, default=64, help="watches opened at once")
    parser.add_argument("--hold", type=float, default=10.0,
                        help="seconds of proxy CPU read at the last step")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every case (dotted key, YAML value)")
    parser.add_argument("--upstream-http2", action="append", default=None, metavar="KEY=VALUE",
                        help="the override that turns HTTP/2 upstream on, case c only "
                             "(default upstreamHTTP2=longRunning, mvproxy's default)")
    parser.add_argument("--step-timeout", type=float, default=600.0)
    parser.add_argument("--timeout", type=float, default=3000.0)
    parser.add_argument("--quick", action="store_true", help="200 and 500 watches, 100 idle")
    args = parser.parse_args()
    args.upstream_http2 = args.upstream_http2 or ["upstreamHTTP2=longRunning"]
    if args.quick:
        args.steps, args.idle, args.hold = "200,500", 100, 3.0
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench: needs two CPUs (the proxy alone on one)")
    result = run.bounded_run(args, "mvproxy-watchmem-", run_all)
    result["table"] = render(result)
    print("\n" + result["table"])
    if not args.quick:
        out = HERE / "results"
        out.mkdir(exist_ok=True)
        (out / "h2watchmem.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "h2watchmem.md").write_text("# Watches through mvproxy: RSS over HTTP/1.1 and "
                                           "HTTP/2 (bench/watchmem.py)\n\n" + result["table"]
                                           + "\n")
        print(f"\nwrote {out / 'h2watchmem.json'} and {out / 'h2watchmem.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
