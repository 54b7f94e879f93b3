"""``mvproxy demo --real``: the demo's mixed-version control plane with real components.

``start_real_cluster`` builds it in one directory and returns a ``RealCluster`` (a
``DemoCluster``: the same ``demo.json``, kubeconfig contexts ``<id>`` and
``<id>-direct``, and guide) once every process is ready and every mvproxy sees its
backend and all its peers:

* one etcd (``DIR/etcd``, on 127.0.0.1, no fsync: the data starts afresh each run);
* one real kube-apiserver per version, member ``i`` on its own address 127.0.0.(2+i),
  started oldest first as in an upgrade (the oldest is ready before the others start),
  all sharing etcd, one service-account key pair (``DIR/pki/sa.key``) and one service
  range; flags as kubeadm lays them out (``kubeprocs``); each has its own hostname
  (the server ID), so its own server ID and identity Lease;
* RBAC set up through the oldest server: the token user demo-viewer (group
  ``viewer``) may read everything and change nothing, and with lease membership the
  mvproxies (group ``system:mvproxies``) may keep Leases in kube-system;
* one ``mvproxy run`` in front of each, on the member's address, with the others as
  static peers or found through Leases (``membership="leases"``).

Ports: as in the simulated demo (mvproxy ``base_port + i``, kube-apiserver
``base_port + 100 + i``, admin ``base_port + 200 + i``, on the member's address), plus
etcd's client and peer ports ``base_port + 300`` and ``+ 301`` on 127.0.0.1.
``base_port=0`` picks free ports.

Binaries come from ``kubebinaries``' lookup under ``binaries`` (a cache root:
``<root>/<version>/{kube-apiserver,kube-controller-manager,etcd}``), else
``$MVPROXY_KUBE_BINARIES``, else the cache ``scripts/dev.py kube-binaries`` fills.

``RealCluster`` also restarts or replaces a kube-apiserver (a rolling-upgrade step,
with no mvproxy restart) and starts kube-controller-managers; every process it started
ends with ``stop()`` (or leaving its ``with`` block). Each process is a
``ManagedProcess`` (``stop``, ``kill``, ``freeze``, ``resume``) reachable as
``cluster.server(sid).backend`` / ``.proxy``, ``cluster.etcd``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import ssl
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mvproxy.devcluster import kubebinaries
from mvproxy.devcluster.demo import (
    DEFAULT_BASE_PORT,
    DEFAULT_LEASE_TIMING,
    HOST,
    MAX_SERVERS,
    MEMBERSHIPS,
    STOP_TIMEOUT,
    DemoCluster,
    DemoError,
    ServerInfo,
    Showcase,
    allocate_ports,
    check_directory,
    mvproxy_config,
    port_taken,
    server_id,
    version_key,
    write_demo_kubeconfig,
    write_demo_tokens,
)
from mvproxy.devcluster.kubehttp import GVR, create_objects, served_resources
from mvproxy.devcluster.kubeprocs import (
    AUDIT_POLICY,
    FIRST_SERVICE_IP,
    EtcdProcess,
    KubeAPIServerProcess,
    KubeControllerManagerProcess,
)
from mvproxy.devcluster.launcher import ManagedProcess, free_port, stop_all
from mvproxy.errors import PKIError, UsageError

StrPath = str | os.PathLike[str]

DEFAULT_REAL_VERSIONS = ("1.35.4", "1.36.3")
ETCD_PORT_OFFSET = 300  # client; the peer port is the next one
READY_TIMEOUT = 120.0  # etcd, every kube-apiserver one after another, and convergence
AUDIT_POLICY_FILE = "audit-policy.yaml"
KCM_USER = "system:kube-controller-manager"  # bound to its ClusterRole by RBAC's bootstrap

#: The new-only resource the guide prefers (GA and on by default from 1.36; 1.35 has none).
MAP_GVR = ("admissionregistration.k8s.io", "v1", "mutatingadmissionpolicies")
MAP_EXAMPLE = """\
# A MutatingAdmissionPolicy: admissionregistration.k8s.io/v1 is served from 1.36 on.
# Created through a 1.35 server's mvproxy, it is forwarded to a newer peer. (Without a
# MutatingAdmissionPolicyBinding it changes nothing.)
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingAdmissionPolicy
metadata:
  name: demo-label-configmaps
