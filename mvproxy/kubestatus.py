"""Kubernetes ``Status`` bodies, the way kube-apiserver writes them.

kubectl and client-go parse these to print "Error from server (NotFound): ...";
both the daemon (503 when no capable peer is reachable, 406, 502) and the simulated
API server answer errors through here. Pure: answers are bytes and ``Reply`` values,
which the listener (or the simulator's aiohttp surface) writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamShuttingDown,
    UpstreamTimeout,
    UpstreamUnreachable,
    UpstreamUnserved,
)

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
    408: "Timeout",
    422: "Invalid",
    429: "TooManyRequests",
    431: "RequestHeaderFieldsTooLarge",
    500: "InternalError",
    501: "NotImplemented",
    503: "ServiceUnavailable",
    505: "HTTPVersionNotSupported",
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


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole answer mvproxy composes itself: status, header fields, body."""

    status: int
    fields: list[tuple[str, str]]
    body: bytes = b""


def status_bytes(code: int, message: str, *, reason: str | None = None,
                 details: dict[str, Any] | None = None) -> bytes:
    return json.dumps(status_body(code, message, reason=reason, details=details)).encode()


def status_reply(code: int, message: str, *, reason: str | None = None,
                 details: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> Reply:
    """A ``Status`` answer with the matching HTTP code, labelled exactly
    ``application/json`` as kube labels errors (no charset)."""
    fields = [*(headers or {}).items(), ("Content-Type", "application/json")]
    return Reply(code, fields, status_bytes(code, message, reason=reason, details=details))


def upstream_failure(cause: UpstreamError, who: str, retry_after: int, *,
                     idempotent: bool = False) -> Reply:
    """The answer when an upstream gave none, chosen by whether retrying is safe.

    - nothing was sent (connect failure), or a peer said nothing reached its backend:
      503 ServiceUnavailable with Retry-After;
    - the upstream refused it unprocessed while shutting down: 429 with its Retry-After;
    - sent, no answer in time: 504 Timeout, without Retry-After: client-go retries any
      response that carries one, even a POST that may already have been applied;
    - sent, answer unusable: 502, without Retry-After, for the same reason.

    An idempotent request (GET, HEAD, OPTIONS) may always be retried, so its 502 and
    504 carry ``Retry-After`` too. The message names what failed in a few words;
    addresses and TLS details belong in the log, not in a body any client can read.
    """
    again = {"Retry-After": str(retry_after)} if idempotent else None
    if isinstance(cause, UpstreamShuttingDown):
        # The upstream's own answer, as a Status: nothing was processed, and its
        # Retry-After says when to come back.
        wait = cause.retry_after if cause.retry_after.isdigit() else str(retry_after)
        return status_reply(429, f"{who} is shutting down; retry later",
                            headers={"Retry-After": wait})
    if isinstance(cause, UpstreamConnectError):
        return status_reply(503, f"error trying to reach {who}: cannot connect",
                            headers={"Retry-After": str(retry_after)})
    if isinstance(cause, UpstreamUnserved):
        return status_reply(503, f"{who} could not reach its API server",
                            headers={"Retry-After": str(retry_after)})
    if isinstance(cause, UpstreamUnreachable) and idempotent:
        return status_reply(503, f"{who} stopped answering; retry later", headers=again)
    if isinstance(cause, UpstreamTimeout):
        return status_reply(504, f"{who} did not answer in time", reason="Timeout",
                            headers=again)
    return status_reply(502, f"{who} sent a broken response or stopped answering",
                        reason="InternalError", headers=again)
