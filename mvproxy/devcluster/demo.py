"""``mvproxy demo``: a mixed-version control plane on loopback, and the API behind it.

``start_cluster`` builds everything in one directory and returns a ``DemoCluster``
(a context manager) once every process is ready and every mvproxy sees its backend
and all its peers:

* a fresh PKI (``DIR/pki``, ``mvproxy certs init`` layout, one server ID per version);
* one simulated kube-apiserver per version (``mvproxy sim``), all sharing one object
  store (``DIR/store.db``) as real servers share etcd, each with an audit log;
* one ``mvproxy run --config DIR/<id>/mvproxy.yaml`` in front of each, every other
  mvproxy listed as a static peer (``membership="static"``), or each publishing a
  Lease through its backend and finding the others' (``membership="leases"``; then
  ``spare_versions`` are configured but not started: ``start_member`` adds one later);
* ``DIR/kubeconfig`` (one context per mvproxy, named by server ID, plus
  ``<id>-direct`` contexts that bypass mvproxy) and ``DIR/demo.json`` (every URL, pid,
  path and token, so scripts can find and stop any process).

Ports: mvproxy ``base_port + i``, kube-apiserver ``base_port + 100 + i``, admin
listener ``base_port + 200 + i``; ``base_port=0`` picks free ports (for tests).

``run_demo`` is the CLI: it starts the cluster (``realdemo``'s with ``--real``), prints
what to try, and stops everything on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from mvproxy.devcluster.launcher import (
    ManagedProcess,
    SimProcess,
    free_port,
    stop_all,
    write_token_file,
)
from mvproxy.errors import MvproxyError, UsageError

StrPath = str | os.PathLike[str]

DEFAULT_VERSIONS = ("1.35", "1.35", "1.36")
DEFAULT_BASE_PORT = 16443
BACKEND_PORT_OFFSET = 100
ADMIN_PORT_OFFSET = 200
MAX_SERVERS = 20
HOST = "127.0.0.1"
READY_TIMEOUT = 30.0  # every process ready and every mvproxy converged, in total
STOP_TIMEOUT = 10.0  # per process group, then SIGKILL
PROBE_TIMEOUT = 2.0
MIN_KUBECTL = "1.30"
MEMBERSHIPS = ("static", "leases")
DEFAULT_LEASE_TIMING = ("15s", "5s")  # leaseDuration, renewPeriod: a killed peer leaves in 15 s

ADMIN_TOKEN_USER = ("demo-admin", "demo-admin-uid", ["system:masters"])
VIEWER_TOKEN_USER = ("demo-viewer", "demo-viewer-uid", ["viewer"])

PODGROUP_EXAMPLE = """\
# A PodGroup: scheduling.k8s.io/v1alpha2 exists only on Kubernetes 1.36 servers.
# Created through an older server's mvproxy, it is forwarded to a 1.36 peer.
apiVersion: scheduling.k8s.io/v1alpha2
kind: PodGroup
metadata:
  name: gang
  namespace: default
spec:
  schedulingPolicy:
    gang:
      minCount: 2
"""


class DemoError(MvproxyError):
    """The demo control plane could not be started."""


def server_id(index: int) -> str:
    return f"apiserver-{index}"


# --------------------------------------------------------------------------- the cluster


@dataclass
class ServerInfo:
    """One control-plane member: a kube-apiserver (simulated, or real with ``--real``)
    and the mvproxy in front, both listening on ``host``."""

    id: str
    version: str
    proxy_port: int
    backend_port: int
    admin_port: int
    proxy: ManagedProcess  # `mvproxy run`; may be stopped and started again
    backend: ManagedProcess  # `mvproxy sim` (a SimProcess) or kube-apiserver; likewise
    config: Path  # the MvproxyConfiguration file of the mvproxy
    audit_log: Path  # the backend's JSON-lines audit log
    host: str = HOST

    @property
    def proxy_url(self) -> str:
        return f"https://{self.host}:{self.proxy_port}"

    @property
    def backend_url(self) -> str:
        return f"https://{self.host}:{self.backend_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    @property
    def context(self) -> str:
        """The kubeconfig context through this server's mvproxy."""
        return self.id

    @property
    def direct_context(self) -> str:
        """The kubeconfig context straight to its kube-apiserver, bypassing mvproxy."""
        return f"{self.id}-direct"


