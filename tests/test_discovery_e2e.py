"""End to end, merged discovery (issue 4): real kubectl 1.36 and plain HTTPS clients
against real ``mvproxy run`` processes in front of a 1.35 and a 1.36 simulated
kube-apiserver (``mvproxy.devcluster.demo.start_cluster``, loopback, free ports).

apiserver-0 runs 1.35, apiserver-1 runs 1.36. The module fixture starts everything
and stops every process at teardown, whatever happens; a test that stops a process
starts it again in ``finally``. Nothing here skips.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from e2e_support import (
    AGGREGATED_V2,
    AGGREGATED_V2BETA1,
    KUBECTL_DISCOVERY_ACCEPT,
    LEGACY_ACCEPT,
    NOPEER_V2,
    aggregated_group_versions,
    group_versions,
    metrics,
    peer_reachable,
    request,
    resource_names,
    wait_peer_unreachable,
)

from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.demo import DemoCluster, start_cluster

OLD, NEW = "apiserver-0", "apiserver-1"
SCHEDULING = "scheduling.k8s.io"  # 1.35: v1, v1alpha1; 1.36: v1, v1alpha2
CAT_135, CAT_136 = load_catalog("1.35"), load_catalog("1.36")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    with start_cluster(tmp_path_factory.mktemp("discovery-e2e"), ["1.35", "1.36"],
                       base_port=0) as running:
        yield running


@pytest.fixture(scope="module")
def k(cluster: DemoCluster, kubectl):
    """kubectl on the cluster's kubeconfig: ``k(*args, context=OLD)``."""

    def run(*args: str, context: str = OLD, check: bool = True):
        return kubectl(*args, kubeconfig=cluster.kubeconfig, context=context, check=check)

    return run


def _api_resources(k, context: str = OLD) -> list[str]:
    return k("api-resources", "-o", "name", context=context).stdout.split()


def _merged(cluster: DemoCluster, accept: str = KUBECTL_DISCOVERY_ACCEPT, **kw):
    return request(cluster, OLD, "GET", "/apis", headers={"Accept": accept}, **kw)


# --------------------------------------------------------------------------- the union


def test_kubectl_api_resources_through_the_old_server_is_the_union(k) -> None:
    printed = _api_resources(k)
    assert "podgroups.scheduling.k8s.io" in printed  # 1.36 only
    assert "workloads.scheduling.k8s.io" in printed
    assert len(printed) == len(set(printed)), "a resource is listed twice"
    assert set(printed) == resource_names(CAT_135) | resource_names(CAT_136)

    # The same kubectl straight at the 1.35 kube-apiserver sees no PodGroups.
    direct = _api_resources(k, context=f"{OLD}-direct")
    assert "podgroups.scheduling.k8s.io" not in direct
    assert set(direct) == resource_names(CAT_135)


def test_kubectl_shows_podgroups_with_their_version(k) -> None:
    table = k("api-resources", "--api-group", "scheduling.k8s.io").stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in table[1:] if line.strip()}
    assert "scheduling.k8s.io/v1alpha2" in rows["podgroups"]
    assert "PodGroup" in rows["podgroups"]


def test_merged_document_headers_etag_and_304(cluster: DemoCluster) -> None:
    first = _merged(cluster)
    assert first.status == 200, first
    assert first.headers["Content-Type"] == AGGREGATED_V2
    etag = first.headers["ETag"]
    assert etag
    doc = first.json()
    assert (doc["kind"], doc["apiVersion"]) == ("APIGroupDiscoveryList", "apidiscovery.k8s.io/v2")
    merged = aggregated_group_versions(doc)
    assert merged[("scheduling.k8s.io", "v1alpha2")]["freshness"] == "Current"
    union = group_versions(CAT_135) | group_versions(CAT_136)
    assert set(merged) == {gv for gv in union if gv[0]}  # /apis has no core group

    again = request(cluster, OLD, "GET", "/apis",
                    headers={"Accept": KUBECTL_DISCOVERY_ACCEPT, "If-None-Match": etag})
    assert again.status == 304, again
    assert again.body == b""
    assert again.headers["ETag"] == etag


def test_v2beta1_then_json_gets_the_merged_legacy_list_as_from_a_backend_without_it(
        cluster: DemoCluster) -> None:
    """kube-apiserver 1.33+ no longer serves aggregated v2beta1: a client asking for it,
    then JSON, gets the legacy APIGroupList; through mvproxy, the merged one."""
    sent = f"{AGGREGATED_V2BETA1},application/json"
    own = request(cluster, OLD, "GET", "/apis", headers={"Accept": sent}, direct=True)
    assert (own.status, own.json()["kind"]) == (200, "APIGroupList"), own
    answer = _merged(cluster, sent)
    assert answer.status == 200, answer
    assert answer.headers["Content-Type"] == "application/json"
    doc = answer.json()
    assert doc["kind"] == "APIGroupList"
    versions = {v["groupVersion"] for g in doc["groups"] for v in g["versions"]}
    assert f"{SCHEDULING}/v1alpha2" in versions  # 1.36 only


