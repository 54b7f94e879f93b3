"""Merged discovery through the assembled daemon, between fake upstreams: what protobuf
clients get, ``/apis/<g>`` agreeing with ``/apis``, and what a client sees when no
media type it accepts is served (406) or the authorization probe to the backend fails.

The backend (1.35) serves ``widgets.example.com`` v1 only; the peer (1.36) serves it
as v2 and v1, and alone serves ``gadgets.example.com``. The backend answers
``/apis/<g>`` like kube-apiserver: 401 without credentials, 403 for the token
``nodiscovery``, else its own ``APIGroup`` or 404 (``kube_like_groups``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

from aiohttp import web
from daemon_support import (
    WAIT,
    Cluster,
    cluster,
    cut_short,
    ready,
)

WIDGETS, GADGETS, NOTHING = "widgets.example.com", "gadgets.example.com", "nothing.example.com"
#: A group the backend answers ``/apis/<g>`` for although no discovery lists it, as
#: kube-apiserver does for an APIService a newer server left in etcd.
GHOST = "phantom.example.com"  # as long as the others: answers are compared by length
KUBECTL = ("application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,"
           "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList,"
           "application/json")
PROTOBUF_AGG = ("application/vnd.kubernetes.protobuf;"
                "g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList")
NOPEER = "aggregator_discovery_nopeer_requests_total"


def _group(name: str, *versions: str) -> dict:
    return {"metadata": {"name": name}, "versions": [
        {"version": v, "freshness": "Current", "resources": [
            {"resource": "widgets", "scope": "Namespaced", "verbs": ["get", "list"],
             "responseKind": {"group": name, "version": v, "kind": "Widget"}}]}
        for v in versions]}


BACKEND_GROUPS = [_group(WIDGETS, "v1")]
PEER_GROUPS = [_group(WIDGETS, "v2", "v1"), _group(GADGETS, "v1")]


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def kube_like_groups(app: web.Application) -> None:
    """``/apis/<g>`` as kube-apiserver answers it: authentication and authorization
    first, then the backend's own APIGroup (widgets v1) or 404."""

    async def api_group(request: web.Request) -> web.Response:
        audit = {"Audit-Id": str(uuid.uuid4())}
        token = request.headers.get("Authorization", "")
        if "X-Remote-User" not in request.headers and token not in (
                "Bearer good", "Bearer nodiscovery"):
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"),
                                     status=401, headers=audit)
        if token == "Bearer nodiscovery":  # kube names the verb and the URL path
            return web.json_response(_status(
                403, "Forbidden", f'forbidden: User "nobody" cannot '
                                  f'{request.method.lower()} path "{request.path}"'),
                status=403, headers=audit)
        name = request.match_info["group"]
        if name not in (WIDGETS, GHOST):
            return web.json_response(_status(404, "NotFound", "the server could not find "
                                                              "the requested resource"),
                                     status=404, headers=audit)
        return web.json_response({"kind": "APIGroup", "apiVersion": "v1", "name": name,
                                  "versions": [{"groupVersion": f"{name}/v1",
                                                "version": "v1"}],
                                  "preferredVersion": {"groupVersion": f"{name}/v1",
                                                       "version": "v1"}}, headers=audit)

    app.router.add_route("*", "/apis/{group:[^/]+}{slash:/?}", api_group)


def groups_cluster(aiohttp_server, root):
    # The peer's backend refuses the same way (a request can reach it through the peer).
    return cluster(aiohttp_server, root, backend_routes=kube_like_groups,
                   peer_routes=kube_like_groups,
                   backend_groups=BACKEND_GROUPS, peer_groups=PEER_GROUPS)


def _backend_saw(c: Cluster, path: str) -> int:
    return c.seen["backend"].count(("GET", path))


# --------------------------------------------------------------------------- protobuf


async def test_protobuf_discovery_gets_merged_json_or_406_never_a_partial_view(
        aiohttp_server, root):
    """staging/src/k8s.io/apiserver/pkg/endpoints/discovery/aggregated/wrapper.go serves
    the peer-aggregated document in any encoding, protobuf too. mvproxy encodes JSON
    only, and the backend's protobuf lacks peer-only APIs: a protobuf clause is skipped
    for the client's next one (406 if none is left: ``test_no_acceptable_media_type_*``),
    except ``profile=nopeer``, which asks for the backend's own view anyway (and is
    counted, as upstream counts it)."""
    async with groups_cluster(aiohttp_server, root) as c:
        await ready(c)
        status, headers, body = await c.get("/apis", headers={
            "Accept": f"{PROTOBUF_AGG},application/json"})
        assert status == 200, body
        assert headers["Content-Type"] == "application/json"
        listed = {g["name"] for g in json.loads(body)["groups"]}
        assert {GADGETS, WIDGETS} <= listed

        before = await c.metric(NOPEER) or 0.0
        status, _, body = await c.get("/apis", headers={
            "Accept": f"{PROTOBUF_AGG};profile=nopeer"})
        assert status == 200, body
        own = json.loads(body)  # the fake backend's own document (JSON, being a fake)
        assert GADGETS not in {g["metadata"]["name"] for g in own["items"]}
        assert await c.metric(NOPEER) == before + 1


