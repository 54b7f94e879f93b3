"""End to end, the proxy (issue 5): real kubectl 1.36, the real Python ``kubernetes``
client and plain HTTPS clients through real ``mvproxy run`` processes in front of
simulated kube-apiservers 1.35, 1.35 and 1.36 sharing one store
(``mvproxy.devcluster.demo.start_cluster``, loopback, free ports).

What a user sees: through an old server's mvproxy, resources only the new server
serves work (and the reverse for resources the new server dropped); the request is
served by a capable backend, audited there as the original user with
``peerProxied: "true"``; nobody can smuggle an identity in; a peer that is down or
frozen costs a prompt 503 with ``Retry-After``, never a hang.

The module fixture starts every process and stops every one at teardown, whatever
happens; a test that stops or freezes a process restores it in ``finally``. The exec
test runs its own cluster (one backend without ``pods/exec``). Nothing here skips.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import (
    LEGACY_ACCEPT,
    WAIT_TIMEOUT,
    LineReader,
    audit_entries,
    first_word_is,
    request,
    stop_popen,
    uri_startswith,
    wait_for_audit,
    wait_for_audit_in_any,
    wait_peer_unreachable,
    wait_until,
)

from mvproxy.devcluster.demo import DemoCluster, start_cluster

OLD, OLD2, NEW = "apiserver-0", "apiserver-1", "apiserver-2"  # 1.35, 1.35, 1.36
ADMIN_USER = "kubernetes-admin"  # CN of pki/admin.crt, O=system:masters
VIEWER_USER = "demo-viewer"  # the viewer-token user
PODGROUPS = "/apis/scheduling.k8s.io/v1alpha2"
NAMESPACES = ("gang", "legacy", "outage", "identity", "drain", "workloads")

PODGROUP = """\
apiVersion: scheduling.k8s.io/v1alpha2
kind: PodGroup
metadata:
  name: {name}
  namespace: {ns}
spec:
  schedulingPolicy:
    gang:
      minCount: 2
"""

WORKLOAD_V1ALPHA1 = """\
apiVersion: scheduling.k8s.io/v1alpha1
kind: Workload
metadata:
  name: training
  namespace: {ns}
spec:
  podGroups:
  - name: workers
    policy:
      gang:
        minCount: 4
"""

POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: shell
  namespace: default
spec:
  containers:
  - name: main
    image: busybox:1.36
"""


def _podgroup_body(ns: str, name: str) -> dict:
    return {"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    with start_cluster(tmp_path_factory.mktemp("proxy-e2e"), ["1.35", "1.35", "1.36"],
                       base_port=0) as running:
        # Namespaces straight at a backend, so that one broken proxy path does not
        # fail every test.
        for ns in NAMESPACES:
            made = request(running, OLD, "POST", "/api/v1/namespaces", direct=True,
                           body={"apiVersion": "v1", "kind": "Namespace",
                                 "metadata": {"name": ns}})
            assert made.status == 201, made
        yield running


@pytest.fixture(scope="module")
def k(cluster: DemoCluster, kubectl):
    """kubectl on the cluster's kubeconfig: ``k(*args, context=OLD)``."""

    def run(*args: str, context: str = OLD, check: bool = True, timeout: float = 60):
        return kubectl(*args, kubeconfig=cluster.kubeconfig, context=context, check=check,
                       timeout=timeout)

    return run


def _audit(cluster: DemoCluster, sid: str) -> Path:
    return cluster.server(sid).audit_log


def _is_admin_via_peer(entry: dict) -> bool:
    user = entry.get("user") or {}
    return (entry.get("peerProxied") == "true" and user.get("username") == ADMIN_USER
            and "system:masters" in (user.get("groups") or []))


def _json(k, *args: str, context: str = OLD) -> dict:
    return json.loads(k("get", *args, "-o", "json", context=context).stdout)


# --------------------------------------------------------------------------- new resources


