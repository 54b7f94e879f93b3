"""Discovery documents: parsing, the served-resource index, rendering, ETags, negotiation."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from mvproxy.devcluster import catalog, discoverydocs
from mvproxy.discovery import (
    AGGREGATED_V2,
    AGGREGATED_V2BETA1,
    API_VERSION_V2,
    API_VERSION_V2BETA1,
    PEER_ACCEPT,
    DiscoveryFormatError,
    Negotiated,
    Snapshot,
    check_prefix,
    etag,
    merge,
    negotiate,
    parse_aggregated,
    render_aggregated,
    render_api_group,
    render_api_group_list,
    render_api_versions,
)
from mvproxy.errors import MvproxyError

MAX_BYTES = 1 << 20
RELEASES = catalog.available_versions()
OBSERVED = Path(__file__).resolve().parent / "data/kubectl-requests/observed-requests.jsonl"


def body(doc: object) -> bytes:
    return json.dumps(doc).encode()


def release_doc(version: str, *, core: bool, api_version: str = API_VERSION_V2) -> dict:
    return discoverydocs.aggregated(catalog.load_catalog(version), core=core,
                                    api_version=api_version)


def release_snapshot(version: str) -> Snapshot:
    # As the poller builds it: each document parsed, then checked for its path.
    core = parse_aggregated(body(release_doc(version, core=True)), max_bytes=MAX_BYTES)
    groups = parse_aggregated(body(release_doc(version, core=False)), max_bytes=MAX_BYTES)
    check_prefix("/api", core)
    check_prefix("/apis", groups)
    return Snapshot(core, groups)


def small_doc() -> dict:
    deployments = {"resource": "deployments", "scope": "Namespaced",
                   "singularResource": "deployment",
                   "responseKind": {"group": "", "version": "", "kind": "Deployment"},
                   "verbs": ["get", "list"],
                   "subresources": [{"subresource": "scale", "verbs": ["get", "update"]}]}
    apps = {"metadata": {"name": "apps"},
            "versions": [{"version": "v1", "resources": [deployments], "freshness": "Current"}]}
    return {"kind": "APIGroupDiscoveryList", "apiVersion": API_VERSION_V2, "metadata": {},
            "items": [apps]}


# --------------------------------------------------------------------------- parsing: accepted

@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("api_version", [API_VERSION_V2, API_VERSION_V2BETA1])
def test_real_release_documents_parse(version, api_version):
    for core in (True, False):
        doc = release_doc(version, core=core, api_version=api_version)
        assert parse_aggregated(body(doc), max_bytes=MAX_BYTES) == tuple(doc["items"])


def test_null_creation_timestamp_and_unknown_fields_are_kept():
    doc = small_doc()
    group = doc["items"][0]
    group["metadata"]["creationTimestamp"] = None  # documents up to early 1.33 carry it
    group["futureField"] = {"x": 1}
    group["versions"][0]["resources"][0]["futureField"] = [1, 2]
    (parsed,) = parse_aggregated(body(doc), max_bytes=MAX_BYTES)
    assert parsed == group
    assert json.loads(render_aggregated([parsed]))["items"] == [group]


def test_empty_lists_omitted_or_null_as_go_writes_them_are_accepted():
    # An APIService that is down: kube-aggregator lists its version with no resources.
    doc = small_doc()
    doc["items"] += [{"metadata": {"name": "metrics.k8s.io"},
                      "versions": [{"version": "v1beta1", "freshness": "Stale"}]},
                     {"metadata": {"name": "empty.example.com"}, "versions": None}]
    doc["items"][0]["versions"][0]["resources"][0]["verbs"] = None
    snapshot = Snapshot(groups=parse_aggregated(body(doc), max_bytes=MAX_BYTES))
    assert snapshot.serves_group_version("metrics.k8s.io", "v1beta1")
    assert snapshot.serves("apps", "v1", "deployments", "scale")


# --------------------------------------------------------------------------- parsing: rejected

def broken(change) -> bytes:
    doc = small_doc()
    change(doc)
    return body(doc)


def _apps(doc: dict) -> dict:
    return doc["items"][0]


def _v1(doc: dict) -> dict:
    return _apps(doc)["versions"][0]


def _deployments(doc: dict) -> dict:
    return _v1(doc)["resources"][0]


GARBAGE = [
    pytest.param(b"<html>502 Bad Gateway</html>", "document: not JSON", id="an HTML error page"),
    pytest.param(b"\xff\xfe\x00\x01", "document: not JSON", id="binary noise"),
    pytest.param(b'{"kind": NaN}', "document: not JSON", id="NaN, which Go never writes"),
    pytest.param(b"[]", "document: the document must be an object", id="a JSON list"),
    pytest.param(body({"kind": "APIGroupList", "apiVersion": "v1", "groups": []}),
                 "kind must be 'APIGroupDiscoveryList', got \"APIGroupList\"",
                 id="a legacy APIGroupList"),
    pytest.param(broken(lambda d: d.update(apiVersion="v1")), "apiVersion must be",
                 id="an unknown apiVersion"),
    pytest.param(broken(lambda d: d.update(items={})), "'items' must be a list",
                 id="items not a list"),
    pytest.param(broken(lambda d: d.update(items=["apps"])), "items[0]: a group must be an object",
                 id="a group that is not an object"),
    pytest.param(broken(lambda d: _apps(d).pop("metadata")),
                 "items[0]: 'metadata' must be an object, got null", id="a group without metadata"),
    pytest.param(broken(lambda d: _apps(d)["metadata"].update(name=5)),
                 "'metadata.name' must be a string, got 5", id="a group name that is not a string"),
    pytest.param(broken(lambda d: _apps(d).update(versions={"v1": {}})),
                 "items[0](apps): 'versions' must be a list", id="versions not a list"),
    pytest.param(broken(lambda d: _v1(d).pop("version")),
                 "items[0](apps).versions[0]: 'version' must be a string, got null",
                 id="a version without a name"),
    pytest.param(broken(lambda d: _v1(d).update(freshness=1)), "'freshness' must be a string",
                 id="freshness not a string"),
    pytest.param(broken(lambda d: _v1(d).update(resources="deployments")),
                 "items[0](apps).versions[0](v1): 'resources' must be a list",
                 id="resources not a list"),
    pytest.param(broken(lambda d: _deployments(d).pop("resource")),
                 "items[0](apps).versions[0](v1).resources[0]: 'resource' must be a string",
                 id="a resource without a name"),
    pytest.param(broken(lambda d: _deployments(d).update(resource="")),
                 "'resource' must not be empty", id="a resource with an empty name"),
    pytest.param(broken(lambda d: _deployments(d).pop("verbs")),
                 "resources[0](deployments): missing 'verbs'", id="a resource without verbs"),
    pytest.param(broken(lambda d: _deployments(d).update(verbs=["get", 7])),
                 "each verb must be a string, got 7", id="a verb that is not a string"),
    pytest.param(broken(lambda d: _deployments(d)["subresources"][0].pop("subresource")),
                 "resources[0](deployments).subresources[0]: 'subresource' must be a string",
                 id="a subresource without a name"),
    pytest.param(broken(lambda d: d["items"].append(copy.deepcopy(_apps(d)))),
                 "document: group \"apps\" is listed twice", id="a duplicate group"),
    pytest.param(broken(lambda d: _apps(d)["versions"].append(copy.deepcopy(_v1(d)))),
                 "items[0](apps): version \"v1\" is listed twice", id="a duplicate version"),
    pytest.param(broken(lambda d: _v1(d)["resources"].append(copy.deepcopy(_deployments(d)))),
                 "items[0](apps).versions[0](v1): resource \"deployments\" is listed twice",
                 id="a duplicate resource"),
]


@pytest.mark.parametrize(("raw", "message"), GARBAGE)
def test_garbage_is_rejected_saying_what_and_where(raw, message):
    with pytest.raises(DiscoveryFormatError) as caught:
        parse_aggregated(raw, max_bytes=MAX_BYTES)
    assert message in str(caught.value)


def test_size_is_checked_before_parsing():
    with pytest.raises(DiscoveryFormatError, match="101 bytes is over the 100-byte limit"):
        parse_aggregated(b"x" * 101, max_bytes=100)


def test_a_valid_document_over_the_limit_is_rejected():
    raw = body(small_doc())
    assert parse_aggregated(raw, max_bytes=len(raw))
    with pytest.raises(DiscoveryFormatError, match="limit"):
        parse_aggregated(raw, max_bytes=len(raw) - 1)


HUGE = "K" * 100_000


@pytest.mark.parametrize("raw", [
    pytest.param(body({"kind": HUGE, "apiVersion": API_VERSION_V2, "items": []}), id="kind"),
    pytest.param(broken(lambda d: _apps(d).update(versions=[HUGE])), id="a version"),
    pytest.param(broken(lambda d: _apps(d)["metadata"].update(name=HUGE) or
                        _v1(d).update(resources=1)), id="a group name in the location"),
])
def test_huge_bad_values_are_not_echoed(raw):
    with pytest.raises(DiscoveryFormatError) as caught:
        parse_aggregated(raw, max_bytes=MAX_BYTES)
    assert len(str(caught.value)) < 200


def test_format_errors_are_mvproxy_errors_and_value_errors():
    assert issubclass(DiscoveryFormatError, MvproxyError)
    assert issubclass(DiscoveryFormatError, ValueError)


def test_documents_for_the_wrong_path_are_rejected():
    core = parse_aggregated(body(release_doc("1.36", core=True)), max_bytes=MAX_BYTES)
    apis = parse_aggregated(body(release_doc("1.36", core=False)), max_bytes=MAX_BYTES)
    with pytest.raises(DiscoveryFormatError,
                       match=r"^GET /api: group '[a-z0-9.]+' does not belong"):
        check_prefix("/api", apis)
    with pytest.raises(DiscoveryFormatError, match=r"^GET /apis: group '' does not belong"):
        check_prefix("/apis", core)
    check_prefix("/api", core)
    check_prefix("/apis", apis)


# --------------------------------------------------------------------------- what a server serves

@pytest.mark.parametrize(("version", "gvr", "expected"), [
    pytest.param("1.36", ("", "v1", "pods", ""), True, id="core pods"),
    pytest.param("1.36", ("", "v1", "pods", "status"), True, id="core pods/status"),
    pytest.param("1.36", ("", "v1", "pods", "eviction"), True, id="core pods/eviction"),
    pytest.param("1.36", ("", "v1", "pods", "resize"), True, id="core pods/resize"),
    pytest.param("1.32", ("", "v1", "pods", "resize"), False, id="1.32 lacks pods/resize"),
    pytest.param("1.36", ("apps", "v1", "deployments", "scale"), True, id="apps deployments/scale"),
    pytest.param("1.34", ("resource.k8s.io", "v1alpha3", "devicetaintrules", ""), True,
                 id="1.34 serves devicetaintrules"),
    pytest.param("1.34", ("resource.k8s.io", "v1alpha3", "devicetaintrules", "status"), False,
                 id="1.34 lacks devicetaintrules/status"),
    pytest.param("1.35", ("resource.k8s.io", "v1alpha3", "devicetaintrules", "status"), True,
                 id="1.35 adds devicetaintrules/status"),
    pytest.param("1.36", ("storage.k8s.io", "v1", "csinodes", "status"), False,
                 id="1.36 lacks csinodes/status"),
    pytest.param("1.37", ("storage.k8s.io", "v1", "csinodes", "status"), True,
                 id="1.37 adds csinodes/status"),
    pytest.param("1.36", ("apps", "v2", "deployments", ""), False, id="unknown version"),
    pytest.param("1.36", ("", "v1", "deployments", ""), False, id="resource of another group"),
    pytest.param("1.36", ("apps", "v1", "deployments", "nosuch"), False, id="unknown subresource"),
])
def test_snapshot_serves(version, gvr, expected):
    assert release_snapshot(version).serves(*gvr) is expected


@pytest.mark.parametrize(("version", "group", "group_version", "expected"), [
    pytest.param("1.35", "scheduling.k8s.io", "v1alpha1", True, id="1.35 serves v1alpha1"),
    pytest.param("1.36", "scheduling.k8s.io", "v1alpha1", False, id="1.36 dropped it"),
    pytest.param("1.36", "scheduling.k8s.io", "v1alpha2", True, id="1.36 serves v1alpha2"),
    pytest.param("1.36", "lifecycle.k8s.io", "v1alpha1", False, id="1.36 lacks lifecycle"),
    pytest.param("1.37", "lifecycle.k8s.io", "v1alpha1", True, id="1.37 has lifecycle"),
    pytest.param("1.36", "", "v1", True, id="core v1"),
])
def test_snapshot_serves_group_version(version, group, group_version, expected):
    assert release_snapshot(version).serves_group_version(group, group_version) is expected


def test_snapshot_indexes_agree_with_the_catalog():
    release_catalog = catalog.load_catalog("1.37")
    expected = {(g.name, v.version, r.resource) for g in release_catalog.groups
                for v in g.versions for r in v.resources}
    assert release_snapshot("1.37").gvrs == expected


def test_an_empty_snapshot_serves_nothing():
    assert not Snapshot().serves("", "v1", "pods")
    assert Snapshot().group_versions == frozenset()


def test_snapshot_equality_and_repr_ignore_the_indexes():
    a, b = release_snapshot("1.36"), release_snapshot("1.36")
    assert a == b and a is not b
    assert "gvrs" not in repr(Snapshot())


# --------------------------------------------------------------------------- rendering and ETags

def test_aggregated_rendering_is_compact_json_in_kube_field_order():
    groups = release_snapshot("1.36").groups
    rendered = render_aggregated(groups)
    assert rendered.startswith(b'{"kind":"APIGroupDiscoveryList","apiVersion":"apidiscovery.k8s.io'
                               b'/v2","metadata":{},"items":[{"metadata":{"name":')
    assert b": " not in rendered and b", " not in rendered
    assert json.loads(rendered)["items"] == list(groups)


def test_aggregated_rendering_labels_v2beta1():
    rendered = json.loads(render_aggregated([], api_version=API_VERSION_V2BETA1))
    assert rendered == {"kind": "APIGroupDiscoveryList", "apiVersion": API_VERSION_V2BETA1,
                        "metadata": {}, "items": []}


def test_aggregated_rendering_rejects_other_api_versions():
    with pytest.raises(ValueError, match="apiVersion"):
        render_aggregated([], api_version="v1")


def test_legacy_api_versions():
    core = release_snapshot("1.36").core
    assert render_api_versions(core) == (
        b'{"kind":"APIVersions","versions":["v1"],"serverAddressByClientCIDRs":[]}\n')


@pytest.mark.parametrize("version", RELEASES)
def test_legacy_group_list_matches_what_the_release_serves(version):
    expected = discoverydocs.api_group_list(catalog.load_catalog(version))
    assert json.loads(render_api_group_list(release_snapshot(version).groups)) == expected


def test_legacy_group_list_lists_all_stale_groups_and_leaves_out_empty_ones():
    groups = [{"metadata": {"name": "metrics.k8s.io"},
               "versions": [{"version": "v1beta1", "freshness": "Stale"}]},
              {"metadata": {"name": "empty.example.com"}}]
    (only,) = json.loads(render_api_group_list(groups))["groups"]
    assert only["preferredVersion"] == {"groupVersion": "metrics.k8s.io/v1beta1",
                                        "version": "v1beta1"}


def _group_list_entries(groups) -> dict[str, dict]:
    return {g["name"]: g for g in json.loads(render_api_group_list(groups))["groups"]}


@pytest.mark.parametrize("version", RELEASES)
def test_api_group_is_what_the_release_serves_byte_for_byte(version):
    """kube writes APIGroup as kind, apiVersion, name, versions, preferredVersion
    (staging/src/k8s.io/apiserver/pkg/endpoints/discovery/group.go, metav1.APIGroup);
    the simulated kube-apiserver's documents stand for the real ones."""
    release_catalog = catalog.load_catalog(version)
    for group in release_snapshot(version).groups:
        expected = discoverydocs.api_group(release_catalog, group["metadata"]["name"])
        # Go's json.Encoder, as kube-apiserver writes: compact, then a newline.
        assert render_api_group(group) == \
            json.dumps(expected, separators=(",", ":")).encode() + b"\n"