# --------------------------------------------------------------------------- /apis/<g>


async def test_group_lists_versions_only_a_peer_serves_and_agrees_with_apis(
        aiohttp_server, root):
    """Upstream answers ``/apis/<g>`` locally
    (staging/src/k8s.io/apiserver/pkg/endpoints/discovery/group.go), so an old server
    omits the versions a newer peer adds, though its peer-aggregated ``/apis`` lists
    them. mvproxy answers it from the merged view: the backend serves widgets v1 only,
    the peer v2 and v1, and ``/apis/<g>`` lists both, preferring what ``/apis`` prefers."""
    async with groups_cluster(aiohttp_server, root) as c:
        await ready(c)
        status, headers, body = await c.get(f"/apis/{WIDGETS}")
        assert status == 200, body
        assert headers["Content-Type"] == "application/json"
        assert body.startswith(b'{"kind":"APIGroup","apiVersion":"v1","name":'
                               b'"widgets.example.com","versions":[')
        group = json.loads(body)
        assert [v["version"] for v in group["versions"]] == ["v2", "v1"]
        assert group["preferredVersion"] == {"groupVersion": f"{WIDGETS}/v2", "version": "v2"}

        _, _, listed = await c.get("/apis", headers={"Accept": "application/json"})
        entries = {g["name"]: g for g in json.loads(listed)["groups"]}
        for name in (WIDGETS, GADGETS, "scheduling.k8s.io", "apps"):
            status, _, body = await c.get(f"/apis/{name}")
            assert status == 200, (name, body)
            group = json.loads(body)
            assert (group.pop("kind"), group.pop("apiVersion")) == ("APIGroup", "v1")
            assert group == entries[name]
        assert {"v1", "v1alpha1", "v1alpha2"} <= {
            v["version"] for v in entries["scheduling.k8s.io"]["versions"]}


async def test_group_etag_304_and_406(aiohttp_server, root):
    """The same caching headers as the other merged answers (ETag, ``Vary: Accept``,
    ``Cache-Control: public``, exact ``If-None-Match`` → 304); group.go negotiates
    without conversions, so aggregated-only or protobuf-only Accept is 406 here."""
    async with groups_cluster(aiohttp_server, root) as c:
        await ready(c)
        status, headers, body = await c.get(f"/apis/{WIDGETS}", headers={"Accept": KUBECTL})
        assert status == 200, body
        etag = headers["ETag"]
        assert (headers["Vary"], headers["Cache-Control"]) == ("Accept", "public")
        status, again, body = await c.get(f"/apis/{WIDGETS}", headers={"If-None-Match": etag})
        assert (status, body, again["ETag"]) == (304, b"", etag)
        for accept in ("text/html", PROTOBUF_AGG, "application/vnd.kubernetes.protobuf",
                       KUBECTL.split(",")[0]):
            status, headers, body = await c.get(f"/apis/{WIDGETS}", headers={"Accept": accept})
            assert status == 406, (accept, body)
            assert (json.loads(body)["kind"], headers["Content-Type"]) == (
                "Status", "application/json")


async def test_group_from_the_backend_when_it_must_be(aiohttp_server, root):
    """As for the other merged answers: before the first complete sync, for a peer, and
    for a group nobody lists (its 404 is genuine), the backend answers."""
    async with groups_cluster(aiohttp_server, root) as c:
        status, _, body = await c.get(f"/apis/{WIDGETS}")  # the peer's first poll waits
        assert status == 200 and len(json.loads(body)["versions"]) == 1, body
        await ready(c)
        status, _, body = await c.get(f"/apis/{NOTHING}")
        assert (status, json.loads(body)["reason"]) == (404, "NotFound")
        status, _, body = await c.get(f"/apis/{WIDGETS}", who="peer",
                                      headers={"X-Remote-User": "someone"})
        assert status == 200 and len(json.loads(body)["versions"]) == 1, body


