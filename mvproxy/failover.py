"""What a failed forwarding attempt leads to: the failover rules, without I/O.

An attempt to move a request to one upstream (the backend, or one capable peer) can
end before any answer reached the client. The request engine (``forwarding``) then
asks two questions here, and acts on the answers:

- ``classify``: what the failure *is*, from what the upstream connection saw (a
  timeout, a connection that was already dead when reused, one that polling ended,
  a broken or missing answer, a refusal that says nothing was processed);
- ``decide``: retry on a fresh connection to the same upstream, try the next candidate
  (for the backend: fall back to a peer serving the same resource), or answer the
  client with this ``Status``.

Everything the rules read is in ``Failed``; once a response has started nothing here
applies (an upstream failure can then only cut the stream). Bytes that may have
reached a server are never sent again unless the method is idempotent, and a body
already handed to an upstream is gone unless a copy was kept (``replayable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from mvproxy import wire
from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamShuttingDown,
    UpstreamTimeout,
    UpstreamUnreachable,
    UpstreamUnserved,
)
from mvproxy.kubestatus import Reply, upstream_failure

IDEMPOTENT = frozenset(("GET", "HEAD", "OPTIONS"))
UNSERVED = "x-mvproxy-unserved"
"""Set by an mvproxy on its 503 when nothing reached its backend (``decide`` adds it
when the downstream is a peer, so that peer tries another)."""
UNSERVED_RAW = UNSERVED.encode()
BACKEND = "the backend API server"
PEERS = "every capable peer"


class Action(Enum):
    RETRY_FRESH = "retry on a fresh connection"
    NEXT = "next candidate"
    ANSWER = "answer"


@dataclass(frozen=True, slots=True)
class Failed:
    """One attempt that ended before any answer, and what may still be done."""

    cause: UpstreamError
    method: str
    to_peer: bool
    """The attempt went to a peer (else to the backend)."""
    replayable: bool = True
    """The whole body so far can be sent again (none was read, or a copy was kept)."""
    stale: bool = False
    """A reused connection ended before any response byte (``classify``)."""
    retried_fresh: bool = False
    """This upstream was already tried again on a fresh connection."""
    alternatives: bool = False
    """Someone else may take it: capable peers left (to a peer), or the request may
    fall back to a peer serving the same resource (to the backend)."""
    from_peer: bool = False
    """The downstream is a peer mvproxy (it may try another when told nothing ran)."""
    body_started: bool = False
    """A body byte went to an upstream (for a timeout, even if a copy was kept)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    action: Action
    cause: UpstreamError
    """What is reported and answered (a stale connection becomes a broken response)."""
    retryable: bool
    """Whether another upstream may take the request."""
    answer: Reply | None = None
    """For ``ANSWER``: the ``Status`` the client gets."""
    failover: str = ""
    """For the backend's ``NEXT``: ``shutting_down`` | ``unanswered`` (metric label)."""

    @property
    def backend_down(self) -> bool:
        """The backend refused connections, was ended by polling or is shutting down:
        what it lists may change when it is back."""
        return isinstance(self.cause, BACKEND_DOWN)


BACKEND_DOWN = (UpstreamConnectError, UpstreamUnreachable, UpstreamUnserved)


def may_resend(cause: UpstreamError, method: str, body_gone: bool) -> bool:
    """Never resend bytes that may have reached a server, unless the method is
    idempotent; a body already handed on is gone (``body_gone``), whatever the method."""
    if body_gone:
        return False
    if isinstance(cause, (UpstreamConnectError, UpstreamUnserved)):
        return True
    return method in IDEMPOTENT


