"""Resources of the simulated kube-apiserver: CRUD, errors, lists, watch, subresources.

In process over plain HTTP (aiohttp's test client); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.simserver import build_app
from mvproxy.devcluster.store import Store

TABLE = ("application/json;as=Table;v=v1;g=meta.k8s.io,"
         "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json")
PODS = "/api/v1/namespaces/default/pods"
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
STEP = 5.0  # upper bound for any single wait on a stream


def pod(name, **labels):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}


def deployment(name, replicas=1):
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}}


async def call(client, method, path, body=None, *, status=200, ctype="application/json",
               accept=None):
    headers = {"Accept": accept} if accept else {}
    data = None
    if body is not None:
        data = body if isinstance(body, str) else json.dumps(body)
        headers["Content-Type"] = ctype
    response = await client.request(method, path, data=data, headers=headers)
    text = await response.text()
    assert response.status == status, text
    return json.loads(text) if text else None


def assert_status(doc, code, reason):
    assert doc["kind"] == "Status" and doc["status"] == "Failure"
    assert (doc["code"], doc["reason"]) == (code, reason)


# --- create / get / update / delete -------------------------------------------------


async def test_pod_lifecycle(client):
    created = await call(client, "POST", PODS, pod("web", app="web"), status=201)
    meta = created["metadata"]
    assert (created["kind"], created["apiVersion"]) == ("Pod", "v1")
    assert meta["namespace"] == "default" and meta["uid"] and meta["creationTimestamp"]
    assert created["status"]["phase"] == "Running"
    got = await call(client, "GET", f"{PODS}/web")
    assert got == created
    got["metadata"]["labels"]["tier"] = "front"
    updated = await call(client, "PUT", f"{PODS}/web", got)
    assert int(updated["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert updated["metadata"]["uid"] == meta["uid"]
    deleted = await call(client, "DELETE", f"{PODS}/web", {"propagationPolicy": "Background"})
    assert deleted["metadata"]["name"] == "web"
    assert_status(await call(client, "GET", f"{PODS}/web", status=404), 404, "NotFound")


async def test_deployment_in_named_group(client):
    created = await call(client, "POST", DEPLOYMENTS, deployment("api"), status=201)
    assert (created["kind"], created["apiVersion"]) == ("Deployment", "apps/v1")
    assert created["metadata"]["generation"] == 1
    created["spec"]["replicas"] = 2
    updated = await call(client, "PUT", f"{DEPLOYMENTS}/api", created)
    assert updated["metadata"]["generation"] == 2


async def test_cluster_scoped_resources(client):
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": "reader"}, "rules": []}
    path = "/apis/rbac.authorization.k8s.io/v1/clusterroles"
    created = await call(client, "POST", path, role, status=201)
    assert "namespace" not in created["metadata"]
    assert (await call(client, "GET", f"{path}/reader"))["kind"] == "ClusterRole"
    # A cluster-scoped resource under a namespace does not exist.
    await call(client, "GET", "/apis/rbac.authorization.k8s.io/v1/namespaces/default/"
                              "clusterroles/reader", status=404)


async def test_system_namespaces_exist_and_namespaces_work(client):
    names = [n["metadata"]["name"] for n in (await call(client, "GET",
                                                        "/api/v1/namespaces"))["items"]]
    assert {"default", "kube-system", "kube-public"} <= set(names)
    ns = await call(client, "POST", "/api/v1/namespaces",
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}},
                    status=201)
    assert ns["status"]["phase"] == "Active"
    assert (await call(client, "GET", "/api/v1/namespaces/team"))["metadata"]["name"] == "team"
    await call(client, "POST", "/api/v1/namespaces/team/configmaps",
               {"metadata": {"name": "cm"}, "data": {"a": "b"}}, status=201)
    await call(client, "DELETE", "/api/v1/namespaces/team")
    # Deleting a namespace deletes what was in it.
    await call(client, "GET", "/api/v1/namespaces/team/configmaps/cm", status=404)


async def test_generate_name_and_missing_kind_defaults(client):
    created = await call(client, "POST", "/api/v1/namespaces/default/configmaps",
                         {"metadata": {"generateName": "cfg-"}}, status=201)
    assert created["metadata"]["name"].startswith("cfg-") and len(created["metadata"]["name"]) == 9
    assert created["kind"] == "ConfigMap"


async def test_yaml_body(client):
    body = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: y\ndata:\n  k: v\n"
    created = await call(client, "POST", "/api/v1/namespaces/default/configmaps", body,
                         status=201, ctype="application/yaml")
    assert created["data"] == {"k": "v"}


async def test_dry_run_stores_nothing(client):
    await call(client, "POST", f"{PODS}?dryRun=All", pod("ghost"), status=201)
    await call(client, "GET", f"{PODS}/ghost", status=404)


# --- errors ----------------------------------------------------------------------------


async def test_not_found_messages(client):
    doc = await call(client, "GET", f"{PODS}/missing", status=404)
    assert_status(doc, 404, "NotFound")
    assert doc["message"] == 'pods "missing" not found'
    assert doc["details"] == {"name": "missing", "kind": "pods"}
    doc = await call(client, "GET", f"{DEPLOYMENTS}/missing", status=404)
    assert doc["message"] == 'deployments.apps "missing" not found'
    assert doc["details"] == {"name": "missing", "group": "apps", "kind": "deployments"}


@pytest.mark.parametrize("path", [
    "/apis/apps/v1/namespaces/default/widgets",
    "/apis/apps/v9/namespaces/default/deployments",
    "/api/v1/pods/x",  # namespaced object without its namespace
    "/api/v1/namespaces/default/pods/x/nosuchsub",
    "/api/v1/watch",
])
async def test_unknown_resource_paths(client, path):
    """In a group the server has: its JSON 404 (an unknown group has no handler at all:
    Go's plain-text 404, see test_sim_parity_fixes)."""
    doc = await call(client, "GET", path, status=404)
    assert_status(doc, 404, "NotFound")
    assert doc["message"] == "the server could not find the requested resource"


async def test_already_exists(client):
    await call(client, "POST", PODS, pod("dup"), status=201)
    doc = await call(client, "POST", PODS, pod("dup"), status=409)
    assert_status(doc, 409, "AlreadyExists")
    assert doc["message"] == 'pods "dup" already exists'


async def test_conflict_on_stale_resource_version(client):
    created = await call(client, "POST", DEPLOYMENTS, deployment("c"), status=201)
    await call(client, "PUT", f"{DEPLOYMENTS}/c", created)
    doc = await call(client, "PUT", f"{DEPLOYMENTS}/c", created, status=409)
    assert_status(doc, 409, "Conflict")
    assert doc["message"] == (
        'Operation cannot be fulfilled on deployments.apps "c": the object has been '
        "modified; please apply your changes to the latest version and try again")


async def test_delete_precondition_conflict(client):
    await call(client, "POST", PODS, pod("pre"), status=201)
    doc = await call(client, "DELETE", f"{PODS}/pre",
                     {"preconditions": {"resourceVersion": "1"}}, status=409)
    assert_status(doc, 409, "Conflict")


@pytest.mark.parametrize(("body", "fragment"), [
    ({**pod("x"), "kind": "Service"}, "cannot be handled as a Pod"),
    ({**pod("x"), "apiVersion": "apps/v1"}, "does not match the expected API version"),
    ({**pod("x"), "metadata": {"name": "x", "namespace": "other"}}, "namespace"),
])
async def test_bad_request_bodies(client, body, fragment):
    doc = await call(client, "POST", PODS, body, status=400)
    assert_status(doc, 400, "BadRequest")
    assert fragment in doc["message"]


async def test_name_mismatch_on_update(client):
    await call(client, "POST", PODS, pod("a"), status=201)
    doc = await call(client, "PUT", f"{PODS}/a", pod("b"), status=400)
    assert doc["message"] == "the name of the object (b) does not match the name on the URL (a)"


async def test_invalid_names(client):
    doc = await call(client, "POST", PODS, pod("Not_Valid"), status=422)
    assert_status(doc, 422, "Invalid")
    doc = await call(client, "POST", PODS, {"metadata": {}}, status=422)
    assert "name or generateName is required" in doc["message"]


async def test_missing_namespace_is_404(client):
    doc = await call(client, "POST", "/api/v1/namespaces/nowhere/pods", pod("p"), status=404)
    assert doc["message"] == 'namespaces "nowhere" not found'


@pytest.mark.parametrize(("method", "path"), [
    ("DELETE", "/api/v1/namespaces"),            # namespaces have no deletecollection
    ("POST", "/api/v1/componentstatuses"),       # read-only resource
    ("POST", "/api/v1/pods"),                    # create needs a namespace
    ("PUT", PODS),                               # update needs a name
    ("POST", f"{PODS}/x/log"),
])
async def test_method_not_allowed(client, method, path):
    doc = await call(client, method, path, {"metadata": {"name": "x"}}, status=405)
    assert_status(doc, 405, "MethodNotAllowed")


async def test_unsupported_body_type(client):
    response = await client.post(PODS, data=b"\x00", headers={
        "Content-Type": "application/vnd.kubernetes.protobuf"})
    assert response.status == 415
    assert (await response.json())["reason"] == "UnsupportedMediaType"


async def test_malformed_json_is_400(client):
    doc = await call(client, "POST", PODS, "{not json", status=400)
    assert_status(doc, 400, "BadRequest")


# --- list ------------------------------------------------------------------------------


async def test_list_paging_and_list_metadata(client):
    for i in range(5):
        await call(client, "POST", PODS, pod(f"p{i}"), status=201)
    first = await call(client, "GET", f"{PODS}?limit=2")
    assert (first["kind"], first["apiVersion"]) == ("PodList", "v1")
    assert [p["metadata"]["name"] for p in first["items"]] == ["p0", "p1"]
    assert first["metadata"]["resourceVersion"] and first["metadata"]["continue"]
    names = [p["metadata"]["name"] for p in first["items"]]
    token = first["metadata"]["continue"]
    while token:
        page = await call(client, "GET", f"{PODS}?limit=2&continue={token}")
        names += [p["metadata"]["name"] for p in page["items"]]
        token = page["metadata"].get("continue")
    assert names == [f"p{i}" for i in range(5)]
    await call(client, "GET", f"{PODS}?continue=garbage", status=400)
    await call(client, "GET", f"{PODS}?limit=many", status=400)


async def test_list_selectors_and_all_namespaces(client):
    await call(client, "POST", "/api/v1/namespaces",
               {"metadata": {"name": "other"}}, status=201)
    await call(client, "POST", PODS, pod("a", app="x"), status=201)
    await call(client, "POST", PODS, pod("b", app="y"), status=201)
    await call(client, "POST", "/api/v1/namespaces/other/pods", pod("c", app="x"), status=201)
    by_label = await call(client, "GET", f"{PODS}?labelSelector=app%3Dx")
    assert [p["metadata"]["name"] for p in by_label["items"]] == ["a"]
    every = await call(client, "GET", "/api/v1/pods?labelSelector=app%3Dx")
    assert [p["metadata"]["namespace"] for p in every["items"]] == ["default", "other"]
    by_name = await call(client, "GET", "/api/v1/pods?fieldSelector=metadata.name%3Db")
    assert [p["metadata"]["name"] for p in by_name["items"]] == ["b"]
    by_ns = await call(client, "GET", "/api/v1/pods?fieldSelector=metadata.namespace%3Dother")
    assert [p["metadata"]["name"] for p in by_ns["items"]] == ["c"]
    doc = await call(client, "GET", f"{PODS}?fieldSelector=spec.nodeNam%3Dn", status=400)
    assert_status(doc, 400, "BadRequest")
    await call(client, "GET", f"{PODS}?labelSelector=%3D%3Dbad", status=400)


async def test_deletecollection(client):
    await call(client, "POST", PODS, pod("a", app="x"), status=201)
    await call(client, "POST", PODS, pod("b", app="y"), status=201)
    deleted = await call(client, "DELETE", f"{PODS}?labelSelector=app%3Dx")
    assert deleted["kind"] == "PodList"
    assert [p["metadata"]["name"] for p in deleted["items"]] == ["a"]
    left = await call(client, "GET", PODS)
    assert [p["metadata"]["name"] for p in left["items"]] == ["b"]


# --- Table -----------------------------------------------------------------------------


async def test_table_list_like_kubectl_get(client):
    await call(client, "POST", PODS, pod("web"), status=201)
    response = await client.get(f"{PODS}?limit=500", headers={"Accept": TABLE})
    assert response.headers["Content-Type"] == "application/json"
    doc = await response.json()
    assert (doc["kind"], doc["apiVersion"]) == ("Table", "meta.k8s.io/v1")
    assert [c["name"] for c in doc["columnDefinitions"]] == [
        "Name", "Ready", "Status", "Restarts", "Age", "IP", "Node", "Nominated Node",
        "Readiness Gates"]
    assert doc["metadata"]["resourceVersion"]
    (row,) = doc["rows"]
    assert row["cells"][0] == "web" and row["cells"][2] == "Running"
    assert row["cells"][4].endswith("s")
    assert row["object"]["kind"] == "PartialObjectMetadata"
    assert row["object"]["metadata"]["namespace"] == "default"


@pytest.mark.parametrize(("include", "expected"), [
    ("Object", "Pod"), ("Metadata", "PartialObjectMetadata"), ("None", None)])
async def test_table_include_object(client, include, expected):
    await call(client, "POST", PODS, pod("web"), status=201)
    doc = await call(client, "GET", f"{PODS}/web?includeObject={include}", accept=TABLE)
    obj = doc["rows"][0]["object"]
    assert (obj["kind"] if obj else None) == expected
    await call(client, "GET", f"{PODS}?includeObject=Everything", accept=TABLE, status=400)


async def test_table_v1beta1_and_partial_metadata_list(client):
    await call(client, "POST", PODS, pod("web"), status=201)
    beta = await call(client, "GET", PODS,
                      accept="application/json;as=Table;v=v1beta1;g=meta.k8s.io")
    assert beta["apiVersion"] == "meta.k8s.io/v1beta1"
    partial = await call(client, "GET", PODS, accept=(
        "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io"))
    assert partial["kind"] == "PartialObjectMetadataList"
    assert partial["items"][0]["metadata"]["name"] == "web"
    await call(client, "GET", PODS, accept="application/vnd.kubernetes.protobuf", status=406)


def test_human_duration_like_kubectl():
    from mvproxy.devcluster.tables import human_duration

    assert [human_duration(s) for s in (5, 119, 150, 600, 3 * 3600 + 120, 9 * 3600,
                                        2 * 86400 + 3600, 30 * 86400, 3 * 365 * 86400)] == [
        "5s", "119s", "2m30s", "10m", "3h2m", "9h", "2d1h", "30d", "3y"]


# --- patch -----------------------------------------------------------------------------


async def test_patch_types(client):
    await call(client, "POST", DEPLOYMENTS, deployment("p"), status=201)
    merged = await call(client, "PATCH", f"{DEPLOYMENTS}/p",
                        {"metadata": {"labels": {"a": "1"}}},
                        ctype="application/merge-patch+json")
    assert merged["metadata"]["labels"] == {"a": "1"}
    jp = await call(client, "PATCH", f"{DEPLOYMENTS}/p",
                    [{"op": "replace", "path": "/spec/replicas", "value": 4}],
                    ctype="application/json-patch+json")
    assert jp["spec"]["replicas"] == 4 and jp["metadata"]["generation"] == 2
    smp = await call(client, "PATCH", f"{DEPLOYMENTS}/p", {"spec": {"template": {"spec": {
        "containers": [{"name": "web", "image": "nginx:2"}]}}}},
        ctype="application/strategic-merge-patch+json")
    assert smp["spec"]["template"]["spec"]["containers"] == [{"name": "web", "image": "nginx:2"}]
    failed = await call(client, "PATCH", f"{DEPLOYMENTS}/p",
                        [{"op": "test", "path": "/spec/replicas", "value": 9}],
                        ctype="application/json-patch+json", status=422)
    assert failed["reason"] == "Invalid"
    await call(client, "PATCH", f"{DEPLOYMENTS}/p", {}, ctype="text/plain", status=415)
    await call(client, "PATCH", f"{DEPLOYMENTS}/nope", {}, status=404,
               ctype="application/merge-patch+json")
    renamed = await call(client, "PATCH", f"{DEPLOYMENTS}/p", {"metadata": {"name": "q"}},
                         ctype="application/merge-patch+json", status=400)
    assert_status(renamed, 400, "BadRequest")


async def test_patch_with_stale_resource_version_conflicts(client):
    created = await call(client, "POST", DEPLOYMENTS, deployment("s"), status=201)
    await call(client, "PATCH", f"{DEPLOYMENTS}/s", {"spec": {"replicas": 2}},
               ctype="application/merge-patch+json")
    stale = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]},
             "spec": {"replicas": 3}}
    doc = await call(client, "PATCH", f"{DEPLOYMENTS}/s", stale,
                     ctype="application/merge-patch+json", status=409)
    assert_status(doc, 409, "Conflict")


