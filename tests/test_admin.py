"""Readiness as a load balancer sees it."""

import asyncio

from mvproxy.admin import readiness_checks
from mvproxy.cache import DiscoveryCache
from mvproxy.discovery import Snapshot


def failed(checks):
    return {name for name, ok, _ in checks if not ok}


def test_ready_once_the_backend_is_synced_whatever_the_peers_do():
    """Documented semantics (README, Operations): ready = backend synced; peers never
    make a member unready."""
    cache = DiscoveryCache("a", ["b"], stale_after=10, forget_after=100)
    draining = asyncio.Event()
    assert failed(readiness_checks(cache, draining)) == {"backend-synced"}
    cache.record_failure("a")  # polled, unsuccessfully: nothing held yet
    assert failed(readiness_checks(cache, draining)) == {"backend-synced", "backend-reachable"}
    cache.record_success("a", Snapshot())
    assert failed(readiness_checks(cache, draining)) == set()  # peer b never polled
    cache.record_failure("b")
    assert failed(readiness_checks(cache, draining)) == set()


def test_not_ready_while_the_backend_fails_or_while_shutting_down():
    clock = [0.0]
    cache = DiscoveryCache("a", [], stale_after=10, forget_after=100, clock=lambda: clock[0])
    draining = asyncio.Event()
    cache.record_success("a", Snapshot())
    clock[0] = 11
    cache.record_failure("a")
    assert failed(readiness_checks(cache, draining)) == {"backend-reachable"}
    cache.record_success("a", None)
    draining.set()
    assert failed(readiness_checks(cache, draining)) == {"shutdown"}
