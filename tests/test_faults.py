"""Faults, standing suite: misbehaving peers and dying processes under load.

A. **Discovery faults** (in process, fake upstreams): a peer whose discovery turns to
   garbage, a non-discovery document, 10 MB, a truncated body or a hang is logged,
   counted and ignored while its last good data stays (requests still route to it,
   merged discovery still lists it), and it recovers without a restart; a peer whose
   serving certificate is expired or from a foreign CA is never trusted.
B. **Process faults** (the demo's real processes: three simulated kube-apiservers
   1.35, 1.36, 1.36 and an mvproxy in front of each): while clients create, get and
   list 1.36-only podgroups and watch them through the 1.35 server's mvproxy, peers'
   mvproxies are frozen (SIGSTOP) and killed, a peer's backend is frozen, then killed
   and comes back as another version. Asserted: no request hangs past the timeouts; reads
   succeed whenever a capable peer is reachable; creates either succeed or fail
   honestly (502/503/504), and every acknowledged create exists exactly once
   (a 409 would mean one was applied twice); watches end instead of stalling; all
   recovers without restarting the 1.35 server's mvproxy.

Every process is stopped by the demo's context manager; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import json
import os
import signal
import ssl
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from daemon_support import (
    PEER_ID,
    PODGROUPS,
    WAIT,
    Cluster,
    cluster,
    fake_server,
    synced,
)
from reliability import record

from mvproxy.devcluster.demo import READY_TIMEOUT, start_cluster

SUITE = "Faults"


# --------------------------------------------------------------------------- A. discovery


async def peer_state(c: Cluster) -> dict:
    return (await c.debug())["peers"][PEER_ID]


BROKEN = {"garbage": "invalid_discovery", "not-discovery": "invalid_discovery",
          "huge": "oversized_discovery", "truncated": "broken_response", "slow": "timeout"}
"""Each misbehaviour and the reason mvproxy_discovery_poll_errors_total gives it."""


@pytest.mark.parametrize("mode", list(BROKEN))
async def test_a_peer_with_broken_discovery_keeps_its_last_good_data(aiohttp_server, root, mode):
    async with cluster(aiohttp_server, root, timeout="300ms", staleAfter="1m",
                       forgetAfter="10m", maxDocumentBytes=1048576) as c:
        c.gate.set()
        await c.until(lambda: synced(c), "the first complete sync")
        upstream = "apiserver_peer_discovery_sync_errors_total"
        before = await c.metric(upstream, type="fetch_discovery") or 0
        c.health["mode"] = mode

        async def failed() -> bool:
            # Every broken document is upstream's fetch_discovery; mvproxy says why.
            return (await c.metric(upstream, type="fetch_discovery") or 0) > before and bool(
                await c.metric("mvproxy_discovery_poll_errors_total", server=PEER_ID,
                               reason=BROKEN[mode]))

        await c.until(failed, f"a failed poll of the {mode} peer")
        await asyncio.sleep(1.2)  # long enough that a fresh success stands out
        assert (await peer_state(c))["secondsSinceSuccess"] > 1.0
        status, _, body = await c.get(PODGROUPS)  # still routed by the last good snapshot
        assert status == 200 and json.loads(body)["server"] == "peer"
        status, _, body = await c.get("/apis", headers={
            "Accept": "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"})
        groups = {g["metadata"]["name"] for g in json.loads(body)["items"]}
        assert status == 200 and "scheduling.k8s.io" in groups
        c.health["mode"] = "ok"

        async def recovered() -> bool:
            state = await peer_state(c)
            return state["reachable"] and state["secondsSinceSuccess"] < 1.0

        await c.until(recovered, "the peer's recovery")
        record(SUITE, f"peer discovery: {mode}", 1,
               "logged and counted; last good snapshot kept and used; recovered")


def certificate(root: Path, tmp: Path, *, expired: bool) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1: expired (cluster CA) or from a foreign CA."""
    now = datetime.now(timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    if expired:
        ca_cert = x509.load_pem_x509_certificate((root / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((root / "ca.key").read_bytes(), None)
        issuer, signer, start, end = ca_cert.subject, ca_key, now - timedelta(days=3), \
            now - timedelta(days=1)
    else:
        signer = ec.generate_private_key(ec.SECP256R1())
        issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mvproxy-ca")])
        start, end = now - timedelta(days=1), now + timedelta(days=1)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mvproxy")]))
            .issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(
                ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(signer, hashes.SHA256()))
    crt, k = tmp / "bad.crt", tmp / "bad.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return crt, k


@pytest.mark.parametrize("expired", [True, False], ids=["expired", "foreign CA"])
async def test_a_peer_with_an_untrusted_certificate_is_never_used(aiohttp_server, root,
                                                                  tmp_path, expired):
    crt, key = certificate(root, tmp_path, expired=expired)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    impostor = await aiohttp_server(fake_server("impostor", "1.36"), ssl=ctx)
    from mvproxy.app import build_daemon, running
    from mvproxy.configfile import load_config
    from mvproxy.devcluster.launcher import free_port
    overrides = {
        "serverID": "a", "bindAddress": "127.0.0.1", "securePort": free_port(),
        "tlsCertFile": str(root / "a" / "mvproxy.crt"),
        "tlsPrivateKeyFile": str(root / "a" / "mvproxy.key"),
        "backend.url": f"https://127.0.0.1:{impostor.port}",  # never reached: see below
        "backend.caFile": str(root / "ca.crt"),
        "peer.caFile": str(root / "ca.crt"), "peer.clientCAFile": str(root / "front-proxy-ca.crt"),
        "peer.certFile": str(root / "a" / "front-proxy-client.crt"),
        "peer.keyFile": str(root / "a" / "front-proxy-client.key"),
        "peers.static": [{"serverID": "b", "url": f"https://127.0.0.1:{impostor.port}"}],
        "discovery.pollInterval": "100ms", "admin.bindAddress": "127.0.0.1", "admin.port": 0,
    }
    daemon = build_daemon(load_config(None, overrides=overrides))
    async with running(daemon) as (_, admin_port):
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + WAIT
            errors = 0.0
            state: dict = {}
            while time.monotonic() < deadline and not (errors and state.get("polled")):
                await asyncio.sleep(0.1)
                async with session.get(f"http://127.0.0.1:{admin_port}/debug/mvproxy") as r:
                    state = (await r.json())["peers"]["b"]
                errors = daemon.metrics.registry.get_sample_value(
                    "apiserver_peer_discovery_sync_errors_total",
                    {"type": "fetch_discovery"}) or 0
            assert errors >= 1 and not state["reachable"] and not state["hasSnapshot"]
    record(SUITE, f"peer certificate {'expired' if expired else 'from a foreign CA'}", 1,
           "TLS refused; never polled successfully, never routed to")


# --------------------------------------------------------------------------- B. processes

OLD, NEW1, NEW2 = "apiserver-0", "apiserver-1", "apiserver-2"
POD_GROUPS = "/apis/scheduling.k8s.io/v1alpha2/namespaces/default/podgroups"
CONNECT_TIMEOUT = 5.0  # the demo's mvproxy default
REQUEST_BOUND = CONNECT_TIMEOUT * 2 + 10  # failover + a slow answer; a hang exceeds it


class Load:
    """Clients of the 1.35 server's mvproxy: creates, gets, lists and watches of the
    1.36-only podgroups, and gets of a local configmap, recorded by phase."""

    def __init__(self, base: str, ctx: ssl.SSLContext):
        self.base, self.ctx = base, ctx
        self.phase = "baseline"
        self.results: list[tuple[str, str, int, float]] = []  # phase, op, status, seconds
        """``phase`` is where the request began, or "boundary" if the phase changed
        while it ran (its outcome belongs to neither phase)."""
        self.created: list[str] = []
        self.watch_ends: list[tuple[str, float]] = []
        self.stop = asyncio.Event()
        self.serial = 0
        self.failures: list[tuple[str, str, int, bytes]] = []

    async def _call(self, session, op: str, method: str, path: str, body=None) -> int:
        started = time.monotonic()
        phase = self.phase
        try:
            async with session.request(method, self.base + path, json=body,
                                       timeout=aiohttp.ClientTimeout(total=REQUEST_BOUND + 5)
                                       ) as resp:
                text = await resp.read()
                status = resp.status
                if status >= 500:
                    self.failures.append((phase, op, status, text[:300]))
        except (TimeoutError, aiohttp.ClientError) as exc:
            status = 0  # the connection ended without an answer
            self.failures.append((phase, op, status, repr(exc)[:300].encode()))
        if self.phase != phase:
            phase = "boundary"
        self.results.append((phase, op, status, time.monotonic() - started))
        return status

    async def worker(self, session) -> None:
        while not self.stop.is_set():
            self.serial += 1
            name = f"pg-{self.serial}"
            status = await self._call(session, "create", "POST", POD_GROUPS, {
                "apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
                "metadata": {"name": name}, "spec": {"minMember": 1}})
            if status == 201:
                self.created.append(name)
            await self._call(session, "get", "GET", f"{POD_GROUPS}/{name}")
            await self._call(session, "list", "GET", POD_GROUPS + "?limit=50")
            await self._call(session, "local", "GET", "/api/v1/namespaces/default")
            await asyncio.sleep(0.02)

    async def watcher(self, session) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                async with session.get(self.base + POD_GROUPS + "?watch=true",
                                       timeout=aiohttp.ClientTimeout(total=None,
                                                                     sock_read=None)) as resp:
                    async for _ in resp.content:
                        if self.stop.is_set():
                            return
            except (TimeoutError, aiohttp.ClientError):
                pass
            self.watch_ends.append((self.phase, time.monotonic() - started))
            await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
async def test_peers_and_backends_die_and_return_under_load(tmp_path):
    with start_cluster(tmp_path / "demo", ["1.35", "1.36", "1.36"], base_port=0,
                       poll_interval="500ms") as demo:
        ctx = ssl.create_default_context(cafile=str(demo.ca))
        ctx.load_cert_chain(demo.pki / "admin.crt", demo.pki / "admin.key")
        load = Load(demo.server(OLD).proxy_url, ctx)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=0)) as s:
            tasks = [asyncio.create_task(load.worker(s)) for _ in range(4)]
            tasks += [asyncio.create_task(load.watcher(s)) for _ in range(2)]
            try:
                await phases(demo, load)
            finally:
                load.stop.set()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        check(demo, load, ctx)


async def settle(seconds: float) -> None:
    await asyncio.sleep(seconds)


NO_CAPABLE_PEER = "only capable peer frozen"
"""The one phase where no reachable server serves podgroups: 503 is the right answer."""


async def phases(demo, load: Load) -> None:
    await settle(3)
    # 1. a peer's mvproxy frozen (its kernel still accepts TCP; nothing answers TLS)
    await frozen(demo, load, NEW1, "peer mvproxy frozen", 8)
    await asyncio.to_thread(demo.wait_converged)  # still "frozen" until every poll sees it
    load.phase = "recovery 1"
    await settle(3)
    # 2. a peer's mvproxy killed, then started again
    load.phase = "peer mvproxy killed"
    os.killpg(demo.server(NEW1).proxy.pid, signal.SIGKILL)
    await settle(4)
    demo.server(NEW1).proxy.stop()
    load.phase = "recovery 2"
    await asyncio.to_thread(demo.start_server, NEW1)
    await settle(3)
    # 3. a peer's backend frozen: polls through that peer time out, it is marked
    #    unreachable, requests held there end and move to the other peer
    load.phase = "peer backend frozen"
    backend_pid = demo.server(NEW2).backend.pid
    os.killpg(backend_pid, signal.SIGSTOP)
    try:
        await settle(6)
    finally:
        os.killpg(backend_pid, signal.SIGCONT)
    await asyncio.to_thread(demo.wait_converged)
    load.phase = "recovery 3"
    await settle(3)
    # 4. a peer's backend killed: that mvproxy says "unserved", the other peer serves
    load.phase = "peer backend killed"
    backend = demo.server(NEW2).backend
    os.killpg(backend.pid, signal.SIGKILL)
    await settle(5)
    # ... and it comes back as 1.37, which serves podgroups only as v1alpha3
    load.phase = "peer backend back as 1.37"
    backend.stop()
    backend.argv[backend.argv.index("--kubernetes-version") + 1] = "1.37"
    await asyncio.to_thread(start_backend_again, demo, NEW2)
    await settle(3)
    # 5. now the only capable peer freezes: 503 with Retry-After, promptly
    await frozen(demo, load, NEW1, NO_CAPABLE_PEER, 8)
    await asyncio.to_thread(demo.wait_converged)
    load.phase = "recovery 5"
    await settle(3)


def start_backend_again(demo, sid: str) -> None:
    """A stopped kube-apiserver started again (same port and store), then converged."""
    backend = demo.server(sid).backend
    backend.start()
    backend.wait_ready(READY_TIMEOUT)
    demo.wait_converged()


async def frozen(demo, load: Load, sid: str, phase: str, seconds: float) -> None:
    load.phase = phase
    pid = demo.server(sid).proxy.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        await settle(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def check(demo, load: Load, ctx: ssl.SSLContext) -> None:
    results = load.results
    assert len(results) > 200, f"too little load: {len(results)}"
    slowest = max(seconds for *_, seconds in results)
    assert slowest < REQUEST_BOUND, f"a request took {slowest:.1f}s"
    by_phase: dict[str, Counter] = {}
    for phase, op, status, _ in results:
        by_phase.setdefault(phase, Counter())[(op, status)] += 1
    # reads succeed whenever a capable peer is reachable; otherwise they get 503
    for phase, counts in by_phase.items():
        for (op, status), n in counts.items():
            if op == "local" or (op == "list" and phase not in (NO_CAPABLE_PEER, "boundary")) or (
                    op == "get" and phase.startswith("recovery")):
                assert status == 200, (phase, op, status, n,
                                       [f for f in load.failures if f[0] == phase][:3])
            if op in ("list", "get") and phase in (NO_CAPABLE_PEER, "boundary"):
                # 502/504: the peer froze with the request in flight (it carries
                # Retry-After); 0: it froze mid-answer and the response was cut
                assert status in (200, 404, 502, 503, 504, 0), (phase, op, status, n)
            if op == "create":
                assert status in (201, 502, 503, 504, 0), (phase, op, status, n)
    assert not any(op == "create" and status == 409 for _, op, status, _ in results), \
        "a create was applied twice"
    # every acknowledged create exists exactly once
    conn = http.client.HTTPSConnection("127.0.0.1", demo.server(NEW1).backend_port,
                                       context=ctx, timeout=30)
    conn.request("GET", POD_GROUPS)
    items = json.loads(conn.getresponse().read())["items"]
    conn.close()
    names = Counter(item["metadata"]["name"] for item in items)
    assert all(names[name] == 1 for name in load.created), "an acknowledged create is missing"
    # no watch stalled: each ended or was still delivering when the run stopped
    assert all(seconds < 60 for _, seconds in load.watch_ends)
    for phase, counts in by_phase.items():
        summary = ", ".join(f"{op} {status}: {n}" for (op, status), n in sorted(counts.items()))
        record(SUITE, f"under load: {phase}", sum(counts.values()), summary)
    record(SUITE, "under load: acknowledged creates", len(load.created),
           "each exists exactly once; no 409 (nothing applied twice)")
    record(SUITE, "under load: watches through peers", len(load.watch_ends),
           "ended and re-established, "
           f"longest {max((s for _, s in load.watch_ends), default=0):.1f}s; "
           f"slowest request {slowest:.1f}s (bound {REQUEST_BOUND:.0f}s)")