def test_api_group_agrees_with_the_merged_group_list():
    """One merged group's APIGroup equals its APIGroupList entry, preferred version
    included (first version not Stale), even where servers disagree on versions."""
    servers = {"apiserver-a": release_snapshot("1.35"), "apiserver-b": release_snapshot("1.36"),
               "apiserver-c": release_snapshot("1.37")}
    groups = merge(servers, stale={"apiserver-c"}).groups
    entries = _group_list_entries(groups)
    assert set(entries) == {g["metadata"]["name"] for g in groups}
    for group in groups:
        rendered = json.loads(render_api_group(group))
        assert rendered.pop("kind") == "APIGroup" and rendered.pop("apiVersion") == "v1"
        assert rendered == entries[group["metadata"]["name"]]


def test_api_group_prefers_the_first_version_not_stale():
    group = {"metadata": {"name": "widgets.example.com"},
             "versions": [{"version": "v2", "freshness": "Stale"}, {"version": "v1"}]}
    assert render_api_group(group) == (
        b'{"kind":"APIGroup","apiVersion":"v1","name":"widgets.example.com","versions":['
        b'{"groupVersion":"widgets.example.com/v2","version":"v2"},'
        b'{"groupVersion":"widgets.example.com/v1","version":"v1"}],'
        b'"preferredVersion":{"groupVersion":"widgets.example.com/v1","version":"v1"}}\n')


