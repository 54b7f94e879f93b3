"""Discovery merge: upstream's peer-aggregated rules, checked on fixtures and real releases."""

from __future__ import annotations

import functools
import itertools
import json

import pytest

from mvproxy.devcluster import catalog, discoverydocs
from mvproxy.discovery import (
    Snapshot,
    group_name,
    merge,
    merge_preserving_relative_order,
    parse_aggregated,
    render_aggregated,
    render_api_group_list,
)

MAX_BYTES = 1 << 20


# --------------------------------------------------------------------------- builders

def res(name: str, verbs=("get", "list"), subs=(), **extra) -> dict:
    doc = {"resource": name, "responseKind": {"group": "", "version": "", "kind": "K"},
           "scope": "Namespaced", "singularResource": name, "verbs": list(verbs), **extra}
    if subs:
        doc["subresources"] = [s if isinstance(s, dict) else {"subresource": s, "verbs": ["get"]}
                               for s in subs]
    return doc


def ver(name: str, *resources: dict, freshness: str = "Current") -> dict:
    return {"version": name, "resources": list(resources), "freshness": freshness}


def grp(name: str, *versions: dict, uid: str = "") -> dict:
    return {"metadata": {"name": name, **({"uid": uid} if uid else {})}, "versions": list(versions)}


def snap(*groups: dict, core=()) -> Snapshot:
    return Snapshot(core=tuple(core), groups=groups)


def merged_groups(**servers: Snapshot) -> list[dict]:
    return list(merge(servers).groups)


G1 = grp("g1", ver("v1", res("r1")), uid="g1-uid")
G2 = grp("g2", ver("v1", res("r1")), uid="g2-uid")


# --------------------------------------------------------------------------- upstream fixtures

UPSTREAM_CASES = [
    pytest.param(
        {"serverA": [G1], "serverB": [grp("g1", ver("v1", res("r2")), uid="g1-peer-uid")]},
        [grp("g1", ver("v1", res("r1"), res("r2")), uid="g1-uid")],
        id="a peer's new resource joins the existing version; metadata from the lowest ID"),
    pytest.param(
        {"serverA": [G1], "serverB": [grp("g1", ver("v2", res("r1")), uid="g1-peer-uid")]},
        [grp("g1", ver("v1", res("r1")), ver("v2", res("r1")), uid="g1-uid")],
        id="a peer's new version joins the existing group"),
    pytest.param(
        {"serverA": [G1], "serverB": [G2]}, [G1, G2],
        id="a peer's new group is added"),
    pytest.param(
        {"serverA": [G1, G2], "serverB": [G2, G1]}, [G1, G2],
        id="same groups in another order: the lowest ID's complete order wins"),
    pytest.param(
        {"serverB": [G2], "serverA": [G1]}, [G1, G2],
        id="server B's view equals server A's view"),
    pytest.param(
        {"serverA": [grp("g1", ver("v1", res("pods", ("get", "list"))), uid="a")],
         "serverB": [grp("g1", ver("v1", res("pods", ("get", "watch"))), uid="b")]},
        [grp("g1", ver("v1", res("pods", ("get", "list", "watch"))), uid="a")],
        id="verbs of differing copies are unioned and sorted"),
    pytest.param(
        {"serverA": [grp("g1", ver("v1", res("pods", subs=["status"])), uid="a")],
         "serverB": [grp("g1", ver("v1", res("pods", subs=["log"])), uid="b")]},
        [grp("g1", ver("v1", res("pods", subs=["log", "status"])), uid="a")],
        id="subresources of differing copies are unioned and sorted by name"),
    pytest.param(
        {"serverA": [], "serverB": [G1]}, [G1],
        id="an empty server contributes nothing"),
]


@pytest.mark.parametrize(("servers", "expected"), UPSTREAM_CASES)
def test_upstream_fixture(servers, expected):
    snapshots = {server_id: snap(*groups) for server_id, groups in servers.items()}
    assert list(merge(snapshots).groups) == expected


def test_identical_servers_merge_to_the_same_objects():
    a, b = snap(G1, G2), snap(dict(G1), dict(G2))
    result = merge({"a": a, "b": b})
    assert result == a
    assert all(m is g for m, g in zip(result.groups, a.groups, strict=True))


def test_a_single_server_is_returned_unchanged():
    only = snap(G1, G2)
    assert merge({"a": only}).groups == only.groups


def test_no_servers_merge_to_an_empty_snapshot():
    assert merge({}) == Snapshot()


