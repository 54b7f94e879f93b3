"""failover: what a failed forwarding attempt leads to, as named tables (no I/O).

Each row is one situation the request engine meets before any answer reached the
client (what failed, the method, whether the body is gone, whether the connection was
reused, what else may take the request) and what must follow: a retry on a fresh
connection, the next candidate, or the answer a client sees (its status and the
header fields that tell it, or a peer mvproxy, whether retrying is safe).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamShuttingDown,
    UpstreamTimeout,
    UpstreamUnreachable,
    UpstreamUnserved,
)
from mvproxy.failover import (
    UNSERVED,
    Action,
    Failed,
    classify,
    decide,
    may_fall_back,
    may_resend,
    refusal,
)

RETRY_AFTER = 7
CONNECT = UpstreamConnectError("b", "cannot connect: refused")
TIMEOUT = UpstreamTimeout("b", "timed out waiting for the response")
BROKEN = UpstreamProtocolError("b", "broken response: bad status line")
CLOSED = UpstreamProtocolError("b", "connection closed before any response")
UNREACHABLE = UpstreamUnreachable("b", "stopped answering")
UNSERVED_BY_PEER = UpstreamUnserved("b", "nothing reached its backend")
DRAINING = UpstreamShuttingDown("b", "refused the request: shutting down", "3")


# --------------------------------------------------------------------------- may_resend

@pytest.mark.parametrize("cause, method, body_gone, expected", [
    pytest.param(CONNECT, "GET", False, True, id="connect failure, GET: nothing sent, resend"),
    pytest.param(CONNECT, "POST", False, True, id="connect failure, POST: nothing sent, resend"),
    pytest.param(CONNECT, "PATCH", False, True,
                 id="connect failure, PATCH before its body: nothing sent, resend"),
    pytest.param(CONNECT, "POST", True, False, id="POST whose body was read: never resend"),
    pytest.param(CONNECT, "GET", True, False,
                 id="GET whose body was read: the body cannot be replayed"),
    pytest.param(TIMEOUT, "GET", False, True, id="timeout on GET: idempotent, resend"),
    pytest.param(TIMEOUT, "HEAD", False, True, id="timeout on HEAD: idempotent, resend"),
    pytest.param(TIMEOUT, "OPTIONS", False, True, id="timeout on OPTIONS: idempotent, resend"),
    pytest.param(TIMEOUT, "POST", False, False,
                 id="timeout on POST: may have been applied, never resend"),
    pytest.param(TIMEOUT, "DELETE", False, False,
                 id="timeout on DELETE: may have been applied, never resend"),
    pytest.param(TIMEOUT, "PUT", True, False, id="timeout on PUT with body: never resend"),
    pytest.param(TIMEOUT, "GET", True, False,
                 id="timeout on GET with a consumed body: never resend"),
    pytest.param(BROKEN, "GET", False, True, id="broken response on GET: idempotent, resend"),
    pytest.param(BROKEN, "PATCH", False, False,
                 id="broken response on PATCH: may have been applied"),
    pytest.param(BROKEN, "POST", True, False,
                 id="broken response on POST with body: never resend"),
    pytest.param(UNSERVED_BY_PEER, "POST", False, True,
                 id="a peer's backend got nothing, POST: resend elsewhere"),
    pytest.param(DRAINING, "DELETE", False, True,
                 id="refused while shutting down, DELETE: nothing ran, resend"),
    pytest.param(DRAINING, "POST", True, False,
                 id="refused while shutting down after the body went: gone"),
])
def test_may_resend(cause, method, body_gone, expected):
    assert may_resend(cause, method, body_gone) is expected


# --------------------------------------------------------------------------- classify

@pytest.mark.parametrize("error, method, reset, received, reused, cause, stale", [
    pytest.param(None, "GET", False, False, True, UpstreamTimeout, False,
                 id="deadline passed: a timeout, never stale"),
    pytest.param(CLOSED, "GET", True, False, True, UpstreamUnreachable, False,
                 id="polling reset it before any byte: unreachable, not worth a retry"),
    pytest.param(CLOSED, "GET", True, True, True, UpstreamProtocolError, False,
                 id="polling reset it after bytes came: the broken response as it is"),
    pytest.param(CLOSED, "GET", False, False, True, UpstreamProtocolError, True,
                 id="reused connection closed before any byte, GET: stale"),
    pytest.param(CLOSED, "HEAD", False, False, True, UpstreamProtocolError, True,
                 id="reused connection closed before any byte, HEAD: stale"),
    pytest.param(CLOSED, "POST", False, False, True, UpstreamProtocolError, False,
                 id="reused connection closed, POST: may have run, not stale"),
    pytest.param(CLOSED, "GET", False, False, False, UpstreamProtocolError, False,
                 id="a fresh connection closed: the server, not a stale pool"),
    pytest.param(CLOSED, "GET", False, True, True, UpstreamProtocolError, False,
                 id="closed after a response byte: broken, not stale"),
    pytest.param(UNSERVED_BY_PEER, "GET", False, True, True, UpstreamUnserved, False,
                 id="a peer's unserved marker passes as it is"),
])
def test_classify(error, method, reset, received, reused, cause, stale):
    got, is_stale = classify(error, "b", method=method, reset=reset, received=received,
                             reused=reused)
    assert type(got) is cause
    assert is_stale is stale


# --------------------------------------------------------------------------- refusal

CLOSE_RETRY = [(b"Connection", b"close"), (b"Retry-After", b"3")]
UNSERVED_FIELDS = [(b"Content-Type", b"application/json"), (UNSERVED.encode(), b"backend")]


def lowered(raw):
    return [name.lower() for name, _ in raw]


@pytest.mark.parametrize("status, raw, to_peer, reroutable, replayable, expected", [
    pytest.param(503, UNSERVED_FIELDS, True, False, True, UpstreamUnserved,
                 id="a peer's 503 with the unserved marker: try another"),
    pytest.param(503, UNSERVED_FIELDS, False, True, True, None,
                 id="the marker from the backend is not trusted: relayed"),
    pytest.param(503, [(b"Retry-After", b"1")], True, False, True, None,
                 id="a peer's plain 503: its answer, relayed"),
    pytest.param(429, CLOSE_RETRY, False, True, True, UpstreamShuttingDown,
                 id="backend draining (429, close, Retry-After), reroutable: elsewhere"),
    pytest.param(429, CLOSE_RETRY, False, False, True, None,
                 id="backend draining, nobody else may take it: its 429 relayed"),
    pytest.param(429, CLOSE_RETRY, False, True, False, None,
                 id="backend draining after the body went: its 429 relayed"),
    pytest.param(429, [(b"Retry-After", b"1")], False, True, True, None,
                 id="load shedding 429 (no close): relayed"),
    pytest.param(429, [(b"Connection", b"close")], False, True, True, None,
                 id="429 with close but no Retry-After: relayed"),
    pytest.param(200, CLOSE_RETRY, True, True, True, None, id="a 200 is an answer"),
])
def test_refusal(status, raw, to_peer, reroutable, replayable, expected):
    got = refusal(status, raw, lowered(raw), "b", to_peer=to_peer, reroutable=reroutable,
                  replayable=replayable, body_pending=False)
    assert (type(got) if got is not None else None) is expected
    if isinstance(got, UpstreamShuttingDown):
        assert got.retry_after == "3"


def test_a_429_said_before_the_body_came_is_relayed():
    """Go's server says Connection: close on any answer while a request body is unread
    (256 KiB or more, or behind 100-continue): a busy 429 then looks like a drain."""
    assert refusal(429, CLOSE_RETRY, lowered(CLOSE_RETRY), "b", to_peer=False,
                   reroutable=True, replayable=True, body_pending=True) is None
    unserved = refusal(503, UNSERVED_FIELDS, lowered(UNSERVED_FIELDS), "b", to_peer=True,
                       reroutable=False, replayable=True, body_pending=True)
    assert type(unserved) is UpstreamUnserved  # a peer mvproxy's marker says it plainly


# --------------------------------------------------------------------------- may_fall_back

@pytest.mark.parametrize("resource, peer_proxied, credentials, expected", [
    pytest.param(True, False, True, True, id="a resource request with credentials"),
    pytest.param(True, False, False, False, id="anonymous: never reaches a peer"),
    pytest.param(True, True, True, False, id="a peer sent it here: never sent back out"),
    pytest.param(False, False, True, False, id="not a resource request (/healthz, /version)"),
])
def test_may_fall_back(resource, peer_proxied, credentials, expected):
    assert may_fall_back(resource, peer_proxied, credentials) is expected


# --------------------------------------------------------------------------- decide

@dataclass(frozen=True)
class Then:
    """What must follow: the action, and for an answer its status and fields."""

    action: Action
    status: int = 0
    retry_after: str | None = None
    """The answer's Retry-After (None: absent)."""
    unserved: bool = False
    failover: str = ""
    backend_down: bool = False


