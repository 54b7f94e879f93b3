"""Assembly and lifecycle: a completed ``Config`` becomes two running listeners.

``build_daemon`` *completes* the configuration (SSL contexts, upstreams, cache,
poller, handlers); ``serve`` runs the main listener (``listener``, the data plane),
the admin listener (aiohttp: not on the request path) and the poller until
SIGTERM/SIGINT, then drains in-flight requests for at most
``timeouts.shutdownGracePeriod`` and returns. Nothing here re-reads YAML.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import resource
import signal
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from aiohttp import web

from mvproxy import h2upstream, logs, reload
from mvproxy.admin import build_admin_app, metrics_app, metrics_handler
from mvproxy.cache import DiscoveryCache
from mvproxy.certreload import CertificateReloader, DaemonTLS
from mvproxy.config import Config, DiscoveryConfig, StaticPeer, TimeoutsConfig
from mvproxy.discoveryhandler import DiscoveryHandler
from mvproxy.dnsmembership import DNSMembership
from mvproxy.errors import UsageError
from mvproxy.handlers import Proxy
from mvproxy.http2 import Http2Settings, Http2Stats, Session, open_session
from mvproxy.identity import ANONYMOUS_DOWNSTREAM, IdentityResolver
from mvproxy.kubeclient import KubeClient
from mvproxy.leasemembership import LeaseMembership
from mvproxy.listener import DownstreamConnection, Limits, Listener
from mvproxy.live import LiveSettings
from mvproxy.logs import kv
from mvproxy.membership import CombinedMembership, Membership, Peer, StaticMembership
from mvproxy.metrics import Metrics
from mvproxy.polling import Poller, PollSettings
from mvproxy.status import Sources, membership_sources
from mvproxy.tls import SwappableContext
from mvproxy.transport import Transport, Upstream

log = logging.getLogger(__name__)


@dataclass
class Daemon:
    """The completed parts of one mvproxy; built once, then only run."""

    config: Config
    listener_ssl: SwappableContext
    metrics: Metrics
    cache: DiscoveryCache
    transport: Transport
    poll_transport: Transport
    """Discovery polls get their own pools: a flood of watches must not starve them."""
    poller: Poller
    proxy: Proxy
    identity: IdentityResolver
    limits: Limits
    draining: asyncio.Event
    """Set on SIGTERM: /readyz fails so load balancers stop sending new requests."""
    certificates: CertificateReloader
    """Re-reads changed certificate files every ``certificates.reloadInterval``."""
    membership: StaticMembership
    peer_ssl: SwappableContext | None
    """Client context toward peers (None: started without peer TLS material)."""
    peer_sources: Sources | None = None
    """Where membership learnt of each peer, for the admin status endpoints."""
    leases: LeaseMembership | None = None
    """Lease membership (``peers.leases``): run beside the poller, released on shutdown."""
    dns: DNSMembership | None = None
    """DNS membership (``peers.dns``): run beside the poller."""

    # What a reload may change (``reload.Reloadable``); each records its section.

    @property
    def peers_reachable(self) -> bool:
        return self.peer_ssl is not None

    def set_peers(self, peers: Sequence[StaticPeer]) -> None:
        self.membership.update(Peer(p.server_id, p.url) for p in peers)
        self.config = replace(self.config, membership=replace(self.config.membership,
                                                              static=tuple(peers)))

    def set_discovery(self, discovery: DiscoveryConfig) -> None:
        self.poller.settings = replace(self.poller.settings, interval=discovery.poll_interval,
                                       timeout=discovery.timeout,
                                       max_bytes=discovery.max_document_bytes)
        self.cache.stale_after = discovery.stale_after
        self.cache.forget_after = discovery.forget_after
        self.config = replace(self.config, discovery=discovery)
        self.proxy.discovery.live.update(self.config)

    def set_timeouts(self, timeouts: TimeoutsConfig) -> None:
        """The shutdown settings are read from ``config`` when a signal comes."""
        for transport in (self.transport, self.poll_transport):
            transport.set_timeouts(connect=timeouts.connect, request=timeouts.request)
        self.config = replace(self.config, timeouts=timeouts)
        self.proxy.discovery.live.update(self.config)

    def set_verbosity(self, verbosity: int) -> None:
        logs.set_verbosity(verbosity)
        self.config = replace(self.config, logging=replace(self.config.logging,
                                                           verbosity=verbosity))


BACKEND_SILENT = frozenset(("timeout", "connect"))
"""Poll failures (``polling.failure_reason``) that mean the backend answers nothing:
its requests in flight are then ended rather than left to ``timeouts.request``."""

NAMED_SOURCES = frozenset(("lease", "dns"))
"""Membership sources whose peers must carry their server ID in their serving
certificate: anyone allowed to write a Lease (or a DNS record) chose their address."""


def _peer_upstreams(membership: Membership, peer_ssl: SwappableContext | None,
                    peer_h2: SwappableContext | None = None
                    ) -> Callable[[], Mapping[str, Upstream]]:
    """A function giving the current peers as Upstreams, rebuilt only when they change.

    Without peer TLS material no peer can be reached; there are none then, since the
    configuration requires the peer files for any membership source, and a reload does
    not add static peers live to a daemon started without them."""
    cached: dict[tuple[Peer, ...], Mapping[str, Upstream]] = {}
    if peer_ssl is None:
        return lambda: {}

    def current() -> Mapping[str, Upstream]:
        peers = membership.peers()
        if peers not in cached:
            cached.clear()
            cached[peers] = {p.server_id: Upstream(
                p.server_id, p.url.rstrip("/"), peer_ssl, is_peer=True,
                must_name_itself=p.source in NAMED_SOURCES, h2_context=peer_h2)
                for p in peers}
        return cached[peers]
    return current


def build_daemon(cfg: Config, *, rng: random.Random | None = None) -> Daemon:
    if cfg.peer.insecure_shared_ca:
        log.warning("peer.insecureSharedCA is set: a user certificate with an allowed peer "
                    "name can act as a peer and claim any user")
    metrics = Metrics()
    transport = Transport(connect_timeout=cfg.timeouts.connect,
                          request_timeout=cfg.timeouts.request)
    identity = IdentityResolver(client_ca_file=cfg.client_ca_file,
                                peer_client_ca_file=cfg.peer.client_ca_file,
                                peer_allowed_names=cfg.peer.allowed_names)
    tls = DaemonTLS(cfg, identity,
                    on_refused=lambda role: metrics.certificate_reload_errors.labels(role).inc())
    backend_url = cfg.backend.url.rstrip("/")
    h2 = cfg.upstream_http2 != "off"
    if h2:
        transport.open_session = h2upstream.open_session
        transport.http2_all = cfg.upstream_http2 == "all"
        metrics.watch_upstream_http2(transport.http2_sessions)
    backend = Upstream("backend", backend_url, tls.backend,
                       h2_context=tls.h2("backend") if h2 else None,
                       anonymous=Upstream("backend", backend_url, tls.backend_anonymous,
                                          presents_certificate=False,
                                          h2_context=tls.h2("backend-anonymous") if h2
                                          else None))
    membership_changed = asyncio.Event()
    peer_ssl = tls.peer  # None: started without peer TLS material
    static = StaticMembership(Peer(p.server_id, p.url) for p in cfg.peers)
    leases = _lease_membership(cfg, metrics, membership_changed.set, tls.backend)
    dns = _dns_membership(cfg, metrics, membership_changed.set, peer_ssl)
    membership = CombinedMembership(
        static, [source for source in (leases, dns) if source is not None],
        own_id=cfg.server_id, own_urls=[u for u in (cfg.peer.advertise_url, cfg.backend.url) if u])
    peers = _peer_upstreams(membership, peer_ssl, tls.h2("peer") if h2 else None)
    cache = DiscoveryCache(cfg.server_id, peers(), stale_after=cfg.discovery.stale_after,
                           forget_after=cfg.discovery.forget_after)
    metrics.watch_peers(lambda: _peer_states(cache))
    metrics.watch_certificates(tls.reloader.expiries)
    poll_transport = Transport(connect_timeout=cfg.timeouts.connect,
                               request_timeout=cfg.timeouts.request, max_idle_per_upstream=2)

    def stopped_answering(server_id: str, unreachable: bool, reason: str) -> None:
        if server_id == cfg.server_id:
            backend_stopped_answering(unreachable, reason)
            return
        if unreachable:
            aborted = transport.reset(server_id)
            if aborted:
                log.warning("ended the requests in progress through an unreachable peer; "
                            "their clients retry elsewhere", extra=kv(peer=server_id,
                                                                      ended=aborted))
        else:
            transport.drop_idle(server_id)

    def backend_stopped_answering(unreachable: bool, reason: str) -> None:
        """A backend that answers nothing at all (frozen, or cut off: its polls time
        out or cannot connect) must not hold requests until ``timeouts.request``: its
        idle connections go at the first such poll, so new requests fail within
        ``timeouts.connect``, and once it is unreachable (``discovery.staleAfter``) the
        requests waiting on it are ended too. A backend that answers, even with errors
        (429 under load), keeps its connections and its requests."""
        if reason not in BACKEND_SILENT:
            return
        if not unreachable:
            transport.drop_idle(backend.name)
            return
        aborted = transport.reset(backend.name)
        if aborted:
            log.warning("ended the requests waiting on a backend that stopped answering",
                        extra=kv(ended=aborted, reason=reason))

    poller = Poller(cache=cache, transport=poll_transport, backend=backend, peers=peers,
                    settings=PollSettings(cfg.discovery.poll_interval, cfg.discovery.timeout,
                                          cfg.discovery.max_document_bytes),
                    metrics=metrics, on_failure=stopped_answering, wake=membership_changed)
    discovery = DiscoveryHandler(cache=cache, transport=transport, backend=backend,
                                 metrics=metrics, live=LiveSettings.of(cfg), peers=peers)
    proxy = Proxy(server_id=cfg.server_id, cache=cache, transport=transport, backend=backend,
                  peers=peers, metrics=metrics, discovery=discovery,
                  rng=rng or random.Random())
    limits = Limits(header_read_timeout=cfg.listener.header_read_timeout,
                    idle_timeout=cfg.listener.idle_timeout,
                    max_header_bytes=cfg.listener.max_header_bytes,
                    max_connections=cfg.listener.max_connections or _derived_max_connections(),
                    max_pending_handshakes=cfg.listener.max_pending_handshakes)
    return Daemon(cfg, tls.listener, metrics, cache, transport, poll_transport,
                  poller, proxy, identity, limits, asyncio.Event(), tls.reloader, static,
                  peer_ssl, membership_sources(membership), leases, dns)


def serve_http2(listener: Listener, cfg: Config, metrics: Metrics) -> Http2Stats:
    """Hand connections whose client chose ``h2`` to an HTTP/2 session each."""
    stats = Http2Stats()
    settings = Http2Settings(max_concurrent_streams=cfg.listener.max_concurrent_streams,
                             goaway_chance=cfg.listener.goaway_chance)

    def opened(conn: DownstreamConnection) -> Session:
        assert listener.streams is not None
        return open_session(conn, listener.streams, settings, stats)
    listener.serve_http2(opened)
    metrics.watch_http2(stats, lambda: len(listener.streams.connections)
                        if listener.streams is not None else 0)
    return stats


def _dns_membership(cfg: Config, metrics: Metrics, on_change: Callable[[], None],
                    peer_ssl: SwappableContext | None) -> DNSMembership | None:
    dns = cfg.membership.dns
    if dns.name is None or peer_ssl is None:
        return None
    return DNSMembership(name=dns.name, port=dns.port, interval=dns.interval,
                         ssl_context=peer_ssl, timeout=cfg.timeouts.connect, metrics=metrics,
                         on_change=on_change)


def _lease_membership(cfg: Config, metrics: Metrics, on_change: Callable[[], None],
                      backend_ssl: SwappableContext) -> LeaseMembership | None:
    """Lease membership talks to the backend as a front proxy (docs/membership.md),
    with the backend client certificate in use now (it rotates with the others)."""
    leases = cfg.membership.leases
    if not leases.enabled:
        return None
    client = KubeClient(cfg.backend.url, backend_ssl, cfg.server_id,
                        timeout=min(cfg.timeouts.request, max(1.0, leases.renew_period)))
    return LeaseMembership(client=client, server_id=cfg.server_id, namespace=leases.namespace,
                           url=cfg.peer.advertise_url or "", duration=leases.lease_duration,
                           renew_period=leases.renew_period,
                           identity_leases=leases.api_server_identity, metrics=metrics,
                           on_change=on_change, departure_grace=cfg.discovery.forget_after)


FD_RESERVE = 128
"""Descriptors kept for discovery polls, the admin listener, logs and certificate files."""


def _derived_max_connections() -> int:
    """Half the open-file limit less a reserve: each downstream connection may hold an
    upstream one. The soft limit is raised to the hard one first, as Go programs
    (kube-apiserver among them) do at start."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, (soft - FD_RESERVE) // 2)


