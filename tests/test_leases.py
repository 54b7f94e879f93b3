"""Lease membership: parsing and validation of Leases, then the source itself against a
simulated kube-apiserver (``mvproxy sim``, real TLS on 127.0.0.1, front-proxy client
certificate as in production)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import urllib.request
from collections.abc import Iterator

import pytest

from mvproxy import leasemembership
from mvproxy.devcluster.launcher import SimProcess, free_port
from mvproxy.devpki import init_pki
from mvproxy.kubeclient import KubeClient
from mvproxy.leasemembership import LeaseMembership
from mvproxy.leases import (
    IDENTITY_LABEL,
    IDENTITY_SELECTOR,
    PEER_ADDRESS_ANNOTATION,
    URL_ANNOTATION,
    LeaseRejected,
    format_time,
    own_lease,
    parse_lease,
    parse_time,
)
from mvproxy.logs import _KV_ATTR
from mvproxy.membership import CombinedMembership, Peer, StaticMembership
from mvproxy.metrics import Metrics
from mvproxy.tls import client_context

NOW = 1_800_000_000.0
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases"
WAIT = 15.0


def mvproxy_lease(server_id="apiserver-b", url="https://10.0.0.2:6443", *, name=None,
                  renew=NOW, duration=30, annotations=None) -> dict:
    lease = own_lease(server_id, "kube-system", url, duration, renew)
    lease["metadata"]["name"] = name or lease["metadata"]["name"]
    if annotations is not None:
        lease["metadata"]["annotations"] = annotations
    return lease


def identity_lease(name="apiserver-7f3a", address="10.0.0.9:6443", renew=NOW,
                   duration=3600) -> dict:
    meta = {"name": name, "namespace": "kube-system",
            "labels": {IDENTITY_LABEL: "kube-apiserver"}, "annotations": {}}
    if address is not None:
        meta["annotations"][PEER_ADDRESS_ANNOTATION] = address
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": f"{name}_0b1c", "leaseDurationSeconds": duration,
                     "renewTime": format_time(renew)}}


# --------------------------------------------------------------------------- parsing


def test_an_mvproxy_lease_names_its_holder_and_url():
    peer = parse_lease(mvproxy_lease())
    assert (peer.server_id, peer.url, peer.expires) == ("apiserver-b", "https://10.0.0.2:6443",
                                                         NOW + 30)


def test_an_identity_lease_is_named_by_its_name_and_address():
    peer = parse_lease(identity_lease())
    assert (peer.server_id, peer.url, peer.expires) == ("apiserver-7f3a", "https://10.0.0.9:6443",
                                                         NOW + 3600)
    assert parse_lease(identity_lease(address="[fd00::9]:6443")).url == "https://[fd00::9]:6443"


def test_a_renewal_claimed_in_the_future_counts_from_when_it_was_seen():
    """One create with renewTime 9999-12-31 must not make a permanent peer."""
    forever = _with(mvproxy_lease(), "spec.renewTime", "9999-12-31T23:59:59.000000Z")
    assert parse_lease(forever, observed=NOW).expires == NOW + 30
    # A renewal already in the past when seen counts from its renewTime, as before.
    assert parse_lease(mvproxy_lease(renew=NOW - 20), observed=NOW).expires == NOW + 10


def test_times_round_trip_with_microseconds():
    assert parse_time(format_time(NOW + 0.25)) == NOW + 0.25
    assert parse_time("2026-12-01T10:00:00Z") == parse_time("2026-12-01T10:00:00.000000Z")


def _with(lease: dict, path: str, value) -> dict:
    *parents, leaf = path.split(".")
    node = lease
    for part in parents:
        node = node[part]
    node[leaf] = value
    return lease


BAD = [
    ("plain http", mvproxy_lease(url="http://10.0.0.2:6443"), "bad_url"),
    ("a path", mvproxy_lease(url="https://10.0.0.2:6443/evil"), "bad_url"),
    ("credentials", mvproxy_lease(url="https://u:p@10.0.0.2:6443"), "bad_url"),
    ("a query", mvproxy_lease(url="https://10.0.0.2:6443?x=1"), "bad_url"),
    ("a bad port", mvproxy_lease(url="https://10.0.0.2:99999"), "bad_url"),
    ("cloud metadata", mvproxy_lease(url="https://169.254.169.254"), "forbidden_address"),
    ("unspecified", mvproxy_lease(url="https://0.0.0.0:6443"), "forbidden_address"),
    ("multicast", mvproxy_lease(url="https://[ff02::1]:6443"), "forbidden_address"),
    ("a huge annotation", mvproxy_lease(url="https://" + "a" * 300_000 + ".example"),
     "bad_url"),
    ("no annotation", mvproxy_lease(annotations={}), "bad_url"),
    ("holder not the name", mvproxy_lease(name="mvproxy-apiserver-c"), "name_mismatch"),
    ("holder not a DNS name", _with(mvproxy_lease(), "spec.holderIdentity", "Evil_ID"),
     "bad_server_id"),
    ("no duration", _with(mvproxy_lease(), "spec.leaseDurationSeconds", None), "bad_duration"),
    ("a year long", _with(mvproxy_lease(), "spec.leaseDurationSeconds", 365 * 86400),
     "bad_duration"),
    ("duration true", _with(mvproxy_lease(), "spec.leaseDurationSeconds", True), "bad_duration"),
    ("bad time", _with(mvproxy_lease(), "spec.renewTime", "yesterday"), "bad_time"),
    ("month 13", _with(mvproxy_lease(), "spec.renewTime", "2026-13-01T00:00:00Z"), "bad_time"),
    ("spec a list", _with(mvproxy_lease(), "spec", []), "malformed"),
    ("labels a list", _with(mvproxy_lease(), "metadata.labels", ["x"]), "malformed"),
    ("unlabelled", _with(mvproxy_lease(), "metadata.labels", {}), "not_membership"),
    ("identity without address", identity_lease(address=None), "no_address"),
    ("identity address with a path", identity_lease(address="10.0.0.9:6443/x"), "bad_url"),
    ("identity address with creds", identity_lease(address="u@10.0.0.9:6443"), "bad_url"),
    ("identity named badly", identity_lease(name="Not..DNS"), "bad_server_id"),
    ("identity at link-local", identity_lease(address="[fe80::1]:6443"), "forbidden_address"),
]


@pytest.mark.parametrize("lease, reason", [(lease, reason) for _, lease, reason in BAD],
                         ids=[name for name, _, _ in BAD])
def test_a_bad_lease_is_rejected_with_a_reason(lease, reason):
    with pytest.raises(LeaseRejected) as caught:
        parse_lease(lease)
    assert caught.value.reason == reason
    assert len(str(caught.value)) < 400  # hostile input is never echoed whole


def test_combined_membership_never_names_this_server():
    static = StaticMembership([Peer("apiserver-b", "https://10.0.0.2:6443")])
    dynamic = StaticMembership([Peer("apiserver-a", "https://10.0.0.9:6443"),   # our ID
                                Peer("apiserver-x", "https://10.0.0.1:6443"),   # our URL
                                Peer("apiserver-y", "https://10.0.0.1:8443"),   # our backend
                                Peer("apiserver-b", "https://10.6.6.6:6443"),   # static wins
                                Peer("apiserver-z", "https://10.0.0.2:6443/"),  # known URL
                                Peer("apiserver-c", "https://10.0.0.3:6443")])
    combined = CombinedMembership(static, [dynamic], own_id="apiserver-a",
                                  own_urls=["https://10.0.0.1:6443/", "https://10.0.0.1:8443"])
    assert combined.peers() == (Peer("apiserver-b", "https://10.0.0.2:6443"),
                                Peer("apiserver-c", "https://10.0.0.3:6443"))
    # Dynamic sources may share a URL: the serving certificate decides per connection
    # which ID is true there, so a Lease cannot push a real peer out by claiming its URL.
    first = StaticMembership([Peer("aaa", "https://10.0.0.7:6443")])
    second = StaticMembership([Peer("node-b", "https://10.0.0.7:6443")])
    assert [p.server_id for p in CombinedMembership(
        StaticMembership([]), [first, second], own_id="apiserver-a").peers()] == ["aaa", "node-b"]
    # A static peer is the operator's word, even at a URL of ours (tests do that).
    operator = StaticMembership([Peer("apiserver-b", "https://10.0.0.1:8443")])
    assert CombinedMembership(operator, [], own_id="apiserver-a",
                              own_urls=["https://10.0.0.1:8443"]).peers() == operator.peers()


# --------------------------------------------------------------------------- against a sim


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    root = tmp_path_factory.mktemp("leases")
    init_pki(root / "pki", ["apiserver-a"])
    process = SimProcess(kubernetes_version="1.36", server_id="apiserver-a",
                         pki_dir=root / "pki", port=free_port(), store=root / "store.db",
                         log_dir=root / "logs")
    try:
        process.start().wait_ready(30.0)
        yield process
    finally:
        process.stop()


def _front_proxy(sim: SimProcess) -> ssl.SSLContext:
    pki = sim.pki_dir
    return client_context(pki / "ca.crt", pki / "apiserver-a/front-proxy-client.crt",
                          pki / "apiserver-a/front-proxy-client.key")


def admin(sim: SimProcess, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """A request as the cluster admin (client certificate), for arranging state."""
    pki = sim.pki_dir
    ctx = client_context(pki / "ca.crt", pki / "admin.crt", pki / "admin.key")
    request = urllib.request.Request(sim.url + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=ctx, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@pytest.fixture
def clean(sim):
    """Every test starts with no Leases."""
    status, listed = admin(sim, "GET", LEASES)
    for item in listed.get("items", []):
        admin(sim, "DELETE", f"{LEASES}/{item['metadata']['name']}")
    yield


def member(sim, server_id: str, port: int, *, namespace="kube-system", metrics=None,
           renew=0.3, duration=3.0, clock=time.time) -> LeaseMembership:
    client = KubeClient(sim.url, _front_proxy(sim), server_id, timeout=5.0)
    return LeaseMembership(client=client, server_id=server_id, namespace=namespace,
                           url=f"https://127.0.0.1:{port}", duration=duration,
                           renew_period=renew, identity_leases=True, metrics=metrics,
                           clock=clock)


def watcher(sim, url: str, *, duration: float = 30.0, renew_period: float = 10.0
            ) -> LeaseMembership:
    """A member that only follows Leases at ``url`` (a hostile or scripted backend)."""
    client = KubeClient(url, _front_proxy(sim), "apiserver-a", timeout=10.0)
    m = LeaseMembership(client=client, server_id="apiserver-a", namespace="kube-system",
                        url="https://127.0.0.1:7001", duration=duration,
                        renew_period=renew_period, identity_leases=False)
    m.hold = False
    return m


@contextlib.asynccontextmanager
async def running(*members: LeaseMembership):
    tasks = [asyncio.create_task(m.run()) for m in members]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for m in members:
            await m.client.close()


async def until(probe, what: str, timeout: float = WAIT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_members_find_each_other_and_a_release_is_seen_at_once(sim, clean):
    a, b = member(sim, "apiserver-a", 7001), member(sim, "apiserver-b", 7002)
    b_task = asyncio.create_task(b.run())
    try:
        async with running(a):
            await until(lambda: a.peers() == (Peer("apiserver-b", "https://127.0.0.1:7002"),),
                        "a to see b")
            await until(lambda: b.peers() == (Peer("apiserver-a", "https://127.0.0.1:7001"),),
                        "b to see a")
            status, lease = admin(sim, "GET", f"{LEASES}/mvproxy-apiserver-b")
            assert status == 200
            assert lease["metadata"]["labels"] == {"app.kubernetes.io/name": "mvproxy"}
            assert lease["metadata"]["annotations"] == {URL_ANNOTATION: "https://127.0.0.1:7002"}
            assert lease["spec"]["holderIdentity"] == "apiserver-b"
            renewed = lease["spec"]["renewTime"]
            await until(lambda: admin(sim, "GET", f"{LEASES}/mvproxy-apiserver-b")[1]["spec"]
                        ["renewTime"] != renewed, "a renewal")
            b_task.cancel()  # graceful shutdown: stop renewing, then delete
            await asyncio.gather(b_task, return_exceptions=True)
            assert await b.release()
            assert admin(sim, "GET", f"{LEASES}/mvproxy-apiserver-b")[0] == 404
            # b's Lease is valid for 3 s more: only the watched deletion drops it sooner
            await until(lambda: a.peers() == (), "a to drop b", timeout=2.0)
    finally:
        b_task.cancel()
        await asyncio.gather(b_task, return_exceptions=True)
        await b.client.close()


async def test_a_killed_members_lease_expires_without_a_deletion(sim, clean):
    offset = [0.0]
    a = member(sim, "apiserver-a", 7001, clock=lambda: time.time() + offset[0])
    b = member(sim, "apiserver-b", 7002, duration=30.0)
    b_task = asyncio.create_task(b.run())
    try:
        async with running(a):
            await until(lambda: a.peers(), "a to see b")
            await asyncio.wait_for(b.synced.wait(), WAIT)
            b_task.cancel()  # "killed": no release, the Lease stays
            await asyncio.gather(b_task, return_exceptions=True)
            assert admin(sim, "GET", f"{LEASES}/mvproxy-apiserver-b")[0] == 200
            assert a.peers() != ()
            offset[0] = 31.0  # the Lease's 30 s have passed for a
            assert a.peers() == ()
    finally:
        b_task.cancel()
        await asyncio.gather(b_task, return_exceptions=True)
        await b.client.close()


async def test_a_lease_renewed_in_the_far_future_still_expires(sim, clean):
    """A Lease created once with renewTime 9999-12-31 lasts one leaseDuration from when
    this mvproxy saw it, and a re-list (same renewTime seen again) does not extend it."""
    forever = mvproxy_lease("forever", "https://127.0.0.1:7009", duration=30)
    forever["spec"]["renewTime"] = "9999-12-31T23:59:59.000000Z"
    forever["metadata"].pop("resourceVersion", None)
    assert admin(sim, "POST", LEASES, forever)[0] == 201
    offset = [0.0]
    a = member(sim, "apiserver-a", 7001, clock=lambda: time.time() + offset[0])
    async with running(a):
        await until(lambda: a.peers(), "a to see the Lease")
        offset[0] = 31.0
        assert a.peers() == ()
        await a._list("app.kubernetes.io/name=mvproxy")  # seen again: still the old sighting
        assert a.peers() == ()


async def test_hostile_leases_are_logged_once_counted_and_ignored(sim, clean, caplog):
    metrics = Metrics()
    bad = [mvproxy_lease("evil-1", "http://127.0.0.1:7009", renew=time.time()),
           mvproxy_lease("evil-2", "https://169.254.169.254", renew=time.time()),
           mvproxy_lease("evil-3", name="mvproxy-apiserver-c", renew=time.time()),
           identity_lease("apiserver-old", address=None, renew=time.time())]
    for lease in bad:
        lease["metadata"].pop("resourceVersion", None)
        assert admin(sim, "POST", LEASES, lease)[0] == 201
    good = identity_lease("apiserver-builtin", address="127.0.0.1:7010", renew=time.time())
    assert admin(sim, "POST", LEASES, good)[0] == 201
    a = member(sim, "apiserver-a", 7001, metrics=metrics)
    caplog.set_level(logging.INFO, logger="mvproxy.leasemembership")
    async with running(a):
        await until(lambda: a.peers() == (Peer("apiserver-builtin", "https://127.0.0.1:7010"),),
                    "the built-in server's identity Lease as the only peer")
        # the same hostile Lease modified again: counted again, not logged again
        evil = admin(sim, "GET", f"{LEASES}/mvproxy-evil-1")[1]
        evil["spec"]["renewTime"] = format_time(time.time())
        assert admin(sim, "PUT", f"{LEASES}/mvproxy-evil-1", evil)[0] == 200
        await until(lambda: _sample(metrics, "bad_url") >= 2, "the second rejection")
    assert _sample(metrics, "forbidden_address") == 1
    assert _sample(metrics, "name_mismatch") == 1
    assert _sample(metrics, "no_address") == 1
    warnings = [r for r in caplog.records if r.getMessage().startswith("ignoring a Lease")]
    assert sorted(getattr(r, _KV_ATTR)["lease"] for r in warnings) == ["apiserver-old",
                                                                       "mvproxy-apiserver-c",
                                                 "mvproxy-evil-1", "mvproxy-evil-2"]
    assert "169.254" not in " ".join(r.getMessage() for r in warnings)  # message is fixed


async def test_thousands_of_leases_stay_bounded(sim, clean, monkeypatch):
    monkeypatch.setattr(leasemembership, "MAX_LEASES", 20)
    monkeypatch.setattr(leasemembership, "MAX_PEERS", 5)
    for i in range(30):
        lease = mvproxy_lease(f"flood-{i:02}", f"https://127.0.0.{i + 2}:6443", renew=time.time(),
                              duration=600)
        lease["metadata"].pop("resourceVersion", None)
        assert admin(sim, "POST", LEASES, lease)[0] == 201
    metrics = Metrics()
    a = member(sim, "apiserver-a", 7001, metrics=metrics)
    async with running(a):
        await until(lambda: len(a.peers()) == 5, "five peers")
        assert [p.server_id for p in a.peers()] == [f"flood-{i:02}" for i in range(5)]
        assert len(a._leases["app.kubernetes.io/name=mvproxy"]) <= 20
        await until(lambda: _sample(metrics, "too_many") >= 10, "the excess counted")


async def test_rbac_refusal_is_counted_and_retried_with_backoff(sim, clean, caplog):
    metrics = Metrics()
    a = member(sim, "apiserver-a", 7001, namespace="default", metrics=metrics)
    caplog.set_level(logging.WARNING, logger="mvproxy.leasemembership")
    async with running(a):
        await until(lambda: metrics.membership_errors.labels("leases",
                                                             "http_403")._value.get() >= 4,
                    "repeated refusals")
    assert a.peers() == ()
    assert metrics.discovery_sync_errors.labels("lease_list")._value.get() >= 1  # upstream's
    refusals = [r for r in caplog.records if "RBAC" in r.getMessage()]
    assert 1 <= len(refusals) <= 3  # renew and two lists: each logged once, not per retry
    assert admin(sim, "GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases")[1][
        "items"] == []


def _sample(metrics: Metrics, reason: str) -> float:
    return metrics.membership_rejected.labels("leases", reason)._value.get()


# --------------------------------------------------------------------------- a hostile backend


@contextlib.asynccontextmanager
async def tls_app(sim: SimProcess, routes):
    """An aiohttp app on 127.0.0.1 serving the sim's certificate (real TLS)."""
    from aiohttp import web

    from mvproxy.tls import server_context

    app = web.Application()
    for path, handler in routes.items():
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    pki = sim.pki_dir / "apiserver-a"
    site = web.TCPSite(runner, "127.0.0.1", 0,
                       ssl_context=server_context(pki / "apiserver.crt", pki / "apiserver.key"))
    await site.start()
    try:
        yield f"https://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_oversized_answers_are_errors_not_buffers(sim):
    from aiohttp import web

    async def huge_list(request):
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(40):  # 10 MiB, no Content-Length: the reader must stop on its own
            await response.write(b" " * (256 << 10))
        return response

    async def endless_line(request):
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(8):
            await response.write(b"x" * (256 << 10))  # 2 MiB and no newline
        return response

    async with tls_app(sim, {"/list": huge_list, "/watch": endless_line}) as url:
        client = KubeClient(url, _front_proxy(sim), "apiserver-a", timeout=10.0)
        try:
            with pytest.raises(leasemembership.KubeError) as caught:
                await client.request("GET", "/list")
            assert caught.value.reason == "too_large"
            with pytest.raises(leasemembership.KubeError) as caught:
                async for _ in client.watch("/watch", {}, 10.0):
                    pass
            assert caught.value.reason == "too_large"
        finally:
            await client.close()


