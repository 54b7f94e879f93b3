"""Regressions of the simulated kube-apiserver: each difference from a real
kube-apiserver that ``tests/realk8s_replay.py`` measured (1.35.4 and 1.36.3, see
docs/simulator-vs-real.md) and that was fixed in the simulator, asserted here as the
real server answered, so the simulator cannot drift back.

In process over plain HTTP (aiohttp's test client), no real binaries needed; every
wait on a stream is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest

from mvproxy.devcluster import simresources
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.simauth import AuditLog, Authenticator
from mvproxy.devcluster.simserver import SIM, build_app
from mvproxy.devcluster.store import Key, Store
from mvproxy.devpki import init_pki

NS = "/api/v1/namespaces/default"
CONFIGMAPS = f"{NS}/configmaps"
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
V2BETA1 = "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList"
STEP = 5.0  # the longest wait for one line of a watch


def configmap(name: str, labels: dict | None = None, data: dict | None = None) -> dict:
    meta: dict = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {"k": "v"} if data is None else data}


def deployment(name: str, replicas: int = 1) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                         {"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}}}


async def call(client, method: str, path: str, body=None, *, status: int = 200,
               ctype: str = "application/json", accept: str | None = None):
    headers = {"Accept": accept} if accept else {}
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body)
        headers["Content-Type"] = ctype
    response = await client.request(method, path, data=data, headers=headers)
    text = await response.text()
    assert response.status == status, text
    return json.loads(text) if text and text[0] in "{[" else text


async def events(response, count: int) -> list[dict]:
    out = []
    for _ in range(count):
        line = await asyncio.wait_for(response.content.readline(), STEP)
        assert line, f"the watch ended after {out}"
        out.append(json.loads(line))
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("parity") / "pki"
    init_pki(directory, ["sim-a"])
    (directory / "tokens.csv").write_text("viewer-token,vera,uid-vera,viewer\n")
    return directory


@pytest.fixture
async def authed(aiohttp_client, tmp_path, pki):
    """The 1.36 simulator with its identity rules (no client certificates over plain
    HTTP, so requests are anonymous or carry a token)."""
    with Store(tmp_path / "store.db") as store:
        authenticator = Authenticator.from_files(pki / "ca.crt", pki / "front-proxy-ca.crt",
                                                 pki / "tokens.csv")
        app = build_app(catalog=load_catalog("1.36"), store=store, server_id="sim-a",
                        authenticator=authenticator, audit=AuditLog(None))
        yield await aiohttp_client(app)


# --------------------------------------------------------------------------- identity


async def test_no_credentials_is_system_anonymous_and_forbidden(authed):
    """Was 401 Unauthorized: kube-apiserver's default --anonymous-auth makes it
    system:anonymous, which RBAC refuses with 403 beyond the public paths."""
    response = await authed.get("/api")
    doc = await response.json()
    assert response.status == 403
    assert (doc["reason"], doc["details"]) == ("Forbidden", {})
    assert doc["message"] == 'forbidden: User "system:anonymous" cannot get path "/api"'
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    doc = await call(authed, "GET", "/api/v1/namespaces", status=403)
    assert doc["message"] == ('namespaces is forbidden: User "system:anonymous" cannot list '
                              'resource "namespaces" in API group "" at the cluster scope')
    assert doc["details"] == {"kind": "namespaces"}
    for empty in ("Bearer ", "Basic cGFyaXR5OnBhcml0eQ=="):  # no bearer token: anonymous
        response = await authed.get("/apis", headers={"Authorization": empty})
        assert response.status == 403, empty
    response = await authed.get("/api", headers={"Authorization": "Bearer wrong"})
    assert response.status == 401  # a rejected credential is never anonymous
    response = await authed.get("/readyz")
    assert (response.status, await response.text()) == (200, "ok")
    assert response.headers["X-Content-Type-Options"] == "nosniff"


# --------------------------------------------------------------------------- objects


async def test_list_items_carry_no_kind_or_api_version(client):
    await call(client, "POST", CONFIGMAPS, configmap("a"), status=201)
    listed = await call(client, "GET", CONFIGMAPS)
    assert (listed["kind"], listed["apiVersion"]) == ("ConfigMapList", "v1")
    assert [set(item) for item in listed["items"]] == [{"metadata", "data"}]
    got = await call(client, "GET", f"{CONFIGMAPS}/a")
    assert (got["kind"], got["apiVersion"]) == ("ConfigMap", "v1")  # single objects do


async def test_generation_only_where_kube_tracks_it(client):
    created = await call(client, "POST", CONFIGMAPS, configmap("g"), status=201)
    assert "generation" not in created["metadata"]
    created = await call(client, "POST", DEPLOYMENTS, deployment("g"), status=201)
    assert created["metadata"]["generation"] == 1


async def test_delete_answers_a_success_status_for_most_resources(client):
    created = await call(client, "POST", CONFIGMAPS, configmap("gone"), status=201)
    doc = await call(client, "DELETE", f"{CONFIGMAPS}/gone")
    assert doc == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                   "details": {"name": "gone", "kind": "configmaps",
                               "uid": created["metadata"]["uid"]}}
    await call(client, "POST", DEPLOYMENTS, deployment("gone"), status=201)
    doc = await call(client, "DELETE", f"{DEPLOYMENTS}/gone")
    assert doc["kind"] == "Status" and doc["details"]["group"] == "apps"


async def test_delete_answers_the_object_where_kube_does(client):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "x"}]}}
    await call(client, "POST", f"{NS}/pods", pod, status=201)
    doc = await call(client, "DELETE", f"{NS}/pods/p")
    assert (doc["kind"], doc["metadata"]["name"]) == ("Pod", "p")
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "short-lived"}}
    await call(client, "POST", "/api/v1/namespaces", ns, status=201)
    doc = await call(client, "DELETE", "/api/v1/namespaces/short-lived")
    assert doc["kind"] == "Namespace" and doc["status"]["phase"] == "Terminating"
    assert doc["metadata"]["deletionTimestamp"]
    await call(client, "GET", "/api/v1/namespaces/short-lived", status=404)  # no controller


async def test_a_stale_delete_precondition_names_the_kind(client):
    created = await call(client, "POST", CONFIGMAPS, configmap("pre"), status=201)
    rv = created["metadata"]["resourceVersion"]
    await call(client, "PATCH", f"{CONFIGMAPS}/pre", {"data": {"k": "2"}},
               ctype="application/merge-patch+json")
    doc = await call(client, "DELETE", f"{CONFIGMAPS}/pre", {"preconditions": {
        "resourceVersion": rv}}, status=409)
    assert doc["reason"] == "Conflict" and doc["details"] == {"name": "pre", "kind": "ConfigMap"}
    assert doc["message"].startswith(
        f'Operation cannot be fulfilled on ConfigMap "pre": the ResourceVersion in the '
        f"precondition ({rv}) does not match the ResourceVersion in record (")


async def test_secret_string_data_is_folded_into_data(client):
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"},
              "data": {"a": base64.b64encode(b"1").decode()}, "stringData": {"b": "two"}}
    created = await call(client, "POST", f"{NS}/secrets", secret, status=201)
    assert "stringData" not in created and created["type"] == "Opaque"
    assert created["data"] == {"a": "MQ==", "b": base64.b64encode(b"two").decode()}
    updated = await call(client, "PUT", f"{NS}/secrets/s", {**created, "stringData": {"b": "3"}})
    assert updated["data"]["b"] == "Mw==" and "stringData" not in updated


async def test_dry_run_create_is_filled_in_like_a_real_one(client):
    doc = await call(client, "POST", f"{CONFIGMAPS}?dryRun=All", configmap("dry"), status=201)
    assert doc["metadata"]["uid"] and doc["metadata"]["creationTimestamp"]
    await call(client, "GET", f"{CONFIGMAPS}/dry", status=404)


# --------------------------------------------------------------------------- 4xx bodies


async def test_invalid_names_the_kind_and_lists_causes(client):
    doc = await call(client, "POST", CONFIGMAPS, configmap("Bad_Name"), status=422)
    assert doc["details"]["kind"] == "ConfigMap"
    assert doc["details"]["causes"] == [{
        "reason": "FieldValueInvalid", "field": "metadata.name",
        "message": doc["message"].split("metadata.name: ", 1)[1]}]
    doc = await call(client, "POST", CONFIGMAPS, {"metadata": {}}, status=422)
    assert doc["details"] == {"kind": "ConfigMap", "causes": [{
        "reason": "FieldValueRequired", "field": "metadata.name",
        "message": "Required value: name or generateName is required"}]}


async def test_labels_and_configuration_keys_are_validated(client):
    doc = await call(client, "POST", CONFIGMAPS, configmap("long", {"app": "x" * 64}),
                     status=422)
    assert doc["message"] == (f'ConfigMap "long" is invalid: metadata.labels: Invalid value: '
                              f'"{"x" * 64}": must be no more than 63 bytes')
    doc = await call(client, "POST", CONFIGMAPS, configmap("key", data={"a b": "1"}),
                     status=422)
    assert doc["details"]["causes"][0]["field"] == "data[a b]"
    assert "a valid config key must consist of alphanumeric characters" in doc["message"]
    await call(client, "POST", CONFIGMAPS, configmap("fine", {"a.b/c-d": "e_f.g"},
                                                     {"k.e-y_1": "v"}), status=201)


async def test_bad_dry_run_is_422_against_the_options_kind(client):
    doc = await call(client, "POST", f"{CONFIGMAPS}?dryRun=Bogus", configmap("x"), status=422)
    assert doc["message"] == ('CreateOptions.meta.k8s.io "" is invalid: dryRun: Unsupported '
                              'value: ["Bogus"]: supported values: "All"')
    assert doc["details"]["group"] == "meta.k8s.io"


async def test_media_type_refusals_read_as_kubes(client):
    await call(client, "POST", CONFIGMAPS, configmap("m"), status=201)
    doc = await call(client, "GET", CONFIGMAPS, accept="application/xml", status=406)
    assert doc["message"].startswith("406: Not Acceptable\n\nAvailable representations: "
                                     "application/json, application/yaml, ")
    assert doc["details"] == {}
    doc = await call(client, "PATCH", f"{CONFIGMAPS}/m", {"data": {}}, status=415)
    assert (doc["message"], doc["details"]) == ("415: Unsupported Media Type", {})
    doc = await call(client, "POST", CONFIGMAPS, b"x", ctype="text/plain", status=415)
    assert doc["message"].endswith("include: application/json, application/yaml, "
                                   "application/vnd.kubernetes.protobuf")
    doc = await call(client, "PATCH", f"{CONFIGMAPS}/m", [{"op": "test", "path": "/data/k",
                                                           "value": "no"}],
                     ctype="application/json-patch+json", status=422)
    assert doc["message"] == "the server rejected our request due to an error in our request"


async def test_unknown_groups_and_paths_get_gos_plain_404(client):
    for path in ("/apis/nope.example.com", "/apis/nope.example.com/v1/things", "/nope"):
        response = await client.get(path)
        assert response.status == 404, path
        assert await response.read() == b"404 page not found\n"
        assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
    doc = await call(client, "GET", "/apis/apps/v0", status=404)  # a known group: JSON
    assert doc["message"] == "the server could not find the requested resource"


async def test_api_answers_are_not_cacheable_but_discovery_is(client):
    for path in (CONFIGMAPS, "/version", "/healthz", f"{CONFIGMAPS}/absent"):
        response = await client.get(path)
        assert response.headers["Cache-Control"] == "no-cache, private", path
    response = await client.get("/apis", headers={"Accept": V2})
    assert response.headers["Cache-Control"] == "public"


# --------------------------------------------------------------------------- list options


async def test_list_resource_version_options_are_validated(client):
    doc = await call(client, "GET", f"{CONFIGMAPS}?resourceVersionMatch=Exact", status=422)
    assert doc["message"] == ('ListOptions.meta.k8s.io "" is invalid: resourceVersionMatch: '
                              "Forbidden: resourceVersionMatch is forbidden unless "
                              "resourceVersion is provided")
    assert doc["details"]["causes"][0]["reason"] == "FieldValueForbidden"
    doc = await call(client, "GET", f"{CONFIGMAPS}?resourceVersion=abc", status=400)
    assert doc["message"].startswith('invalid resource version: resourceVersion: Invalid '
                                     'value: "abc"')
    doc = await call(client, "GET", f"{CONFIGMAPS}?watch=1&sendInitialEvents=true", status=422)
    assert "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan" in \
        doc["message"]


async def test_a_list_from_the_future_times_out_with_retry_after(client, monkeypatch):
    monkeypatch.setattr(simresources, "_FRESHNESS_WAIT", 0.2)
    response = await client.get(f"{CONFIGMAPS}?resourceVersion=999999"
                                "&resourceVersionMatch=NotOlderThan")
    doc = await response.json()
    assert (response.status, doc["reason"]) == (504, "Timeout")
    assert doc["message"].startswith("Timeout: Too large resource version: 999999, current: ")
    assert doc["details"]["causes"] == [{"reason": "ResourceVersionTooLarge",
                                         "message": "Too large resource version"}]
    assert response.headers["Retry-After"] == "1"


# --------------------------------------------------------------------------- watch


async def test_a_watch_from_before_the_server_started_is_410(aiohttp_client, tmp_path):
    """A kube-apiserver's watch cache begins when it starts: an older resourceVersion is
    410 Expired (then the stream ends), a later one is replayed."""
    with Store(tmp_path / "store.db") as store:
        for name in ("before-1", "before-2"):
            store.create(Key("", "configmaps", "default", name), configmap(name))
        started_at = store.current_resource_version()
        client = await aiohttp_client(build_app(catalog=load_catalog("1.36"), store=store,
                                                server_id="sim-a"))
        response = await client.get(f"{CONFIGMAPS}?watch=1&resourceVersion=1")
        (event,) = await events(response, 1)
        assert event["type"] == "ERROR"
        assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
        assert await asyncio.wait_for(response.content.readline(), STEP) == b""  # ended
        response = await client.get(f"{CONFIGMAPS}?watch=1&resourceVersion={started_at}")
        await call(client, "POST", CONFIGMAPS, configmap("after"), status=201)
        (event,) = await events(response, 1)
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "after")
        response.close()


async def test_an_object_leaving_the_selector_is_deleted_as_last_seen(client):
    created = await call(client, "POST", CONFIGMAPS, configmap("w", {"app": "w"}), status=201)
    rv = created["metadata"]["resourceVersion"]
    response = await client.get(f"{CONFIGMAPS}?watch=1&labelSelector=app%3Dw"
                                f"&resourceVersion={rv}")
    patched = await call(client, "PATCH", f"{CONFIGMAPS}/w",
                         {"metadata": {"labels": {"app": "x"}}},
                         ctype="application/merge-patch+json")
    (event,) = await events(response, 1)
    assert event["type"] == "DELETED"
    assert event["object"]["metadata"]["labels"] == {"app": "w"}  # what the watcher saw
    assert event["object"]["metadata"]["resourceVersion"] == \
        patched["metadata"]["resourceVersion"]  # at the change's resourceVersion
    response.close()


# --------------------------------------------------------------------------- discovery


async def test_v2beta1_aggregated_discovery_is_gone_from_1_33(aiohttp_client, tmp_path):
    with Store(tmp_path / "store.db") as store:
        new = await aiohttp_client(build_app(catalog=load_catalog("1.33"), store=store,
                                             server_id="a"))
        old = await aiohttp_client(build_app(catalog=load_catalog("1.32"), store=store,
                                             server_id="b"))
        response = await new.get("/apis", headers={"Accept": V2BETA1})
        doc = await response.json()
        assert (response.status, doc["reason"]) == (406, "NotAcceptable")
        assert doc["message"] == ("only the following media types are accepted: "
                                  "application/json, application/yaml, "
                                  "application/vnd.kubernetes.protobuf")
        response = await new.get("/apis", headers={"Accept": f"{V2BETA1},application/json"})
        assert (await response.json())["kind"] == "APIGroupList"
        response = await old.get("/apis", headers={"Accept": V2BETA1})
        assert response.headers["Content-Type"] == V2BETA1


async def test_openapi_index_is_text_and_documents_have_etags(client):
    response = await client.get("/openapi/v3")
    assert response.headers["Content-Type"] == "text/plain; charset=utf-8"
    index = json.loads(await response.read())
    url = index["paths"]["apis/apps/v1"]["serverRelativeURL"]
    response = await client.get(url)
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["ETag"].startswith('"')
    response = await client.get("/openapi/v2")
    assert response.headers["ETag"].startswith('"')


async def test_metrics_are_labelled_as_kube_labels_them(client):
    response = await client.get("/metrics")
    assert response.headers["Content-Type"] == \
        "text/plain; version=0.0.4; charset=utf-8; escaping=underscores"


# --------------------------------------------------------------------------- tables


async def test_tables_have_kubes_columns_for_secrets_statefulsets_leases(client):
    await call(client, "POST", f"{NS}/secrets", {"metadata": {"name": "s"},
                                                 "data": {"a": "MQ=="}}, status=201)
    table = await call(client, "GET", f"{NS}/secrets", accept=TABLE)
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Type", "Data", "Age"]
    assert table["rows"][0]["cells"][:3] == ["s", "Opaque", 1]
    sts = {**deployment("db"), "kind": "StatefulSet"}
    sts["spec"]["serviceName"] = "db"
    await call(client, "POST", "/apis/apps/v1/namespaces/default/statefulsets", sts, status=201)
    table = await call(client, "GET", "/apis/apps/v1/namespaces/default/statefulsets",
                       accept=TABLE)
    assert [(c["name"], c["priority"]) for c in table["columnDefinitions"]] == [
        ("Name", 0), ("Ready", 0), ("Age", 0), ("Containers", 1), ("Images", 1)]
    assert table["rows"][0]["cells"][:2] == ["db", "0/1"]
    leases = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
    for name, spec in (("held", {"holderIdentity": "me"}), ("free", {})):
        await call(client, "POST", leases, {"metadata": {"name": name}, "spec": spec},
                   status=201)
    table = await call(client, "GET", leases, accept=TABLE)
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Holder", "Age"]
    assert [r["cells"][:2] for r in table["rows"]] == [["free", ""], ["held", "me"]]


async def test_deployment_counts_are_typed_string_and_pod_restarts_are_text(client):
    await call(client, "POST", DEPLOYMENTS, deployment("web"), status=201)
    table = await call(client, "GET", DEPLOYMENTS, accept=TABLE)
    types = {c["name"]: c["type"] for c in table["columnDefinitions"]}
    assert (types["Up-to-date"], types["Available"]) == ("string", "string")
    assert table["rows"][0]["cells"][2:4] == [0, 0]  # the cells stay numbers, as kube's
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    await call(client, "POST", f"{NS}/pods", pod, status=201)
    table = await call(client, "GET", f"{NS}/pods", accept=TABLE)
    assert table["rows"][0]["cells"][3] == "0"


async def test_table_include_object_refusal_reads_as_kubes(client):
    doc = await call(client, "GET", f"{CONFIGMAPS}?includeObject=Bogus", accept=TABLE,
                     status=400)
    assert doc["message"] == ('Unable to convert to Table as requested: includeObject: '
                              "Invalid value: \"Bogus\": must be 'Metadata', 'Object', "
                              "'None', or empty")


def test_the_horizon_is_where_the_store_was_when_the_app_was_built(tmp_path):
    with Store(tmp_path / "store.db") as store:
        store.create(Key("", "configmaps", "default", "x"), configmap("x"))
        app = build_app(catalog=load_catalog("1.36"), store=store, server_id="a")
        assert app[SIM].resources.horizon == 1  # before its own namespaces were written


def test_every_fix_the_report_lists_has_its_regression_test_here() -> None:
    import realk8s_replay

    names = {name for name in globals() if name.startswith("test_")}
    missing = [test for _, test in realk8s_replay.FIXED if test not in names]
    assert not missing, missing