def _peer_states(cache: DiscoveryCache) -> Iterator[tuple[str, bool, float | None]]:
    now = time.monotonic()
    for peer_id in cache.peer_ids():
        state = cache.state(peer_id)
        age = now - state.last_success if state and state.last_success is not None else None
        yield peer_id, bool(state and state.reachable), age


@dataclass(frozen=True)
class WorkerRole:
    """What differs in a worker of ``run --workers N``: it shares the secure port with
    the others (SO_REUSEPORT), answers its supervisor's admin requests on a Unix socket,
    and stops when the supervisor's pipe on its stdin closes (the supervisor died)."""

    index: int
    admin_socket: str


@contextlib.asynccontextmanager
async def running(daemon: Daemon, worker: WorkerRole | None = None
                  ) -> AsyncIterator[tuple[int, int]]:
    """Listeners and the poller up; yields (proxy port, admin port: 0 for a worker);
    stops everything."""
    cfg = daemon.config
    leases = daemon.leases
    if leases is not None and worker is not None and worker.index != 0:
        leases.hold = False  # one Lease per member: worker 0 holds it, all follow
    lease_task = (asyncio.create_task(leases.run(), name="mvproxy-leases")
                  if leases is not None else None)
    dns_task = (asyncio.create_task(daemon.dns.run(), name="mvproxy-dns")
                if daemon.dns is not None else None)
    poller = asyncio.create_task(daemon.poller.run(), name="mvproxy-poller")
    reload_every = cfg.certificates.reload_interval
    reloader = asyncio.create_task(daemon.certificates.run(reload_every)
                                   if reload_every > 0 else asyncio.sleep(0),
                                   name="mvproxy-certificates")
    listener = Listener(handler=daemon.proxy.handle,
                        limits=daemon.limits,
                        ssl_context=daemon.listener_ssl,
                        resolve_identity=daemon.identity.resolve,
                        anonymous=ANONYMOUS_DOWNSTREAM,
                        on_refused=lambda code: daemon.metrics.refused_requests.labels(
                            str(code)).inc())
    daemon.metrics.watch_connections(lambda: listener.open_connections)
    if cfg.listener.http2:
        serve_http2(listener, cfg, daemon.metrics)
    admin = web.AppRunner(build_admin_app(daemon.cache, daemon.metrics, daemon.draining,
                                          daemon.peer_sources,
                                          allowed_hosts=None if worker is not None
                                          else cfg.admin.allowed_hosts),
                          access_log=None, handle_signals=False,
                          shutdown_timeout=_AIOHTTP_SHUTDOWN)
    # With --workers the supervisor serves /metrics (added up) on this address instead.
    metrics_only = (web.AppRunner(metrics_app(metrics_handler(daemon.metrics),
                                              allowed_hosts=cfg.admin.allowed_hosts),
                                  access_log=None, handle_signals=False,
                                  shutdown_timeout=_AIOHTTP_SHUTDOWN)
                    if cfg.admin.metrics_bind_address is not None and worker is None else None)
    try:
        try:
            port = listener.start(cfg.bind_address, cfg.secure_port,
                                  reuse_port=worker is not None)
        except OSError as exc:
            raise UsageError(f"cannot listen on {cfg.bind_address}:{cfg.secure_port}: "
                             f"{exc.strerror or exc}") from None
        if worker is None:
            ports = (port, await _start(admin, cfg.admin.bind_address, cfg.admin.port, None))
            if metrics_only is not None:
                assert cfg.admin.metrics_bind_address is not None
                metrics_port = await _start(metrics_only, cfg.admin.metrics_bind_address,
                                            cfg.admin.metrics_port, None)
                log.info("serving /metrics alone", extra=kv(
                    address=cfg.admin.metrics_bind_address, port=metrics_port))
        else:
            await admin.setup()
            name = worker.admin_socket  # "@name": the abstract namespace, no file
            await web.UnixSite(admin, "\0" + name[1:] if name.startswith("@") else name).start()
            ports = (port, 0)
        log.info("serving", extra=kv(server_id=cfg.server_id, port=ports[0], admin_port=ports[1],
                                     peers=len(cfg.peers),
                                     max_connections=daemon.limits.max_connections))
        yield ports
    finally:
        if dns_task is not None:
            dns_task.cancel()
            await asyncio.gather(dns_task, return_exceptions=True)
        # Leases first: peers stop routing here while we drain.
        if leases is not None and lease_task is not None:
            lease_task.cancel()
            await asyncio.gather(lease_task, return_exceptions=True)
            if leases.hold:
                await leases.release()
        await _drain(daemon, listener)
        await listener.close()
        await admin.cleanup()
        if metrics_only is not None:
            await metrics_only.cleanup()
        poller.cancel()
        reloader.cancel()
        await asyncio.gather(poller, reloader, return_exceptions=True)
        await daemon.transport.close()
        await daemon.poll_transport.close()


