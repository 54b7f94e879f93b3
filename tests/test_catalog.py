"""The shipped catalogs hold exactly what real kube-apiservers' discovery shows.

Tests that compare against the real documents read the repository's copy in
tests/data/k8s-discovery (gzipped, provenance in its README); the rest need only
package data.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mvproxy.devcluster import discoverydocs
from mvproxy.devcluster.catalog import available_versions, load_catalog

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "tests" / "data" / "k8s-discovery"
CATALOGS = REPO / "mvproxy" / "devcluster" / "catalogs"
GENERATOR = REPO / "scripts" / "gen_catalogs.py"
RELEASES = [f"1.{minor}" for minor in range(31, 38)]
NEWEST = {"1.31": "0209a4cb", "1.33": "0b1dcaba", "1.37": "6732d913"}


@pytest.fixture(scope="module")
def index() -> list[dict]:
    return json.loads((SOURCE / "index.json").read_text())


@pytest.fixture(scope="module")
def newest(index) -> dict[str, dict]:
    """Release -> its cycle's newest snapshot entry (index.json lists oldest first)."""
    picked = {}
    for entry in index:
        release, _, rest = entry["dir"].partition("-cycle-")
        if rest:
            picked[release] = entry
    return picked


def _read(entry: dict) -> dict:
    stored = SOURCE / entry["dir"] / f"{entry['file']}.gz"
    return json.loads(gzip.decompress(stored.read_bytes()))


def _strip_timestamps(doc: dict) -> dict:
    for item in doc["items"]:
        item["metadata"].pop("creationTimestamp", None)
    return doc


def _gvrs(groups) -> list[tuple[str, str, str]]:
    return [(g, v, r) for g, versions in groups for v, resources in versions for r in resources]


def _catalog_gvrs(catalog) -> list[tuple[str, str, str]]:
    return _gvrs((g.name, [(v.version, [r.resource for r in v.resources]) for v in g.versions])
                 for g in catalog.groups if g.name)


def _source_gvrs(doc: dict) -> list[tuple[str, str, str]]:
    return _gvrs((i["metadata"]["name"],
                  [(v["version"], [r["resource"] for r in v["resources"]]) for v in i["versions"]])
                 for i in doc["items"])


def test_available_versions_are_1_31_to_1_37():
    assert available_versions() == RELEASES


def test_newest_snapshot_per_cycle_is_used(newest):
    for release, commit in NEWEST.items():
        assert newest[release]["commit"].startswith(commit)
    for release in RELEASES:
        raw = json.loads((CATALOGS / f"{release}.json").read_text())
        assert raw["source"]["commit"] == newest[release]["commit"]
        assert raw["source"]["sha256"] == newest[release]["sha256"]


@pytest.mark.parametrize("release", RELEASES)
def test_gvrs_and_their_order_equal_the_source(release, newest):
    catalog = load_catalog(release)
    doc = _read(newest[release])
    assert _catalog_gvrs(catalog) == _source_gvrs(doc)
    assert [g.name for g in catalog.groups] == ["", *newest[release]["groups"]]
    flat = {f"{g}/{v}": [] for g, v, _ in _catalog_gvrs(catalog)}
    for g, v, r in _catalog_gvrs(catalog):
        flat[f"{g}/{v}"].append(r)
    assert flat == newest[release]["group_versions"]


@pytest.mark.parametrize("release", RELEASES)
def test_apis_round_trip_equals_the_source(release, newest):
    rendered = discoverydocs.aggregated(load_catalog(release), core=False)
    assert rendered == _strip_timestamps(_read(newest[release]))


@pytest.mark.parametrize("release", RELEASES)
def test_core_legacy_round_trip_equals_the_source(release, index):
    entry = next(e for e in index if e["file"] == "api__v1.json")
    source = _read(entry)
    for resource in source["resources"]:
        resource.pop("storageVersionHash", None)
    listed = discoverydocs.api_resource_list(load_catalog(release), "", "v1")
    # The one addition the stored document lacks (gen_catalogs.CORE_ADDITIONS).
    resize = [r for r in listed["resources"] if r["name"] == "pods/resize"]
    assert len(resize) == (release >= "1.33")
    listed["resources"] = [r for r in listed["resources"] if r["name"] != "pods/resize"]
    assert listed == source


def test_api_versions_matches_the_real_shape(index):
    entry = next(e for e in index if e["file"] == "api.json")
    assert discoverydocs.api_versions("10.10.10.10:8050") == _read(entry)


def test_generator_is_deterministic_and_committed_catalogs_are_current(tmp_path, index):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        subprocess.run([sys.executable, str(GENERATOR), str(SOURCE), "--out", str(out)],
                       check=True, capture_output=True)
        runs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    committed = {p.name: p.read_bytes() for p in sorted(CATALOGS.glob("*.json"))}
    assert runs[0] == runs[1]
    assert runs[0] == committed, "catalogs are stale: run scripts/gen_catalogs.py"


