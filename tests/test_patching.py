"""The patch algorithms of the simulated API server: RFC 7386, RFC 6902, strategic merge."""

from __future__ import annotations

import pytest

from mvproxy.devcluster.patching import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)

# --- RFC 7386: the examples of its appendix A --------------------------------------------

RFC7386_CASES = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize(("target", "patch", "expected"), RFC7386_CASES)
def test_merge_patch_rfc7386_examples(target, patch, expected):
    assert merge_patch(target, patch) == expected


def test_merge_patch_does_not_mutate_its_inputs():
    target, patch = {"a": {"b": 1}}, {"a": {"c": 2}}
    merge_patch(target, patch)
    assert target == {"a": {"b": 1}} and patch == {"a": {"c": 2}}


# --- RFC 6902 -------------------------------------------------------------------------


def test_json_patch_add_remove_replace():
    doc = {"spec": {"replicas": 1, "list": ["a", "c"]}, "x": 1}
    ops = [
        {"op": "replace", "path": "/spec/replicas", "value": 3},
        {"op": "add", "path": "/spec/list/1", "value": "b"},
        {"op": "add", "path": "/spec/list/-", "value": "d"},
        {"op": "remove", "path": "/x"},
        {"op": "add", "path": "/metadata", "value": {"labels": {"k": "v"}}},
    ]
    assert json_patch(doc, ops) == {
        "spec": {"replicas": 3, "list": ["a", "b", "c", "d"]},
        "metadata": {"labels": {"k": "v"}},
    }
    assert doc["x"] == 1  # input untouched


def test_json_patch_move_copy_test_and_escapes():
    doc = {"a/b": 1, "m~n": 2, "arr": [1, 2]}
    ops = [
        {"op": "test", "path": "/a~1b", "value": 1},
        {"op": "copy", "from": "/m~0n", "path": "/copied"},
        {"op": "move", "from": "/arr/0", "path": "/first"},
    ]
    assert json_patch(doc, ops) == {"a/b": 1, "m~n": 2, "arr": [2], "copied": 2, "first": 1}


def test_json_patch_replace_array_element_and_whole_document():
    assert json_patch({"a": [1, 2, 3]}, [{"op": "replace", "path": "/a/1", "value": 9}]) == {
        "a": [1, 9, 3]}
    assert json_patch({"a": 1}, [{"op": "replace", "path": "", "value": {"b": 2}}]) == {"b": 2}


@pytest.mark.parametrize("ops", [
    [{"op": "test", "path": "/a", "value": 2}],
    [{"op": "remove", "path": "/missing"}],
    [{"op": "replace", "path": "/missing", "value": 1}],
    [{"op": "add", "path": "/arr/5", "value": 1}],
    [{"op": "add", "path": "/arr/01", "value": 1}],
    [{"op": "add", "path": "no-slash", "value": 1}],
    [{"op": "add", "path": "/x"}],
    [{"op": "frobnicate", "path": "/a"}],
    [{"op": "move", "from": "/obj", "path": "/obj/inner"}],
    [{"op": "copy", "path": "/b"}],
    {"op": "add"},
    ["not an object"],
])
def test_json_patch_errors(ops):
    with pytest.raises(PatchError):
        json_patch({"a": 1, "arr": [], "obj": {}}, ops)


def test_json_patch_is_atomic():
    doc = {"a": 1}
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "replace", "path": "/a", "value": 2},
                         {"op": "test", "path": "/a", "value": 1}])
    assert doc == {"a": 1}


# --- strategic merge (simplified) -------------------------------------------------------

DEPLOYMENT = {"spec": {"template": {"spec": {"containers": [
    {"name": "web", "image": "nginx:1.24", "ports": [{"containerPort": 80}]},
    {"name": "sidecar", "image": "envoy"},
]}}}}


def test_strategic_merge_merges_lists_by_name_and_drops_directives():
    patch = {"spec": {"template": {"spec": {
        "$setElementOrder/containers": [{"name": "web"}, {"name": "sidecar"}],
        "containers": [{"name": "web", "image": "nginx:1.25"}],
    }}}}
    result = strategic_merge_patch(DEPLOYMENT, patch)
    containers = result["spec"]["template"]["spec"]["containers"]
    assert containers[0] == {"name": "web", "image": "nginx:1.25", "ports": [{"containerPort": 80}]}
    assert containers[1] == {"name": "sidecar", "image": "envoy"}
    assert "$setElementOrder/containers" not in result["spec"]["template"]["spec"]


def test_strategic_merge_delete_and_replace_directives():
    patch = {"spec": {"template": {"spec": {"containers": [
        {"name": "sidecar", "$patch": "delete"},
        {"name": "new", "image": "busybox"},
    ]}}}, "meta": {"$patch": "replace", "only": 1}}
    result = strategic_merge_patch({**DEPLOYMENT, "meta": {"a": 1}}, patch)
    names = [c["name"] for c in result["spec"]["template"]["spec"]["containers"]]
    assert names == ["web", "new"]
    assert result["meta"] == {"only": 1}


def test_strategic_merge_primitive_lists_replace_and_delete_from_list():
    target = {"args": ["a", "b"], "finalizers": ["x", "y", "z"]}
    patch = {"args": ["c"], "$deleteFromPrimitiveList/finalizers": ["y"]}
    assert strategic_merge_patch(target, patch) == {"args": ["c"], "finalizers": ["x", "z"]}


def test_strategic_merge_null_deletes_like_merge_patch():
    assert strategic_merge_patch({"a": 1, "b": {"c": 2}}, {"a": None, "b": {"c": None}}) == {
        "b": {}}