RETRY = Then(Action.RETRY_FRESH)


def answer(status: int, retry_after: str | None = None, **kw) -> Then:
    return Then(Action.ANSWER, status, retry_after, **kw)


def nxt(failover: str = "", **kw) -> Then:
    return Then(Action.NEXT, failover=failover, **kw)


WAIT = str(RETRY_AFTER)

ROWS: list[tuple[str, Failed, Then]] = [
    # stale pooled connections
    ("stale GET: once more on a fresh connection",
     Failed(CLOSED, "GET", to_peer=False, stale=True), RETRY),
    ("stale GET to a peer: once more on a fresh connection",
     Failed(CLOSED, "GET", to_peer=True, stale=True, alternatives=True), RETRY),
    ("stale again after the fresh retry, peers may take it: fall back",
     Failed(CLOSED, "GET", to_peer=False, stale=True, retried_fresh=True, alternatives=True),
     nxt("unanswered")),
    ("stale again after the fresh retry, nobody else: 502 with Retry-After (GET)",
     Failed(CLOSED, "GET", to_peer=False, stale=True, retried_fresh=True),
     answer(502, WAIT)),
    ("stale GET whose body went with no copy: no retry, 502 (GET: Retry-After)",
     Failed(CLOSED, "GET", to_peer=False, stale=True, replayable=False, alternatives=True),
     answer(502, WAIT)),
    # the backend
    ("backend refuses connections, GET, a peer serves it: fall back",
     Failed(CONNECT, "GET", to_peer=False, alternatives=True),
     nxt("unanswered", backend_down=True)),
    ("backend refuses connections, POST, a peer serves it: fall back (nothing sent)",
     Failed(CONNECT, "POST", to_peer=False, alternatives=True),
     nxt("unanswered", backend_down=True)),
    ("backend refuses connections, no peer may take it: 503 Retry-After",
     Failed(CONNECT, "GET", to_peer=False), answer(503, WAIT, backend_down=True)),
    ("backend refuses connections, POST whose body went: 503 (nothing was sent)",
     Failed(CONNECT, "POST", to_peer=False, replayable=False, alternatives=True),
     answer(503, WAIT, backend_down=True)),
    ("backend shutting down, a peer serves it: fall back, counted as shutting_down",
     Failed(DRAINING, "POST", to_peer=False, alternatives=True),
     nxt("shutting_down", backend_down=True)),
    ("backend shutting down, nobody else: its own 429 and Retry-After",
     Failed(DRAINING, "POST", to_peer=False), answer(429, "3", backend_down=True)),
    ("backend shutting down, a peer mvproxy sent it: 503 unserved, so it tries another",
     Failed(DRAINING, "GET", to_peer=False, from_peer=True),
     answer(503, WAIT, unserved=True, backend_down=True)),
    ("backend refuses connections, a peer mvproxy sent it: 503 unserved",
     Failed(CONNECT, "GET", to_peer=False, from_peer=True),
     answer(503, WAIT, unserved=True, backend_down=True)),
    ("backend times out on GET, a peer serves it: fall back",
     Failed(TIMEOUT, "GET", to_peer=False, alternatives=True), nxt("unanswered")),
    ("backend times out on POST: may have run, 504 without Retry-After",
     Failed(TIMEOUT, "POST", to_peer=False, alternatives=True), answer(504)),
    ("backend times out on GET whose body started (a copy kept): 504 Retry-After",
     Failed(TIMEOUT, "GET", to_peer=False, body_started=True, alternatives=True),
     answer(504, WAIT)),
    ("backend sends a broken answer to a PATCH: 502 without Retry-After",
     Failed(BROKEN, "PATCH", to_peer=False, alternatives=True), answer(502)),
    ("backend ended by polling, GET, nobody else: 503 Retry-After",
     Failed(UNREACHABLE, "GET", to_peer=False), answer(503, WAIT, backend_down=True)),
    ("backend ended by polling, POST: 502 without Retry-After (it may have run)",
     Failed(UNREACHABLE, "POST", to_peer=False, alternatives=True),
     answer(502, backend_down=True)),
    ("backend times out, a peer mvproxy sent it: 504, no unserved marker",
     Failed(TIMEOUT, "GET", to_peer=False, from_peer=True), answer(504, WAIT)),
    # peers
    ("peer refuses connections, more candidates: the next one",
     Failed(CONNECT, "GET", to_peer=True, alternatives=True), nxt()),
    ("peer's backend got nothing, POST, more candidates: the next one",
     Failed(UNSERVED_BY_PEER, "POST", to_peer=True, alternatives=True), nxt()),
    ("last peer refuses connections: 503 Retry-After from every capable peer",
     Failed(CONNECT, "GET", to_peer=True), answer(503, WAIT)),
    ("last peer's backend got nothing: 503 Retry-After",
     Failed(UNSERVED_BY_PEER, "POST", to_peer=True), answer(503, WAIT)),
    ("peer times out on POST: never the next one, 504",
     Failed(TIMEOUT, "POST", to_peer=True, alternatives=True), answer(504)),
    ("peer times out on GET, more candidates: the next one",
     Failed(TIMEOUT, "GET", to_peer=True, alternatives=True), nxt()),
    ("peer broken answer to a DELETE: never the next one, 502",
     Failed(BROKEN, "DELETE", to_peer=True, alternatives=True), answer(502)),
    ("peer refuses a POST whose body went with no copy: 503, never the next one",
     Failed(CONNECT, "POST", to_peer=True, replayable=False, alternatives=True),
     answer(503, WAIT)),
    ("a peer's answer never carries the unserved marker",
     Failed(CONNECT, "GET", to_peer=True, from_peer=True), answer(503, WAIT)),
]