async def test_a_410_gone_watch_lists_again(sim):
    from aiohttp import web

    lists = []

    async def leases(request):
        if request.query.get("watch") != "true":
            lists.append(request.query.get("labelSelector"))
            return web.json_response({"kind": "LeaseList", "metadata": {"resourceVersion": "5"},
                                      "items": [mvproxy_lease(renew=time.time())]})
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(json.dumps({"type": "ERROR", "object": {
            "kind": "Status", "code": 410, "reason": "Expired"}}).encode() + b"\n")
        return response

    async with tls_app(sim, {LEASES: leases, f"{LEASES}/{{name}}": leases}) as url:
        m = watcher(sim, url)
        async with running(m):
            await until(lambda: len(lists) >= 3, "lists after each 410")
            assert m.peers() == (Peer("apiserver-b", "https://10.0.0.2:6443"),)


async def test_answers_of_the_wrong_shape_never_end_membership(sim, caplog):
    """A backend whose JSON has the wrong shapes (metadata a string, a name a list, a
    create answered with ``[]``): each is counted or retried, membership keeps running,
    takes the good Lease that follows, and keeps renewing its own."""
    from aiohttp import web

    lists, creates, renewals = [], [], []
    release = asyncio.Event()
    good = mvproxy_lease(renew=time.time(), duration=600)
    own = {**mvproxy_lease("apiserver-a", "https://127.0.0.1:7001"),
           "metadata": {"name": "mvproxy-apiserver-a", "resourceVersion": "7"}}

    async def leases(request):
        if request.method == "POST":
            creates.append(1)
            return web.json_response([] if len(creates) == 1 else own, status=201)
        if request.query.get("watch") != "true":
            lists.append(1)
            if len(lists) == 1:
                return web.json_response({"metadata": "x", "items": []})
            return web.json_response({"metadata": {"resourceVersion": "5"}, "items": [
                {"metadata": "x"}, "a string", {"metadata": {"name": ["a", "list"]}}]})
        response = web.StreamResponse()
        await response.prepare(request)
        for event in ({"type": "ADDED", "object": {"metadata": "x"}},
                      {"type": "MODIFIED", "object": {"metadata": {"name": {}}}},
                      {"type": "DELETED", "object": {"metadata": "x"}},
                      {"type": "DELETED", "object": {"metadata": {"name": ["x"]}}},
                      {"type": "ADDED", "object": good}):
            await response.write(json.dumps(event).encode() + b"\n")
        await release.wait()
        return response

    async def own_lease_path(request):
        if request.method == "PUT":
            renewals.append(1)
            return web.json_response(own)
        return web.json_response({"kind": "Status", "code": 404}, status=404)

    metrics = Metrics()
    caplog.set_level(logging.WARNING, logger="mvproxy.leasemembership")
    async with tls_app(sim, {LEASES: leases, f"{LEASES}/mvproxy-apiserver-a": own_lease_path}
                       ) as url:
        client = KubeClient(url, _front_proxy(sim), "apiserver-a", timeout=10.0)
        m = LeaseMembership(client=client, server_id="apiserver-a", namespace="kube-system",
                            url="https://127.0.0.1:7001", duration=3.0, renew_period=0.1,
                            identity_leases=False, metrics=metrics)
        task = asyncio.create_task(m.run())
        try:
            await until(lambda: m.peers() == (Peer("apiserver-b", "https://10.0.0.2:6443"),)
                        or task.done(), "the good Lease after the bad ones")
            await until(lambda: len(renewals) >= 3 or task.done(), "renewals after a bad create")
            assert not task.done(), task.exception()
        finally:
            release.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
    assert len(lists) >= 2 and len(creates) == 2
    assert _sample(metrics, "malformed") >= 7  # three list items, four watch objects
    assert metrics.membership_errors.labels("leases", "malformed")._value.get() >= 2
    renew_errors = [getattr(r, _KV_ATTR)["error"] for r in caplog.records
                    if r.getMessage() == "lease renew failed; retrying"]
    assert renew_errors == ["Lease create: the answer is not a Lease"]


