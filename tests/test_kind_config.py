"""config/kind/: what can be checked without Docker or kind.

- cluster.yaml uses only fields of kind's v1alpha4 ``Cluster`` (schema below, from
  sigs.k8s.io/kind pkg/apis/config/v1alpha4/types.go at v0.32.0), and every extraMount
  points at a file of this repository;
- its kubeadmConfigPatches parse as the kubeadm types they name, in both API versions
  kind generates (v1beta3 below 1.36, v1beta4 from 1.36);
- the kubeadm patch for kube-apiserver moves its probes to loopback and the result is
  still a valid Pod;
- mvproxy runs on each node from the standalone binary, started by the node's systemd:
  the unit and kubelet's drop-in are mounted where systemd reads them, the unit gives
  the binary a private TMPDIR (its RuntimeDirectory) and no capabilities, and
  ``systemd-analyze verify`` accepts it where systemd is installed;
- ``mvproxy-run.sh``, run here with the node's ``hostname`` and ``getent`` stood in for,
  starts the mounted binary with only flags ``mvproxy run`` has, and its configuration
  passes ``mvproxy check-config`` against a kubeadm-shaped development PKI;
- the layout: mvproxy on <node IP>:6443, kube-apiserver on 127.0.0.1:6443.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from mvproxy.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
KIND = ROOT / "config" / "kind"
CLUSTER = KIND / "cluster.yaml"
UNIT = KIND / "mvproxy.service"
KUBELET_DROP_IN = KIND / "kubelet-wants-mvproxy.conf"
RUN_SCRIPT = KIND / "mvproxy-run.sh"
BINARY = ROOT / "dist" / "mvproxy"  # what `python3 scripts/dev.py binary` writes
MVPROXY_CONFIG = KIND / "mvproxy.yaml"
PATCHES = KIND / "patches"
KUBE_VERSIONS = ("1.35", "1.36")


# --- a small structural schema checker -----------------------------------------------

class MapOf:
    """A YAML mapping with free keys (Go ``map[K]V``)."""

    def __init__(self, value):
        self.value = value


def conform(value, schema, path: str = "") -> list[str]:
    """Problems of ``value`` against ``schema``: a dict is a struct (unknown keys are
    errors), a one-item list a Go slice, a tuple an enum, a type a scalar."""
    where = path or "<root>"
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping"]
        out = [f"{path}.{k}".lstrip(".") + ": unknown field" for k in value if k not in schema]
        for k, v in value.items():
            if k in schema:
                out += conform(v, schema[k], f"{path}.{k}".lstrip("."))
        return out
    if isinstance(schema, MapOf):
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping"]
        return [p for k, v in value.items() for p in conform(v, schema.value, f"{path}[{k}]")]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [p for i, v in enumerate(value) for p in conform(v, schema[0], f"{path}[{i}]")]
    if isinstance(schema, tuple):
        return [] if value in schema else [f"{where}: {value!r} is not one of {schema}"]
    if schema is int and isinstance(value, bool):
        return [f"{where}: expected {schema.__name__}"]
    return [] if isinstance(value, schema) else [f"{where}: expected {schema.__name__}"]


# kind v1alpha4 (types.go at v0.32.0): every field of Cluster, Node, Mount, PortMapping,
# Networking and PatchJSON6902, with the enums' values.
PATCH_JSON6902 = {"group": str, "version": str, "kind": str, "patch": str}
KIND_MOUNT = {"containerPath": str, "hostPath": str, "readOnly": bool, "selinuxRelabel": bool,
              "propagation": ("None", "HostToContainer", "Bidirectional")}
KIND_PORT_MAPPING = {"containerPort": int, "hostPort": int, "listenAddress": str,
                     "protocol": ("TCP", "UDP", "SCTP")}
KIND_NODE = {"role": ("control-plane", "worker"), "image": str, "labels": MapOf(str),
             "extraMounts": [KIND_MOUNT], "extraPortMappings": [KIND_PORT_MAPPING],
             "kubeadmConfigPatches": [str], "kubeadmConfigPatchesJSON6902": [PATCH_JSON6902]}
KIND_NETWORKING = {"ipFamily": ("ipv4", "ipv6", "dual"), "apiServerPort": int,
                   "apiServerAddress": str, "podSubnet": str, "serviceSubnet": str,
                   "disableDefaultCNI": bool,
                   "kubeProxyMode": ("iptables", "ipvs", "nftables", "none"),
                   "dnsSearch": [str]}
KIND_CLUSTER = {"kind": ("Cluster",), "apiVersion": ("kind.x-k8s.io/v1alpha4",), "name": str,
                "nodes": [KIND_NODE], "networking": KIND_NETWORKING,
                "featureGates": MapOf(bool), "runtimeConfig": MapOf(str),
                "kubeadmConfigPatches": [str], "kubeadmConfigPatchesJSON6902": [PATCH_JSON6902],
                "containerdConfigPatches": [str], "containerdConfigPatchesJSON6902": [str]}

# kubeadm (cmd/kubeadm/app/apis/kubeadm/v1beta3 and v1beta4 types.go): the fields the
# patches use, with their real types. v1beta4 made extraArgs a list of name/value;
# kind (v0.32.0+) converts a patch's map for a v1beta4 target (kubeadm_merge.go).
PATCHES_FIELD = {"directory": str}
KUBEADM = {
    "kubeadm.k8s.io/v1beta3": {
        "ClusterConfiguration": {"kind": str, "apiVersion": str, "apiServer": {
            "certSANs": [str], "extraArgs": MapOf(str), "timeoutForControlPlane": str}},
        "InitConfiguration": {"kind": str, "apiVersion": str, "patches": PATCHES_FIELD},
        "JoinConfiguration": {"kind": str, "apiVersion": str, "patches": PATCHES_FIELD},
    },
    "kubeadm.k8s.io/v1beta4": {
        "ClusterConfiguration": {"kind": str, "apiVersion": str, "apiServer": {
            "certSANs": [str], "extraArgs": [{"name": str, "value": str}],
            "extraEnvs": [dict]}},
        "InitConfiguration": {"kind": str, "apiVersion": str, "patches": PATCHES_FIELD},
        "JoinConfiguration": {"kind": str, "apiVersion": str, "patches": PATCHES_FIELD},
    },
}


def as_generated(patch: dict, api_version: str) -> dict:
    """The patch as kind applies it to a document of ``api_version``."""
    doc = copy.deepcopy(patch)
    doc["apiVersion"] = api_version
    server = doc.get("apiServer", {})
    if api_version.endswith("v1beta4") and isinstance(server.get("extraArgs"), dict):
        server["extraArgs"] = [{"name": k, "value": v} for k, v in server["extraArgs"].items()]
    return doc


def load(path: Path):
    return yaml.safe_load(path.read_text())


def cluster_patches() -> list[dict]:
    return [yaml.safe_load(p) for p in load(CLUSTER).get("kubeadmConfigPatches", [])]


def cluster_extra_args() -> dict[str, str]:
    [cluster_config] = [p for p in cluster_patches() if p["kind"] == "ClusterConfiguration"]
    return cluster_config["apiServer"]["extraArgs"]


# --- kind Cluster -------------------------------------------------------------------------

def test_conform_reports_unknown_fields_and_wrong_types():
    """The checker itself: the mistakes it exists to catch are reported."""
    bad = {"kind": "Cluster", "apiVersion": "kind.x-k8s.io/v1alpha4",
           "nodes": [{"role": "master", "extraMounts": [{"hostpath": "x", "readOnly": "yes"}]}],
           "kubeadmConfigPatch": []}
    found = conform(bad, KIND_CLUSTER)
    assert "kubeadmConfigPatch: unknown field" in found
    assert any(p.startswith("nodes[0].role:") for p in found)
    assert "nodes[0].extraMounts[0].hostpath: unknown field" in found
    assert "nodes[0].extraMounts[0].readOnly: expected bool" in found


def test_cluster_uses_only_kind_v1alpha4_fields():
    cluster = load(CLUSTER)
    assert conform(cluster, KIND_CLUSTER) == []
    assert cluster["kind"] == "Cluster" and cluster["apiVersion"] == "kind.x-k8s.io/v1alpha4"


def node_mounts() -> dict[str, Path]:
    """containerPath -> the repository file mounted there (the same on every node)."""
    [mounts] = {tuple((m["containerPath"], m["hostPath"]) for m in node["extraMounts"])
                for node in load(CLUSTER)["nodes"]}
    return {inside: (ROOT / outside).resolve() for inside, outside in mounts}


def test_three_control_plane_nodes_each_mount_mvproxy():
    nodes = load(CLUSTER)["nodes"]
    control = [n for n in nodes if n["role"] == "control-plane"]
    assert len(control) == 3
    assert not [m for n in nodes for m in n["extraMounts"]
                if m["containerPath"].startswith("/etc/kubernetes/manifests")]  # no pod
    for node in control:
        mounts = {m["containerPath"]: m for m in node["extraMounts"]}
        config_mount = mounts["/etc/kubernetes/mvproxy/config.yaml"]
        assert (ROOT / config_mount["hostPath"]).resolve() == MVPROXY_CONFIG
        for m in node["extraMounts"]:
            # kind resolves a relative hostPath against the working directory: the
            # repository root, where docs/kind.md says to run `kind create cluster`. The
            # binary is there once `dev.py binary` has built it.
            assert not PurePosixPath(m["hostPath"]).is_absolute()
            assert (ROOT / m["hostPath"]).resolve() == BINARY.parent or \
                (ROOT / m["hostPath"]).exists(), m["hostPath"]
            assert PurePosixPath(m["containerPath"]).is_absolute()
            assert m.get("readOnly") is True
        # kind's image references: a tag pinned by digest.
        assert re.fullmatch(r"kindest/node:v1\.\d+\.\d+@sha256:[0-9a-f]{64}", node["image"])


# --- kubeadmConfigPatches -------------------------------------------------------------

def test_kubeadm_patches_apply_to_every_api_version_kind_generates():
    """No apiVersion: kind then patches the document of that kind whatever its version."""
    patches = cluster_patches()
    assert {p["kind"] for p in patches} == {"ClusterConfiguration", "InitConfiguration",
                                            "JoinConfiguration"}
    for patch in patches:
        assert "apiVersion" not in patch, patch["kind"]


@pytest.mark.parametrize("api_version", sorted(KUBEADM))
def test_kubeadm_patches_parse_as_the_kubeadm_types_they_name(api_version):
    for patch in cluster_patches():
        doc = as_generated(patch, api_version)
        assert conform(doc, KUBEADM[api_version][patch["kind"]]) == [], patch["kind"]


def test_kubeadm_flags_and_certificate_follow_the_layout():
    [cluster_config] = [p for p in cluster_patches() if p["kind"] == "ClusterConfiguration"]
    assert "127.0.0.1" in cluster_config["apiServer"]["certSANs"]
    args = cluster_extra_args()
    assert args == {"bind-address": "127.0.0.1"}   # advertise-address and port unchanged
    # kubeadm's requestheader flags stay as kubeadm writes them; upstream's peer proxy
    # stays off (no --peer-ca-file).
    assert not any(k.startswith(("requestheader", "peer-")) for k in args)


def test_kubeadm_patch_directory_is_mounted_on_every_control_plane_node():
    dirs = {p["patches"]["directory"] for p in cluster_patches() if "patches" in p}
    assert len(dirs) == 1
    [directory] = dirs
    for node in load(CLUSTER)["nodes"]:
        mounted = {m["containerPath"]: m["hostPath"] for m in node["extraMounts"]}
        assert (ROOT / mounted[directory]).resolve() == PATCHES


def kubeadm_like_apiserver_pod(node_ip: str) -> dict:
    """The shape of kubeadm's kube-apiserver static pod: probes on the advertise address."""
    def probe(path: str, **extra) -> dict:
        return {"httpGet": {"host": node_ip, "path": path, "port": 6443, "scheme": "HTTPS"},
                "periodSeconds": 10, "timeoutSeconds": 15, **extra}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "kube-apiserver", "namespace": "kube-system"},
            "spec": {"hostNetwork": True, "containers": [{
                "name": "kube-apiserver", "image": "registry.k8s.io/kube-apiserver:v1.36.1",
                "command": ["kube-apiserver", f"--advertise-address={node_ip}",
                            "--bind-address=127.0.0.1", "--secure-port=6443"],
                "livenessProbe": probe("/livez", failureThreshold=8),
                "readinessProbe": probe("/readyz", failureThreshold=3),
                "startupProbe": probe("/livez", failureThreshold=24)}]}}


