"""Every path of ``reload.LIVE`` changes what it names in a running daemon.

A daemon is built in process (``app.build_daemon``, nothing listening: the behaviours
checked here need no socket), reloaded with one path changed, then probed: one probe
per path, each false before the reload, true after. Shutdown probes run the daemon's
own drain and delay against a fake listener, bounded by ``WAIT``: with the running
value (ten minutes) they could not end in time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from mvproxy import reload
from mvproxy.app import Daemon, _drain, _shutdown_delay, build_daemon
from mvproxy.cache import Snapshot
from mvproxy.configfile import load_config
from mvproxy.logs import V

WAIT = 20.0
PEER = "b"

Probe = Callable[[Daemon], Awaitable[bool]]
PROBES: dict[str, tuple[dict, Probe]] = {}


def live(path: str, to: object) -> Callable[[Probe], Probe]:
    """Register the probe of ``path``, whose value in the reloaded file is ``to``."""
    def register(probe: Probe) -> Probe:
        PROBES[path] = ({"peers.static" if path == "peers" else path: to}, probe)
        return probe
    return register


def _config(root, changes: dict):
    peer_files = {"peer.caFile": root / "ca.crt", "peer.clientCAFile": root / "front-proxy-ca.crt",
                  "peer.certFile": root / "a" / "front-proxy-client.crt",
                  "peer.keyFile": root / "a" / "front-proxy-client.key"}
    return load_config(None, overrides={
        "serverID": "a", "tlsCertFile": str(root / "a" / "mvproxy.crt"),
        "tlsPrivateKeyFile": str(root / "a" / "mvproxy.key"),
        "backend.url": "https://127.0.0.1:1", "backend.caFile": str(root / "ca.crt"),
        "backend.certFile": str(root / "a" / "front-proxy-client.crt"),
        "backend.keyFile": str(root / "a" / "front-proxy-client.key"),
        **{key: str(path) for key, path in peer_files.items()},
        "peers.static": [{"serverID": PEER, "url": "https://127.0.0.1:2"}],
        "discovery.pollInterval": "1s", "discovery.timeout": "1s",
        "discovery.staleAfter": "30s", "discovery.forgetAfter": "10m",
        "discovery.maxDocumentBytes": 1 << 20,
        "timeouts.connect": "5s", "timeouts.request": "60s",
        "timeouts.shutdownGracePeriod": "10m", "timeouts.shutdownDelay": "10m",
        "logging.verbosity": 2, **changes})


# --------------------------------------------------------------------------- probes


@live("peers", to=[{"serverID": "c", "url": "https://127.0.0.1:3"}])
async def _forwards_to_the_new_peer(daemon: Daemon) -> bool:
    return set(daemon.proxy.peers()) == {"c"}


@live("discovery.pollInterval", to="7s")
async def _polls_and_asks_to_retry_at_the_new_interval(daemon: Daemon) -> bool:
    return (daemon.poller.settings.interval, daemon.proxy.retry_after) == (7.0, 7)


@live("discovery.timeout", to="3s")
async def _polls_with_the_new_timeout(daemon: Daemon) -> bool:
    return daemon.poller.settings.timeout == 3.0


@live("discovery.maxDocumentBytes", to=4096)
async def _reads_documents_up_to_the_new_limit(daemon: Daemon) -> bool:
    return (daemon.poller.settings.max_bytes,
            daemon.proxy.discovery.live.max_document_bytes) == (4096, 4096)


def _failing_peer(daemon: Daemon, silent_for: float):
    """The peer's state after answering once, then failing ``silent_for`` later."""
    now = [1000.0]
    daemon.cache._clock = lambda: now[0]
    daemon.cache.record_success(PEER, Snapshot())
    now[0] += silent_for
    daemon.cache.record_failure(PEER, "test")
    return daemon.cache.state(PEER)


@live("discovery.staleAfter", to="5s")
async def _a_silent_peer_turns_unreachable_sooner(daemon: Daemon) -> bool:
    return not _failing_peer(daemon, 10.0).reachable


@live("discovery.forgetAfter", to="40s")
async def _a_silent_peer_is_forgotten_sooner(daemon: Daemon) -> bool:
    return _failing_peer(daemon, 60.0).snapshot is None


@live("timeouts.connect", to="2s")
async def _connects_with_the_new_timeout(daemon: Daemon) -> bool:
    return (daemon.transport.connect_timeout, daemon.poll_transport.connect_timeout) == (2, 2)


@live("timeouts.request", to="9s")
async def _requests_and_probes_with_the_new_timeout(daemon: Daemon) -> bool:
    return (daemon.transport.request_timeout, daemon.poll_transport.request_timeout,
            daemon.proxy.discovery.live.probe_timeout) == (9, 9, 9)


class _BusyListener:
    """One request in flight until ``cancel_in_flight`` ends it."""

    def __init__(self) -> None:
        self.busy = 1

    def stop_accepting(self) -> None: ...

    def close_idle(self) -> None: ...

    def in_flight(self) -> int:
        return self.busy

    def cancel_in_flight(self) -> int:
        ended, self.busy = self.busy, 0
        return ended


async def _ends(awaitable: Awaitable[None]) -> bool:
    try:
        await asyncio.wait_for(awaitable, WAIT)
    except TimeoutError:
        return False
    return True


@live("timeouts.shutdownGracePeriod", to="0s")
async def _drain_ends_requests_after_the_new_grace(daemon: Daemon) -> bool:
    listener = _BusyListener()
    return await _ends(_drain(daemon, listener)) and listener.busy == 0  # type: ignore[arg-type]


@live("timeouts.shutdownDelay", to="0s")
async def _shutdown_waits_the_new_delay(daemon: Daemon) -> bool:
    return await _ends(_shutdown_delay(daemon, asyncio.Event()))


@live("logging.verbosity", to=5)
async def _logs_at_the_new_verbosity(daemon: Daemon) -> bool:
    return logging.getLogger("mvproxy").isEnabledFor(V(5))


SLOW = frozenset(("timeouts.shutdownGracePeriod", "timeouts.shutdownDelay"))
"""Probes that would wait ``WAIT`` on the running value: not probed before the reload."""


# --------------------------------------------------------------------------- tests


def test_every_live_path_has_a_probe():
    assert set(PROBES) == reload.LIVE


@pytest.fixture
def verbosity():
    """The log levels a verbosity change sets, restored as they were."""
    names = ("", "aiohttp", "asyncio")
    levels = [logging.getLogger(name).level for name in names]
    yield
    for name, level in zip(names, levels, strict=True):
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize("path", sorted(PROBES))
async def test_a_reload_changes_the_running_behaviour(root, path, verbosity):
    change, probe = PROBES[path]
    daemon = build_daemon(_config(root, {}))
    try:
        if path not in SLOW:
            assert not await probe(daemon), f"{path}: true before the reload"
        assert reload.reload(daemon, lambda: _config(root, change))
        assert await probe(daemon), path
    finally:
        await daemon.transport.close()
        await daemon.poll_transport.close()


async def test_a_refused_file_changes_nothing(root):
    daemon = build_daemon(_config(root, {}))
    try:
        before = daemon.config

        def broken():
            return load_config(None, overrides={"serverID": "NOT A NAME"})

        assert not reload.reload(daemon, broken)
        assert daemon.config is before and set(daemon.proxy.peers()) == {PEER}
    finally:
        await daemon.transport.close()
        await daemon.poll_transport.close()
