"""Out of file descriptors: the accept loop backs off and says so once.

The reliability issue saw, at the fd limit, a traceback per failed accept (58,772
log entries, 25 MB in a minute) and discovery polls failing for want of descriptors,
so peers were marked unreachable. These tests run ``mvproxy run`` as a subprocess
with a small ``RLIMIT_NOFILE`` (a process-wide limit, so never in the test process)
in front of a fake backend in the test process, and open more connections than fit.
"""

from __future__ import annotations

import asyncio
import ssl

from process_support import admin_get, get, start_daemon, wait_ready
from reliability import record

from mvproxy import tls

NOFILE = 200


async def open_many(port: int, ctx: ssl.SSLContext, count: int):
    """Start ``count`` TLS connections; after a moment, (connected, still waiting)."""
    tasks = [asyncio.create_task(asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")) for _ in range(count)]
    await asyncio.wait(tasks, timeout=3)
    return [t for t in tasks if t.done() and not t.exception()], [t for t in tasks if not t.done()]


async def close_all(tasks) -> None:
    for task in tasks:
        if task.done() and not task.exception():
            task.result()[1].close()
        else:
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_derived_limit_keeps_descriptors_for_polls(backend, root, tmp_path):
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, nofile=NOFILE)
    ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    try:
        await wait_ready(admin)
        connected, waiting = await open_many(port, ctx, 80)
        derived = (NOFILE - 128) // 2
        assert len(connected) == derived and waiting
        await asyncio.sleep(1)  # several poll rounds while clients hold every slot
        assert (await admin_get(admin, "/readyz?verbose"))[0] == 200
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


async def test_running_out_of_descriptors_backs_off_and_recovers(backend, root, tmp_path):
    """maxConnections set above what the process can open: accept fails with EMFILE."""
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, nofile=NOFILE,
                                           maxConnections=1000)
    ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
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
