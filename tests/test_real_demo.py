"""``mvproxy demo --real``: real etcd and kube-apiservers 1.35.4 and 1.36.3, one mvproxy
in front of each, as a user runs it and through the Python API the end-to-end tests use.

The resource only the new server serves is computed from the two servers' own
discovery, never named here. Without the binaries (``python3 scripts/dev.py
kube-binaries``) the real tests skip, and fail under CI; the usage errors need none.
Every process started is stopped at teardown, and the tests check that it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import request, wait_for_audit, wait_until
from process_support import pid_alive
from real_support import require_binaries

from mvproxy.cli import main
from mvproxy.devcluster.kubehttp import GVR, served_resources
from mvproxy.devcluster.realdemo import RealCluster, start_real_cluster

VERSIONS = ("1.35.4", "1.36.3")
OLD, NEW = "apiserver-0", "apiserver-1"
START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0


def _state_pids(state: dict) -> list[int]:
    """Every pid demo.json lists (a process not started yet has none)."""
    pids = [state["etcd"]["pid"]]
    pids += [s[part]["pid"] for s in state["servers"] for part in ("proxy", "backend")]
    pids += [m["pid"] for m in state["controllerManagers"]]
    return [pid for pid in pids if pid is not None]


def _names(gvrs: set[GVR] | frozenset[GVR]) -> set[str]:
    """As ``kubectl api-resources -o name`` prints them."""
    return {f"{resource}.{group}" if group else resource for group, _, resource in gvrs
            if "/" not in resource}


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


# --------------------------------------------------------------------------- usage errors


def test_missing_binaries_say_how_to_build_them(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "kube"
    (empty / "1.36.3").mkdir(parents=True)
    (empty / "1.36.3" / "etcd").write_text("#!/bin/sh\n")
    (empty / "1.36.3" / "etcd").chmod(0o755)
    code = main(["demo", "--real", "--dir", str(tmp_path / "d"), "--base-port", "0",
                 "--kube-binaries", str(empty)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mvproxy: error: --real:"), err
    assert "`python3 scripts/dev.py kube-binaries 1.35.4,1.36.3`" in err
    assert f"{empty / '1.36.3'} lacks kube-apiserver, kube-controller-manager" in err
    assert "--kube-binaries DIR" in err and "$MVPROXY_KUBE_BINARIES" in err
    assert not (tmp_path / "d").exists()  # nothing written, nothing started


def test_the_environment_variable_names_the_binaries(tmp_path: Path, capsys,
                                                     monkeypatch) -> None:
    monkeypatch.setenv("MVPROXY_KUBE_BINARIES", str(tmp_path / "nowhere"))
    code = main(["demo", "--real", "--dir", str(tmp_path / "d"), "--versions", "1.36.3"])
    err = capsys.readouterr().err
    assert code == 2 and str(tmp_path / "nowhere") in err, err
    assert "`python3 scripts/dev.py kube-binaries 1.36.3`" in err


@pytest.mark.parametrize(("versions", "says"), [
    ("1.35,1.36", "--real needs full releases X.Y.Z, got '1.35', '1.36'"),
    ("1.35.4,1.37.2", "span more than one minor release"),
    ("", "full releases"),
])
def test_real_versions_are_full_and_within_one_minor(tmp_path: Path, capsys, versions: str,
                                                     says: str) -> None:
    code = main(["demo", "--real", "--dir", str(tmp_path / "d"), "--versions", versions])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "--versions 1.35.4,1.36.3" in err, err
    assert not (tmp_path / "d").exists()


def test_an_address_this_machine_lacks_is_a_usage_error() -> None:
    from mvproxy.devcluster.realdemo import check_addresses
    from mvproxy.errors import UsageError

    check_addresses(["127.0.0.2", "127.0.0.3"])
    with pytest.raises(UsageError, match="cannot listen on 192.0.2.1"):
        check_addresses(["192.0.2.1"])  # TEST-NET-1: on no interface here


def test_kube_binaries_needs_real(tmp_path: Path, capsys) -> None:
    code = main(["demo", "--dir", str(tmp_path / "d"), "--kube-binaries", str(tmp_path)])
    assert code == 2 and "only with --real" in capsys.readouterr().err


def test_a_server_that_fails_to_start_stops_everything(tmp_path: Path) -> None:
    """The error carries the kube-apiserver's own words; etcd is stopped with it."""
    from mvproxy.devcluster.launcher import ProcessError

    binaries = require_binaries(VERSIONS[:1])
    with pytest.raises(ProcessError, match="(?s)apiserver-0-apiserver exited.*no-such-flag"):
        start_real_cluster(tmp_path / "d", VERSIONS[:1], 0, binaries=binaries,
                           extra_apiserver_args={OLD: ["--no-such-flag"]})
    state = json.loads((tmp_path / "d" / "demo.json").read_text())
    assert _wait_gone(_state_pids(state)) == []


