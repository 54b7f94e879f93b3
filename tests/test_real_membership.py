"""Membership and a rolling upgrade against real kube-apiservers 1.35.4 and 1.36.3
(issue 20 §3): each mvproxy (``--workers 2``) finds its peers through Leases, its
peers' mvproxy Leases and the real servers' own identity Leases
(``peers.leases.apiServerIdentity``); a member without an mvproxy is reached through
its identity Lease alone, and its restart (which deletes that Lease) costs its APIs a
retry-later answer (503, or 502 for a GET the closing server cut), never a 404; the
1.35 server is replaced by 1.36 and rolled back while a new-only
resource stays reachable through both mvproxies, with no mvproxy restarted.

The 1.35 server runs with ``--feature-gates=UnknownVersionInteroperabilityProxy=true``:
without it 1.35 writes no ``kubernetes.io/peer-advertise-address`` on its identity
Lease (see the test that says why), while 1.36 writes one with the gate's default. The new-only set
comes from the servers' own discovery. One module-scoped cluster; every wait is
bounded; every process is stopped at teardown. Skips without the binaries (fails under
CI).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from e2e_support import (
    AGGREGATED_V2,
    aggregated_group_versions,
    audit_entries,
    request,
    wait_until,
)
from real_support import require_binaries

from mvproxy.devcluster.kubehttp import GVR
from mvproxy.devcluster.realdemo import MAP_GVR, RealCluster, start_real_cluster

VERSIONS = ("1.35.4", "1.36.3")
OLD, NEW = "apiserver-0", "apiserver-1"
GATE = "--feature-gates=UnknownVersionInteroperabilityProxy=true"
IDENTITY = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases"
IDENTITY_SELECTOR = "?labelSelector=apiserver.kubernetes.io/identity%3Dkube-apiserver"
MVPROXY_SELECTOR = "?labelSelector=app.kubernetes.io/name%3Dmvproxy"
MAP_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"
CONVERGE = 60.0  # a kube-apiserver restarted and every worker's view converged
ADMIN_USER = "kubernetes-admin"


# --------------------------------------------------------------------------- the cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    binaries = require_binaries(VERSIONS)
    with start_real_cluster(tmp_path_factory.mktemp("membership") / "demo", VERSIONS, 0,
                            binaries=binaries, membership="leases",
                            extra_apiserver_args={OLD: [GATE]}) as running:
        for server in running.servers:  # identity Leases too, two workers each
            doc = yaml.safe_load(server.config.read_text("utf-8"))
            doc["peers"]["leases"]["apiServerIdentity"] = True
            doc["workers"] = 2
            server.config.write_text(yaml.safe_dump(doc, sort_keys=False), "utf-8")
            running.stop_server(server.id)
            running.start_server(server.id)
        yield running


@pytest.fixture(scope="module")
def new_only(cluster: RealCluster) -> frozenset[GVR]:
    only = cluster.served(NEW) - cluster.served(OLD)
    assert MAP_GVR in only, sorted(only)
    return only


def _identity_leases(cluster: RealCluster) -> dict[str, dict[str, Any]]:
    """The kube-apiservers' identity Leases by the server they name (host:port)."""
    answer = request(cluster, OLD, "GET", IDENTITY + IDENTITY_SELECTOR, direct=True)
    assert answer.status == 200, answer
    return {(item["metadata"].get("annotations") or {}).get(
        "kubernetes.io/peer-advertise-address", ""): item for item in answer.json()["items"]}


def _identity_id(cluster: RealCluster, sid: str) -> str:
    """Server ``sid``'s kube-apiserver's ID, the name of its identity Lease."""
    server = cluster.server(sid)
    leases = _identity_leases(cluster)
    where = f"{server.host}:{server.backend_port}"
    assert where in leases, (where, sorted(leases))
    return leases[where]["metadata"]["name"]


def _debug(cluster: RealCluster, sid: str, path: str = "/debug/mvproxy") -> dict[str, Any]:
    with urllib.request.urlopen(cluster.server(sid).admin_url + path, timeout=10) as answer:
        return json.load(answer)


def _worker_peers(cluster: RealCluster, sid: str) -> list[dict[str, dict[str, Any]]]:
    """Each worker's peers (server ID -> state) in ``sid``'s mvproxy."""
    return [(w.get("state") or {}).get("peers") or {} for w in _debug(cluster, sid)["workers"]]


def _sees(cluster: RealCluster, sid: str, wanted: set[str], gone: set[str] = frozenset()
          ) -> bool:
    """Every worker of ``sid``'s mvproxy has every ``wanted`` peer reachable, none of
    ``gone``."""
    views = _worker_peers(cluster, sid)
    return len(views) == 2 and all(
        all(view.get(p, {}).get("reachable") for p in wanted) and not gone & set(view)
        for view in views)


