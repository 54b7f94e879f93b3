"""``/openapi/v3``: the index and one document per group/version, with real schemas.

kubectl reads these for two things. ``kubectl explain`` finds the schema whose
``x-kubernetes-group-version-kind`` names the kind and prints its field docs; the
schemas are the release's real ones (``openapi/1.NN.json.gz``, derived by
``scripts/gen_openapi.py`` from the published schemas ``kubernetes-validate`` ships).
Before ``create -f`` / ``apply -f`` send ``fieldValidation=Strict``, kubectl looks for
the resource's PATCH operation and its ``fieldValidation`` parameter; so each
document lists one PATCH operation per patchable resource (the sim validates nothing
server-side beyond what it always did). A document holds its group/version's kinds
and every schema they reference, as kube's do.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from functools import lru_cache
from importlib import resources

from aiohttp import web

from . import apistatus
from .catalog import Catalog, GroupEntry, ResourceEntry, VersionEntry
from .simdiscovery import dump

PREFIX = "/openapi/v3"
_REF = "#/components/schemas/"


@lru_cache(maxsize=2)
def release_schemas(version: str) -> dict[str, dict]:
    """All component schemas of release ``version`` ("1.36"); {} if none ship."""
    data = resources.files(__package__).joinpath("openapi", f"{version}.json.gz")
    try:
        return json.loads(gzip.decompress(data.read_bytes()))
    except FileNotFoundError:
        return {}


def _refs(node: object, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_REF):
            found.add(ref[len(_REF):])
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def _schemas_for(schemas: dict[str, dict], group: str, version: str) -> dict[str, dict]:
    """The group/version's kinds and, transitively, every schema they reference."""
    roots = [name for name, schema in schemas.items()
             if any(g.get("group") == group and g.get("version") == version
                    for g in schema.get("x-kubernetes-group-version-kind", ()))]
    kept: dict[str, dict] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in kept or name not in schemas:
            continue
        kept[name] = schemas[name]
        found: set[str] = set()
        _refs(schemas[name], found)
        todo.extend(found - kept.keys())
    return dict(sorted(kept.items()))


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


def _document(catalog: Catalog, group: GroupEntry, version: VersionEntry,
              schemas: dict[str, dict]) -> dict:
    paths = {_item_path(group.name, version.version, r):
             _patch_operation(group.name, version.version, r)
             for r in version.resources if "patch" in r.verbs}
    return {"openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": catalog.git_version},
            "paths": paths,
            "components": {"schemas": _schemas_for(schemas, group.name, version.version)}}


class OpenAPI:
    """``/openapi/v3`` (the index) and one document per group/version, rendered once."""

    def __init__(self, catalog: Catalog) -> None:
        self.documents: dict[str, bytes] = {}
        self.etags: dict[str, str] = {}
        index: dict[str, dict] = {}
        schemas = release_schemas(catalog.kubernetes_version)
        for group in catalog.groups:
            for version in group.versions:
                key = (f"apis/{group.name}/{version.version}" if group.name
                       else f"api/{version.version}")
                body = dump(_document(catalog, group, version, schemas))
                digest = hashlib.sha512(body).hexdigest()[:32].upper()
                self.documents[key] = body
                self.etags[key] = f'"{digest}"'
                index[key] = {"serverRelativeURL": f"{PREFIX}/{key}?hash={digest}"}
        self.index = dump({"paths": index})

    def handle(self, request: web.Request) -> web.Response:
        rest = request.path[len(PREFIX):].strip("/")
        if not rest:
            # kube-openapi labels the index as text (clients parse it as JSON anyway).
            return web.Response(body=self.index,
                                headers={"Content-Type": "text/plain; charset=utf-8"})
        body = self.documents.get(rest)
        if body is None:
            return apistatus.path_not_found()
        return web.Response(body=body, headers={"Content-Type": "application/json",
                                                "ETag": self.etags[rest]})
