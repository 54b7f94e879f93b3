"""Merged discovery through the assembled daemon, between fake upstreams: what protobuf
clients get.

The backend (1.35) serves ``widgets.example.com`` v1 only; the peer (1.36) serves it
as v2 and v1, and alone serves ``gadgets.example.com``. The backend answers
``/apis/<g>`` like kube-apiserver: 401 without credentials, 403 for the token
``nodiscovery``, else its own ``APIGroup`` or 404 (``kube_like_groups``).
"""

from __future__ import annotations

import json
import uuid

from aiohttp import web
from daemon_support import (  # root: the module's PKI fixture
    Cluster,
    cluster,
    ready,
    root,  # noqa: F401
)

WIDGETS, GADGETS, NOTHING = "widgets.example.com", "gadgets.example.com", "nothing.example.com"
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
        if token == "Bearer nodiscovery":
            return web.json_response(_status(
                403, "Forbidden", f'forbidden: User "nobody" cannot get path "{request.path}"'),
                status=403, headers=audit)
        if request.match_info["group"] != WIDGETS:
            return web.json_response(_status(404, "NotFound", "the server could not find "
                                                              "the requested resource"),
                                     status=404, headers=audit)
        return web.json_response({"kind": "APIGroup", "apiVersion": "v1", "name": WIDGETS,
                                  "versions": [{"groupVersion": f"{WIDGETS}/v1",
                                                "version": "v1"}],
                                  "preferredVersion": {"groupVersion": f"{WIDGETS}/v1",
                                                       "version": "v1"}}, headers=audit)

    app.router.add_get("/apis/{group}", api_group)


def groups_cluster(aiohttp_server, root):
    return cluster(aiohttp_server, root, backend_routes=kube_like_groups,
                   backend_groups=BACKEND_GROUPS, peer_groups=PEER_GROUPS)


def _backend_saw(c: Cluster, path: str) -> int:
    return c.seen["backend"].count(("GET", path))


# --------------------------------------------------------------------------- protobuf


async def test_protobuf_discovery_gets_merged_json_or_406_never_a_partial_view(
        aiohttp_server, root):
    """staging/src/k8s.io/apiserver/pkg/endpoints/discovery/aggregated/wrapper.go serves
    the peer-aggregated document in any encoding, protobuf too. mvproxy encodes JSON
    only, and the backend's protobuf lacks peer-only APIs: a protobuf clause is skipped
    for the client's next one (406 if none is left), except ``profile=nopeer``, which
    asks for the backend's own view anyway (and is counted, as upstream counts it)."""
    async with groups_cluster(aiohttp_server, root) as c:
        await ready(c)
        status, headers, body = await c.get("/apis", headers={
            "Accept": f"{PROTOBUF_AGG},application/json"})
        assert status == 200, body
        assert headers["Content-Type"] == "application/json"
        listed = {g["name"] for g in json.loads(body)["groups"]}
        assert {GADGETS, WIDGETS} <= listed

        status, _, body = await c.get("/apis", headers={"Accept": PROTOBUF_AGG})
        assert status == 406, body
        assert json.loads(body)["reason"] == "NotAcceptable"

        before = await c.metric(NOPEER) or 0.0
        status, _, body = await c.get("/apis", headers={
            "Accept": f"{PROTOBUF_AGG};profile=nopeer"})
        assert status == 200, body
        own = json.loads(body)  # the fake backend's own document (JSON, being a fake)
        assert GADGETS not in {g["metadata"]["name"] for g in own["items"]}
        assert await c.metric(NOPEER) == before + 1