async def test_a_group_nobody_lists_is_a_404_even_if_the_backend_describes_it(
        aiohttp_server, root):
    """Real kube-apiserver 1.36.3 left beside 1.37.2's APIService objects answers
    ``/apis/storagemigration.k8s.io`` with an APIGroup and ``/apis/<g>/v1`` with 404.
    mvproxy lists only what some server's discovery lists, and anything it lists can be
    got: the ghost is kube's own 404 for an unknown group; a refusal stays the
    backend's; nothing is remembered."""
    async with groups_cluster(aiohttp_server, root) as c:
        await ready(c)
        status, headers, body = await c.get(f"/apis/{GHOST}")
        assert (status, body) == (404, b"404 page not found\n")
        assert headers["Content-Type"] == "text/plain; charset=utf-8"
        assert _backend_saw(c, f"/apis/{GHOST}") == 1  # the backend was asked
        _, _, listed = await c.get("/apis", headers={"Accept": "application/json"})
        assert GHOST not in {g["name"] for g in json.loads(listed)["groups"]}
        status, _, body = await c.get(f"/apis/{GHOST}", who="bearer",
                                      headers={"Authorization": "Bearer nodiscovery"})
        assert (status, json.loads(body)["reason"]) == (403, "Forbidden")
        status, _, body = await c.get(f"/apis/{NOTHING}")  # the backend's own 404
        assert (status, json.loads(body)["reason"]) == (404, "NotFound")
        assert not [key for key in c.daemon.proxy.discovery._authorized if key[1] != "/apis"]


async def test_group_probe_asks_the_exact_path_and_a_yes_is_remembered(
        aiohttp_server, root):
    """Credentials are checked by asking the backend ``/apis/<g>`` itself; its 404 for a
    peer-only group is a yes (kube authorizes before routing). A yes is reused briefly."""
    async with groups_cluster(aiohttp_server, root) as c:
        await ready(c)
        good = {"Authorization": "Bearer good"}
        for _ in range(3):
            for name in (WIDGETS, GADGETS):
                status, _, body = await c.get(f"/apis/{name}", who="bearer", headers=good)
                assert status == 200 and json.loads(body)["kind"] == "APIGroup", body
        assert _backend_saw(c, f"/apis/{WIDGETS}") == 1
        assert _backend_saw(c, f"/apis/{GADGETS}") == 1


async def test_one_connections_yes_never_authorizes_another_connection(
        aiohttp_server, root):
    """The credentials memo is per connection: after the admin's certificate (no
    token) is authorized for a group, a connection without a certificate or a token
    sending the same (no) credential headers is still asked for, and refused by the
    backend; so is a token that changes on a connection already authorized."""
    async with groups_cluster(aiohttp_server, root) as c:
        await ready(c)
        path = f"/apis/{WIDGETS}"
        for _ in range(2):  # the second time from the memo and the remembered yes
            status, _, body = await c.get(path, who="admin")
            assert status == 200 and json.loads(body)["kind"] == "APIGroup", body
        assert _backend_saw(c, path) == 1
        status, _, _ = await c.get(path, who="bearer")
        assert status == 401
        status, _, _ = await c.get(path, who="bearer", headers={"Authorization": "Bearer good"})
        assert status == 200
        for token in ("Bearer bad", "Bearer nodiscovery"):  # the same connection, pooled
            status, _, _ = await c.get(path, who="bearer", headers={"Authorization": token})
            assert status in (401, 403), token
        assert len(c.daemon.proxy.discovery.credentials) <= 3


async def test_an_unauthenticated_client_learns_nothing_and_grows_nothing(
        aiohttp_server, root):
    """An attacker without (valid) credentials gets exactly the backend's refusal for a
    group every server lists, one only a peer lists and one nobody lists, whatever it
    accepts: it cannot tell which groups peers serve. Refusals are never remembered, and
    groups nobody lists never reach the memo or the rendered documents, so neither grows
    with what clients send."""
    async with groups_cluster(aiohttp_server, root) as c:
        await ready(c)
        handler = c.daemon.proxy.discovery
        for credentials in ({}, {"Authorization": "Bearer bad"},
                            {"Authorization": "Bearer nodiscovery"}):
            for accept in (None, "application/json", KUBECTL, "text/html",
                           "application/vnd.kubernetes.protobuf"):
                sent = {**credentials, **({"Accept": accept} if accept else {})}
                for method, form in (("GET", "/apis/{}"), ("GET", "/apis/{}/"),
                                     ("HEAD", "/apis/{}")):
                    answers = []
                    for name in (WIDGETS, GADGETS, NOTHING, GHOST):
                        async with c.sessions["bearer"].request(
                                method, c.base + form.format(name), headers=sent) as resp:
                            body = await resp.read()
                            assert resp.status in (401, 403), (name, method, sent, body)
                            length = int(resp.headers["Content-Length"]) - len(name)
                            answers.append((resp.status, sorted(resp.headers), length,
                                            body.replace(name.encode(), b"G")))
                    assert all(a == answers[0] for a in answers), (method, form, sent)
        for _ in range(20):
            await c.get(f"/apis/{uuid.uuid4().hex}.example.com", who="bearer",
                        headers={"Authorization": "Bearer good"})
        assert not handler._authorized
        documents = c.daemon.cache.view()._documents
        assert not [key for key in documents if isinstance(key, tuple) and key[0] != "/apis"]


