"""What a request must look like before mvproxy acts on it (pure, no I/O).

mvproxy holds ``:6443`` in front of the whole control plane, so a request it could
not forward exactly as kube-apiserver would read it is refused here, before routing:

- **The target must be origin-form** (``/path?query``). Absolute-form
  (``http://host/p``), authority-form (CONNECT's ``host:port``), ``*`` and a
  scheme-relative ``//host/p`` are refused with 400. The upstream URL is always the
  upstream's base joined with this path, so mvproxy only ever connects to its backend
  and its peers; an HTTP client given such a target would connect wherever it names,
  with mvproxy's client certificate (an open proxy). The path is not normalised:
  ``..`` and ``//`` inside it reach the backend as sent, and the backend decides.
- **HTTP/1.0 and HTTP/1.1 only**: HTTP/0.9 has no headers (no identity, no
  credentials); any other version is not something mvproxy speaks as text (505).
- **``Transfer-Encoding`` may only be ``chunked``** (501 otherwise): mvproxy forwards
  bodies without decoding them, and ``gzip, chunked`` would otherwise reach the
  backend as a body it reads differently from mvproxy. It is accepted only as llhttp
  accepts it, so the two never disagree: one field, ``chunked`` in any case, with
  spaces (not tabs) after it; ``chunked<TAB>``, which llhttp refuses only after the
  head is complete, is refused here (400) before anything is sent.

Header names with an underscore are dropped, not refused, as nginx does by default:
some servers treat ``X_Remote_User`` as ``X-Remote-User``, and mvproxy's identity
rules must see every name the backend might act on (``forwarding``'s header filter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FORBIDDEN_IN_TARGET = re.compile(r"[\x00-\x20\x7f#]")
"""Controls, space and a fragment: never part of a request target (RFC 9112 §3.2)."""
_CHUNKED = re.compile(r"[ \t]*chunked *", re.IGNORECASE | re.ASCII)
"""The one ``Transfer-Encoding`` field value served, as llhttp reads it: llhttp drops the
leading whitespace itself and accepts trailing spaces, but refuses a trailing tab (or
any other byte) after the final ``chunked``."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is not served: the HTTP status and the ``Status`` message."""

    status: int
    message: str


def check_request(version: tuple[int, int], target: str,
                  transfer_encodings: list[str]) -> Refusal | None:
    """None if mvproxy may act on the request, else why not."""
    if version not in ((1, 1), (1, 0)):
        if version < (1, 0):
            return Refusal(400, "HTTP/0.9 requests are not served; use HTTP/1.1")
        return Refusal(505, f"HTTP/{version[0]}.{version[1]} is not supported here; "
                            "use HTTP/1.1")
    problem = target_problem(target)
    if problem:
        return Refusal(400, problem)
    if transfer_encodings:
        # Only space and tab are whitespace in a field (RFC 9110 §5.6.3): str.strip()
        # would also take "\xa0" or "\x0b" away, which llhttp keeps and refuses.
        codings = [c.strip(" \t").lower() for value in transfer_encodings
                   for c in value.split(",")]
        if codings != ["chunked"]:
            return Refusal(501, "only the chunked transfer coding is supported")
        if len(transfer_encodings) != 1 or not _CHUNKED.fullmatch(transfer_encodings[0]):
            return Refusal(400, "Transfer-Encoding must be 'chunked' with nothing but "
                                "spaces after it")
    return None


def target_problem(target: str) -> str:
    """Why ``target`` is not an origin-form request target ("" when it is)."""
    if not target.startswith("/"):
        return "the request target must be a path starting with '/' (origin-form)"
    if target.startswith("//"):
        return "the request path must not start with '//'"
    if _FORBIDDEN_IN_TARGET.search(target):
        return "the request target contains a control character, a space or a '#'"
    return ""

