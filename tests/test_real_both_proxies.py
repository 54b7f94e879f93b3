"""Both proxies at once, against real kube-apiservers 1.35.4 and 1.36.3: each server's
built-in peer proxy on (``--peer-ca-file``, the peer-advertise flags, the gate) AND an
mvproxy in front of each (issue 20 §4).

A request rerouted by the old server's mvproxy reaches the new server's mvproxy with
``x-kubernetes-peer-proxied: true`` and goes to its kube-apiserver once: the old
kube-apiserver never sees it (so its built-in proxy cannot add a second hop), nothing
loops, and the new server's audit log names the client's user and address. A client
straight at the old kube-apiserver still gets the built-in proxy's answer.

One cluster for the module (``scripts/upstream_comparison.py``'s flags); without the
binaries these tests skip (fail under CI).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_support import audit_entries, metrics, request, wait_for_audit
from real_support import require_binaries, upstream_comparison

from mvproxy.devcluster.realdemo import RealCluster

VERSIONS = ("1.35.4", "1.36.3")
OLD, NEW = "apiserver-0", "apiserver-1"
CLIENT = "127.0.0.9"
MAP_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"
REROUTED = "apiserver_rerouted_request_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    binaries = require_binaries(VERSIONS)
    cmp = upstream_comparison()
    directory = tmp_path_factory.mktemp("both-proxies") / "demo"
    with cmp.start_pair(directory, VERSIONS, cmp.BOTH, binaries=binaries) as running:
        yield running


def _policy(name: str) -> dict:
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {"matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                "resources": ["configmaps"]}]},
                "failurePolicy": "Fail", "reinvocationPolicy": "Never",
                "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {
                    "expression": 'Object{metadata: Object.metadata{labels: {"a": "b"}}}'}}]}}


def _backend_rerouted(cluster: RealCluster, sid: str) -> float:
    """The kube-apiserver's own count of requests its built-in proxy rerouted."""
    answer = request(cluster, sid, "GET", "/metrics", direct=True)
    assert answer.status == 200, answer
    return sum(float(line.rpartition(" ")[2]) for line in answer.body.decode().splitlines()
               if line.startswith(REROUTED))


def _created(name: str):
    return lambda e: (e.get("verb") == "create" and e.get("stage") == "ResponseComplete"
                      and (e.get("objectRef") or {}).get("name") == name)


def test_a_rerouted_request_is_served_once_by_the_peer(cluster: RealCluster) -> None:
    name = "both-proxies"
    before = {sid: _backend_rerouted(cluster, sid) for sid in (OLD, NEW)}
    ours = metrics(cluster, OLD)
    made = request(cluster, OLD, "POST", MAP_PATH, body=_policy(name), source=CLIENT)
    assert made.status == 201, made
    try:
        got = request(cluster, OLD, "GET", f"{MAP_PATH}/{name}", source=CLIENT)
        assert (got.status, got.json()["metadata"]["uid"]) == (200, made.json()["metadata"]["uid"])
        # Who the client is, as the old kube-apiserver itself records the same identity.
        own = request(cluster, OLD, "GET", "/api/v1/namespaces/default", direct=True)
        assert own.status == 200, own
        me = wait_for_audit(cluster.server(OLD).audit_log,
                            lambda e: e.get("requestURI") == "/api/v1/namespaces/default"
                            and e.get("stage") == "ResponseComplete")["user"]
        entry = wait_for_audit(cluster.server(NEW).audit_log, _created(name))
        assert (entry["user"]["username"], entry["user"].get("groups")) == \
            (me["username"], me.get("groups"))
        assert entry["sourceIPs"][0] == CLIENT
        assert entry["responseStatus"]["code"] == 201
        # Once: one create on the new server, none on the old one (no second hop).
        assert len([e for e in audit_entries(cluster.server(NEW).audit_log)
                    if _created(name)(e)]) == 1
        assert not [e for e in audit_entries(cluster.server(OLD).audit_log)
                    if (e.get("objectRef") or {}).get("name") == name]
        assert {sid: _backend_rerouted(cluster, sid) for sid in (OLD, NEW)} == before
        after = metrics(cluster, OLD)
        key = next(k for k in after if k.startswith(REROUTED) and 'code="201"' in k)
        assert after[key] == ours.get(key, 0.0) + 1
    finally:
        request(cluster, OLD, "DELETE", f"{MAP_PATH}/{name}")


def test_straight_at_the_old_server_the_built_in_proxy_still_answers(
        cluster: RealCluster) -> None:
    name = "built-in-beside"
    before = _backend_rerouted(cluster, OLD)
    made = request(cluster, OLD, "POST", MAP_PATH, body=_policy(name), direct=True)
    assert made.status == 201, made
    try:
        assert _backend_rerouted(cluster, OLD) == before + 1
        # The object is the same one through either proxy.
        got = request(cluster, OLD, "GET", f"{MAP_PATH}/{name}")
        assert (got.status, got.json()["metadata"]["uid"]) == (200, made.json()["metadata"]["uid"])
    finally:
        request(cluster, OLD, "DELETE", f"{MAP_PATH}/{name}")


def test_the_comparisons_row_says_the_same(cluster: RealCluster) -> None:
    """``scripts/upstream_comparison.py``'s "Both proxies at once" row, on this cluster."""
    both = upstream_comparison().both_proxies(cluster, VERSIONS)
    assert both.via_mvproxy.startswith("create 201"), both
    assert (both.new_creates, both.old_entries, both.old_rerouted) == (1, 0, 0), both
    assert both.mvproxy_rerouted >= 2, both  # the create and the get
    assert both.direct.startswith("201") and both.direct_rerouted == 1, both
