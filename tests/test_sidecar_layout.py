"""The example sidecar layout keeps the ``kubernetes`` Service pointing at mvproxy.

kube-apiserver publishes ``default/kubernetes`` as its advertise address and its own
secure port; in-cluster clients connect there. In config/'s layout that must be the
address mvproxy listens on, and kube-apiserver itself must be reachable on loopback
(mvproxy's backend, its own probes).
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from sidecar_support import KUBEADM, NODE_NAME, config_argv, container, dev_config, node

from mvproxy.cli import build_parser, config_overrides
from mvproxy.configfile import load_config
from mvproxy.devcluster.launcher import ManagedProcess, SimProcess, free_port, stop_all
from mvproxy.devcluster.simendpoints import ENDPOINTS, SLICE, publish, withdraw
from mvproxy.devcluster.store import Store
from mvproxy.devpki import init_pki
from mvproxy.tls import client_context

NODE_IP = "127.0.0.5"  # the node's IP (status.hostIP), on loopback


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sidecar") / "pki"
    init_pki(root, [NODE_NAME], hosts=[NODE_IP], days=2)
    return root


def mvproxy_config(tmp: Path, pki: Path, argv: list[str], **ports):
    args = build_parser().parse_args(["run", *config_argv(argv, dev_config(tmp, pki, **ports))])
    return load_config(args.config, config_overrides(args))


def test_published_endpoint_is_where_mvproxy_listens(tmp_path, pki):
    api, argv = node(NODE_IP)
    published = (api["advertise-address"], int(api["secure-port"]))
    cfg = mvproxy_config(tmp_path, pki, argv)
    assert (cfg.bind_address, cfg.secure_port) == published == (NODE_IP, 6443)
    # kube-apiserver itself: loopback, same port; mvproxy's backend is exactly that.
    assert api["bind-address"] == "127.0.0.1"
    assert cfg.backend.url == f"https://127.0.0.1:{api['secure-port']}"
    assert cfg.membership.leases.enabled and cfg.peer.advertise_url == f"https://{NODE_IP}:6443"
    assert cfg.server_id == NODE_NAME


def test_probes_do_not_cross_mvproxy():
    """kube-apiserver's probes go to loopback (an mvproxy outage must not restart it);
    mvproxy's to its admin listener."""
    api = container("kube-apiserver")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = api[probe]["httpGet"]
        assert (get["host"], get["port"], get["scheme"]) == ("127.0.0.1", 6443, "HTTPS"), probe
    mv = container("mvproxy")
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = mv[probe]["httpGet"]
        assert (get["host"], get["port"]) == ("127.0.0.1", 9443), probe
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in mv["env"]} == {
        "NODE_NAME": "spec.nodeName", "NODE_IP": "status.hostIP"}


def test_kubeadm_patch_gives_what_the_manifest_relies_on():
    doc = yaml.safe_load(KUBEADM.read_text())
    extra = {a["name"]: a["value"] for a in doc["apiServer"]["extraArgs"]}
    api, _ = node(NODE_IP)
    for name, value in extra.items():
        assert api[name] == value, name
    assert "127.0.0.1" in doc["apiServer"]["certSANs"]  # the backend URL's host


