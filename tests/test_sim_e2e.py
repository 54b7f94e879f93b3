"""End to end: real kubectl 1.36 (and real Python clients) against two simulated
kube-apiservers, 1.35 and 1.36, sharing one object store, over real TLS.

Everything runs on loopback; the module fixture starts both ``mvproxy sim`` processes
and stops them at teardown, whatever happens in between. Nothing here skips: if the
simulated server is missing or broken, these tests fail.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import http.client
import json
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_support import LineReader, stop_popen

from mvproxy.devcluster.catalog import Catalog, load_catalog
from mvproxy.devcluster.kubeconfig import write_kubeconfig
from mvproxy.devcluster.launcher import SimProcess, free_port, write_token_file
from mvproxy.devpki import init_pki

READY_TIMEOUT = 30.0
WAIT_TIMEOUT = 15.0  # for things that happen asynchronously (a watch event, an audit line)

ADMIN_TOKEN = "admin-token-0123456789"
VIEWER_TOKEN = "viewer-token-0123456789"
ADMIN_TOKEN_USER = "token-admin"
VIEWER_USER = "jane-viewer"

LEGACY_ACCEPT = "application/json, */*"  # what kubectl 1.20 sends for discovery


@dataclass
class Cluster:
    root: Path
    pki: Path
    kubeconfig: Path
    sims: dict[str, SimProcess]  # context name -> its sim

    @functools.cached_property
    def admin_ssl(self) -> ssl.SSLContext:
        return self.sims["sim-136"].admin_context()

    def api(self, method: str, path: str, body: dict | None = None, *,
            server: str = "sim-136", ssl_context: ssl.SSLContext | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict]:
        """One plain JSON request (admin certificate unless ``ssl_context`` says otherwise).

        For setting the scene only: what a test asserts comes from kubectl where it can.
        """
        sim = self.sims[server]
        conn = http.client.HTTPSConnection(
            "127.0.0.1", sim.port, timeout=10,
            context=ssl_context if ssl_context is not None else self.admin_ssl)
        try:
            sent = {"Accept": "application/json", **(headers or {})}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                sent["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=sent)
            response = conn.getresponse()
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
        finally:
            conn.close()

    def create(self, path: str, body: dict, server: str = "sim-136") -> dict:
        status, doc = self.api("POST", path, body, server=server)
        assert status == 201, f"POST {path}: {status} {doc}"
        return doc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("sim-e2e")
    pki = root / "pki"
    init_pki(pki, ["sim-135", "sim-136"])
    tokens = write_token_file(root / "tokens.csv", {
        ADMIN_TOKEN: (ADMIN_TOKEN_USER, "uid-admin", ["system:masters"]),
        VIEWER_TOKEN: (VIEWER_USER, "uid-viewer", ["viewer"]),
    })
    store = root / "store.db"
    sims: dict[str, SimProcess] = {}
    with contextlib.ExitStack() as stack:
        for version, name in (("1.35", "sim-135"), ("1.36", "sim-136")):
            sim = SimProcess(
                kubernetes_version=version, server_id=name, pki_dir=pki, port=free_port(),
                store=store, log_dir=root / "logs", token_auth_file=tokens,
                audit_log_path=root / f"audit-{name}.jsonl",
            )
            stack.callback(sim.stop)  # registered before start: stopped even if start fails
            sims[name] = sim.start()
        for sim in sims.values():
            sim.wait_ready(READY_TIMEOUT)

        kubeconfig = write_kubeconfig(
            root / "kubeconfig",
            ca_file=pki / "ca.crt",
            clusters=[(name, sim.url) for name, sim in sims.items()],
            users={
                "admin": {"client-certificate": pki / "admin.crt",
                          "client-key": pki / "admin.key"},
                "admin-token": {"token": ADMIN_TOKEN},
                "viewer-token": {"token": VIEWER_TOKEN},
                "stranger": {"token": "not-a-known-token"},
            },
            contexts=[
                ("sim-135", "sim-135", "admin"),
                ("sim-136", "sim-136", "admin"),
                ("sim-136-admin-token", "sim-136", "admin-token"),
                ("sim-136-viewer", "sim-136", "viewer-token"),
                ("sim-136-stranger", "sim-136", "stranger"),
            ],
            current_context="sim-136",
        )
        cluster = Cluster(root, pki, kubeconfig, sims)
        for ns in NAMESPACES:
            cluster.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                  "metadata": {"name": ns}})
        yield cluster


@pytest.fixture(scope="module")
def k(cluster: Cluster, kubectl):
    """kubectl bound to the cluster's kubeconfig: ``k(*args, context="sim-136")``."""

    def run(*args: str, context: str = "sim-136", check: bool = True, timeout: float = 60):
        return kubectl(*args, kubeconfig=cluster.kubeconfig, context=context,
                       check=check, timeout=timeout)

    return run


