"""What a resource request addresses, and the object rules every verb shares.

``resolve`` turns a RequestInfo into a :class:`Target` (catalog entry, scope, verb)
or the exact error kube-apiserver gives for that URL. The rest are the checks kube
makes on request bodies (apiVersion, kind, name, namespace) and how objects are
presented in responses (apiVersion/kind of the URL, since every version shares one
stored object, as in etcd).
"""

from __future__ import annotations

import base64
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
    if entry is None and info.api_group and catalog.group(info.api_group) is None:
        raise RequestError(apistatus.page_not_found())  # no handler for the group at all
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
        problems = [*_label_problems(meta.get("labels")), *_data_key_problems(t, body)]
    if not problems:
        return
    name = meta.get("name") if isinstance(meta.get("name"), str) else t.path_name
    raise RequestError(apistatus.invalid(t.group, kind, name or "", *problems))


_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_LABEL_VALUE_HELP = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' "
    "or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
    "'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
_NAME_PART_HELP = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and "
    "end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex "
    "used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
_CONFIG_KEY_HELP = (
    "a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. "
    "'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is "
    "'[-._a-zA-Z0-9]+')")


def _label_problems(labels: object) -> list[str]:
    """kube's label checks: each key a qualified name, each value at most 63 bytes of
    the label alphabet; reported on ``metadata.labels`` as kube does."""
    if not isinstance(labels, dict):
        return []
    problems = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if len(name) > 63:
            problems.append(f"metadata.labels: Invalid value: {_shown(key)}: name part must "
                            "be no more than 63 bytes")
        elif not _QUALIFIED_NAME.fullmatch(name):
            problems.append(f"metadata.labels: Invalid value: {_shown(key)}: {_NAME_PART_HELP}")
        elif prefix and (len(prefix) > 253 or not _SUBDOMAIN.fullmatch(prefix)):
            problems.append(f"metadata.labels: Invalid value: {_shown(key)}: prefix part "
                            f"{_SUBDOMAIN_HELP}")
        if len(value.encode()) > 63:
            problems.append(f"metadata.labels: Invalid value: {_shown(value)}: must be no more "
                            "than 63 bytes")
        elif not _LABEL_VALUE.fullmatch(value):
            problems.append(f"metadata.labels: Invalid value: {_shown(value)}: "
                            f"{_LABEL_VALUE_HELP}")
    return problems


def _data_key_problems(t: Target, body: dict) -> list[str]:
    """ConfigMap and Secret keys: kube's config-key alphabet, at most 253 characters."""
    if t.group != "" or t.resource not in ("configmaps", "secrets") or t.sub is not None:
        return []
    fields = ("data", "binaryData") if t.resource == "configmaps" else ("data", "stringData")
    problems = []
    for where in fields:
        section = body.get(where)
        if not isinstance(section, dict):
            continue
        for key in section:
            if not isinstance(key, str):
                continue
            if len(key) > 253:
                problems.append(f"{where}[{key}]: Invalid value: {_shown(key)}: must be no "
                                "more than 253 characters")
            elif not _CONFIG_KEY.fullmatch(key) or key in (".", ".."):
                detail = (_CONFIG_KEY_HELP if key not in (".", "..")
                          else f"must not be '{key}'")
                problems.append(f"{where}[{key}]: Invalid value: {_shown(key)}: {detail}")
    return problems


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
            t.group, t.entry.kind, "",
            "metadata.name: Required value: name or generateName is required"))
    label = t.resource == "namespaces"
    pattern, help_text = (_LABEL, _LABEL_HELP) if label else (_SUBDOMAIN, _SUBDOMAIN_HELP)
    if len(name) > (63 if label else 253) or not pattern.fullmatch(name):
        raise RequestError(apistatus.invalid(
            t.group, t.entry.kind, name, f'metadata.name: Invalid value: "{name}": {help_text}'))
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
        fold_string_data(obj)
    elif t.group == "" and t.resource == "namespaces":
        name = obj["metadata"]["name"]
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = name
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj.setdefault("status", {}).setdefault("phase", "Active")


def fold_string_data(secret: dict) -> None:
    """A Secret's write-only ``stringData`` merged into ``data`` (base64), as kube does
    on every write; it is never stored or shown."""
    strings = secret.pop("stringData", None)
    if not isinstance(strings, dict) or not strings:
        return
    current = secret.get("data")
    data: dict = current if isinstance(current, dict) else {}
    for key, value in strings.items():
        if isinstance(key, str) and isinstance(value, str):
            data[key] = base64.b64encode(value.encode()).decode()
    secret["data"] = data