def test_attributes_other_than_capabilities_come_from_the_lowest_server_id():
    a = snap(grp("g", ver("v1", res("things", ("get",), shortNames=["a"], scope="Cluster")),
                 uid="a"))
    b = snap(grp("g", ver("v1", res("things", ("list",), shortNames=["b"])), uid="b"))
    (thing,) = merge({"server-b": b, "server-a": a}).groups[0]["versions"][0]["resources"]
    assert thing["shortNames"] == ["a"]
    assert thing["scope"] == "Cluster"
    assert thing["verbs"] == ["get", "list"]


def test_a_duplicate_subresource_takes_the_later_servers_copy():
    old = {"subresource": "status", "verbs": ["get"]}
    new = {"subresource": "status", "verbs": ["get", "patch"]}
    a = snap(grp("g", ver("v1", res("things", ("get",), subs=[old]))))
    b = snap(grp("g", ver("v1", res("things", ("list",), subs=[new, "scale"]))))
    (thing,) = merge({"a": a, "b": b}).groups[0]["versions"][0]["resources"]
    assert thing["subresources"] == [{"subresource": "scale", "verbs": ["get"]}, new]


def test_identical_copies_keep_their_verb_order():
    pods = res("pods", ("list", "get", "watch"))
    merged = merge({"a": snap(grp("g", ver("v1", pods))), "b": snap(grp("g", ver("v1", pods)))})
    assert merged.groups[0]["versions"][0]["resources"][0]["verbs"] == ["list", "get", "watch"]


def test_versions_are_folded_server_by_server_as_upstream_does():
    # Upstream merges the accumulated version order with the next server's, one server at
    # a time: a=[v1] + b=[v2] gives [v1, v2]; then + c=[v3, v1] gives [v3, v1, v2].
    # (One sort over all three lists would give [v2, v3, v1].)
    servers = {"a": snap(grp("g", ver("v1"))), "b": snap(grp("g", ver("v2"))),
               "c": snap(grp("g", ver("v3"), ver("v1")))}
    versions = merge(servers).groups[0]["versions"]
    assert [v["version"] for v in versions] == ["v3", "v1", "v2"]


def test_groups_are_ordered_over_all_servers_at_once():
    servers = {"a": snap(grp("g1")), "b": snap(grp("g2")), "c": snap(grp("g3"), grp("g1"))}
    assert [group_name(g) for g in merge(servers).groups] == ["g2", "g3", "g1"]


def test_core_is_merged_too():
    old = snap(core=[grp("", ver("v1", res("pods", subs=["status"])))])
    new = snap(core=[grp("", ver("v1", res("pods", subs=["resize", "status"])))])
    merged = merge({"old": old, "new": new})
    assert merged.serves("", "v1", "pods", "resize")
    assert merged.groups == ()


def test_merging_does_not_modify_its_inputs():
    a = snap(grp("g", ver("v1", res("pods", ("get",), subs=["status"]))))
    b = snap(grp("g", ver("v1", res("pods", ("list",), subs=["log"])), ver("v2")))
    before = json.dumps([a.groups, b.groups])
    merge({"a": a, "b": b}, stale={"b"})
    assert json.dumps([a.groups, b.groups]) == before


# --------------------------------------------------------------------------- freshness

def freshness(result: Snapshot, group: str, version: str) -> str | None:
    (entry,) = [v for g in (*result.core, *result.groups) if group_name(g) == group
                for v in g["versions"] if v["version"] == version]
    return entry.get("freshness")


def test_a_version_only_on_unreachable_servers_is_stale():
    result = merge({"a": snap(G1), "b": snap(G2)}, stale={"b"})
    assert freshness(result, "g2", "v1") == "Stale"
    assert freshness(result, "g1", "v1") == "Current"
    assert result.serves("g2", "v1", "r1")


def test_a_version_also_on_a_reachable_server_is_current():
    result = merge({"a-down": snap(G1), "b-up": snap(G1)}, stale={"a-down"})
    assert freshness(result, "g1", "v1") == "Current"


def test_a_peers_stale_never_overrides_a_reachable_current():
    # Upstream takes freshness from the lowest server ID (peer_aggregated_handler.go in
    # kubernetes/kubernetes staging/src/k8s.io/apiserver/pkg/endpoints/discovery/aggregated/).
    stale_copy = grp("g1", ver("v1", res("r1"), freshness="Stale"), uid="g1-uid")
    result = merge({"a-peer": snap(stale_copy), "b-backend": snap(G1)})
    assert freshness(result, "g1", "v1") == "Current"


