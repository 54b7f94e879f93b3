"""Kubernetes ``Status`` error bodies, as kube-apiserver writes them.

kubectl and client-go parse these to print "Error from server (NotFound): ...", so
every error the simulated API server returns goes through here.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from mvproxy.kubestatus import status_body


def status_response(code: int, message: str, *, reason: str | None = None,
                    details: dict[str, Any] | None = None,
                    headers: dict[str, str] | None = None) -> web.Response:
    """An aiohttp response carrying a ``Status`` body with the matching HTTP code;
    ``details`` is sent whenever given, even empty (kube's ``errors`` package always
    sets it; only its authentication failures carry none)."""
    body = status_body(code, message, reason=reason, details=details)
    if details is not None:
        body["details"] = details
    return json_response(code, body, headers)


def json_response(code: int, body: dict[str, Any], headers: dict[str, str] | None = None
                  ) -> web.Response:
    # kube labels errors exactly "application/json" (aiohttp's text= would add a charset).
    return web.Response(status=code, body=json.dumps(body).encode(),
                        headers={**(headers or {}), "Content-Type": "application/json"})


# --- kube-apiserver's common failures, worded as apimachinery's ``errors`` package does ---


def qualified(group: str, resource: str) -> str:
    """``pods`` for core, ``deployments.apps`` otherwise: how kube names a resource."""
    return f"{resource}.{group}" if group else resource


def _details(group: str, resource: str, name: str) -> dict[str, Any]:
    # StatusDetails fields are omitempty in kube: core resources carry no "group".
    details: dict[str, Any] = {"name": name} if name else {}
    if group:
        details["group"] = group
    details["kind"] = resource
    return details


def object_not_found(group: str, resource: str, name: str) -> web.Response:
    """``pods "x" not found`` with kube's omitempty details (no empty group)."""
    return status_response(404, f'{qualified(group, resource)} "{name}" not found',
                           details=_details(group, resource, name))


def _generic(code: int, message: str) -> web.Response:
    """kube's generic errors carry an empty ``details: {}``."""
    body = status_body(code, message)
    body["details"] = {}
    return json_response(code, body)


def path_not_found() -> web.Response:
    """An unknown group, version, resource or path: kube's generic 404."""
    return _generic(404, "the server could not find the requested resource")


def page_not_found() -> web.Response:
    """What kube-apiserver answers for a path no handler claims, an unknown API group
    (``/apis/nope.example.com/...``) included: Go's plain-text 404, not a Status."""
    return web.Response(status=404, body=b"404 page not found\n",
                        headers={"Content-Type": "text/plain; charset=utf-8",
                                 "X-Content-Type-Options": "nosniff"})


SIM_LIMIT = "not supported by mvproxy's simulated kube-apiserver"


def not_simulated(code: int, what: str) -> web.Response:
    """Something a real kube-apiserver serves and the simulator does not.

    Says so plainly, so nobody mistakes a simulator limit for kube's answer; genuine
    kube 404s (unknown resources, which mvproxy's routing relies on) never use this.
    """
    return status_response(code, f"{what} is {SIM_LIMIT} (see docs/simulator.md "
                                 "for its limits)", reason="NotFound" if code == 404 else None)


def already_exists(group: str, resource: str, name: str) -> web.Response:
    return status_response(409, f'{qualified(group, resource)} "{name}" already exists',
                           details=_details(group, resource, name))


def conflict(group: str, resource: str, name: str, why: str) -> web.Response:
    """Optimistic-locking failure; ``why`` is kube's explanation after the colon."""
    message = f'Operation cannot be fulfilled on {qualified(group, resource)} "{name}": {why}'
    return status_response(409, message, reason="Conflict",
                           details=_details(group, resource, name))


