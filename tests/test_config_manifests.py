"""Every file under config/ is checked by a real tool or a real parser.

- Kubernetes manifests (picked by apiVersion/kind, whichever file they are in) validate
  strictly with kubernetes-validate against the 1.35 and 1.36 schemas, both bundled by
  kubernetes-validate 1.37 (``kubernetes-json-schema/v1.35.0-local-strict`` and
  ``v1.36.0-local-strict``). Documents of other API groups (kubeadm, kind, Prometheus
  Operator, mvproxy's own) are checked by their own tests; a document of a group not
  listed here fails, so a new file is never silently unchecked. YAML/JSON without
  apiVersion/kind (Prometheus rule files, Grafana dashboards) is not a manifest.
- The kubeadm configuration is the type it claims: known apiVersion/kind and only
  fields that type has (a small schema of kubeadm v1beta4, which kubernetes-validate
  does not carry).
- Every flag an mvproxy container passes exists in ``mvproxy run --help``, and
  config/mvproxy-sidecar.yaml with those flags passes ``mvproxy check-config``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from sidecar_support import CONFIG, KUBEADM, NODE_NAME, SIDECAR, config_argv, dev_config, node

from mvproxy.devpki import init_pki

VERSIONS = ("1.35", "1.36")
#: API groups whose documents other tests check (they are not Kubernetes API objects
#: kubernetes-validate knows): group -> where.
CHECKED_ELSEWHERE = {
    "mvproxy.io": "mvproxy check-config (test_config.py, below)",
    "kubeadm.k8s.io": "test_kubeadm_configuration_is_the_type_it_claims",
    "kind.x-k8s.io": "the kind tests",
    "monitoring.coreos.com": "the Prometheus tests (promtool)",
}


def documents() -> list[tuple[str, int, object]]:
    """(file, index, document) of every YAML/JSON file under config/."""
    found = []
    for path in sorted(CONFIG.rglob("*")):
        if path.suffix not in (".yaml", ".yml", ".json") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        docs = [json.loads(text)] if path.suffix == ".json" else list(yaml.safe_load_all(text))
        name = str(path.relative_to(CONFIG))
        found += [(name, i, doc) for i, doc in enumerate(docs) if doc is not None]
    return found


def group_of(doc: dict) -> str:
    api_version = doc["apiVersion"]
    return api_version.split("/")[0] if "/" in api_version else ""


def is_typed(doc: object) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("apiVersion"), str) \
        and isinstance(doc.get("kind"), str)


def kubernetes_manifests() -> list[tuple[str, int, dict]]:
    return [(f, i, d) for f, i, d in documents()
            if is_typed(d) and group_of(d) not in CHECKED_ELSEWHERE]


def ids(items) -> list[str]:
    return [f"{f}#{i}:{d['kind']}" for f, i, d in items]


MANIFESTS = kubernetes_manifests()


def test_config_holds_the_sidecar_manifests():
    names = {(f, d["kind"]) for f, _, d in MANIFESTS}
    assert {(SIDECAR.name, "Pod"), ("mvproxy-leases-rbac.yaml", "Role"),
            ("mvproxy-leases-rbac.yaml", "RoleBinding")} <= names


def test_every_typed_document_is_checked_somewhere():
    """A Kubernetes kind kubernetes-validate knows, or a group another test checks."""
    for f, i, doc in documents():
        if not is_typed(doc) or group_of(doc) in CHECKED_ELSEWHERE:
            continue
        group = group_of(doc)
        assert "." not in group or group.endswith(".k8s.io"), \
            f"{f}#{i}: {doc['apiVersion']} is not a Kubernetes API group; add it to " \
            "CHECKED_ELSEWHERE with the test that checks it"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "index", "doc"), MANIFESTS, ids=ids(MANIFESTS))
def test_manifest_validates_strictly(name, index, doc, version):
    try:
        used = kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{name}#{index}: no {version} schema for {doc['apiVersion']} "
                    f"{doc['kind']}: {exc}")
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{name}#{index} invalid for {version}: {exc}")
    assert used == version  # the schema of that very release, not an older fallback


@pytest.mark.parametrize("version", VERSIONS)
def test_the_validator_rejects_an_unknown_field(version):
    """Negative control: strict validation really looks at container fields."""
    pod = yaml.safe_load(SIDECAR.read_text())
    pod["spec"]["containers"][1]["securityContxt"] = {"runAsNonRoot": True}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, version, strict=True)


# --- kubeadm ---------------------------------------------------------------------------

_ARGS = [{"name": str, "value": str}]
_COMPONENT = {"extraArgs": _ARGS, "extraVolumes": [dict], "extraEnvs": [dict]}
#: The fields of kubeadm.k8s.io/v1beta4 ClusterConfiguration (cmd/kubeadm/app/apis/
#: kubeadm/v1beta4/types.go), nested only where config/ uses them.
CLUSTER_CONFIGURATION_V1BETA4 = {
    "apiVersion": str, "kind": str, "etcd": dict, "networking": dict,
    "kubernetesVersion": str, "controlPlaneEndpoint": str,
    "apiServer": {**_COMPONENT, "certSANs": [str]},
    "controllerManager": _COMPONENT, "scheduler": _COMPONENT, "dns": dict, "proxy": dict,
    "certificatesDir": str, "imageRepository": str, "featureGates": dict,
    "clusterName": str, "encryptionAlgorithm": str,
    "certificateValidityPeriod": str, "caCertificateValidityPeriod": str,
}
KUBEADM_TYPES = {("kubeadm.k8s.io/v1beta4", "ClusterConfiguration"):
                 CLUSTER_CONFIGURATION_V1BETA4}


def schema_problems(value: object, schema: object, path: str) -> list[str]:
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return [f"{path}: must be a mapping"]
        problems = []
        for key, item in value.items():
            if key not in schema:
                problems.append(f"{path}.{key}: unknown field")
            else:
                problems += schema_problems(item, schema[key], f"{path}.{key}")
        return problems
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: must be a list"]
        return [p for i, item in enumerate(value)
                for p in schema_problems(item, schema[0], f"{path}[{i}]")]
    if schema is dict:
        return [] if isinstance(value, dict) else [f"{path}: must be a mapping"]
    return [] if isinstance(value, schema) else [f"{path}: must be {schema.__name__}"]


def kubeadm_problems(doc: dict) -> list[str]:
    schema = KUBEADM_TYPES.get((doc.get("apiVersion"), doc.get("kind")))
    if schema is None:
        return [f"unknown kubeadm type {doc.get('apiVersion')} {doc.get('kind')}"]
    problems = schema_problems(doc, schema, "")
    for arg in (doc.get("apiServer") or {}).get("extraArgs") or []:
        if set(arg) != {"name", "value"} or str(arg.get("name", "")).startswith("-"):
            problems.append(f"apiServer.extraArgs: {arg!r} must be {{name, value}}, "
                            "name without dashes")
    return problems


def test_kubeadm_configuration_is_the_type_it_claims():
    docs = [d for f, _, d in documents() if is_typed(d) and group_of(d) == "kubeadm.k8s.io"]
    assert docs, "config/ holds no kubeadm configuration"
    for doc in docs:
        assert kubeadm_problems(doc) == []
    assert yaml.safe_load(KUBEADM.read_text())["kind"] == "ClusterConfiguration"


@pytest.mark.parametrize(("change", "problem"), [
    (lambda d: d["apiServer"].update(certSAN=["x"]), ".apiServer.certSAN: unknown field"),
    (lambda d: d.update(apiVersion="kubeadm.k8s.io/v1beta9"), "unknown kubeadm type"),
    (lambda d: d["apiServer"].update(extraArgs={"bind-address": "1"}), "must be a list"),
    (lambda d: d["apiServer"]["extraArgs"].append({"name": "--x", "value": "1"}),
     "name without dashes"),
    (lambda d: d["apiServer"].update(certSANs="127.0.0.1"), "must be a list"),
], ids=["typo", "unknown version", "v1beta3 map", "dashes", "SANs a string"])
def test_kubeadm_check_catches_mistakes(change, problem):
    doc = yaml.safe_load(KUBEADM.read_text())
    change(doc)
    assert any(problem in p for p in kubeadm_problems(doc)), kubeadm_problems(doc)


# --- mvproxy's flags and configuration ---------------------------------------------------


def pod_specs(doc: dict) -> list[dict]:
    spec = doc.get("spec") or {}
    template = (spec.get("template") or {}).get("spec")
    return [s for s in (spec, template) if isinstance(s, dict)]


def mvproxy_containers() -> list[tuple[str, dict]]:
    return [(f, c) for f, _, d in MANIFESTS for s in pod_specs(d)
            for c in s.get("containers") or []
            if c.get("name") == "mvproxy" or "mvproxy" in str(c.get("image", ""))]


def run_help_flags() -> set[str]:
    done = subprocess.run([sys.executable, "-m", "mvproxy", "run", "--help"],
                          capture_output=True, text=True, timeout=60, check=True)
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", done.stdout))


def test_every_mvproxy_flag_in_a_manifest_exists():
    known = run_help_flags()
    containers = mvproxy_containers()
    assert containers, "no mvproxy container found in config/"
    for name, c in containers:
        argv = [*c.get("command", [])[1:], *c.get("args", [])]
        assert argv[0] == "run", f"{name}: mvproxy container must run `mvproxy run`"
        used = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}
        assert used and used <= known, f"{name}: unknown flags {sorted(used - known)}"


def test_sidecar_config_passes_check_config(tmp_path):
    """The example config and the sidecar's flags, kubeadm's paths on a dev PKI."""
    pki = tmp_path / "pki"
    init_pki(pki, [NODE_NAME], hosts=["127.0.0.5"], days=2)
    _, argv = node("127.0.0.5")
    argv = config_argv(argv, dev_config(tmp_path, pki))
    config = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    rest = [a for a in argv if not a.startswith("--config=")]
    done = subprocess.run(
        [sys.executable, "-m", "mvproxy", "check-config", config, *rest,
         f"--kube-apiserver-manifest={SIDECAR}"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "configuration is valid" in done.stdout and "warning" not in done.stderr
