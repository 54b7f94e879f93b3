"""Accept-header negotiation the way kube-apiserver does it.

kube reads Accept as a list of media ranges, orders them by q-value (then by
specificity, keeping the client's order among equals), and serves the first range it
can satisfy. The ``as``/``g``/``v`` parameters ask for a *conversion* (aggregated
discovery, a Table, PartialObjectMetadata); a range with a conversion the endpoint
does not offer, or with an unknown parameter, is skipped rather than served plain.
Only JSON is produced here: a request that accepts nothing but protobuf gets 406.
"""

from __future__ import annotations

from dataclasses import dataclass

from mvproxy import accept
from mvproxy.accept import MediaRange

DISCOVERY_GROUP = "apidiscovery.k8s.io"
META_GROUP = "meta.k8s.io"
AGGREGATED_KIND = "APIGroupDiscoveryList"
DISCOVERY_VERSIONS = ("v2", "v2beta1")
META_VERSIONS = ("v1", "v1beta1")

_JSON_RANGES = frozenset(("application/json", "application/*", "*/*"))
# Parameters kube tolerates on any range; "profile" is the 1.35+ discovery profile.
_HARMLESS = frozenset(("pretty", "charset", "profile"))
_CONVERSION = ("as", "g", "v")


def _conversion(r: MediaRange) -> tuple[str, str, str] | None:
    """(group, version, kind) asked for by ``g``/``v``/``as``, or None."""
    if not any(k in r.params for k in _CONVERSION):
        return None
    return (r.params.get("g", ""), r.params.get("v", ""), r.params.get("as", ""))


@dataclass(frozen=True)
class Negotiated:
    """What to send: ``kind`` is "" for the plain object, else the conversion's kind."""

    kind: str = ""
    version: str = ""


def parse_accept(header: str | None) -> list[MediaRange]:
    """Media ranges best first: the core parser's order (q, then concrete before
    wildcard), ranges with more parameters first among equals; no header: ``*/*``."""
    if not header or not header.strip():
        return [MediaRange("*/*")]
    return sorted(accept.parse_accept(header), key=lambda r: (*accept.rank(r), -len(r.params)))


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
        wanted = _conversion(r)
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