# --------------------------------------------------------------------------- as a user runs it


def test_demo_real_serves_kubectl_and_stops_on_ctrl_c(tmp_path: Path, kubectl) -> None:
    require_binaries(VERSIONS)
    directory, log = tmp_path / "demo", tmp_path / "demo.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mvproxy", "demo", "--real", "--dir", str(directory),
             "--base-port", "0"], stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True)
    state: dict = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "Press Ctrl-C" not in log.read_text():
            assert proc.poll() is None, f"demo exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()}"
            time.sleep(0.2)
        state = json.loads((directory / "demo.json").read_text())
        guide = log.read_text()

        # demo.json: every process, each server real and on its own loopback address.
        assert state["real"] is True
        assert [(s["id"], s["version"]) for s in state["servers"]] == list(zip(
            (OLD, NEW), VERSIONS, strict=True))
        hosts = {s["backend"]["url"].split("//")[1].split(":")[0] for s in state["servers"]}
        assert hosts == {"127.0.0.2", "127.0.0.3"}
        for s in state["servers"]:
            assert s["proxy"]["url"].split(":")[:2] == s["backend"]["url"].split(":")[:2]
            assert Path(s["backend"]["binary"]).name == "kube-apiserver"
        pids = _state_pids(state)
        assert len(set(pids)) == 5 and all(pid_alive(p) for p in pids)
        assert state["etcd"]["url"].startswith("http://127.0.0.1:")

        # What only the new server serves, from the servers' own discovery.
        from mvproxy.tls import client_context
        pki = directory / "pki"
        admin = client_context(pki / "ca.crt", pki / "admin.crt", pki / "admin.key")
        old, new = (served_resources(s["backend"]["url"], admin) for s in state["servers"])
        new_only = _names(new - old)
        assert new_only, "1.36.3 serves nothing 1.35.4 does not?"
        # kubectl through the old server's mvproxy lists them; straight to it, it does not.
        kc = state["kubeconfig"]
        merged = set(kubectl("api-resources", "-o", "name", kubeconfig=kc,
                             context=OLD).stdout.split())
        direct = set(kubectl("api-resources", "-o", "name", kubeconfig=kc,
                             context=f"{OLD}-direct").stdout.split())
        assert new_only <= merged, new_only - merged
        assert not new_only & direct, new_only & direct
        # The guide shows one of them, with the contexts to compare.
        groups = {group for group, _, _ in new - old}
        assert any(f"--api-group {group}" in guide for group in groups), guide
        assert f"--context {OLD}-direct api-resources" in guide
        assert "sharing one etcd" in guide

        # Ctrl-C: everything stops, exit 0.
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"demo still running {STOP_TIMEOUT:g}s after SIGINT:\n{log.read_text()}")
        assert code == 0, log.read_text()
        assert _wait_gone(pids) == []
        assert "stopped." in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in _state_pids(state) if state else []:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# --------------------------------------------------------------------------- the Python API


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    binaries = require_binaries(VERSIONS)
    with start_real_cluster(tmp_path_factory.mktemp("real") / "demo", VERSIONS, 0,
                            binaries=binaries) as running:
        yield running