# --- responses ---------------------------------------------------------------------


#: Resources whose objects carry ``metadata.generation`` (their registry strategies set
#: it), measured on kube-apiserver 1.36.3 (with the admission and webhook
#: configurations and flow-control levels that share those strategies' code).
GENERATION_TRACKED = frozenset((
    ("", "pods"), ("", "podtemplates"), ("", "replicationcontrollers"),
    ("apps", "deployments"), ("apps", "replicasets"), ("apps", "statefulsets"),
    ("apps", "daemonsets"), ("batch", "jobs"), ("batch", "cronjobs"),
    ("networking.k8s.io", "networkpolicies"), ("networking.k8s.io", "ingresses"),
    ("policy", "poddisruptionbudgets"), ("discovery.k8s.io", "endpointslices"),
    ("scheduling.k8s.io", "priorityclasses"),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"),
    ("admissionregistration.k8s.io", "validatingadmissionpolicies"),
    ("admissionregistration.k8s.io", "validatingadmissionpolicybindings"),
    ("admissionregistration.k8s.io", "mutatingadmissionpolicies"),
    ("admissionregistration.k8s.io", "mutatingadmissionpolicybindings"),
    ("flowcontrol.apiserver.k8s.io", "flowschemas"),
    ("flowcontrol.apiserver.k8s.io", "prioritylevelconfigurations"),
    ("apiextensions.k8s.io", "customresourcedefinitions"),
))
#: Measured without it (1.36.3): data and identity objects, and a few with a status.
GENERATION_UNTRACKED = frozenset((
    ("", "configmaps"), ("", "secrets"), ("", "serviceaccounts"), ("", "services"),
    ("", "endpoints"), ("", "events"), ("", "limitranges"), ("", "resourcequotas"),
    ("", "persistentvolumeclaims"), ("", "persistentvolumes"), ("", "namespaces"),
    ("", "nodes"), ("coordination.k8s.io", "leases"), ("events.k8s.io", "events"),
    ("rbac.authorization.k8s.io", "roles"), ("rbac.authorization.k8s.io", "rolebindings"),
    ("rbac.authorization.k8s.io", "clusterroles"),
    ("rbac.authorization.k8s.io", "clusterrolebindings"),
    ("storage.k8s.io", "storageclasses"), ("node.k8s.io", "runtimeclasses"),
    ("autoscaling", "horizontalpodautoscalers"),
))


def tracks_generation(t: Target) -> bool:
    """Whether kube sets ``metadata.generation`` on this resource's objects: as measured,
    else (for kinds not measured) whether it has a spec/status split."""
    key = (t.group, t.resource)
    if key in GENERATION_TRACKED:
        return True
    if key in GENERATION_UNTRACKED:
        return False
    return t.entry.subresource("status") is not None


def present(t: Target, obj: dict) -> dict:
    """The object as the URL's version shows it: kind and apiVersion first, as kube;
    ``metadata.generation`` only where kube keeps one (the store counts it for all)."""
    rest = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
    meta = rest.get("metadata")
    if isinstance(meta, dict) and "generation" in meta and not tracks_generation(t):
        rest["metadata"] = {k: v for k, v in meta.items() if k != "generation"}
    return {"kind": t.entry.kind, "apiVersion": t.api_version, **rest}


def present_item(t: Target, obj: dict) -> dict:
    """An object as an item of a list: kube writes no kind or apiVersion there (the list
    carries them)."""
    shown = present(t, obj)
    del shown["kind"], shown["apiVersion"]
    return shown


#: Resources whose DELETE answers with the object (their registry returns the deleted
#: object, or it lingers with a finalizer or grace period), measured on 1.36.3; every
#: other resource answers with a Success Status naming it.
RETURNS_DELETED_OBJECT = frozenset((
    ("", "pods"), ("", "services"), ("", "serviceaccounts"), ("", "resourcequotas"),
    ("", "persistentvolumeclaims"), ("", "persistentvolumes"), ("", "podtemplates"),
    ("", "replicationcontrollers"), ("", "namespaces"), ("batch", "jobs"),
    ("storage.k8s.io", "storageclasses"), ("apiextensions.k8s.io", "customresourcedefinitions"),
))


