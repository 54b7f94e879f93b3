"""The discovery cache: one snapshot per server, replaced whole, read once per request.

``polling`` writes (``record_success``, ``record_failure``, ``set_peers``); the
request path reads ``view()``, an immutable ``CacheView`` rebuilt only when
something a client could notice changed (a snapshot, reachability, membership).
Each rebuild bumps ``generation``; the merged discovery bytes and the routing
index belong to one view, so they are computed once per generation, never per
request.

Reachability: a server is *reachable* until ``stale_after`` seconds pass without a
successful poll, and its snapshot is *forgotten* (dropped from routing and merged
discovery) after ``forget_after``. A peer that never answered has no snapshot and
counts as unreachable from its first failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from mvproxy import discovery
from mvproxy.discovery import Snapshot


@dataclass(frozen=True)
class ServerState:
    """What is known about one server's discovery."""

    server_id: str
    snapshot: Snapshot | None = None
    """Last good snapshot; kept through failures until ``forget_after``."""
    polled: bool = False
    """At least one poll finished, successfully or not (readiness waits for this)."""
    reachable: bool = False
    last_success: float | None = None
    """Monotonic time of the last successful poll."""
    first_failure: float | None = None
    """Monotonic time of the first failure of the current failing streak."""
    last_poll: float | None = None
    """Monotonic time the last poll finished, successfully or not (for operators)."""
    last_error: str | None = None
    """Why the last poll failed (reason and message); None after a success."""


@dataclass(frozen=True)
class Document:
    """A rendered discovery document and its ETag."""

    body: bytes
    etag: str


_EMPTY: tuple[str, ...] = ()
_PEER_ONLY_MEMO_MAX = 4096


@dataclass(frozen=True)
class CacheView:
    """Everything one request needs, consistent with itself.

    ``capable`` maps (group, version, resource, subresource) and ``capable_gv`` maps
    (group, version) to the peers whose snapshot lists it; ``reachable`` filters
    them. Lookups are O(1) in the number of resources.
    """

    generation: int
    server_id: str
    backend: ServerState
    peers: Mapping[str, ServerState]
    synced: bool
    capable: Mapping[tuple[str, str, str, str], tuple[str, ...]]
    capable_gv: Mapping[tuple[str, str], tuple[str, ...]]
    capable_group: Mapping[str, tuple[str, ...]]
    reachable: frozenset[str]
    local_groups: frozenset[str]
    """Group names the backend serves (any version), for ``/apis/<g>`` routing."""
    _documents: dict = field(default_factory=dict, compare=False, repr=False)

    def capable_peers(self, group: str, version: str, resource: str,
                      subresource: str = "") -> tuple[str, ...]:
        return self.capable.get((group, version, resource, subresource), _EMPTY)

    def capable_group_version_peers(self, group: str, version: str) -> tuple[str, ...]:
        return self.capable_gv.get((group, version), _EMPTY)

    def capable_group_peers(self, group: str) -> tuple[str, ...]:
        return self.capable_group.get(group, _EMPTY)

    def merged(self) -> Snapshot | None:
        """The union of every known snapshot, unreachable servers' versions marked Stale."""
        if "merged" not in self._documents:
            self._documents["merged"] = _merge(self)
        return self._documents["merged"]

    def merged_group(self, name: str) -> dict | None:
        """The merged named group ``name`` if it lists a version (what ``/apis/<name>``
        shows); the same groups as ``local_groups`` plus ``capable_group``."""
        if "groups" not in self._documents:
            merged = self.merged()
            self._documents["groups"] = {
                discovery.group_name(g): g for g in (merged.groups if merged else ())
                if g.get("versions")}
        return self._documents["groups"].get(name)

    def peer_only_resources(self, group: str, version: str) -> tuple[dict, ...]:
        """Legacy ``APIResource`` entries the merged view lists in ``group``/``version``
        and the backend does not (``discovery.peer_only_resources``), memoised per
        group/version for this generation; empty before the backend's first poll."""
        memo = self._documents.setdefault("peer-only-resources", {})
        found = memo.get((group, version))
        if found is None:
            merged, local = self.merged(), self.backend.snapshot
            found = (discovery.peer_only_resources(merged, local, group, version)
                     if merged is not None and local is not None else ())
            if len(memo) < _PEER_ONLY_MEMO_MAX:  # keys are group/versions the backend serves
                memo[(group, version)] = found
        return found

    def document(self, key: tuple[str, ...], render: Callable[[], bytes]) -> tuple[Document, bool]:
        """Memoised rendering for this generation; returns (document, was_cached)."""
        cached = self._documents.get(key)
        if cached is not None:
            return cached, True
        body = render()
        self._documents[key] = Document(body, discovery.etag(body))
        return self._documents[key], False


def _merge(view: CacheView) -> Snapshot | None:
    snapshots = {view.server_id: view.backend.snapshot} if view.backend.snapshot else {}
    stale = set() if view.backend.reachable else {view.server_id}
    for peer_id, state in view.peers.items():
        if state.snapshot is not None:
            snapshots[peer_id] = state.snapshot
            if peer_id not in view.reachable:
                stale.add(peer_id)
    return discovery.merge(snapshots, stale=stale) if snapshots else None


