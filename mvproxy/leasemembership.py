"""Membership from Leases: hold our own, follow everyone's with list + watch.

``run`` keeps two kinds of loops going until cancelled:

* renewal: this mvproxy's Lease is created, then updated every ``renew_period``
  (a conflict re-reads it; errors retry with bounded backoff, never faster than
  ``_MIN_RETRY``);
* following, one per label selector: a list, then watches from its resourceVersion;
  a watch that ends is resumed from the last resourceVersion seen, a 410 Gone re-lists,
  an error re-lists after a backoff doubling to ``_MAX_RETRY``.

``peers()`` answers from memory: the parsed Leases whose expiry has not passed, so a
killed peer drops out when its Lease expires even if nobody deletes it; a renewTime is
believed only up to when we first saw it (``mvproxy.leases``), across re-lists too.

A kube-apiserver deletes its identity Lease on every graceful shutdown, so on every
restart of a rolling upgrade, and writes a new one a few seconds after it starts
again. Dropping its peer at the deletion would make its APIs vanish from routing and
merged discovery meanwhile: a client would get 404 for what only it serves, the false
404 this proxy exists to prevent (measured against real 1.36.3: eleven 404s in 2 s of a
restart). So an identity-Lease peer whose Lease is deleted (or missing from a re-list)
stays a peer for ``departure_grace`` (``discovery.forgetAfter``: as long as a peer that
stopped answering keeps its snapshot), unreachable while it is away, so its APIs are
``Stale`` and requests for them get 503; its new Lease takes over when it comes back.
An mvproxy deletes its own Lease only when it leaves, and is dropped at once. A
Lease that does not parse (a malformed object included) is logged once (per name and
reason), counted, and ignored. Any other failure in a loop (a backend answer of an
unexpected shape, a bug) is logged (throttled), counted, and retried after the backoff:
the loops end only when cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from mvproxy.kubeclient import KubeClient, KubeError
from mvproxy.leases import (
    IDENTITY_SELECTOR,
    MVPROXY_SELECTOR,
    LeasePeer,
    LeaseRejected,
    lease_name,
    own_lease,
    parse_lease,
)
from mvproxy.logs import Throttle, kv, throttled
from mvproxy.membership import Peer
from mvproxy.metrics import Metrics

log = logging.getLogger(__name__)

_MIN_RETRY = 0.2
_MAX_RETRY = 30.0
MAX_LEASES = 5000
"""Leases remembered per selector; more are counted and ignored (memory stays bounded)."""
MAX_PEERS = 256
"""Peers taken from Leases at most; a flood of valid Leases cannot make us poll thousands."""
_MAX_LOGGED = 1024
"""Distinct (Lease, reason) pairs logged one by one; beyond, a throttled summary line."""
_FLOOD = Throttle(60.0)


IDENTITY_SOURCE = "apiserver-identity"
"""The source of peers from kube-apiserver identity Leases: their IDs (``apiserver-<hash>``)
are in no certificate, so only ``peer.caFile`` and the kubelet rule check them."""


class _Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


class LeaseMembership:
    def __init__(self, *, client: KubeClient, server_id: str, namespace: str, url: str,
                 duration: float, renew_period: float, identity_leases: bool,
                 metrics: Metrics | None = None, on_change: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 departure_grace: float = 600.0):
        self.client = client
        self.server_id = server_id
        self.namespace = namespace
        self.url = url
        self.duration = duration
        self.renew_period = renew_period
        self.selectors = (MVPROXY_SELECTOR, *((IDENTITY_SELECTOR,) if identity_leases else ()))
        self._metrics = metrics
        self._on_change = on_change or (lambda: None)
        self._clock = clock
        self._rng = rng or random.Random()
        self._leases: dict[str, dict[str, LeasePeer]] = {s: {} for s in self.selectors}
        self.departure_grace = departure_grace
        self._departed: dict[str, tuple[LeasePeer, float]] = {}
        """Identity Leases deleted, by name: (the peer, until when it still counts)."""
        self._own: dict[str, Any] | None = None
        self._logged: set[tuple[str, str]] = set()
        self._failing: dict[str, str] = {}
        self._cached: tuple[Peer, ...] = ()
        self._valid_until = 0.0
        self._dirty = True
        self.synced = asyncio.Event()
        """Set once every selector has been listed (tests and readiness wait on it)."""
        self._listed: set[str] = set()
        self.hold = True
        """Whether this process creates and renews the Lease (False: follow only)."""

    @property
    def _path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"

    # ------------------------------------------------------------------ the answer

    def peers(self) -> tuple[Peer, ...]:
        now = self._clock()
        if self._dirty or now >= self._valid_until:
            self._cached, self._valid_until = self._compute(now)
            self._dirty = False
        return self._cached

    def _compute(self, now: float) -> tuple[tuple[Peer, ...], float]:
        chosen: dict[str, LeasePeer] = {}
        sources: dict[str, str] = {}
        until: dict[str, float] = {}
        for selector in self.selectors:  # mvproxy Leases first: they win a shared ID
            source = "lease" if selector == MVPROXY_SELECTOR else IDENTITY_SOURCE
            for lease in self._leases[selector].values():
                if lease.expires > now and lease.server_id != self.server_id:
                    if chosen.setdefault(lease.server_id, lease) is lease:
                        sources[lease.server_id] = source
                        until[lease.server_id] = lease.expires
        for name, (lease, grace) in list(self._departed.items()):
            deadline = min(grace, lease.expires)
            if deadline <= now:
                del self._departed[name]
                log.info("identity Lease gone for good; its peer leaves",
                         extra=kv(lease=name))
            elif lease.server_id != self.server_id and \
                    chosen.setdefault(lease.server_id, lease) is lease:
                sources[lease.server_id] = IDENTITY_SOURCE
                until[lease.server_id] = deadline
        live = sorted(chosen.values(), key=lambda p: p.server_id)
        if len(live) > MAX_PEERS:
            self._count_rejected("too_many", len(live) - MAX_PEERS)
            live = live[:MAX_PEERS]
        next_expiry = min((until[p.server_id] for p in live), default=float("inf"))
        return tuple(Peer(p.server_id, p.url, sources[p.server_id]) for p in live), next_expiry

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._renew_loop(), name="mvproxy-lease-renew")
                 ] if self.hold else []
        tasks += [asyncio.create_task(self._follow(s), name=f"mvproxy-lease-watch-{s}")
                  for s in self.selectors]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def release(self, timeout: float = 2.0) -> bool:
        """Delete our Lease (graceful shutdown): peers drop us at once, not at expiry."""
        try:
            async with asyncio.timeout(timeout):
                status, _ = await self.client.request(
                    "DELETE", f"{self._path}/{lease_name(self.server_id)}")
        except (KubeError, TimeoutError) as exc:
            log.warning("could not delete this mvproxy's Lease; peers drop it when it "
                        "expires", extra=kv(error=str(exc)))
            return False
        finally:
            await self.client.close()
        if status not in (200, 202, 404):
            log.warning("could not delete this mvproxy's Lease; peers drop it when it "
                        "expires", extra=kv(status=status))
            return False
        log.info("deleted this mvproxy's Lease", extra=kv(lease=lease_name(self.server_id)))
        return True

    # ------------------------------------------------------------------ renewal

    async def _renew_loop(self) -> None:
        retry = _MIN_RETRY
        while True:
            try:
                await self._renew_once()
                self._recovered("renew")
                retry = _MIN_RETRY
                await asyncio.sleep(self.renew_period)
            except Exception as exc:  # noqa: BLE001 - renewal must outlive any one failure
                self._failed("renew", exc)
                await asyncio.sleep(min(retry, self.renew_period))
                retry = min(retry * 2, _MAX_RETRY)

    async def _renew_once(self) -> None:
        name = lease_name(self.server_id)
        if self._own is None:
            status, current = await self.client.request("GET", f"{self._path}/{name}")
            if status == 404:
                body = own_lease(self.server_id, self.namespace, self.url, self.duration,
                                 self._clock())
                status, created = await self.client.request("POST", self._path, body=body)
                _expect(status, created, 201, "create")
                self._own = _lease_object(status, created, "create")
                log.info("created this mvproxy's Lease", extra=kv(lease=name,
                                                                   namespace=self.namespace))
                return
            _expect(status, current, 200, "get")
            self._own = _lease_object(status, current, "get")
        body = own_lease(self.server_id, self.namespace, self.url, self.duration,
                         self._clock(), previous=self._own)
        status, updated = await self.client.request("PUT", f"{self._path}/{name}", body=body)
        if status in (404, 409):
            self._own = None  # deleted or changed by someone else: read it again
        _expect(status, updated, 200, "update")
        self._own = None  # an answer that is not a Lease: read it again next time
        self._own = _lease_object(status, updated, "update")

    # ------------------------------------------------------------------ following

    async def _follow(self, selector: str) -> None:
        """List, then watch; every retry, even after a clean end or a 410, waits a
        backoff unless the previous watch delivered events, so a backend that ends
        every stream at once (or answers 410 forever) cannot make this spin."""
        retry = _MIN_RETRY
        while True:
            try:
                rv = await self._list(selector)
                self._recovered(f"list {selector}")
                while True:
                    rv, events = await self._watch(selector, rv)
                    if events:
                        retry = _MIN_RETRY
                        continue
                    await self._pause(retry)
                    retry = min(retry * 2, _MAX_RETRY)
            except _Gone:
                log.info("lease watch expired; listing again", extra=kv(selector=selector))
            except Exception as exc:  # noqa: BLE001 - following must outlive any one failure
                self._failed(f"list {selector}", exc)
            await self._pause(retry)
            retry = min(retry * 2, _MAX_RETRY)

    async def _pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self._rng.uniform(0.8, 1.2))

    async def _list(self, selector: str) -> str:
        status, body = await self.client.request("GET", self._path,
                                                 params={"labelSelector": selector})
        _expect(status, body, 200, "list")
        items = body.get("items") if isinstance(body, dict) else None
        rv = _field(body, "metadata", "resourceVersion")
        if not isinstance(items, list) or not isinstance(rv, str):
            raise KubeError(status, "malformed", "Lease list without items or resourceVersion")
        fresh: dict[str, LeasePeer] = {}
        known = self._leases[selector]  # first sightings survive a re-list
        for item in items:
            self._take(fresh, item, known)
        for name in set(known) - set(fresh):  # deleted while we were not watching
            self._depart(selector, name, known[name])
        self._leases[selector] = fresh
        self._changed()
        self._listed.add(selector)
        if self._listed == set(self.selectors):
            self.synced.set()
        return rv

    async def _watch(self, selector: str, rv: str) -> tuple[str, int]:
        params = {"labelSelector": selector, "resourceVersion": rv,
                  "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self._rng.randint(300, 600))}
        # aclosing: a cancelled watch releases its connection now, not when GC finds it
        # Healthy watches carry a renewal at least every renew period (ours, or a
        # kube-apiserver's every 10 s); silence for two means a dead connection, found
        # before the peers' Leases would look expired.
        idle = max(2 * self.renew_period, 1.0)
        async with contextlib.aclosing(self.client.watch(self._path, params, idle)) as events:
            return await self._consume(selector, rv, events)

    async def _consume(self, selector: str, rv: str,
                       events: AsyncIterator[dict[str, Any]]) -> tuple[str, int]:
        seen = 0
        async for event in events:
            seen += 1
            kind, obj = event.get("type"), event.get("object")
            if kind == "ERROR":
                if isinstance(obj, dict) and obj.get("code") == 410:
                    raise _Gone()
                raise KubeError(200, "watch_error", "watch ERROR event")
            if not isinstance(obj, dict):
                raise KubeError(200, "malformed", "watch event without an object")
            new_rv = _field(obj, "metadata", "resourceVersion")
            if isinstance(new_rv, str) and new_rv:
                rv = new_rv
            store = self._leases[selector]
            if kind in ("ADDED", "MODIFIED"):
                self._take(store, obj)
            elif kind == "DELETED":
                name = _field(obj, "metadata", "name")
                if not isinstance(name, str):
                    self._reject("?", LeaseRejected("malformed", "deleted Lease without a name"))
                elif (gone := store.pop(name, None)) is not None:
                    self._depart(selector, name, gone)
                    self._changed()
            elif kind != "BOOKMARK":
                raise KubeError(200, "malformed", "unknown watch event type")
        return rv, seen

    def _take(self, store: dict[str, LeasePeer], obj: object,
              known: dict[str, LeasePeer] | None = None) -> None:
        """Parse ``obj`` into ``store``; ``known`` (default: ``store``) holds what was
        seen before, whose first sighting of the same renewTime is kept."""
        name = _field(obj, "metadata", "name")
        if not isinstance(name, str):
            self._reject("?", LeaseRejected("malformed", "Lease without a name"))
            return
        try:
            peer = parse_lease(obj, observed=self._clock())
            seen = (store if known is None else known).get(name)
            if seen is not None and seen.renewed == peer.renewed:
                peer = replace(peer, observed=min(seen.observed, peer.observed))
        except LeaseRejected as exc:
            if store.pop(name, None) is not None:
                self._changed()
            self._reject(name, exc)
            return
        if name not in store and len(store) >= MAX_LEASES:
            self._reject(name, LeaseRejected("too_many", f"more than {MAX_LEASES} Leases"))
            return
        if self._departed.pop(name, None) is not None:
            log.info("identity Lease back", extra=kv(lease=name))
            self._changed()
        if store.get(name) != peer:
            store[name] = peer
            self._changed()

    def _depart(self, selector: str, name: str, peer: LeasePeer) -> None:
        """An identity Lease was deleted: its kube-apiserver shut down, most often to
        restart. It stays a peer for ``departure_grace`` (module docstring)."""
        if selector != IDENTITY_SELECTOR or self.departure_grace <= 0:
            return
        if len(self._departed) >= MAX_LEASES:
            self._count_rejected("too_many")
            return
        self._departed[name] = (peer, self._clock() + self.departure_grace)
        log.info("identity Lease deleted; its peer stays, unreachable, until it comes back "
                 "or the grace ends", extra=kv(lease=name, grace_seconds=self.departure_grace))

    # ------------------------------------------------------------------ reporting

    def _changed(self) -> None:
        self._dirty = True
        self._on_change()

    def _reject(self, name: str, exc: LeaseRejected) -> None:
        self._count_rejected(exc.reason)
        key = (name[:253], exc.reason)
        if key in self._logged:
            return
        if len(self._logged) >= _MAX_LOGGED:  # a flood: one line a minute, with a count
            _FLOOD.warning(log, "ignoring many Leases that name no usable peer",
                           reason=exc.reason)
            return
        self._logged.add(key)
        level = logging.INFO if exc.reason == "no_address" else logging.WARNING
        log.log(level, "ignoring a Lease that names no usable peer",
                    extra=kv(lease=name[:253], reason=exc.reason, detail=str(exc)))

    def _count_rejected(self, reason: str, n: int = 1) -> None:
        if self._metrics is not None:
            self._metrics.membership_rejected.labels("leases", reason).inc(n)

    def _failed(self, what: str, exc: Exception) -> None:
        if not isinstance(exc, KubeError):
            self._unexpected(what, exc)
            return
        if self._metrics is not None:
            self._metrics.membership_errors.labels("leases", exc.reason).inc()
            if what.startswith("list"):  # upstream's name for a failed Lease list or watch
                self._metrics.discovery_sync_errors.labels("lease_list").inc()
        if self._failing.get(what) != exc.reason:  # log a new failure once, not every retry
            self._failing[what] = exc.reason
            hint = (" (RBAC: see docs/membership.md)" if exc.status == 403 else "")
            log.warning(f"lease {what} failed; retrying{hint}",
                        extra=kv(reason=exc.reason, error=str(exc)))

    def _unexpected(self, what: str, exc: Exception) -> None:
        """Not a KubeError: an answer of a shape nobody checked, or a bug. Counted and
        logged at most once a minute per loop, with where it happened but not its text
        (which may quote a hostile object)."""
        if self._metrics is not None:
            self._metrics.membership_errors.labels("leases", "unexpected").inc()
            if what.startswith("list"):
                self._metrics.discovery_sync_errors.labels("lease_list").inc()
        frames = traceback.extract_tb(exc.__traceback__)
        where = f"{frames[-1].name}:{frames[-1].lineno}" if frames else "?"
        self._failing[what] = "unexpected"
        throttled.log(log, logging.ERROR, f"lease {what} failed unexpectedly; retrying",
                      error=type(exc).__name__, where=where)

    def _recovered(self, what: str) -> None:
        if self._failing.pop(what, None) is not None:
            log.info(f"lease {what} works again")


def _field(obj: object, *path: str) -> object:
    """``obj[path[0]][path[1]]...``, or None where a level is not a map."""
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _lease_object(status: int, body: object, what: str) -> dict[str, Any]:
    """Our own Lease as the backend answered it; anything else is an error (renewal
    reads it again), never kept to build the next update from."""
    if not isinstance(body, dict) or not isinstance(_field(body, "metadata", "resourceVersion"),
                                                    str) \
            or not isinstance(body.get("spec", {}), dict):
        raise KubeError(status, "malformed", f"Lease {what}: the answer is not a Lease")
    return body


def _expect(status: int, body: object, wanted: int, what: str) -> None:
    if status != wanted:
        message = body.get("message") if isinstance(body, dict) else None
        detail = f": {message[:200]}" if isinstance(message, str) else ""
        raise KubeError(status, f"http_{status}", f"Lease {what}: HTTP {status}{detail}")
