"""Poller against fake backend and peer servers over real mTLS on 127.0.0.1.

Each fake serves the real 1.35 or 1.36 aggregated ``/api`` and ``/apis`` with ETags
and can be switched to misbehave (garbage, wrong kind, 500, oversized, hang). Most
tests call ``poll_once`` directly with an injected clock; the ``run()`` tests use a
20 ms interval and wait on conditions, never on fixed sleeps. The only wall-clock
wait that must expire is one 0.2 s poll timeout.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from mvproxy import devpki, discovery, tls
from mvproxy.cache import DiscoveryCache
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.discoverydocs import aggregated
from mvproxy.metrics import Metrics
from mvproxy.polling import (
    POLL_IDENTITY,
    REASONS,
    Poller,
    PollSettings,
    _ServerPoll,
    failure_reason,
    sync_error_types,
)
from mvproxy.transport import Transport, Upstream

SELF, PEER_B, PEER_C = "apiserver-a", "apiserver-b", "apiserver-c"
NEW_GV = ("scheduling.k8s.io", "v1alpha2")  # 1.36 only
OLD_GV = ("scheduling.k8s.io", "v1alpha1")  # 1.35 only
STALE_AFTER, FORGET_AFTER = 15.0, 600.0
TIMEOUT = 0.2
SYNC_ERRORS = "apiserver_peer_discovery_sync_errors_total"
POLL_ERRORS = "mvproxy_discovery_poll_errors_total"
UPSTREAM_TYPES = ("lease_list", "hostport_resolution", "fetch_discovery")


# --------------------------------------------------------------------------- documents

def catalog_documents(version: str, *, without: tuple[str, str] | None = None) -> dict[str, bytes]:
    catalog = load_catalog(version)
    core, groups = aggregated(catalog, core=True), copy.deepcopy(aggregated(catalog, core=False))
    if without is not None:
        for group in groups["items"]:
            if group["metadata"]["name"] == without[0]:
                group["versions"] = [v for v in group["versions"] if v["version"] != without[1]]
    return {"/api": json.dumps(core).encode(), "/apis": json.dumps(groups).encode()}


@pytest.fixture(scope="module")
def docs135() -> dict[str, bytes]:
    return catalog_documents("1.35")


@pytest.fixture(scope="module")
def docs136() -> dict[str, bytes]:
    return catalog_documents("1.36")


# --------------------------------------------------------------------------- fake servers

class FakeServer:
    """A kube-apiserver's discovery endpoints, switchable to every kind of failure."""

    def __init__(self, docs: dict[str, bytes], *, etag_header: str = "ETag"):
        self.docs = dict(docs)
        self.mode = "ok"
        self.etag_header = etag_header
        self.requests: list[dict] = []
        self.statuses: list[int] = []
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api", self.handle)
        app.router.add_get("/apis", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        cert = request.transport.get_extra_info("peercert") or {}
        subject = dict(x[0] for x in cert.get("subject", ()))
        self.requests.append({"path": request.path, "headers": dict(request.headers),
                              "cn": subject.get("commonName")})
        response = await self._answer(request)
        self.statuses.append(response.status)
        return response

    async def _answer(self, request: web.Request) -> web.Response:
        body = self.docs[request.path]
        if self.mode == "hang":
            self.arrived.set()
            await asyncio.wait_for(self.release.wait(), 5)
        elif self.mode == "500":
            return web.Response(status=500, text="internal error")
        elif self.mode == "garbage":
            body = b'{"kind": "APIGroupDiscoveryList", "items": [' + b"\x00garbage"
        elif self.mode == "wrong_kind":
            body = json.dumps({"kind": "APIGroupList", "apiVersion": "v1", "groups": []}).encode()
        elif self.mode == "wrong_document":
            body = self.docs["/apis" if request.path == "/api" else "/api"]
        tag = discovery.etag(body)
        headers = {self.etag_header: tag}
        if request.headers.get("If-None-Match") == tag:
            return web.Response(status=304, headers=headers)
        return web.Response(body=body, headers={**headers, "Content-Type": discovery.AGGREGATED_V2})

    def seen(self, header: str) -> list[str | None]:
        return [r["headers"].get(header) for r in self.requests]


# --------------------------------------------------------------------------- PKI

@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    good = tmp_path_factory.mktemp("pki") / "pki"
    rogue = tmp_path_factory.mktemp("rogue") / "pki"
    devpki.init_pki(good, [SELF, PEER_B, PEER_C], days=2)
    devpki.init_pki(rogue, [PEER_B], days=2)
    return good, rogue


@pytest.fixture(scope="module")
def peer_client_ctx(certs):
    good, _ = certs
    return tls.client_context(good / "ca.crt", good / SELF / "front-proxy-client.crt",
                              good / SELF / "front-proxy-client.key")


@pytest.fixture
def start(aiohttp_server, certs):
    """``await start(fake, server_id, rogue_cert=False)``: serve ``fake`` over mTLS."""
    good, rogue = certs

    async def go(fake: FakeServer, server_id: str, *, rogue_cert: bool = False) -> FakeServer:
        root = rogue if rogue_cert else good
        ctx = tls.server_context(root / server_id / "mvproxy.crt", root / server_id / "mvproxy.key",
                                 good / "front-proxy-ca.crt", require_client_cert=True)
        server = await aiohttp_server(fake.app(), ssl=ctx)
        fake.url = f"https://127.0.0.1:{server.port}"
        return fake

    return go


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A poller wired to fakes, with handles on its cache, metrics and per-server state."""

    def __init__(self, ctx, backend: FakeServer, peers: dict[str, FakeServer], *,
                 interval: float = 30.0, max_bytes: int = 1 << 20):
        self.clock = Clock()
        self.cache = DiscoveryCache(SELF, peers, stale_after=STALE_AFTER,
                                    forget_after=FORGET_AFTER, clock=self.clock)
        self.transport = Transport(connect_timeout=2.0, request_timeout=2.0)
        self.registry = CollectorRegistry()
        self.upstreams = {pid: Upstream(pid, fake.url, ctx, is_peer=True)
                          for pid, fake in peers.items()}
        self.backend_upstream = Upstream("backend", backend.url, ctx)
        self.poller = Poller(
            cache=self.cache, transport=self.transport, backend=self.backend_upstream,
            peers=lambda: dict(self.upstreams),
            settings=PollSettings(interval=interval, timeout=TIMEOUT, max_bytes=max_bytes,
                                  jitter=0.0),
            metrics=Metrics(self.registry))
        self.states = {pid: _ServerPoll(up) for pid, up in self.upstreams.items()}
        self.states[SELF] = _ServerPoll(self.backend_upstream)

    async def poll(self, server_id: str) -> None:
        await self.poller.poll_once(server_id, self.states[server_id])

    def errors(self, kind: str) -> float:
        """Upstream's counter, by its ``type``."""
        return self.registry.get_sample_value(SYNC_ERRORS, {"type": kind}) or 0.0

    def total_errors(self) -> float:
        return sum(self.errors(k) for k in UPSTREAM_TYPES)

    def reasons(self, server: str = PEER_B) -> dict[str, float]:
        """mvproxy's counter for ``server``: the reasons seen, with their counts."""
        return {reason: value for reason in REASONS
                if (value := self.registry.get_sample_value(
                    POLL_ERRORS, {"server": server, "reason": reason}))}

    def merged_gvs(self) -> dict[tuple[str, str], str]:
        merged = self.cache.view().merged()
        return {(discovery.group_name(g), v["version"]): v.get("freshness", "")
                for g in (*merged.core, *merged.groups) for v in g.get("versions") or ()}


@pytest.fixture
async def harness(start, peer_client_ctx, docs135, docs136):
    """``await harness(peers={...}, backend_docs=...)`` -> Harness; closed at teardown."""
    made: list[Harness] = []

    async def make(peers: dict[str, FakeServer] | None = None, *, backend: FakeServer | None = None,
                   **kwargs) -> Harness:
        backend = await start(backend or FakeServer(docs135), SELF)
        if peers is None:
            peers = {PEER_B: FakeServer(docs136)}
        for pid, fake in peers.items():
            if not fake.url:
                await start(fake, pid)
        made.append(Harness(peer_client_ctx, backend, peers, **kwargs))
        made[-1].backend = backend
        made[-1].fakes = peers
        return made[-1]

    yield make
    for h in made:
        for fake in (h.backend, *h.fakes.values()):
            fake.release.set()
        await h.poller._stop_all()
        await h.transport.close()


def messages(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if r.name == "mvproxy.polling" and r.getMessage() == text)


FAILED = "discovery poll failed"
RECOVERED = "discovery poll recovered"
UNREACHABLE = "server became unreachable; its versions are now served as Stale"


async def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Let the event loop run until ``condition`` holds (bounded: about 2 s at most)."""
    for _ in range(400):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


# --------------------------------------------------------------------------- ETags and headers

@pytest.mark.parametrize("etag_header", ["ETag", "Etag"])  # Go canonicalises to "Etag"
async def test_second_poll_sends_if_none_match_and_a_304_changes_nothing(
        harness, docs136, etag_header):
    peer = FakeServer(docs136, etag_header=etag_header)
    h = await harness({PEER_B: peer})
    await h.poll(PEER_B)
    assert peer.statuses == [200, 200]
    state = h.cache.state(PEER_B)
    first_snapshot, generation = state.snapshot, h.cache.generation
    assert state.reachable and first_snapshot.serves_group_version(*NEW_GV)
    assert peer.seen("If-None-Match") == [None, None]
    view = h.cache.view()
    doc, _ = view.document(("merged",), lambda: b"rendered once")

    h.clock.now += 5
    await h.poll(PEER_B)
    assert peer.statuses[2:] == [304, 304]
    sent = {r["path"]: r["headers"].get("If-None-Match") for r in peer.requests[2:]}
    assert sent == {p: discovery.etag(docs136[p]) for p in ("/api", "/apis")}
    assert h.cache.generation == generation
    assert h.cache.state(PEER_B).snapshot is first_snapshot
    assert h.cache.state(PEER_B).last_success == 1005.0
    assert h.cache.view().document(("merged",), lambda: b"again") == (doc, True)
    assert h.total_errors() == 0


async def test_peer_requests_carry_peer_headers_and_client_certificate(harness):
    h = await harness()
    await h.poll(PEER_B)
    await h.poll(SELF)
    for fake in (h.fakes[PEER_B], h.backend):
        assert sorted(r["path"] for r in fake.requests) == ["/api", "/apis"]
        for request in fake.requests:
            headers = request["headers"]
            assert headers["Accept"] == discovery.PEER_ACCEPT
            assert "profile=nopeer" in headers["Accept"]
            assert request["cn"] == devpki.FRONT_PROXY_CLIENT_CN
            for name, value in POLL_IDENTITY.items():
                assert headers[name] == value
    for request in h.fakes[PEER_B].requests:
        assert request["headers"]["x-kubernetes-peer-proxied"] == "true"


async def test_one_document_changed_rebuilds_the_snapshot(harness, docs136):
    h = await harness()
    await h.poll(PEER_B)
    generation = h.cache.generation
    h.fakes[PEER_B].docs["/apis"] = catalog_documents("1.36", without=NEW_GV)["/apis"]
    await h.poll(PEER_B)
    assert h.fakes[PEER_B].statuses[2:] in ([304, 200], [200, 304])
    assert h.cache.generation == generation + 1
    snapshot = h.cache.state(PEER_B).snapshot
    assert not snapshot.serves_group_version(*NEW_GV)
    assert snapshot.serves("", "v1", "pods", "exec")  # /api kept from the earlier poll


# --------------------------------------------------------------------------- failures

@pytest.mark.parametrize("mode", ["garbage", "wrong_kind", "wrong_document"])
async def test_malformed_documents_keep_the_last_good_snapshot(harness, caplog, mode):
    caplog.set_level(logging.INFO, logger="mvproxy.polling")
    h = await harness()
    await h.poll(PEER_B)
    good = h.cache.state(PEER_B).snapshot
    generation = h.cache.generation
    h.fakes[PEER_B].mode = mode
    for _ in range(3):
        h.clock.now += 1
        await h.poll(PEER_B)
    # Both documents are broken: two failed fetches per poll, every poll counted.
    assert h.errors("fetch_discovery") == 6 and h.total_errors() == 6
    assert h.reasons() == {"invalid_discovery": 6}
    assert messages(caplog, FAILED) == 1
    state = h.cache.state(PEER_B)
    assert state.snapshot is good and state.reachable
    assert h.cache.generation == generation


async def test_oversized_documents_are_refused(harness, docs136):
    limit = len(docs136["/apis"]) - 1
    h = await harness(max_bytes=limit)
    assert len(docs136["/api"]) < limit
    await h.poll(PEER_B)
    await h.poll(PEER_B)
    assert h.errors("fetch_discovery") == 2 and h.total_errors() == 2  # /apis, twice
    assert h.reasons() == {"oversized_discovery": 2}
    state = h.cache.state(PEER_B)
    assert state.polled and not state.reachable and state.snapshot is None


async def test_http_500_is_a_fetch_failure_per_path(harness):
    """As upstream's TestPeerDiscoveryMetrics ("fetch discovery error": 2): each failed
    /api or /apis fetch counts (staging/src/k8s.io/apiserver/pkg/util/peerproxy/
    peer_discovery_test.go; types from peerproxy/metrics/metrics.go)."""
    h = await harness()
    h.fakes[PEER_B].mode = "500"
    await h.poll(PEER_B)
    assert h.errors("fetch_discovery") == 2 and h.total_errors() == 2
    assert h.reasons() == {"http_status": 2}
    assert h.fakes[PEER_B].statuses == [500, 500]


async def test_peer_certificate_from_another_ca_fails_verification(harness, start, docs136):
    rogue = await start(FakeServer(docs136), PEER_B, rogue_cert=True)
    h = await harness({PEER_B: rogue})
    await h.poll(PEER_B)
    await h.poll(SELF)
    assert rogue.requests == []  # the handshake failed before any request
    assert h.errors("fetch_discovery") == 2 and h.reasons() == {"connect": 2}
    state = h.cache.state(PEER_B)
    assert state.polled and not state.reachable and state.snapshot is None
    assert h.cache.view().synced  # polled once, unsuccessfully, still counts


def test_failure_reasons_are_bounded():
    from mvproxy.discovery import DiscoveryFormatError
    from mvproxy.errors import (
        UpstreamConnectError,
        UpstreamProtocolError,
        UpstreamTimeout,
        UpstreamUnresolved,
    )
    from mvproxy.polling import UnexpectedStatus
    from mvproxy.transport import BodyTooLarge

    assert failure_reason(DiscoveryFormatError("x")) == "invalid_discovery"
    assert failure_reason(UpstreamTimeout("p", "x")) == "timeout"
    assert failure_reason(BodyTooLarge("p", "x")) == "oversized_discovery"
    assert failure_reason(UnexpectedStatus("p", "HTTP 500")) == "http_status"
    # Only the size check decides "oversized", not words in an upstream's message.
    assert failure_reason(UpstreamProtocolError("p", "rate limit")) == "broken_response"
    assert failure_reason(UpstreamConnectError("p", "x")) == "connect"
    assert failure_reason(UpstreamUnresolved("p", "x")) == "name_resolution"
    assert failure_reason(RuntimeError("bug")) == "internal"


def test_upstream_types_resolve_once_then_count_each_fetch():
    """Upstream resolves a peer's host:port once per sync (``hostport_resolution``),
    then counts each failed path fetch (``fetch_discovery``): peerproxy/peer_discovery.go,
    types from staging/src/k8s.io/apiserver/pkg/util/peerproxy/metrics/metrics.go."""
    assert sync_error_types(["name_resolution", "name_resolution"]) == ["hostport_resolution"]
    assert sync_error_types(["timeout", "http_status"]) == ["fetch_discovery"] * 2
    assert sync_error_types(["invalid_discovery"]) == ["fetch_discovery"]


async def test_unexpected_errors_do_not_escape_a_poll(harness, monkeypatch):
    h = await harness()

    class Broken:
        """A transport whose every fetch fails with a bug (the compiled ``Transport``'s
        methods cannot be replaced on an instance)."""

        request_timeout = h.transport.request_timeout

        async def fetch(self, *args, **kwargs):
            raise RuntimeError("bug")

    monkeypatch.setattr(h.poller, "transport", Broken())
    await h.poll(PEER_B)  # must not raise
    assert h.errors("fetch_discovery") == 2 and h.reasons() == {"internal": 2}
    assert h.cache.state(PEER_B).polled


async def test_slow_peer_times_out_without_delaying_a_fast_one(harness, docs135, docs136):
    slow, fast = FakeServer(docs136), FakeServer(docs135)
    slow.mode = "hang"
    h = await harness({PEER_B: slow, PEER_C: fast})
    slow_poll = asyncio.create_task(h.poll(PEER_B))
    await slow.arrived.wait()  # the slow peer holds a request open
    await h.poll(PEER_C)
    assert not slow_poll.done()  # the fast peer finished first
    assert h.cache.state(PEER_C).reachable
    await slow_poll  # ends by its own 0.2 s timeout (the handler waits for release)
    assert h.errors("fetch_discovery") == 2 and h.total_errors() == 2
    assert h.reasons() == {"timeout": 2}
    assert h.cache.state(PEER_B).polled and not h.cache.state(PEER_B).reachable


# --------------------------------------------------------------------------- state changes

async def test_flapping_peer_is_counted_every_time_and_logged_once_per_change(harness, caplog):
    """Counters count every failed fetch, so rate() is honest (upstream counts each
    one: staging/src/k8s.io/apiserver/pkg/util/peerproxy/metrics/metrics.go); the log
    says it once per change of state."""
    caplog.set_level(logging.INFO, logger="mvproxy.polling")
    h = await harness()
    peer = h.fakes[PEER_B]
    await h.poll(PEER_B)
    for _ in range(3):
        peer.mode = "500"
        await h.poll(PEER_B)
        await h.poll(PEER_B)  # the same failure again: counted, not logged
        peer.mode = "ok"
        await h.poll(PEER_B)
        await h.poll(PEER_B)
    assert h.errors("fetch_discovery") == 12 and h.total_errors() == 12  # 3 x 2 polls x 2
    assert h.reasons() == {"http_status": 12}
    assert messages(caplog, FAILED) == 3
    assert messages(caplog, RECOVERED) == 3
    # A different kind of failure is a change of state too.
    peer.mode = "500"
    await h.poll(PEER_B)
    peer.mode = "garbage"
    await h.poll(PEER_B)
    assert h.errors("fetch_discovery") == 16
    assert h.reasons() == {"http_status": 14, "invalid_discovery": 2}
    assert messages(caplog, FAILED) == 5


async def test_backend_failures_count_only_in_the_mvproxy_counter(harness):
    """Upstream's sync errors are about peers (it never polls itself:
    staging/src/k8s.io/apiserver/pkg/util/peerproxy/metrics/metrics.go); the
    backend's failed polls are mvproxy's own counter, under its server ID."""
    h = await harness()
    h.backend.mode = "500"
    await h.poll(SELF)
    assert h.total_errors() == 0
    assert h.reasons(SELF) == {"http_status": 2}


async def test_a_peer_whose_name_does_not_resolve_is_one_hostport_resolution_per_poll(
        harness, peer_client_ctx, monkeypatch):
    """Upstream: a peer without a usable host:port is ``hostport_resolution``, counted
    once per sync before any fetch (peerproxy/peer_discovery.go; type values in
    staging/src/k8s.io/apiserver/pkg/util/peerproxy/metrics/metrics.go). The name
    lookup is faked: tests reach nothing but loopback."""
    h = await harness()
    loop = asyncio.get_running_loop()

    async def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(loop, "getaddrinfo", no_such_host)
    upstream = Upstream(PEER_B, "https://apiserver-b.invalid:6443", peer_client_ctx,
                        is_peer=True)
    h.states[PEER_B] = _ServerPoll(upstream)
    for _ in range(2):
        await h.poll(PEER_B)
    assert h.errors("hostport_resolution") == 2 and h.total_errors() == 2
    assert h.reasons() == {"name_resolution": 4}


async def test_stale_marking_and_recovery(harness, caplog):
    caplog.set_level(logging.INFO, logger="mvproxy.polling")
    h = await harness()
    await h.poll(SELF)
    await h.poll(PEER_B)
    assert h.merged_gvs()[NEW_GV] == discovery.CURRENT
    h.fakes[PEER_B].mode = "500"
    h.clock.now += STALE_AFTER - 1
    await h.poll(PEER_B)
    assert h.cache.view().reachable == {PEER_B}
    h.clock.now += 1
    await h.poll(PEER_B)
    h.clock.now += 1
    await h.poll(PEER_B)
    assert h.cache.view().reachable == frozenset()
    assert messages(caplog, UNREACHABLE) == 1
    gvs = h.merged_gvs()
    assert gvs[NEW_GV] == discovery.STALE and gvs[OLD_GV] == discovery.CURRENT
    assert gvs[("apps", "v1")] == discovery.CURRENT

    h.fakes[PEER_B].mode = "ok"
    await h.poll(PEER_B)
    assert h.cache.view().reachable == {PEER_B}
    assert h.merged_gvs()[NEW_GV] == discovery.CURRENT
    assert messages(caplog, RECOVERED) == 1


async def test_forgotten_peer_gets_its_snapshot_back_on_a_304(harness):
    h = await harness()
    peer = h.fakes[PEER_B]
    await h.poll(SELF)
    await h.poll(PEER_B)
    peer.mode = "500"
    h.clock.now += FORGET_AFTER
    await h.poll(PEER_B)
    assert h.cache.state(PEER_B).snapshot is None
    assert NEW_GV not in h.merged_gvs()
    assert h.cache.view().capable_group_version_peers(*NEW_GV) == ()

    peer.mode = "ok"
    await h.poll(PEER_B)
    assert peer.statuses[-2:] == [304, 304]  # unchanged documents ...
    view = h.cache.view()
    assert view.peers[PEER_B].snapshot is not None  # ... but the snapshot is back
    assert view.capable_group_version_peers(*NEW_GV) == (PEER_B,)
    assert h.merged_gvs()[NEW_GV] == discovery.CURRENT


async def test_group_version_deleted_everywhere_disappears_after_one_poll_each(
        harness, docs135):
    h = await harness({PEER_B: FakeServer(docs135)})
    await h.poll(SELF)
    await h.poll(PEER_B)
    assert OLD_GV in h.merged_gvs()
    gone = catalog_documents("1.35", without=OLD_GV)
    h.backend.docs.update(gone)
    h.fakes[PEER_B].docs.update(gone)
    await h.poll(PEER_B)
    assert OLD_GV in h.merged_gvs()  # the backend still lists it
    await h.poll(SELF)
    assert OLD_GV not in h.merged_gvs()


async def test_readiness_waits_for_backend_and_every_peer(harness, docs135):
    broken = FakeServer(docs135)
    broken.mode = "500"
    h = await harness({PEER_B: FakeServer(docs135), PEER_C: broken})
    await h.poll(SELF)
    await h.poll(PEER_B)
    assert not h.cache.view().synced
    await h.poll(PEER_C)
    assert h.cache.view().synced


# --------------------------------------------------------------------------- run()

def poll_tasks() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("mvproxy-poll-")}


async def test_membership_removal_cancels_the_task_and_forgets_the_peer(harness, docs135,
                                                                       caplog):
    caplog.set_level(logging.INFO, logger="mvproxy.polling")
    h = await harness({PEER_B: FakeServer(docs135), PEER_C: FakeServer(docs135)})
    h.poller._start(SELF, _ServerPoll(h.backend_upstream))
    h.poller._reconcile()
    await wait_until(lambda: h.cache.view().synced, "the first polls")
    assert poll_tasks() == {f"mvproxy-poll-{s}" for s in (SELF, PEER_B, PEER_C)}

    del h.upstreams[PEER_C]
    h.poller._reconcile()
    assert h.cache.state(PEER_C) is None and h.cache.peer_ids() == (PEER_B,)
    await wait_until(lambda: "mvproxy-poll-apiserver-c" not in poll_tasks(), "cancellation")
    assert poll_tasks() == {f"mvproxy-poll-{s}" for s in (SELF, PEER_B)}
    assert messages(caplog, "peer removed from membership") == 1

    del h.upstreams[PEER_B]  # the last peer leaves: the merged view is the backend's alone
    before = h.cache.generation
    h.poller._reconcile()
    assert h.cache.generation == before + 1 and h.cache.view().peers == {}
    await h.poller._stop_all()
    assert poll_tasks() == set()


async def test_run_polls_follows_membership_and_cancels_cleanly(harness, docs135, docs136):
    h = await harness({PEER_B: FakeServer(docs136)}, interval=0.02)
    runner = asyncio.create_task(h.poller.run())
    await wait_until(lambda: h.cache.view().synced, "the first polls")
    await wait_until(lambda: len(h.fakes[PEER_B].requests) >= 4, "a second round")
    assert 304 in h.fakes[PEER_B].statuses

    h.upstreams[PEER_C] = Upstream(PEER_C, h.fakes[PEER_B].url,
                                   h.upstreams[PEER_B].ssl_context, is_peer=True)
    await wait_until(lambda: h.cache.view().synced and PEER_C in h.cache.view().reachable,
                     "the new peer")
    del h.upstreams[PEER_B]
    await wait_until(lambda: "mvproxy-poll-apiserver-b" not in poll_tasks(), "removal")
    assert h.cache.state(PEER_B) is None

    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    assert poll_tasks() == set()
    assert h.poller._tasks == {}
    others = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    assert all(not t.get_name().startswith("mvproxy") for t in others)


async def test_run_survives_a_broken_membership_source(harness, caplog):
    h = await harness(interval=0.02)
    calls = []

    def peers():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("membership broke")
        return dict(h.upstreams)

    h.poller._peers = peers
    runner = asyncio.create_task(h.poller.run())
    try:
        await wait_until(lambda: h.cache.view().synced, "polls after the failure")
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
    assert len(calls) >= 2
    assert poll_tasks() == set()


async def test_a_membership_change_is_reconciled_at_once_not_after_the_interval(harness, docs136):
    h = await harness({PEER_B: FakeServer(docs136)})  # a 30 s interval: the wake must do it
    h.poller._wake = wake = asyncio.Event()
    runner = asyncio.create_task(h.poller.run())
    try:
        await wait_until(lambda: h.cache.view().synced, "the first polls")
        h.upstreams[PEER_C] = Upstream(PEER_C, h.fakes[PEER_B].url,
                                       h.upstreams[PEER_B].ssl_context, is_peer=True)
        wake.set()  # what a Lease or DNS source does when its peers change
        await wait_until(lambda: PEER_C in h.cache.view().reachable, "the joining peer polled")
        del h.upstreams[PEER_B]
        wake.set()
        await wait_until(lambda: h.cache.state(PEER_B) is None, "the leaving peer dropped")
        assert PEER_B not in h.cache.view().peers
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner


async def test_a_first_poll_that_fails_is_retried_soon_not_after_an_interval(harness):
    """A peer that starts a moment after us (or answers 500 while it warms up) is seen
    within a second, although the poll interval here is an hour: never-fetched servers
    are retried after FIRST_RETRY, doubling, capped at the interval."""
    h = await harness(interval=3600.0)
    fake = h.fakes[PEER_B]
    fake.mode = "500"
    runner = asyncio.create_task(h.poller.run())
    try:
        await wait_until(lambda: len(fake.requests) >= 4, "a second poll of the failing peer")
        assert PEER_B not in h.cache.view().reachable
        fake.mode = "ok"
        await wait_until(lambda: PEER_B in h.cache.view().reachable, "the peer, once it answers")
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
