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
    """An aiohttp response carrying a ``Status`` body with the matching HTTP code."""
    body = status_body(code, message, reason=reason, details=details)
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


SIM_LIMIT = "not supported by mvproxy's simulated kube-apiserver"


def not_simulated(code: int, what: str) -> web.Response:
    """Something a real kube-apiserver serves and the simulator does not.

    Says so plainly, so nobody mistakes a simulator limit for kube's answer; genuine
    kube 404s (unknown resources, which mvproxy's routing relies on) never use this.
    """
    return status_response(code, f"{what} is {SIM_LIMIT} (see the README's simulator "
                                 "limits)", reason="NotFound" if code == 404 else None)


def already_exists(group: str, resource: str, name: str) -> web.Response:
    return status_response(409, f'{qualified(group, resource)} "{name}" already exists',
                           details=_details(group, resource, name))


def conflict(group: str, resource: str, name: str, why: str) -> web.Response:
    """Optimistic-locking failure; ``why`` is kube's explanation after the colon."""
    message = f'Operation cannot be fulfilled on {qualified(group, resource)} "{name}": {why}'
    return status_response(409, message, reason="Conflict",
                           details=_details(group, resource, name))


OBJECT_MODIFIED = ("the object has been modified; please apply your changes to the latest "
                   "version and try again")


def bad_request(message: str) -> web.Response:
    return status_response(400, message)


def invalid(group: str, resource: str, kind: str, name: str, message: str) -> web.Response:
    """422 Invalid, as admission/validation failures read: ``Pod "x" is invalid: ...``."""
    return status_response(422, f'{kind} "{name}" is invalid: {message}',
                           details=_details(group, resource, name))


def method_not_allowed() -> web.Response:
    return _generic(405, "the server does not allow this method on the requested resource")


def not_acceptable(accepted: str = "application/json") -> web.Response:
    return status_response(406, f"only the following media types are accepted: {accepted}")


def unsupported_media_type(accepted: str = "application/json, application/yaml") -> web.Response:
    return status_response(
        415, "the body of the request was in an unknown format - accepted media types "
             f"include: {accepted}")