async def test_an_unexpected_failure_is_logged_and_retried(sim, clean, caplog, monkeypatch):
    """Whatever a loop did not foresee (here: one exception from parsing and one from
    building the renewal) is logged with where it happened, counted and retried: the
    Lease is still held and the peer still found."""
    failures = {"parse": 1, "renew": 1}

    def once(what, real):
        def wrapper(*args, **kwargs):
            if failures[what]:
                failures[what] -= 1
                raise RuntimeError("something nobody foresaw")
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(leasemembership, "parse_lease", once("parse", parse_lease))
    monkeypatch.setattr(leasemembership, "own_lease", once("renew", own_lease))
    monkeypatch.setattr(leasemembership, "throttled", leasemembership.Throttle(3600.0))
    b = mvproxy_lease(renew=time.time(), duration=600)
    b["metadata"].pop("resourceVersion", None)
    assert admin(sim, "POST", LEASES, b)[0] == 201
    metrics = Metrics()
    caplog.set_level(logging.ERROR, logger="mvproxy.leasemembership")
    a = member(sim, "apiserver-a", 7001, metrics=metrics)
    async with running(a):
        await until(lambda: a.peers() == (Peer("apiserver-b", "https://10.0.0.2:6443"),),
                    "the peer after the failure")
        await until(lambda: admin(sim, "GET", f"{LEASES}/mvproxy-apiserver-a")[0] == 200,
                    "our own Lease after the failure")
    assert failures == {"parse": 0, "renew": 0}
    assert metrics.membership_errors.labels("leases", "unexpected")._value.get() == 2
    lines = {r.getMessage(): getattr(r, _KV_ATTR) for r in caplog.records}
    assert lines["lease renew failed unexpectedly; retrying"]["error"] == "RuntimeError"
    listed = lines["lease list app.kubernetes.io/name=mvproxy failed unexpectedly; retrying"]
    assert listed["where"].startswith("wrapper:")  # the function that raised
    assert "nobody foresaw" not in caplog.text  # the text of an exception is not logged