def test_etag_has_upstreams_format():
    assert re.fullmatch(r'"[0-9A-F]{128}"', etag(b"{}"))


def test_etag_is_stable_for_the_same_merge_and_changes_with_content():
    servers = {"apiserver-a": release_snapshot("1.35"), "apiserver-b": release_snapshot("1.36")}
    first = etag(render_aggregated(merge(servers).groups))
    assert etag(render_aggregated(merge(dict(reversed(servers.items()))).groups)) == first
    servers["apiserver-c"] = release_snapshot("1.37")
    assert etag(render_aggregated(merge(servers).groups)) != first
    assert etag(render_aggregated(merge(servers, stale={"apiserver-c"}).groups)) != first


# --------------------------------------------------------------------------- negotiation

KUBECTL_130_TO_136 = ("application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,"
                      "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,"
                      "application/json")
KUBECTL_137 = ("application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,"
               "application/json")
KUBECTL_127 = ("application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,"
               "application/json")
KUBECTL_120_AND_RAW = "application/json, */*"
KUBECTL_GET_LIST = ("application/json;as=Table;v=v1;g=meta.k8s.io,"
                    "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json")
AGG_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
PROTOBUF_AGG = ("application/vnd.kubernetes.protobuf;"
                "g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList")

MERGED_V2 = Negotiated("aggregated", AGGREGATED_V2, API_VERSION_V2)
MERGED_V2BETA1 = Negotiated("aggregated", AGGREGATED_V2BETA1, API_VERSION_V2BETA1)
NOPEER_V2 = Negotiated("aggregated", AGGREGATED_V2, API_VERSION_V2, nopeer=True)
LEGACY = Negotiated("legacy", "application/json")
BACKEND_NOPEER_V2 = Negotiated("backend", api_version=API_VERSION_V2, nopeer=True)
NOT_ACCEPTABLE = Negotiated("not_acceptable")