def test_a_version_its_only_server_reports_stale_stays_stale():
    stale_copy = grp("g1", ver("v1", res("r1"), freshness="Stale"))
    result = merge({"a": snap(stale_copy), "b": snap(G2)})
    assert freshness(result, "g1", "v1") == "Stale"


def test_an_unreachable_core_only_version_is_stale():
    core_v2 = grp("", ver("v1", res("pods")), ver("v2", res("pods")))
    result = merge({"a": snap(core=[grp("", ver("v1", res("pods")))]),
                    "b": snap(core=[core_v2])}, stale={"b"})
    assert freshness(result, "", "v1") == "Current"
    assert freshness(result, "", "v2") == "Stale"


def test_stale_ids_that_are_not_servers_change_nothing():
    only = snap(G1)
    assert merge({"a": only}, stale={"zzz"}) == only


def test_legacy_preferred_version_skips_stale_versions():
    servers = {"a": snap(grp("g", ver("v1", res("r")))),
               "b": snap(grp("g", ver("v2", res("r")), ver("v1", res("r"))))}
    (group,) = json.loads(render_api_group_list(merge(servers, stale={"b"}).groups))["groups"]
    assert [v["version"] for v in group["versions"]] == ["v2", "v1"]
    assert group["preferredVersion"] == {"groupVersion": "g/v1", "version": "v1"}


# --------------------------------------------------------------------------- relative order

@pytest.mark.parametrize(("lists", "expected"), [
    pytest.param([], [], id="no lists give nothing"),
    pytest.param([[], []], [], id="empty lists give nothing"),
    pytest.param([["a", "b", "c"], ["b", "c"]], ["a", "b", "c"],
                 id="shortcut: a complete list is returned as is"),
    pytest.param([["c", "a", "b"], ["a", "b", "c"]], ["c", "a", "b"],
                 id="shortcut: the first complete list wins over a later one"),
    pytest.param([["b", "a"], ["a", "b"]], ["b", "a"],
                 id="shortcut comes before cycle detection"),
    pytest.param([["b", "a"], ["c", "a", "d"]], ["b", "c", "a", "d"],
                 id="topological: every list's relative order is kept"),
    pytest.param([["a", "c"], ["b", "c"]], ["a", "b", "c"],
                 id="tie-break: unordered items come lexicographically"),
    pytest.param([["b", "d"], ["a", "c"]], ["a", "b", "c", "d"],
                 id="tie-break: the smallest ready item goes first at every step"),
    pytest.param([["z", "y"], ["y", "z"], ["x"]], ["x", "y", "z"],
                 id="cycle: falls back to lexicographic order"),
    pytest.param([["a", "a"]], ["a"], id="a duplicate inside one list is a cycle"),
])
def test_merge_preserving_relative_order(lists, expected):
    assert merge_preserving_relative_order(lists) == expected


def test_merge_preserving_relative_order_copies_the_shortcut_list():
    source = ["a", "b"]
    result = merge_preserving_relative_order([source])
    assert result == source and result is not source


def test_merge_preserving_relative_order_scales():
    # 40k interleaved items: a quadratic algorithm would not finish in the test timeout.
    evens = [f"k{i:06d}" for i in range(0, 40_000, 2)]
    odds = [f"k{i:06d}" for i in range(1, 40_000, 2)][::-1]
    result = merge_preserving_relative_order([evens, odds])
    assert len(result) == 40_000
    wanted = set(evens)
    assert [x for x in result if x in wanted] == evens


# --------------------------------------------------------------------------- real releases

RELEASES = catalog.available_versions()
PAIRS = list(itertools.combinations(RELEASES, 2))


def _body(doc: dict) -> bytes:
    return json.dumps(doc).encode()


@functools.cache
def release(version: str) -> Snapshot:
    release_catalog = catalog.load_catalog(version)
    return Snapshot(
        parse_aggregated(_body(discoverydocs.aggregated(release_catalog, core=True)),
                         max_bytes=MAX_BYTES),
        parse_aggregated(_body(discoverydocs.aggregated(release_catalog, core=False)),
                         max_bytes=MAX_BYTES))


@functools.cache
def merged_pair(old: str, new: str) -> Snapshot:
    return merge({f"apiserver-{old}": release(old), f"apiserver-{new}": release(new)})


def _agreed_pairs(lists: list[list[str]]) -> set[tuple[str, str]]:
    """(x, y) where x precedes y in every list that holds both, and some list does."""
    before: dict[tuple[str, str], bool] = {}
    for items in lists:
        for x, y in itertools.combinations(items, 2):
            before[(x, y)] = before.get((x, y), True)
            before[(y, x)] = False
    return {pair for pair, agreed in before.items() if agreed}


