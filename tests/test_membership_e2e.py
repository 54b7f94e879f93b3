"""Lease membership end to end: ``mvproxy demo`` processes (three 1.35 servers with
``peers.leases``, one 1.36 spare started later), loopback, free ports, short intervals.

Only the 1.36 server serves ``scheduling.k8s.io/v1alpha2`` (PodGroups), so a request
for it through an old server's mvproxy works exactly when that mvproxy counts the new
server as a peer. Every wait is bounded; no assertion depends on how fast it happened.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest
from cryptography import x509
from pki_support import issue

from mvproxy.configfile import load_config
from mvproxy.devcluster.demo import DemoCluster, start_cluster
from tests.e2e_support import (
    AGGREGATED_V2,
    HTTP_TIMEOUT,
    aggregated_group_versions,
    request,
    tls_context,
    wait_until,
)

PODGROUPS = "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups"
LEASE = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/mvproxy-apiserver-3"
NEW_GV = ("scheduling.k8s.io", "v1alpha2")
OLD, NEW = "apiserver-0", "apiserver-3"
CHANGE_TIMEOUT = 10.0  # generous bound; the mechanism (watch, expiry) is asserted separately


def merged(cluster: DemoCluster, sid: str) -> dict:
    answer = request(cluster, sid, "GET", "/apis", headers={"Accept": AGGREGATED_V2})
    assert answer.status == 200, answer
    return aggregated_group_versions(answer.json())


def lease_status(cluster: DemoCluster) -> int:
    """The new member's Lease, read directly from an old server's kube-apiserver."""
    return request(cluster, OLD, "GET", LEASE, direct=True).status


@pytest.fixture
def cluster(tmp_path):
    with start_cluster(tmp_path / "demo", ["1.35", "1.35", "1.35"], base_port=0,
                       poll_interval="500ms", membership="leases",
                       lease_timing=("3s", "1s"), spare_versions=["1.36"]) as cluster:
        yield cluster


def test_the_demo_flag_and_its_configuration():
    from mvproxy.cli import build_parser

    assert build_parser().parse_args(["demo"]).membership == "static"
    assert build_parser().parse_args(["demo", "--membership", "leases"]).membership == "leases"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--membership", "gossip"])


def test_members_join_and_leave_through_leases(cluster):
    for server in cluster.servers:  # what `mvproxy demo --membership leases` writes
        cfg = load_config(server.config)
        assert cfg.membership.leases.enabled and cfg.peers == ()
        assert cfg.peer.advertise_url == server.proxy_url
    assert request(cluster, OLD, "GET", PODGROUPS).status == 404
    assert NEW_GV not in merged(cluster, OLD)

    # A fourth server starts: no mvproxy is restarted or reconfigured.
    new = cluster.server(NEW)
    new.backend.start().wait_ready(30.0)
    new.proxy.start().wait_ready(30.0)
    started = time.monotonic()
    wait_until(lambda: request(cluster, OLD, "GET", PODGROUPS).status == 200,
               "a request for an API only the new server serves, through an old mvproxy",
               CHANGE_TIMEOUT)
    print(f"routed to the new member {time.monotonic() - started:.2f}s after it was ready")
    for sid in ("apiserver-1", "apiserver-2"):
        assert NEW_GV in merged(cluster, sid)
    assert lease_status(cluster) == 200

    # Graceful stop (SIGTERM): the Lease is deleted, so peers drop it without waiting
    # for it to expire.
    cluster.stop_server(NEW)
    assert lease_status(cluster) == 404
    wait_until(lambda: NEW_GV not in merged(cluster, OLD),
               "the stopped member's APIs to leave the merged view", CHANGE_TIMEOUT)
    assert request(cluster, OLD, "GET", PODGROUPS).status in (404, 503)

    # Back again, then killed (SIGKILL): the Lease stays, and expires.
    cluster.start_member(NEW)
    assert NEW_GV in merged(cluster, OLD)
    cluster.kill_server(NEW)
    assert lease_status(cluster) == 200  # nobody deleted it
    wait_until(lambda: NEW_GV not in merged(cluster, OLD),
               "the killed member's APIs to leave the merged view once its Lease expired",
               CHANGE_TIMEOUT)
    assert lease_status(cluster) == 200  # expiry, not deletion, removed it
    state = cluster.debug_state(OLD)
    assert NEW not in (state.get("peers") or {}), state


def _served_serial(cluster: DemoCluster, sid: str) -> int:
    """Serial number of the certificate a new connection to ``sid``'s mvproxy gets."""
    ctx = tls_context(cluster)
    port = cluster.server(sid).proxy_port
    with socket.create_connection(("127.0.0.1", port), timeout=HTTP_TIMEOUT) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


def test_a_rotated_certificate_and_sigterm_during_a_watch(cluster):
    """In the lease demo: a replaced serving certificate is served to new connections
    without a restart; SIGTERM during a running watch exits 0 and ends the watch with a
    clean end of stream (no truncated chunk), so the client simply watches again."""
    before = _served_serial(cluster, OLD)
    rotated = issue(cluster.pki, f"{OLD}/mvproxy")
    wait_until(lambda: _served_serial(cluster, OLD) == rotated.serial_number,
               "the rotated serving certificate on a new connection", CHANGE_TIMEOUT)
    assert rotated.serial_number != before

    server = cluster.server(OLD)
    conn = http.client.HTTPSConnection("127.0.0.1", server.proxy_port,
                                       context=tls_context(cluster), timeout=HTTP_TIMEOUT)
    try:
        conn.request("GET", "/api/v1/namespaces/default/configmaps?watch=true")
        watch = conn.getresponse()
        assert watch.status == 200
        made = request(cluster, "apiserver-1", "POST", "/api/v1/namespaces/default/configmaps",
                       body={"apiVersion": "v1", "kind": "ConfigMap",
                             "metadata": {"name": "watched-through-sigterm"}})
        assert made.status == 201, made
        event = json.loads(watch.readline())
        assert event["object"]["metadata"]["name"] == "watched-through-sigterm"
        assert server.proxy.stop() == 0
        assert watch.read() == b""  # the last chunk arrived: http.client saw a clean end
    finally:
        conn.close()
