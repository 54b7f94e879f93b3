"""The simulator's ``/openapi/v2`` (issue 13): gnostic protobuf that kubectl 1.20 reads.

Unit half: the hand-written encoding, read back with the repo's own protobuf field
reader, carries a definition's GVK extension, properties and refs. End-to-end half: a
real demo cluster and the real kubectl 1.20 (no v3 client): ``apply``/``create``/
``diff`` validate client-side without ``--validate=false`` (a misspelled field fails
with kubectl's own error) and ``explain pods`` prints field docs, through an mvproxy
context and the ``-direct`` context.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import kubectl_env
from e2e_support import request
from kubectl import kubectl_binary

from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.demo import DemoCluster, start_cluster
from mvproxy.devcluster.protobuf import fields
from mvproxy.devcluster.protoencode import varint
from mvproxy.devcluster.simopenapiv2 import (
    PROTOBUF,
    PROTOBUF_ANSWER,
    document,
    encode_document,
    wants_protobuf,
)

CONTEXTS = ["apiserver-0", "apiserver-0-direct"]
CM = "io.k8s.api.core.v1.ConfigMap"


def _one(data: bytes, number: int) -> bytes:
    got = [v for n, v in fields(data) if n == number]
    assert len(got) == 1, (number, got)
    return got[0]  # type: ignore[return-value]


def _all(data: bytes, number: int) -> list:
    return [v for n, v in fields(data) if n == number]


def _named(data: bytes, number: int) -> dict[str, bytes]:
    """Repeated NamedX entries (name=1, value=2) of field ``number`` as a dict."""
    return {_one(entry, 1).decode(): _one(entry, 2) for entry in _all(data, number)}


@pytest.fixture(scope="module")
def decoded() -> dict[str, bytes]:
    body = encode_document(document(load_catalog("1.36")))
    assert _one(body, 1) == b"2.0"                      # swagger
    assert _one(_one(body, 2), 1) == b"Kubernetes"      # info.title
    return _named(_one(body, 9), 1)                      # definitions


def test_varint_round_numbers() -> None:
    assert [varint(v) for v in (0, 1, 127, 128, 300)] == \
        [b"\x00", b"\x01", b"\x7f", b"\x80\x01", b"\xac\x02"]
    with pytest.raises(ValueError):
        varint(-1)


def test_definitions_carry_gvk_properties_and_types(decoded: dict[str, bytes]) -> None:
    cm = decoded[CM]
    ext = _named(cm, 31)
    gvk = json.loads(_one(ext["x-kubernetes-group-version-kind"], 2))
    assert gvk == [{"group": "", "kind": "ConfigMap", "version": "v1"}]
    props = _named(_one(cm, 25), 1)
    assert {"apiVersion", "kind", "metadata", "data", "binaryData", "immutable"} <= set(props)
    assert _one(props["metadata"], 1) == \
        b"#/definitions/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
    data = props["data"]
    assert _all(_one(data, 22), 1) == [b"object"]
    assert _all(_one(_one(_one(data, 21), 1), 22), 1) == [b"string"]  # additionalProperties
    assert b"configuration data" in _one(data, 4)


def test_allof_wrapped_refs_become_plain_refs(decoded: dict[str, bytes]) -> None:
    props = _named(_one(decoded["io.k8s.api.core.v1.Container"], 25), 1)
    resources = props["resources"]
    assert _one(resources, 1) == b"#/definitions/io.k8s.api.core.v1.ResourceRequirements"
    assert _all(resources, 24) == []
    ports = props["ports"]
    assert _one(_one(_one(ports, 23), 1), 1) == b"#/definitions/io.k8s.api.core.v1.ContainerPort"
    assert json.loads(_one(_named(ports, 31)["x-kubernetes-patch-merge-key"], 2)) == \
        "containerPort"


def test_every_ref_names_a_definition() -> None:
    doc = document(load_catalog("1.36"))
    text = json.dumps(doc["definitions"])
    assert "#/components/" not in text
    refs = {part.split('"')[0] for part in text.split('"$ref": "#/definitions/')[1:]}
    assert refs and refs <= set(doc["definitions"])
    assert "io.k8s.api.core.v1.Pod" in doc["definitions"]


def test_paths_name_each_patch_operation_with_gvk_and_dry_run() -> None:
    body = encode_document(document(load_catalog("1.36")))
    paths = _named(_one(body, 8), 2)
    patch = _one(paths["/api/v1/namespaces/{namespace}/configmaps/{name}"], 8)
    ext = _named(patch, 13)
    assert json.loads(_one(ext["x-kubernetes-group-version-kind"], 2)) == \
        {"group": "", "kind": "ConfigMap", "version": "v1"}
    query = [_one(_one(_one(item, 1), 2), 3) for item in _all(patch, 8)]
    assert [_one(q, 4) for q in query] == [b"dryRun", b"fieldManager", b"force"]
    assert {_one(q, 2) for q in query} == {b"query"}
    assert "/apis/apps/v1/namespaces/{namespace}/deployments/{name}" in paths


def test_protobuf_only_for_the_gnostic_media_type() -> None:
    assert wants_protobuf(PROTOBUF)
    assert wants_protobuf(f"application/json;q=0.5, {PROTOBUF}")
    assert not wants_protobuf("application/json")
    assert not wants_protobuf("")
    assert not wants_protobuf("*/*")


# --- end to end ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    with start_cluster(tmp_path_factory.mktemp("openapi-v2"), ["1.36"],
                       base_port=0) as running:
        yield running


@pytest.fixture(scope="module")
def kubectl120(tmp_path_factory: pytest.TempPathFactory):
    binary = kubectl_binary("1.20")
    env = kubectl_env(tmp_path_factory.mktemp("kubectl-home"))

    def run(cluster: DemoCluster, context: str, *args: str) -> subprocess.CompletedProcess:
        argv = [str(binary), "--kubeconfig", str(cluster.kubeconfig), "--cache-dir",
                str(Path(cluster.kubeconfig).parent / "kubectl-cache"), "--context",
                context, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=90, env=env,
                              stdin=subprocess.DEVNULL, check=False)
    return run


@pytest.mark.parametrize("direct", [False, True])
def test_served_in_both_encodings(cluster: DemoCluster, direct: bool) -> None:
    proto = request(cluster, "apiserver-0", "GET", "/openapi/v2",
                    headers={"Accept": PROTOBUF}, direct=direct)
    assert proto.status == 200 and proto.headers["Content-Type"] == PROTOBUF_ANSWER
    assert CM.encode() in proto.body
    plain = request(cluster, "apiserver-0", "GET", "/openapi/v2",
                    headers={"Accept": "application/json"}, direct=direct)
    assert plain.status == 200
    doc = json.loads(plain.body)
    assert doc["swagger"] == "2.0" and CM in doc["definitions"]
    anon = request(cluster, "apiserver-0", "GET", "/openapi/v2", cert=None, direct=direct)
    assert anon.status in (200, 401, 403)  # kube lets anyone read it; never a crash


def _manifest(tmp_path: Path, name: str, data_key: str = "data") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\n"
                    f"  namespace: default\n{data_key}:\n  a: b\n")
    return str(path)


@pytest.mark.parametrize("context", CONTEXTS)
def test_kubectl_120_validates_client_side(cluster: DemoCluster, kubectl120, tmp_path,
                                          context: str) -> None:
    name = f"v2-{context}"
    done = kubectl120(cluster, context, "apply", "-f", _manifest(tmp_path, name))
    assert done.returncode == 0, done.stderr
    got = kubectl120(cluster, context, "get", "configmap", name, "-n", "default", "-o",
                     "jsonpath={.data.a}")
    assert got.stdout == "b", got.stderr
    made = kubectl120(cluster, context, "create", "-f", _manifest(tmp_path, name + "-c"))
    assert made.returncode == 0, made.stderr
    diff = kubectl120(cluster, context, "diff", "-f", _manifest(tmp_path, name))
    assert diff.returncode == 0, diff.stderr + diff.stdout
    bad = kubectl120(cluster, context, "apply", "-f",
                     _manifest(tmp_path, name + "-bad", data_key="dta"))
    assert bad.returncode != 0
    assert 'unknown field "dta"' in bad.stderr, bad.stderr
    assert "--validate=false" in bad.stderr
    missing = kubectl120(cluster, context, "get", "configmap", name + "-bad", "-n",
                         "default")
    assert missing.returncode != 0  # nothing was sent


@pytest.mark.parametrize("context", CONTEXTS)
def test_kubectl_120_explain_pods(cluster: DemoCluster, kubectl120, context: str) -> None:
    done = kubectl120(cluster, context, "explain", "pods")
    assert done.returncode == 0, done.stderr
    assert "KIND:     Pod" in done.stdout and "spec\t<Object>" in done.stdout, done.stdout
    deep = kubectl120(cluster, context, "explain", "pods.spec.containers.resources")
    assert deep.returncode == 0, deep.stderr
    assert "limits" in deep.stdout and "requests" in deep.stdout, deep.stdout