def strategic_merge(target, patch):
    """Strategic merge as kubeadm applies it, for what a Pod patch uses: maps merge,
    ``containers`` merge by ``name``, anything else is replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for key, value in patch.items():
            if key == "containers":
                by_name = {c["name"]: c for c in out.get(key, [])}
                for c in value:
                    by_name[c["name"]] = strategic_merge(by_name.get(c["name"], {}), c)
                out[key] = list(by_name.values())
            else:
                out[key] = strategic_merge(out.get(key), value)
        return out
    return patch


def test_kubeadm_patch_moves_kube_apiserver_probes_to_loopback():
    files = sorted(p.name for p in PATCHES.iterdir())
    # kubeadm's naming: target[suffix][+patchtype].extension
    for name in files:
        assert re.fullmatch(r"(etcd|kube-apiserver|kube-controller-manager|kube-scheduler|"
                            r"kubeletconfiguration|corednsdeployment)[^+.]*"
                            r"(\+(strategic|merge|json))?\.(yaml|json)", name), name
    assert "kube-apiserver+strategic.yaml" in files
    patched = strategic_merge(kubeadm_like_apiserver_pod("172.18.0.3"),
                              load(PATCHES / "kube-apiserver+strategic.yaml"))
    [container] = patched["spec"]["containers"]
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = container[probe]["httpGet"]
        assert get["host"] == "127.0.0.1" and get["port"] == 6443 and get["path"], probe
    assert any(a == "--advertise-address=172.18.0.3" for a in container["command"])
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(patched, version, strict=True)


# --- mvproxy from the node's systemd ---------------------------------------------------------

def unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit file as section -> [(key, value)], in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, line
        current.append((key.strip(), value.strip()))
    return sections


def setting(sections: dict, section: str, key: str) -> str:
    [value] = [v for k, v in sections[section] if k == key]
    return value


def test_systemd_reads_the_unit_and_kubelet_wants_it():
    mounts = node_mounts()
    assert mounts["/etc/systemd/system/mvproxy.service"] == UNIT
    [drop_in] = [inside for inside, f in mounts.items() if f == KUBELET_DROP_IN]
    assert re.fullmatch(r"/etc/systemd/system/kubelet\.service\.d/[0-9]+-[a-z-]+\.conf",
                        drop_in)
    assert unit(KUBELET_DROP_IN) == {"Unit": [("Wants", "mvproxy.service")]}


def test_the_unit_starts_the_mounted_binary_with_a_private_tmpdir_and_no_capabilities():
    service = unit(UNIT)
    mounts = node_mounts()
    start = setting(service, "Service", "ExecStart")
    assert mounts[start] == RUN_SCRIPT and os.access(RUN_SCRIPT, os.X_OK)
    # The binary unpacks itself under TMPDIR: the service's own runtime directory,
    # owned by root, 0700, removed when it stops.
    runtime = setting(service, "Service", "RuntimeDirectory")
    assert setting(service, "Service", "RuntimeDirectoryMode") == "0700"
    assert ("Environment", f"TMPDIR=/run/{runtime}") in service["Service"]
    # Restarted until kubeadm has written the certificates, however long that takes.
    assert setting(service, "Service", "Restart") == "always"
    assert setting(service, "Unit", "StartLimitIntervalSec") == "0"
    # SIGTERM to the launcher alone, which passes it on (mvproxy then drains).
    assert setting(service, "Service", "KillMode") == "mixed"
    assert setting(service, "Service", "NoNewPrivileges") == "yes"
    assert setting(service, "Service", "CapabilityBoundingSet") == ""
    assert setting(service, "Service", "AmbientCapabilities") == ""
    assert "Install" not in service  # started through kubelet's drop-in, not enabled


def test_systemd_analyze_verifies_the_units(tmp_path):
    """Where systemd is installed: its own checker on the unit and on a kubelet.service
    with the drop-in, laid out as on a node (ExecStart pointed at this tree's script,
    which is what the node mounts there). It reports a bad setting as a warning, so
    any output at all fails."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze here")
    units = tmp_path / "units"
    (units / "kubelet.service.d").mkdir(parents=True)
    start = setting(unit(UNIT), "Service", "ExecStart")
    (units / "mvproxy.service").write_text(
        UNIT.read_text().replace(f"ExecStart={start}\n", f"ExecStart={RUN_SCRIPT}\n"))
    (units / "kubelet.service").write_text("[Service]\nExecStart=/bin/true\n")
    (units / "kubelet.service.d" / "20-mvproxy.conf").write_text(KUBELET_DROP_IN.read_text())
    done = subprocess.run([analyze, "verify", "--man=no", "mvproxy.service", "kubelet.service"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"})
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


NODE_NAME, NODE_IP = "mvproxy-control-plane", "172.18.0.3"


def run_args(tmp: Path, node_name: str = NODE_NAME, node_ip: str = NODE_IP) -> list[str]:
    """What mvproxy-run.sh executes on a node named ``node_name`` whose /etc/hosts gives
    it ``node_ip``: the script runs here with ``hostname`` and ``getent`` answering as
    on that node, and a stand-in binary that prints its arguments."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {"hostname": f"echo {node_name}",
             "getent": f'[ "$1 $2" = "ahostsv4 {node_name}" ] && '
                       f'printf "{node_ip}      STREAM {node_name}\\n'
                       f'{node_ip}      DGRAM  \\n"',
             "mvproxy": 'for a in "$@"; do echo "$a"; done'}
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(["/bin/sh", str(RUN_SCRIPT)], capture_output=True, text=True,
                          timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin",
                                           "MVPROXY": str(bin_dir / "mvproxy")})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_the_run_script_execs_the_mounted_binary(tmp_path):
    text = RUN_SCRIPT.read_text()
    [default] = re.findall(r"^MVPROXY=\$\{MVPROXY:-(\S+)\}$", text, re.M)
    inside = PurePosixPath(default)
    assert node_mounts()[str(inside.parent)] == BINARY.parent and inside.name == BINARY.name
    assert re.search(r'^exec "\$MVPROXY" run', text, re.M)
    # Without an IPv4 address for the node it says so and exits 1, mvproxy unstarted.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"hostname": "echo lonely", "getent": "exit 2"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    done = subprocess.run(["/bin/sh", str(RUN_SCRIPT)], capture_output=True, text=True,
                          timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin",
                                           "MVPROXY": "/bin/false"})
    assert done.returncode == 1 and "no IPv4 address for lonely" in done.stderr


def test_the_run_script_uses_only_flags_mvproxy_run_has(tmp_path):
    args = run_args(tmp_path)
    assert args[0] == "run"
    run = next(a for a in build_parser()._actions
               if a.choices and "run" in a.choices).choices["run"]
    known = {o for a in run._actions for o in a.option_strings}
    for arg in args[1:]:
        assert arg.split("=")[0] in known, arg      # exact names, not argparse prefixes
    build_parser().parse_args(args)


def test_layout_mvproxy_on_node_ip_kube_apiserver_on_loopback(tmp_path):
    """kube-apiserver publishes <advertise address>:<secure port> in default/kubernetes;
    with kind's advertise address (the node IP) and port 6443, that is mvproxy."""
    ns = build_parser().parse_args(run_args(tmp_path))
    assert (ns.server_id, ns.bind_address, ns.secure_port) == (NODE_NAME, NODE_IP, 6443)
    assert ns.peer_advertise_url == f"https://{NODE_IP}:6443"
    # kube-apiserver: --bind-address from the patch, kind's default port 6443.
    assert ns.backend_url == f"https://{cluster_extra_args()['bind-address']}:6443"
    assert (ns.admin_bind_address, ns.admin_port) == ("127.0.0.1", 9443)
    assert node_mounts()[ns.config] == MVPROXY_CONFIG
    pki = load(MVPROXY_CONFIG)["tlsCertFile"]
    assert pki.startswith("/etc/kubernetes/pki/")  # kubeadm's, on the node itself


# --- mvproxy.yaml against a kubeadm-shaped development PKI -----------------------------------

def kubeadm_pki(tmp: Path, node: str) -> Path:
    """``mvproxy certs init`` output, renamed to kubeadm's /etc/kubernetes/pki layout."""
    dev = tmp / "dev"
    subprocess.run([sys.executable, "-m", "mvproxy", "certs", "init", str(dev),
                    "--server-id", node, "--host", "127.0.0.1"],
                   check=True, capture_output=True, timeout=120)
    pki = tmp / "pki"
    pki.mkdir()
    for source, target in [("ca.crt", "ca.crt"), ("front-proxy-ca.crt", "front-proxy-ca.crt"),
                           (f"{node}/mvproxy.crt", "apiserver.crt"),
                           (f"{node}/mvproxy.key", "apiserver.key"),
                           (f"{node}/front-proxy-client.crt", "front-proxy-client.crt"),
                           (f"{node}/front-proxy-client.key", "front-proxy-client.key")]:
        shutil.copy2(dev / source, pki / target)
    return pki


def check_config(tmp: Path, text: str, args: list[str]) -> subprocess.CompletedProcess:
    config = tmp / "config.yaml"
    config.write_text(text)
    return subprocess.run([sys.executable, "-m", "mvproxy", "check-config", str(config), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_mvproxy_config_passes_check_config_with_the_static_pod_flags(tmp_path):
    node = "mvproxy-control-plane"
    pki = kubeadm_pki(tmp_path, node)
    text = MVPROXY_CONFIG.read_text()
    assert text.count("/etc/kubernetes/pki/") >= 8
    text = text.replace("/etc/kubernetes/pki/", f"{pki}/")
    args = [a for a in run_args(tmp_path, node, "127.0.0.1")[1:]
            if not a.startswith("--config=")]
    # Ports of the flags are kept: check-config validates, it does not bind.
    result = check_config(tmp_path, text, args)
    assert result.returncode == 0, result.stdout + result.stderr

    # And the check is real: a key the file misspells is refused by path.
    bad = text.replace("pollInterval:", "pollIntervall:")
    result = check_config(tmp_path, bad, args)
    assert result.returncode == 2 and "discovery.pollIntervall" in result.stderr + result.stdout