@dataclass(frozen=True)
class Showcase:
    """What the guide shows off: a resource only the newest servers serve, listed
    through an older server's mvproxy and (with an example manifest) created there."""

    group: str
    version: str
    resource: str  # plural, as kubectl api-resources names it
    title: str = ""  # how the guide names them ("PodGroups"); default: the resource
    example: Path | None = None  # a manifest of that resource to create


PODGROUPS = Showcase("scheduling.k8s.io", "v1alpha2", "podgroups", "PodGroups")


@dataclass
class DemoCluster:
    """A running demo control plane (see the module docstring). ``stop()`` ends it."""

    directory: Path
    servers: list[ServerInfo]
    kubeconfig: Path
    ca: Path
    pki: Path
    store: Path
    tokens: dict[str, str]  # kubeconfig user -> bearer token ("admin-token", "viewer-token")
    state_file: Path  # demo.json
    showcase: Showcase | None = None  # what the guide demonstrates (None: plain commands)
    shared_store: str = "one store"  # what the servers share, as the guide says it

    # ------------------------------------------------------------------ lookup

    def server(self, sid: str) -> ServerInfo:
        for server in self.servers:
            if server.id == sid:
                return server
        raise KeyError(f"no server {sid!r}; servers: {', '.join(s.id for s in self.servers)}")

    @property
    def processes(self) -> list[ManagedProcess]:
        return [p for s in self.servers for p in (s.proxy, s.backend)]

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> DemoCluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every mvproxy, then every kube-apiserver. Idempotent."""
        try:
            stop_all([s.proxy for s in self.servers], STOP_TIMEOUT)
        finally:
            stop_all([s.backend for s in self.servers], STOP_TIMEOUT)

    def stop_server(self, sid: str) -> None:
        """Stop one server's mvproxy (its peers then find it unreachable)."""
        self.server(sid).proxy.stop(STOP_TIMEOUT)

    def start_server(self, sid: str, *, wait: bool = True,
                     timeout: float = READY_TIMEOUT) -> None:
        """Start one server's mvproxy again (same ports and configuration).

        With ``wait``, return once it is ready and every running mvproxy sees every
        running peer again.
        """
        self._restart(self.server(sid).proxy, wait, timeout)

    def start_member(self, sid: str, *, timeout: float = READY_TIMEOUT) -> None:
        """Start a member that is not running (a spare, or one stopped): its
        kube-apiserver, then its mvproxy; return once every mvproxy sees it."""
        server = self.server(sid)
        deadline = time.monotonic() + timeout
        if not server.backend.running:
            server.backend.start()
            server.backend.wait_ready(timeout)
        self._restart(server.proxy, True, max(0.1, deadline - time.monotonic()))

    def kill_server(self, sid: str) -> None:
        """SIGKILL one server's mvproxy: no graceful shutdown, its Lease stays until it
        expires."""
        proxy = self.server(sid).proxy
        if proxy.running and proxy.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proxy.pid, signal.SIGKILL)
        proxy.stop(STOP_TIMEOUT)  # reaps it

    def _restart(self, process: ManagedProcess, wait: bool, timeout: float) -> None:
        """Start a stopped process again; with ``wait``, until the cluster converged."""
        process.start()
        self.write_state()
        if wait:
            deadline = time.monotonic() + timeout
            process.wait_ready(timeout)
            self.wait_converged(max(0.1, deadline - time.monotonic()))

    # ------------------------------------------------------------------ readiness

    def debug_state(self, sid: str) -> dict[str, Any] | None:
        """One mvproxy's ``/debug/mvproxy`` document, or None if it does not answer."""
        server = self.server(sid)
        conn = http.client.HTTPConnection(server.host, server.admin_port,
                                          timeout=PROBE_TIMEOUT)
        try:
            conn.request("GET", "/debug/mvproxy")
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                return None
            doc = json.loads(body)
            return doc if isinstance(doc, dict) else None
        except (OSError, http.client.HTTPException, ValueError):
            return None
        finally:
            conn.close()

    def _unconverged(self, polled_since: float | None = None) -> dict[str, list[str]]:
        """Running mvproxy -> what it should see but does not (empty: all converged).

        An mvproxy should see its backend if that is running, and each peer whose
        mvproxy and backend are both running; with ``polled_since`` (a
        ``time.monotonic()``), through a poll that succeeded after that moment.
        """
        up = {s.id for s in self.servers if s.proxy.running and s.backend.running}
        missing: dict[str, list[str]] = {}
        for server in self.servers:
            if not server.proxy.running:
                continue
            asked = time.monotonic()
            state = self.debug_state(server.id)
            if state is None:
                missing[server.id] = ["its admin listener (/debug/mvproxy)"]
                continue
            max_age = None if polled_since is None else asked - polled_since
            lacks = []
            # With ``workers`` > 1 the supervisor lists each worker's own view.
            workers = state.get("workers")
            views = ([w.get("state") if isinstance(w, dict) else None for w in workers]
                     if isinstance(workers, list) else [state])
            for index, view in enumerate(views):
                where = f" (worker {index})" if isinstance(workers, list) else ""
                if not isinstance(view, dict):
                    lacks.append(f"a view{where}")
                    continue
                if server.backend.running and not _sees(view.get("backend"), max_age):
                    lacks.append(f"its backend{where}")
                peers = view.get("peers") or {}
                lacks += [f"peer {p}{where}" for p in sorted(up - {server.id})
                          if not _sees(peers.get(p), max_age)]
            if lacks:
                missing[server.id] = lacks
        return missing

    def wait_converged(self, timeout: float = READY_TIMEOUT, *,
                       polled_since: float | None = None) -> None:
        """Wait until every running mvproxy has discovery from everything running
        (with ``polled_since``: discovery polled after that ``time.monotonic()``, e.g.
        once a kube-apiserver was replaced)."""
        deadline = time.monotonic() + timeout
        while True:
            missing = self._unconverged(polled_since)
            if not missing:
                return
            if time.monotonic() >= deadline:
                sid, lacks = next(iter(missing.items()))
                proxy = self.server(sid).proxy
                raise DemoError(
                    f"{sid}: mvproxy does not see {', '.join(lacks)} after {timeout:g}s; "
                    f"log {proxy.log_path}:\n{proxy.log_tail()}")
            time.sleep(0.1)

    # ------------------------------------------------------------------ demo.json

    def state(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "pid": os.getpid(),
            "kubeconfig": str(self.kubeconfig),
            "ca": str(self.ca),
            "servers": [
                {
                    "id": s.id,
                    "version": s.version,
                    "proxy": {"url": s.proxy_url, "admin_url": s.admin_url,
                              "pid": s.proxy.pid, "config": str(s.config),
                              "log": str(s.proxy.log_path)},
                    "backend": {"url": s.backend_url, "pid": s.backend.pid,
                                "audit_log": str(s.audit_log),
                                "log": str(s.backend.log_path)},
                }
                for s in self.servers
            ],
            "users": {user: {"token": token} for user, token in self.tokens.items()},
        }

    def write_state(self) -> None:
        _write_atomic(self.state_file, json.dumps(self.state(), indent=2) + "\n", 0o600)