# Namespaces the tests work in, created by the fixture (JSON over HTTPS) so that one
# broken kubectl command does not fail every test.
NAMESPACES = ("shared-store", "watched", "deploy", "exec", "by-token", "viewer", "gang",
              "python")


def _namespace(cluster: Cluster, name: str) -> str:
    assert name in NAMESPACES
    return name


def _configmap(cluster: Cluster, ns: str, name: str, data: dict | None = None,
               server: str = "sim-136") -> dict:
    body = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns}, "data": data or {}}
    return cluster.create(f"/api/v1/namespaces/{ns}/configmaps", body, server=server)


# --------------------------------------------------------------------------- discovery


def _preferred_names(catalog: Catalog, group: str | None = None) -> list[str]:
    """What ``kubectl api-resources -o name`` prints: every resource of every group once,
    from the most preferred version that has it, as ``resource.group`` (core: bare)."""
    names: list[str] = []
    for g in catalog.groups:
        if group is not None and g.name != group:
            continue
        seen: set[str] = set()
        for v in g.versions:
            for r in v.resources:
                if r.resource not in seen:
                    seen.add(r.resource)
                    names.append(f"{r.resource}.{g.name}" if g.name else r.resource)
    return names


def test_sim_modules_are_importable() -> None:
    """The simulated server is part of the package; a missing module fails, never skips."""
    import importlib

    for module in ("simserver", "simauth", "simexec"):
        importlib.import_module(f"mvproxy.devcluster.{module}")


@pytest.mark.parametrize("context,version", [("sim-135", "1.35"), ("sim-136", "1.36")])
def test_api_resources_lists_exactly_the_catalog(k, context: str, version: str) -> None:
    printed = k("api-resources", "-o", "name", context=context).stdout.split()
    expected = _preferred_names(load_catalog(version))
    assert len(printed) == len(set(printed)), "a resource is listed twice"
    assert set(printed) == set(expected)


@pytest.mark.parametrize("group", ["", "apps", "scheduling.k8s.io", "resource.k8s.io"])
def test_api_resources_of_one_group(k, group: str) -> None:
    printed = k("api-resources", "-o", "name", f"--api-group={group}").stdout.split()
    assert set(printed) == set(_preferred_names(load_catalog("1.36"), group))
    assert len(printed) == len(set(printed))


def test_podgroups_are_new_in_136(k) -> None:
    on_135 = k("api-resources", "-o", "name", "--api-group=scheduling.k8s.io",
               context="sim-135").stdout.split()
    on_136 = k("api-resources", "-o", "name", "--api-group=scheduling.k8s.io").stdout.split()
    assert "workloads.scheduling.k8s.io" in on_135
    assert "podgroups.scheduling.k8s.io" not in on_135
    assert "podgroups.scheduling.k8s.io" in on_136


# --------------------------------------------------------------------------- CRUD


def _get_json(k, *args: str, context: str = "sim-136") -> dict:
    return json.loads(k("get", *args, "-o", "json", context=context).stdout)