def test_each_server_is_a_real_release_with_its_own_identity(cluster: RealCluster) -> None:
    for server, version in zip(cluster.servers, VERSIONS, strict=True):
        answer = request(cluster, server.id, "GET", "/version", direct=True)
        assert answer.status == 200 and answer.json()["gitVersion"] == f"v{version}", answer
    # Each has its own hostname, so its own identity Lease (the lease controller may
    # write them a moment after /readyz).
    path = ("/apis/coordination.k8s.io/v1/namespaces/kube-system/leases"
            "?labelSelector=apiserver.kubernetes.io/identity")
    wait_until(lambda: len(request(cluster, OLD, "GET", path).json()["items"]) == 2,
               "two kube-apiserver identity Leases")


def test_tokens_and_rbac_are_the_real_servers(cluster: RealCluster) -> None:
    viewer = cluster.tokens["viewer-token"]
    listed = request(cluster, OLD, "GET", "/api/v1/namespaces", cert=None, token=viewer)
    assert listed.status == 200, listed
    denied = request(cluster, OLD, "POST", "/api/v1/namespaces", cert=None, token=viewer,
                     body={"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": "nope"}})
    assert denied.status == 403 and denied.json()["reason"] == "Forbidden", denied
    entry = wait_for_audit(cluster.server(OLD).audit_log, lambda e: e["verb"] == "create"
                           and e["requestURI"] == "/api/v1/namespaces"
                           and e["user"]["username"] == "demo-viewer", "the refused create")
    assert "viewer" in entry["user"]["groups"] and entry["responseStatus"]["code"] == 403


def test_controller_manager_through_the_old_servers_mvproxy(cluster: RealCluster) -> None:
    kcm = cluster.start_controller_manager()
    assert kcm.version == VERSIONS[0] and kcm.running
    assert kcm.pid in _state_pids(json.loads(cluster.state_file.read_text()))
    made = request(cluster, OLD, "POST", "/api/v1/namespaces", body={
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kcm-works"}})
    assert made.status == 201, made
    # Its service-account controller gives the new namespace its default account.
    wait_until(lambda: request(cluster, OLD, "GET", "/api/v1/namespaces/kcm-works/"
                               "serviceaccounts/default").status == 200,
               "the default ServiceAccount in a new namespace", timeout=30)


def test_rolling_upgrade_walk_needs_no_mvproxy_restart(cluster: RealCluster) -> None:
    new_only = cluster.served(NEW) - cluster.served(OLD)
    assert new_only
    proxies = [s.proxy.pid for s in cluster.servers]
    admin = cluster.admin_context()
    old = cluster.server(OLD)

    cluster.replace_backend(OLD, VERSIONS[1])  # upgraded ...
    assert old.version == VERSIONS[1] and new_only <= cluster.served(OLD)
    assert request(cluster, OLD, "GET", "/version", direct=True).json()["gitVersion"] == \
        f"v{VERSIONS[1]}"
    assert json.loads(cluster.state_file.read_text())["servers"][0]["version"] == VERSIONS[1]

    cluster.replace_backend(OLD, VERSIONS[0])  # ... and rolled back
    assert not new_only & cluster.served(OLD)
    assert new_only <= served_resources(old.proxy_url, admin, nopeer=False)
    assert [s.proxy.pid for s in cluster.servers] == proxies


def test_stop_ends_every_process(cluster: RealCluster) -> None:
    """Runs last: the module's cluster is stopped here (stop() is idempotent)."""
    pids = _state_pids(cluster.state())
    assert len(pids) == 6 and all(pid_alive(p) for p in pids)  # etcd, 2 + 2, the kcm
    cluster.stop()
    assert _wait_gone(pids) == []