def precondition_conflict(group: str, kind: str, name: str, expected: str,
                          actual: str) -> web.Response:
    """A DELETE whose resourceVersion precondition fails: kube names the *kind* here."""
    subject = f"{kind}.{group}" if group else kind
    message = (f'Operation cannot be fulfilled on {subject} "{name}": the ResourceVersion in '
               f"the precondition ({expected}) does not match the ResourceVersion in record "
               f"({actual}). The object might have been modified")
    details: dict[str, Any] = {"name": name}
    if group:
        details["group"] = group
    details["kind"] = kind
    return status_response(409, message, reason="Conflict", details=details)


OBJECT_MODIFIED = ("the object has been modified; please apply your changes to the latest "
                   "version and try again")


def bad_request(message: str) -> web.Response:
    return status_response(400, message)


#: The prefix of a field error's text -> its cause reason (apimachinery's field.ErrorType).
_CAUSE_REASONS = (("Invalid value", "FieldValueInvalid"), ("Required value", "FieldValueRequired"),
                  ("Forbidden", "FieldValueForbidden"), ("Unsupported value",
                                                         "FieldValueNotSupported"),
                  ("Duplicate value", "FieldValueDuplicate"), ("Too long", "FieldValueTooLong"),
                  ("Too many", "FieldValueTooMany"), ("Not found", "FieldValueNotFound"))


def _cause(problem: str) -> dict[str, str]:
    """``"spec.x: Invalid value: 3: must be ..."`` -> a StatusCause."""
    field, _, body = problem.partition(": ")
    reason = next((r for prefix, r in _CAUSE_REASONS if body.startswith(prefix)),
                  "FieldValueInvalid")
    return {"reason": reason, "message": body, "field": field}


def invalid(group: str, kind: str, name: str, *problems: str) -> web.Response:
    """422 Invalid as kube's ``errors.NewInvalid`` writes it: the message
    ``Kind[.group] "name" is invalid: <field>: <what>`` (several in ``[...]``), details
    naming the *kind* (not the resource) with one cause per problem. Each problem is
    ``"<field path>: <what is wrong>"``, e.g. ``"metadata.name: Required value"``."""
    subject = f"{kind}.{group}" if group else kind
    listed = problems[0] if len(problems) == 1 else "[" + ", ".join(problems) + "]"
    details: dict[str, Any] = {"name": name} if name else {}
    if group:
        details["group"] = group
    details["kind"] = kind
    details["causes"] = [_cause(p) for p in problems]
    return status_response(422, f'{subject} "{name}" is invalid: {listed}', details=details)


def method_not_allowed() -> web.Response:
    return _generic(405, "the server does not allow this method on the requested resource")


#: What kube-apiserver lists in a 406 (it encodes all of these; the simulator JSON only).
_REPRESENTATIONS = ("application/json, application/yaml, application/vnd.kubernetes.protobuf, "
                    "application/json;stream=watch, "
                    "application/vnd.kubernetes.protobuf;stream=watch")


def not_acceptable() -> web.Response:
    """kube-apiserver's 406 for an Accept it cannot satisfy, worded as its negotiation
    layer does."""
    return status_response(406, f"406: Not Acceptable\n\nAvailable representations: "
                                f"{_REPRESENTATIONS}", details={})


def discovery_not_acceptable() -> web.Response:
    """The discovery handlers' own 406 (no details)."""
    return status_response(406, "only the following media types are accepted: "
                                "application/json, application/yaml, "
                                "application/vnd.kubernetes.protobuf")


def unsupported_media_type(
        accepted: str = "application/json, application/yaml, application/vnd.kubernetes.protobuf"
) -> web.Response:
    """A request body in a Content-Type no decoder takes (kube: no details)."""
    return status_response(
        415, "the body of the request was in an unknown format - accepted media types "
             f"include: {accepted}")


def unsupported_patch_type() -> web.Response:
    """A PATCH whose Content-Type is no patch type: go-restful's bare 415."""
    return status_response(415, "415: Unsupported Media Type", details={})