async def test_server_side_apply_creates_then_merges(client):
    body = ("apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: ssa\n"
            "spec:\n  replicas: 2\n")
    created = await call(client, "PATCH", f"{DEPLOYMENTS}/ssa?fieldManager=kubectl", body,
                         ctype="application/apply-patch+yaml", status=201)
    assert created["spec"]["replicas"] == 2
    again = body.replace("replicas: 2", "replicas: 5")
    updated = await call(client, "PATCH", f"{DEPLOYMENTS}/ssa?fieldManager=kubectl", again,
                         ctype="application/apply-patch+yaml")
    assert updated["spec"]["replicas"] == 5


# --- subresources ----------------------------------------------------------------------


async def test_status_subresource_changes_only_status(client):
    await call(client, "POST", DEPLOYMENTS, deployment("st"), status=201)
    current = await call(client, "GET", f"{DEPLOYMENTS}/st/status")
    current["status"] = {"readyReplicas": 1}
    current["spec"]["replicas"] = 9
    updated = await call(client, "PUT", f"{DEPLOYMENTS}/st/status", current)
    assert updated["status"] == {"readyReplicas": 1}
    assert updated["spec"]["replicas"] == 1 and updated["metadata"]["generation"] == 1
    patched = await call(client, "PATCH", f"{DEPLOYMENTS}/st/status",
                         {"status": {"replicas": 1}, "spec": {"replicas": 7}},
                         ctype="application/merge-patch+json")
    assert patched["status"] == {"readyReplicas": 1, "replicas": 1}
    assert patched["spec"]["replicas"] == 1
    # ...and the main resource ignores .status.
    patched["status"] = {"bogus": True}
    main = await call(client, "PUT", f"{DEPLOYMENTS}/st", patched)
    assert main["status"] == {"readyReplicas": 1, "replicas": 1}


