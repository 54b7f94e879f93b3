"""Discovery, version and health of the simulated kube-apiserver, in process (no TLS).

Accept headers are the ones real clients send (see docs/real-clients.md and the
captured requests): the response must carry exactly the Content-Type kube gives.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.mediatypes import parse_accept
from mvproxy.devcluster.simserver import build_app
from mvproxy.devcluster.store import Store

KUBECTL_136 = ("application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,"
               "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,"
               "application/json")
KUBECTL_137 = ("application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,"
               "application/json")
KUBECTL_127 = ("application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,"
               "application/json")
V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
V2BETA1 = "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList"


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "store.db") as s:
        yield s


@pytest.fixture
async def client(aiohttp_client, store):
    app = build_app(catalog=load_catalog("1.36"), store=store, server_id="sim-a")
    return await aiohttp_client(app)


@pytest.fixture
async def client_132(aiohttp_client, store):
    """A 1.32 server: the last release serving aggregated discovery v2beta1."""
    app = build_app(catalog=load_catalog("1.32"), store=store, server_id="sim-a")
    return await aiohttp_client(app)


async def _get(client, path, accept=None, **headers):
    if accept is not None:
        headers["Accept"] = accept
    response = await client.get(path, headers=headers)
    return response, await response.read()


@pytest.mark.parametrize(("release", "accept", "content_type"), [
    ("1.36", KUBECTL_136, V2),
    ("1.36", KUBECTL_137, V2),
    ("1.32", KUBECTL_127, V2BETA1),
    ("1.36", V2 + ";profile=nopeer", V2),
    ("1.36", "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList;"
             "profile=nopeer,application/json", V2),
    # q-values win over order.
    ("1.32", f"{V2};q=0.5,{V2BETA1}", V2BETA1),
    ("1.36", f"{V2};q=0.5,{V2BETA1}", V2),  # 1.33+ serve no v2beta1
])
@pytest.mark.parametrize("path", ["/api", "/apis", "/api/", "/apis/"])
async def test_aggregated_discovery_content_type(client, client_132, path, release, accept,
                                                 content_type):
    response, body = await _get(client_132 if release == "1.32" else client, path, accept)
    assert response.status == 200
    assert response.headers["Content-Type"] == content_type
    doc = json.loads(body)
    assert doc["kind"] == "APIGroupDiscoveryList"
    assert doc["apiVersion"] == "apidiscovery.k8s.io/" + content_type.split("v=")[1].split(";")[0]


async def test_aggregated_core_and_groups_are_split(client):
    _, core = await _get(client, "/api", V2)
    _, groups = await _get(client, "/apis", V2)
    core_items = json.loads(core)["items"]
    group_names = [g["metadata"].get("name") for g in json.loads(groups)["items"]]
    assert [g["metadata"] for g in core_items] == [{}]
    assert "apps" in group_names and "" not in group_names and None not in group_names


async def test_etag_caching_headers_and_304(client):
    response, body = await _get(client, "/apis", KUBECTL_136)
    etag = response.headers["ETag"]
    assert etag == '"' + hashlib.sha512(body).hexdigest().upper() + '"'
    assert response.headers["Vary"] == "Accept"
    assert response.headers["Cache-Control"] == "public"
    again, again_body = await _get(client, "/apis", KUBECTL_136, **{"If-None-Match": etag})
    assert again.status == 304 and again_body == b""
    assert again.headers["ETag"] == etag
    stale, _ = await _get(client, "/apis", KUBECTL_136, **{"If-None-Match": '"OTHER"'})
    assert stale.status == 200


async def test_v2_and_v2beta1_have_different_etags(client_132):
    v2, _ = await _get(client_132, "/api", V2)
    beta, _ = await _get(client_132, "/api", V2BETA1)
    assert v2.headers["ETag"] != beta.headers["ETag"]


@pytest.mark.parametrize("accept", ["application/json, */*", "application/json", "*/*", None, ""])
async def test_legacy_top_level_documents(client, accept):
    response, body = await _get(client, "/apis", accept)
    assert response.status == 200
    assert response.headers["Content-Type"] == "application/json"
    assert json.loads(body)["kind"] == "APIGroupList"
    response, body = await _get(client, "/api/", accept)
    doc = json.loads(body)
    assert doc["kind"] == "APIVersions" and doc["versions"] == ["v1"]
    assert "ETag" not in response.headers


@pytest.mark.parametrize(("path", "kind"), [
    ("/api/v1", "APIResourceList"),
    ("/api/v1/", "APIResourceList"),
    ("/apis/apps", "APIGroup"),
    ("/apis/apps/", "APIGroup"),
    ("/apis/apps/v1", "APIResourceList"),
    ("/apis/apps/v1/", "APIResourceList"),
    ("/apis/scheduling.k8s.io/v1alpha2", "APIResourceList"),
])
async def test_legacy_group_and_version_documents(client, path, kind):
    response, body = await _get(client, path, "application/json, */*")
    assert response.status == 200
    assert response.headers["Content-Type"] == "application/json"
    assert json.loads(body)["kind"] == kind


async def test_legacy_resource_list_lists_subresources(client):
    _, body = await _get(client, "/apis/apps/v1", "*/*")
    names = {r["name"] for r in json.loads(body)["resources"]}
    assert {"deployments", "deployments/scale", "deployments/status"} <= names


@pytest.mark.parametrize("path", ["/apis/apps/v9", "/api/v2", "/apis/scheduling.k8s.io/v1alpha1"])
async def test_unknown_discovery_paths_are_kube_404(client, path):
    """Under a group the server has; an unknown group or path has no handler at all and
    gets Go's plain-text 404 (test_sim_parity_fixes)."""
    response, body = await _get(client, path, "application/json")
    assert response.status == 404
    assert response.headers["Content-Type"] == "application/json"
    status = json.loads(body)
    assert status["kind"] == "Status" and status["reason"] == "NotFound"
    assert status["message"] == "the server could not find the requested resource"