async def test_a_backend_that_ends_every_watch_at_once_is_not_hammered(sim):
    from aiohttp import web

    watches = []

    async def leases(request):
        if request.query.get("watch") != "true":
            return web.json_response({"kind": "LeaseList", "metadata": {"resourceVersion": "5"},
                                      "items": []})
        watches.append(time.monotonic())
        return web.Response(text="")  # 200, and the stream is over

    async with tls_app(sim, {LEASES: leases}) as url:
        m = watcher(sim, url)
        async with running(m):
            await until(lambda: len(watches) >= 4, "four empty watches")
    # A sleep never ends early, so these are lower bounds, not races: the pauses double.
    gaps = [b - a for a, b in zip(watches, watches[1:], strict=False)]  # neighbours
    assert gaps[2] >= 0.8 * leasemembership._MIN_RETRY * 4, gaps


async def test_the_membership_identity_may_touch_leases_and_nothing_else(sim):
    client = KubeClient(sim.url, _front_proxy(sim), "apiserver-a", timeout=5.0)
    try:
        assert (await client.request("GET", LEASES))[0] == 200
        for path in ("/api/v1/namespaces/kube-system/secrets", "/api/v1/nodes",
                     "/apis/coordination.k8s.io/v1/namespaces/default/leases"):
            status, body = await client.request("GET", path)
            assert status == 403, path
            assert 'User "system:mvproxy:apiserver-a"' in body["message"]
        status, _ = await client.request("PATCH", f"{LEASES}/x", body={})
        assert status == 403
    finally:
        await client.close()


