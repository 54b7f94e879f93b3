"""Assembly and lifecycle: a completed ``Config`` becomes two running listeners.

``build_daemon`` *completes* the configuration (SSL contexts, upstreams, cache,
poller, handlers); ``serve`` runs the main listener, the admin listener and the
poller until SIGTERM/SIGINT, then drains in-flight requests for at most
``timeouts.shutdownGracePeriod`` and returns. Nothing here re-reads YAML.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import signal
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from mvproxy import pki
from mvproxy.admin import build_admin_app
from mvproxy.cache import DiscoveryCache
from mvproxy.config import Config
from mvproxy.discoveryhandler import DiscoveryHandler
from mvproxy.errors import UsageError
from mvproxy.handlers import Proxy
from mvproxy.identity import IdentityResolver
from mvproxy.logs import kv
from mvproxy.membership import Membership, Peer, StaticMembership
from mvproxy.metrics import Metrics
from mvproxy.polling import Poller, PollSettings
from mvproxy.transport import Transport, Upstream

log = logging.getLogger(__name__)


@dataclass
class Daemon:
    """The completed parts of one mvproxy; built once, then only run."""

    config: Config
    listener_ssl: ssl.SSLContext
    metrics: Metrics
    cache: DiscoveryCache
    transport: Transport
    poll_transport: Transport
    """Discovery polls get their own pools: a flood of watches must not starve them."""
    poller: Poller
    proxy: Proxy
    draining: asyncio.Event
    """Set on SIGTERM: /readyz fails so load balancers stop sending new requests."""


def _listener_context(cfg: Config) -> ssl.SSLContext:
    """Serving context; client certificates optional, verified by the client CA or the
    peer client CA if sent (``identity`` then tells which one issued it)."""
    ctx = pki.server_context(cfg.tls_cert_file, cfg.tls_private_key_file, cfg.client_ca_file)
    if cfg.peer.client_ca_file and cfg.peer.client_ca_file != cfg.client_ca_file:
        ctx.load_verify_locations(cafile=cfg.peer.client_ca_file)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def _peer_upstreams(membership: Membership, peer_ssl: ssl.SSLContext | None):
    """A function giving the current peers as Upstreams, rebuilt only when they change."""
    cached: dict[tuple[Peer, ...], Mapping[str, Upstream]] = {}

    def current() -> Mapping[str, Upstream]:
        peers = membership.peers()
        if peers not in cached:
            cached.clear()
            cached[peers] = {p.server_id: Upstream(p.server_id, p.url.rstrip("/"), peer_ssl,
                                                   is_peer=True) for p in peers}
        return cached[peers]
    return current


def build_daemon(cfg: Config, *, rng: random.Random | None = None) -> Daemon:
    if cfg.peer.insecure_shared_ca:
        log.warning("peer.insecureSharedCA is set: a user certificate with an allowed peer "
                    "name can act as a peer and claim any user")
    metrics = Metrics()
    transport = Transport(connect_timeout=cfg.timeouts.connect,
                          request_timeout=cfg.timeouts.request)
    backend_url = cfg.backend.url.rstrip("/")
    backend = Upstream("backend", backend_url, pki.client_context(
        cfg.backend.ca_file, cfg.backend.cert_file, cfg.backend.key_file),
        anonymous=Upstream("backend", backend_url, pki.client_context(cfg.backend.ca_file),
                           presents_certificate=False))
    membership = StaticMembership(Peer(p.server_id, p.url) for p in cfg.peers)
    peer_ssl = (pki.client_context(cfg.peer.ca_file, cfg.peer.cert_file, cfg.peer.key_file)
                if cfg.peers else None)
    peers = _peer_upstreams(membership, peer_ssl)
    cache = DiscoveryCache(cfg.server_id, peers(), stale_after=cfg.discovery.stale_after,
                           forget_after=cfg.discovery.forget_after)
    metrics.watch_peers(lambda: _peer_states(cache))
    metrics.watch_certificates(_certificates(cfg))
    poll_transport = Transport(connect_timeout=cfg.timeouts.connect,
                               request_timeout=cfg.timeouts.request)
    poller = Poller(cache=cache, transport=poll_transport, backend=backend, peers=peers,
                    settings=PollSettings(cfg.discovery.poll_interval, cfg.discovery.timeout,
                                          cfg.discovery.max_document_bytes),
                    metrics=metrics)
    retry_after = max(1, math.ceil(cfg.discovery.poll_interval))
    discovery = DiscoveryHandler(cache=cache, transport=transport, backend=backend,
                                 metrics=metrics, probe_timeout=cfg.timeouts.request,
                                 max_bytes=cfg.discovery.max_document_bytes,
                                 retry_after=retry_after)
    identity = IdentityResolver(client_ca_file=cfg.client_ca_file,
                                peer_client_ca_file=cfg.peer.client_ca_file,
                                peer_allowed_names=cfg.peer.allowed_names)
    proxy = Proxy(server_id=cfg.server_id, cache=cache, transport=transport, backend=backend,
                  peers=peers, identity=identity, metrics=metrics, discovery=discovery,
                  rng=rng or random.Random(), retry_after=retry_after)
    return Daemon(cfg, _listener_context(cfg), metrics, cache, transport, poll_transport,
                  poller, proxy, asyncio.Event())


def _certificates(cfg: Config) -> dict[str, str]:
    """Role -> certificate file mvproxy presents, for the expiry metric."""
    roles = {"serving": cfg.tls_cert_file, "backend-client": cfg.backend.cert_file,
             "peer-client": cfg.peer.cert_file}
    return {role: path for role, path in roles.items() if path}


def _peer_states(cache: DiscoveryCache):
    now = time.monotonic()
    for peer_id in cache.peer_ids():
        state = cache.state(peer_id)
        age = now - state.last_success if state and state.last_success is not None else None
        yield peer_id, bool(state and state.reachable), age


def build_proxy_app(daemon: Daemon) -> web.Application:
    # Request bodies are streamed, never read whole, so aiohttp's body cap does not apply;
    # 0 disables it (kube-apiserver enforces its own limits).
    app = web.Application(client_max_size=0, middlewares=[daemon.proxy.checked])
    app.router.add_route("*", "/{tail:.*}", daemon.proxy.handle)
    app.on_response_prepare.append(_no_server_banner)
    return app


async def _no_server_banner(request: web.Request, response: web.StreamResponse) -> None:
    """kube-apiserver sends no Server header; mvproxy does not advertise its stack either."""
    response.headers.popall("Server", None)


@contextlib.asynccontextmanager
async def running(daemon: Daemon):
    """Listeners and the poller up; yields (proxy port, admin port); stops everything."""
    cfg = daemon.config
    poller = asyncio.create_task(daemon.poller.run(), name="mvproxy-poller")
    # handler_cancellation: a downstream that goes away cancels its handler, which
    # closes the upstream request; otherwise a watch whose client left stays open
    # upstream (and on every peer hop) until the next event arrives to fail the write.
    # The drain below does the graceful waiting; aiohttp's own shutdown only has to
    # close what is left (its timeout applies twice, and 0 would mean "forever").
    main = web.AppRunner(build_proxy_app(daemon), access_log=None,
                         shutdown_timeout=_AIOHTTP_SHUTDOWN, handle_signals=False,
                         handler_cancellation=True)
    admin = web.AppRunner(build_admin_app(daemon.cache, daemon.metrics, daemon.draining),
                          access_log=None, handle_signals=False,
                          shutdown_timeout=_AIOHTTP_SHUTDOWN)
    try:
        ports = (await _start(main, cfg.bind_address, cfg.secure_port, daemon.listener_ssl),
                 await _start(admin, cfg.admin.bind_address, cfg.admin.port, None))
        log.info("serving", extra=kv(server_id=cfg.server_id, port=ports[0], admin_port=ports[1],
                                     peers=len(cfg.peers)))
        yield ports
    finally:
        await _drain(daemon, main)
        await main.cleanup()
        await admin.cleanup()
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        await daemon.transport.close()
        await daemon.poll_transport.close()


_AIOHTTP_SHUTDOWN = 0.5
_DRAIN_CHECK = 0.05


async def _drain(daemon: Daemon, main: web.AppRunner) -> None:
    """Stop accepting, let in-flight requests finish within the grace period, then end
    the rest (watches, exec sessions), so SIGTERM exits within shutdownGracePeriod."""
    grace = daemon.config.timeouts.shutdown_grace_period
    daemon.draining.set()
    for site in list(main.sites):
        await site.stop()
    log.info("shutting down; draining in-flight requests",
             extra=kv(in_flight=daemon.proxy.in_flight(), grace_seconds=grace))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while daemon.proxy.in_flight() and loop.time() < deadline:
        await asyncio.sleep(min(_DRAIN_CHECK, max(0.0, deadline - loop.time())))
    cancelled = daemon.proxy.cancel_in_flight()
    if cancelled:
        log.info("grace period over; ended the requests still open",
                 extra=kv(ended=cancelled))


async def _start(runner: web.AppRunner, host: str, port: int,
                 ssl_context: ssl.SSLContext | None) -> int:
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return runner.addresses[-1][1]


async def serve(daemon: Daemon) -> None:
    """Run until SIGTERM or SIGINT, then drain and return (exit status 0)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with running(daemon):
        await stop.wait()