def test_scheduling_alpha_versions_differ_between_1_35_and_1_36():
    old, new = load_catalog("1.35"), load_catalog("1.36")
    assert old.resource("scheduling.k8s.io", "v1alpha1", "workloads") is not None
    assert old.group_version("scheduling.k8s.io", "v1alpha2") is None
    assert new.resource("scheduling.k8s.io", "v1alpha2", "podgroups") is not None
    assert new.group_version("scheduling.k8s.io", "v1alpha1") is None


def test_only_the_newest_serves_lifecycle():
    assert load_catalog("1.37").group("lifecycle.k8s.io") is not None
    assert load_catalog("1.36").group("lifecycle.k8s.io") is None


def test_lookups():
    catalog = load_catalog("1.36")
    pods = catalog.resource("", "v1", "pods")
    assert (pods.kind, pods.singular, pods.namespaced) == ("Pod", "pod", True)
    assert pods.short_names == ("po",) and pods.categories == ("all",)
    eviction = pods.subresource("eviction")
    assert (eviction.group, eviction.version, eviction.kind) == ("policy", "v1", "Eviction")
    assert pods.subresource("status").group == ""
    nodes = catalog.resource("", "v1", "nodes")
    assert nodes.namespaced is False
    assert catalog.group("autoscaling").versions[0].version == "v2"
    assert catalog.resource("apps", "v1", "nope") is None
    assert catalog.resource("nope", "v1", "pods") is None
    assert catalog.group_version("apps", "v9") is None
    assert catalog.groups[0].name == ""


@pytest.mark.parametrize("spelling", ["1.36", "v1.36", "1.36.3", "v1.36.3"])
def test_version_spellings_select_the_minor(spelling):
    assert load_catalog(spelling) is load_catalog("1.36")
    assert load_catalog(spelling).git_version == "v1.36.0"


@pytest.mark.parametrize("version", ["1.30", "2.0", "latest", ""])
def test_unknown_version_lists_the_available_ones(version):
    with pytest.raises(ValueError) as caught:
        load_catalog(version)
    assert ", ".join(RELEASES) in str(caught.value)


def test_core_group_is_the_same_in_every_release_but_pods_resize():
    cores = {load_catalog(r).group("") for r in RELEASES}
    assert len(cores) == 2
    for release in RELEASES:
        pods = load_catalog(release).resource("", "v1", "pods")
        assert (pods.subresource("resize") is not None) is (release >= "1.33"), release


def test_pods_resize_is_listed_as_real_servers_list_it():
    """As real kube-apiserver 1.35.4 and 1.36.3 list it in /api/v1: between proxy and
    status, a Pod, get/patch/update (tests/test_real_sim_parity.py compares the rest)."""
    core = discoverydocs.api_resource_list(load_catalog("1.36"), "", "v1")["resources"]
    names = [r["name"] for r in core if r["name"].startswith("pods/")]
    assert names[names.index("pods/proxy") + 1:] == ["pods/resize", "pods/status"]
    assert next(r for r in core if r["name"] == "pods/resize") == {
        "name": "pods/resize", "singularName": "", "namespaced": True, "kind": "Pod",
        "verbs": ["get", "patch", "update"]}


def test_aggregated_core_document():
    doc = discoverydocs.aggregated(load_catalog("1.35"), core=True,
                                   api_version=discoverydocs.AGGREGATED_V2BETA1)
    assert doc["apiVersion"] == "apidiscovery.k8s.io/v2beta1"
    assert doc["kind"] == "APIGroupDiscoveryList" and doc["metadata"] == {}
    [group] = doc["items"]
    assert group["metadata"] == {}
    [version] = group["versions"]
    assert (version["version"], version["freshness"]) == ("v1", "Current")
    pods = next(r for r in version["resources"] if r["resource"] == "pods")
    assert pods["responseKind"] == {"group": "", "version": "", "kind": "Pod"}
    assert pods["scope"] == "Namespaced" and pods["shortNames"] == ["po"]
    evict = next(s for s in pods["subresources"] if s["subresource"] == "eviction")
    assert evict["responseKind"] == {"group": "policy", "version": "v1", "kind": "Eviction"}


def test_legacy_resource_lists_carry_subresources_as_entries():
    catalog = load_catalog("1.36")
    core = {r["name"]: r for r in discoverydocs.api_resource_list(catalog, "", "v1")["resources"]}
    assert core["pods/status"] == {"name": "pods/status", "singularName": "", "namespaced": True,
                                   "kind": "Pod", "verbs": ["get", "patch", "update"]}
    apps = discoverydocs.api_resource_list(catalog, "apps", "v1")
    assert (apps["apiVersion"], apps["groupVersion"]) == ("v1", "apps/v1")
    entries = {r["name"]: r for r in apps["resources"]}
    assert entries["deployments/scale"] == {
        "name": "deployments/scale", "singularName": "", "namespaced": True,
        "group": "autoscaling", "version": "v1", "kind": "Scale",
        "verbs": ["get", "patch", "update"]}
    assert entries["deployments"]["shortNames"] == ["deploy"]
    assert discoverydocs.api_resource_list(catalog, "apps", "v9") is None