def test_podgroup_lifecycle_through_an_old_server(cluster: DemoCluster, k, kubectl) -> None:
    """create/get/watch/patch/delete a 1.36-only PodGroup through a 1.35 server's mvproxy."""
    ns = "gang"
    listed = k("api-resources", "--api-group", "scheduling.k8s.io", "-o", "name").stdout.split()
    assert "podgroups.scheduling.k8s.io" in listed

    manifest = cluster.directory / "podgroup-gang.yaml"
    manifest.write_text(PODGROUP.format(name="gang", ns=ns))
    # Client-side validation stays on: it needs the group/version in /openapi/v3.
    assert k("create", "-f", manifest).stdout.strip() == \
        "podgroup.scheduling.k8s.io/gang created"
    assert k("get", "podgroups", "-n", ns, "-o", "name").stdout.split() == \
        ["podgroup.scheduling.k8s.io/gang"]
    got = _json(k, "podgroup", "gang", "-n", ns)
    assert (got["apiVersion"], got["kind"]) == ("scheduling.k8s.io/v1alpha2", "PodGroup")
    assert got["spec"]["schedulingPolicy"]["gang"]["minCount"] == 2

    watch = subprocess.Popen(
        kubectl.argv("get", "podgroup", "gang", "-n", ns, "-w", "-o",
                     "custom-columns=NAME:.metadata.name,COLOR:.metadata.labels.color",
                     kubeconfig=cluster.kubeconfig, context=OLD),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, env=kubectl.env)
    reader = None
    try:
        reader = LineReader(watch)
        assert reader.wait_for(first_word_is("gang")).split() == ["gang", "<none>"]
        # Patched through the *other* old server: the watch through apiserver-0 sees it.
        patched = k("patch", "podgroup", "gang", "-n", ns, "--type", "merge",
                    "-p", '{"metadata":{"labels":{"color":"blue"}}}', context=OLD2)
        assert patched.stdout.strip() == "podgroup.scheduling.k8s.io/gang patched"
        assert reader.wait_for(first_word_is("gang")).split() == ["gang", "blue"]
    finally:
        stop_popen(watch, reader)
    base = f"{PODGROUPS}/namespaces/{ns}/podgroups"
    # kubectl has gone: its watch must end on both hops too (the backend audits a watch
    # when it ends), not linger until the next event happens to fail a write.
    watched = wait_for_audit(_audit(cluster, NEW), uri_startswith(base, "watch"),
                             "the watch did not end at the 1.36 backend after kubectl exited")
    assert _is_admin_via_peer(watched), watched

    assert _json(k, "podgroup", "gang", "-n", ns)["metadata"]["labels"] == {"color": "blue"}
    assert k("delete", "podgroup", "gang", "-n", ns).stdout.strip() == \
        f'podgroup.scheduling.k8s.io "gang" deleted from {ns} namespace'
    gone = k("get", "podgroup", "gang", "-n", ns, check=False)
    assert gone.returncode != 0
    assert 'podgroups.scheduling.k8s.io "gang" not found' in gone.stderr

    # Served by the 1.36 backend, as the admin, marked as peer-proxied: every verb.
    for verb in ("create", "list", "get", "patch", "delete"):
        wait_for_audit(_audit(cluster, NEW), uri_startswith(base, verb),
                       f"no {verb} of podgroups audited on the 1.36 backend")
        entries = [e for e in audit_entries(_audit(cluster, NEW))
                   if uri_startswith(base, verb)(e)]
        assert all(_is_admin_via_peer(e) for e in entries), entries
    # The 1.35 backends never saw a PodGroup request (they would have answered 404).
    for sid in (OLD, OLD2):
        seen = [e["requestURI"] for e in audit_entries(_audit(cluster, sid))
                if "podgroups" in e.get("requestURI", "")]
        assert seen == [], (sid, seen)