async def test_scale_subresource(client):
    await call(client, "POST", DEPLOYMENTS, deployment("sc", replicas=2), status=201)
    scale = await call(client, "GET", f"{DEPLOYMENTS}/sc/scale")
    assert (scale["kind"], scale["apiVersion"]) == ("Scale", "autoscaling/v1")
    assert scale["spec"] == {"replicas": 2} and scale["status"]["selector"] == "app=sc"
    patched = await call(client, "PATCH", f"{DEPLOYMENTS}/sc/scale", {"spec": {"replicas": 5}},
                         ctype="application/merge-patch+json")
    assert patched["spec"]["replicas"] == 5
    assert (await call(client, "GET", f"{DEPLOYMENTS}/sc"))["spec"]["replicas"] == 5
    patched["spec"]["replicas"] = 1
    put = await call(client, "PUT", f"{DEPLOYMENTS}/sc/scale", patched)
    assert put["spec"]["replicas"] == 1
    bad = await call(client, "PUT", f"{DEPLOYMENTS}/sc/scale", {**put, "kind": "Deployment"},
                     status=400)
    assert_status(bad, 400, "BadRequest")
    await call(client, "GET", f"{PODS}/x/scale", status=404)  # pods have no scale


async def test_exec_needs_an_existing_pod(client):
    doc = await call(client, "GET", f"{PODS}/ghost/exec?command=ls&stdout=true", status=404)
    assert doc["message"] == 'pods "ghost" not found'


