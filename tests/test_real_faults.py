"""Faults against real kube-apiservers 1.35.4 (old) and 1.36.3 (new), one mvproxy each
(issue 20 §3): what a client of the old server's mvproxy sees when the new server is
killed or frozen, when its own kube-apiserver freezes or shuts down gracefully, while
a watch stays silent past mvproxy's idle timeout, and across a rotation of mvproxy's
front-proxy client certificate whose old certificate then expires.

The new-only set comes from the two servers' own discovery: the releases' own
(``mutatingadmissionpolicies`` and their bindings, new resources in
``admissionregistration.k8s.io/v1``, a group/version both serve) plus ``batch/v1``,
which the old server is started without (``--runtime-config batch/v1=false``, the skew
trick of upstream's own peer-proxy integration test), so that a whole new-only
group/version exists whose freshness merged discovery must mark ``Stale``.

One module-scoped cluster; the old kube-apiserver runs with
``--shutdown-delay-duration`` and ``--shutdown-send-retry-after``; both mvproxies are
restarted once at setup with a 3 s ``listener.idleTimeout`` and a 1 s certificate
reload interval. Every test restores what it broke, every wait is bounded, and every
process is stopped at teardown. Skips without the binaries (fails under CI).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import shutil
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import (
    AGGREGATED_V2,
    Answer,
    aggregated_group_versions,
    audit_entries,
    request,
    tls_context,
    wait_peer_unreachable,
    wait_until,
)
from informer_support import Informer, informer_binary
from real_support import require_binaries

from mvproxy.devcluster.kubehttp import GVR
from mvproxy.devcluster.realdemo import MAP_EXAMPLE, MAP_GVR, RealCluster, start_real_cluster

VERSIONS = ("1.35.4", "1.36.3")
OLD, NEW = "apiserver-0", "apiserver-1"
SHUTDOWN_DELAY = 3  # the old kube-apiserver's --shutdown-delay-duration, seconds
IDLE_TIMEOUT = 3.0  # both mvproxies' listener.idleTimeout, seconds
POLL, STALE_AFTER = 1.0, 3.0  # the demo's discovery.pollInterval and its 3x staleAfter
FAULT_BOUND = 12.0
"""Seconds within which a fault must show: a watch ended, a request answered. The
mechanisms take about staleAfter plus a poll (4 s) or mvproxy's connect timeout (5 s);
the request timeout they replace is 60 s."""
RECOVERY = 60.0  # a kube-apiserver back and every mvproxy converged, client-go backoff
NAMESPACE = "faults"
MAP_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"
CONFIGMAPS = f"/api/v1/namespaces/{NAMESPACE}/configmaps"
ADMIN_USER = "kubernetes-admin"  # pki/admin.crt


# --------------------------------------------------------------------------- the cluster


def _reconfigure(cluster: RealCluster, sid: str) -> None:
    """A short idle timeout and certificate reload interval in ``sid``'s mvproxy
    configuration, then that mvproxy restarted (before any test runs)."""
    server = cluster.server(sid)
    doc = yaml.safe_load(server.config.read_text("utf-8"))
    doc["listener"] = {"idleTimeout": f"{IDLE_TIMEOUT:g}s"}
    doc["certificates"] = {"reloadInterval": "1s"}
    server.config.write_text(yaml.safe_dump(doc, sort_keys=False), "utf-8")
    cluster.stop_server(sid)
    cluster.start_server(sid)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    binaries = require_binaries(VERSIONS)
    old_args = [f"--shutdown-delay-duration={SHUTDOWN_DELAY}s",
                "--shutdown-send-retry-after=true", "--runtime-config=batch/v1=false"]
    with start_real_cluster(tmp_path_factory.mktemp("faults") / "demo", VERSIONS, 0,
                            binaries=binaries,
                            extra_apiserver_args={OLD: old_args}) as running:
        for server in running.servers:
            _reconfigure(running, server.id)
        made = request(running, OLD, "POST", "/api/v1/namespaces", direct=True, body={
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        assert made.status == 201, made
        yield running


@dataclass(frozen=True)
class Skew:
    """What only the new server serves, from the servers' own discovery."""

    resources: frozenset[GVR]
    versions: frozenset[tuple[str, str]]
    """Group/versions the old server serves nothing of."""


