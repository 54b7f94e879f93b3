"""Who the peers are.

Polling asks ``peers()`` at every round (and at once when a dynamic source reports a
change), routing at every request, so a source only has to keep its answer current
and cheap. Sources: static (``peers.static`` / ``--peer``, here, reloaded on SIGHUP),
Leases (``leasemembership``) and DNS (``dnsmembership``); ``CombinedMembership`` joins
them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Peer:
    """One other control-plane member, reached through its mvproxy."""

    server_id: str
    url: str
    source: str = field(default="static", compare=False)
    """Where membership learnt of it ("static", "lease", "dns"), for the status page."""


class Membership(Protocol):
    def peers(self) -> tuple[Peer, ...]:
        """The current peers, in a stable order; never includes this server."""


class StaticMembership:
    """Peers from configuration; they change only when the configuration is reloaded."""

    def __init__(self, peers: Iterable[Peer]):
        self._peers = tuple(peers)

    def peers(self) -> tuple[Peer, ...]:
        return self._peers

    def update(self, peers: Iterable[Peer]) -> None:
        """The reloaded list; polling and routing follow within one poll interval."""
        self._peers = tuple(peers)


class CombinedMembership:
    """Several sources as one: the first source naming a server ID wins (static first),
    and a URL the operator listed is not taken again by a dynamic source. Dynamic
    sources may share a URL: which ID is true there is decided per connection by the
    serving certificate (``tls.peer_serving_problem``), never by who sorted first, so a
    Lease cannot push a real peer out by claiming its URL. This server's own ID is never
    a peer; neither are its own URLs (advertised, backend) when a dynamic source names
    them (a static peer is the operator's word)."""

    def __init__(self, static: Membership, dynamic: Iterable[Membership], *, own_id: str,
                 own_urls: Iterable[str] = ()):
        self._sources = (static, *dynamic)
        self._own_id = own_id
        self._own_urls = frozenset(normalise_url(u) for u in own_urls)
        self._last: tuple[tuple[Peer, ...], ...] | None = None
        self._peers: tuple[Peer, ...] = ()

    def peers(self) -> tuple[Peer, ...]:
        answers = tuple(source.peers() for source in self._sources)
        if answers != self._last:
            self._last, self._peers = answers, self._combine(answers)
        return self._peers

    def _combine(self, answers: tuple[tuple[Peer, ...], ...]) -> tuple[Peer, ...]:
        chosen: dict[str, Peer] = {}
        urls: set[str] = set()
        for index, answer in enumerate(answers):
            for peer in answer:
                url = normalise_url(peer.url)
                if peer.server_id == self._own_id or peer.server_id in chosen \
                        or url in urls or (index and url in self._own_urls):
                    continue
                chosen[peer.server_id] = peer
                if not index:
                    urls.add(url)
        return tuple(sorted(chosen.values(), key=lambda p: p.server_id))


def normalise_url(url: str) -> str:
    """``https://Host:443/`` and ``https://host`` are the same address."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 443
    except ValueError:
        return url
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}:{port}"