spec:
  matchConstraints:
    resourceRules:
    - apiGroups: [""]
      apiVersions: ["v1"]
      operations: ["CREATE"]
      resources: ["configmaps"]
  failurePolicy: Fail
  reinvocationPolicy: Never
  mutations:
  - patchType: ApplyConfiguration
    applyConfiguration:
      expression: >
        Object{metadata: Object.metadata{labels: {"mvproxy-demo": "mutated"}}}
"""


def member_host(index: int) -> str:
    """The loopback address of member ``index``: 127.0.0.2, 127.0.0.3, ..."""
    return f"127.0.0.{2 + index}"


# --------------------------------------------------------------------------- validation


def parse_real_versions(versions: str | Sequence[str]) -> list[str]:
    """``"1.35.4,1.36.3"`` (or a list) -> normalized releases; UsageError unless each is
    X.Y.Z and all are within one minor of each other (Kubernetes' skew policy for
    kube-apiservers of one control plane)."""
    items = versions.split(",") if isinstance(versions, str) else list(versions)
    items = [v.strip() for v in items]
    example = ",".join(DEFAULT_REAL_VERSIONS)
    parsed: list[tuple[int, int, int]] = []
    bad = []
    for item in items:
        try:
            parsed.append(kubebinaries.parse_version(item))
        except ValueError:
            bad.append(item)
    if bad or not 1 <= len(items) <= MAX_SERVERS:
        what = (f"--real needs full releases X.Y.Z, got {', '.join(repr(v) for v in bad)}"
                if bad else f"expected 1 to {MAX_SERVERS} versions, got {len(items)}")
        raise UsageError(f"--versions: {what} (e.g. --versions {example})")
    lines = {(major, minor) for major, minor, _ in parsed}
    if len({major for major, _ in lines}) > 1 or \
            max(minor for _, minor in lines) - min(minor for _, minor in lines) > 1:
        raise UsageError(f"--versions: {', '.join(items)} span more than one minor release; "
                         "the kube-apiservers of one control plane must be within one minor "
                         f"of each other (e.g. --versions {example})")
    return ["%d.%d.%d" % v for v in parsed]


def check_addresses(hosts: Sequence[str]) -> None:
    """UsageError unless this machine can listen on every member address (Linux routes
    all of 127.0.0.0/8 to loopback; macOS, for one, has only 127.0.0.1 by default)."""
    for host in hosts:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, 0))
            except OSError as e:
                raise UsageError(
                    f"--real: cannot listen on {host} ({e.strerror or e}); each server needs "
                    f"its own loopback address (127.0.0.2 and up). Add them to the loopback "
                    f"interface first (on macOS: sudo ifconfig lo0 alias {host})") from None


def binaries_root(directory: StrPath | None = None) -> Path:
    """Where to look: ``directory`` (``--kube-binaries``), else the builder's cache root
    (``$MVPROXY_KUBE_BINARIES``, else ``~/.cache/mvproxy/kube``)."""
    return Path(directory).expanduser() if directory else kubebinaries.cache_root()


def resolve_binaries(versions: Sequence[str], root: Path) -> dict[str, Path]:
    """Version -> the directory holding its three binaries; UsageError naming the
    command that builds whatever is missing."""
    found: dict[str, Path] = {}
    missing: list[str] = []
    details: list[str] = []
    for version in dict.fromkeys(versions):
        directory = kubebinaries.find_binaries(version, root)
        if directory is not None:
            found[version] = directory
            continue
        missing.append(version)
        partial = kubebinaries.version_dir(root, version)
        if partial.is_dir():
            details.append(f"{partial} lacks "
                           f"{', '.join(kubebinaries.missing_binaries(partial))}")
    if missing:
        seen = f" ({'; '.join(details)})" if details else ""
        raise UsageError(
            f"--real: no kube-apiserver, kube-controller-manager and etcd for "
            f"{', '.join(missing)} under {root}{seen}. Build them from the mvproxy sources "
            f"with `{kubebinaries.BUILD_COMMAND} {','.join(missing)}` (needs Go; about 5 "
            f"minutes per version), or name a directory holding "
            f"<version>/{{{','.join(kubebinaries.BINARIES)}}} with --kube-binaries DIR "
            f"or ${kubebinaries.ENV_ROOT}")
    return found


# --------------------------------------------------------------------------- the cluster


@dataclass
class RealCluster(DemoCluster):
    """A running ``mvproxy demo --real`` control plane (see the module docstring)."""

    etcd: EtcdProcess = field(kw_only=True)
    binaries: Path = field(kw_only=True)  # the root the binaries were found under
    apiserver_args: dict[str, list[str]] = field(kw_only=True, default_factory=dict)
    controller_managers: list[KubeControllerManagerProcess] = field(
        kw_only=True, default_factory=list)

    # ------------------------------------------------------------------ lookup

    def backend(self, sid: str) -> KubeAPIServerProcess:
        """The kube-apiserver of server ``sid``."""
        process = self.server(sid).backend
        assert isinstance(process, KubeAPIServerProcess)
        return process

    @property
    def processes(self) -> list[ManagedProcess]:
        return [self.etcd, *super().processes, *self.controller_managers]

    @property
    def oldest(self) -> ServerInfo:
        return min(self.servers, key=lambda s: version_key(s.version))

    @property
    def newest(self) -> ServerInfo:
        return max(self.servers, key=lambda s: version_key(s.version))

    def admin_context(self) -> ssl.SSLContext:
        """TLS as the admin user (cluster CA, ``pki/admin.crt``), for direct requests."""
        from mvproxy.tls import client_context

        return client_context(self.pki / "ca.crt", self.pki / "admin.crt",
                              self.pki / "admin.key")

    def served(self, sid: str) -> frozenset[GVR]:
        """What server ``sid``'s kube-apiserver itself serves: (group, version, resource)
        from its own discovery (asked directly, ``profile=nopeer``)."""
        return served_resources(self.server(sid).backend_url, self.admin_context())

    def binary(self, version: str, name: str) -> Path:
        """``name`` (kube-apiserver, ...) of ``version``; UsageError if not built."""
        return resolve_binaries([version], self.binaries)[version] / name

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Stop the kube-controller-managers, every mvproxy, every kube-apiserver, then
        etcd. Idempotent."""
        try:
            try:
                stop_all(self.controller_managers, STOP_TIMEOUT)
            finally:
                super().stop()
        finally:
            self.etcd.stop(STOP_TIMEOUT)

    def restart_backend(self, sid: str, *, timeout: float = READY_TIMEOUT) -> None:
        """Stop server ``sid``'s kube-apiserver (if running) and start it again; return
        once it is ready and every mvproxy has polled discovery since."""
        backend = self.server(sid).backend
        backend.stop(STOP_TIMEOUT)
        self._start_backend(sid, backend, timeout)

    def replace_backend(self, sid: str, version: str, *,
                        extra_args: Sequence[str] | None = None,
                        timeout: float = READY_TIMEOUT) -> None:
        """One rolling-upgrade step: server ``sid``'s kube-apiserver stopped and replaced
        by ``version`` (same address, port, hostname, etcd and files; ``extra_args``
        replace its extra flags, default: keep them). Its mvproxy keeps running; this
        returns once every mvproxy has polled discovery from the new server."""
        (version,) = parse_real_versions([version])
        server = self.server(sid)
        if extra_args is not None:
            self.apiserver_args[sid] = list(extra_args)
        replacement = apiserver_process(
            self.binary(version, "kube-apiserver"), version, sid, server.host,
            server.backend_port, root=self.directory, etcd_url=self.etcd.client_url,
            extra_args=self.apiserver_args.get(sid, ()))
        server.backend.stop(STOP_TIMEOUT)
        server.backend, server.version = replacement, version
        self._start_backend(sid, replacement, timeout)

    def _start_backend(self, sid: str, backend: ManagedProcess, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        backend.start()
        self.write_state()
        backend.wait_ready(timeout)
        self.wait_converged(max(0.1, deadline - time.monotonic()),
                            polled_since=time.monotonic())

    def start_controller_manager(self, sid: str | None = None, *, direct: bool = False,
                                 version: str | None = None,
                                 extra_args: Sequence[str] = (),
                                 timeout: float = READY_TIMEOUT
                                 ) -> KubeControllerManagerProcess:
        """Start a kube-controller-manager (``version``, default the oldest server's, as
        the skew policy says) talking to server ``sid`` (default the oldest) through
        its mvproxy, or straight to its kube-apiserver with ``direct``; as user
        system:kube-controller-manager, no leader election. Returns it once its
        ``/healthz`` answers; ``stop()`` stops it with the cluster."""
        from mvproxy.devcluster.kubeconfig import write_kubeconfig

        server = self.server(sid) if sid is not None else self.oldest
        version = parse_real_versions([version or self.oldest.version])[0]
        name = f"kube-controller-manager-{len(self.controller_managers)}"
        home = self.directory / "controller-managers" / name
        home.mkdir(parents=True, exist_ok=True)
        users = self.pki / "users"
        kubeconfig = write_kubeconfig(
            home / "kubeconfig", ca_file=self.ca,
            clusters=[(server.id, server.backend_url if direct else server.proxy_url)],
            users={"kcm": {"client-certificate": users / "kube-controller-manager.crt",
                           "client-key": users / "kube-controller-manager.key"}},
            contexts=[("kcm", server.id, "kcm")], current_context="kcm")
        process = KubeControllerManagerProcess(
            self.binary(version, "kube-controller-manager"), version=version, name=name,
            kubeconfig=kubeconfig, pki_dir=self.pki, host=HOST, port=free_port(HOST),
            cert_dir=home / "serving", log_dir=self.directory / "logs",
            extra_args=extra_args)
        self.controller_managers.append(process)
        process.start()
        self.write_state()
        process.wait_ready(timeout)
        return process

    # ------------------------------------------------------------------ demo.json

    def state(self) -> dict[str, Any]:
        doc = super().state()
        doc["real"] = True
        doc["binaries"] = str(self.binaries)
        doc["etcd"] = {"url": self.etcd.client_url, "pid": self.etcd.pid,
                       "data_dir": str(self.etcd.data_dir), "log": str(self.etcd.log_path)}
        for entry, server in zip(doc["servers"], self.servers, strict=True):
            backend = server.backend
            entry["backend"]["hostname"] = server.id
            if isinstance(backend, KubeAPIServerProcess):
                entry["backend"]["binary"] = str(backend.binary)
        doc["controllerManagers"] = [
            {"name": p.name, "version": p.version, "pid": p.pid,
             "kubeconfig": str(p.kubeconfig), "log": str(p.log_path)}
            for p in self.controller_managers]
        return doc


def apiserver_process(binary: Path, version: str, sid: str, host: str, port: int, *,
                      root: Path, etcd_url: str,
                      extra_args: Sequence[str] = ()) -> KubeAPIServerProcess:
    """Member ``sid``'s kube-apiserver at ``version`` on ``host:port``, with the files of
    the demo directory ``root`` (``pki/``, ``tokens.csv``, ``audit-policy.yaml``,
    ``<id>/audit.log``, ``logs/<id>-apiserver.log``); its hostname is the server ID."""
    pki = root / "pki"
    return KubeAPIServerProcess(
        binary, version=version, name=f"{sid}-apiserver", hostname=sid, host=host,
        port=port, etcd_url=etcd_url, pki_dir=pki, server_pki=pki / sid,
        token_auth_file=root / "tokens.csv", audit_policy=root / AUDIT_POLICY_FILE,
        audit_log=root / sid / "audit.log", log_dir=root / "logs", extra_args=extra_args)


def pick_showcase(old: frozenset[GVR], new: frozenset[GVR],
                  examples: Path) -> Showcase | None:
    """What the guide shows: MutatingAdmissionPolicies (with an example manifest
    written into ``examples``) when only the newer server serves them, else the first
    new-only resource, else nothing."""
    only = sorted(new - old)
    if MAP_GVR in only:
        examples.mkdir(exist_ok=True)
        example = examples / "mutatingadmissionpolicy.yaml"
        example.write_text(MAP_EXAMPLE, "utf-8")
        return Showcase(*MAP_GVR, title="MutatingAdmissionPolicies", example=example)
    return Showcase(*only[0]) if only else None


def _bootstrap_objects(membership: str) -> list[tuple[str, dict[str, Any]]]:
    """RBAC the demo needs beyond the servers' own bootstrap policy."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    group = "rbac.authorization.k8s.io"
    viewer = {"name": "mvproxy-demo-viewer"}
    objects: list[tuple[str, dict[str, Any]]] = [(f"{rbac}/clusterroles", {
        # Read everything, as the simulator's viewer does (ClusterRole view leaves out
        # cluster-scoped resources such as namespaces).
        "apiVersion": f"{group}/v1", "kind": "ClusterRole", "metadata": viewer,
        "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list", "watch"]}],
    }), (f"{rbac}/clusterrolebindings", {
        "apiVersion": f"{group}/v1", "kind": "ClusterRoleBinding", "metadata": viewer,
        "roleRef": {"apiGroup": group, "kind": "ClusterRole", "name": viewer["name"]},
        "subjects": [{"apiGroup": group, "kind": "Group", "name": "viewer"}],
    })]
    if membership == "leases":  # as config/mvproxy-leases-rbac.yaml
        namespaced = f"{rbac}/namespaces/kube-system"
        meta = {"name": "mvproxy-membership", "namespace": "kube-system"}
        objects += [(f"{namespaced}/roles", {
            "apiVersion": f"{group}/v1", "kind": "Role", "metadata": meta,
            "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                       "verbs": ["get", "list", "watch", "create", "update", "delete"]}],
        }), (f"{namespaced}/rolebindings", {
            "apiVersion": f"{group}/v1", "kind": "RoleBinding", "metadata": meta,
            "roleRef": {"apiGroup": group, "kind": "Role", "name": "mvproxy-membership"},
            "subjects": [{"apiGroup": group, "kind": "Group", "name": "system:mvproxies"}],
        })]
    return objects


def _prepare(root: Path, ids: Sequence[str], hosts: Sequence[str]) -> dict[str, str]:
    """The run's files: a fresh PKI (own SANs per member, the service-account key pair,
    the kube-controller-manager's certificate), tokens, the audit policy; whatever a
    previous run left (etcd data, logs, audit logs) removed."""
    import shutil

    from mvproxy.devpki import init_pki, issue_client_certificate

    root.mkdir(parents=True, exist_ok=True)
    for stale in ("etcd", "logs", "controller-managers", "kubectl-cache", "examples"):
        shutil.rmtree(root / stale, ignore_errors=True)
    (root / "demo.json").unlink(missing_ok=True)
    for sid in ids:
        (root / sid / "audit.log").unlink(missing_ok=True)
    pki = root / "pki"
    init_pki(pki, ids, [FIRST_SERVICE_IP], force=True,
             server_hosts={sid: [host] for sid, host in zip(ids, hosts, strict=True)},
             service_account_key=True)
    issue_client_certificate(pki, "kube-controller-manager", KCM_USER)
    tokens, _ = write_demo_tokens(root)
    (root / AUDIT_POLICY_FILE).write_text(AUDIT_POLICY, "utf-8")
    return tokens


# --------------------------------------------------------------------------- start


def start_real_cluster(
    directory: StrPath,
    versions: Sequence[str] = DEFAULT_REAL_VERSIONS,
    base_port: int = DEFAULT_BASE_PORT,
    *,
    binaries: StrPath | None = None,
    membership: str = "static",
    poll_interval: str = "1s",
    lease_timing: tuple[str, str] = DEFAULT_LEASE_TIMING,
    extra_apiserver_args: Mapping[str, Sequence[str]] | None = None,
    mvproxies: bool = True,
    timeout: float = READY_TIMEOUT,
) -> RealCluster:
    """Start the real control plane in ``directory``; return once it has converged.

    ``mvproxies=False`` starts no mvproxy (each ``server(id).proxy`` is made but never
    started; ``cluster.start_server(id)`` starts it later): the kube-apiservers alone,
    e.g. to compare with their built-in peer proxy.

    UsageError (bad versions, binaries missing, a port in use, a demo running there)
    comes before anything starts; DemoError, ProcessError (with the failing process's
    log tail) or KubeHTTPError after stopping whatever was started.
    """
    if membership not in MEMBERSHIPS:
        raise UsageError(f"--membership: must be one of {', '.join(MEMBERSHIPS)}, "
                         f"got {membership!r}")
    versions = parse_real_versions(versions)
    root_of_binaries = binaries_root(binaries)
    found = resolve_binaries(versions, root_of_binaries)
    ids = [server_id(i) for i in range(len(versions))]
    extra = {sid: list(args) for sid, args in (extra_apiserver_args or {}).items()}
    unknown = sorted(set(extra) - set(ids))
    if unknown:
        raise UsageError(f"extra_apiserver_args: unknown server ID(s) {', '.join(unknown)}; "
                         f"servers: {', '.join(ids)}")
    root = check_directory(directory)
    hosts = [member_host(i) for i in range(len(versions))]
    check_addresses(hosts)
    ports = allocate_ports(base_port, len(versions), hosts)
    etcd_ports = _etcd_ports(base_port)
    try:
        tokens = _prepare(root, ids, hosts)
    except (OSError, PKIError) as e:
        raise DemoError(f"cannot write the demo files into {root}: {e}") from e

    logs = root / "logs"
    oldest_version = min(versions, key=version_key)
    etcd = EtcdProcess(found[oldest_version] / "etcd", data_dir=root / "etcd",
                       client_port=etcd_ports[0], peer_port=etcd_ports[1], log_dir=logs)
    servers: list[ServerInfo] = []
    for index, (sid, host, triple) in enumerate(zip(ids, hosts, ports, strict=True)):
        (root / sid).mkdir(exist_ok=True)
        config = root / sid / "mvproxy.yaml"
        peers = [(other, f"https://{hosts[j]}:{ports[j][0]}") for j, other in enumerate(ids)
                 if j != index]
        config.write_text(mvproxy_config(
            sid, triple, peers, poll_interval,
            lease_timing if membership == "leases" else None, host=host), "utf-8")
        proxy = ManagedProcess(
            [sys.executable, "-m", "mvproxy", "run", "--config", str(config)],
            f"{sid}-mvproxy", logs, ready_url=f"http://{host}:{triple[2]}/readyz")
        backend = apiserver_process(found[versions[index]] / "kube-apiserver",
                                    versions[index], sid, host, triple[1], root=root,
                                    etcd_url=etcd.client_url, extra_args=extra.get(sid, ()))
        servers.append(ServerInfo(sid, versions[index], *triple, proxy, backend, config,
                                  backend.audit_log, host))
    cluster = RealCluster(
        root, servers, write_demo_kubeconfig(root, servers, root / "pki", tokens),
        root / "pki" / "ca.crt", root / "pki", root / "etcd", tokens, root / "demo.json",
        shared_store="one etcd", etcd=etcd, binaries=root_of_binaries, apiserver_args=extra)

    try:
        _start(cluster, membership, timeout, mvproxies)
    except BaseException:
        with contextlib.suppress(Exception):
            cluster.stop()
        raise
    return cluster


def _etcd_ports(base_port: int) -> tuple[int, int]:
    """(client, peer) on 127.0.0.1: base_port + 300 and + 301, or free ones for 0."""
    if base_port == 0:
        client = free_port(HOST)
        peer = free_port(HOST)
        while peer == client:
            peer = free_port(HOST)
        return client, peer
    ports = (base_port + ETCD_PORT_OFFSET, base_port + ETCD_PORT_OFFSET + 1)
    if ports[1] > 65535:
        raise UsageError(f"--base-port: {base_port} leaves no room for etcd's ports "
                         f"({ports[0]}, {ports[1]}); pick at most {65535 - ETCD_PORT_OFFSET - 1}")
    taken = [p for p in ports if port_taken(p, HOST)]
    if taken:
        raise UsageError(f"port{'s' if len(taken) > 1 else ''} {', '.join(map(str, taken))} "
                         f"on {HOST} (etcd's) already in use; pick another --base-port, or "
                         "--base-port 0 for free ports")
    return ports


def _start(cluster: RealCluster, membership: str, timeout: float,
           mvproxies: bool = True) -> None:
    """etcd; the oldest kube-apiserver, then RBAC through it; the others in version
    order and every mvproxy (unless not ``mvproxies``); then wait for all of them and
    for convergence."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    order = sorted(cluster.servers, key=lambda s: version_key(s.version))
    cluster.etcd.start()
    cluster.write_state()
    cluster.etcd.wait_ready(left())
    first = order[0]
    first.backend.start()
    cluster.write_state()
    first.backend.wait_ready(left())
    create_objects(first.backend_url, cluster.admin_context(), _bootstrap_objects(membership))
    for server in order[1:]:
        server.backend.start()
    proxies = [s.proxy for s in cluster.servers] if mvproxies else []
    for proxy in proxies:
        proxy.start()
    cluster.write_state()
    for process in [s.backend for s in order[1:]] + proxies:
        process.wait_ready(left())
    cluster.wait_converged(left())
    if len(cluster.servers) > 1:
        cluster.showcase = pick_showcase(cluster.served(cluster.oldest.id),
                                         cluster.served(cluster.newest.id),
                                         cluster.directory / "examples")
    cluster.write_state()


# --------------------------------------------------------------------------- the CLI


def cli_starter(args: argparse.Namespace) -> tuple[list[str], Callable[[], DemoCluster]]:
    """``mvproxy demo --real``'s versions and how to start it, checked before anything
    starts (UsageError: bad versions, binaries missing)."""
    versions = parse_real_versions(",".join(DEFAULT_REAL_VERSIONS) if args.versions is None
                                   else args.versions)
    root = binaries_root(getattr(args, "kube_binaries", None))
    resolve_binaries(versions, root)

    def start() -> DemoCluster:
        return start_real_cluster(args.dir, versions, args.base_port, binaries=root,
                                  membership=getattr(args, "membership", "static"))

    return versions, start


__all__ = [
    "DEFAULT_REAL_VERSIONS",
    "RealCluster",
    "binaries_root",
    "cli_starter",
    "member_host",
    "parse_real_versions",
    "pick_showcase",
    "resolve_binaries",
    "start_real_cluster",
]