@pytest.fixture(scope="module")
def skew(cluster: RealCluster) -> Skew:
    old, new = cluster.served(OLD), cluster.served(NEW)
    only = new - old
    versions = {(g, v) for g, v, _ in new} - {(g, v) for g, v, _ in old}
    assert MAP_GVR in only, sorted(only)  # the releases' own new resource, in a shared GV
    assert ("batch", "v1") in versions, sorted(versions)  # what the old server leaves out
    return Skew(frozenset(only), frozenset(versions))


def _proxy_pids(cluster: RealCluster) -> list[int | None]:
    return [s.proxy.pid for s in cluster.servers]


# --------------------------------------------------------------------------- clients


def _map(name: str) -> dict[str, Any]:
    body = yaml.safe_load(MAP_EXAMPLE)
    body["metadata"]["name"] = name
    return body


def _configmap(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": NAMESPACE}, "data": {"k": "v"}}


def _job(name: str) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
                {"name": "main", "image": "busybox:1.36"}]}}}}


def _assert_retry_later(answer: Answer, code: int = 503) -> dict[str, Any]:
    """A Kubernetes Status with ``code`` and a positive Retry-After."""
    assert answer.status == code, answer
    assert int(answer.headers["Retry-After"]) > 0, answer
    status = answer.json()
    assert (status["kind"], status["status"], status["code"]) == ("Status", "Failure", code)
    return status


def _merged(cluster: RealCluster, sid: str) -> dict[tuple[str, str], dict]:
    """``sid``'s mvproxy's merged /apis, (group, version) -> its entry."""
    answer = request(cluster, sid, "GET", "/apis", headers={"Accept": AGGREGATED_V2})
    assert answer.status == 200, answer
    return aggregated_group_versions(answer.json())


def _freshness(cluster: RealCluster, sid: str, gvs: frozenset[tuple[str, str]]) -> set[str]:
    merged = _merged(cluster, sid)
    return {merged[gv].get("freshness", "Current") if gv in merged else "missing" for gv in gvs}


def _listed(cluster: RealCluster, sid: str, gvrs: frozenset[GVR]) -> bool:
    """Every one of ``gvrs`` listed in ``sid``'s mvproxy's merged /apis."""
    answer = request(cluster, sid, "GET", "/apis", headers={"Accept": AGGREGATED_V2})
    return _listed_in(answer, gvrs)


def _listed_in(answer: Answer, gvrs: frozenset[GVR]) -> bool:
    """Every one of ``gvrs`` listed in an aggregated /apis answer."""
    assert answer.status == 200, answer
    merged = aggregated_group_versions(answer.json())
    return all(gv in merged and r in {x["resource"] for x in merged[gv]["resources"]}
               for gv, r in (((g, v), r) for g, v, r in gvrs))