_AIOHTTP_SHUTDOWN = 0.5
_DRAIN_CHECK = 0.05


async def _drain(daemon: Daemon, listener: Listener) -> None:
    """Stop accepting, let in-flight requests finish within the grace period, then end
    the rest (watches, exec sessions), so SIGTERM exits within shutdownGracePeriod."""
    grace = daemon.config.timeouts.shutdown_grace_period
    daemon.draining.set()
    listener.stop_accepting()
    listener.close_idle()
    log.info("shutting down; draining in-flight requests",
             extra=kv(in_flight=listener.in_flight(), grace_seconds=grace))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while listener.in_flight() and loop.time() < deadline:
        await asyncio.sleep(min(_DRAIN_CHECK, max(0.0, deadline - loop.time())))
        listener.close_idle()
    cancelled = listener.cancel_in_flight()
    if cancelled:
        log.info("grace period over; ended the requests still open",
                 extra=kv(ended=cancelled))
        await asyncio.sleep(0)


async def _start(runner: web.AppRunner, host: str, port: int,
                 ssl_context: ssl.SSLContext | None) -> int:
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return runner.addresses[-1][1]


async def serve(daemon: Daemon, worker: WorkerRole | None = None, *,
                load: Callable[[], Config] | None = None) -> None:
    """Run until SIGTERM or SIGINT (a worker also: until its supervisor is gone), then
    fail /readyz, keep serving for ``timeouts.shutdownDelay``, drain and return (exit
    status 0). With ``load``, SIGHUP re-reads the configuration (``reload``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if load is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: reload.reload(daemon, load))
    if worker is not None:
        _stop_when_closed(sys.stdin.fileno(), stop)
    async with running(daemon, worker):
        freeze_startup_heap()
        await stop.wait()
        await _shutdown_delay(daemon, stop)


def freeze_startup_heap() -> None:
    """Put what start-up built (modules, configuration, contexts: ~50,000 objects) out
    of the cyclic collector's reach, so that a full collection walks only what serving
    made (~4,000): measured under the handshake bench, one took 17-125 ms, a pause that
    every connection in flight waits out. Reference counting still frees frozen
    objects; only a cycle among them that a reload drops stays, once per reload."""
    gc.collect()
    gc.freeze()


async def _shutdown_delay(daemon: Daemon, stop: asyncio.Event) -> None:
    """/readyz fails at once; new requests are still served for ``shutdownDelay`` so load
    balancers take this member out before it refuses connections. A second signal
    ends the wait."""
    daemon.draining.set()
    delay = daemon.config.timeouts.shutdown_delay
    if delay <= 0:
        return
    log.info("shutting down: /readyz fails; serving for the shutdown delay first",
             extra=kv(seconds=delay))
    stop.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), delay)


def _stop_when_closed(fd: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``fd`` (a pipe whose writer is the supervisor) reaches EOF."""
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(fd, 512)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            log.warning("the supervisor is gone; shutting down")
            stop.set()
    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)
