"""Kubernetes ``Status`` bodies, the way kube-apiserver writes them.

kubectl and client-go parse these to print "Error from server (NotFound): ...";
both the daemon (503 when no capable peer is reachable, 406, 502) and the simulated
API server answer errors through here.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from mvproxy.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "AlreadyExists",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    500: "InternalError",
    503: "ServiceUnavailable",
}


def status_body(code: int, message: str, *, reason: str | None = None,
                details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``metav1.Status`` failure object."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or REASONS.get(code, ""),
        "code": code,
    }
    if details:
        body["details"] = details
    return body


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


def upstream_failure(cause: UpstreamError, who: str, retry_after: int) -> web.Response:
    """The answer when an upstream gave none, chosen by whether retrying is safe.

    - nothing was sent (connect failure): 503 ServiceUnavailable with Retry-After;
    - sent, no answer in time: 504 Timeout, without Retry-After: client-go retries any
      response that carries one, even a POST that may already have been applied;
    - sent, answer unusable: 502, without Retry-After, for the same reason.

    The message names what failed in a few words; addresses and TLS details belong in
    the log, not in a body any client can read.
    """
    if isinstance(cause, UpstreamConnectError):
        return status_response(503, f"error trying to reach {who}: cannot connect",
                               headers={"Retry-After": str(retry_after)})
    if isinstance(cause, UpstreamTimeout):
        return status_response(504, f"{who} did not answer in time", reason="Timeout")
    return status_response(502, f"{who} sent a broken response", reason="InternalError")