# --------------------------------------------------------------------------- 406, probe failures
# What a client sees when the merged view could answer but no media type it accepts is
# served, or when the authorization probe to the backend gives no usable answer. The
# backend's discovery misbehaves only for probes carrying ``Bearer probe-<mode>``
# (mvproxy's own polls carry no token), so the merged view stays synced throughout;
# ``Bearer good`` is a client the backend says yes to.

TOP_406 = "only aggregated (apidiscovery.k8s.io v2, v2beta1) and legacy JSON discovery is " \
          "served here"


def probe_faults(release: asyncio.Event):
    """Backend routes: discovery probes misbehave as the bearer token says."""

    @web.middleware
    async def faults(request: web.Request, handler):
        token = request.headers.get("Authorization", "")
        if not token.startswith("Bearer probe-") or request.path.startswith("/api/"):
            return await handler(request)
        mode = token.removeprefix("Bearer probe-")
        if mode == "deny":
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        if mode == "error":
            return web.json_response(_status(500, "InternalError", "etcd is gone"),
                                     status=500)
        if mode == "slow":  # answers only after the test is over
            await asyncio.wait_for(release.wait(), WAIT)
            return await handler(request)
        if mode == "garbage":  # not HTTP at all, then hang up
            request.transport.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            request.transport.close()
            return web.Response()  # goes nowhere: the connection is closed
        if mode == "truncated":
            return await cut_short(request, b'{"kind":"APIGroupDiscoveryList","items":[')
        raise AssertionError(f"unknown mode {mode}")

    def install(app: web.Application) -> None:
        app.middlewares.append(faults)
        kube_like_groups(app)

    return install


@contextlib.asynccontextmanager
async def probed_cluster(aiohttp_server, root):
    release = asyncio.Event()
    try:
        async with cluster(aiohttp_server, root, backend_routes=probe_faults(release),
                           backend_groups=BACKEND_GROUPS, peer_groups=PEER_GROUPS,
                           timeouts={"request": "1s"}) as c:
            await ready(c)
            yield c
    finally:
        release.set()


def _answerable_from_the_merge(c: Cluster) -> bool:
    """The merged view would answer (so a failure below came from the probe)."""
    view = c.daemon.cache.view()
    return view.synced and view.merged() is not None


async def _as(c: Cluster, path: str, mode: str, accept: str | None = None):
    headers = {"Authorization": "Bearer good" if mode == "ok" else f"Bearer probe-{mode}"}
    if accept is not None:
        headers["Accept"] = accept
    status, fields, body = await c.get(path, who="bearer", headers=headers)
    return status, fields, json.loads(body) if body else None


async def test_no_acceptable_media_type_is_a_406_status_after_authorization(
        aiohttp_server, root):
    """``/api`` and ``/apis`` answer a request accepting nothing mvproxy serves with a
    406 Status naming what is served (no Retry-After: retrying cannot help), but only
    once the backend has authorized the client: a refused one gets the refusal."""
    async with probed_cluster(aiohttp_server, root) as c:
        assert _answerable_from_the_merge(c)
        for path in ("/api", "/apis"):
            for accept in ("text/html", "application/vnd.kubernetes.protobuf", PROTOBUF_AGG,
                           "application/yaml"):
                status, fields, body = await _as(c, path, "ok", accept)
                assert status == 406, (path, accept, body)
                assert body == _status(406, "NotAcceptable", TOP_406), (path, accept)
                assert fields["Content-Type"] == "application/json"
                assert "Retry-After" not in fields
                status, _, body = await _as(c, path, "deny", accept)
                assert (status, body) == (401, _status(401, "Unauthorized", "Unauthorized"))