def _route(cluster: RealCluster, sid: str, path: str) -> dict[str, Any]:
    return _debug(cluster, sid, f"/debug/mvproxy/route?method=GET&path={path}")


def _merged_lists(cluster: RealCluster, sid: str, gvrs: frozenset[GVR]) -> bool:
    answer = request(cluster, sid, "GET", "/apis", headers={"Accept": AGGREGATED_V2})
    merged = aggregated_group_versions(answer.json()) if answer.status == 200 else {}
    return all((g, v) in merged and r in {x["resource"] for x in merged[(g, v)]["resources"]}
               for g, v, r in gvrs)


def _map(name: str) -> dict[str, Any]:
    from mvproxy.devcluster.realdemo import MAP_EXAMPLE

    body = yaml.safe_load(MAP_EXAMPLE)
    body["metadata"]["name"] = name
    return body


@dataclass
class Prober:
    """GETs of one path through mvproxies on a thread, every answer's status kept."""

    cluster: RealCluster
    path: str
    sids: tuple[str, ...]
    answers: list[tuple[float, str, int, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Prober:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self.stop.is_set():
            for sid in self.sids:
                try:
                    answer = request(self.cluster, sid, "GET", self.path, timeout=10)
                    status, retry = answer.status, answer.headers.get("Retry-After", "")
                except (AssertionError, OSError, http.client.HTTPException):
                    status, retry = 0, ""
                self.answers.append((time.monotonic(), sid, status, retry))
            time.sleep(0.1)

    def summary(self) -> dict[str, Counter[int]]:
        return {sid: Counter(s for _, who, s, _ in self.answers if who == sid)
                for sid in self.sids}


def _only_retry_later(prober: Prober, statuses: Counter[int]) -> None:
    """Answers were 200, or a failure that tells the client to retry: 503 (nobody
    reachable serves it now), or 502 for a GET whose connection the server closed as
    it shut down; each with Retry-After."""
    assert statuses[200] and set(statuses) <= {200, 502, 503}, statuses
    assert all(retry for _, _, status, retry in prober.answers if status != 200), \
        prober.answers


# --------------------------------------------------------------------------- membership


def test_what_the_real_servers_publish_and_whom_each_mvproxy_takes(cluster: RealCluster,
                                                                   new_only) -> None:
    leases = _identity_leases(cluster)
    for server in cluster.servers:  # 1.35 with the gate, 1.36 by default
        assert f"{server.host}:{server.backend_port}" in leases, sorted(leases)
    old_id, new_id = _identity_id(cluster, OLD), _identity_id(cluster, NEW)
    for item in leases.values():
        assert item["spec"]["holderIdentity"].startswith(item["metadata"]["name"] + "_")
        assert item["spec"]["leaseDurationSeconds"] == 3600
    # Each mvproxy, in both workers: its peer's mvproxy and kube-apiserver; never its
    # own kube-apiserver's identity Lease.
    wait_until(lambda: _sees(cluster, OLD, {NEW, new_id}, {old_id}),
               "the old mvproxy's workers to take the new member's two Leases", CONVERGE)
    wait_until(lambda: _sees(cluster, NEW, {OLD, old_id}, {new_id}),
               "the new mvproxy's workers to take the old member's two Leases", CONVERGE)
    sources = {s["serverID"]: s["source"] for s in _debug(cluster, OLD,
                                                          "/debug/mvproxy/peers")["servers"]}
    assert sources[NEW] == "lease" and sources[new_id] == "apiserver-identity", sources
    # One mvproxy Lease per member, though each runs two workers.
    held = request(cluster, OLD, "GET", IDENTITY + MVPROXY_SELECTOR, direct=True).json()
    assert sorted(i["metadata"]["name"] for i in held["items"]) == [
        f"mvproxy-{OLD}", f"mvproxy-{NEW}"]
    assert request(cluster, OLD, "GET", MAP_PATH).status == 200


def test_a_1_35_server_without_the_gate_publishes_no_address() -> None:
    """Why the module starts 1.35 with the gate: the upstream source (pkg/controlplane/
    apiserver/server.go, v1.35.4) writes the annotation only while it is on, and it is
    off by default in 1.35 (alpha); the first run of this suite without it saw a 1.35
    identity Lease without annotations, which mvproxy ignores ("no_address")."""
    from mvproxy.leases import LeaseRejected, parse_lease

    bare = {"metadata": {"name": "apiserver-qzk7tc3nd7lrymr74debrusv3a",
                         "labels": {"apiserver.kubernetes.io/identity": "kube-apiserver",
                                    "kubernetes.io/hostname": "vm"}},
            "spec": {"holderIdentity": "apiserver-qzk7tc3nd7lrymr74debrusv3a_791c75f4",
                     "leaseDurationSeconds": 3600,
                     "renewTime": "2026-12-01T23:26:36.043415Z"}}
    with pytest.raises(LeaseRejected) as rejected:
        parse_lease(bare)
    assert rejected.value.reason == "no_address"


def test_a_member_without_mvproxy_is_reached_through_its_identity_lease(
        cluster: RealCluster, new_only) -> None:
    """The new member's mvproxy stopped (its Lease goes with it): the old mvproxy
    reaches the new kube-apiserver straight through its identity Lease. That server
    then restarts, and a graceful shutdown deletes its identity Lease: through the old
    mvproxy, what only it serves answers 503 with Retry-After meanwhile, never 404."""
    new_id = _identity_id(cluster, NEW)
    cluster.stop_server(NEW)
    try:
        wait_until(lambda: _sees(cluster, OLD, {new_id}, {NEW}),
                   "the old mvproxy to keep only the identity Lease's peer", CONVERGE)
        made = request(cluster, OLD, "POST", MAP_PATH, body=_map("through-identity"))
        assert made.status == 201, made
        entry = wait_until(lambda: next((e for e in audit_entries(cluster.server(NEW).audit_log)
                                         if e.get("verb") == "create"
                                         and e.get("objectRef", {}).get("name")
                                         == "through-identity"), None),
                           "the create in the new server's audit log")
        assert entry["user"]["username"] == ADMIN_USER and entry["responseStatus"]["code"] == 201

        backend = cluster.backend(NEW)
        with Prober(cluster, MAP_PATH, (OLD,)) as prober:
            backend.stop()  # graceful: the identity Lease is deleted
            assert request(cluster, OLD, "GET", IDENTITY + f"/{new_id}",
                           direct=True).status == 404
            backend.start()
            backend.wait_ready(CONVERGE)
            wait_until(lambda: request(cluster, OLD, "GET", MAP_PATH).status == 200,
                       "what the new server serves, through the old mvproxy", CONVERGE)
        statuses = prober.summary()[OLD]
        assert not statuses[404], prober.answers
        _only_retry_later(prober, statuses)
    finally:
        cluster.start_server(NEW)


# --------------------------------------------------------------------------- the upgrade walk


def _converged(cluster: RealCluster, new_only: frozenset[GVR], served_by_old: bool) -> bool:
    """Both mvproxies (every worker) see each other and both kube-apiservers, list the
    new-only resources, and the old mvproxy routes them to its backend exactly when it
    serves them."""
    try:  # a restarted server writes its identity Lease a moment after it is ready
        old_id, new_id = _identity_id(cluster, OLD), _identity_id(cluster, NEW)
    except AssertionError:
        return False
    route = _route(cluster, OLD, MAP_PATH)["route"]
    return (_sees(cluster, OLD, {NEW, new_id}) and _sees(cluster, NEW, {OLD, old_id})
            and all(_merged_lists(cluster, sid, new_only) for sid in (OLD, NEW))
            and route == ("backend" if served_by_old else "peer"))


def test_a_rolling_upgrade_walk_keeps_a_new_only_resource_reachable(
        cluster: RealCluster, new_only) -> None:
    """The 1.35 server replaced by 1.36, then rolled back, with no mvproxy restart:
    after each step peers and merged discovery converge, and through both mvproxies
    the new-only resource answers throughout (a 503 with Retry-After at worst, never
    404)."""
    supervisors = [s.proxy.pid for s in cluster.servers]
    old_id = _identity_id(cluster, OLD)
    wait_until(lambda: _converged(cluster, new_only, served_by_old=False),
               "the starting point", CONVERGE)
    with Prober(cluster, MAP_PATH, (OLD, NEW)) as prober:
        cluster.replace_backend(OLD, VERSIONS[1], timeout=CONVERGE)  # upgraded ...
        assert new_only <= cluster.served(OLD)
        wait_until(lambda: _converged(cluster, new_only, served_by_old=True),
                   "peers and discovery after the upgrade", CONVERGE)
        cluster.replace_backend(OLD, VERSIONS[0], timeout=CONVERGE)  # ... rolled back
        assert not new_only & cluster.served(OLD)
        wait_until(lambda: _converged(cluster, new_only, served_by_old=False),
                   "peers and discovery after the rollback", CONVERGE)
    summary = prober.summary()
    for sid, statuses in summary.items():
        assert not statuses[404], (sid, statuses)
        _only_retry_later(prober, statuses)
    assert [s.proxy.pid for s in cluster.servers] == supervisors
    assert _identity_id(cluster, OLD) == old_id  # same hostname, same server ID
    print(f"walk: {summary}")