def test_a_reload_applies_static_peers_and_keeps_lease_settings(tmp_path):
    from mvproxy.configfile import load_config
    from mvproxy.reload import merge

    init_pki(tmp_path / "pki", ["a"])
    p = tmp_path / "pki"
    base = {"serverID": "a", "tlsCertFile": str(p / "a/mvproxy.crt"),
            "tlsPrivateKeyFile": str(p / "a/mvproxy.key"), "backend.url": "https://127.0.0.1:6444",
            "backend.certFile": str(p / "a/front-proxy-client.crt"),
            "backend.keyFile": str(p / "a/front-proxy-client.key"),
            "peer.caFile": str(p / "ca.crt"), "peer.clientCAFile": str(p / "front-proxy-ca.crt"),
            "peer.certFile": str(p / "a/front-proxy-client.crt"),
            "peer.keyFile": str(p / "a/front-proxy-client.key"),
            "peer.advertiseURL": "https://127.0.0.1:6443", "peers.leases.enabled": True}
    old = load_config(None, overrides=base)
    new = load_config(None, overrides={
        **base, "peers.leases.renewPeriod": "2s", "peers.dns.name": "mvproxy.test",
        "peers.static": [{"serverID": "b", "url": "https://10.0.0.2:6443"}]})
    running, applied, kept = merge(old, new)
    assert applied == ["peers"] and sorted(kept) == ["peers.dns", "peers.leases"]
    assert [p.server_id for p in running.peers] == ["b"]
    assert running.membership.leases == old.membership.leases
    assert running.membership.dns == old.membership.dns


