"""``/openapi/v2``: the release's real schemas as a Swagger 2.0 document.

kubectl before 1.27 has no OpenAPI v3 client: ``explain`` and client-side validation
(``apply``/``create``/``diff`` without ``--validate=false``) fetch ``/openapi/v2`` in
protobuf (gnostic's ``openapi.v2.Document``) and find a kind's schema by the
``x-kubernetes-group-version-kind`` extension of each definition. The definitions are
the same schemas ``/openapi/v3`` serves (``simopenapi``), turned back into v2 form:
``#/definitions/`` references, ``allOf: [$ref]`` wrappers unwrapped. ``paths`` holds
only each patchable resource's PATCH operation with its GVK and ``dryRun`` parameter:
``kubectl diff`` (1.20) looks there to decide that the server supports dry-run. JSON
is answered to a client that does not ask for protobuf, as kube does.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from aiohttp import web

from . import protoencode as pb
from .catalog import Catalog
from .simdiscovery import dump
from .simopenapi import _item_path, _schemas_for, release_schemas

PATH = "/openapi/v2"
#: What client-go asks for; the ``@`` makes it no valid media type to answer with, so
#: the answer is labelled with the dotted form (Go's mime parser rejects the ``@``).
PROTOBUF = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"
PROTOBUF_ANSWER = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
_V3_REF, _V2_REF = "#/components/schemas/", "#/definitions/"

# gnostic openapiv2/OpenAPIv2.proto field numbers.
_DOC_SWAGGER, _DOC_INFO, _DOC_PATHS, _DOC_DEFINITIONS = 1, 2, 8, 9
_INFO_TITLE, _INFO_VERSION = 1, 2
_NAMED_NAME, _NAMED_VALUE = 1, 2          # NamedSchema, NamedAny
_ANY_YAML = 2                             # Any.yaml
_S_REF, _S_FORMAT, _S_TITLE, _S_DESCRIPTION = 1, 2, 3, 4
_S_REQUIRED, _S_ADDITIONAL, _S_TYPE, _S_ITEMS = 19, 21, 22, 23
_S_ALL_OF, _S_PROPERTIES, _S_EXTENSION = 24, 25, 31
_ADDITIONAL_SCHEMA, _ADDITIONAL_BOOL = 1, 2  # AdditionalPropertiesItem
_REPEATED_ONE = 1  # TypeItem.value, ItemsItem.schema, Properties/Definitions entries
_PATHS_PATH, _PATH_ITEM_PATCH = 2, 8      # Paths.path (NamedPathItem), PathItem.patch
_OP_ID, _OP_PARAMETERS, _OP_EXTENSION = 5, 8, 13
_ITEM_PARAMETER, _PARAMETER_NON_BODY, _NON_BODY_QUERY = 1, 2, 3
_QUERY_IN, _QUERY_NAME, _QUERY_TYPE, _QUERY_UNIQUE = 2, 4, 6, 20
_QUERY_PARAMETERS = ("dryRun", "fieldManager", "force")


def v2_schema(node: Any) -> Any:
    """A v3 component schema in v2 form (refs, and ``allOf`` around a lone ``$ref``)."""
    if isinstance(node, list):
        return [v2_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v2_schema(v) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith(_V3_REF):
        out["$ref"] = _V2_REF + ref[len(_V3_REF):]
    all_of = out.get("allOf")
    if (isinstance(all_of, list) and len(all_of) == 1 and isinstance(all_of[0], dict)
            and set(all_of[0]) == {"$ref"} and "$ref" not in out):
        del out["allOf"]
        out["$ref"] = all_of[0]["$ref"]
    return out


def document(catalog: Catalog) -> dict:
    """The v2 document: every schema of the group/versions this server serves."""
    schemas = release_schemas(catalog.kubernetes_version)
    definitions: dict[str, dict] = {}
    paths: dict[str, dict] = {}
    for group in catalog.groups:
        for version in group.versions:
            definitions.update(_schemas_for(schemas, group.name, version.version))
            for resource in version.resources:
                if "patch" in resource.verbs:
                    paths[_item_path(group.name, version.version, resource)] = {"patch": {
                        "operationId": f"patch{resource.kind}",
                        "parameters": [{"name": n, "in": "query", "type": "string",
                                        "uniqueItems": True} for n in _QUERY_PARAMETERS],
                        "x-kubernetes-action": "patch",
                        "x-kubernetes-group-version-kind": {
                            "group": group.name, "kind": resource.kind,
                            "version": version.version}}}
    return {"swagger": "2.0",
            "info": {"title": "Kubernetes", "version": catalog.git_version},
            "paths": paths,
            "definitions": {name: v2_schema(definitions[name])
                            for name in sorted(definitions)}}


def _named(name: str, value: bytes) -> bytes:
    return pb.length_delimited(_NAMED_NAME, name) + pb.length_delimited(_NAMED_VALUE, value)


def encode_schema(schema: dict) -> bytes:
    """One ``openapi.v2.Schema``: the fields kube-openapi's proto model reads."""
    out = bytearray()
    for number, field in ((_S_REF, "$ref"), (_S_FORMAT, "format"), (_S_TITLE, "title"),
                          (_S_DESCRIPTION, "description")):
        if isinstance(schema.get(field), str):
            out += pb.length_delimited(number, schema[field])
    for name in schema.get("required") or ():
        if isinstance(name, str):
            out += pb.length_delimited(_S_REQUIRED, name)
    extra = schema.get("additionalProperties")
    if isinstance(extra, bool):
        out += pb.length_delimited(_S_ADDITIONAL, pb.boolean(_ADDITIONAL_BOOL, extra))
    elif isinstance(extra, dict):
        out += pb.length_delimited(
            _S_ADDITIONAL, pb.length_delimited(_ADDITIONAL_SCHEMA, encode_schema(extra)))
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if kinds:
        out += pb.length_delimited(_S_TYPE, b"".join(
            pb.length_delimited(_REPEATED_ONE, k) for k in kinds if isinstance(k, str)))
    items = schema.get("items")
    items = [items] if isinstance(items, dict) else items if isinstance(items, list) else []
    if items:
        out += pb.length_delimited(_S_ITEMS, b"".join(
            pb.length_delimited(_REPEATED_ONE, encode_schema(i))
            for i in items if isinstance(i, dict)))
    for part in schema.get("allOf") or ():
        if isinstance(part, dict):
            out += pb.length_delimited(_S_ALL_OF, encode_schema(part))
    properties = schema.get("properties")
    if isinstance(properties, dict):
        out += pb.length_delimited(_S_PROPERTIES, b"".join(
            pb.length_delimited(_REPEATED_ONE, _named(name, encode_schema(value)))
            for name, value in properties.items() if isinstance(value, dict)))
    out += _extensions(schema, _S_EXTENSION)
    return bytes(out)