# --- watch -----------------------------------------------------------------------------


async def read_event(response):
    line = await asyncio.wait_for(response.content.readline(), STEP)
    assert line, "watch stream ended"
    return json.loads(line)


async def test_watch_from_now_sees_existing_then_new(client):
    await call(client, "POST", PODS, pod("old"), status=201)
    async with client.get(f"{PODS}?watch=true&timeoutSeconds=10") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "application/json"
        assert response.headers["Transfer-Encoding"] == "chunked"
        first = await read_event(response)
        assert (first["type"], first["object"]["metadata"]["name"]) == ("ADDED", "old")
        assert first["object"]["kind"] == "Pod"
        await call(client, "POST", PODS, pod("new"), status=201)
        event = await read_event(response)
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "new")
        await call(client, "DELETE", f"{PODS}/new")
        assert (await read_event(response))["type"] == "DELETED"


async def test_watch_from_resource_version_and_legacy_prefix(client):
    created = await call(client, "POST", PODS, pod("w"), status=201)
    rv = created["metadata"]["resourceVersion"]
    path = f"/api/v1/watch/namespaces/default/pods/w?resourceVersion={rv}&timeoutSeconds=10"
    async with client.get(path) as response:
        await call(client, "POST", PODS, pod("other"), status=201)  # filtered out by name
        await call(client, "PATCH", f"{PODS}/w", {"metadata": {"labels": {"x": "y"}}},
                   ctype="application/merge-patch+json")
        event = await read_event(response)
        assert event["type"] == "MODIFIED" and event["object"]["metadata"]["name"] == "w"