def test_peers_say_where_membership_learnt_of_them():
    from mvproxy.status import membership_sources

    static = StaticMembership([Peer("apiserver-b", "https://10.0.0.2:6443")])
    leased = StaticMembership([Peer("apiserver-c", "https://10.0.0.3:6443", "lease")])
    combined = CombinedMembership(static, [leased], own_id="apiserver-a")
    assert membership_sources(combined)() == {"apiserver-b": "static", "apiserver-c": "lease"}


async def test_a_silent_watch_is_abandoned_and_watched_again(sim):
    from aiohttp import web

    watches = []
    release = asyncio.Event()

    async def leases(request):
        if request.query.get("watch") != "true":
            return web.json_response({"kind": "LeaseList", "metadata": {"resourceVersion": "5"},
                                      "items": [mvproxy_lease(renew=time.time(), duration=600)]})
        watches.append(request.query["resourceVersion"])
        response = web.StreamResponse()
        await response.prepare(request)  # headers, then nothing, as a dead connection
        await release.wait()
        return response

    async with tls_app(sim, {LEASES: leases}) as url:
        m = watcher(sim, url, duration=3.0, renew_period=0.3)
        async with running(m):
            try:
                await until(lambda: len(watches) >= 2, "a second watch after the silence")
                assert m.peers() == (Peer("apiserver-b", "https://10.0.0.2:6443"),)
            finally:
                release.set()
    assert watches[:2] == ["5", "5"]  # resumed from the same resourceVersion, no re-list