def _extensions(node: dict, number: int) -> bytes:
    out = bytearray()
    for name, value in node.items():
        if name.startswith("x-"):  # JSON is YAML; kube-openapi parses the YAML text
            any_value = pb.length_delimited(_ANY_YAML, json.dumps(value) + "\n")
            out += pb.length_delimited(number, _named(name, any_value))
    return bytes(out)


def encode_patch_operation(operation: dict) -> bytes:
    """One ``openapi.v2.Operation`` with query parameters and vendor extensions."""
    out = bytearray(pb.length_delimited(_OP_ID, operation["operationId"]))
    for param in operation["parameters"]:
        query = (pb.length_delimited(_QUERY_IN, param["in"])
                 + pb.length_delimited(_QUERY_NAME, param["name"])
                 + pb.length_delimited(_QUERY_TYPE, param["type"])
                 + pb.boolean(_QUERY_UNIQUE, param["uniqueItems"]))
        non_body = pb.length_delimited(_NON_BODY_QUERY, query)
        parameter = pb.length_delimited(_PARAMETER_NON_BODY, non_body)
        out += pb.length_delimited(_OP_PARAMETERS,
                                   pb.length_delimited(_ITEM_PARAMETER, parameter))
    out += _extensions(operation, _OP_EXTENSION)
    return bytes(out)


def encode_document(doc: dict) -> bytes:
    """The whole ``openapi.v2.Document`` (swagger, info, PATCH paths, definitions)."""
    info = (pb.length_delimited(_INFO_TITLE, doc["info"]["title"])
            + pb.length_delimited(_INFO_VERSION, doc["info"]["version"]))
    paths = b"".join(
        pb.length_delimited(_PATHS_PATH, _named(path, pb.length_delimited(
            _PATH_ITEM_PATCH, encode_patch_operation(item["patch"]))))
        for path, item in doc["paths"].items())
    definitions = b"".join(
        pb.length_delimited(_REPEATED_ONE, _named(name, encode_schema(schema)))
        for name, schema in doc["definitions"].items())
    return (pb.length_delimited(_DOC_SWAGGER, doc["swagger"])
            + pb.length_delimited(_DOC_INFO, info)
            + pb.length_delimited(_DOC_PATHS, paths)
            + pb.length_delimited(_DOC_DEFINITIONS, definitions))


def wants_protobuf(accept: str) -> bool:
    """kube answers protobuf only to a client that names the gnostic media type."""
    return any(part.split(";")[0].strip().lower() in (PROTOBUF.lower(), PROTOBUF_ANSWER)
               for part in accept.split(","))


class OpenAPIV2:
    """``GET /openapi/v2``; both encodings rendered on first use and kept."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog
        self._json: bytes | None = None
        self._protobuf: bytes | None = None
        self._etag = ""

    def _render(self) -> None:
        doc = document(self._catalog)
        self._json = dump(doc)
        self._protobuf = encode_document(doc)
        # kube serves the document with a strong ETag of its content
        self._etag = '"' + hashlib.sha512(self._json).hexdigest()[:32].upper() + '"'

    def handle(self, request: web.Request) -> web.Response:
        if self._json is None:
            self._render()
        if wants_protobuf(request.headers.get("Accept", "")):
            return web.Response(body=self._protobuf, headers={"Content-Type": PROTOBUF_ANSWER})
        return web.Response(body=self._json, headers={"Content-Type": "application/json",
                                                      "ETag": self._etag})