PROBE_FAILURES = [
    # mode, status, reason, message
    ("slow", 504, "Timeout", "the backend API server did not answer in time"),
    ("garbage", 502, "InternalError",
     "the backend API server sent a broken response or stopped answering"),
    ("truncated", 502, "InternalError",
     "the backend API server sent a broken response or stopped answering"),
]


async def test_a_failed_probe_is_a_status_with_retry_after_never_the_merged_view(
        aiohttp_server, root):
    """When the backend does not answer the probe usably (no answer in time, bytes that
    are not HTTP, a body cut short), the client gets the Status ``upstream_failure``
    gives a GET, Retry-After included (discovery is always safe to retry), and never the
    merged document; nothing is remembered, so the next good probe is asked afresh."""
    async with probed_cluster(aiohttp_server, root) as c:
        for path in ("/api", "/apis", f"/apis/{WIDGETS}", f"/apis/{GADGETS}"):
            for mode, code, reason, message in PROBE_FAILURES:
                assert _answerable_from_the_merge(c)
                status, fields, body = await _as(c, path, mode)
                assert status == code, (path, mode, body)
                assert body == _status(code, reason, message), (path, mode)
                assert fields["Content-Type"] == "application/json"
                assert fields.get("Retry-After") == "1", (path, mode)  # ceil(pollInterval)
            assert path not in {p for _, p in c.daemon.proxy.discovery._authorized}
            status, _, body = await _as(c, path, "ok")
            assert status == 200, (path, body)


async def test_a_failed_openapi_index_fetch_is_a_status_with_retry_after(aiohttp_server, root):
    """``GET /openapi/v3`` (the index mvproxy merges) fails like a discovery probe: the
    Status a GET gets, Retry-After included (kubectl retries it), never a bare 500."""
    async with probed_cluster(aiohttp_server, root) as c:
        for mode, code, reason, message in PROBE_FAILURES:
            status, fields, body = await _as(c, "/openapi/v3", mode)
            assert (status, body) == (code, _status(code, reason, message)), mode
            assert fields.get("Retry-After") == "1", mode


async def test_a_probe_the_backend_answers_with_an_error_is_relayed(aiohttp_server, root):
    """A backend that answers the probe with something other than a yes (here a 500) is
    relayed as if the request had been forwarded: its code and its Status."""
    async with probed_cluster(aiohttp_server, root) as c:
        for path in ("/apis", f"/apis/{GADGETS}"):
            status, _, body = await _as(c, path, "error")
            assert (status, body) == (500, _status(500, "InternalError", "etcd is gone"))


async def test_a_ready_merged_answer_still_asks_for_each_connections_yes(aiohttp_server, root):
    """Once ``/apis`` is answered from the ready answer (``Prepared``) for a client the
    backend said yes to, a token the backend refuses, on the same pooled connection or
    with the same Accept, still gets the backend's 401; a connection without a token
    is asked for too (this backend says yes to it)."""
    async with probed_cluster(aiohttp_server, root) as c:
        for _ in range(3):
            status, _, body = await _as(c, "/apis", "ok", KUBECTL)
            assert status == 200 and body["kind"] == "APIGroupDiscoveryList"
        assert c.daemon.proxy.discovery._prepared
        for _ in range(2):
            status, _, body = await _as(c, "/apis", "deny", KUBECTL)
            assert (status, body) == (401, _status(401, "Unauthorized", "Unauthorized"))
        said_yes = len(c.daemon.proxy.discovery._authorized)
        status, _, _ = await c.get("/apis", who="bearer", headers={"Accept": KUBECTL})
        assert status == 200 and len(c.daemon.proxy.discovery._authorized) == said_yes + 1


async def test_a_backend_that_cannot_be_reached_is_a_503_with_retry_after(
        aiohttp_server, root):
    """The backend stopped after the first sync: the merged view still holds, the probe
    cannot connect. Without credentials the client gets 503 ServiceUnavailable with
    Retry-After (anonymous requests are the backend's alone)."""
    async with probed_cluster(aiohttp_server, root) as c:
        await c.backend_server.close()
        for path in ("/api", "/apis", f"/apis/{GADGETS}"):
            assert _answerable_from_the_merge(c)
            status, fields, body = await c.get(path, who="bearer")
            assert status == 503, (path, body)
            assert json.loads(body) == _status(503, "ServiceUnavailable",
                                               "error trying to reach the backend API "
                                               "server: cannot connect")
            assert fields.get("Retry-After") == "1"
        assert not [p for p in c.seen["peer"] if p[0].startswith("PROBE")]