NEGOTIATION = [
    pytest.param(KUBECTL_130_TO_136, MERGED_V2, id="kubectl 1.30-1.36 gets merged v2"),
    pytest.param(KUBECTL_137, MERGED_V2, id="kubectl 1.37 gets merged v2"),
    pytest.param(KUBECTL_127, MERGED_V2BETA1, id="kubectl 1.27 gets merged v2beta1"),
    pytest.param(KUBECTL_120_AND_RAW, LEGACY, id="kubectl 1.20 and get --raw get legacy"),
    pytest.param("*/*", LEGACY, id="kr8s gets legacy"),
    pytest.param("application/json", LEGACY, id="DynamicClient gets legacy"),
    pytest.param(None, LEGACY, id="no Accept gets legacy"),
    pytest.param("  ", LEGACY, id="an empty Accept gets legacy"),
    pytest.param("application/*", LEGACY, id="application/* gets legacy"),
    pytest.param("*", LEGACY, id="a bare * means */*"),
    pytest.param("Application/JSON", LEGACY, id="media types are case-insensitive"),
    pytest.param(PEER_ACCEPT, NOPEER_V2, id="a peer's fetch asks for the nopeer view"),
    pytest.param(f"{AGG_V2};profile=foo", MERGED_V2, id="an unknown profile gets the merged view"),
    pytest.param(f"{KUBECTL_127.split(',')[0]};profile=nopeer",
                 Negotiated("aggregated", AGGREGATED_V2BETA1, API_VERSION_V2BETA1, nopeer=True),
                 id="nopeer works for v2beta1 too"),
    pytest.param("application/json ; g=apidiscovery.k8s.io ; v=v2 ; as=APIGroupDiscoveryList",
                 MERGED_V2, id="spaces around parameters are ignored"),
    pytest.param("application/json;v=v2;as=APIGroupDiscoveryList;g=apidiscovery.k8s.io",
                 MERGED_V2, id="parameter order does not matter"),
    pytest.param(f"{PROTOBUF_AGG},application/json", LEGACY,
                 id="aggregated protobuf is skipped for the next clause"),
    pytest.param(f"{PROTOBUF_AGG},{AGG_V2}", MERGED_V2,
                 id="aggregated protobuf then JSON gets merged JSON"),
    pytest.param("application/vnd.kubernetes.protobuf, */*", LEGACY,
                 id="plain protobuf is skipped for the next clause"),
    pytest.param(PROTOBUF_AGG, NOT_ACCEPTABLE, id="aggregated protobuf alone is not acceptable"),
    pytest.param("application/vnd.kubernetes.protobuf", NOT_ACCEPTABLE,
                 id="plain protobuf alone is not acceptable"),
    pytest.param(f"{PROTOBUF_AGG};profile=nopeer,application/json", BACKEND_NOPEER_V2,
                 id="nopeer protobuf goes to the backend"),
    pytest.param(f"{PROTOBUF_AGG};profile=nopeer", BACKEND_NOPEER_V2,
                 id="aggregated protobuf nopeer alone goes to the backend, marked nopeer"),
    pytest.param("application/vnd.kubernetes.protobuf;profile=nopeer,application/json", LEGACY,
                 id="nopeer without aggregation is plain protobuf, skipped"),
    pytest.param(f"application/json,{PROTOBUF_AGG}", LEGACY, id="JSON before protobuf stays JSON"),
    pytest.param(f"application/json;q=0.5,{AGG_V2}", MERGED_V2, id="higher q wins"),
    pytest.param(f"{AGG_V2};q=0,application/json", LEGACY, id="q=0 excludes a clause"),
    pytest.param(f"{AGG_V2};q=x,application/json", LEGACY, id="an unreadable q excludes a clause"),
    pytest.param(f"*/*,{AGG_V2}", MERGED_V2, id="a wildcard yields to a specific type of equal q"),
    pytest.param(KUBECTL_GET_LIST, LEGACY, id="as=Table clauses are skipped"),
    pytest.param("application/json;as=Table;v=v1;g=meta.k8s.io", NOT_ACCEPTABLE,
                 id="only as=Table is not acceptable"),
    pytest.param("application/json;g=apidiscovery.k8s.io;v=v3;as=APIGroupDiscoveryList",
                 NOT_ACCEPTABLE, id="an unknown discovery version is not acceptable"),
    pytest.param("application/json;q=0", NOT_ACCEPTABLE, id="everything at q=0 is not acceptable"),
    pytest.param("text/html", NOT_ACCEPTABLE, id="HTML is not acceptable"),
    pytest.param("application/yaml", NOT_ACCEPTABLE, id="YAML is not acceptable"),
]


