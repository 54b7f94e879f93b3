"""Accept-header negotiation the way kube-apiserver does it.

kube reads Accept as a list of media ranges, orders them by q-value (then by
specificity, keeping the client's order among equals), and serves the first range it
can satisfy. The ``as``/``g``/``v`` parameters ask for a *conversion* (aggregated
discovery, a Table, PartialObjectMetadata); a range with a conversion the endpoint
does not offer, or with an unknown parameter, is skipped rather than served plain.
Only JSON is produced here: a request that accepts nothing but protobuf gets 406.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DISCOVERY_GROUP = "apidiscovery.k8s.io"
META_GROUP = "meta.k8s.io"
AGGREGATED_KIND = "APIGroupDiscoveryList"
DISCOVERY_VERSIONS = ("v2", "v2beta1")
META_VERSIONS = ("v1", "v1beta1")

_JSON_RANGES = frozenset(("application/json", "application/*", "*/*"))
# Parameters kube tolerates on any range; "profile" is the 1.35+ discovery profile.
_HARMLESS = frozenset(("pretty", "charset", "profile"))
_CONVERSION = ("as", "g", "v")


@dataclass(frozen=True)
class MediaRange:
    """One clause of an Accept header."""

    media_type: str
    params: dict[str, str] = field(default_factory=dict)
    q: float = 1.0

    @property
    def conversion(self) -> tuple[str, str, str] | None:
        """(group, version, kind) asked for by ``g``/``v``/``as``, or None."""
        if not any(k in self.params for k in _CONVERSION):
            return None
        return (self.params.get("g", ""), self.params.get("v", ""), self.params.get("as", ""))


@dataclass(frozen=True)
class Negotiated:
    """What to send: ``kind`` is "" for the plain object, else the conversion's kind."""

    kind: str = ""
    version: str = ""


def _parse_clause(text: str) -> MediaRange | None:
    media_type, *raw_params = (p.strip() for p in text.split(";"))
    if "/" not in media_type:
        return None
    params: dict[str, str] = {}
    q = 1.0
    for raw in raw_params:
        key, _, value = raw.partition("=")
        key, value = key.strip().lower(), value.strip().strip('"')
        if key == "q":
            try:
                q = float(value)
            except ValueError:
                q = 0.0
        elif key:
            params[key] = value
    return MediaRange(media_type.lower(), params, q) if q > 0 else None


def parse_accept(header: str | None) -> list[MediaRange]:
    """Media ranges best first: by q, then concrete before wildcard, then more params."""
    if not header or not header.strip():
        return [MediaRange("*/*")]
    ranges = [r for r in (_parse_clause(c) for c in header.split(",") if c.strip()) if r]

    def rank(r: MediaRange) -> tuple:
        main, _, sub = r.media_type.partition("/")
        return (-r.q, main == "*", sub == "*", -len(r.params))

    return sorted(ranges, key=rank)  # sorted() is stable: equal ranks keep client order


def _plain_json(r: MediaRange, allow_stream: bool) -> bool:
    extra = set(r.params) - _HARMLESS - set(_CONVERSION)
    if allow_stream:
        extra.discard("stream")
    return r.media_type in _JSON_RANGES and not extra


def negotiate(header: str | None, conversions: dict[tuple[str, str, str], Negotiated],
              *, plain: bool = True, allow_stream: bool = False) -> Negotiated | None:
    """The first range this endpoint can serve, or None (→ 406).

    ``conversions`` maps (group, version, kind) to the answer for that conversion;
    ``plain`` says whether an unconverted JSON object is on offer.
    """
    for r in parse_accept(header):
        if not _plain_json(r, allow_stream):
            continue
        wanted = r.conversion
        if wanted is None:
            if plain:
                return Negotiated()
            continue
        if wanted in conversions:
            return conversions[wanted]
    return None


DISCOVERY_CONVERSIONS = {
    (DISCOVERY_GROUP, v, AGGREGATED_KIND): Negotiated(AGGREGATED_KIND, v)
    for v in DISCOVERY_VERSIONS
}


def _meta(kinds: tuple[str, ...]) -> dict[tuple[str, str, str], Negotiated]:
    return {(META_GROUP, v, k): Negotiated(k, v) for v in META_VERSIONS for k in kinds}


OBJECT_CONVERSIONS = _meta(("Table", "PartialObjectMetadata"))
LIST_CONVERSIONS = _meta(("Table", "PartialObjectMetadataList"))
WATCH_CONVERSIONS = _meta(("Table", "PartialObjectMetadata"))


def aggregated_content_type(version: str) -> str:
    """kube echoes the conversion in Content-Type; kubectl ignores bodies labelled plainly."""
    return f"application/json;g={DISCOVERY_GROUP};v={version};as={AGGREGATED_KIND}"