async def test_while_the_backend_is_down_a_peer_authorizes_discovery(aiohttp_server, root):
    """With credentials, the probe goes to a reachable peer instead, which answers a peer
    with its own backend's answer (that backend authorizes the same credentials): the
    merged view is served, so discovery through a member whose kube-apiserver restarts
    keeps working, as its resource requests do."""
    async with probed_cluster(aiohttp_server, root) as c:
        await c.backend_server.close()
        for path in ("/api", "/apis", f"/apis/{GADGETS}"):
            status, _, body = await _as(c, path, "ok", KUBECTL if path != f"/apis/{GADGETS}"
                                        else None)
            assert status == 200, (path, body)
        probes = [p for p in c.seen["peer"] if p[0].startswith("PROBE")]
        assert ("PROBE /apis", "Bearer good") in probes, probes


async def test_a_forwarded_discovery_request_that_fails_is_retryable_too(
        aiohttp_server, root):
    """``profile=nopeer`` is the backend's own answer, forwarded; when it fails before
    its head the client gets the same Statuses as for a failed probe, Retry-After
    included (a body cut short after the head is relayed as cut, like any response)."""
    nopeer = KUBECTL.split(",")[0] + ";profile=nopeer"
    failures = [f for f in PROBE_FAILURES if f[0] != "truncated"]
    async with probed_cluster(aiohttp_server, root) as c:
        before = await c.metric(NOPEER) or 0.0
        for mode, code, reason, message in failures:
            status, fields, body = await _as(c, "/apis", mode, nopeer)
            assert status == code, (mode, body)
            assert body == _status(code, reason, message), mode
            assert fields.get("Retry-After") == "1", mode
        assert await c.metric(NOPEER) == before + len(failures)  # all forwarded


# --------------------------------------------------------------------------- /apis/<g>/<v>
# The legacy APIResourceList of a group/version both serve, with a resource only the
# peer has (kube-apiserver 1.35 and 1.36 both serve admissionregistration.k8s.io/v1;
# only 1.36 has mutatingadmissionpolicies in it): kr8s and the Python DynamicClient
# read /apis/<g>/<v> and would not find it.

SPROCKETS = {"resource": "sprockets", "scope": "Cluster", "singularResource": "sprocket",
             "verbs": ["get", "list"], "shortNames": ["spr"],
             "responseKind": {"group": "", "version": "", "kind": "Sprocket"},
             "subresources": [{"subresource": "status", "verbs": ["get", "patch"],
                               "responseKind": {"group": "", "version": "",
                                                "kind": "Sprocket"}}]}
WIDGETS_V1 = f"/apis/{WIDGETS}/v1"


def _with_sprockets(group: dict) -> dict:
    version = {**group["versions"][0]}
    version["resources"] = [*version["resources"], SPROCKETS]
    return {**group, "versions": [version]}


def kube_like_resource_list(app: web.Application) -> None:
    """``/apis/widgets.example.com/v1`` as kube-apiserver answers it: 401 without
    credentials, 403 for ``nodiscovery``, then JSON or protobuf as asked."""

    async def resource_list(request: web.Request) -> web.Response:
        audit = {"Audit-Id": str(uuid.uuid4()), "X-Seen-Accept": request.headers.get(
            "Accept", ""), "X-Seen-Accept-Encoding": request.headers.get("Accept-Encoding", "")}
        token = request.headers.get("Authorization", "")
        if "X-Remote-User" not in request.headers and token not in (
                "Bearer good", "Bearer nodiscovery"):
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"),
                                     status=401, headers=audit)
        if token == "Bearer nodiscovery":
            return web.json_response(_status(
                403, "Forbidden", f'forbidden: User "nobody" cannot get path "{request.path}"'),
                status=403, headers=audit)
        if request.headers.get("Accept", "").startswith("application/vnd.kubernetes.protobuf"):
            return web.Response(body=b"k8s\x00protobuf", headers=audit,
                                content_type="application/vnd.kubernetes.protobuf")
        return web.Response(body=json.dumps({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{WIDGETS}/v1",
            "resources": [{"name": "widgets", "singularName": "", "namespaced": True,
                           "kind": "Widget", "verbs": ["get", "list"],
                           "storageVersionHash": "abc="}]}).encode() + b"\n",
            headers={**audit, "ETag": '"backend-own"'}, content_type="application/json")

    app.router.add_route("GET", WIDGETS_V1 + "{slash:/?}", resource_list)


def resource_list_cluster(aiohttp_server, root):
    return cluster(aiohttp_server, root, backend_routes=kube_like_resource_list,
                   peer_routes=kube_like_resource_list, backend_groups=[_group(WIDGETS, "v1")],
                   peer_groups=[_with_sprockets(_group(WIDGETS, "v1"))])