@pytest.mark.parametrize(("accept", "expected"), NEGOTIATION)
def test_negotiate(accept, expected):
    """First acceptable clause, as staging/src/k8s.io/apiserver/pkg/endpoints/discovery/
    aggregated/wrapper.go negotiates; protobuf only as ``profile=nopeer`` (the backend's
    own view): any other protobuf answer would lack the peer-only APIs."""
    assert negotiate(accept) == expected


GROUP_NEGOTIATION = [
    pytest.param(KUBECTL_130_TO_136, LEGACY, id="kubectl's aggregated clauses are skipped"),
    pytest.param(KUBECTL_120_AND_RAW, LEGACY, id="kubectl 1.20 and get --raw"),
    pytest.param(None, LEGACY, id="no Accept"),
    pytest.param("*/*", LEGACY, id="a wildcard"),
    pytest.param(PEER_ACCEPT, LEGACY, id="nopeer means nothing without aggregation"),
    pytest.param(AGG_V2, NOT_ACCEPTABLE, id="aggregated alone is not acceptable"),
    pytest.param(f"{PROTOBUF_AGG};profile=nopeer", NOT_ACCEPTABLE, id="nopeer protobuf too"),
    pytest.param("application/vnd.kubernetes.protobuf", NOT_ACCEPTABLE, id="protobuf alone"),
    pytest.param("application/vnd.kubernetes.protobuf,application/json", LEGACY,
                 id="protobuf then JSON gets JSON"),
    pytest.param("application/yaml", NOT_ACCEPTABLE, id="YAML"),
]