def test_configmap_lifecycle(k) -> None:
    ns = "cm-life"
    assert k("create", "namespace", ns).stdout.strip() == f"namespace/{ns} created"
    assert _get_json(k, "namespace", ns)["status"]["phase"] == "Active"
    out = k("create", "configmap", "settings", "-n", ns, "--from-literal=color=blue").stdout
    assert out.strip() == "configmap/settings created"

    cm = _get_json(k, "configmap", "settings", "-n", ns)
    assert cm["kind"] == "ConfigMap" and cm["apiVersion"] == "v1"
    assert cm["metadata"]["name"] == "settings" and cm["metadata"]["namespace"] == ns
    assert cm["data"] == {"color": "blue"}
    assert cm["metadata"]["uid"] and cm["metadata"]["resourceVersion"]

    table = k("get", "cm", "-n", ns).stdout.splitlines()
    header = table[0].split()
    assert header[0] == "NAME" and "AGE" in header
    assert [row.split()[0] for row in table[1:]] == ["settings"]

    out = k("patch", "cm", "settings", "-n", ns, "--type", "merge",
            "-p", '{"data":{"size":"xl"}}').stdout
    assert out.strip() == "configmap/settings patched"
    assert _get_json(k, "cm", "settings", "-n", ns)["data"] == {"color": "blue", "size": "xl"}

    out = k("patch", "cm", "settings", "-n", ns, "--type", "json",
            "-p", '[{"op":"remove","path":"/data/color"}]').stdout
    assert out.strip() == "configmap/settings patched"
    assert _get_json(k, "cm", "settings", "-n", ns)["data"] == {"size": "xl"}

    assert k("label", "cm", "settings", "-n", ns, "tier=gold").stdout.strip() == \
        "configmap/settings labeled"
    assert _get_json(k, "cm", "settings", "-n", ns)["metadata"]["labels"] == {"tier": "gold"}
    assert k("create", "configmap", "plain", "-n", ns).stdout.strip() == \
        "configmap/plain created"
    selected = k("get", "cm", "-n", ns, "-l", "tier=gold", "-o", "name").stdout.split()
    assert selected == ["configmap/settings"]

    assert k("delete", "cm", "settings", "-n", ns).stdout.strip() == \
        f'configmap "settings" deleted from {ns} namespace'
    gone = k("get", "cm", "settings", "-n", ns, check=False)
    assert gone.returncode != 0
    assert 'configmaps "settings" not found' in gone.stderr


def test_object_written_through_135_is_read_through_136(k, cluster) -> None:
    ns = _namespace(cluster, "shared-store")
    out = k("create", "configmap", "from-135", "-n", ns, "--from-literal=k=v",
            context="sim-135").stdout
    assert out.strip() == "configmap/from-135 created"
    old = _get_json(k, "cm", "from-135", "-n", ns, context="sim-135")
    new = _get_json(k, "cm", "from-135", "-n", ns, context="sim-136")
    assert new["metadata"]["uid"] == old["metadata"]["uid"]
    assert new["metadata"]["resourceVersion"] == old["metadata"]["resourceVersion"]
    assert new["data"] == {"k": "v"}


def test_watch_prints_an_object_created_through_the_other_sim(k, kubectl, cluster) -> None:
    ns = _namespace(cluster, "watched")
    _configmap(cluster, ns, "before")
    cmd = kubectl.argv("get", "cm", "-n", ns, "-w", kubeconfig=cluster.kubeconfig,
                       context="sim-136")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=kubectl.env)
    reader = None
    try:
        reader = LineReader(proc)
        reader.wait_for(lambda line: line.split()[:1] == ["before"], WAIT_TIMEOUT)
        k("create", "configmap", "after", "-n", ns, context="sim-135")
        reader.wait_for(lambda line: line.split()[:1] == ["after"], WAIT_TIMEOUT)
    finally:
        stop_popen(proc, reader)


DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: {ns}
  labels: {{app: web}}
spec:
  replicas: 1
  selector:
    matchLabels: {{app: web}}
  template:
    metadata:
      labels: {{app: web}}
    spec:
      containers:
      - name: web
        image: registry.k8s.io/pause:3.10
