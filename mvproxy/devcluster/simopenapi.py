"""A skeletal OpenAPI v3, just enough for kubectl's field-validation check.

Before ``kubectl create -f`` / ``apply -f`` send ``fieldValidation=Strict``, kubectl
looks in ``/openapi/v3/<group-version>`` for the resource's PATCH operation (matched
by ``x-kubernetes-group-version-kind``) and its ``fieldValidation`` query parameter;
when it finds none it falls back to client-side validation, which needs the full
protobuf OpenAPI v2 we do not have. So each group/version gets a document listing
one PATCH operation per patchable resource and no schemas. ``kubectl explain`` gets
nothing useful from it; that is accepted.
"""

from __future__ import annotations

import hashlib

from aiohttp import web

from . import apistatus
from .catalog import Catalog, GroupEntry, ResourceEntry, VersionEntry
from .simdiscovery import dump

PREFIX = "/openapi/v3"


def _item_path(group: str, version: str, resource: ResourceEntry) -> str:
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    scope = "/namespaces/{namespace}" if resource.namespaced else ""
    return f"{base}{scope}/{resource.resource}/{{name}}"


def _patch_operation(group: str, version: str, resource: ResourceEntry) -> dict:
    query = [{"name": n, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
             for n in ("dryRun", "fieldManager", "fieldValidation", "force")]
    return {"patch": {
        "operationId": f"patch{resource.kind}",
        "parameters": query,
        "responses": {"200": {"description": "OK"}},
        "x-kubernetes-action": "patch",
        "x-kubernetes-group-version-kind": {"group": group, "kind": resource.kind,
                                            "version": version},
    }}


def _document(catalog: Catalog, group: GroupEntry, version: VersionEntry) -> dict:
    paths = {_item_path(group.name, version.version, r):
             _patch_operation(group.name, version.version, r)
             for r in version.resources if "patch" in r.verbs}
    return {"openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": catalog.git_version},
            "paths": paths, "components": {"schemas": {}}}


class OpenAPI:
    """``/openapi/v3`` (the index) and one document per group/version, rendered once."""

    def __init__(self, catalog: Catalog) -> None:
        self.documents: dict[str, bytes] = {}
        index: dict[str, dict] = {}
        for group in catalog.groups:
            for version in group.versions:
                key = (f"apis/{group.name}/{version.version}" if group.name
                       else f"api/{version.version}")
                body = dump(_document(catalog, group, version))
                digest = hashlib.sha512(body).hexdigest()[:32].upper()
                self.documents[key] = body
                index[key] = {"serverRelativeURL": f"{PREFIX}/{key}?hash={digest}"}
        self.index = dump({"paths": index})

    def handle(self, request: web.Request) -> web.Response:
        rest = request.path[len(PREFIX):].strip("/")
        body = self.index if not rest else self.documents.get(rest)
        if body is None:
            return apistatus.path_not_found()
        return web.Response(body=body, headers={"Content-Type": "application/json"})
