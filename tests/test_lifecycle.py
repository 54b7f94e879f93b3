"""Signals on a real ``mvproxy run`` process: SIGHUP reloads what can change live,
SIGTERM fails /readyz first and keeps serving for ``shutdownDelay``.

The daemon runs in front of a fake backend on 127.0.0.1 (``process_support``); waits
are bounded polls, never timing assertions.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import yaml
from process_support import WAIT, admin_get, get, start_daemon, wait_ready

from mvproxy import tls
from mvproxy.configfile import load_config
from mvproxy.devcluster.launcher import free_port
from mvproxy.reload import changed_paths, merge


def _peer_tls(root: Path) -> dict:
    return {"caFile": str(root / "ca.crt"), "clientCAFile": str(root / "front-proxy-ca.crt"),
            "certFile": str(root / "a" / "front-proxy-client.crt"),
            "keyFile": str(root / "a" / "front-proxy-client.key")}


def _static(server_id: str) -> dict:
    return {"static": [{"serverID": server_id, "url": f"https://127.0.0.1:{free_port()}"}]}


async def _until(probe, what: str):
    async with asyncio.timeout(WAIT):
        while True:
            found = await probe()
            if found:
                return found
            await asyncio.sleep(0.05)
    raise AssertionError(what)  # pragma: no cover - asyncio.timeout raises first


def _log(tmp: Path) -> str:
    return (tmp / "daemon.log").read_text(errors="replace")


# --------------------------------------------------------------------------- merge rules


def test_a_reload_applies_live_keys_and_keeps_the_rest(root):
    base = {"serverID": "a", "tlsCertFile": str(root / "a" / "mvproxy.crt"),
            "tlsPrivateKeyFile": str(root / "a" / "mvproxy.key"),
            "backend": {"url": "https://127.0.0.1:6444"}, "peer": _peer_tls(root),
            "peers": _static("b")}
    old = load_config(None, overrides=_flat(base))
    changed = {**base, "securePort": 7443, "peers": _static("c"),
               "discovery": {"pollInterval": "1s"}, "logging": {"verbosity": 4,
                                                                "format": "json"}}
    new = load_config(None, overrides=_flat(changed))
    # timeout and staleAfter follow pollInterval when not set (config derives them)
    live = {"peers", "discovery.pollInterval", "discovery.timeout", "discovery.staleAfter",
            "logging.verbosity"}
    assert set(changed_paths(old, new)) == live | {"securePort", "logging.format"}
    running, applied, kept = merge(old, new)
    assert set(applied) == live
    assert set(kept) == {"securePort", "logging.format"}
    assert running.secure_port == old.secure_port and running.logging.format == "text"
    assert [p.server_id for p in running.peers] == ["c"]
    assert running.discovery.poll_interval == 1.0 and running.logging.verbosity == 4


def _flat(doc: dict, prefix: str = "") -> dict:
    """A document as the dotted overrides ``load_config`` takes."""
    out: dict = {}
    for key, value in doc.items():
        if isinstance(value, dict) and key != "peers":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}.static" if key == "peers" else f"{prefix}{key}"] = (
                value["static"] if key == "peers" else value)
    return out


# --------------------------------------------------------------------------- processes


async def test_sighup_reloads_peers_and_reports_what_needs_a_restart(root, tmp_path,
                                                                     backend):
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, extra={
        "peer": _peer_tls(root), "peers": _static("b")})
    ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    try:
        await wait_ready(admin)
        config_file = tmp_path / "config.yaml"
        doc = yaml.safe_load(config_file.read_text())

        async def peers() -> set[str]:
            return set(json.loads((await admin_get(admin, "/debug/mvproxy"))[1])["peers"])

        assert await peers() == {"b"}
        doc.update(peers=_static("c"), securePort=free_port(),
                   logging={"verbosity": 3})
        config_file.write_text(yaml.safe_dump(doc))
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: _is(peers(), {"c"}), "the reloaded peer list")
        await _until(lambda: _contains(tmp_path, "reload applied"), "the reload's log line")
        assert "need a restart" in _log(tmp_path) and "securePort" in _log(tmp_path)
        assert await get(port, ctx) == 200  # still on the port it started with

        config_file.write_text("kind: MvproxyConfiguration\nserverID: NOT A NAME\n")
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: _contains(tmp_path, "reload refused"), "the refusal")
        assert await peers() == {"c"} and await get(port, ctx) == 200
        assert proc.poll() is None
    finally:
        log = stop()
    assert proc.returncode == 0, log


async def test_sighup_moves_retry_after_with_the_poll_interval(root, tmp_path):
    """A 503 asks clients to wait about one discovery poll: after a SIGHUP that changes
    ``discovery.pollInterval`` every 503 says the new wait, from the request path and
    from discovery alike (the backend here is a port nothing listens on)."""
    dead = f"https://127.0.0.1:{free_port()}"
    proc, port, admin, stop = start_daemon(root, tmp_path, dead)
    ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    try:
        await _until(lambda: _retry_after(port, ctx, "/api/v1/namespaces"),
                     "a 503 while the backend is down")
        assert await _retry_after(port, ctx, "/api/v1/namespaces") == (503, "1")
        config_file = tmp_path / "config.yaml"
        doc = yaml.safe_load(config_file.read_text())
        doc["discovery"] = {"pollInterval": "7s"}
        config_file.write_text(yaml.safe_dump(doc))
        proc.send_signal(signal.SIGHUP)
        await _until(lambda: _contains(tmp_path, "reload applied"), "the reload's log line")
        for path in ("/api/v1/namespaces", "/apis"):
            assert await _retry_after(port, ctx, path) == (503, "7"), path
    finally:
        log = stop()
    assert proc.returncode == 0, log


async def _retry_after(port: int, ctx, path: str) -> tuple[int, str | None] | None:
    """(status, Retry-After) of a GET; None while the daemon does not answer yet."""
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
            async with session.get(f"https://127.0.0.1:{port}{path}",
                                   timeout=aiohttp.ClientTimeout(total=WAIT)) as resp:
                return resp.status, resp.headers.get("Retry-After")
    except aiohttp.ClientConnectionError:
        return None


async def _is(awaitable, expected) -> bool:
    return await awaitable == expected


async def _contains(tmp: Path, text: str) -> bool:
    return text in _log(tmp)


async def test_sigterm_fails_readyz_then_serves_for_the_shutdown_delay(root, tmp_path,
                                                                       backend):
    """A long delay, ended by a second signal: nothing here depends on how long it is."""
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, extra={
        "timeouts": {"shutdownGracePeriod": "2s", "shutdownDelay": "10m"}})
    ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    try:
        await wait_ready(admin)
        proc.send_signal(signal.SIGTERM)

        async def unready() -> bool:
            status, text = await admin_get(admin, "/readyz?verbose")
            return status == 503 and "[-]shutdown failed" in text

        await _until(unready, "/readyz failing after SIGTERM")
        assert await get(port, ctx) == 200  # new requests are still served
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # a second signal ends the delay
        await _until(lambda: _exited(proc), "exit after the second SIGTERM")
    finally:
        log = stop()
    assert proc.returncode == 0, log


async def _exited(proc) -> bool:
    return proc.poll() is not None