def classify(error: UpstreamError | None, upstream: str, *, method: str, reset: bool,
             received: bool, reused: bool) -> tuple[UpstreamError, bool]:
    """The cause of a failure before the response head, and whether it is a stale
    pooled connection. ``error`` None: the request's deadline passed. ``reset``:
    polling aborted the connection; ``received``: some response byte arrived;
    ``reused``: the connection carried an earlier request."""
    if error is None:
        return UpstreamTimeout(upstream, "timed out waiting for the response"), False
    if reset and not received:
        return UpstreamUnreachable(upstream, "stopped answering; polling found it "
                                             "unreachable"), False
    stale = (isinstance(error, UpstreamProtocolError) and not received and reused
             and method in IDEMPOTENT)
    return error, stale


def refusal(status: int, raw: wire.RawFields, lowered: list[bytes], upstream: str, *,
            to_peer: bool, reroutable: bool, replayable: bool,
            body_pending: bool) -> UpstreamError | None:
    """A response head that says nothing was processed, when another server may take
    the request instead of the client seeing it: a peer's 503 with ``UNSERVED``, or
    the backend's 429 while it drains. None: relay the answer.

    ``body_pending``: part of the request body has not reached the upstream yet. Go's
    server then says ``Connection: close`` on any answer (256 KiB or more unread, or a
    ``100-continue`` body), so a 429 with ``Retry-After`` (priority and fairness, a pod
    behind ``pods/proxy``) would look like a drain: it is relayed instead."""
    if to_peer and status == 503 and UNSERVED_RAW in lowered:
        return UpstreamUnserved(upstream, "nothing reached its backend")
    if status == 429 and reroutable and b"connection" in lowered and replayable \
            and not body_pending and shutting_down(raw, lowered):
        return UpstreamShuttingDown(upstream, "refused the request: shutting down",
                                    wire.first(wire.decoded(raw), "retry-after"))
    return None


def shutting_down(raw: wire.RawFields, lowered: list[bytes]) -> bool:
    """kube-apiserver's answer while it drains (``--shutdown-send-retry-after``): 429
    with ``Connection: close``, which its load-shedding 429s (priority and fairness,
    max-in-flight) do not send; the request was not processed."""
    return b"close" in wire.raw_connection_tokens(raw, lowered) \
        and b"retry-after" in lowered


def may_fall_back(resource_request: bool, peer_proxied: bool, credentials: bool) -> bool:
    """Whether a request routed to the backend may go to a peer serving the same
    resource if the backend cannot take it: resource requests with credentials (an
    anonymous one never reaches a peer), never one a peer already sent here."""
    return credentials and resource_request and not peer_proxied


STALE_CAUSE = "connection closed before any response"


def decide(failed: Failed, retry_after: int) -> Verdict:
    """What happens after ``failed``: see the module docstring. ``retry_after``: the
    seconds mvproxy's own 503s ask clients to wait."""
    cause = failed.cause
    if failed.stale:
        if failed.replayable and not failed.retried_fresh:
            return Verdict(Action.RETRY_FRESH, cause, True)
        cause = UpstreamProtocolError(cause.upstream, STALE_CAUSE)
    if isinstance(cause, UpstreamTimeout):
        retryable = may_resend(cause, failed.method, failed.body_started)
    else:
        retryable = may_resend(cause, failed.method, not failed.replayable)
    if retryable and failed.alternatives:
        reason = "" if failed.to_peer else (
            "shutting_down" if isinstance(cause, UpstreamShuttingDown) else "unanswered")
        return Verdict(Action.NEXT, cause, True, failover=reason)
    idempotent = failed.method in IDEMPOTENT
    if failed.to_peer:
        return Verdict(Action.ANSWER, cause, retryable,
                       upstream_failure(cause, PEERS, retry_after, idempotent=idempotent))
    answered = cause
    if failed.from_peer and isinstance(cause, UpstreamShuttingDown):
        # Refused unprocessed: the peer that sent this may try another, as when
        # nothing reached the backend at all.
        answered = UpstreamUnserved(cause.upstream, str(cause))
    answer = upstream_failure(answered, BACKEND, retry_after, idempotent=idempotent)
    if failed.from_peer and answer.status == 503:
        answer.fields.append((UNSERVED, "backend-unreachable"))
    return Verdict(Action.ANSWER, cause, retryable, answer)