def _index(peers: Mapping[str, ServerState]
           ) -> tuple[Mapping[tuple, tuple[str, ...]], Mapping[tuple, tuple[str, ...]],
                      Mapping[str, tuple[str, ...]]]:
    capable: dict[tuple, list[str]] = {}
    capable_gv: dict[tuple, list[str]] = {}
    capable_group: dict[str, list[str]] = {}
    for peer_id in sorted(peers):
        snapshot = peers[peer_id].snapshot
        if snapshot is None:
            continue
        for gvr in snapshot.gvrs:
            capable.setdefault((*gvr, ""), []).append(peer_id)
        for gvrs in snapshot.subresources:
            capable.setdefault(gvrs, []).append(peer_id)
        for gv in snapshot.group_versions:
            capable_gv.setdefault(gv, []).append(peer_id)
        for group in {g for g, _ in snapshot.group_versions}:
            capable_group.setdefault(group, []).append(peer_id)
    def freeze(d: dict) -> Mapping:
        return MappingProxyType({k: tuple(v) for k, v in d.items()})
    return freeze(capable), freeze(capable_gv), freeze(capable_group)


class DiscoveryCache:
    """Holds ``ServerState`` per server and publishes ``CacheView`` generations."""

    def __init__(self, server_id: str, peer_ids: Iterable[str], *, stale_after: float,
                 forget_after: float, clock: Callable[[], float] = time.monotonic):
        self.server_id = server_id
        self.stale_after = stale_after
        self.forget_after = forget_after
        self._clock = clock
        self._backend = ServerState(server_id)
        self._peers: dict[str, ServerState] = {p: ServerState(p) for p in peer_ids}
        self._generation = 0
        self._view = self._build()

    def view(self) -> CacheView:
        return self._view

    @property
    def generation(self) -> int:
        return self._generation

    def peer_ids(self) -> tuple[str, ...]:
        return tuple(self._peers)

    def state(self, server_id: str) -> ServerState | None:
        if server_id == self.server_id:
            return self._backend
        return self._peers.get(server_id)

    def set_peers(self, peer_ids: Iterable[str]) -> None:
        """Membership changed: keep known peers' state, add new ones, drop the rest."""
        wanted = list(dict.fromkeys(peer_ids))
        if set(wanted) == set(self._peers):
            return  # order is not visible: the index and the merge sort by server ID
        self._peers = {p: self._peers.get(p) or ServerState(p) for p in wanted}
        self._publish()

    def record_success(self, server_id: str, snapshot: Snapshot | None) -> None:
        """A poll succeeded; ``snapshot`` None means unchanged (the server answered 304)."""
        old = self.state(server_id)
        if old is None:
            return
        new = replace(old, snapshot=snapshot if snapshot is not None else old.snapshot,
                      polled=True, reachable=True, last_success=self._clock(),
                      first_failure=None, last_poll=self._clock(), last_error=None)
        self._store(old, new)

    def record_failure(self, server_id: str, error: str | None = None) -> None:
        """A poll failed (``error`` says why, for operators): keep the last good snapshot
        until it is stale, then forgotten."""
        old = self.state(server_id)
        if old is None:
            return
        now = self._clock()
        first_failure = old.first_failure if old.first_failure is not None else now
        since = old.last_success if old.last_success is not None else first_failure
        snapshot = old.snapshot if now - since < self.forget_after else None
        reachable = old.last_success is not None and now - since < self.stale_after
        new = replace(old, snapshot=snapshot, polled=True, reachable=reachable,
                      first_failure=first_failure, last_poll=now, last_error=error)
        self._store(old, new)

    def _store(self, old: ServerState, new: ServerState) -> None:
        if new.server_id == self.server_id:
            self._backend = new
        else:
            self._peers[new.server_id] = new
        if _visible(old) != _visible(new) or old.snapshot is not new.snapshot and \
                old.snapshot != new.snapshot:
            self._publish()
        else:
            # Timestamps changed only: keep the generation (and its memoised bytes).
            self._view = replace(self._view, backend=self._backend,
                                 peers=MappingProxyType(dict(self._peers)),
                                 _documents=self._view._documents)

    def _publish(self) -> None:
        self._generation += 1
        self._view = self._build()

    def _build(self) -> CacheView:
        capable, capable_gv, capable_group = _index(self._peers)
        local = self._backend.snapshot
        synced = self._backend.polled and all(s.polled for s in self._peers.values())
        return CacheView(
            generation=self._generation, server_id=self.server_id, backend=self._backend,
            peers=MappingProxyType(dict(self._peers)), synced=synced, capable=capable,
            capable_gv=capable_gv, capable_group=capable_group,
            reachable=frozenset(p for p, s in self._peers.items() if s.reachable),
            local_groups=frozenset(g for g, _ in local.group_versions) if local else frozenset())


def _visible(state: ServerState) -> tuple[bool, bool, bool]:
    """The parts of a state that change routing, readiness or merged discovery."""
    return state.polled, state.reachable, state.snapshot is None