def _sees(state: object, max_age: float | None = None) -> bool:
    if not (isinstance(state, dict) and state.get("reachable") and state.get("hasSnapshot")):
        return False
    if max_age is None:
        return True
    age = state.get("secondsSinceSuccess")
    return isinstance(age, (int, float)) and age <= max_age


# --------------------------------------------------------------------------- validation


def parse_versions(versions: str | Sequence[str]) -> list[str]:
    """``"1.35,1.35,1.36"`` (or a list) -> checked minor versions; UsageError if bad."""
    from mvproxy.devcluster.catalog import available_versions

    items = versions.split(",") if isinstance(versions, str) else list(versions)
    items = [v.strip() for v in items]
    available = available_versions()
    bad = [v for v in items if v not in available]
    if not items or bad or not 1 <= len(items) <= MAX_SERVERS:
        what = (f"unknown Kubernetes version(s) {', '.join(repr(v) for v in bad)}"
                if bad else f"expected 1 to {MAX_SERVERS} versions, got {len(items)}")
        raise UsageError(f"--versions: {what}; available: {', '.join(available)} "
                         f"(e.g. --versions {','.join(DEFAULT_VERSIONS)})")
    return items


def port_taken(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def allocate_ports(base_port: int, count: int,
                   hosts: Sequence[str] | None = None) -> list[tuple[int, int, int]]:
    """(mvproxy, kube-apiserver, admin) ports per server, each checked on that server's
    host (``hosts``, default 127.0.0.1 for all); UsageError if one is taken."""
    where = list(hosts) if hosts is not None else [HOST] * count
    if len(where) != count:
        raise ValueError(f"{count} servers but {len(where)} hosts")
    if base_port == 0:
        chosen: set[int] = set()

        def pick(host: str) -> int:
            for _ in range(100):
                port = free_port(host)
                if port not in chosen:
                    chosen.add(port)
                    return port
            raise DemoError(f"cannot find enough free ports on {host}")

        return [(pick(h), pick(h), pick(h)) for h in where]
    highest = base_port + ADMIN_PORT_OFFSET + count - 1
    if base_port < 1 or highest > 65535:
        top = 65535 - ADMIN_PORT_OFFSET - count + 1
        raise UsageError(f"--base-port: {base_port} does not fit {count} servers (the demo "
                         f"uses {base_port}..{highest}); pick 1..{top}, or 0 for free ports")
    ports = [(base_port + i, base_port + BACKEND_PORT_OFFSET + i,
              base_port + ADMIN_PORT_OFFSET + i) for i in range(count)]
    taken = [p for triple, host in zip(ports, where, strict=True) for p in triple
             if port_taken(p, host)]
    if taken:
        shown = ", ".join(sorted(set(where)))
        raise UsageError(f"port{'s' if len(taken) > 1 else ''} "
                         f"{', '.join(map(str, taken))} on {shown} already in use; "
                         f"pick another --base-port (the demo uses {base_port}..{highest}), "
                         f"or --base-port 0 for free ports")
    return ports


def _pid_alive(pid: object, marker: bytes = b"mvproxy") -> bool:
    """Alive and (where /proc tells) running a command line that holds ``marker``."""
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.parent.parent.is_dir() and Path("/proc/self").exists():
        try:
            return marker in cmdline.read_bytes()  # not a recycled pid
        except OSError:
            return False
    return True


def state_pids(doc: object) -> list[int]:
    """Every pid a demo.json document lists: each server's mvproxy and kube-apiserver,
    and with ``--real`` its etcd and kube-controller-managers."""
    if not isinstance(doc, dict):
        return []
    entries: list[object] = [doc.get("etcd")]
    servers = doc.get("servers")
    for server in servers if isinstance(servers, list) else ():
        if isinstance(server, dict):
            entries += [server.get("proxy"), server.get("backend")]
    managers = doc.get("controllerManagers")
    entries += managers if isinstance(managers, list) else []
    pids = [e.get("pid") for e in entries if isinstance(e, dict)]
    return [p for p in pids if isinstance(p, int)]


def running_pids(directory: StrPath) -> list[int]:
    """Pids of the processes of a demo in ``directory`` (per its demo.json) still alive."""
    root = Path(directory).absolute()
    try:
        doc = json.loads((root / "demo.json").read_text("utf-8"))
    except (OSError, ValueError):
        return []
    # Each command line names mvproxy or a file in the demo's directory (etcd's data).
    return [p for p in state_pids(doc)
            if _pid_alive(p) or _pid_alive(p, str(root).encode())]


def check_directory(directory: StrPath) -> Path:
    """The demo directory, absolute; UsageError if it is a file or a demo runs there."""
    root = Path(directory).absolute()
    if root.exists() and not root.is_dir():
        raise UsageError(f"--dir: {root} exists and is not a directory")
    alive = running_pids(root)
    if alive:
        raise UsageError(
            f"{root} holds a demo that is still running (pids {', '.join(map(str, alive))}); "
            f"stop it first (Ctrl-C in its terminal, or kill {' '.join(map(str, alive))}) "
            f"or use another --dir")
    return root


# --------------------------------------------------------------------------- files


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def mvproxy_config(sid: str, ports: tuple[int, int, int],
                   peers: Sequence[tuple[str, str]], poll_interval: str,
                   lease_timing: tuple[str, str] | None = None, host: str = HOST) -> str:
    """The ``DIR/<sid>/mvproxy.yaml`` of one member: listeners on ``host``, its backend
    there too, the PKI in ``DIR/pki``; ``peers`` are (server ID, URL) when static."""
    proxy_port, backend_port, admin_port = ports
    pki = f"../pki/{sid}"
    doc: dict[str, Any] = {
        "apiVersion": "mvproxy.io/v1alpha1",
        "kind": "MvproxyConfiguration",
        "serverID": sid,
        "bindAddress": host,
        "securePort": proxy_port,
        "tlsCertFile": f"{pki}/mvproxy.crt",
        "tlsPrivateKeyFile": f"{pki}/mvproxy.key",
        "clientCAFile": "../pki/ca.crt",
        "backend": {
            "url": f"https://{host}:{backend_port}",
            "caFile": "../pki/ca.crt",
            "certFile": f"{pki}/front-proxy-client.crt",
            "keyFile": f"{pki}/front-proxy-client.key",
        },
    }
    if peers or lease_timing:
        # Peers are proven by the front-proxy CA, which signs only proxies (docs/security.md,
        # "Identity"); their serving certificates by the cluster CA.
        doc["peer"] = {"caFile": "../pki/ca.crt", "clientCAFile": "../pki/front-proxy-ca.crt",
                       "certFile": f"{pki}/front-proxy-client.crt",
                       "keyFile": f"{pki}/front-proxy-client.key"}
    if lease_timing:
        # Each mvproxy publishes its URL in a Lease through its backend (shared store).
        doc["peer"]["advertiseURL"] = f"https://{host}:{proxy_port}"
        doc["peers"] = {"leases": {"enabled": True, "leaseDuration": lease_timing[0],
                                   "renewPeriod": lease_timing[1]}}
    elif peers:
        doc["peers"] = {"static": [{"serverID": pid, "url": url} for pid, url in peers]}
    doc["discovery"] = {"pollInterval": poll_interval}
    doc["admin"] = {"bindAddress": host, "port": admin_port}
    doc["logging"] = {"format": "text", "verbosity": 2}
    doc["timeouts"] = {"shutdownGracePeriod": "3s"}
    header = (
        f"# mvproxy configuration of {sid}, written by `mvproxy demo` (rewritten on each run).\n"
        "# Paths are relative to this file. Check it with:\n"
        "#   mvproxy check-config mvproxy.yaml\n"
        "# Every key is documented in config/mvproxy.example.yaml of the mvproxy sources.\n")
    return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def write_demo_tokens(root: Path) -> tuple[dict[str, str], Path]:
    """Fresh bearer tokens for demo-admin (system:masters) and demo-viewer (viewer) in
    ``root/tokens.csv``: (kubeconfig user -> token, the file)."""
    tokens = {"admin-token": secrets.token_urlsafe(24),
              "viewer-token": secrets.token_urlsafe(24)}
    token_file = write_token_file(root / "tokens.csv", {
        tokens["admin-token"]: ADMIN_TOKEN_USER,
        tokens["viewer-token"]: VIEWER_TOKEN_USER,
    })
    return tokens, token_file


def write_demo_kubeconfig(root: Path, servers: Sequence[ServerInfo], pki: Path,
                          tokens: Mapping[str, str]) -> Path:
    """``root/kubeconfig``: a context per mvproxy (named by server ID) and one per
    kube-apiserver (``<id>-direct``), users admin (certificate) and the tokens'."""
    from mvproxy.devcluster.kubeconfig import write_kubeconfig

    return write_kubeconfig(
        root / "kubeconfig",
        ca_file=pki / "ca.crt",
        clusters=[(s.context, s.proxy_url) for s in servers]
        + [(s.direct_context, s.backend_url) for s in servers],
        users={
            "admin": {"client-certificate": pki / "admin.crt", "client-key": pki / "admin.key"},
            **{user: {"token": token} for user, token in tokens.items()},
        },
        contexts=[(s.context, s.context, "admin") for s in servers]
        + [(s.direct_context, s.direct_context, "admin") for s in servers],
        current_context=servers[0].context,
    )


def _reset_files(directory: Path, ids: Sequence[str]) -> None:
    """Remove what a previous run left that must not leak into this one."""
    for name in ("store.db", "store.db-wal", "store.db-shm", "store.db-journal", "demo.json"):
        (directory / name).unlink(missing_ok=True)
    logs = directory / "logs"
    if logs.is_dir():
        for log in logs.glob("*.log"):
            log.unlink(missing_ok=True)
    for sid in ids:
        (directory / sid / "audit.log").unlink(missing_ok=True)
    shutil.rmtree(directory / "kubectl-cache", ignore_errors=True)


# --------------------------------------------------------------------------- start


def start_cluster(
    directory: StrPath,
    versions: Sequence[str] = DEFAULT_VERSIONS,
    base_port: int = DEFAULT_BASE_PORT,
    *,
    poll_interval: str = "1s",
    extra_sim_args: Mapping[str, Sequence[str]] | None = None,
    timeout: float = READY_TIMEOUT,
    membership: str = "static",
    lease_timing: tuple[str, str] = DEFAULT_LEASE_TIMING,
    spare_versions: Sequence[str] = (),
) -> DemoCluster:
    """Start the demo control plane in ``directory``; return once it has converged.

    Raises UsageError (bad versions, a port in use, a demo still running there) before
    starting anything, and DemoError/ProcessError (with the failing process's log tail)
    after stopping whatever it started.
    """
    from mvproxy.devpki import init_pki

    if membership not in MEMBERSHIPS:
        raise UsageError(f"--membership: must be one of {', '.join(MEMBERSHIPS)}, "
                         f"got {membership!r}")
    if spare_versions and membership != "leases":
        raise UsageError("spare servers need lease membership (static peers are fixed)")
    started = len(parse_versions(versions))
    versions = parse_versions([*parse_versions(versions), *spare_versions]
                              if spare_versions else versions)
    ids = [server_id(i) for i in range(len(versions))]
    extra = dict(extra_sim_args or {})
    unknown = sorted(set(extra) - set(ids))
    if unknown:
        raise UsageError(f"extra_sim_args: unknown server ID(s) {', '.join(unknown)}; "
                         f"servers: {', '.join(ids)}")
    root = check_directory(directory)
    ports = allocate_ports(base_port, len(versions))

    try:
        root.mkdir(parents=True, exist_ok=True)
        _reset_files(root, ids)
        pki = root / "pki"
        init_pki(pki, ids, force=True)
        tokens, token_file = write_demo_tokens(root)
        (root / "examples").mkdir(exist_ok=True)
        (root / "examples" / "podgroup.yaml").write_text(PODGROUP_EXAMPLE, "utf-8")
    except OSError as e:
        raise DemoError(f"cannot write the demo files into {root}: {e}") from e

    store = root / "store.db"
    logs = root / "logs"
    servers: list[ServerInfo] = []
    for index, (sid, version, triple) in enumerate(zip(ids, versions, ports, strict=True)):
        sub = root / sid
        sub.mkdir(exist_ok=True)
        config = sub / "mvproxy.yaml"
        peers = [(other, f"https://{HOST}:{ports[j][0]}") for j, other in enumerate(ids)
                 if j != index]
        config.write_text(mvproxy_config(
            sid, triple, peers, poll_interval,
            lease_timing if membership == "leases" else None), "utf-8")
        audit = sub / "audit.log"
        backend = SimProcess(
            kubernetes_version=version, server_id=sid, pki_dir=pki, port=triple[1],
            store=store, log_dir=logs, token_auth_file=token_file, audit_log_path=audit,
            extra_args=extra.get(sid, ()))
        backend.name = f"{sid}-apiserver"
        backend.log_path = logs / f"{backend.name}.log"
        proxy = ManagedProcess(
            [sys.executable, "-m", "mvproxy", "run", "--config", str(config)],
            f"{sid}-mvproxy", logs, ready_url=f"http://{HOST}:{triple[2]}/readyz")
        servers.append(ServerInfo(sid, version, triple[0], triple[1], triple[2],
                                  proxy, backend, config, audit))

    kubeconfig = write_demo_kubeconfig(root, servers, pki, tokens)
    cluster = DemoCluster(root, servers, kubeconfig, pki / "ca.crt", pki, store, tokens,
                          root / "demo.json",
                          showcase=replace(PODGROUPS, example=root / "examples" / "podgroup.yaml"))
    try:
        # In parallel: every process starts at once, then we wait for all of them.
        first = servers[:started]  # spares wait for start_member
        for server in first:
            server.backend.start()
        for server in first:
            server.proxy.start()
        cluster.write_state()
        deadline = time.monotonic() + timeout
        for process in [s.backend for s in first] + [s.proxy for s in first]:
            process.wait_ready(max(0.1, deadline - time.monotonic()))
        cluster.wait_converged(max(0.1, deadline - time.monotonic()))
    except BaseException:
        with contextlib.suppress(Exception):
            cluster.stop()
        raise
    return cluster


# --------------------------------------------------------------------------- the CLI


def _count(n: int, noun: str) -> str:
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
    return f"{n} {noun if n == 1 else plural}"


#: Where a source checkout keeps the pinned kubectl binaries the test suite downloads.
TOOLS_DIR = Path(__file__).resolve().parents[2] / ".tools"
FETCH_KUBECTL = "python3 scripts/dev.py kubectl"


def version_key(version: str) -> tuple[int, ...]:
    """``1.35`` or ``1.35.4`` as a tuple that sorts by release."""
    return tuple(int(part) for part in version.removeprefix("v").split(".") if part.isdigit())


def _version_key(path: Path) -> tuple[int, ...]:
    digits = path.name.removeprefix("kubectl-v").split(".")
    return tuple(int(d) for d in digits if d.isdigit())


def _kubectl_hint(tools_dir: Path = TOOLS_DIR) -> tuple[str, str | None]:
    """(the kubectl command to print, a note saying where it came from or how to get one).

    kubectl on PATH wins; else the newest pinned one in the checkout's ``.tools/``
    (by its full path, so the commands work as pasted); else how to fetch one.
    """
    if shutil.which("kubectl"):
        return "kubectl", None
    pinned = sorted((p for p in tools_dir.glob("kubectl-v*")
                     if p.is_file() and os.access(p, os.X_OK)), key=_version_key)
    if pinned:
        return shlex.quote(str(pinned[-1])), ("kubectl is not on your PATH; using the "
                                              f"pinned one the tests downloaded: {pinned[-1]}")
    return "kubectl", (f"kubectl is not on your PATH: `{FETCH_KUBECTL}` (from the "
                       "repository) downloads a pinned one into .tools/ and prints its "
                       f"path; or install any kubectl >= {MIN_KUBECTL} "
                       "(https://kubernetes.io/docs/tasks/tools/).")


def _mvproxy_command() -> str:
    """How to call mvproxy itself: the console script next to this interpreter."""
    beside = Path(sys.executable).parent / "mvproxy"
    if shutil.which("mvproxy") or not beside.is_file():
        return "mvproxy"
    return shlex.quote(str(beside))


def guide(cluster: DemoCluster, elapsed: float | None = None) -> str:
    """What to try, for a newcomer to copy and paste."""
    kubectl, note = _kubectl_hint()
    mvproxy = _mvproxy_command()
    q = shlex.quote
    servers = cluster.servers
    first = servers[0]
    newest = max(servers, key=lambda s: version_key(s.version))
    old = next((s for s in servers if s.version != newest.version), None)
    versions = ", ".join(s.version for s in servers)
    took = f" (ready in {elapsed:.1f}s)" if elapsed is not None else ""
    show = cluster.showcase
    lines = [
        f"mvproxy demo: {_count(len(servers), 'kube-apiserver')} ({versions}), each behind "
        f"its own mvproxy, sharing {cluster.shared_store}{took}.",
        "",
        f"  {'server':<13} {'version':<8} {'mvproxy (kubectl)':<24} "
        f"{'kube-apiserver':<24} admin (metrics)",
    ]
    for s in servers:
        lines.append(f"  {s.id:<13} {s.version:<8} {s.proxy_url:<24} "
                     f"{s.backend_url:<24} {s.admin_url}")
    lines += ["", "Try it in another terminal:"]
    if note:
        lines.append(f"  # {note}")
    lines += [
        f"  export KUBECONFIG={q(str(cluster.kubeconfig))}",
        f"  {kubectl} config get-contexts    # one context per mvproxy; "
        f"<id>-direct bypasses mvproxy",
        f"  {kubectl} --context {first.id} get namespaces",
    ]
    if old is not None and show is not None:
        gv = f"{show.group}/{show.version}" if show.group else show.version
        lines += [
            "",
            f"  # {show.title or show.resource} ({gv}) exist only in {newest.version}. "
            f"{old.id} runs {old.version},",
            "  # yet through its mvproxy it lists them (discovery merged from its peers) ...",
            f"  {kubectl} --context {old.context} api-resources --api-group {q(show.group)}",
            "  # ... while its kube-apiserver alone does not:",
            f"  {kubectl} --context {old.direct_context} api-resources "
            f"--api-group {q(show.group)}",
        ]
        if show.example is not None:
            lines += [
                f"  # Create one through {old.id}: mvproxy forwards it to a {newest.version} "
                "peer.",
                f"  {kubectl} --context {old.context} create -f {q(str(show.example))}",
                f"  {kubectl} --context {old.context} get {show.resource}",
                f"  grep -l {show.resource} {q(str(cluster.directory))}/*/audit.log"
                f"    # only {newest.version} kube-apiservers saw them",
            ]
    lines += [
        "",
        "  # Other users: admin-token (system:masters), viewer-token (read-only):",
        f"  {kubectl} --context {first.id} --user viewer-token get namespaces",
        f"  {kubectl} --context {first.id} --user viewer-token create namespace nope"
        "    # Forbidden",
        "",
        f"  {mvproxy} --help    # mvproxy itself: every command and its options",
        "",
        "  # What mvproxy sees: discovery state of its backend and peers, and metrics",
        "  # (apiserver_rerouted_request_total counts requests forwarded to a peer):",
        f"  curl -s {first.admin_url}/debug/mvproxy",
        f"  curl -s {first.admin_url}/metrics | grep -E '^(apiserver_rerouted|mvproxy_peer_up)'",
    ]
    lines += [
        "",
        f"Files in {cluster.directory}: demo.json (every URL, pid and token), kubeconfig, "
        "pki/, logs/, <id>/mvproxy.yaml, <id>/audit.log",
        "Press Ctrl-C to stop everything.",
    ]
    return "\n".join(lines) + "\n"


def run_demo(args: argparse.Namespace) -> int:
    """``mvproxy demo``: start, print the guide, run until SIGINT/SIGTERM/SIGHUP, stop, exit 0.

    With ``--real`` the control plane is ``realdemo``'s (real etcd and kube-apiservers);
    bad versions or missing binaries are refused before anything starts.
    """
    directory = Path(args.dir)
    real = bool(getattr(args, "real", False))
    start: Callable[[], DemoCluster]
    if real:
        from mvproxy.devcluster.realdemo import cli_starter

        versions, start = cli_starter(args)
        what = f"etcd, {_count(len(versions), 'real kube-apiserver')} ({', '.join(versions)})"
    else:
        if getattr(args, "kube_binaries", None):
            raise UsageError("--kube-binaries: only with --real (the simulator needs no "
                             "binaries)")
        versions = parse_versions(DEFAULT_VERSIONS if args.versions is None else args.versions)

        def start() -> DemoCluster:
            return start_cluster(directory, versions, args.base_port,
                                 membership=getattr(args, "membership", "static"))

        what = _count(len(versions), "kube-apiserver")
    stop = threading.Event()

    def interrupt_startup(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGTERM and SIGHUP (terminal closed) too: the children run in their own sessions,
    # so nobody else would stop them.
    stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in stopping}
    for sig in previous:
        signal.signal(sig, interrupt_startup)
    try:
        print(f"mvproxy demo: starting {what} "
              f"and {_count(len(versions), 'mvproxy')} in {directory.absolute()} ...",
              flush=True)
        started = time.monotonic()
        try:
            cluster = start()
        except KeyboardInterrupt:
            print("mvproxy demo: interrupted during startup; stopped everything.",
                  file=sys.stderr, flush=True)
            return 130
        with cluster:
            for sig in previous:
                signal.signal(sig, lambda signum, frame: stop.set())
            print(guide(cluster, time.monotonic() - started), end="", flush=True)
            reported: set[str] = set()
            while not stop.wait(0.5):
                for proc in cluster.processes:
                    if proc.returncode is not None and proc.name not in reported:
                        reported.add(proc.name)
                        print(f"mvproxy demo: {proc.name} exited with code {proc.returncode}; "
                              f"see {proc.log_path}", file=sys.stderr, flush=True)
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)  # stopping is bounded; finish it
            print("\nmvproxy demo: stopping ...", flush=True)
        print("mvproxy demo: stopped.", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


__all__ = [
    "PODGROUPS",
    "DemoCluster",
    "DemoError",
    "ServerInfo",
    "Showcase",
    "allocate_ports",
    "check_directory",
    "mvproxy_config",
    "parse_versions",
    "port_taken",
    "run_demo",
    "running_pids",
    "start_cluster",
    "state_pids",
    "version_key",
    "write_demo_kubeconfig",
    "write_demo_tokens",
]
