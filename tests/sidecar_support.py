"""The example sidecar layout (config/), read as kubelet and mvproxy would read it.

Shared by the layout tests and the manifest checks: the containers' flags with the
downward-API placeholders resolved for a given node, and mvproxy's configuration with
kubeadm's /etc/kubernetes/pki paths pointed at a development PKI.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config"
SIDECAR = CONFIG / "kube-apiserver-sidecar.yaml"
MVPROXY_CONFIG = CONFIG / "mvproxy-sidecar.yaml"
KUBEADM = CONFIG / "kubeadm-clusterconfiguration.yaml"
NODE_NAME = "node-a"

#: kubeadm's file → the file of the same role that `mvproxy certs init` writes.
DEV_PKI_FILES = {
    "apiserver.crt": f"{NODE_NAME}/mvproxy.crt", "apiserver.key": f"{NODE_NAME}/mvproxy.key",
    "front-proxy-client.crt": f"{NODE_NAME}/front-proxy-client.crt",
    "front-proxy-client.key": f"{NODE_NAME}/front-proxy-client.key",
    "ca.crt": "ca.crt", "front-proxy-ca.crt": "front-proxy-ca.crt",
}


def pod() -> dict:
    return yaml.safe_load(SIDECAR.read_text())


def container(name: str) -> dict:
    return next(c for c in pod()["spec"]["containers"] if c["name"] == name)


def example_node_ip() -> str:
    """The node IP the example is written for (kubeadm's literal advertise address)."""
    return flags(container("kube-apiserver")["command"][1:])["advertise-address"]


def flags(argv: list[str]) -> dict[str, str]:
    """``--name=value`` arguments as a dict (every flag in config/ is written that way)."""
    found = {}
    for arg in argv:
        assert arg.startswith("--") and "=" in arg, f"write flags as --name=value: {arg!r}"
        name, value = arg[2:].split("=", 1)
        found[name] = value
    return found


def resolve(argv: list[str], env: dict, values: dict[str, str]) -> list[str]:
    """Kubelet's $(VAR) expansion, for variables from the downward API only."""
    sources = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in env}

    def one(match: re.Match) -> str:
        return values[sources[match.group(1)]]

    return [re.sub(r"\$\(([A-Z_]+)\)", one, arg) for arg in argv]


def node(node_ip: str, *, port: int | None = None) -> tuple[dict[str, str], list[str]]:
    """The example on a node with IP ``node_ip``: kube-apiserver's flags and mvproxy's
    argv (after ``run``). ``port`` replaces 6443 throughout (free ports in tests)."""
    literal = example_node_ip()
    api = flags([a.replace(literal, node_ip) for a in container("kube-apiserver")["command"][1:]])
    mv = container("mvproxy")
    argv = resolve(mv["args"], mv["env"], {"status.hostIP": node_ip, "spec.nodeName": NODE_NAME})
    assert argv[0] == "run"
    if port is not None:
        api["secure-port"] = str(port)
        argv = [a.replace(":6443", f":{port}") for a in argv[1:]]
    else:
        argv = argv[1:]
    return api, argv


def dev_config(tmp: Path, pki: Path, *, port: int | None = None, admin_port: int | None = None
               ) -> Path:
    """config/mvproxy-sidecar.yaml with kubeadm's paths pointed at ``pki`` (and, for a
    run on loopback, its ports moved)."""
    text = MVPROXY_CONFIG.read_text()
    for name, dev in DEV_PKI_FILES.items():
        text = text.replace(f"/etc/kubernetes/pki/{name}", str(pki / dev))
    assert "/etc/kubernetes/pki/" not in text, "a kubeadm file without a dev PKI equivalent"
    doc = yaml.safe_load(text)
    if port is not None:
        doc["securePort"] = port
        doc["backend"]["url"] = doc["backend"]["url"].replace(":6443", f":{port}")
    if admin_port is not None:
        doc["admin"]["port"] = admin_port
    out = tmp / "mvproxy-sidecar.yaml"
    out.write_text(yaml.safe_dump(doc))
    return out


def config_argv(argv: list[str], config: Path) -> list[str]:
    """mvproxy's argv with ``--config`` pointing at ``config``."""
    return [f"--config={config}" if a.startswith("--config=") else a for a in argv]