async def test_a_flood_of_bad_leases_is_logged_in_bounded_lines(sim, clean, caplog, monkeypatch):
    monkeypatch.setattr(leasemembership, "_MAX_LOGGED", 3)
    monkeypatch.setattr(leasemembership, "_FLOOD", leasemembership.Throttle(3600.0))
    for i in range(12):
        lease = mvproxy_lease(f"bad-{i:02}", "http://127.0.0.1:1", renew=time.time())
        lease["metadata"].pop("resourceVersion", None)
        assert admin(sim, "POST", LEASES, lease)[0] == 201
    metrics = Metrics()
    caplog.set_level(logging.WARNING, logger="mvproxy.leasemembership")
    a = member(sim, "apiserver-a", 7001, metrics=metrics)
    async with running(a):
        await until(lambda: _sample(metrics, "bad_url") >= 12, "every bad Lease counted")
    lines = [r.getMessage() for r in caplog.records if "no usable peer" in r.getMessage()]
    assert lines.count("ignoring a Lease that names no usable peer") == 3
    assert lines.count("ignoring many Leases that name no usable peer") == 1


# --------------------------------------------------------------------------- in the daemon


async def test_a_lease_cannot_make_the_daemon_trust_a_server_that_is_not_a_peer(
        sim, clean, tmp_path):
    """A Lease names an impostor (a TLS server whose certificate another CA signed):
    mvproxy lists it, tries it, and never takes its discovery; and mvproxy's own Lease
    is there while it runs and gone after a graceful stop."""
    from mvproxy.app import build_daemon
    from mvproxy.app import running as daemon_running
    from mvproxy.configfile import load_config
    from mvproxy.tls import server_context

    init_pki(tmp_path / "other", ["impostor"])
    impostor = tmp_path / "other/impostor"
    served = []

    async def handle(reader, writer):
        served.append(1)  # a completed handshake would get here; it must not
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context(
        impostor / "mvproxy.crt", impostor / "mvproxy.key"))
    port = server.sockets[0].getsockname()[1]
    bad = mvproxy_lease("impostor", f"https://127.0.0.1:{port}", renew=time.time(),
                        duration=600)
    bad["metadata"].pop("resourceVersion", None)
    assert admin(sim, "POST", LEASES, bad)[0] == 201

    p = sim.pki_dir
    own_port = free_port()
    cfg = load_config(None, overrides={
        "serverID": "apiserver-a", "bindAddress": "127.0.0.1", "securePort": own_port,
        "tlsCertFile": str(p / "apiserver-a/mvproxy.crt"),
        "tlsPrivateKeyFile": str(p / "apiserver-a/mvproxy.key"),
        "backend.url": sim.url, "backend.caFile": str(p / "ca.crt"),
        "backend.certFile": str(p / "apiserver-a/front-proxy-client.crt"),
        "backend.keyFile": str(p / "apiserver-a/front-proxy-client.key"),
        "peer.caFile": str(p / "ca.crt"), "peer.clientCAFile": str(p / "front-proxy-ca.crt"),
        "peer.certFile": str(p / "apiserver-a/front-proxy-client.crt"),
        "peer.keyFile": str(p / "apiserver-a/front-proxy-client.key"),
        "peer.advertiseURL": f"https://127.0.0.1:{own_port}",
        "peers.leases": {"enabled": True, "leaseDuration": "3s", "renewPeriod": "1s"},
        "discovery.pollInterval": "200ms", "admin.bindAddress": "127.0.0.1", "admin.port": 0,
        "timeouts.shutdownGracePeriod": "0s"})
    daemon = build_daemon(cfg)
    try:
        async with daemon_running(daemon):
            await until(lambda: (s := daemon.cache.state("impostor")) is not None and s.polled,
                        "the impostor tried")
            state = daemon.cache.state("impostor")
            assert not state.reachable and state.snapshot is None, state
            assert "impostor" not in daemon.cache.view().reachable
            await until(lambda: admin(sim, "GET", f"{LEASES}/mvproxy-apiserver-a")[0] == 200,
                        "our own Lease")
        assert admin(sim, "GET", f"{LEASES}/mvproxy-apiserver-a")[0] == 404  # released
    finally:
        server.close()
        await server.wait_closed()
    assert served == []


