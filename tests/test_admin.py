"""The admin listener: readiness as a load balancer sees it; which Host it answers;
the listener that serves /metrics alone."""

import asyncio

import aiohttp
import pytest
from daemon_support import PEER_ID, WAIT, cluster, ready
from process_support import start_daemon, wait_ready

from mvproxy.admin import MISDIRECTED, host_allowed, readiness_checks
from mvproxy.cache import DiscoveryCache
from mvproxy.devcluster.launcher import free_port
from mvproxy.discovery import Snapshot


def failed(checks):
    return {name for name, ok, _ in checks if not ok}


def test_ready_once_the_backend_is_synced_whatever_the_peers_do():
    """Documented semantics (docs/operations.md, "Readiness and shutdown"): ready =
    backend synced; peers never make a member unready."""
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


# --------------------------------------------------------------------------- Host check

@pytest.mark.parametrize("host, expected", [
    (None, True), ("", True),
    ("127.0.0.1", True), ("127.0.0.1:9443", True), ("10.0.0.1:9443", True),
    ("[::1]", True), ("[::1]:9443", True), ("[fe80::1%25eth0]:9443", True),
    ("localhost", True), ("localhost:9443", True), ("LocalHost:80", True), ("localhost.", True),
    ("mvproxy.node-a.example", True), ("MVPROXY.node-a.example.:9443", True),
    ("evil.example", False), ("evil.example:9443", False), ("127.0.0.1.evil.example", False),
    ("localhost.evil.example", False), ("node-a.example", False),
    ("::1", False), ("[::1", False), ("[::1]x", False), ("[127.0.0.1]", False),
    ("127.0.0.1:", False), ("127.0.0.1:abc", False), ("127.0.0.1:123456", False),
    ("127.0.0.1:9443:1", False), ("0x7f.1", False), ("127.1", False),
    ("127.0.0.1 ", False), ("user@127.0.0.1", False),
], ids=lambda value: repr(value))
def test_host_allowed(host, expected):
    """IP literals, localhost and configured names, with or without a port; anything
    a rebinding page could carry (its own name) is refused."""
    assert host_allowed(host, frozenset({"mvproxy.node-a.example"})) is expected


