"""Decode the Kubernetes protobuf request bodies that kubectl sends.

``kubectl create namespace|configmap|secret|deployment|serviceaccount`` and ``kubectl
auth can-i|whoami`` (1.3x) POST built-in objects as
``application/vnd.kubernetes.protobuf``: the magic ``k8s\\0``, then
a ``runtime.Unknown`` envelope (TypeMeta, raw message bytes). Without schemas the raw
bytes are only numbered fields, so this module carries hand-written field maps for
those kinds (just the fields those commands set, plus the common metadata). Fields
not in a map are dropped. Zero values are dropped too, as JSON's omitempty would,
except for fields known to be pointers (``replicas: 0`` must stay).

Responses are never protobuf: every client that sends it also accepts JSON.
"""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from typing import Any

MAGIC = b"k8s\x00"
CONTENT_TYPE = "application/vnd.kubernetes.protobuf"


class ProtobufError(ValueError):
    """The body is not a protobuf message we can read."""


# --- wire format -------------------------------------------------------------------


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(data):
            raise ProtobufError("truncated varint")
        b = data[i]
        result |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return result, i
        shift += 7


def fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs: varints as int, length-delimited as bytes."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
            out.append((number, value))
        elif wire == 2:
            size, i = _varint(data, i)
            if i + size > len(data):
                raise ProtobufError("truncated field")
            out.append((number, data[i:i + size]))
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4  # fixed-width: no Kubernetes field we read uses them
            if i > len(data):
                raise ProtobufError("truncated field")
        else:
            raise ProtobufError(f"unsupported wire type {wire}")
    return out


# --- schemas: field number -> (json name, type) --------------------------------------
# Types: "str", "int", "bool", "bytes" (base64 in JSON), "time", "quantity", "intorstr",
# "map" (string→string), "mapbytes", "mapquantity", "mapstrings" (string→ExtraValue,
# a list of strings in JSON), a nested schema dict, or a
# one-element list of any of those (repeated). A trailing "!" keeps zero values.

TIME = "time"
OWNER_REFERENCE = {1: ("kind", "str"), 3: ("name", "str"), 4: ("uid", "str"),
                   5: ("apiVersion", "str"), 6: ("controller", "bool"),
                   7: ("blockOwnerDeletion", "bool")}
OBJECT_META = {
    1: ("name", "str"), 2: ("generateName", "str"), 3: ("namespace", "str"),
    5: ("uid", "str"), 6: ("resourceVersion", "str"), 7: ("generation", "int"),
    8: ("creationTimestamp", TIME), 11: ("labels", "map"), 12: ("annotations", "map"),
    13: ("ownerReferences", [OWNER_REFERENCE]), 14: ("finalizers", ["str"]),
}
LABEL_SELECTOR = {1: ("matchLabels", "map"), 2: ("matchExpressions", [
    {1: ("key", "str"), 2: ("operator", "str"), 3: ("values", ["str"])}])}