def test_mvproxy_hardening():
    mv = container("mvproxy")
    sc = mv["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] != 0
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert all(m.get("readOnly") for m in mv["volumeMounts"])
    assert mv["resources"]["requests"]


def test_sim_publishes_like_kube_apiserver(tmp_path):
    """Every live server's address, the last starter's port; a graceful stop withdraws."""
    with Store(tmp_path / "store.db") as store:
        publish(store, "127.0.0.5", 6443)
        publish(store, "127.0.0.6", 6443)
        publish(store, "127.0.0.5", 6443)  # a restart: no duplicate
        ep = store.get(ENDPOINTS)
        assert ep["subsets"] == [{"addresses": [{"ip": "127.0.0.5"}, {"ip": "127.0.0.6"}],
                                  "ports": [{"name": "https", "port": 6443,
                                             "protocol": "TCP"}]}]
        assert [e["addresses"] for e in store.get(SLICE)["endpoints"]] == [
            ["127.0.0.5"], ["127.0.0.6"]]
        withdraw(store, "127.0.0.5")
        assert [a["ip"] for a in store.get(ENDPOINTS)["subsets"][0]["addresses"]] == [
            "127.0.0.6"]
        withdraw(store, "127.0.0.6")
        assert store.get(ENDPOINTS)["subsets"] == [] and store.get(SLICE)["endpoints"] == []


@pytest.mark.parametrize("subsets", [
    "x", [5], [{"addresses": "a", "ports": 7}], [{"addresses": [{"ip": 5}, 3],
                                                  "ports": [{"port": True}]}]],
    ids=["string", "list of numbers", "fields of the wrong type", "items of the wrong type"])
def test_sim_replaces_endpoints_of_any_shape(tmp_path, subsets):
    """Anyone allowed to write Endpoints can leave them malformed; start-up and stop
    still publish and withdraw (and keep only well-formed addresses)."""
    with Store(tmp_path / "store.db") as store:
        store.create(ENDPOINTS, {"apiVersion": "v1", "kind": "Endpoints", "subsets": subsets})
        store.create(SLICE, {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                             "endpoints": subsets})
        publish(store, "127.0.0.5", 6443)
        assert store.get(ENDPOINTS)["subsets"][0]["addresses"] == [{"ip": "127.0.0.5"}]
        assert store.get(SLICE)["endpoints"] == [{"addresses": ["127.0.0.5"],
                                                  "conditions": {"ready": True}}]
        withdraw(store, "127.0.0.5")
        assert store.get(ENDPOINTS)["subsets"] == []


@pytest.mark.parametrize("bad", ["node-a.example", "127.0.0.1:6443", "1" * 5000])
def test_sim_refuses_an_advertise_address_that_is_not_an_ip(tmp_path, pki, bad):
    done = subprocess.run(
        [sys.executable, "-m", "mvproxy", "sim", "--server-id", NODE_NAME, "--pki", str(pki),
         "--secure-port", "1", "--store", str(tmp_path / "s.db"),
         f"--advertise-address={bad}"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--advertise-address" in done.stderr and "IPv4 or IPv6" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def get_json(url: str, ctx: ssl.SSLContext) -> dict:
    with urllib.request.urlopen(url, context=ctx, timeout=10) as answer:
        return json.load(answer)


def test_kubernetes_service_reaches_mvproxy_end_to_end(tmp_path, pki):
    """The example's flags on loopback: the sim (kube-apiserver) on 127.0.0.1:<p>
    advertising the node IP, mvproxy from the example's config and args; the published
    endpoint answers, and it is mvproxy (nothing else listens on the node IP)."""
    port, admin = free_port(NODE_IP), free_port()
    api, argv = node(NODE_IP, port=port)
    sim = SimProcess(kubernetes_version="1.36", server_id=NODE_NAME, pki_dir=pki, port=port,
                     store=tmp_path / "store.db", log_dir=tmp_path,
                     bind_address=api["bind-address"],
                     advertise_address=api["advertise-address"])
    config = dev_config(tmp_path, pki, port=port, admin_port=admin)
    mvproxy = ManagedProcess([sys.executable, "-m", "mvproxy", "run",
                              *config_argv(argv, config)], "mvproxy", tmp_path,
                             ready_url=f"http://127.0.0.1:{admin}/readyz")
    try:
        sim.start().wait_ready()
        ctx = client_context(pki / "ca.crt", pki / "admin.crt", pki / "admin.key")
        path = "/api/v1/namespaces/default/endpoints/kubernetes"
        ep = get_json(f"{sim.url}{path}", ctx)
        (subset,) = ep["subsets"]
        published = [(a["ip"], p["port"]) for a in subset["addresses"] for p in subset["ports"]]
        assert published == [(NODE_IP, port)]
        slice_ = get_json(f"{sim.url}/apis/discovery.k8s.io/v1/namespaces/default/"
                          "endpointslices/kubernetes", ctx)
        assert slice_["endpoints"][0]["addresses"] == [NODE_IP]
        assert slice_["ports"][0]["port"] == port

        mvproxy.start().wait_ready()
        via_service = get_json(f"https://{NODE_IP}:{port}{path}", ctx)
        assert via_service["metadata"]["uid"] == ep["metadata"]["uid"]
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as m:
            assert b"mvproxy" in m.read()
        # The admin listener (status page, /debug/mvproxy) is not on the node IP.
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{NODE_IP}:{admin}/debug/mvproxy", timeout=10)
    finally:
        stop_all([mvproxy, sim])
    # kube-apiserver withdraws its address on a graceful stop.
    with Store(tmp_path / "store.db") as store:
        assert store.get(ENDPOINTS)["subsets"] == []