@pytest.mark.parametrize("path", ["/apis", "/api"])
def test_v2beta1_only_is_refused_as_the_backend_refuses_it(cluster: DemoCluster,
                                                           path: str) -> None:
    own = request(cluster, OLD, "GET", path, headers={"Accept": AGGREGATED_V2BETA1},
                  direct=True)
    answer = request(cluster, OLD, "GET", path, headers={"Accept": AGGREGATED_V2BETA1})
    assert own.status == answer.status == 406, answer
    assert answer.json()["reason"] == own.json()["reason"] == "NotAcceptable"
    assert answer.json()["message"] == own.json()["message"]


@pytest.fixture(scope="module")
def beta_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    """1.31 and 1.32: releases that still serve aggregated v2beta1."""
    with start_cluster(tmp_path_factory.mktemp("discovery-e2e-beta"), ["1.31", "1.32"],
                       base_port=0) as running:
        yield running


def test_v2beta1_is_merged_while_the_backend_serves_it(beta_cluster: DemoCluster) -> None:
    old, new = load_catalog("1.31"), load_catalog("1.32")
    only_new = sorted(gv for gv in group_versions(new) - group_versions(old) if gv[0])
    assert only_new, "1.32 serves no group/version 1.31 lacks"
    own = request(beta_cluster, OLD, "GET", "/apis", headers={"Accept": AGGREGATED_V2BETA1},
                  direct=True)
    assert own.headers["Content-Type"] == AGGREGATED_V2BETA1, own
    answer = _merged(beta_cluster, AGGREGATED_V2BETA1)
    assert answer.status == 200, answer
    assert answer.headers["Content-Type"] == AGGREGATED_V2BETA1
    doc = answer.json()
    assert doc["apiVersion"] == "apidiscovery.k8s.io/v2beta1"
    assert set(only_new) <= set(aggregated_group_versions(doc))
    assert not set(only_new) & set(aggregated_group_versions(own.json()))


def test_v2beta1_nopeer_is_the_backends_own_answer(cluster: DemoCluster,
                                                   beta_cluster: DemoCluster) -> None:
    for running in (cluster, beta_cluster):
        for sent in (f"{AGGREGATED_V2BETA1};profile=nopeer",
                     f"{AGGREGATED_V2BETA1};profile=nopeer,application/json"):
            own = request(running, OLD, "GET", "/apis", headers={"Accept": sent},
                          direct=True)
            answer = _merged(running, sent)
            assert (answer.status, answer.headers["Content-Type"]) == \
                (own.status, own.headers["Content-Type"]), sent
            assert answer.json() == own.json()


def test_nopeer_is_exactly_the_backends_own_view(cluster: DemoCluster) -> None:
    answer = _merged(cluster, NOPEER_V2)
    assert answer.status == 200, answer
    own = request(cluster, OLD, "GET", "/apis", headers={"Accept": NOPEER_V2}, direct=True)
    assert own.status == 200, own
    assert answer.json() == own.json()
    served = set(aggregated_group_versions(answer.json()))
    assert served == {gv for gv in group_versions(CAT_135) if gv[0]}
    assert ("scheduling.k8s.io", "v1alpha2") not in served


def test_legacy_group_list_lists_the_peer_only_version(k) -> None:
    doc = json.loads(k("get", "--raw", "/apis").stdout)
    assert doc["kind"] == "APIGroupList"
    scheduling = next(g for g in doc["groups"] if g["name"] == "scheduling.k8s.io")
    versions = [v["version"] for v in scheduling["versions"]]
    assert "v1alpha2" in versions and "v1alpha1" in versions and "v1" in versions
    assert {g["name"] for g in doc["groups"]} == \
        {g.name for g in CAT_135.groups + CAT_136.groups if g.name}


def test_group_discovery_lists_the_peer_only_version_and_agrees_with_apis(k) -> None:
    """``kubectl get --raw /apis/<g>`` (legacy APIGroup, answered locally upstream by
    staging/src/k8s.io/apiserver/pkg/endpoints/discovery/group.go) lists the 1.36-only
    version through the 1.35 server, exactly as its entry in the merged ``/apis``."""
    group = json.loads(k("get", "--raw", f"/apis/{SCHEDULING}").stdout)
    assert (group.pop("kind"), group.pop("apiVersion")) == ("APIGroup", "v1")
    assert {"v1", "v1alpha1", "v1alpha2"} <= {v["version"] for v in group["versions"]}
    listed = json.loads(k("get", "--raw", "/apis").stdout)
    assert group == next(g for g in listed["groups"] if g["name"] == SCHEDULING)
    direct = json.loads(k("get", "--raw", f"/apis/{SCHEDULING}",
                          context=f"{OLD}-direct").stdout)
    assert "v1alpha2" not in {v["version"] for v in direct["versions"]}


