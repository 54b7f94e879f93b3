"""Regressions of the simulated kube-apiserver found in review: a watch whose pump died
kept bookmarking, badly typed metadata was stored (and broke every selector), deleting
a namespace through an older server left a newer server's objects behind, and a
selective watch bookmarked a stale resourceVersion.

In process over plain HTTP (aiohttp's test client); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.simserver import SIM, build_app
from mvproxy.devcluster.store import Key, Store

SECRETS = "/api/v1/namespaces/default/secrets"
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"
PODGROUPS = "/apis/scheduling.k8s.io/v1alpha2/namespaces/{ns}/podgroups"
STEP = 5.0  # upper bound for any single wait on a stream


def store_of(client) -> Store:
    return client.server.app[SIM].resources.store


async def call(client, method, path, body=None, *, status=200,
               ctype="application/json"):
    headers, data = {}, None
    if body is not None:
        data = json.dumps(body)
        headers["Content-Type"] = ctype
    response = await client.request(method, path, data=data, headers=headers)
    text = await response.text()
    assert response.status == status, text
    return json.loads(text) if text else None


async def read_event(response):
    line = await asyncio.wait_for(response.content.readline(), STEP)
    assert line, "watch stream ended"
    return json.loads(line)


def secret(name, labels):
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "labels": labels}, "data": {"k": "c2VjcmV0"}}


# --- 1: a failing watch pump ends the stream with an ERROR event -------------------------


async def test_reviewers_repro_second_secret_arrives(client):
    """labels "oops" once killed the pump; the next matching secret never arrived."""
    path = f"{SECRETS}?watch=1&labelSelector=app%3Dz&allowWatchBookmarks=true" \
           "&timeoutSeconds=10"
    async with client.get(path) as watch:
        await call(client, "POST", SECRETS, secret("bad", "oops"), status=422)
        await call(client, "POST", SECRETS, secret("good", {"app": "z"}), status=201)
        for _ in range(100):
            event = await read_event(watch)
            if event["type"] != "BOOKMARK":
                break
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "good")


async def test_watch_failure_is_a_500_error_event_then_the_stream_ends(client, monkeypatch,
                                                                       caplog):
    store = store_of(client)
    path = f"{SECRETS}?watch=1&allowWatchBookmarks=true&timeoutSeconds=10"
    async with client.get(path) as watch:
        assert watch.status == 200

        def broken(*args, **kwargs):
            raise RuntimeError("do-not-log-me")

        monkeypatch.setattr(store, "_events_after", broken)
        with caplog.at_level(logging.ERROR, logger="mvproxy.devcluster.simwatch"):
            for _ in range(100):  # bookmarks may come first
                event = await read_event(watch)
                if event["type"] != "BOOKMARK":
                    break
            assert event["type"] == "ERROR"
            status = event["object"]
            assert (status["kind"], status["status"]) == ("Status", "Failure")
            assert (status["code"], status["reason"]) == (500, "InternalError")
            assert status["message"].startswith("Internal error occurred:")
            # ... and then the stream ends, so the client re-lists (no more bookmarks).
            assert await asyncio.wait_for(watch.content.read(), STEP) == b""
    failures = [r for r in caplog.records if r.getMessage() == "watch stream failed"]
    assert failures, caplog.records
    assert "do-not-log-me" not in caplog.text


# --- 2: metadata is validated; a bad stored value breaks nobody --------------------------


@pytest.mark.parametrize(("metadata", "message"), [
    ({"name": 5}, 'ConfigMap "" is invalid: metadata.name: Invalid value: 5: '
                  "must be of type string"),
    ({"name": "x", "labels": ["a"]},
     'ConfigMap "x" is invalid: metadata.labels: Invalid value: ["a"]: '
     "must be a map of string to string"),
    ({"name": "x", "labels": "oops"},
     'ConfigMap "x" is invalid: metadata.labels: Invalid value: "oops": '
     "must be a map of string to string"),
    ({"name": "x", "annotations": {"a": 1}},
     'ConfigMap "x" is invalid: metadata.annotations[a]: Invalid value: 1: '
     "must be of type string"),
    ({"generateName": ["g-"]}, 'ConfigMap "" is invalid: metadata.generateName: '
                               'Invalid value: ["g-"]: must be of type string'),
    ({"name": "x", "namespace": 1, "resourceVersion": 7},
     'ConfigMap "x" is invalid: [metadata.namespace: Invalid value: 1: must be of type '
     "string, metadata.resourceVersion: Invalid value: 7: must be of type string]"),
    ("x", 'ConfigMap "" is invalid: metadata: Invalid value: "x": must be of type object'),
])
async def test_badly_typed_metadata_is_422_invalid(client, metadata, message):
    doc = await call(client, "POST", CONFIGMAPS, {"metadata": metadata}, status=422)
    assert (doc["kind"], doc["code"], doc["reason"]) == ("Status", 422, "Invalid")
    assert doc["message"] == message
    assert doc["details"]["kind"] == "ConfigMap"  # kube names the kind here, not the resource
    assert (await call(client, "GET", CONFIGMAPS))["items"] == []


async def test_bad_labels_are_422_on_update_and_patch_too(client):
    created = await call(client, "POST", CONFIGMAPS, {"metadata": {"name": "x"}}, status=201)
    created["metadata"]["labels"] = ["a"]
    doc = await call(client, "PUT", f"{CONFIGMAPS}/x", created, status=422)
    assert doc["message"].startswith('ConfigMap "x" is invalid: metadata.labels:')
    doc = await call(client, "PATCH", f"{CONFIGMAPS}/x", {"metadata": {"labels": {"a": 5}}},
                     status=422, ctype="application/merge-patch+json")
    assert doc["message"] == ('ConfigMap "x" is invalid: metadata.labels[a]: '
                              "Invalid value: 5: must be of type string")
    # null fields decode to nothing, as in kube.
    await call(client, "PATCH", f"{CONFIGMAPS}/x", {"metadata": {"labels": None}},
               ctype="application/merge-patch+json")


async def test_an_already_stored_bad_labels_value_breaks_no_list_or_watch(client):
    store = store_of(client)
    await asyncio.to_thread(store.create, Key("", "secrets", "default", "legacy"),
                            secret("legacy", "oops"))
    listed = await call(client, "GET", f"{SECRETS}?labelSelector=app%3Dz")
    assert listed["items"] == []
    listed = await call(client, "GET", f"{SECRETS}?labelSelector=%21app")
    assert [o["metadata"]["name"] for o in listed["items"]] == ["legacy"]
    path = f"{SECRETS}?watch=1&labelSelector=app%3Dz&timeoutSeconds=10"
    async with client.get(path) as watch:
        # A MODIFIED event whose previous object has the bad labels: the selector is
        # applied to both, which used to raise inside the pump.
        await asyncio.to_thread(store.update, Key("", "secrets", "default", "legacy"),
                                secret("legacy", {"app": "z"}))
        event = await read_event(watch)
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "legacy")


# --- 4: deleting a namespace deletes everything in it, whichever server serves it -------


async def test_namespace_delete_through_older_server_removes_newer_resources(
        aiohttp_client, store_path):
    with Store(store_path) as one, Store(store_path) as two:
        old = await aiohttp_client(build_app(catalog=load_catalog("1.35"), store=one,
                                             server_id="old"))
        new = await aiohttp_client(build_app(catalog=load_catalog("1.36"), store=two,
                                             server_id="new"))
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}}
        await call(old, "POST", "/api/v1/namespaces", ns, status=201)
        pg = {"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
              "metadata": {"name": "pg"}, "spec": {}}
        await call(new, "POST", PODGROUPS.format(ns="team"), pg, status=201)
        await call(old, "GET", PODGROUPS.format(ns="team"), status=404)  # not served by 1.35
        path = PODGROUPS.format(ns="team") + "?watch=1&timeoutSeconds=10"
        async with new.get(path) as watch:
            assert (await read_event(watch))["type"] == "ADDED"
            await call(old, "DELETE", "/api/v1/namespaces/team")
            event = await read_event(watch)
            assert (event["type"], event["object"]["metadata"]["name"]) == ("DELETED", "pg")
        await call(old, "POST", "/api/v1/namespaces", ns, status=201)
        assert (await call(new, "GET", PODGROUPS.format(ns="team")))["items"] == []


# --- 5: bookmarks follow the watch cursor, never past an undelivered event --------------


async def test_selective_watch_bookmarks_advance_past_unmatched_events(client):
    list_rv = (await call(client, "GET", SECRETS))["metadata"]["resourceVersion"]
    path = f"{SECRETS}?watch=1&labelSelector=app%3Dz&allowWatchBookmarks=true" \
           f"&resourceVersion={list_rv}&timeoutSeconds=10"
    async with client.get(path) as watch:
        other = await call(client, "POST", SECRETS, secret("other", {"app": "y"}), status=201)
        quiet_rv = int(other["metadata"]["resourceVersion"])
        for _ in range(100):
            event = await read_event(watch)
            assert event["type"] == "BOOKMARK"
            if int(event["object"]["metadata"]["resourceVersion"]) >= quiet_rv:
                break
        else:
            pytest.fail("bookmarks never passed the unmatched event")
        wanted = await call(client, "POST", SECRETS, secret("z", {"app": "z"}), status=201)
        wanted_rv = int(wanted["metadata"]["resourceVersion"])
        for _ in range(100):
            event = await read_event(watch)
            if event["type"] != "BOOKMARK":
                break
            # A bookmark never claims a matching event the client has not been sent.
            assert int(event["object"]["metadata"]["resourceVersion"]) < wanted_rv
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "z")