def test_legacy_group_documents():
    catalog = load_catalog("1.36")
    groups = discoverydocs.api_group_list(catalog)
    assert (groups["kind"], groups["apiVersion"]) == ("APIGroupList", "v1")
    assert [g["name"] for g in groups["groups"]] == [g.name for g in catalog.groups[1:]]
    autoscaling = discoverydocs.api_group(catalog, "autoscaling")
    assert autoscaling["kind"] == "APIGroup"
    assert autoscaling["preferredVersion"] == {"groupVersion": "autoscaling/v2", "version": "v2"}
    assert [v["groupVersion"] for v in autoscaling["versions"]] == ["autoscaling/v2",
                                                                   "autoscaling/v1"]
    assert discoverydocs.api_group(catalog, "") is None
    assert discoverydocs.api_group(catalog, "lifecycle.k8s.io") is None


# --------------------------------------------------------------------------- --runtime-config


def test_without_a_group_version_drops_it_and_keeps_the_rest():
    catalog = load_catalog("1.35")
    trimmed = catalog.without(["scheduling.k8s.io/v1alpha1"])
    assert trimmed.group_version("scheduling.k8s.io", "v1alpha1") is None
    assert [v.version for v in trimmed.group("scheduling.k8s.io").versions] == ["v1"]
    assert [g.name for g in trimmed.groups] == [g.name for g in catalog.groups]
    assert trimmed.git_version == catalog.git_version
    # Pure: the shipped catalog is unchanged.
    assert catalog.group_version("scheduling.k8s.io", "v1alpha1") is not None


def test_without_the_last_version_drops_the_group():
    catalog = load_catalog("1.35")
    trimmed = catalog.without(["apps/v1"])
    assert trimmed.group("apps") is None
    assert [g.name for g in trimmed.groups] == [g.name for g in catalog.groups if g.name != "apps"]


@pytest.mark.parametrize("key", ["v1", "api/v1", "/v1"])
def test_core_group_version_spellings(key):
    trimmed = load_catalog("1.36").without([key])
    assert trimmed.group("") is None and trimmed.group("apps") is not None


@pytest.mark.parametrize("key", ["v1/pods/exec", "/v1/pods/exec"])
def test_without_one_subresource(key):
    catalog = load_catalog("1.35")
    trimmed = catalog.without([key])
    pods = trimmed.resource("", "v1", "pods")
    assert pods.subresource("exec") is None
    before = [s.subresource for s in catalog.resource("", "v1", "pods").subresources]
    assert [s.subresource for s in pods.subresources] == [s for s in before if s != "exec"]
    assert pods.verbs == catalog.resource("", "v1", "pods").verbs
    assert trimmed.resource("", "v1", "configmaps") == catalog.resource("", "v1", "configmaps")


def test_without_a_grouped_subresource():
    trimmed = load_catalog("1.36").without(["apps/v1/deployments/scale"])
    assert trimmed.resource("apps", "v1", "deployments").subresource("scale") is None
    assert trimmed.resource("apps", "v1", "deployments").subresource("status") is not None
    assert trimmed.resource("apps", "v1", "replicasets").subresource("scale") is not None


@pytest.mark.parametrize("key,message", [
    ("nope.k8s.io/v1", "no group/version nope.k8s.io/v1"),
    ("v2", "no group/version v2"),
    ("v1/pods/teleport", "no subresource pods/teleport"),
    ("apps/v1/gizmos/status", "no subresource gizmos/status"),
    ("a/b/c/d/e", "expected group/version"),
    ("apps//v1", "empty segment"),
])
def test_without_rejects_keys_that_name_nothing(key, message):
    with pytest.raises(ValueError, match=message):
        load_catalog("1.36").without([key])


def test_disabled_keys_parses_the_flag_value():
    from mvproxy.devcluster.catalog import disabled_keys

    assert disabled_keys("") == [] and disabled_keys(None) == []
    assert disabled_keys("v1/pods/exec=false, apps/v1=False,batch/v1=true,storage.k8s.io/v1") \
        == ["v1/pods/exec", "apps/v1"]
    with pytest.raises(ValueError, match="true or false"):
        disabled_keys("apps/v1=off")
    with pytest.raises(ValueError, match="expected group/version"):
        disabled_keys("a/b/c/d/e=true")


def test_sim_refuses_a_bad_runtime_config(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mvproxy", "sim", "--server-id", "x", "--pki", str(tmp_path),
         "--secure-port", "1", "--store", str(tmp_path / "s.db"),
         "--runtime-config", "v1/pods/teleport=false"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "no subresource pods/teleport" in done.stderr