@pytest.mark.parametrize(("accept", "expected"), GROUP_NEGOTIATION)
def test_negotiate_group(accept, expected):
    """``/apis/<g>`` offers no aggregated conversion (staging/src/k8s.io/apiserver/pkg/
    endpoints/discovery/group.go writes APIGroup with the default endpoint restrictions):
    only the legacy ``APIGroup``, merged."""
    assert negotiate(accept, aggregated=False) == expected


@pytest.mark.parametrize(("accept", "expected"), [
    pytest.param(KUBECTL_127.split(",")[0], NOT_ACCEPTABLE, id="v2beta1 alone: nothing left"),
    pytest.param(KUBECTL_127, LEGACY, id="kubectl 1.27, v2beta1 then JSON: legacy"),
    pytest.param(KUBECTL_130_TO_136, MERGED_V2, id="kubectl 1.30-1.36 still gets v2"),
    pytest.param(f"{KUBECTL_127.split(',')[0]},{AGG_V2}", MERGED_V2, id="v2beta1 then v2: v2"),
])
def test_negotiate_for_a_backend_without_v2beta1(accept, expected):
    """kube-apiserver 1.33+ no longer serves aggregated v2beta1 and takes the client's
    next clause (measured on 1.35.4 and 1.36.3: v2beta1 alone is 406, then JSON the
    legacy list): negotiated again so, mvproxy answers the same kind."""
    assert negotiate(accept, v2beta1=False) == expected
    assert negotiate(KUBECTL_127).api_version == "apidiscovery.k8s.io/v2beta1"