CONTAINER = {
    1: ("name", "str"), 2: ("image", "str"), 3: ("command", ["str"]), 4: ("args", ["str"]),
    5: ("workingDir", "str"),
    6: ("ports", [{1: ("name", "str"), 2: ("hostPort", "int"), 3: ("containerPort", "int"),
                   4: ("protocol", "str"), 5: ("hostIP", "str")}]),
    7: ("env", [{1: ("name", "str"), 2: ("value", "str")}]),
    8: ("resources", {1: ("limits", "mapquantity"), 2: ("requests", "mapquantity")}),
    9: ("volumeMounts", [{1: ("name", "str"), 2: ("readOnly", "bool"),
                          3: ("mountPath", "str"), 4: ("subPath", "str")}]),
    13: ("terminationMessagePath", "str"), 14: ("imagePullPolicy", "str"),
    16: ("stdin", "bool"), 17: ("stdinOnce", "bool"), 18: ("tty", "bool"),
    20: ("terminationMessagePolicy", "str"),
}
POD_SPEC = {
    2: ("containers", [CONTAINER]), 3: ("restartPolicy", "str"),
    4: ("terminationGracePeriodSeconds", "int!"), 6: ("dnsPolicy", "str"),
    7: ("nodeSelector", "map"), 8: ("serviceAccountName", "str"), 10: ("nodeName", "str"),
    19: ("schedulerName", "str"), 20: ("initContainers", [CONTAINER]),
}
POD_TEMPLATE = {1: ("metadata", OBJECT_META), 2: ("spec", POD_SPEC)}
DEPLOYMENT_SPEC = {
    1: ("replicas", "int!"), 2: ("selector", LABEL_SELECTOR), 3: ("template", POD_TEMPLATE),
    4: ("strategy", {1: ("type", "str"), 2: ("rollingUpdate", {
        1: ("maxUnavailable", "intorstr"), 2: ("maxSurge", "intorstr")})}),
    5: ("minReadySeconds", "int"), 6: ("revisionHistoryLimit", "int!"), 7: ("paused", "bool"),
    9: ("progressDeadlineSeconds", "int!"),
}
# authorization.k8s.io/v1 and authentication.k8s.io/v1 (k8s.io/api generated.proto).
_SELECTOR_REQUIREMENT = {1: ("key", "str"), 2: ("operator", "str"), 3: ("values", ["str"])}
_SELECTOR_ATTRIBUTES = {1: ("rawSelector", "str"), 2: ("requirements", [_SELECTOR_REQUIREMENT])}
RESOURCE_ATTRIBUTES = {
    1: ("namespace", "str"), 2: ("verb", "str"), 3: ("group", "str"), 4: ("version", "str"),
    5: ("resource", "str"), 6: ("subresource", "str"), 7: ("name", "str"),
    8: ("fieldSelector", _SELECTOR_ATTRIBUTES), 9: ("labelSelector", _SELECTOR_ATTRIBUTES),
}
NON_RESOURCE_ATTRIBUTES = {1: ("path", "str"), 2: ("verb", "str")}
SUBJECT_ACCESS_REVIEW_SPEC = {
    1: ("resourceAttributes", RESOURCE_ATTRIBUTES),
    2: ("nonResourceAttributes", NON_RESOURCE_ATTRIBUTES),
    3: ("user", "str"), 4: ("groups", ["str"]), 5: ("extra", "mapstrings"), 6: ("uid", "str"),
}
_ACCESS_REVIEW = {1: ("metadata", OBJECT_META), 2: ("spec", SUBJECT_ACCESS_REVIEW_SPEC)}
_REVIEW_KINDS: dict[tuple[str, str], dict] = {
    ("authorization.k8s.io/v1", "SubjectAccessReview"): _ACCESS_REVIEW,
    ("authorization.k8s.io/v1", "LocalSubjectAccessReview"): _ACCESS_REVIEW,
    # SelfSubjectAccessReviewSpec: fields 1 and 2 of SubjectAccessReviewSpec, same types.
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"): _ACCESS_REVIEW,
    ("authorization.k8s.io/v1", "SelfSubjectRulesReview"): {
        1: ("metadata", OBJECT_META), 2: ("spec", {1: ("namespace", "str")})},
    # Status (field 2) is the server's answer: a request carries only metadata.
    **{(f"authentication.k8s.io/{v}", "SelfSubjectReview"): {1: ("metadata", OBJECT_META)}
       for v in ("v1", "v1beta1", "v1alpha1")},
}
KINDS: dict[tuple[str, str], dict] = {
    **_REVIEW_KINDS,
    ("v1", "Namespace"): {1: ("metadata", OBJECT_META),
                          2: ("spec", {1: ("finalizers", ["str"])}),
                          3: ("status", {1: ("phase", "str")})},
    ("v1", "ConfigMap"): {1: ("metadata", OBJECT_META), 2: ("data", "map"),
                          3: ("binaryData", "mapbytes"), 4: ("immutable", "bool")},
    ("v1", "Secret"): {1: ("metadata", OBJECT_META), 2: ("data", "mapbytes"),
                       3: ("type", "str"), 4: ("stringData", "map"), 5: ("immutable", "bool")},
    ("v1", "ServiceAccount"): {1: ("metadata", OBJECT_META),
                               4: ("automountServiceAccountToken", "bool")},
    ("v1", "Pod"): {1: ("metadata", OBJECT_META), 2: ("spec", POD_SPEC)},
    ("apps/v1", "Deployment"): {1: ("metadata", OBJECT_META), 2: ("spec", DEPLOYMENT_SPEC)},
}


