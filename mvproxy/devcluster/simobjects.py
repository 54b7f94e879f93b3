"""What a resource request addresses, and the object rules every verb shares.

``resolve`` turns a RequestInfo into a :class:`Target` (catalog entry, scope, verb)
or the exact error kube-apiserver gives for that URL. The rest are the checks kube
makes on request bodies (apiVersion, kind, name, namespace) and how objects are
presented in responses (apiVersion/kind of the URL, since every version shares one
stored object, as in etcd).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

import yaml
from aiohttp import web

from mvproxy.requestinfo import RequestInfo

from . import apistatus, protobuf
from .catalog import Catalog, ResourceEntry, SubresourceEntry
from .store import Key

JSON_TYPES = frozenset(("application/json", ""))
YAML_TYPES = frozenset(("application/yaml", "application/apply-patch+yaml"))
# Only list and watch are registered across all namespaces for namespaced resources.
_CLUSTER_WIDE_VERBS = frozenset(("list", "watch"))

_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN_HELP = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
    "'-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
    "regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_LABEL_HELP = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
    "regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')")


class RequestError(Exception):
    """Carries the kube error response for a request that cannot go on."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.text)
        self.response = response


@dataclass(frozen=True)
class Target:
    """A resource request resolved against the catalog."""

    info: RequestInfo
    entry: ResourceEntry
    sub: SubresourceEntry | None
    namespace: str  # "" for cluster-scoped resources and all-namespaces requests

    @property
    def group(self) -> str:
        return self.info.api_group

    @property
    def resource(self) -> str:
        return self.entry.resource

    @property
    def api_version(self) -> str:
        g, v = self.info.api_group, self.info.api_version
        return f"{g}/{v}" if g else v

    @property
    def path_name(self) -> str:
        """The object name in the path (not one taken from a field selector)."""
        return self.info.parts[1] if len(self.info.parts) > 1 else ""

    def key(self, name: str) -> Key:
        return Key(self.group, self.resource, self.namespace, name)

    def scope(self) -> str | None:
        """The namespace to list in; None means every namespace."""
        return self.namespace if self.entry.namespaced and self.namespace else None

    def error_not_found(self, name: str) -> web.Response:
        return apistatus.object_not_found(self.group, self.resource, name)


def resolve(catalog: Catalog, info: RequestInfo) -> Target:
    """The catalog entry a URL names; RequestError with kube's 404/405 otherwise."""
    entry = catalog.resource(info.api_group, info.api_version, info.resource)
    if entry is None or len(info.parts) > 3:
        raise RequestError(apistatus.path_not_found())
    sub = entry.subresource(info.subresource) if info.subresource else None
    if info.subresource and sub is None:
        raise RequestError(apistatus.path_not_found())
    namespace = info.namespace
    if not entry.namespaced:
        if namespace and entry.resource != "namespaces":
            raise RequestError(apistatus.path_not_found())
        namespace = ""
    elif not namespace and info.verb not in _CLUSTER_WIDE_VERBS:
        # kube has no route for /pods/<name> (404) nor POST/DELETE on /pods (405).
        raise RequestError(apistatus.path_not_found() if len(info.parts) > 1
                           else apistatus.method_not_allowed())
    verbs = sub.verbs if sub else entry.verbs
    named = len(info.parts) > 1
    # Collections take no PUT/PATCH; a named object takes no POST (except subresources).
    misplaced = (info.verb in ("update", "patch") and not named) or (
        info.verb == "create" and named and sub is None)
    if info.verb not in verbs or misplaced:
        raise RequestError(apistatus.method_not_allowed())
    return Target(info, entry, sub, namespace)


# --- bodies --------------------------------------------------------------------------


async def read_body(request: web.Request) -> object:
    """The decoded request body (JSON or YAML); 415/400 as kube answers bad input."""
    raw = await request.read()
    ctype = request.content_type if request.headers.get("Content-Type") else ""
    try:
        if ctype == protobuf.CONTENT_TYPE:
            return protobuf.decode(raw)
        if ctype in YAML_TYPES:
            return yaml.safe_load(raw.decode()) if raw.strip() else None
        if ctype in JSON_TYPES or ctype.endswith("+json"):
            return json.loads(raw) if raw.strip() else None
    except protobuf.ProtobufError as exc:
        raise RequestError(apistatus.status_response(415, str(exc))) from None
    except (ValueError, yaml.YAMLError) as exc:
        raise RequestError(apistatus.bad_request(f"error decoding request body: {exc}")) from None
    raise RequestError(apistatus.unsupported_media_type())


def check_object(t: Target, body: object, *, kind: str | None = None,
                 api_version: str | None = None) -> dict:
    """kube's decode checks: an object whose apiVersion and kind fit the URL.

    Missing apiVersion/kind are filled in from the URL, as kube's defaulting decoder does.
    """
    if not isinstance(body, dict):
        raise RequestError(apistatus.bad_request("the request body must be a JSON object"))
    kind = kind or (t.sub.kind if t.sub and t.sub.kind else t.entry.kind)
    api_version = api_version or t.api_version
    got_version = body.get("apiVersion") or api_version
    got_kind = body.get("kind") or kind
    if got_version != api_version:
        raise RequestError(apistatus.bad_request(
            f"the API version in the data ({got_version}) does not match the expected "
            f"API version ({api_version})"))
    if got_kind != kind:
        raise RequestError(apistatus.bad_request(
            f'{got_kind} in version "{got_version}" cannot be handled as a {kind}'))
    if body.get("metadata") is None:
        body["metadata"] = {}
    check_metadata(t, body, kind)
    return body