def test_only_aggregated_v2_nopeer_counts_as_upstream_counts_it():
    """Upstream's wrapper.go counts profile=nopeer on a v2 aggregated clause, JSON or
    protobuf (aggregator_discovery_nopeer_requests_total in staging/src/k8s.io/
    apiserver/pkg/endpoints/discovery/aggregated/metrics.go); v2beta1 is not
    aggregated discovery there since 1.35."""
    assert NOPEER_V2.counts_as_nopeer and BACKEND_NOPEER_V2.counts_as_nopeer
    v2beta1 = negotiate(f"{KUBECTL_127.split(',')[0]};profile=nopeer")
    assert v2beta1.nopeer and not v2beta1.counts_as_nopeer
    assert not any(n.counts_as_nopeer for n in (MERGED_V2, LEGACY, NOT_ACCEPTABLE))


def test_constants_are_upstreams_exact_strings():
    assert AGGREGATED_V2 == AGG_V2
    assert PEER_ACCEPT == (
        "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList;profile=nopeer,"
        "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json")


def _observed_discovery_requests() -> list[dict]:
    records = [json.loads(line) for line in OBSERVED.read_text().splitlines() if line.strip()]
    found = [r for r in records if urlsplit(r["path"]).path.rstrip("/") in ("/api", "/apis")]
    clients = {r["client"].split()[1] for r in found if r["client"].startswith("kubectl ")}
    assert {"v1.20.2", "v1.27.16", "v1.30.13", "v1.37.1"} <= clients, clients
    return found


def _what_the_client_needs(record: dict) -> Negotiated:
    match = re.match(r"kubectl v1\.(\d+)", record["client"])
    if not match or (record.get("command") or "").startswith("get --raw"):
        return LEGACY
    minor = int(match[1])
    return MERGED_V2 if minor >= 30 else MERGED_V2BETA1 if minor >= 27 else LEGACY


def test_every_observed_client_gets_what_it_needs():
    for record in _observed_discovery_requests():
        accept = next((v for k, v in record["headers"] if k.lower() == "accept"), None)
        assert negotiate(accept) == _what_the_client_needs(record), record["client"]


def test_the_negotiation_table_covers_every_observed_accept():
    table = {p.values[0] for p in NEGOTIATION}
    observed = {v for r in _observed_discovery_requests() for k, v in r["headers"]
                if k.lower() == "accept"}
    assert observed <= table


# --------------------------------------------------------------------------- APIResourceList
# Against discovery captured from real kube-apiservers 1.35.4 and 1.36.3
# (tests/data/real-discovery/README.md).

REAL = Path(__file__).resolve().parent / "data/real-discovery"


def _real(version: str) -> dict:
    import gzip

    return json.loads(gzip.decompress((REAL / f"{version}.json.gz").read_bytes()))


def _real_snapshot(doc: dict) -> Snapshot:
    return Snapshot(doc["aggregated"]["/api"]["items"], doc["aggregated"]["/apis"]["items"])


def _without_hash(entries: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "storageVersionHash"} for e in entries]


@pytest.mark.parametrize("version", ["1.35.4", "1.36.3"])
def test_legacy_resources_are_what_kube_apiserver_lists(version: str) -> None:
    """Every group/version of a real server: the aggregated entries, converted, are its
    own APIResourceList (in its order, by name), but for storageVersionHash."""
    from mvproxy.discovery import legacy_resources

    doc = _real(version)
    assert doc["version"] == f"v{version}"
    checked = 0
    for group in doc["aggregated"]["/api"]["items"] + doc["aggregated"]["/apis"]["items"]:
        name = group["metadata"].get("name", "")
        for entry in group["versions"]:
            path = f"/apis/{name}/{entry['version']}" if name else f"/api/{entry['version']}"
            converted = [e for r in entry["resources"] for e in legacy_resources(r)]
            real = doc["legacy"][path]["resources"]
            assert sorted(converted, key=lambda e: e["name"]) == _without_hash(real), path
            # Field order too: the same bytes a client would see from the server.
            assert [list(e) for e in sorted(converted, key=lambda e: e["name"])] == \
                [[k for k in e if k != "storageVersionHash"] for e in real], path
            checked += 1
    assert checked > 20  # every group/version each serves
    # What the conversion must get right: another group's kind, subresources.
    scale = next(e for e in doc["legacy"]["/apis/apps/v1"]["resources"]
                 if e["name"] == "deployments/scale")
    assert (scale["group"], scale["version"], scale["kind"]) == ("autoscaling", "v1", "Scale")


