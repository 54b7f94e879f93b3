"""Background polling of ``/api`` and ``/apis`` on the backend and every peer.

One task per server, so a slow peer never delays another; each poll has its own
timeout and sends ``If-None-Match`` so an unchanged document costs a 304. Results
go into the ``DiscoveryCache``. Failures keep the last good snapshot; a server never
fetched yet, or whose last poll failed, is retried after ``FIRST_RETRY``, doubling up
to the interval. Every failed
fetch is counted, so ``rate()`` is honest; it is logged once per change of state
(ok -> failing, or a different reason), not once per poll. Nothing raises out of the
loops.

Two counters (docs/operations.md, "Upstream's MVP metrics, compared"):
``mvproxy_discovery_poll_errors_total
{server,reason}`` for every failed fetch of any server, by mvproxy's own reason; and
upstream's ``apiserver_peer_discovery_sync_errors_total{type}`` for peers only (upstream
polls only peers; the backend's failures show in the first counter and in readiness):
``hostport_resolution`` once per poll whose peer address did not resolve, else
``fetch_discovery`` once per failed ``/api`` or ``/apis`` fetch, as upstream.
``lease_list`` is counted by Lease membership (``leasemembership``) when a Lease list
or watch fails; with static or DNS membership it never moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mvproxy import __version__, discovery
from mvproxy.cache import DiscoveryCache
from mvproxy.discovery import DiscoveryFormatError, Snapshot
from mvproxy.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnresolved,
)
from mvproxy.logs import kv
from mvproxy.metrics import Metrics
from mvproxy.transport import BodyTooLarge, Transport, Upstream
from mvproxy.wire import PEER_PROXIED

log = logging.getLogger(__name__)

PATHS = ("/api", "/apis")

# Upstream's peer discovery fetches authenticate as this user (kubernetes/kubernetes
# staging/src/k8s.io/apiserver/pkg/util/peerproxy/).
POLL_IDENTITY = {"X-Remote-User": "system:apiserver", "X-Remote-Group": "system:authenticated"}


@dataclass(frozen=True)
class PollSettings:
    interval: float
    timeout: float
    max_bytes: int
    jitter: float = 0.1
    """Each sleep is ``interval`` times a random factor in [1 - jitter, 1 + jitter],
    so that the members of a control plane do not poll each other in lockstep."""


@dataclass
class _ServerPoll:
    """Per-server memory between polls: ETags and the documents they stand for."""

    upstream: Upstream
    etags: dict[str, str] = field(default_factory=dict)
    groups: dict[str, tuple[dict, ...]] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    """The snapshot those documents make; handed to the cache again on a 304, so a
    server whose snapshot the cache forgot gets it back when it answers again."""
    failure: str | None = None


class UnexpectedStatus(UpstreamProtocolError):
    """A discovery fetch answered neither 200 nor (when asked) 304."""


_REASONS = (  # most specific first: BodyTooLarge and UnexpectedStatus are protocol errors
    (UpstreamUnresolved, "name_resolution"), (UpstreamConnectError, "connect"),
    (UpstreamTimeout, "timeout"), (BodyTooLarge, "oversized_discovery"),
    (UnexpectedStatus, "http_status"), (DiscoveryFormatError, "invalid_discovery"),
    (UpstreamError, "broken_response"))
REASONS = frozenset(reason for _, reason in _REASONS) | {"internal"}
"""Every value of ``mvproxy_discovery_poll_errors_total{reason}``."""
HOSTPORT_RESOLUTION, FETCH_DISCOVERY = "hostport_resolution", "fetch_discovery"
FIRST_RETRY = 0.2
"""Seconds before retrying a server whose discovery was never fetched, doubling up to
the poll interval: a peer that starts a moment after us is seen within a second, not
after a whole interval (until then, requests for its APIs get the backend's 404)."""


def failure_reason(exc: BaseException) -> str:
    """A bounded label for one failed fetch; ``internal`` is an mvproxy bug."""
    for kind, reason in _REASONS:
        if isinstance(exc, kind):
            return reason
    return "internal"


def sync_error_types(reasons: list[str]) -> list[str]:
    """Upstream's ``type`` values for one failed poll of a peer: its address not
    resolving is one ``hostport_resolution`` (upstream resolves once, then fetches);
    every other failed fetch is a ``fetch_discovery``."""
    fetches = [FETCH_DISCOVERY for reason in reasons if reason != "name_resolution"]
    return fetches if len(fetches) == len(reasons) else [HOSTPORT_RESOLUTION, *fetches]


class Poller:
    """Keeps ``cache`` current for the backend and every peer ``peers()`` names."""

    def __init__(self, *, cache: DiscoveryCache, transport: Transport, backend: Upstream,
                 peers: Callable[[], Mapping[str, Upstream]], settings: PollSettings,
                 metrics: Metrics, rng: random.Random | None = None,
                 on_failure: Callable[[str, bool, str], None] | None = None,
                 wake: asyncio.Event | None = None):
        self.cache = cache
        self._wake = wake
        """Set by a dynamic membership source when the peers changed: reconcile at once,
        so a joining peer is polled now and a leaving one dropped now."""
        self._on_failure = on_failure
        """Told (server ID, whether it just became unreachable, the first failure's
        reason) after every failed poll, so the request path stops reusing connections
        to a server that stopped answering."""
        self.transport = transport
        self.settings = settings
        self.metrics = metrics
        self._peers = peers
        self._rng = rng or random.Random()
        self._backend = _ServerPoll(backend)
        self._tasks: dict[str, asyncio.Task] = {}
        self._states: dict[str, _ServerPoll] = {}
        self._retired: set[asyncio.Task] = set()
        """Tasks of removed peers: cancelled, awaited by ``_stop_all``."""

    async def run(self) -> None:
        """Poll until cancelled, following membership changes at every interval."""
        self._start(self.cache.server_id, self._backend)
        try:
            while True:
                try:
                    self._reconcile()
                except Exception:  # a broken membership source must not stop polling
                    log.exception("cannot read the peer list; keeping the current peers")
                await self._until_next_round()
        finally:
            await self._stop_all()

    async def _until_next_round(self) -> None:
        if self._wake is None:
            await asyncio.sleep(self.settings.interval)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.settings.interval)
        self._wake.clear()

    def _reconcile(self) -> None:
        wanted = dict(self._peers())
        wanted.pop(self.cache.server_id, None)
        self.cache.set_peers(wanted)
        for server_id in set(self._tasks) - set(wanted) - {self.cache.server_id}:
            log.info("peer removed from membership", extra=kv(peer=server_id))
            self._retire(server_id)
        for server_id, upstream in wanted.items():
            known = self._states.get(server_id)
            if known is not None and known.upstream != upstream:
                log.info("peer address changed", extra=kv(peer=server_id, url=upstream.url))
                self._retire(server_id)
            if server_id not in self._tasks:
                self._start(server_id, _ServerPoll(upstream))

    def _start(self, server_id: str, state: _ServerPoll) -> None:
        self._states[server_id] = state
        self._tasks[server_id] = asyncio.create_task(
            self._loop(server_id, state), name=f"mvproxy-poll-{server_id}")

    def _retire(self, server_id: str) -> None:
        self._states.pop(server_id, None)
        task = self._tasks.pop(server_id)
        task.cancel()
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def _stop_all(self) -> None:
        tasks = [*self._tasks.values(), *self._retired]
        self._tasks, self._states, self._retired = {}, {}, set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self, server_id: str, state: _ServerPoll) -> None:
        retry = FIRST_RETRY
        while True:
            await self.poll_once(server_id, state)
            delay = self.settings.interval
            if state.snapshot is None or state.failure is not None:
                # Nothing fetched yet, or failing: try again soon, so a server that is
                # back (perhaps as another version) is seen within about a second.
                delay, retry = min(retry, delay), retry * 2
            else:
                retry = FIRST_RETRY
            spread = self._rng.uniform(-self.settings.jitter, self.settings.jitter)
            await asyncio.sleep(delay * (1 + spread))

    async def poll_once(self, server_id: str, state: _ServerPoll) -> None:
        """Fetch both documents once and record the outcome; never raises."""
        started = time.perf_counter()
        try:
            results = await asyncio.gather(*(self._fetch(state, p) for p in PATHS),
                                           return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, Exception):
                    raise result  # cancelled: not a failure of the server
            errors = [r for r in results if isinstance(r, Exception)]
            if not errors:
                self._succeeded(server_id, state, self._snapshot(state, results))
        except Exception as exc:  # a bug here must not end this server's polling
            errors = [exc]
        finally:
            self.metrics.poll_duration.labels(server_id).observe(time.perf_counter() - started)
        if errors:
            self._failed(server_id, state, errors)

    def _snapshot(self, state: _ServerPoll, results: list) -> Snapshot:
        """The server's snapshot: the same object as last time when both documents are
        unchanged (304), so the cache sees no change and keeps its generation.

        Both fetches run at once, under one timeout each; the state is updated only
        when both succeed, so a snapshot never mixes two polls' halves.
        """
        if all(result is None for result in results) and state.snapshot is not None:
            return state.snapshot
        for path, result in zip(PATHS, results, strict=True):
            if result is not None:
                state.groups[path], state.etags[path] = result
        state.snapshot = Snapshot(core=state.groups["/api"], groups=state.groups["/apis"])
        return state.snapshot

    async def _fetch(self, state: _ServerPoll, path: str) -> tuple[tuple[dict, ...], str] | None:
        """(groups, etag) for a changed document, None for a 304."""
        headers = {"Accept": discovery.PEER_ACCEPT, "User-Agent": f"mvproxy/{__version__}",
                   **POLL_IDENTITY}
        if state.upstream.is_peer:
            # A peer must answer from its own backend, not re-merge or re-route.
            headers[PEER_PROXIED] = "true"
        known = path in state.groups and state.etags.get(path)
        if known:
            headers["If-None-Match"] = state.etags[path]
        fetched = await self.transport.fetch(
            state.upstream, path, headers=headers, timeout=self.settings.timeout,
            max_bytes=self.settings.max_bytes)
        if fetched.status == 304 and known:
            return None
        if fetched.status != 200:
            raise UnexpectedStatus(state.upstream.name,
                                   f"GET {path} answered HTTP {fetched.status}")
        groups = discovery.parse_aggregated(fetched.body, max_bytes=self.settings.max_bytes)
        discovery.check_prefix(path, groups)
        return groups, fetched.headers.get("ETag", "")

    def _failed(self, server_id: str, state: _ServerPoll, errors: list[Exception]) -> None:
        """Count every failed fetch; log once per change of reason."""
        reasons = [failure_reason(exc) for exc in errors]
        for reason in reasons:
            self.metrics.poll_errors.labels(server_id, reason).inc()
        if state.upstream.is_peer:
            for sync_type in sync_error_types(reasons):
                self.metrics.discovery_sync_errors.labels(sync_type).inc()
        was_reachable = self._reachable(server_id)
        kind, exc = reasons[0], errors[0]
        self.cache.record_failure(server_id, f"{kind}: {str(exc)[:300]}")
        if kind != state.failure:
            state.failure = kind
            known = self.cache.state(server_id)
            log.warning("discovery poll failed", exc_info=exc if kind == "internal" else None,
                        extra=kv(server=server_id, reason=kind, error=str(exc)[:300],
                                 keeping_last_snapshot=bool(known and known.snapshot is not None)))
        became_unreachable = was_reachable and not self._reachable(server_id)
        if became_unreachable:
            log.warning("server became unreachable; its versions are now served as Stale",
                        extra=kv(server=server_id))
        if self._on_failure is not None:
            self._on_failure(server_id, became_unreachable, kind)

    def _succeeded(self, server_id: str, state: _ServerPoll, snapshot: Snapshot) -> None:
        was_reachable = self._reachable(server_id)
        self.cache.record_success(server_id, snapshot)
        if state.failure is not None:
            state.failure = None
            log.info("discovery poll recovered", extra=kv(server=server_id))
        elif not was_reachable:
            log.info("server reachable", extra=kv(server=server_id))

    def _reachable(self, server_id: str) -> bool:
        known = self.cache.state(server_id)
        return bool(known and known.reachable)