_STRING_FIELDS = ("name", "generateName", "namespace", "resourceVersion")
_MAP_FIELDS = ("labels", "annotations")


def _shown(value: object) -> str:
    """A value as kube's ``field.Invalid`` prints it (strings quoted)."""
    return json.dumps(value, separators=(",", ":"), default=str)


def check_metadata(t: Target, body: dict, kind: str) -> None:
    """422 Invalid unless metadata is an object whose name, generateName, namespace and
    resourceVersion are strings and whose labels and annotations map strings to strings.

    ``null`` fields are dropped, as kube decodes them to the empty value. Without this a
    badly typed field would be stored and break every later selector on the resource.
    """
    meta = body["metadata"]
    problems: list[str] = []
    if not isinstance(meta, dict):
        problems.append(f"metadata: Invalid value: {_shown(meta)}: must be of type object")
        meta = {}
    for key in _STRING_FIELDS:
        if key in meta and meta[key] is None:
            del meta[key]
        elif key in meta and not isinstance(meta[key], str):
            problems.append(f"metadata.{key}: Invalid value: {_shown(meta[key])}: "
                            "must be of type string")
    for key in _MAP_FIELDS:
        value = meta.get(key)
        if key in meta and value is None:
            del meta[key]
        elif key in meta and not isinstance(value, dict):
            problems.append(f"metadata.{key}: Invalid value: {_shown(value)}: "
                            "must be a map of string to string")
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    problems.append(f"metadata.{key}: Invalid value: {_shown(k)}: "
                                    "keys must be of type string")
                elif not isinstance(v, str):
                    problems.append(f"metadata.{key}[{k}]: Invalid value: {_shown(v)}: "
                                    "must be of type string")
    if not problems:
        return
    name = meta.get("name") if isinstance(meta.get("name"), str) else t.path_name
    message = problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]"
    raise RequestError(apistatus.invalid(t.group, t.resource, kind, name or "", message))


def check_url_name(t: Target, obj: dict) -> None:
    """On update and patch the body's name must be the URL's (kube: 400)."""
    name = obj["metadata"].get("name") or t.path_name
    if name != t.path_name:
        raise RequestError(apistatus.bad_request(
            f"the name of the object ({name}) does not match the name on the URL "
            f"({t.path_name})"))
    obj["metadata"]["name"] = name


def check_namespace(t: Target, obj: dict) -> None:
    """A namespace in the body must be the URL's; cluster-scoped objects drop it."""
    meta = obj["metadata"]
    if not t.entry.namespaced:
        meta.pop("namespace", None)
        return
    if meta.get("namespace", t.namespace) != t.namespace:
        raise RequestError(apistatus.bad_request(
            "the namespace of the provided object does not match the namespace sent on "
            "the request"))
    meta["namespace"] = t.namespace


def name_for_create(t: Target, obj: dict) -> str:
    """metadata.name, or generateName plus five random characters; 422 when invalid."""
    meta = obj["metadata"]
    name = meta.get("name") or ""
    if not name and meta.get("generateName"):
        alphabet = "bcdfghjklmnpqrstvwxz2456789"
        name = meta["generateName"] + "".join(secrets.choice(alphabet) for _ in range(5))
    if not name:
        raise RequestError(apistatus.invalid(
            t.group, t.resource, t.entry.kind, "",
            "metadata.name: Required value: name or generateName is required"))
    label = t.resource == "namespaces"
    pattern, help_text = (_LABEL, _LABEL_HELP) if label else (_SUBDOMAIN, _SUBDOMAIN_HELP)
    if len(name) > (63 if label else 253) or not pattern.fullmatch(name):
        raise RequestError(apistatus.invalid(
            t.group, t.resource, t.entry.kind, name,
            f'metadata.name: Invalid value: "{name}": {help_text}'))
    meta["name"] = name
    return name


def apply_defaults(t: Target, obj: dict) -> None:
    """The few defaults clients rely on: a Running, Ready pod (kubectl exec; kr8s polls
    the Ready and ContainersReady conditions before exec), an Active namespace."""
    if t.group == "" and t.resource == "pods":
        status = obj.setdefault("status", {})
        status.setdefault("phase", "Running")
        status.setdefault("conditions", [{"type": c, "status": "True"} for c in (
            "PodScheduled", "Initialized", "ContainersReady", "Ready")])
    elif t.group == "" and t.resource == "secrets":
        obj["type"] = obj.get("type") or "Opaque"
    elif t.group == "" and t.resource == "namespaces":
        name = obj["metadata"]["name"]
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj.setdefault("status", {}).setdefault("phase", "Active")


# --- responses ---------------------------------------------------------------------


def present(t: Target, obj: dict) -> dict:
    """The object as the URL's version shows it: kind and apiVersion first, as kube."""
    rest = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
    return {"kind": t.entry.kind, "apiVersion": t.api_version, **rest}


def json_response(doc: object, status: int = 200) -> web.Response:
    body = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    return web.Response(status=status, body=body, headers={"Content-Type": "application/json"})


def success_status(code: int = 200) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "code": code}


def dry_run(request: web.Request) -> bool:
    """``dryRun=All``: validate, answer, store nothing. Other values are a 400, as in kube."""
    values = request.query.getall("dryRun", [])
    for value in values:
        if value != "All":
            raise RequestError(apistatus.bad_request(
                f'dryRun: Unsupported value: "{value}": supported values: "All"'))
    return bool(values)