"""


def test_apply_and_scale_a_deployment(k, cluster) -> None:
    ns = _namespace(cluster, "deploy")
    manifest = cluster.root / "deployment.yaml"
    manifest.write_text(DEPLOYMENT.format(ns=ns))
    assert k("apply", "-f", manifest).stdout.strip() == "deployment.apps/web created"
    assert k("scale", "deployment", "web", "-n", ns, "--replicas", "3").stdout.strip() == \
        "deployment.apps/web scaled"
    deployment = _get_json(k, "deployment", "web", "-n", ns)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["metadata"]["labels"] == {"app": "web"}


def test_exec_in_a_pod(k, cluster) -> None:
    ns = _namespace(cluster, "exec")
    out = k("run", "shell", "-n", ns, "--image=busybox:1.36", "--restart=Never").stdout
    assert out.strip() == "pod/shell created"
    done = k("exec", "shell", "-n", ns, "--", "echo", "hi")
    assert done.stdout == "hi\n"


# --------------------------------------------------------------------------- authn / authz


def test_admin_token_has_full_access(k, cluster) -> None:
    ns = _namespace(cluster, "by-token")
    _configmap(cluster, ns, "t")
    ctx = "sim-136-admin-token"
    assert k("get", "cm", "t", "-n", ns, "-o", "name", context=ctx).stdout.split() == \
        ["configmap/t"]
    assert k("label", "cm", "t", "-n", ns, "by=token", context=ctx).stdout.strip() == \
        "configmap/t labeled"
    status, cm = cluster.api("GET", f"/api/v1/namespaces/{ns}/configmaps/t")
    assert status == 200 and cm["metadata"]["labels"] == {"by": "token"}


def test_viewer_can_read_but_not_write(k, cluster) -> None:
    ns = _namespace(cluster, "viewer")
    _configmap(cluster, ns, "visible")
    listed = k("get", "cm", "-n", ns, "-o", "name", context="sim-136-viewer").stdout.split()
    assert "configmap/visible" in listed

    denied = k("create", "configmap", "nope", "-n", ns, context="sim-136-viewer", check=False)
    assert denied.returncode != 0
    assert "configmaps is forbidden" in denied.stderr
    assert VIEWER_USER in denied.stderr
    assert k("get", "cm", "nope", "-n", ns, check=False).returncode != 0


def test_unknown_token_is_unauthorized(k) -> None:
    done = k("get", "configmaps", "-A", context="sim-136-stranger", check=False)
    assert done.returncode != 0
    assert "error: You must be logged in to the server (Unauthorized)" in done.stderr


def test_no_credentials_is_anonymous_and_forbidden(cluster) -> None:
    # kubectl itself refuses to send a request without credentials (it prompts for a
    # username), so this is a plain HTTPS client that presents nothing. As with
    # kube-apiserver's default --anonymous-auth, that is system:anonymous, which RBAC
    # refuses with 403 (an empty bearer token too); only a rejected credential is 401.
    anonymous = ssl.create_default_context(cafile=str(cluster.pki / "ca.crt"))
    for path in ("/api/v1/namespaces/default/configmaps", "/api", "/apis"):
        status, doc = cluster.api("GET", path, ssl_context=anonymous)
        assert (status, doc.get("kind"), doc.get("reason")) == (403, "Status", "Forbidden")
        assert 'User "system:anonymous" cannot' in doc["message"]
    status, doc = cluster.api("GET", "/api", ssl_context=anonymous,
                              headers={"Authorization": "Bearer "})
    assert (status, doc.get("reason")) == (403, "Forbidden")
    status, doc = cluster.api("GET", "/api", ssl_context=anonymous,
                              headers={"Authorization": "Bearer not-a-known-token"})
    assert (status, doc.get("reason")) == (401, "Unauthorized")


# --------------------------------------------------------------------------- mixed versions

PODGROUP = """\
apiVersion: scheduling.k8s.io/v1alpha2
kind: PodGroup
metadata:
  name: gang
  namespace: {ns}
spec:
  schedulingPolicy:
    gang:
      minCount: 2