# --- decoding ----------------------------------------------------------------------


def _time(raw: bytes) -> str | None:
    seconds = dict(fields(raw)).get(1, 0)
    if not seconds:
        return None
    return datetime.fromtimestamp(int(seconds), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _int_or_string(raw: bytes) -> int | str:
    parts = dict(fields(raw))
    if parts.get(1, 0) == 1:
        return _text(parts.get(3, b""))
    return _signed(parts.get(2, 0))


def _signed(value: Any) -> int:
    """int64/int32 varints: negative numbers arrive as 64-bit two's complement."""
    value = int(value)
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(value: Any) -> str:
    if not isinstance(value, bytes):
        raise ProtobufError("expected a length-delimited string")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtobufError("a string field is not UTF-8") from None


def _entries(raw: Any) -> tuple[str, bytes | int]:
    if not isinstance(raw, bytes):
        raise ProtobufError("expected a map entry")
    parts = dict(fields(raw))
    return _text(parts.get(1, b"")), parts.get(2, b"")


_VARINT_KINDS = frozenset(("int", "bool"))


def _scalar(kind: str, value: Any) -> Any:
    if not isinstance(kind, str) or kind not in _VARINT_KINDS:
        if not isinstance(value, bytes):  # a varint where a message/string belongs
            raise ProtobufError("expected a length-delimited field")
    elif not isinstance(value, int):
        raise ProtobufError("expected a varint field")
    if isinstance(kind, dict):
        return decode_message(value, kind)
    if kind == "str":
        return _text(value)
    if kind == "int":
        return _signed(value)
    if kind == "bool":
        return bool(value)
    if kind == "bytes":
        return base64.b64encode(value).decode()
    if kind == TIME:
        return _time(value)
    if kind == "quantity":
        return _text(dict(fields(value)).get(1, b""))
    if kind == "intorstr":
        return _int_or_string(value)
    if kind == "strings":  # ExtraValue: repeated string items = 1
        return [_text(v) for n, v in fields(value) if n == 1]
    raise ProtobufError(f"unknown field type {kind}")


_MAP_VALUES = {"map": "str", "mapbytes": "bytes", "mapquantity": "quantity",
               "mapstrings": "strings"}


def _empty(value: Any) -> bool:
    return value is None or value in ("", 0, False) or value == {} or value == []


def decode_message(data: bytes, schema: dict) -> dict:
    """A message as a JSON-shaped dict, following ``schema``; unknown fields dropped."""
    out: dict[str, Any] = {}
    for number, value in fields(data):
        if number not in schema:
            continue
        name, kind = schema[number]
        if isinstance(kind, list):
            out.setdefault(name, []).append(_scalar(kind[0], value))
        elif isinstance(kind, str) and kind in _MAP_VALUES:
            key, item = _entries(value)
            out.setdefault(name, {})[key] = _scalar(_MAP_VALUES[kind], item)
        else:
            keep_zero = isinstance(kind, str) and kind.endswith("!")
            decoded = _scalar(kind.rstrip("!") if isinstance(kind, str) else kind, value)
            if keep_zero or not _empty(decoded):
                out[name] = decoded
    return out


def decode(body: bytes) -> dict:
    """A ``k8s\\0``-framed object as the JSON document it stands for."""
    if not body.startswith(MAGIC):
        raise ProtobufError("missing the k8s protobuf magic prefix")
    envelope = dict(fields(body[len(MAGIC):]))
    type_meta = dict(fields(_message(envelope.get(1, b""), "typeMeta")))
    api_version, kind = _text(type_meta.get(1, b"")), _text(type_meta.get(2, b""))
    schema = KINDS.get((api_version, kind))
    if schema is None:
        raise ProtobufError(f"protobuf bodies of {api_version} {kind} are not supported")
    return {"apiVersion": api_version, "kind": kind,
            **decode_message(_message(envelope.get(2, b""), "the object"), schema)}


def _message(value: int | bytes, what: str) -> bytes:
    if not isinstance(value, bytes):  # a varint where the envelope has a message
        raise ProtobufError(f"expected {what} as a length-delimited field")
    return value