def _names(body: bytes) -> list[str]:
    return [r["name"] for r in json.loads(body)["resources"]]


async def test_resource_list_gains_what_only_peers_serve(aiohttp_server, root):
    async with resource_list_cluster(aiohttp_server, root) as c:
        await ready(c)
        for path in (WIDGETS_V1, WIDGETS_V1 + "/"):
            status, headers, body = await c.get(path, headers={
                "Accept": "application/json", "Accept-Encoding": "gzip"})
            assert status == 200, body
            assert _names(body) == ["sprockets", "sprockets/status", "widgets"]
            document = json.loads(body)
            assert document["resources"][0] == {
                "name": "sprockets", "singularName": "sprocket", "namespaced": False,
                "kind": "Sprocket", "verbs": ["get", "list"], "shortNames": ["spr"]}
            assert document["resources"][2]["storageVersionHash"] == "abc="  # the backend's
            assert body.endswith(b"}\n")
            # The backend's own answer, rewritten: its fields but not its ETag; asked as
            # JSON, without compression.
            assert headers["Content-Type"] == "application/json" and "Audit-Id" in headers
            assert "ETag" not in headers and int(headers["Content-Length"]) == len(body)
            assert (headers["X-Seen-Accept"], headers["X-Seen-Accept-Encoding"]) == (
                "application/json", "")
        # Protobuf first, JSON accepted: merged JSON (as for /apis).
        status, headers, body = await c.get(WIDGETS_V1, headers={
            "Accept": "application/vnd.kubernetes.protobuf, application/json"})
        assert status == 200 and headers["Content-Type"] == "application/json", body
        assert "sprockets" in _names(body)


async def test_resource_list_refusals_and_other_encodings_are_the_backends(
        aiohttp_server, root):
    async with resource_list_cluster(aiohttp_server, root) as c:
        await ready(c)
        status, headers, body = await c.get(WIDGETS_V1, headers={
            "Accept": "application/vnd.kubernetes.protobuf"})
        assert (status, headers["Content-Type"], body) == (
            200, "application/vnd.kubernetes.protobuf", b"k8s\x00protobuf")
        status, _, body = await c.get(WIDGETS_V1, who="bearer",
                                      headers={"Authorization": "Bearer nodiscovery"})
        assert status == 403 and json.loads(body)["message"] == (
            f'forbidden: User "nobody" cannot get path "{WIDGETS_V1}"'), body
        status, _, body = await c.get(WIDGETS_V1, who="bearer")
        assert (status, json.loads(body)["reason"]) == (401, "Unauthorized")
        status, _, body = await c.get(WIDGETS_V1, who="bearer",
                                      headers={"Authorization": "Bearer good"})
        assert status == 200 and "sprockets" in _names(body), body
        # A peer asks for the backend's own view.
        status, _, body = await c.get(WIDGETS_V1, who="peer",
                                      headers={"X-Remote-User": "someone",
                                               "x-kubernetes-peer-proxied": "true"})
        assert status == 200 and _names(body) == ["widgets"], body


async def test_resource_list_when_the_backend_fails(aiohttp_server, root):
    async with resource_list_cluster(aiohttp_server, root) as c:
        await ready(c)
        await c.backend_server.close()
        status, headers, body = await c.get(WIDGETS_V1)
        assert status == 503 and headers.get("Retry-After"), body
        assert json.loads(body)["kind"] == "Status"


# ------------------------------------------------------------------- /openapi/v3/apis/<g>/<v>
# The OpenAPI document of a group/version both serve, sprockets only on the peer:
# kubectl explain reads the backend's unless mvproxy completes it.

OPENAPI_WIDGETS = f"/openapi/v3/apis/{WIDGETS}/v1"


def _openapi_doc(resources: list[str]) -> dict:
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.35.4"},
            "paths": {f"{WIDGETS_V1}/{r}": {"get": {"responses": {"200": {"content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{r}List"}}}}}}}
                for r in resources},
            "components": {"schemas": {f"{r}List": {"x-kubernetes-group-version-kind": [
                {"group": WIDGETS, "kind": f"{r}List", "version": "v1"}]} for r in resources}}}