def test_resource_the_new_server_dropped_reaches_an_old_backend(cluster: DemoCluster,
                                                                k) -> None:
    """scheduling.k8s.io/v1alpha1 is gone in 1.36; through 1.36's mvproxy it still works."""
    ns = "workloads"
    direct = k("get", "workloads.v1alpha1.scheduling.k8s.io", "-n", ns,
               context=f"{NEW}-direct", check=False)
    assert direct.returncode != 0  # the 1.36 kube-apiserver alone cannot

    manifest = cluster.directory / "workload-v1alpha1.yaml"
    manifest.write_text(WORKLOAD_V1ALPHA1.format(ns=ns))
    assert k("create", "-f", manifest, context=NEW).stdout.strip() == \
        "workload.scheduling.k8s.io/training created"
    assert k("get", "workloads.v1alpha1.scheduling.k8s.io", "-n", ns, "-o", "name",
             context=NEW).stdout.split() == ["workload.scheduling.k8s.io/training"]

    uri = f"/apis/scheduling.k8s.io/v1alpha1/namespaces/{ns}/workloads"
    old_logs = [_audit(cluster, OLD), _audit(cluster, OLD2)]
    for verb in ("create", "list"):
        entries = wait_for_audit_in_any(old_logs, uri_startswith(uri, verb))
        assert all(_is_admin_via_peer(e) for e in entries), entries
    assert not any("/v1alpha1/" in e.get("requestURI", "") and "workloads" in e["requestURI"]
                   for e in audit_entries(_audit(cluster, NEW)))


# --------------------------------------------------------------------------- legacy clients