async def test_watch_bookmarks(client):
    list_rv = (await call(client, "GET", PODS))["metadata"]["resourceVersion"]
    path = f"{PODS}?watch=1&allowWatchBookmarks=true&resourceVersion={list_rv}&timeoutSeconds=10"
    async with client.get(path) as response:
        event = await read_event(response)
        assert event["type"] == "BOOKMARK"
        assert event["object"] == {"kind": "Pod", "apiVersion": "v1",
                                   "metadata": {"resourceVersion": list_rv}}


async def test_watch_send_initial_events_ends_with_marked_bookmark(client):
    await call(client, "POST", PODS, pod("a"), status=201)
    path = f"{PODS}?watch=1&sendInitialEvents=true&allowWatchBookmarks=true" \
           "&resourceVersionMatch=NotOlderThan&timeoutSeconds=10"
    async with client.get(path) as response:
        assert (await read_event(response))["type"] == "ADDED"
        bookmark = await read_event(response)
        assert bookmark["type"] == "BOOKMARK"
        assert bookmark["object"]["metadata"]["annotations"] == {
            "k8s.io/initial-events-end": "true"}


async def test_watch_timeout_ends_stream(client):
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with client.get(f"{PODS}?watch=true&timeoutSeconds=1") as response:
        body = await asyncio.wait_for(response.read(), STEP)
    assert body == b"" and loop.time() - started < 3