@pytest.mark.parametrize("failed, then", [pytest.param(f, t, id=name) for name, f, t in ROWS])
def test_decide(failed: Failed, then: Then):
    verdict = decide(failed, RETRY_AFTER)
    assert verdict.action is then.action
    assert verdict.failover == then.failover
    if not failed.to_peer:
        assert verdict.backend_down is then.backend_down
    if then.action is not Action.ANSWER:
        assert verdict.answer is None
        return
    assert verdict.answer is not None
    fields = dict(verdict.answer.fields)
    assert verdict.answer.status == then.status
    assert fields.get("Retry-After") == then.retry_after
    assert (UNSERVED in fields) is then.unserved
    status = json.loads(verdict.answer.body)
    assert status["kind"] == "Status" and status["code"] == then.status


def test_every_row_is_named_once():
    names = [name for name, _, _ in ROWS]
    assert len(names) == len(set(names))


def test_a_stale_connection_is_answered_as_a_broken_response():
    verdict = decide(Failed(CLOSED, "GET", to_peer=True, stale=True, retried_fresh=True),
                     RETRY_AFTER)
    assert isinstance(verdict.cause, UpstreamProtocolError)
    assert "closed before any response" in str(verdict.cause)


def test_the_answer_names_who_failed_and_never_an_address():
    cause: UpstreamError = UpstreamConnectError("b", "cannot connect: 10.0.0.9:6443 refused")
    backend = decide(Failed(cause, "GET", to_peer=False), RETRY_AFTER).answer
    peers = decide(Failed(cause, "GET", to_peer=True), RETRY_AFTER).answer
    assert backend is not None and peers is not None
    assert b"the backend API server" in backend.body and b"10.0.0.9" not in backend.body
    assert b"every capable peer" in peers.body and b"10.0.0.9" not in peers.body
