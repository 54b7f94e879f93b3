"""What mvproxy lists can be got through it, against real kube-apiservers 1.36.3 and
1.37.2 sharing one etcd, before and after the 1.37.2 server is rolled back to 1.36.3.

A kube-apiserver answers ``/apis/<g>`` from the APIService objects in etcd, where each
server registers its groups (``automanaged: onstart``; a server starting removes those
it does not serve). So while both run, the real old server describes a group only the
new one serves (``storagemigration.k8s.io``) at ``/apis/<g>`` and answers 404 at
``/apis/<g>/<v>``: the inconsistency is the real server's, not mvproxy's. Through
mvproxy every group its ``/apis`` lists answers ``/apis/<g>`` and ``/apis/<g>/<v>``,
and after the rollback the group is a 404 at ``/apis/<g>``.

One cluster for the module; without the binaries these tests skip (fail under CI).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_support import request
from real_support import require_binaries

from mvproxy.devcluster.realdemo import RealCluster, start_real_cluster

VERSIONS = ("1.36.3", "1.37.2")
OLD, NEW = "apiserver-0", "apiserver-1"
JSON = {"Accept": "application/json"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    binaries = require_binaries(VERSIONS)
    with start_real_cluster(tmp_path_factory.mktemp("rollback") / "demo", VERSIONS, 0,
                            binaries=binaries) as running:
        yield running


def _new_only_groups(cluster: RealCluster) -> set[tuple[str, str]]:
    """(group, version) of groups only the new server serves, from their own discovery."""
    old = {g for g, _, _ in cluster.served(OLD)}
    return {(g, v) for g, v, _ in cluster.served(NEW) if g not in old}


def _listed(cluster: RealCluster, sid: str) -> dict[str, list[str]]:
    answer = request(cluster, sid, "GET", "/apis", headers=JSON)
    assert answer.status == 200, answer
    return {g["name"]: [v["version"] for v in g["versions"]] for g in answer.json()["groups"]}


def _everything_listed_can_be_got(cluster: RealCluster, sid: str) -> None:
    for group, versions in _listed(cluster, sid).items():
        answer = request(cluster, sid, "GET", f"/apis/{group}", headers=JSON)
        assert (answer.status, answer.json()["kind"]) == (200, "APIGroup"), (group, answer)
        assert [v["version"] for v in answer.json()["versions"]] == versions
        for version in versions:
            answer = request(cluster, sid, "GET", f"/apis/{group}/{version}", headers=JSON)
            assert (answer.status, answer.json()["kind"]) == (200, "APIResourceList"), \
                (group, version, answer)


def test_a_new_only_group_is_listed_and_got_through_the_old_mvproxy(
        cluster: RealCluster) -> None:
    new_only = _new_only_groups(cluster)
    assert new_only, "1.37.2 serves no group 1.36.3 lacks"
    for group, version in sorted(new_only):
        # The real old server alone: an APIGroup from etcd, then a 404.
        ghost = request(cluster, OLD, "GET", f"/apis/{group}", headers=JSON, direct=True)
        assert (ghost.status, ghost.json()["kind"]) == (200, "APIGroup"), ghost
        gone = request(cluster, OLD, "GET", f"/apis/{group}/{version}", headers=JSON,
                       direct=True)
        assert gone.status == 404, gone
    for sid in (OLD, NEW):
        _everything_listed_can_be_got(cluster, sid)
    assert {g for g, _ in new_only} <= set(_listed(cluster, OLD))


def test_after_a_rollback_a_group_nobody_serves_is_not_described(
        cluster: RealCluster) -> None:
    new_only = _new_only_groups(cluster)
    cluster.replace_backend(NEW, VERSIONS[0])
    try:
        for group, _ in sorted(new_only):
            for sid in (OLD, NEW):
                through = request(cluster, sid, "GET", f"/apis/{group}", headers=JSON)
                assert (through.status, through.body) == (404, b"404 page not found\n"), \
                    through
                assert group not in _listed(cluster, sid)
        for sid in (OLD, NEW):
            _everything_listed_can_be_got(cluster, sid)
    finally:
        cluster.replace_backend(NEW, VERSIONS[1])