def assert_keeps_agreed_order(merged: list[str], inputs: list[list[str]], where: str) -> None:
    position = {item: i for i, item in enumerate(merged)}
    broken = [p for p in _agreed_pairs(inputs) if position[p[0]] > position[p[1]]]
    assert not broken, f"{where}: order of {sorted(broken)[:3]} not kept"


def _names(groups) -> list[str]:
    return [group_name(g) for g in groups]


def _version_lists(snapshots, group: str) -> list[list[str]]:
    return [[v["version"] for v in g["versions"]] for s in snapshots
            for g in (*s.core, *s.groups) if group_name(g) == group]


def _resource_lists(snapshots, group: str, version: str) -> list[list[str]]:
    return [[r["resource"] for r in v.get("resources", [])] for s in snapshots
            for g in (*s.core, *s.groups) if group_name(g) == group
            for v in g["versions"] if v["version"] == version]


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_release_pair_serves_exactly_the_union(old, new):
    merged, a, b = merged_pair(old, new), release(old), release(new)
    assert merged.group_versions == a.group_versions | b.group_versions
    assert merged.gvrs == a.gvrs | b.gvrs
    assert merged.subresources == a.subresources | b.subresources


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_release_pair_keeps_every_order_both_servers_agree_on(old, new):
    merged, inputs = merged_pair(old, new), (release(old), release(new))
    assert_keeps_agreed_order(_names(merged.groups), [_names(s.groups) for s in inputs], "groups")
    for group in (*merged.core, *merged.groups):
        name = group_name(group)
        versions = [v["version"] for v in group["versions"]]
        assert_keeps_agreed_order(versions, _version_lists(inputs, name), name)
        for version in group["versions"]:
            resources = [r["resource"] for r in version["resources"]]
            assert_keeps_agreed_order(resources, _resource_lists(inputs, name, version["version"]),
                                      f"{name}/{version['version']}")


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_release_pair_merge_is_a_function_of_the_map(old, new):
    # Each mvproxy builds the map from its own point of view; the documents must agree.
    seen_from_old = merge({"apiserver-a": release(old), "apiserver-b": release(new)})
    seen_from_new = merge({"apiserver-b": release(new), "apiserver-a": release(old)})
    assert render_aggregated(seen_from_old.groups) == render_aggregated(seen_from_new.groups)
    assert seen_from_old.core == seen_from_new.core


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_release_pair_document_parses_back(old, new):
    merged = merged_pair(old, new)
    assert parse_aggregated(render_aggregated(merged.groups), max_bytes=MAX_BYTES) == merged.groups
    assert parse_aggregated(render_aggregated(merged.core), max_bytes=MAX_BYTES) == merged.core


@pytest.mark.parametrize("version", RELEASES)
def test_release_merged_with_itself_is_unchanged(version):
    snapshot = release(version)
    merged = merge({"apiserver-a": snapshot, "apiserver-b": snapshot})
    assert merged == snapshot
    assert render_aggregated(merged.groups) == render_aggregated(snapshot.groups)


def test_all_releases_merged_serve_everything_any_of_them_serves():
    merged = merge({f"apiserver-{v}": release(v) for v in RELEASES})
    assert merged.gvrs == frozenset().union(*(release(v).gvrs for v in RELEASES))
    assert merged.serves("lifecycle.k8s.io", "v1alpha1", "evictionrequests")
    assert merged.serves("networking.k8s.io", "v1beta1", "ipaddresses")  # gone in 1.37


def test_release_pair_with_an_unreachable_newer_server_marks_only_its_versions_stale():
    merged = merge({"apiserver-a": release("1.36"), "apiserver-b": release("1.37")},
                   stale={"apiserver-b"})
    stale = {(group_name(g), v["version"]) for g in merged.groups for v in g["versions"]
             if v["freshness"] == "Stale"}
    assert stale == release("1.37").group_versions - release("1.36").group_versions
    assert ("lifecycle.k8s.io", "v1alpha1") in stale


def test_release_pair_with_competing_alpha_versions_orders_them_lexicographically():
    # 1.35 lists scheduling [v1, v1alpha1], 1.36 [v1, v1alpha2]: nothing orders the two
    # alphas, so upstream's tie-break decides; v1 stays preferred.
    (scheduling,) = [g for g in merged_pair("1.35", "1.36").groups
                     if group_name(g) == "scheduling.k8s.io"]
    assert [v["version"] for v in scheduling["versions"]] == ["v1", "v1alpha1", "v1alpha2"]