async def test_watch_too_old_resource_version_is_error_event(client):
    for i in range(60):  # the fixture's store keeps 50 events
        await call(client, "POST", "/api/v1/namespaces/default/configmaps",
                   {"metadata": {"name": f"c{i}"}}, status=201)
    async with client.get(f"{PODS}?watch=true&resourceVersion=1") as response:
        assert response.status == 200
        event = await read_event(response)
        assert event["type"] == "ERROR"
        assert_status(event["object"], 410, "Expired")
        assert await asyncio.wait_for(response.content.read(), STEP) == b""


async def test_watch_bad_input_is_400(client):
    await call(client, "GET", f"{PODS}?watch=true&resourceVersion=abc", status=400)
    await call(client, "GET", f"{PODS}?watch=true&fieldSelector=spec.x%3D1", status=400)


async def test_watch_as_table_like_kubectl_get_w(client):
    await call(client, "POST", PODS, pod("t1"), status=201)
    async with client.get(f"{PODS}?watch=true&timeoutSeconds=10",
                          headers={"Accept": TABLE}) as response:
        first = await read_event(response)
        assert first["type"] == "ADDED" and first["object"]["kind"] == "Table"
        assert [c["name"] for c in first["object"]["columnDefinitions"]][:3] == [
            "Name", "Ready", "Status"]
        assert first["object"]["rows"][0]["cells"][0] == "t1"
        await call(client, "POST", PODS, pod("t2"), status=201)
        second = await read_event(response)
        assert second["object"]["columnDefinitions"] is None  # headers only once
        assert second["object"]["rows"][0]["cells"][0] == "t2"


# --- several servers, one store ---------------------------------------------------------


