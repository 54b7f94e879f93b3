"""``mvproxy run`` as a real subprocess, in front of a fake backend in the test process.

For what only a separate process shows: process-wide limits (RLIMIT_NOFILE), signals,
worker processes. Every process started here is stopped by the ``stop`` it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import yaml
from daemon_support import fake_server

from mvproxy import devpki, tls
from mvproxy.devcluster.launcher import free_port

WAIT = 20.0


@pytest.fixture
async def backend(aiohttp_server, root):
    server = await aiohttp_server(fake_server("backend", "1.35"), ssl=tls.server_context(
        root / "a" / "apiserver.crt", root / "a" / "apiserver.key", root / "front-proxy-ca.crt"))
    return f"https://127.0.0.1:{server.port}"


def daemon_config(root: Path, backend: str, port: int, admin: int, **listener: object) -> dict:
    """A complete configuration for server "a" in front of ``backend``."""
    return {
        **devpki.sidecar_config(root, backend, port, admin),
        "discovery": {"pollInterval": "200ms"},
        "timeouts": {"shutdownGracePeriod": "2s"},
        "listener": {"headerReadTimeout": "30s", "idleTimeout": "30s", **listener},
    }


def start_daemon(root: Path, tmp: Path, backend: str, *, args: tuple[str, ...] = (),
                 nofile: int | None = None, extra: dict | None = None, **listener: object):
    """(process, port, admin port, stop); ``stop()`` ends it (SIGTERM, then SIGKILL)
    and returns its log. ``extra`` replaces top-level keys of ``daemon_config``'s."""
    port, admin = free_port(), free_port()
    config = {**daemon_config(root, backend, port, admin, **listener), **(extra or {})}
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - closed by stop()
    limit: Callable[[], None] | None = None
    if nofile is not None:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen([sys.executable, "-m", "mvproxy", "run", "--config",
                             str(tmp / "config.yaml"), *args], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=limit)

    def stop() -> str:
        stop_process(proc)
        log.close()
        return (tmp / "daemon.log").read_text(errors="replace")

    return proc, port, admin, stop


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``WAIT``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(WAIT)


async def wait_ready(admin: int) -> None:
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(WAIT):
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{admin}/readyz") as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.1)


async def admin_get(admin: int, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{admin}{path}") as resp:
            return resp.status, await resp.text()


async def get(port: int, ctx: ssl.SSLContext) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        async with session.get(f"https://127.0.0.1:{port}/api/v1/namespaces",
                               timeout=aiohttp.ClientTimeout(total=WAIT)) as resp:
            return resp.status


def pid_alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