def kube_like_openapi(resources: list[str]):
    def routes(app: web.Application) -> None:
        async def document(request: web.Request) -> web.Response:
            seen = {"X-Seen-Query": request.query_string,
                    "X-Seen-Accept": request.headers.get("Accept", ""),
                    "X-Seen-User": request.headers.get("X-Remote-User", ""),
                    "X-Seen-Peer-Proxied": request.headers.get("x-kubernetes-peer-proxied", ""),
                    "Audit-Id": str(uuid.uuid4())}
            token = request.headers.get("Authorization", "")
            if "X-Remote-User" not in request.headers and token != "Bearer good":
                return web.json_response(_status(401, "Unauthorized", "Unauthorized"),
                                         status=401, headers=seen)
            if request.headers.get("Accept", "").startswith("application/com.github"):
                return web.Response(body=b"protobuf", headers=seen,
                                    content_type="application/com.github.proto-openapi."
                                                 "spec.v3.v1.0+protobuf")
            if request.query_string:  # kube redirects a stale hash
                return web.Response(status=301, headers={**seen, "Location": request.path})
            return web.json_response(_openapi_doc(resources), headers=seen)

        async def index(request: web.Request) -> web.Response:
            return web.json_response({"paths": {f"apis/{WIDGETS}/v1": {
                "serverRelativeURL": f"{OPENAPI_WIDGETS}?hash=BACKEND"}}})

        app.router.add_get(OPENAPI_WIDGETS, document)
        app.router.add_get("/openapi/v3", index)
        kube_like_resource_list(app)
    return routes


def openapi_cluster(aiohttp_server, root):
    return cluster(aiohttp_server, root, backend_routes=kube_like_openapi(["widgets"]),
                   peer_routes=kube_like_openapi(["widgets", "sprockets"]),
                   backend_groups=[_group(WIDGETS, "v1")],
                   peer_groups=[_with_sprockets(_group(WIDGETS, "v1"))])


async def test_openapi_document_gains_what_only_peers_serve(aiohttp_server, root):
    async with openapi_cluster(aiohttp_server, root) as c:
        await ready(c)
        status, _, body = await c.get("/openapi/v3")
        assert json.loads(body)["paths"][f"apis/{WIDGETS}/v1"] == {
            "serverRelativeURL": OPENAPI_WIDGETS}  # the backend's hash named its own
        for query in ("", "?hash=BACKEND"):  # a client with the old index still gets it
            status, headers, body = await c.get(OPENAPI_WIDGETS + query, headers={
                "Accept": "application/json", "Accept-Encoding": "gzip"})
            assert status == 200, body
            document = json.loads(body)
            assert set(document["paths"]) == {f"{WIDGETS_V1}/widgets", f"{WIDGETS_V1}/sprockets"}
            assert set(document["components"]["schemas"]) == {"widgetsList", "sprocketsList"}
            assert (headers["Content-Type"], headers["Cache-Control"]) == (
                "application/json", "no-cache, private")
            assert "Audit-Id" in headers and "Content-Encoding" not in headers
        etag = headers["ETag"]
        status, _, body = await c.get(OPENAPI_WIDGETS, headers={"If-None-Match": etag})
        assert (status, body) == (304, b"")
        # The backend and the peer were asked without the hash, as JSON, as the client.
        asked = [t for m, t in c.seen["backend"] if t.startswith(OPENAPI_WIDGETS)]
        assert asked and all(t == OPENAPI_WIDGETS for t in asked), asked
        assert [t for m, t in c.seen["peer"] if t.startswith(OPENAPI_WIDGETS)]


async def test_openapi_document_otherwise_the_backends(aiohttp_server, root):
    async with openapi_cluster(aiohttp_server, root) as c:
        await ready(c)
        # Another encoding: the backend's answer as it is (query included).
        protobuf = "application/com.github.proto-openapi.spec.v3.v1.0+protobuf"
        status, headers, body = await c.get(OPENAPI_WIDGETS, headers={"Accept": protobuf})
        assert (status, body) == (200, b"protobuf")
        # Without credentials, the backend's refusal; no peer is asked.
        before = len(c.seen["peer"])
        status, _, body = await c.get(OPENAPI_WIDGETS, who="bearer")
        assert (status, json.loads(body)["reason"]) == (401, "Unauthorized")
        assert len(c.seen["peer"]) == before
        # The peer gone: the backend's document alone.
        await c.peer_server.close()
        await c.until(_peer_unreachable(c), "the peer seen unreachable")
        status, _, body = await c.get(OPENAPI_WIDGETS)
        assert status == 200 and set(json.loads(body)["paths"]) == {f"{WIDGETS_V1}/widgets"}


def _peer_unreachable(c: Cluster):
    async def probe() -> bool:
        peers = (await c.debug()).get("peers") or {}
        return peers.get("apiserver-b", {}).get("reachable") is False
    return probe
