"""Who the peers are.

Polling asks ``peers()`` at every round, so a membership source only has to keep
its answer current. Only static membership (``peers.static`` / ``--peer``, reloaded on
SIGHUP) exists today; DNS and Lease-based sources will implement the same one-method interface.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Peer:
    """One other control-plane member, reached through its mvproxy."""

    server_id: str
    url: str


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
