"""Out of file descriptors: the accept loop backs off and says so once.

The reliability issue saw, at the fd limit, a traceback per failed accept (58,772
log entries, 25 MB in a minute) and discovery polls failing for want of descriptors,
so peers were marked unreachable. These tests run ``mvproxy run`` as a subprocess
with a small ``RLIMIT_NOFILE`` (a process-wide limit, so never in the test process)
in front of a fake backend in the test process, and open more connections than fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import ssl
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml
from daemon_support import fake_server, root  # noqa: F401 - root: the PKI fixture
from reliability import record

from mvproxy import pki
from mvproxy.devcluster.launcher import free_port

WAIT = 20.0
NOFILE = 200


@pytest.fixture
async def backend(aiohttp_server, root):  # noqa: F811
    server = await aiohttp_server(fake_server("backend", "1.35"), ssl=pki.server_context(
        root / "a" / "apiserver.crt", root / "a" / "apiserver.key", root / "front-proxy-ca.crt"))
    return f"https://127.0.0.1:{server.port}"


def start_daemon(root: Path, tmp: Path, backend: str, **listener: object):  # noqa: F811
    port, admin = free_port(), free_port()
    config = {
        "apiVersion": "mvproxy.io/v1alpha1", "kind": "MvproxyConfiguration",
        "serverID": "a", "bindAddress": "127.0.0.1", "securePort": port,
        "tlsCertFile": str(root / "a" / "mvproxy.crt"),
        "tlsPrivateKeyFile": str(root / "a" / "mvproxy.key"),
        "clientCAFile": str(root / "ca.crt"),
        "backend": {"url": backend, "caFile": str(root / "ca.crt"),
                    "certFile": str(root / "a" / "front-proxy-client.crt"),
                    "keyFile": str(root / "a" / "front-proxy-client.key")},
        "discovery": {"pollInterval": "200ms"},
        "admin": {"bindAddress": "127.0.0.1", "port": admin},
        "listener": {"headerReadTimeout": "30s", "idleTimeout": "30s", **listener},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - closed by the caller's stop()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

    proc = subprocess.Popen([sys.executable, "-m", "mvproxy", "run", "--config",
                             str(tmp / "config.yaml")], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=limit)

    def stop() -> str:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(WAIT)
        log.close()
        return (tmp / "daemon.log").read_text(errors="replace")

    return proc, port, admin, stop


async def wait_ready(admin: int) -> None:
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(WAIT):
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{admin}/readyz") as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.1)


async def readyz(admin: int) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{admin}/readyz?verbose") as resp:
            return resp.status


async def open_many(port: int, ctx: ssl.SSLContext, count: int):
    """Start ``count`` TLS connections; after a moment, (connected, still waiting)."""
    tasks = [asyncio.create_task(asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")) for _ in range(count)]
    await asyncio.wait(tasks, timeout=3)
    return [t for t in tasks if t.done() and not t.exception()], [t for t in tasks if not t.done()]


async def get(port: int, ctx: ssl.SSLContext) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        async with session.get(f"https://127.0.0.1:{port}/api/v1/namespaces",
                               timeout=aiohttp.ClientTimeout(total=WAIT)) as resp:
            return resp.status


async def close_all(tasks) -> None:
    for task in tasks:
        if task.done() and not task.exception():
            task.result()[1].close()
        else:
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_derived_limit_keeps_descriptors_for_polls(backend, root, tmp_path):  # noqa: F811
    proc, port, admin, stop = start_daemon(root, tmp_path, backend)
    ctx = pki.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    try:
        await wait_ready(admin)
        connected, waiting = await open_many(port, ctx, 80)
        derived = (NOFILE - 128) // 2
        assert len(connected) == derived and waiting
        await asyncio.sleep(1)  # several poll rounds while clients hold every slot
        assert await readyz(admin) == 200
        await close_all(connected + waiting)
        assert await get(port, ctx) == 200
    finally:
        log = stop()
    assert log.count("not accepting new connections: out of the connection limit") == 1
    assert "accepting connections again" in log
    assert "Traceback" not in log
    record("Resource limits", f"80 clients against a derived limit of {(NOFILE - 128) // 2} "
                              f"(RLIMIT_NOFILE {NOFILE})", 80,
           "excess clients wait; readyz stays 200 (polls keep their descriptors); one warning")


async def test_running_out_of_descriptors_backs_off_and_recovers(backend, root, tmp_path):  # noqa: F811
    """maxConnections set above what the process can open: accept fails with EMFILE."""
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, maxConnections=1000)
    ctx = pki.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    try:
        await wait_ready(admin)
        connected, waiting = await open_many(port, ctx, 2 * NOFILE)
        assert connected and waiting
        await asyncio.sleep(2)  # the accept loop is retried after its back-off
        assert proc.poll() is None
        await close_all(connected + waiting)
        assert await get(port, ctx) == 200
        await wait_ready(admin)
    finally:
        log = stop()
    assert log.count("not accepting new connections: out of file descriptors") == 1
    assert "Traceback" not in log
    assert len(log.splitlines()) < 40, log[-3000:]
    record("Resource limits", f"{2 * NOFILE} clients with maxConnections above RLIMIT_NOFILE "
                              f"{NOFILE}", 2 * NOFILE,
           "EMFILE: accepting pauses 1 s at a time, one warning, no traceback; recovers")
