"""The ``Accept`` header read as kube-apiserver reads it (Go's goautoneg); pure.

One parser for the daemon's discovery negotiation (``discovery.negotiate``) and the
simulator's (``devcluster.mediatypes``); what each can *serve* is theirs to decide.
Clauses come best first: by falling q, then concrete before wildcard types, keeping
the client's order among equals. A clause with q=0, an unparsable or NaN q, or no
``type/subtype`` is left out; a bare ``*`` is read as ``*/*``, as goautoneg does. Only
the first ``MAX_CLAUSES`` clauses (and ``MAX_PARAMS`` parts of each) are read: unlike
goautoneg, which reads them all, so a huge header cannot buy CPU time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MediaRange:
    """One clause of an Accept header: lowercased type, parameters (keys lowercased,
    values unquoted, without ``q``) and its quality."""

    media_type: str
    params: dict[str, str] = field(default_factory=dict)
    q: float = 1.0


def _quality(text: str) -> float:
    try:
        q = float(text)
    except ValueError:
        return 0.0  # as goautoneg: an unparsable q excludes the clause
    return q if q == q else 0.0  # NaN


MAX_CLAUSES = 64
"""Clauses read from one Accept header; later ones are ignored. Real clients send one to
four; without a bound a 1 MiB header of clauses costs a quarter second of CPU to sort,
on every request that sends it."""
MAX_PARAMS = 16
"""Parameters read from one clause (kube's discovery types use three, plus ``q``)."""


def _clause(text: str) -> MediaRange | None:
    media_type, *raw_params = text.split(";", MAX_PARAMS)[:MAX_PARAMS]
    media_type = media_type.strip().lower()
    if media_type == "*":
        media_type = "*/*"
    if "/" not in media_type:
        return None
    params: dict[str, str] = {}
    for raw in raw_params:
        key, _, value = raw.partition("=")
        key = key.strip().lower()
        if key:
            params[key] = value.strip().strip('"')
    q = _quality(params.pop("q", "1"))
    return MediaRange(media_type, params, q) if q > 0 else None


def rank(r: MediaRange) -> tuple[float, bool, bool]:
    """The sort key: higher q first, then concrete before wildcard type and subtype."""
    main, _, sub = r.media_type.partition("/")
    return -r.q, main == "*", sub == "*"


def parse_accept(header: str) -> list[MediaRange]:
    """The acceptable clauses of ``header``, best first (sorting is stable: equal ranks
    keep the client's order)."""
    parts = header.split(",", MAX_CLAUSES)[:MAX_CLAUSES]
    ranges = [r for r in (_clause(part) for part in parts if part.strip()) if r]
    return sorted(ranges, key=rank)