def test_python_dynamic_client_lists_podgroups_through_an_old_server(
        cluster: DemoCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes import client, dynamic

    ns = "legacy"
    made = request(cluster, NEW, "POST", f"{PODGROUPS}/namespaces/{ns}/podgroups",
                   body=_podgroup_body(ns, "from-136"), direct=True)
    assert made.status == 201, made

    # DynamicClient caches discovery in $TMPDIR/osrcp-*.json: start from an empty one.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for stale in glob.glob(str(tmp_path / "osrcp-*.json")):
        Path(stale).unlink()

    config = client.Configuration()
    config.host = cluster.server(OLD).proxy_url
    config.ssl_ca_cert = str(cluster.ca)
    config.cert_file = str(cluster.pki / "admin.crt")
    config.key_file = str(cluster.pki / "admin.key")
    with client.ApiClient(config) as api:
        dyn = dynamic.DynamicClient(api)
        podgroups = dyn.resources.get(api_version="scheduling.k8s.io/v1alpha2", kind="PodGroup")
        assert podgroups.namespaced
        listed = podgroups.get(namespace=ns)
        assert [item.metadata.name for item in listed.items] == ["from-136"]
    # Its discovery walk asked for the peer-only group/version through apiserver-0.
    entry = wait_for_audit(_audit(cluster, NEW), lambda e: e.get("requestURI") == PODGROUPS)
    assert _is_admin_via_peer(entry), entry


def test_legacy_group_version_document_comes_from_the_peer(cluster: DemoCluster) -> None:
    """kubectl 1.20 style: GET /apis/<g>/<v> for a group/version only a peer serves."""
    answer = request(cluster, OLD, "GET", PODGROUPS, headers={"Accept": LEGACY_ACCEPT})
    assert answer.status == 200, answer
    doc = answer.json()
    assert (doc["kind"], doc["groupVersion"]) == ("APIResourceList",
                                                  "scheduling.k8s.io/v1alpha2")
    kinds = {r["name"]: r["kind"] for r in doc["resources"]}
    assert kinds["podgroups"] == "PodGroup"
    group = request(cluster, OLD, "GET", "/apis/scheduling.k8s.io",
                    headers={"Accept": LEGACY_ACCEPT})
    assert group.status == 200 and group.json()["kind"] == "APIGroup", group


# --------------------------------------------------------------------------- client addresses

CLIENT_IP = "127.0.0.2"
"""The test client's source address; mvproxy reaches every backend from 127.0.0.1."""


@pytest.mark.parametrize("claimed", [None, "127.0.0.9"], ids=["plain", "client-sent XFF"])
@pytest.mark.parametrize("route", ["local", "peer"])
def test_audit_source_ips_list_the_real_client(cluster: DemoCluster, route: str,
                                               claimed: str | None) -> None:
    """The backend's audit ``sourceIPs`` name the client, not only mvproxy, on both routes.

    Upstream: Go's ``httputil.ReverseProxy`` (used by kube-apiserver's proxies,
    staging/src/k8s.io/apimachinery/pkg/util/proxy/upgradeaware.go) appends the
    downstream's address to ``X-Forwarded-For``; kube-apiserver's audit records
    ``utilnet.SourceIPs`` (staging/src/k8s.io/apimachinery/pkg/util/net/http.go).
    Whatever a client claims stays first, as when it talks to kube-apiserver directly.
    """
    marker = f"xff-{route}-{claimed or 'plain'}"
    path = (f"/api/v1/namespaces/default/configmaps?labelSelector={marker}"
            if route == "local" else f"{PODGROUPS}/namespaces/default/podgroups"
                                     f"?labelSelector={marker}")
    headers = {"X-Forwarded-For": claimed} if claimed else {}
    answer = request(cluster, OLD, "GET", path, headers=headers, source=CLIENT_IP)
    assert answer.status == 200, answer
    entry = wait_for_audit(_audit(cluster, OLD if route == "local" else NEW),
                           uri_startswith(path))
    expected = [CLIENT_IP, "127.0.0.1"] if claimed is None else [claimed, CLIENT_IP,
                                                                  "127.0.0.1"]
    assert entry["sourceIPs"] == expected, entry
    assert entry["peerProxied"] == ("true" if route == "peer" else None)


# --------------------------------------------------------------------------- identity


def test_identity_headers_from_a_token_client_are_ignored(cluster: DemoCluster) -> None:
    """A viewer claiming to be the admin via X-Remote-* is still the viewer."""
    ns = "identity"
    claims = {"X-Remote-User": ADMIN_USER, "X-Remote-Group": "system:masters",
              "X-Remote-Extra-Scopes": "all", "x-kubernetes-peer-proxied": "true"}
    viewer = cluster.tokens["viewer-token"]

    cm = request(cluster, OLD, "POST",
                 f"/api/v1/namespaces/{ns}/configmaps?fieldManager=claims-admin",
                 headers=claims, token=viewer, cert=None,
                 body={"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "smuggled", "namespace": ns}})
    assert cm.status == 403, cm
    status = cm.json()
    assert (status["kind"], status["reason"]) == ("Status", "Forbidden")
    assert VIEWER_USER in status["message"]
    entry = wait_for_audit(_audit(cluster, OLD), uri_startswith(
        f"/api/v1/namespaces/{ns}/configmaps?fieldManager=claims-admin"))
    assert entry["user"]["username"] == VIEWER_USER
    assert "system:masters" not in entry["user"]["groups"]
    assert entry["responseStatus"]["code"] == 403

    # Through a peer hop too (and the forged peer-proxied marker did not keep the
    # request on the 1.35 backend, which would have answered 404).
    pg = request(cluster, OLD, "POST",
                 f"{PODGROUPS}/namespaces/{ns}/podgroups?fieldManager=claims-admin",
                 headers=claims, token=viewer, cert=None, body=_podgroup_body(ns, "smuggled"))
    assert pg.status == 403, pg
    assert pg.json()["reason"] == "Forbidden" and VIEWER_USER in pg.json()["message"]
    entry = wait_for_audit(_audit(cluster, NEW), uri_startswith(
        f"{PODGROUPS}/namespaces/{ns}/podgroups?fieldManager=claims-admin"))
    assert entry["user"]["username"] == VIEWER_USER
    assert entry["peerProxied"] == "true"
    # Nobody wrote anything as the claimed admin.
    for sid in (OLD, NEW):
        claimed = [e for e in audit_entries(_audit(cluster, sid))
                   if "claims-admin" in e.get("requestURI", "")]
        assert [e["user"]["username"] for e in claimed] == [VIEWER_USER], claimed


def test_identity_headers_from_a_certificate_client_are_ignored(cluster: DemoCluster) -> None:
    """With a client certificate, the certificate's user wins over X-Remote-*."""
    ns = "identity"
    claims = {"X-Remote-User": "mallory", "X-Remote-Group": "viewer"}
    for sid, path in ((OLD, f"/api/v1/namespaces/{ns}/configmaps?fieldManager=claims-mallory"),
                      (NEW, f"{PODGROUPS}/namespaces/{ns}/podgroups?fieldManager=claims-mallory")):
        body = ({"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": "by-cert", "namespace": ns}}
                if sid == OLD else _podgroup_body(ns, "by-cert"))
        made = request(cluster, OLD, "POST", path, headers=claims, body=body)
        assert made.status == 201, made
        entry = wait_for_audit(_audit(cluster, sid), uri_startswith(path))
        assert entry["user"]["username"] == ADMIN_USER
        assert "system:masters" in entry["user"]["groups"]
        assert "viewer" not in entry["user"]["groups"]


@pytest.mark.parametrize("path", ["/healthz", "/livez", "/readyz", "/version", "/version/"])
def test_anonymous_health_checks_answer_as_the_backend_does(cluster: DemoCluster, path) -> None:
    """Load balancers probe :6443 without credentials; the backend's anonymous policy
    (system:public-info-viewer) must apply through mvproxy exactly as directly. With
    the front-proxy certificate and no X-Remote-User the backend answered 401."""
    direct = request(cluster, OLD, "GET", path, cert=None, direct=True)
    proxied = request(cluster, OLD, "GET", path, cert=None)
    assert direct.status == 200, direct
    assert (proxied.status, proxied.body) == (direct.status, direct.body)


def test_anonymous_requests_stay_anonymous(cluster: DemoCluster) -> None:
    """Beyond the public paths, an anonymous request is refused as anonymous, by the
    backend, locally and through a peer hop alike."""
    for path in ("/api/v1/namespaces", f"{PODGROUPS}/namespaces/default/podgroups"):
        direct = request(cluster, NEW, "GET", path, cert=None, direct=True)
        proxied = request(cluster, OLD, "GET", path, cert=None)
        assert proxied.status == direct.status != 200, (proxied, direct)
        assert proxied.json()["reason"] == direct.json()["reason"]


ANON_NS = "anonymous-probe"  # in no other test's request: its audit lines are these tests'.
# A resource and a group version; the query only makes the audited URI this test's own.
PEER_ONLY_PATHS = (f"{PODGROUPS}/namespaces/{ANON_NS}/podgroups", f"{PODGROUPS}?probe={ANON_NS}")
NOBODY_PATH = f"/apis/nothing.example.com/v1/namespaces/{ANON_NS}/widgets"


def _same_answer(answer, expected) -> None:
    """Indistinguishable to the client: status, content type and body."""
    assert (answer.status, answer.headers["Content-Type"], answer.body) == (
        expected.status, expected.headers["Content-Type"], expected.body), (answer, expected)


def _never_reached(cluster: DemoCluster, sid: str, path: str) -> None:
    """``sid``'s kube-apiserver audits every request it receives, refused ones too (it
    writes the line before answering, so a forwarded request would already be there)."""
    seen = [e for e in audit_entries(_audit(cluster, sid)) if e.get("requestURI") == path]
    assert not seen, seen


def _refused_anonymously(answer) -> None:
    """kube-apiserver's answer to system:anonymous for an API (served or not): 403."""
    assert answer.status == 403 and answer.json()["reason"] == "Forbidden", answer


def test_without_credentials_peer_only_apis_look_like_unknown_ones(cluster: DemoCluster) -> None:
    """Issue 19: an anonymous request for what only the 1.36 server serves was forwarded
    to it (a slower refusal: which group/version/resources peers serve, which merged
    discovery hides from anonymous clients). Now the 1.35 server's own backend answers
    it, exactly as it answers that request directly and as it refuses an API nobody
    serves (a 403 naming what the client asked for), and the peer's kube-apiserver never
    sees it; a token user still reaches the peer."""
    _refused_anonymously(request(cluster, OLD, "GET", NOBODY_PATH, cert=None))
    for path in PEER_ONLY_PATHS:
        expected = request(cluster, OLD, "GET", path, cert=None, direct=True)
        _refused_anonymously(expected)
        for _ in range(3):  # a pooled connection lets the callback path answer too
            _same_answer(request(cluster, OLD, "GET", path, cert=None), expected)
        wait_for_audit(_audit(cluster, OLD), lambda e, p=path: e.get("requestURI") == p
                       and e["responseStatus"]["code"] == 403 and e["peerProxied"] is None)
        _never_reached(cluster, NEW, path)
    viewer = request(cluster, OLD, "GET", PEER_ONLY_PATHS[0], cert=None,
                     token=cluster.tokens["viewer-token"])
    assert viewer.status == 200, viewer
    entry = wait_for_audit(_audit(cluster, NEW), uri_startswith(PEER_ONLY_PATHS[0]))
    assert (entry["user"]["username"], entry["peerProxied"]) == (VIEWER_USER, "true")


def test_without_credentials_an_unreachable_peer_is_no_503(cluster: DemoCluster) -> None:
    """The 503 "served only by peers that are unreachable" told an anonymous client what
    peers serve; it now gets the backend's answer for an unknown API, while a token
    user still gets the 503 (mvproxy cannot tell a valid token from a junk one)."""
    expected = {path: request(cluster, OLD, "GET", path, cert=None, direct=True)
                for path in PEER_ONLY_PATHS}
    cluster.stop_server(NEW)
    try:
        wait_peer_unreachable(cluster, OLD, NEW)
        for path in PEER_ONLY_PATHS:
            _refused_anonymously(expected[path])
            _same_answer(request(cluster, OLD, "GET", path, cert=None), expected[path])
        _assert_503(request(cluster, OLD, "GET", PEER_ONLY_PATHS[0], cert=None,
                            token=cluster.tokens["viewer-token"]))
    finally:
        cluster.start_server(NEW)


# --------------------------------------------------------------------------- peer outages


def _assert_503(answer) -> dict:
    assert answer.status == 503, answer
    assert int(answer.headers["Retry-After"]) > 0
    assert answer.headers["Content-Type"].startswith("application/json")
    status = answer.json()
    assert (status["kind"], status["status"], status["reason"], status["code"]) == \
        ("Status", "Failure", "ServiceUnavailable", 503)
    return status


def test_stopped_peer_gets_503_then_service_returns(cluster: DemoCluster, k) -> None:
    ns = "outage"
    path = f"{PODGROUPS}/namespaces/{ns}/podgroups"
    cluster.stop_server(NEW)
    try:
        # Right away: routing still believes the peer is up; the connect fails.
        _assert_503(request(cluster, OLD, "GET", path))
        # After staleAfter: routing knows, and answers at once.
        wait_peer_unreachable(cluster, OLD, NEW)
        status = _assert_503(request(cluster, OLD, "GET", path))
        assert NEW in status["message"]
        _assert_503(request(cluster, OLD, "POST", path, body=_podgroup_body(ns, "down")))
    finally:
        cluster.start_server(NEW)

    def works() -> bool:
        return k("get", "podgroups", "-n", ns, check=False).returncode == 0

    wait_until(works, "kubectl get podgroups through apiserver-0 after the restart")
    made = request(cluster, OLD, "POST", path, body=_podgroup_body(ns, "back"))
    assert made.status == 201, made


def test_frozen_peer_gets_503_not_a_hang(cluster: DemoCluster) -> None:
    """SIGSTOP: the peer's kernel still accepts TCP, but nothing answers TLS or HTTP.
    The request must end with a 503 after mvproxy's connect timeout (5 s), which the
    client's 15 s timeout in ``request`` bounds; a hang fails the test."""
    path = f"{PODGROUPS}/namespaces/outage/podgroups"
    assert request(cluster, OLD, "GET", path).status == 200  # a pooled connection exists
    pid = cluster.server(NEW).proxy.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        _assert_503(request(cluster, OLD, "GET", path))
    finally:
        os.kill(pid, signal.SIGCONT)
        cluster.wait_converged()
    assert request(cluster, OLD, "GET", path).status == 200


def test_frozen_backend_does_not_hold_requests_until_the_request_timeout(
        cluster: DemoCluster) -> None:
    """SIGSTOP on a member's own kube-apiserver: a request already on a pooled
    connection to it, and a watch, used to wait for the request timeout (60 s: measured
    60.5 s against a real frozen kube-apiserver), the watch forever. Now the backend's
    polls time out (1 s here), its idle connections go, and once it is unreachable
    (staleAfter, 3 s) what waits on it ends: well inside the client's 15 s."""
    path = "/api/v1/namespaces/outage/configmaps"
    assert request(cluster, OLD, "GET", path).status == 200  # a pooled connection exists
    backend = cluster.server(OLD).backend
    watch = _open_watch(cluster, OLD, path)
    backend.freeze()
    try:
        started = time.monotonic()
        answer = request(cluster, OLD, "GET", path)
        assert answer.status == 200, answer  # served by a peer that serves it too
        assert time.monotonic() - started < 10, answer
        assert _watch_ended(watch, 10), "the watch on the frozen backend did not end"
    finally:
        watch.close()
        backend.resume()
        cluster.wait_converged()
    assert request(cluster, OLD, "GET", path).status == 200


def _open_watch(cluster: DemoCluster, sid: str, path: str):
    """A watch through ``sid``'s mvproxy, its response head read (a raw connection)."""
    import http.client

    from e2e_support import tls_context

    server = cluster.server(sid)
    conn = http.client.HTTPSConnection(server.host, server.proxy_port, timeout=WAIT_TIMEOUT,
                                       context=tls_context(cluster))
    conn.request("GET", path + "?watch=true")
    response = conn.getresponse()
    assert response.status == 200, response.read()
    conn.response = response  # type: ignore[attr-defined]
    return conn


def _watch_ended(conn, timeout: float) -> bool:
    """Whether the watch's stream ends (cleanly or cut) within ``timeout`` seconds."""
    import http.client

    conn.sock.settimeout(timeout)
    try:
        while conn.response.read1(65536):
            pass
    except TimeoutError:
        return False
    except (OSError, http.client.HTTPException):
        pass
    return True


def test_sigterm_drains_and_exits_zero(cluster: DemoCluster, kubectl) -> None:
    """SIGTERM: mvproxy stops listening, ends open streams within its grace period and
    exits 0; a watch through it ends instead of hanging."""
    made = request(cluster, OLD, "POST", "/api/v1/namespaces/drain/configmaps",
                   body={"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": {"name": "watched", "namespace": "drain"}})
    assert made.status == 201, made
    watch = subprocess.Popen(
        kubectl.argv("get", "configmaps", "-n", "drain", "-w",
                     kubeconfig=cluster.kubeconfig, context=OLD2),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, env=kubectl.env)
    reader = None
    try:
        reader = LineReader(watch)
        reader.wait_for(first_word_is("watched"))
        assert cluster.server(OLD2).proxy.stop() == 0
        assert reader.ended.wait(WAIT_TIMEOUT), "the watch did not end when mvproxy stopped"
        watch.wait(WAIT_TIMEOUT)
    finally:
        stop_popen(watch, reader)
        cluster.start_server(OLD2)
    again = kubectl("get", "ns", "drain", "-o", "name", kubeconfig=cluster.kubeconfig,
                    context=OLD2)
    assert again.stdout.split() == ["namespace/drain"]


# --------------------------------------------------------------------------- exec


@pytest.fixture
def exec_cluster(tmp_path: Path) -> Iterator[DemoCluster]:
    """1.35 + 1.36; apiserver-0's kube-apiserver does not serve pods/exec."""
    with start_cluster(tmp_path / "exec", ["1.35", "1.36"], base_port=0,
                       extra_sim_args={"apiserver-0": ["--runtime-config",
                                                       "v1/pods/exec=false"]}) as running:
        yield running


def test_exec_through_a_peer_hop_keeps_the_identity(exec_cluster: DemoCluster,
                                                    kubectl) -> None:
    c = exec_cluster

    def k(*args: str, context: str = "apiserver-0", check: bool = True):
        return kubectl(*args, kubeconfig=c.kubeconfig, context=context, check=check)

    manifest = c.directory / "pod.yaml"
    manifest.write_text(POD)
    assert k("create", "-f", manifest).stdout.strip() == "pod/shell created"
    # Its own kube-apiserver cannot exec ...
    direct = k("exec", "shell", "--", "echo", "hi", context="apiserver-0-direct", check=False)
    assert direct.returncode != 0 and direct.stdout == ""
    # ... through its mvproxy, a peer's can.
    assert k("exec", "shell", "--", "echo", "hi").stdout == "hi\n"
    assert k("exec", "shell", "--user", "admin-token", "--", "echo", "token").stdout == \
        "token\n"

    uri = "/api/v1/namespaces/default/pods/shell/exec?"
    entry = wait_for_audit(c.server("apiserver-1").audit_log,
                           lambda e: uri_startswith(uri)(e) and "command=hi" in e["requestURI"])
    assert _is_admin_via_peer(entry), entry
    assert entry["responseStatus"]["code"] == 101
    by_token = wait_for_audit(c.server("apiserver-1").audit_log,
                              lambda e: uri_startswith(uri)(e) and "command=token" in
                              e["requestURI"])
    assert by_token["user"]["username"] == "demo-admin"
    assert by_token["peerProxied"] == "true"
    # Only the direct attempt (WebSocket, then the SPDY fallback) reached apiserver-0's
    # kube-apiserver, and got its 404.
    local = [e for e in audit_entries(c.server("apiserver-0").audit_log)
             if uri_startswith(uri)(e)]
    assert local and all(e["responseStatus"]["code"] == 404 for e in local), local
    assert all("command=hi" in e["requestURI"] and e["peerProxied"] is None for e in local)


# --------------------------------------------------------------------------- rollback


def test_a_backend_rolled_back_never_answers_404_for_what_its_peer_serves(
        tmp_path: Path) -> None:
    """Two 1.36 servers; the first one's kube-apiserver is rolled back to 1.35 (its
    mvproxy keeps running). Its old snapshot lists PodGroups, which 1.35 lacks: between
    the new backend's start and mvproxy's next poll, a request routed by that snapshot
    got 1.35's 404 (nine of them against real 1.36.3 rolled back to 1.35.4). A backend
    that failed a poll, or was found down by a request, is trusted again only by a
    poll that succeeds, which also brings its new snapshot: the other 1.36 server takes
    PodGroups meanwhile, and afterwards, as the only one serving them."""
    import threading
    from collections import Counter

    path = f"{PODGROUPS}/namespaces/default/podgroups"
    with start_cluster(tmp_path / "rollback", ["1.36", "1.36"], base_port=0) as c:
        backend = c.server("apiserver-0").backend
        assert request(c, "apiserver-0", "GET", path).status == 200
        statuses: Counter[int] = Counter()
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                try:
                    statuses[request(c, "apiserver-0", "GET", path, timeout=10).status] += 1
                except AssertionError:
                    statuses[0] += 1
                time.sleep(0.02)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            backend.stop()
            backend.argv[backend.argv.index("--kubernetes-version") + 1] = "1.35"
            backend.start()
            backend.wait_ready(WAIT_TIMEOUT)
            c.wait_converged(polled_since=time.monotonic())
            time.sleep(0.5)
        finally:
            stop.set()
            prober.join(15)
        assert not statuses[404] and statuses[200], statuses
        assert set(statuses) <= {200, 503}, statuses