@pytest.mark.parametrize("path", ["/apis", f"/apis/{SCHEDULING}"])
@pytest.mark.parametrize("accept", [KUBECTL_DISCOVERY_ACCEPT, LEGACY_ACCEPT])
def test_anonymous_gets_the_backends_403_not_discovery(cluster: DemoCluster,
                                                        accept: str, path: str) -> None:
    """kube-apiserver (and so the simulator) takes no credentials as system:anonymous,
    which RBAC refuses discovery with 403 naming only the path the client asked for."""
    answer = request(cluster, OLD, "GET", path, headers={"Accept": accept}, cert=None)
    assert answer.status == 403, answer
    doc = answer.json()
    assert (doc["kind"], doc["reason"]) == ("Status", "Forbidden")
    assert doc["message"] == f'forbidden: User "system:anonymous" cannot get path "{path}"'
    assert b"podgroups" not in answer.body and b"v1alpha2" not in answer.body


@pytest.mark.parametrize("token", [None, "not-a-known-token"])
def test_unauthenticated_cannot_tell_a_merged_group_from_an_unknown_one(
        cluster: DemoCluster, token: str | None) -> None:
    """A refusal for a group only the peer serves is the backend's own, the same as for
    a group nobody serves: whatever it accepts, the client learns nothing."""
    for accept in (LEGACY_ACCEPT, "text/html", "application/vnd.kubernetes.protobuf"):
        paths = (f"/apis/{SCHEDULING}", "/apis/nothing.example.com")
        answers = [request(cluster, OLD, "GET", path, headers={"Accept": accept}, cert=None,
                           token=token) for path in paths]
        # No credentials: 403 naming the path asked for; an unknown token: 401.
        assert [a.status for a in answers] == [401 if token else 403] * 2, answers
        assert answers[0].body.replace(paths[0].encode(), b"PATH") == \
            answers[1].body.replace(paths[1].encode(), b"PATH")
        assert sorted(answers[0].headers.keys()) == sorted(answers[1].headers.keys())


def test_unknown_token_gets_401_viewer_token_gets_discovery(cluster: DemoCluster) -> None:
    for _ in range(3):  # a refusal is never remembered (only a yes is, briefly)
        denied = _merged(cluster, cert=None, token="not-a-known-token")
        assert denied.status == 401, denied
    viewer = _merged(cluster, cert=None, token=cluster.tokens["viewer-token"])
    assert viewer.status == 200, viewer
    assert ("scheduling.k8s.io", "v1alpha2") in aggregated_group_versions(viewer.json())


# --------------------------------------------------------------------------- metrics


def test_cache_hit_metric_grows_on_repeated_requests(cluster: DemoCluster) -> None:
    name = "aggregator_discovery_peer_aggregated_cache_hits_total"
    _merged(cluster)  # rendered (a miss at most once per cache generation)
    before = metrics(cluster, OLD)[name]
    for _ in range(3):
        assert _merged(cluster).status == 200
    after = metrics(cluster, OLD)[name]
    # A generation change between requests (a peer's discovery changed) costs one miss.
    assert after - before >= 2, (before, after)


def test_peer_up_metric(cluster: DemoCluster) -> None:
    assert metrics(cluster, OLD)[f'mvproxy_peer_up{{peer="{NEW}"}}'] == 1.0
    assert metrics(cluster, NEW)[f'mvproxy_peer_up{{peer="{OLD}"}}'] == 1.0


# --------------------------------------------------------------------------- stale


def test_unreachable_peer_goes_stale_then_current_again(cluster: DemoCluster, k) -> None:
    """Stop the 1.36 mvproxy: its versions stay listed, marked Stale (kubectl skips
    them, garbage collection treats them as unknown, not gone); start it: Current."""
    up = f'mvproxy_peer_up{{peer="{NEW}"}}'
    nopeer = "aggregator_discovery_nopeer_requests_total"
    cluster.stop_server(NEW)
    try:
        wait_peer_unreachable(cluster, OLD, NEW)
        assert metrics(cluster, OLD)[up] == 0.0

        answer = _merged(cluster)
        assert answer.status == 200, answer
        merged = aggregated_group_versions(answer.json())
        assert merged[("scheduling.k8s.io", "v1alpha2")]["freshness"] == "Stale"
        assert merged[("scheduling.k8s.io", "v1alpha1")]["freshness"] == "Current"
        assert merged[("apps", "v1")]["freshness"] == "Current"

        printed = _api_resources(k)
        assert "podgroups.scheduling.k8s.io" not in printed
        assert "workloads.scheduling.k8s.io" in printed  # 1.35 serves v1alpha1
        assert "deployments.apps" in printed

        # With the only peer down, nobody else can ask apiserver-0 for its own view:
        # the nopeer counter moves by exactly the requests made here.
        before = metrics(cluster, OLD)[nopeer]
        for _ in range(2):
            assert _merged(cluster, NOPEER_V2).status == 200
        assert metrics(cluster, OLD)[nopeer] == before + 2
    finally:
        cluster.start_server(NEW)

    assert peer_reachable(cluster, OLD, NEW) is True
    assert metrics(cluster, OLD)[up] == 1.0
    merged = aggregated_group_versions(_merged(cluster).json())
    assert merged[("scheduling.k8s.io", "v1alpha2")]["freshness"] == "Current"
    assert "podgroups.scheduling.k8s.io" in _api_resources(k)