async def test_the_lease_client_follows_a_rotated_backend_certificate(sim, tmp_path):
    from mvproxy.tls import SwappableContext

    init_pki(tmp_path / "other", ["x"])
    other = tmp_path / "other"
    swappable = SwappableContext(client_context(other / "ca.crt"))  # trusts the wrong CA
    client = KubeClient(sim.url, swappable, "apiserver-a", timeout=5.0)
    try:
        with pytest.raises(leasemembership.KubeError):
            await client.request("GET", LEASES)
        swappable.context = _front_proxy(sim)  # what a certificate reload does
        assert (await client.request("GET", LEASES))[0] == 200
    finally:
        await client.close()


async def test_identity_lease_peers_are_marked_and_need_no_name_in_their_certificate(
        sim, clean):
    """Review F1: peers from mvproxy Leases must carry their server ID in their serving
    certificate; kube-apiserver identity Leases name IDs no certificate carries, so they
    are their own source (opt-in, ``apiServerIdentity``) and only ``peer.caFile`` and
    the kubelet rule check them."""
    from mvproxy.app import NAMED_SOURCES

    assert admin(sim, "POST", LEASES, identity_lease(
        "apiserver-7f3a", "127.0.0.1:7009", renew=time.time()))[0] == 201
    a, b = member(sim, "apiserver-a", 7001), member(sim, "apiserver-b", 7002)
    async with running(a, b):
        await until(lambda: len(a.peers()) == 2, "a to see b and the identity Lease")
        sources = {p.server_id: p.source for p in a.peers()}
    assert sources == {"apiserver-b": "lease", "apiserver-7f3a": "apiserver-identity"}
    assert "lease" in NAMED_SOURCES and "apiserver-identity" not in NAMED_SOURCES


async def test_a_deleted_identity_lease_keeps_its_peer_for_the_grace(sim, clean):
    """kube-apiserver deletes its identity Lease on every graceful shutdown, so on every
    restart: its peer stays (then unreachable: its APIs Stale, 503) until its new Lease
    comes, or until ``departure_grace`` ends. Against real 1.36.3 the peer used to go at
    once, and requests for what only it serves got 404 for the restart's 2 s."""
    offset = [0.0]
    a = member(sim, "apiserver-a", 7001, clock=lambda: time.time() + offset[0])
    a.departure_grace = 60.0
    name = "apiserver-7f3a"
    lease = f"{LEASES}/{name}"

    def ids() -> set[str]:
        return {p.server_id for p in a.peers()}

    async with running(a):
        assert admin(sim, "POST", LEASES, identity_lease(name, "127.0.0.1:7009",
                                                         renew=time.time()))[0] == 201
        await until(lambda: name in ids(), "a to take the identity Lease's peer")
        assert admin(sim, "DELETE", lease)[0] == 200  # a graceful shutdown
        await until(lambda: name in a._departed, "the deletion to be seen")
        assert name in ids()
        # Back: its new Lease (a new holder) is the peer again; gone, and back again.
        assert admin(sim, "POST", LEASES, identity_lease(name, "127.0.0.1:7009",
                                                         renew=time.time()))[0] == 201
        await until(lambda: name not in a._departed, "the new Lease to be seen")
        assert name in ids()
        assert admin(sim, "DELETE", lease)[0] == 200
        await until(lambda: name in a._departed, "the second deletion to be seen")
        offset[0] = 59.0
        assert name in ids()
        offset[0] = 61.0  # it did not come back within the grace: it leaves
        assert name not in ids() and not a._departed


async def test_an_identity_lease_deleted_between_two_lists_keeps_its_peer_too(sim, clean):
    """The same when the deletion is learnt from a re-list (a watch that ended or a 410)."""
    a = member(sim, "apiserver-a", 7001)
    a.departure_grace = 60.0
    name = "apiserver-7f3a"
    assert admin(sim, "POST", LEASES, identity_lease(name, "127.0.0.1:7009",
                                                     renew=time.time()))[0] == 201
    try:
        await a._list(IDENTITY_SELECTOR)
        assert {p.server_id for p in a.peers()} == {name}
        assert admin(sim, "DELETE", f"{LEASES}/{name}")[0] == 200
        await a._list(IDENTITY_SELECTOR)
        assert {p.server_id for p in a.peers()} == {name} and name in a._departed
    finally:
        await a.client.close()


async def test_a_deleted_mvproxy_lease_drops_its_peer_at_once(sim, clean):
    """An mvproxy deletes its Lease only when it leaves (docs/membership.md)."""
    a = member(sim, "apiserver-a", 7001)
    b = member(sim, "apiserver-b", 7002)
    async with running(a, b):
        await until(lambda: {p.server_id for p in a.peers()} == {"apiserver-b"},
                    "a to see b")
    assert await b.release()
    await a._list(leasemembership.MVPROXY_SELECTOR)
    assert a.peers() == () and not a._departed
    await a.client.close()