async def raw_http(port: int, head: str, host: str = "127.0.0.1") -> tuple[int, str]:
    """One request written as is (``head`` without the blank line); (status, body)."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head.encode() + b"Connection: close\r\n\r\n")
        async with asyncio.timeout(WAIT):
            answer = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head_bytes, _, body = answer.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), body.decode("utf-8", "replace")


ADMIN_PATHS = ("/", "/debug/mvproxy", "/debug/mvproxy/peers",
               "/debug/mvproxy/route?path=/api", "/metrics", "/readyz")


async def test_the_admin_listener_answers_only_for_addresses_and_configured_names(
        aiohttp_server, root):
    """Issue 19: any Host was answered, so a page whose name an attacker's DNS rebinds
    to 127.0.0.1 could read /debug/mvproxy from a browser on the node. Now such a Host
    gets 421; addresses (probes, curl, Prometheus), localhost, configured names and
    HTTP/1.0 without Host are answered as before."""
    async with cluster(aiohttp_server, root,
                       extra={"admin.allowedHosts": ["mvproxy.node-a.example"]}) as c:
        await ready(c)
        port = int(c.admin.rsplit(":", 1)[1])
        for path in ADMIN_PATHS:
            for host in ("evil.example", f"evil.example:{port}", f"localhost.evil.example:{port}"):
                status, body = await raw_http(port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\n")
                assert (status, body) == (421, MISDIRECTED), (path, host)
            for host in (f"127.0.0.1:{port}", f"[::1]:{port}", f"localhost:{port}",
                         "mvproxy.node-a.example"):
                status, _ = await raw_http(port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\n")
                assert status == 200, (path, host)
            status, _ = await raw_http(port, f"GET {path} HTTP/1.0\r\n")
            assert status == 200, path
        status, _ = await raw_http(port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                         "Host: evil.example\r\n")
        assert status in (400, 421)  # aiohttp's parser or the check: never answered
        # A Prometheus scrape by address, as an HTTP client writes it.
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{c.admin}/metrics",
                                   headers={"Accept": "text/plain;version=0.0.4"}) as resp:
                assert resp.status == 200
                assert "mvproxy_peer_up" in await resp.text()
        assert await c.metric("mvproxy_peer_up", peer=PEER_ID) == 1.0


async def test_the_metrics_listener_serves_metrics_and_nothing_else(aiohttp_server, root):
    """``admin.metricsBindAddress`` (the node IP for a ServiceMonitor) serves /metrics
    alone, behind the same Host check; the admin listener stays on 127.0.0.1 and
    nothing of it is reachable on the metrics address."""
    node_ip = "127.0.0.5"  # stands for the node IP, on loopback
    metrics_port = free_port(node_ip)
    async with cluster(aiohttp_server, root, extra={"admin.metricsBindAddress": node_ip,
                                                    "admin.metricsPort": metrics_port}) as c:
        await ready(c)
        status, body = await raw_http(metrics_port, f"GET /metrics HTTP/1.1\r\n"
                                      f"Host: {node_ip}:{metrics_port}\r\n", node_ip)
        assert status == 200 and "mvproxy_peer_up" in body
        for path in ADMIN_PATHS[:-2] + ("/readyz", "/healthz", "/livez", "/metrics/x"):
            status, _ = await raw_http(metrics_port, f"GET {path} HTTP/1.1\r\n"
                                       f"Host: {node_ip}:{metrics_port}\r\n", node_ip)
            assert status == 404, path
        status, body = await raw_http(metrics_port, "GET /metrics HTTP/1.1\r\n"
                                      "Host: evil.example\r\n", node_ip)
        assert (status, body) == (421, MISDIRECTED)
        admin_port = int(c.admin.rsplit(":", 1)[1])
        with pytest.raises(OSError):  # the admin listener is on 127.0.0.1 only
            await raw_http(admin_port, "GET /debug/mvproxy HTTP/1.0\r\n", node_ip)
        status, _ = await c.admin_get("/debug/mvproxy")
        assert status == 200


async def test_the_workers_supervisor_checks_host_and_serves_metrics_alone(backend, root,
                                                                           tmp_path):
    """With ``--workers`` the supervisor serves both listeners (the workers' admin
    sockets, which only it reaches, need no Host check): same rules, summed metrics."""
    node_ip = "127.0.0.5"
    metrics_port = free_port(node_ip)
    proc, _, admin, stop = start_daemon(root, tmp_path, backend, args=(
        "--workers", "2", "--admin-metrics-bind-address", node_ip,
        "--admin-metrics-port", str(metrics_port)))
    try:
        await wait_ready(admin)
        status, body = await raw_http(admin, "GET /debug/mvproxy HTTP/1.1\r\n"
                                             "Host: evil.example\r\n")
        assert (status, body) == (421, MISDIRECTED)
        status, body = await raw_http(admin, "GET /debug/mvproxy/route?path=/api/v1/pods "
                                             f"HTTP/1.1\r\nHost: 127.0.0.1:{admin}\r\n")
        assert status == 200 and '"worker": 0' in body, body
        status, body = await raw_http(metrics_port, "GET /metrics HTTP/1.1\r\n"
                                      f"Host: {node_ip}:{metrics_port}\r\n", node_ip)
        assert status == 200 and "mvproxy_workers 2.0" in body, body[:300]
        status, _ = await raw_http(metrics_port, "GET /debug/mvproxy HTTP/1.1\r\n"
                                   f"Host: {node_ip}\r\n", node_ip)
        assert status == 404
    finally:
        log = stop()
    assert proc.returncode == 0 and "Traceback" not in log, log[-2000:]