def test_an_old_servers_resource_list_merged_is_the_new_servers() -> None:
    """1.35.4's backend, 1.36.3 as the peer: the legacy admissionregistration.k8s.io/v1
    document gains MutatingAdmissionPolicies and their bindings, exactly as 1.36.3
    lists them (storageVersionHash aside), in 1.36.3's order."""
    from mvproxy.discovery import merge_resource_list, peer_only_resources

    old, new = _real("1.35.4"), _real("1.36.3")
    local = _real_snapshot(old)
    merged = merge({"apiserver-0": local, "apiserver-1": _real_snapshot(new)})
    path, gv = "/apis/admissionregistration.k8s.io/v1", "admissionregistration.k8s.io/v1"
    extra = peer_only_resources(merged, local, "admissionregistration.k8s.io", "v1")
    assert [e["name"] for e in extra] == ["mutatingadmissionpolicies",
                                          "mutatingadmissionpolicybindings"]
    backend_body = json.dumps(old["legacy"][path], separators=(",", ":")).encode() + b"\n"
    body = merge_resource_list(backend_body, extra, gv)
    assert body is not None and body.endswith(b"}\n") and b"\n" not in body[:-1]
    document = json.loads(body)
    assert {k: v for k, v in document.items() if k != "resources"} == \
        {k: v for k, v in new["legacy"][path].items() if k != "resources"}
    assert _without_hash(document["resources"]) == \
        _without_hash(new["legacy"][path]["resources"])
    # The backend's own entries keep their storageVersionHash; the added ones have none.
    hashes = {e["name"]: "storageVersionHash" in e for e in document["resources"]}
    assert hashes["validatingadmissionpolicies"] and not hashes["mutatingadmissionpolicies"]
    # Nothing peer-only elsewhere between these two releases, and nothing the other way.
    for group, version in local.group_versions - {("admissionregistration.k8s.io", "v1")}:
        assert not peer_only_resources(merged, local, group, version), (group, version)
    assert not peer_only_resources(merged, _real_snapshot(new), "admissionregistration.k8s.io",
                                   "v1")


def test_peer_only_subresources_of_shared_resources_are_added() -> None:
    from mvproxy.discovery import merge_resource_list, peer_only_resources

    def core(subresources: list[str]) -> Snapshot:
        pods = {"resource": "pods", "scope": "Namespaced", "singularResource": "pod",
                "responseKind": {"group": "", "version": "", "kind": "Pod"},
                "verbs": ["get", "list"], "shortNames": ["po"], "categories": ["all"],
                "subresources": [{"subresource": s, "responseKind": {
                    "group": "", "version": "", "kind": "Pod"}, "verbs": ["get", "patch"]}
                    for s in subresources]}
        return Snapshot([{"metadata": {}, "versions": [{"version": "v1",
                                                         "resources": [pods]}]}], [])

    local = core(["status"])
    merged = merge({"a": local, "b": core(["resize", "status"])})
    extra = peer_only_resources(merged, local, "", "v1")
    assert extra == ({"name": "pods/resize", "singularName": "", "namespaced": True,
                      "kind": "Pod", "verbs": ["get", "patch"]},)
    backend = {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        {"name": "pods", "singularName": "pod", "namespaced": True, "kind": "Pod",
         "verbs": ["get", "list"], "storageVersionHash": "xPOwRZ+Yhw8="},
        {"name": "pods/status", "singularName": "", "namespaced": True, "kind": "Pod",
         "verbs": ["get", "patch"]}]}
    body = merge_resource_list(json.dumps(backend).encode(), extra, "v1")
    assert [r["name"] for r in json.loads(body)["resources"]] == \
        ["pods", "pods/resize", "pods/status"]


@pytest.mark.parametrize(("body", "why"), [
    (b"not json", "not JSON"),
    (b'{"kind":"Status","code":403}', "a refusal"),
    (b'{"kind":"APIResourceList","groupVersion":"apps/v1","resources":[]}', "another GV"),
    (b'{"kind":"APIResourceList","groupVersion":"v1","resources":{}}', "resources not a list"),
    (b'{"kind":"APIResourceList","groupVersion":"v1","resources":[1]}', "an entry not an object"),
])
def test_what_is_not_the_resource_list_is_left_alone(body: bytes, why: str) -> None:
    from mvproxy.discovery import merge_resource_list

    extra = [{"name": "pods/resize", "kind": "Pod"}]
    assert merge_resource_list(body, extra, "v1") is None, why


def test_an_unsorted_list_gets_extras_at_the_end_and_duplicates_are_not_added() -> None:
    from mvproxy.discovery import merge_resource_list

    backend = {"kind": "APIResourceList", "groupVersion": "x.example/v1", "resources": [
        {"name": "zebras"}, {"name": "apples"}]}
    raw = json.dumps(backend).encode()
    body = merge_resource_list(raw, [{"name": "apples"}, {"name": "mangos"}], "x.example/v1")
    assert [r["name"] for r in json.loads(body)["resources"]] == ["zebras", "apples", "mangos"]
    assert merge_resource_list(raw, [{"name": "apples"}], "x.example/v1") is raw
