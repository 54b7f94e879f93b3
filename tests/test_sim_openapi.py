"""The simulator's OpenAPI v3 data: real schemas, reproducible, covering what it serves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mvproxy.devcluster.catalog import available_versions, load_catalog
from mvproxy.devcluster.simopenapi import OpenAPI, release_schemas

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "mvproxy" / "devcluster" / "openapi"


def test_generator_reproduces_the_committed_files(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_openapi.py"),
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=300)
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == sorted(p.name for p in DATA.iterdir())
    for name in made:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def _gvks(schemas: dict) -> set[tuple[str, str, str]]:
    return {(g["group"], g["version"], g["kind"]) for s in schemas.values()
            for g in s.get("x-kubernetes-group-version-kind", ())}


@pytest.mark.parametrize("version", ["1.33", "1.34", "1.36", "1.37"])
def test_every_served_kind_has_its_schema(version: str) -> None:
    catalog = load_catalog(version)
    served = {(g.name, v.version, r.kind) for g in catalog.groups for v in g.versions
              for r in v.resources if "/" not in r.resource}
    assert served - _gvks(release_schemas(version)) == set()


def test_documents_carry_kube_spelled_schemas() -> None:
    api = OpenAPI(load_catalog("1.36"))
    doc = json.loads(api.documents["apis/scheduling.k8s.io/v1alpha2"])
    schemas = doc["components"]["schemas"]
    group = schemas["io.k8s.api.scheduling.v1alpha2.PodGroup"]
    assert group["x-kubernetes-group-version-kind"] == [
        {"group": "scheduling.k8s.io", "kind": "PodGroup", "version": "v1alpha2"}]
    assert group["properties"]["spec"]["allOf"] == [
        {"$ref": "#/components/schemas/io.k8s.api.scheduling.v1alpha2.PodGroupSpec"}]
    assert group["type"] == "object" and "enum" not in group["properties"]["kind"]
    # Every reference resolves inside the same document.
    text = json.dumps(doc)
    for ref in {part.split('"')[0] for part in text.split("#/components/schemas/")[1:]}:
        assert ref in schemas, ref
    # Only its own group/version's kinds are roots.
    kinds = _gvks({k: v for k, v in schemas.items() if ".scheduling." in k})
    assert all(g == "scheduling.k8s.io" and v == "v1alpha2" for g, v, _ in kinds)


def test_a_release_without_data_serves_empty_schemas() -> None:
    assert release_schemas("0.0") == {}
    assert "1.36" in available_versions()