class Watch:
    """A JSON watch through an mvproxy (or straight to a kube-apiserver), read on a
    thread: its events, and whether its stream ended."""

    def __init__(self, cluster: RealCluster, sid: str, path: str, *, direct: bool = False):
        server = cluster.server(sid)
        self.conn = http.client.HTTPSConnection(
            server.host, server.backend_port if direct else server.proxy_port,
            timeout=600, context=tls_context(cluster))
        self.conn.request("GET", path + ("&" if "?" in path else "?") + "watch=true")
        self.response = self.conn.getresponse()
        assert self.response.status == 200, (self.response.status, self.response.read())
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            while line := self.response.readline():
                if line.strip():
                    self.events.put(json.loads(line))
        except Exception:  # noqa: BLE001 - cut, broken or closed by close(): all an end
            pass
        finally:
            self.ended.set()

    def next_event(self, timeout: float) -> dict[str, Any]:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no watch event within {timeout:g}s "
                                 f"(ended: {self.ended.is_set()})") from None

    def wait_for(self, name: str, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = self.next_event(max(0.1, deadline - time.monotonic()))
            if event.get("object", {}).get("metadata", {}).get("name") == name:
                return event

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self._thread.join(5)


@contextlib.contextmanager
def watching(cluster: RealCluster, sid: str, path: str, *, direct: bool = False
             ) -> Iterator[Watch]:
    watch = Watch(cluster, sid, path, direct=direct)
    try:
        yield watch
    finally:
        watch.close()


@contextlib.contextmanager
def informer_on_map(cluster: RealCluster, tmp_path) -> Iterator[Informer]:
    """client-go 1.35's informer on MutatingAdmissionPolicies through the old server's
    mvproxy, synced."""
    group, version, resource = MAP_GVR
    informer = Informer(informer_binary(VERSIONS[0]), kubeconfig=cluster.kubeconfig,
                        context=OLD, group=group, version=version, resource=resource,
                        stderr_path=tmp_path / "informer.err")
    try:
        informer.wait_for("SYNCED", timeout=30)
        yield informer
    finally:
        informer.stop()


def _audited(cluster: RealCluster, sid: str, marker: str) -> list[dict[str, Any]]:
    """``sid``'s kube-apiserver's audit entries of requests whose URI holds ``marker``."""
    return [e for e in audit_entries(cluster.server(sid).audit_log)
            if marker in e.get("requestURI", "")]


def _served_by(cluster: RealCluster, marker: str) -> str:
    """Which kube-apiserver audited the request whose URI holds ``marker`` (waits for
    the audit line, which may trail the answer)."""
    def which() -> str | None:
        for sid in (OLD, NEW):
            if _audited(cluster, sid, marker):
                return sid
        return None
    return wait_until(which, f"an audit entry for {marker}", timeout=10)


def _marked(path: str) -> tuple[str, str]:
    """``path`` with a unique, harmless label selector, and that marker."""
    marker = f"probe-{uuid.uuid4().hex[:12]}"
    return f"{path}?labelSelector=mvproxy-probe%3D{marker}", marker


# --------------------------------------------------------------------------- the new server


def _outage_checks(cluster: RealCluster, skew: Skew, watch: Watch,
                   informer: Informer, began: float) -> None:
    """While the new server is down: the watch through the old server's mvproxy ended
    (the raw one and client-go's), its requests are 503 + Retry-After, and discovery
    keeps what only the new server serves, its own group/versions as Stale."""
    assert watch.ended.wait(FAULT_BOUND), "the watch through the old server's mvproxy hung"
    ended = time.monotonic() - began
    informer.wait_for("WATCH_END", stoppedByClient=False, timeout=FAULT_BOUND)
    wait_peer_unreachable(cluster, OLD, NEW, FAULT_BOUND)
    print(f"watch ended after {ended:.1f}s, peer unreachable after "
          f"{time.monotonic() - began:.1f}s")
    for method, body in (("GET", None), ("POST", _map(f"down-{uuid.uuid4().hex[:6]}"))):
        started = time.monotonic()
        _assert_retry_later(request(cluster, OLD, method, MAP_PATH, body=body))
        assert time.monotonic() - started < FAULT_BOUND
    _assert_retry_later(request(cluster, OLD, "GET", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs"))
    wait_until(lambda: _freshness(cluster, OLD, skew.versions) == {"Stale"},
               "the new-only group/versions marked Stale", timeout=FAULT_BOUND)
    # The new-only resources of a group/version the old server serves stay listed (that
    # version is Current: freshness is per group/version), and answer 503, not 404.
    assert _listed(cluster, OLD, skew.resources)


def _recovered(cluster: RealCluster, skew: Skew, informer: Informer, name: str) -> None:
    """Everything works again through the old server's mvproxy, no mvproxy restarted."""
    wait_until(lambda: request(cluster, OLD, "GET", MAP_PATH).status == 200,
               "MutatingAdmissionPolicies through the old server's mvproxy", timeout=RECOVERY)
    made = request(cluster, OLD, "POST", MAP_PATH, body=_map(name))
    assert made.status == 201, made
    informer.wait_for("ADDED", name=name, timeout=RECOVERY)
    job = request(cluster, OLD, "POST", f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs",
                  body=_job(name))
    assert job.status == 201, job
    wait_until(lambda: _freshness(cluster, OLD, skew.versions) == {"Current"},
               "the new-only group/versions Current again", timeout=RECOVERY)


def test_the_new_server_killed_then_restarted(cluster: RealCluster, skew: Skew,
                                              tmp_path) -> None:
    proxies = _proxy_pids(cluster)
    with informer_on_map(cluster, tmp_path) as informer, \
            watching(cluster, OLD, MAP_PATH) as watch:
        made = request(cluster, OLD, "POST", MAP_PATH, body=_map("before-kill"))
        assert made.status == 201, made
        watch.wait_for("before-kill")
        informer.wait_for("ADDED", name="before-kill")
        cluster.backend(NEW).kill()  # SIGKILL: no graceful shutdown at all
        _outage_checks(cluster, skew, watch, informer, time.monotonic())
        cluster.restart_backend(NEW)
        _recovered(cluster, skew, informer, "after-restart")
    assert _proxy_pids(cluster) == proxies


def test_the_new_server_frozen_then_resumed(cluster: RealCluster, skew: Skew,
                                            tmp_path) -> None:
    proxies, backend = _proxy_pids(cluster), cluster.backend(NEW)
    backend_pid = backend.pid
    with informer_on_map(cluster, tmp_path) as informer, \
            watching(cluster, OLD, MAP_PATH) as watch:
        assert request(cluster, OLD, "GET", MAP_PATH).status == 200  # pooled connections
        backend.freeze()  # SIGSTOP: its sockets stay open, nothing answers
        began = time.monotonic()
        try:
            _outage_checks(cluster, skew, watch, informer, began)
        finally:
            backend.resume()
        _recovered(cluster, skew, informer, "after-resume")
    assert _proxy_pids(cluster) == proxies and backend.pid == backend_pid


# --------------------------------------------------------------------------- the old server itself


def test_a_frozen_backend_does_not_hold_its_mvproxys_requests(cluster: RealCluster) -> None:
    """The old server's own kube-apiserver frozen: a GET already headed for it on a
    pooled connection used to take the request timeout (measured 60.5 s, then a 504);
    a watch on it hung for good. Now polling's verdict ends both, and what the new
    server serves too is served there meanwhile."""
    backend = cluster.backend(OLD)
    assert request(cluster, OLD, "GET", CONFIGMAPS).status == 200  # a pooled connection
    with watching(cluster, OLD, CONFIGMAPS) as watch:
        backend.freeze()
        try:
            path, marker = _marked(CONFIGMAPS)
            started = time.monotonic()
            answer = request(cluster, OLD, "GET", path)
            waited = time.monotonic() - started
            assert answer.status == 200 and waited < FAULT_BOUND, (answer, waited)
            print(f"a GET on the frozen backend's pooled connection: {waited:.1f}s")
            assert _served_by(cluster, marker) == NEW
            assert watch.ended.wait(FAULT_BOUND), "the watch on the frozen backend hung"
            made = request(cluster, OLD, "POST", CONFIGMAPS, body=_configmap("while-frozen"))
            assert made.status == 201, made
            # Discovery for credentials not seen before (no remembered yes): the peer
            # authorizes them instead of the frozen backend.
            started = time.monotonic()
            listed = request(cluster, OLD, "GET", "/apis", cert=None,
                             token=cluster.tokens["viewer-token"],
                             headers={"Accept": AGGREGATED_V2})
            assert listed.status == 200 and time.monotonic() - started < FAULT_BOUND, listed
            assert _listed_in(listed, frozenset({MAP_GVR}))
        finally:
            backend.resume()
    cluster.wait_converged(RECOVERY)
    path, marker = _marked(CONFIGMAPS)
    assert request(cluster, OLD, "GET", path).status == 200
    assert _served_by(cluster, marker) == OLD


@dataclass
class HeldRequest:
    """A request kube-apiserver counts as in flight until released: a POST whose body
    never arrives (straight to it). While one is held, a server draining with
    ``--shutdown-send-retry-after`` keeps answering 429 instead of closing."""

    sock: Any = field(repr=False)

    @classmethod
    def open(cls, cluster: RealCluster, sid: str) -> HeldRequest:
        server = cluster.server(sid)
        raw = socket.create_connection((server.host, server.backend_port), timeout=10)
        sock = tls_context(cluster).wrap_socket(raw, server_hostname=server.host)
        sock.sendall(f"POST {CONFIGMAPS} HTTP/1.1\r\nHost: {server.host}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n{"
                     .encode())
        return cls(sock)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _refused(cluster: RealCluster, sid: str) -> bool:
    server = cluster.server(sid)
    try:
        socket.create_connection((server.host, server.backend_port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def test_the_backends_graceful_shutdown_through_its_mvproxy(cluster: RealCluster) -> None:
    """kube-apiserver with --shutdown-delay-duration and --shutdown-send-retry-after:
    served as usual during the delay, then 429 + Retry-After + Connection: close while
    in-flight requests drain, then connection refused. Through its mvproxy a user's
    request moves to the peer serving it too from the 429 on; a request no peer may
    take (a write whose body went, one without credentials) gets the backend's own 429,
    as directly; the watch on the backend ends and is re-established on the peer."""
    backend = cluster.backend(OLD)
    held = HeldRequest.open(cluster, OLD)
    try:
        with watching(cluster, OLD, CONFIGMAPS) as watch:
            backend.terminate()
            terminated = time.monotonic()
            # 1. The delay: /readyz fails, everything is still served by the backend.
            readyz = request(cluster, OLD, "GET", "/readyz", direct=True)
            assert readyz.status != 200, readyz
            path, marker = _marked(CONFIGMAPS)
            assert request(cluster, OLD, "GET", path).status == 200
            if time.monotonic() - terminated < SHUTDOWN_DELAY - 1:  # not late (a slow run)
                assert _served_by(cluster, marker) == OLD
            # 2. The drain: 429 straight from the backend ...
            direct = wait_until(lambda: (a := request(cluster, OLD, "GET", CONFIGMAPS,
                                                      direct=True)).status == 429 and a,
                                "the backend's 429 after its shutdown delay",
                                timeout=SHUTDOWN_DELAY + FAULT_BOUND)
            assert direct.headers["Retry-After"] == "5", direct
            assert direct.headers["Connection"] == "close", direct
            # ... a user's GET through mvproxy is served by the peer ...
            path, marker = _marked(CONFIGMAPS)
            assert request(cluster, OLD, "GET", path).status == 200
            assert _served_by(cluster, marker) == NEW
            # ... without credentials: the backend's own answer, as directly ...
            anonymous = request(cluster, OLD, "GET", "/api/v1/namespaces", cert=None)
            straight = request(cluster, OLD, "GET", "/api/v1/namespaces", cert=None,
                               direct=True)
            assert (anonymous.status, anonymous.headers["Retry-After"], anonymous.body) == \
                (straight.status, straight.headers["Retry-After"], straight.body) == \
                (429, "5", direct.body)
            assert anonymous.headers.get("Connection") != "close"  # mvproxy's stays open
            # ... a write whose body went to the backend: its 429, or the peer took it.
            made = request(cluster, OLD, "POST", CONFIGMAPS, body=_configmap("draining"))
            assert made.status in (201, 429), made
            if made.status == 429:
                assert (made.headers["Retry-After"], made.body) == ("5", direct.body)
            # The backend ended the watch; watching again lands on the peer.
            assert watch.ended.wait(FAULT_BOUND), "the backend's drain did not end the watch"
        with watching(cluster, OLD, CONFIGMAPS) as again:
            # 3. Released: the backend stops listening; the peer takes writes too.
            held.release()
            wait_until(lambda: _refused(cluster, OLD), "the backend to stop listening",
                       timeout=FAULT_BOUND)
            made = request(cluster, OLD, "POST", CONFIGMAPS, body=_configmap("after-drain"))
            assert made.status == 201, made
            again.wait_for("after-drain")
        wait_until(lambda: not backend.running, "the backend to exit by itself",
                   timeout=FAULT_BOUND)
        assert backend.returncode == 0, backend.log_tail()  # it drained, then exited
    finally:
        held.release()
        cluster.restart_backend(OLD)
    path, marker = _marked(CONFIGMAPS)
    wait_until(lambda: request(cluster, OLD, "GET", path).status == 200,
               "configmaps through the old server's mvproxy after the restart")
    assert _served_by(cluster, marker) == OLD


# --------------------------------------------------------------------------- long streams


def test_silent_watches_outlive_the_idle_timeout(cluster: RealCluster) -> None:
    """mvproxy's listener.idleTimeout (3 s here) closes idle keep-alive connections, never
    a watch whose upstream is alive, however long it is silent: one served by the
    backend, one by the peer, both quiet for more than twice that."""
    name = f"late-{uuid.uuid4().hex[:6]}"
    with watching(cluster, OLD, f"{CONFIGMAPS}?resourceVersion=0&fieldSelector="
                                f"metadata.name%3D{name}") as local, \
            watching(cluster, OLD, f"{MAP_PATH}?fieldSelector=metadata.name%3D{name}") as peer:
        time.sleep(IDLE_TIMEOUT * 2 + 1)
        assert not local.ended.is_set() and not peer.ended.is_set()
        assert request(cluster, OLD, "POST", CONFIGMAPS, body=_configmap(name)).status == 201
        assert request(cluster, OLD, "POST", MAP_PATH, body=_map(name)).status == 201
        assert local.wait_for(name)["type"] == "ADDED"
        assert peer.wait_for(name)["type"] == "ADDED"
    # ... while an idle keep-alive connection is closed after it.
    server = cluster.server(OLD)
    conn = http.client.HTTPSConnection(server.host, server.proxy_port, timeout=30,
                                       context=tls_context(cluster))
    try:
        conn.request("GET", "/version")
        conn.getresponse().read()
        conn.sock.settimeout(IDLE_TIMEOUT * 4)
        try:
            assert conn.sock.recv(1) == b"", "the idle connection was not closed"
        except (ssl.SSLError, ConnectionError):
            pass  # closed
    finally:
        conn.close()


# --------------------------------------------------------------------------- certificates


def _expiry_in_use(cluster: RealCluster, sid: str) -> float | None:
    from e2e_support import metrics

    for name, value in metrics(cluster, sid).items():
        if name.startswith("mvproxy_certificate_expiry_timestamp_seconds{") \
                and 'role="backend-client"' in name:
            return value
    return None


@dataclass
class Traffic:
    """Requests through the old server's mvproxy on a thread, back to back on one
    keep-alive client connection, alternating what its backend serves and what only
    the peer serves; every answer kept with when it came."""

    cluster: RealCluster
    answers: list[tuple[float, str, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        server = self.cluster.server(OLD)
        conn = http.client.HTTPSConnection(server.host, server.proxy_port, timeout=15,
                                           context=tls_context(self.cluster))
        try:
            while not self.stop.is_set():
                for path in (CONFIGMAPS, MAP_PATH):
                    try:
                        conn.request("GET", path)
                        response = conn.getresponse()
                        response.read()
                        status = response.status
                    except (OSError, http.client.HTTPException):
                        conn.close()
                        status = 0
                    self.answers.append((time.time(), path, status))
        finally:
            conn.close()


def test_front_proxy_certificate_rotated_then_the_old_one_expired(cluster: RealCluster) -> None:
    """mvproxy's front-proxy client certificate (to its backend and its peers) is
    replaced by a short-lived one, that one by a long-lived one, and the short-lived one
    then expires under load: kube-apiserver checks a client certificate on every
    request, so a pooled connection still presenting it would now get 401. None does."""
    from mvproxy.devpki import rotate_front_proxy_client

    def in_use(cert) -> Callable[[], bool]:
        return lambda: _expiry_in_use(cluster, OLD) == cert.not_valid_after_utc.timestamp()

    short = rotate_front_proxy_client(cluster.pki, OLD, lifetime=timedelta(seconds=12))
    saved = cluster.directory / "short-lived"
    shutil.rmtree(saved, ignore_errors=True)
    shutil.copytree(cluster.pki / OLD, saved)
    wait_until(in_use(short), "the short-lived certificate in use", timeout=10)
    traffic = Traffic(cluster)
    threads = [threading.Thread(target=traffic.run, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2)  # connections made with the short-lived one are pooled and busy
        long = rotate_front_proxy_client(cluster.pki, OLD, lifetime=timedelta(days=1))
        wait_until(in_use(long), "the long-lived certificate in use", timeout=10)
        expired = short.not_valid_after_utc.timestamp()
        wait_until(lambda: time.time() > expired + 3, "the short-lived certificate to expire",
                   timeout=30, pause=0.5)
    finally:
        traffic.stop.set()
        for thread in threads:
            thread.join(20)
    after = [a for a in traffic.answers if a[0] > expired]
    failed = [a for a in traffic.answers if a[2] != 200]
    assert not failed, failed[:10]
    assert len(after) > 20 and {p for _, p, _ in after} == {CONFIGMAPS, MAP_PATH}, len(after)
    # The control: kube-apiserver does refuse the expired certificate, per request.
    assert datetime.now(UTC) > short.not_valid_after_utc
    assert _expired_certificate_is_refused(cluster, saved)


def _expired_certificate_is_refused(cluster: RealCluster, saved: Path) -> bool:
    """Straight to the old kube-apiserver, presenting the expired certificate (its pair
    saved in ``saved``) as a front proxy asserting the admin: refused with 401."""
    ctx = ssl.create_default_context(cafile=str(cluster.ca))
    ctx.load_cert_chain(str(saved / "front-proxy-client.crt"),
                        str(saved / "front-proxy-client.key"))
    server = cluster.server(OLD)
    conn = http.client.HTTPSConnection(server.host, server.backend_port, timeout=15,
                                       context=ctx)
    try:
        conn.request("GET", CONFIGMAPS, headers={"X-Remote-User": ADMIN_USER,
                                                 "X-Remote-Group": "system:masters"})
        response = conn.getresponse()
        response.read()
        return response.status == 401
    finally:
        conn.close()