"""


def _audit_username(entry: dict) -> str | None:
    user = entry.get("user")
    return user.get("username") if isinstance(user, dict) else user


def _wait_for_audit(path: Path, predicate, timeout: float) -> dict:
    """The first audit line matching ``predicate``; the log may trail the response."""
    deadline = time.monotonic() + timeout
    entries: list[dict] = []
    while True:
        text = path.read_text("utf-8") if path.exists() else ""
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
        found = next((e for e in entries if predicate(e)), None)
        if found is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    assert found is not None, f"no matching audit entry among {len(entries)}: {entries[-5:]!r}"
    return found


def test_podgroup_is_served_only_by_136(k, cluster) -> None:
    ns = _namespace(cluster, "gang")
    manifest = cluster.root / "podgroup.yaml"
    manifest.write_text(PODGROUP.format(ns=ns))
    created = k("create", "-f", manifest).stdout.strip()
    assert created == "podgroup.scheduling.k8s.io/gang created"
    assert k("get", "podgroups", "-n", ns, "-o", "name").stdout.split() == \
        ["podgroup.scheduling.k8s.io/gang"]

    missing = k("get", "podgroups", "-n", ns, context="sim-135", check=False)
    assert missing.returncode != 0
    assert "the server doesn't have a resource type \"podgroups\"" in missing.stderr

    audit = cluster.sims["sim-136"].audit_log_path
    assert audit is not None
    uri = f"/apis/scheduling.k8s.io/v1alpha2/namespaces/{ns}/podgroups"
    entry = _wait_for_audit(
        audit,
        lambda e: e.get("verb") == "create" and e.get("requestURI", "").startswith(uri),
        WAIT_TIMEOUT)
    assert _audit_username(entry) == "kubernetes-admin"
    assert entry["responseStatus"]["code"] == 201


# --------------------------------------------------------------------------- legacy discovery


def test_python_dynamic_client_lists_configmaps(k, cluster, tmp_path, monkeypatch) -> None:
    from kubernetes import client, dynamic

    ns = _namespace(cluster, "python")
    _configmap(cluster, ns, "seeded", {"x": "1"})

    # DynamicClient caches discovery in $TMPDIR/osrcp-*.json: start from an empty one.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for stale in glob.glob(str(tmp_path / "osrcp-*.json")):
        Path(stale).unlink()

    sim = cluster.sims["sim-136"]
    config = client.Configuration()
    config.host = sim.url
    config.ssl_ca_cert = str(cluster.pki / "ca.crt")
    config.cert_file = str(cluster.pki / "admin.crt")
    config.key_file = str(cluster.pki / "admin.key")
    with client.ApiClient(config) as api:
        dyn = dynamic.DynamicClient(api)
        configmaps = dyn.resources.get(api_version="v1", kind="ConfigMap")
        listed = configmaps.get(namespace=ns)
        assert [item.metadata.name for item in listed.items] == ["seeded"]
        assert listed.items[0].data.x == "1"
        podgroups = dyn.resources.get(api_version="scheduling.k8s.io/v1alpha2",
                                      kind="PodGroup")
        assert podgroups.namespaced


def _legacy_get(conn: http.client.HTTPSConnection, path: str) -> dict:
    conn.request("GET", path, headers={"Accept": LEGACY_ACCEPT})
    response = conn.getresponse()
    body = response.read()
    assert response.status == 200, f"GET {path}: {response.status} {body[:300]!r}"
    assert response.getheader("Content-Type", "").startswith("application/json")
    return json.loads(body)


def _expected_resource_list(catalog: Catalog, group: str, version: str) -> dict:
    entry = catalog.group_version(group, version)
    assert entry is not None
    expected: dict[str, tuple] = {}
    for r in entry.resources:
        expected[r.resource] = (r.kind, r.namespaced, frozenset(r.verbs))
        for s in r.subresources:
            expected[f"{r.resource}/{s.subresource}"] = (s.kind, r.namespaced,
                                                         frozenset(s.verbs))
    return expected


@pytest.mark.parametrize("context,version", [("sim-135", "1.35"), ("sim-136", "1.36")])
def test_legacy_discovery_walk_matches_catalog(cluster, context: str, version: str) -> None:
    catalog = load_catalog(version)
    sim = cluster.sims[context]
    conn = http.client.HTTPSConnection("127.0.0.1", sim.port, timeout=10,
                                       context=cluster.admin_ssl)
    try:
        api = _legacy_get(conn, "/api")
        assert api["kind"] == "APIVersions" and api["versions"] == ["v1"]

        group_list = _legacy_get(conn, "/apis")
        assert group_list["kind"] == "APIGroupList"
        groups = [g for g in catalog.groups if g.name]
        assert [g["name"] for g in group_list["groups"]] == [g.name for g in groups]
        for served, g in zip(group_list["groups"], groups, strict=True):
            assert [v["version"] for v in served["versions"]] == [v.version for v in g.versions]
            assert [v["groupVersion"] for v in served["versions"]] == \
                [f"{g.name}/{v.version}" for v in g.versions]
            assert served["preferredVersion"]["version"] == g.versions[0].version

        walked = [("", "v1", "/api/v1")] + [
            (g.name, v.version, f"/apis/{g.name}/{v.version}")
            for g in groups for v in g.versions]
        for group, version_name, path in walked:
            doc = _legacy_get(conn, path)
            assert doc["kind"] == "APIResourceList"
            assert doc["groupVersion"] == (f"{group}/{version_name}" if group else version_name)
            got = {r["name"]: (r["kind"], r["namespaced"], frozenset(r["verbs"]))
                   for r in doc["resources"]}
            assert got == _expected_resource_list(catalog, group, version_name), path
    finally:
        conn.close()


def test_kubectl_get_raw_apis_is_the_legacy_group_list(k) -> None:
    doc = json.loads(k("get", "--raw", "/apis").stdout)
    assert doc["kind"] == "APIGroupList"
    assert [g["name"] for g in doc["groups"]] == \
        [g.name for g in load_catalog("1.36").groups if g.name]


# --------------------------------------------------------------------------- the tooling


def test_kubeconfig_is_private_and_points_at_files(k, cluster) -> None:
    assert cluster.kubeconfig.stat().st_mode & 0o777 == 0o600
    view = json.loads(k("config", "view", "-o", "json").stdout)
    cas = {c["cluster"]["certificate-authority"] for c in view["clusters"]}
    assert cas == {str(cluster.pki / "ca.crt")}
    admin = next(u["user"] for u in view["users"] if u["name"] == "admin")
    assert admin["client-certificate"] == str(cluster.pki / "admin.crt")


def test_stop_ends_the_whole_process_group(tmp_path) -> None:
    from mvproxy.devcluster.launcher import ManagedProcess

    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    proc = ManagedProcess([sys.executable, "-c", script], "parent", tmp_path)
    with proc:
        for _ in range(100):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
    assert not proc.running
    for _ in range(100):  # the grandchild is reaped by init, a moment later
        if not Path(f"/proc/{grandchild}").exists() or \
                Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"grandchild {grandchild} survived stop()")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, wanted: set[str]) -> str:
    for _ in range(100):
        state = _state(pid)
        if state in wanted:
            return state
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} is in state {_state(pid)}, not {wanted}")


def test_freeze_resume_and_kill(tmp_path) -> None:
    """freeze() stops the process (SIGSTOP), resume() continues it, kill() ends it at
    once; stop() also ends a frozen process."""
    from mvproxy.devcluster.launcher import ManagedProcess

    marker = tmp_path / "ignoring"
    script = ("import pathlib, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "pathlib.Path(sys.argv[1]).touch()\n"
              "time.sleep(60)\n")
    proc = ManagedProcess([sys.executable, "-c", script, marker], "sleeper", tmp_path)

    def ignoring_sigterm() -> None:
        for _ in range(200):
            if marker.exists():
                return
            time.sleep(0.05)
        raise AssertionError("the child never started")

    with proc:
        assert proc.pid is not None
        ignoring_sigterm()
        proc.freeze()
        _wait_state(proc.pid, {"T"})
        proc.resume()
        _wait_state(proc.pid, {"S", "R"})
        started = time.monotonic()
        assert proc.kill() == -signal.SIGKILL  # it ignores SIGTERM: no 10 s wait
        assert time.monotonic() - started < 5 and not proc.running
        marker.unlink()
        proc.start()
        ignoring_sigterm()
        proc.freeze()
        _wait_state(proc.pid, {"T"})
        assert proc.stop(timeout=1) == -signal.SIGKILL
    proc.freeze()  # not running: nothing to do
    proc.resume()


def test_wait_ready_reports_an_early_exit_with_its_log(tmp_path) -> None:
    from mvproxy.devcluster.launcher import ManagedProcess, ProcessError

    script = "import sys; print('bad flag --frobnicate'); sys.exit(3)"
    proc = ManagedProcess([sys.executable, "-c", script], "broken", tmp_path,
                          ready_url=f"http://127.0.0.1:{free_port()}/readyz")
    with proc, pytest.raises(ProcessError, match="(?s)exited with code 3.*--frobnicate"):
        proc.wait_ready(10)
