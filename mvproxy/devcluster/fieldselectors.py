"""Field selectors per resource, with the fields and errors kube-apiserver has.

kube-apiserver accepts a fixed set of field labels per kind: most kinds only
``metadata.name`` and ``metadata.namespace``; a few core kinds (pods, events, nodes,
namespaces, secrets, services, replicationcontrollers) have their own list and answer an
unknown label with "field label not supported: <label>", the others with
``"<label>" is not a known field selector: only "metadata.name", "metadata.namespace"``.
The message reaches the client as a 400 Status, as upstream's list and watch handlers do.

A selector is parsed once, before any object is read; each requirement then looks one
value up in the object (a missing or badly typed field reads as "", never raises), so a
hostile object can only fail to match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Predicate = Callable[[dict], bool]
Getter = Callable[[dict], str]

__all__ = ["parse", "split_terms"]


def _at(*path: str) -> Getter:
    """Read a string (or bool, printed as Go does) at ``path``; anything else is ""."""

    def get(obj: dict) -> str:
        cur: Any = obj
        for step in path:
            if not isinstance(cur, dict):
                return ""
            cur = cur.get(step)
        if isinstance(cur, bool):
            return "true" if cur else "false"
        return cur if isinstance(cur, str) else ""

    return get


def _first_pod_ip(obj: dict) -> str:
    ip = _at("status", "podIP")(obj)
    if ip:
        return ip
    ips = (obj.get("status") or {}).get("podIPs") if isinstance(obj.get("status"), dict) else None
    if isinstance(ips, list) and ips and isinstance(ips[0], dict):
        value = ips[0].get("ip")
        return value if isinstance(value, str) else ""
    return ""


_META = {"metadata.name": _at("metadata", "name"),
         "metadata.namespace": _at("metadata", "namespace")}
_NAME = {"metadata.name": _META["metadata.name"]}

# (group, resource) -> {label: getter}; kinds with their own list answer unknown labels
# with _OWN_MESSAGE, every other kind gets _DEFAULT_MESSAGE.
_OWN: dict[tuple[str, str], dict[str, Getter]] = {
    ("", "pods"): {
        **_META,
        "spec.nodeName": _at("spec", "nodeName"),
        "spec.host": _at("spec", "nodeName"),  # old clients' name for spec.nodeName
        "spec.restartPolicy": _at("spec", "restartPolicy"),
        "spec.schedulerName": _at("spec", "schedulerName"),
        "spec.serviceAccountName": _at("spec", "serviceAccountName"),
        "spec.hostNetwork": lambda o: _at("spec", "hostNetwork")(o) or "false",
        "status.phase": _at("status", "phase"),
        "status.podIP": _first_pod_ip,
        "status.podIPs": lambda o: "",  # accepted upstream, but not a selectable value
        "status.nominatedNodeName": _at("status", "nominatedNodeName"),
    },
    ("", "events"): {
        **_META,
        **{f"involvedObject.{f}": _at("involvedObject", f)
           for f in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion",
                     "fieldPath")},
        "reason": _at("reason"),
        "reportingComponent": _at("reportingComponent"),
        "source": _at("source", "component"),
        "type": _at("type"),
    },
    ("", "nodes"): {**_NAME,
                    "spec.unschedulable": lambda o: _at("spec", "unschedulable")(o) or "false"},
    ("", "namespaces"): {**_NAME, "status.phase": _at("status", "phase")},
    ("", "secrets"): {**_META, "type": _at("type")},
    ("", "services"): {**_META, "spec.clusterIP": _at("spec", "clusterIP"),
                       "spec.type": _at("spec", "type")},
    ("", "replicationcontrollers"): {
        **_META, "status.replicas": lambda o: str((o.get("status") or {}).get("replicas", 0))
        if isinstance(o.get("status"), dict) else "0"},
}


def _unsupported(own: bool, label: str) -> str:
    if own:
        return f"field label not supported: {label}"
    return (f'"{label}" is not a known field selector: only "metadata.name", '
            f'"metadata.namespace"')


def split_terms(text: str) -> list[str]:
    """Split on commas not escaped by a backslash (escapes are kept for the values)."""
    terms, cur, escaped = [], [], False
    for ch in text:
        if escaped:
            cur.append("\\" + ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == ",":
            terms.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if escaped:
        cur.append("\\")
    terms.append("".join(cur))
    return terms


def _unescape(value: str, text: str) -> str:
    out, escaped = [], False
    for ch in value:
        if escaped:
            if ch not in "\\,=":
                raise ValueError(f"invalid selector: '{text}'; "
                                 f"invalid escape sequence in value: '\\{ch}'")
            out.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch in ",=":
            raise ValueError(f"invalid selector: '{text}'; "
                             f"unescaped '{ch}' in value: '{value}'")
        else:
            out.append(ch)
    if escaped:
        raise ValueError(f"invalid selector: '{text}'; trailing backslash in value")
    return "".join(out)


def _split_term(term: str, text: str) -> tuple[str, bool, str]:
    for op in ("!=", "==", "="):
        at = term.find(op)
        if at > 0:
            return term[:at].strip(), op == "!=", _unescape(term[at + len(op):].strip(), text)
    raise ValueError(f"invalid selector: '{text}'; can't understand '{term}'")


def parse(text: str, group: str = "", resource: str = "") -> Predicate:
    """Parse ``text`` for objects of (``group``, ``resource``); requirements are ANDed.

    Raises ValueError with kube's message for a malformed term or an unsupported label.
    """
    own = _OWN.get((group, resource))
    fields = own if own is not None else _META
    reqs: list[tuple[Getter, bool, str]] = []
    for term in split_terms(text):
        if not term.strip():
            continue
        label, negate, value = _split_term(term, text)
        getter = fields.get(label)
        if getter is None:
            raise ValueError(_unsupported(own is not None, label))
        reqs.append((getter, negate, value))

    def match(obj: dict) -> bool:
        if not isinstance(obj, dict):
            return False
        return all((get(obj) == value) != negate for get, negate, value in reqs)

    return match