async def test_two_servers_share_one_store(aiohttp_client, store_path):
    with Store(store_path) as one, Store(store_path) as two:
        a = await aiohttp_client(build_app(catalog=load_catalog("1.35"), store=one,
                                           server_id="a"))
        b = await aiohttp_client(build_app(catalog=load_catalog("1.36"), store=two,
                                           server_id="b"))
        async with b.get(f"{DEPLOYMENTS}?watch=true&timeoutSeconds=10") as watch:
            await call(a, "POST", DEPLOYMENTS, deployment("shared"), status=201)
            event = await read_event(watch)
            assert event["object"]["metadata"]["name"] == "shared"
        got = await call(b, "GET", f"{DEPLOYMENTS}/shared")
        assert got["metadata"]["name"] == "shared"
        # A resource only the newer release serves is 404 on the older one.
        path = "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups"
        await call(b, "GET", path)
        await call(a, "GET", path, status=404)


# --- protobuf bodies (what `kubectl create namespace|secret` sends) ---------------------

# Captured from kubectl v1.36.3 -v=8: `create namespace x` and `create secret generic s
# --from-literal=a=b`.
NAMESPACE_PB = bytes.fromhex(
    "6b3873000a0f0a02763112094e616d6573706163651219"
    "0a110a017812001a0022002a0032003800420012001a020a001a002200")
SECRET_PB = bytes.fromhex(
    "6b3873000a0c0a027631120653656372657412"
    "1d0a110a017312001a0022002a00320038004200"
    "12060a0161120162" "1a00" "1a002200")
PROTOBUF = "application/vnd.kubernetes.protobuf"


def test_protobuf_decoding_of_kubectl_bodies():
    from mvproxy.devcluster.protobuf import decode

    assert decode(NAMESPACE_PB) == {"apiVersion": "v1", "kind": "Namespace",
                                    "metadata": {"name": "x"}}
    assert decode(SECRET_PB) == {"apiVersion": "v1", "kind": "Secret",
                                 "metadata": {"name": "s"}, "data": {"a": "Yg=="}}


async def test_protobuf_create(client):
    response = await client.post("/api/v1/namespaces", data=NAMESPACE_PB, headers={
        "Content-Type": PROTOBUF, "Accept": f"{PROTOBUF},application/json"})
    assert response.status == 201
    assert response.headers["Content-Type"] == "application/json"
    assert (await response.json())["metadata"]["name"] == "x"
    response = await client.post("/api/v1/namespaces/default/secrets", data=SECRET_PB,
                                 headers={"Content-Type": PROTOBUF})
    secret = await response.json()
    assert secret["type"] == "Opaque" and secret["data"] == {"a": "Yg=="}


async def test_protobuf_of_an_unknown_kind_is_415(client):
    body = NAMESPACE_PB.replace(b"\x0a\x0f\x0a\x02v1\x12\x09Namespace",
                                b"\x0a\x0f\x0a\x02v1\x12\x09Namespacf")
    response = await client.post("/api/v1/namespaces", data=body,
                                 headers={"Content-Type": PROTOBUF})
    assert response.status == 415


async def test_pods_resize_is_served_from_1_33(client, aiohttp_client, tmp_path):
    """Real kube-apiserver 1.35.4 and 1.36.3 list and serve ``pods/resize``; the
    simulator of 1.36 does too (the catalog adds it from 1.33), and 1.32's does not."""
    await call(client, "POST", PODS, pod("sized"), status=201)
    got = await call(client, "GET", f"{PODS}/sized/resize")
    assert (got["kind"], got["metadata"]["name"]) == ("Pod", "sized")
    patched = await call(client, "PATCH", f"{PODS}/sized/resize",
                         '{"metadata":{"labels":{"resized":"yes"}}}',
                         ctype="application/merge-patch+json")
    assert patched["kind"] == "Pod"
    listed = await call(client, "GET", "/api/v1")
    assert "pods/resize" in [r["name"] for r in listed["resources"]]
    with Store(tmp_path / "old.db", event_retention=50) as store:
        old = await aiohttp_client(build_app(catalog=load_catalog("1.32"), store=store,
                                             server_id="sim-old"))
        await call(old, "POST", PODS, pod("sized"), status=201)
        refused = await call(old, "GET", f"{PODS}/sized/resize", status=404)
        assert_status(refused, 404, "NotFound")