@pytest.mark.parametrize(("path", "accept"), [
    ("/apis", "application/vnd.kubernetes.protobuf"),
    ("/api", "application/yaml"),
    ("/apis", "application/json;as=Table;v=v1;g=meta.k8s.io"),
    ("/apis/apps", V2),  # aggregated exists only for /api and /apis
    ("/apis", "application/json;foo=bar"),
])
async def test_unsatisfiable_accept_is_406(client, path, accept):
    response, body = await _get(client, path, accept)
    assert response.status == 406
    status = json.loads(body)
    assert (status["reason"], status["code"]) == ("NotAcceptable", 406)


async def test_protobuf_first_falls_back_to_json(client):
    response, body = await _get(client, "/apis",
                                "application/vnd.kubernetes.protobuf,application/json")
    assert response.status == 200 and json.loads(body)["kind"] == "APIGroupList"


@pytest.mark.parametrize("path", ["/version", "/version/"])
async def test_version(client, path):
    response, body = await _get(client, path, "*/*")
    doc = json.loads(body)
    assert response.headers["Content-Type"] == "application/json"
    assert (doc["major"], doc["minor"]) == ("1", "36")
    assert doc["gitVersion"].startswith("v1.36.") and doc["platform"] == "linux/amd64"


@pytest.mark.parametrize("path", ["/healthz", "/livez", "/readyz", "/readyz/", "/livez/ping"])
async def test_health(client, path):
    response, body = await _get(client, path)
    assert response.status == 200 and body == b"ok"


async def test_health_verbose(client):
    response, body = await _get(client, "/readyz?verbose")
    assert response.status == 200 and b"readyz check passed" in body


async def test_each_version_serves_its_own_catalog(aiohttp_client, store):
    old = await aiohttp_client(build_app(catalog=load_catalog("1.35"), store=store,
                                         server_id="old"))
    new = await aiohttp_client(build_app(catalog=load_catalog("1.36"), store=store,
                                         server_id="new"))
    old_r, _ = await _get(old, "/apis/scheduling.k8s.io/v1alpha2", "*/*")
    new_r, _ = await _get(new, "/apis/scheduling.k8s.io/v1alpha2", "*/*")
    assert (old_r.status, new_r.status) == (404, 200)


def test_parse_accept_orders_by_q_then_specificity():
    ranges = parse_accept("*/*;q=0.8, application/json, text/plain;q=0.9, application/*")
    assert [r.media_type for r in ranges] == ["application/json", "application/*",
                                             "text/plain", "*/*"]
    assert parse_accept("application/json;q=0") == []
    assert [r.media_type for r in parse_accept(None)] == ["*/*"]


async def test_openapi_v3_declares_field_validation_for_patch(client):
    response, body = await _get(client, "/openapi/v3", "application/json")
    index = json.loads(body)["paths"]
    url = index["apis/apps/v1"]["serverRelativeURL"]
    assert url.startswith("/openapi/v3/apis/apps/v1?hash=")
    response, body = await _get(client, url, "application/json")
    assert response.status == 200
    path = json.loads(body)["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]
    assert path["patch"]["x-kubernetes-group-version-kind"] == {
        "group": "apps", "kind": "Deployment", "version": "v1"}
    assert "fieldValidation" in [p["name"] for p in path["patch"]["parameters"]]
    core, _ = await _get(client, index["api/v1"]["serverRelativeURL"])
    assert core.status == 200
    missing, _ = await _get(client, "/openapi/v3/apis/nope/v1")
    assert missing.status == 404