def deleted_answer(t: Target, obj: dict) -> dict:
    """What a DELETE of ``obj`` answers: the object for the resources above, else kube's
    ``Status`` ``Success`` with the object's name, group, resource and uid."""
    if (t.group, t.resource) in RETURNS_DELETED_OBJECT:
        return present(t, obj)
    meta = obj.get("metadata") or {}
    details: dict = {"name": meta.get("name", t.path_name)}
    if t.group:
        details["group"] = t.group
    details["kind"] = t.resource
    if meta.get("uid"):
        details["uid"] = meta["uid"]
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": details}


def json_response(doc: object, status: int = 200) -> web.Response:
    body = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    return web.Response(status=status, body=body, headers={"Content-Type": "application/json"})


def success_status(code: int = 200) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "code": code}


_RV_MATCHES = ("Exact", "NotOlderThan")


def _list_options_invalid(*problems: str) -> RequestError:
    return RequestError(apistatus.invalid("meta.k8s.io", "ListOptions", "", *problems))


def check_list_options(request: web.Request, *, watch: bool) -> int | None:
    """kube's checks of a list or watch's resourceVersion options, in its order: 422 for
    combinations ListOptions validation forbids, 400 for a resourceVersion that is not a
    number. Returns the resourceVersion as a number (None when unset)."""
    q = request.query
    rv, match = q.get("resourceVersion", ""), q.get("resourceVersionMatch", "")
    initial = q.get("sendInitialEvents")
    if match:
        if match not in _RV_MATCHES:
            raise _list_options_invalid(
                f'resourceVersionMatch: Unsupported value: "{match}": supported values: '
                + ", ".join(f'"{m}"' for m in _RV_MATCHES))
        if watch and initial is None:
            raise _list_options_invalid("resourceVersionMatch: Forbidden: "
                                        "resourceVersionMatch is forbidden for watch unless "
                                        "sendInitialEvents is provided")
        if not rv and not (watch and initial is not None):
            raise _list_options_invalid("resourceVersionMatch: Forbidden: "
                                        "resourceVersionMatch is forbidden unless "
                                        "resourceVersion is provided")
        if match == "Exact" and rv == "0":
            raise _list_options_invalid('resourceVersionMatch: Forbidden: '
                                        'resourceVersionMatch "exact" is forbidden for '
                                        'resourceVersion "0"')
    if initial is not None:
        if not watch:
            raise _list_options_invalid("sendInitialEvents: Forbidden: sendInitialEvents is "
                                        "forbidden for list")
        if match != "NotOlderThan":
            raise _list_options_invalid("resourceVersionMatch: Forbidden: sendInitialEvents "
                                        "requires setting resourceVersionMatch to "
                                        "NotOlderThan")
    if not rv:
        return None
    if not rv.isdigit():
        raise RequestError(apistatus.bad_request(
            f'invalid resource version: resourceVersion: Invalid value: "{rv}": '
            f'strconv.ParseUint: parsing "{rv}": invalid syntax'))
    return int(rv)


def too_large_resource_version(wanted: int, current: int) -> web.Response:
    """kube's answer when a list asks for a resourceVersion newer than its store has
    reached, after waiting (its watch cache waits 3 s): 504 with a retry hint."""
    return apistatus.status_response(
        504, f"Timeout: Too large resource version: {wanted}, current: {current}",
        reason="Timeout",
        details={"causes": [{"reason": "ResourceVersionTooLarge",
                             "message": "Too large resource version"}],
                 "retryAfterSeconds": 1},
        headers={"Retry-After": "1"})


def dry_run(request: web.Request) -> bool:
    """``dryRun=All``: validate, answer, store nothing. Other values are a 422, as in kube."""
    values = request.query.getall("dryRun", [])
    if any(value != "All" for value in values):
        options = _OPTIONS_KINDS.get(request.method, "CreateOptions")
        raise RequestError(apistatus.invalid(
            "meta.k8s.io", options, "", f"dryRun: Unsupported value: {_shown(values)}: "
                                        'supported values: "All"'))
    return bool(values)


#: The options object kube validates a write's query against, by method.
_OPTIONS_KINDS = {"POST": "CreateOptions", "PUT": "UpdateOptions", "PATCH": "PatchOptions",
                  "DELETE": "DeleteOptions"}
