"""The operator endpoints: ``/debug/mvproxy/peers``, ``/debug/mvproxy/route`` and ``/``.

Pure documents from a hand-fed cache first, then the assembled daemon between fakes
(a backend and two peers, one of them hostile), then ``--workers 2`` processes.
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from urllib.parse import quote

import aiohttp
import pytest
from daemon_support import PEER_ID, PODGROUPS, SELF, cluster, ready
from process_support import admin_get, start_daemon, wait_ready

from mvproxy.cache import DiscoveryCache
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.discoverydocs import aggregated
from mvproxy.discovery import Snapshot
from mvproxy.status import MAX_PATH, BadQuery, explain_route, peers_document, route_query
from mvproxy.statuspage import CSP, HEADERS, render

HOSTILE = '<script>alert(1)</script><img src=x onerror=alert(2)>'
HOSTILE_GROUP = "x.evil.io<script>document.title='owned'</script>"


def snapshot(version: str, extra: list[dict] | None = None) -> Snapshot:
    catalog = load_catalog(version)
    return Snapshot(core=aggregated(catalog, core=True)["items"],
                    groups=aggregated(catalog, core=False)["items"] + (extra or []))


def group(name: str, version: str = "v1") -> dict:
    return {"metadata": {"name": name}, "versions": [
        {"version": version, "freshness": "Current", "resources": [
            {"resource": "widgets", "scope": "Namespaced", "verbs": ["get", "list"],
             "responseKind": {"group": name, "version": version, "kind": "Widget"}}]}]}


def fed_cache() -> tuple[DiscoveryCache, list[float]]:
    """Backend 1.35, peer b 1.36 (plus a hostile group), peer c never answered."""
    clock = [100.0]
    cache = DiscoveryCache("a", ["b", "c"], stale_after=10, forget_after=100,
                           clock=lambda: clock[0])
    cache.record_success("a", snapshot("1.35"))
    cache.record_success("b", snapshot("1.36", [group(HOSTILE_GROUP)]))
    cache.record_failure("c", f"connect: {HOSTILE}")
    clock[0] = 103.0
    return cache, clock


# --------------------------------------------------------------------------- documents


def test_peers_document_lists_every_server_and_what_only_it_serves():
    cache, clock = fed_cache()
    doc = peers_document(cache.view(), sources={"b": "lease"}, clock=lambda: clock[0],
                         wall=lambda: 1_800_000_000.0)
    servers = {s["serverID"]: s for s in doc["servers"]}
    assert [s["serverID"] for s in doc["servers"]] == ["a", "b", "c"]
    a, b, c = servers["a"], servers["b"], servers["c"]
    assert (a["role"], a["source"], b["role"], b["source"], c["source"]) == (
        "backend", "static", "peer", "lease", "static")
    assert a["reachable"] and b["reachable"] and not c["reachable"] and c["polled"]
    assert b["snapshotAgeSeconds"] == 3.0 and b["secondsSinceLastPoll"] == 3.0
    assert b["lastPollTime"] == "2027-01-15T07:59:57Z"
    assert b["lastError"] is None and c["lastError"] == f"connect: {HOSTILE}"
    assert c["hasSnapshot"] is False and c["groupVersions"] == 0 and c["lastPollTime"]
    assert "scheduling.k8s.io/v1alpha2" in b["onlyHere"]  # 1.36's podgroups
    assert f"{HOSTILE_GROUP}/v1" in b["onlyHere"]
    assert b["groupVersions"] > a["groupVersions"] > 0 and a["kubeVersion"] is None
    apis = {api["groupVersion"]: api for api in doc["apis"]}
    assert apis["v1"] == {"groupVersion": "v1", "servedBy": ["a", "b"], "everywhere": True}
    assert apis["scheduling.k8s.io/v1alpha2"]["everywhere"] is False
    assert json.loads(json.dumps(doc)) == doc  # plain JSON


def test_page_escapes_everything_a_peer_controls():
    cache, clock = fed_cache()
    doc = peers_document(cache.view(), sources={"b": HOSTILE}, clock=lambda: clock[0])
    doc["servers"][1]["serverID"] = HOSTILE  # membership from Leases names servers too
    doc["apis"][0]["servedBy"].append(HOSTILE)
    doc["reroutes"] = [{"group": HOSTILE, "version": "v1", "resource": HOSTILE,
                        "code": "200", "count": 3}]
    page = render(doc)
    elements = Elements()
    elements.feed(page)
    assert elements.tags <= {"html", "head", "meta", "title", "style", "body", "h1", "h2",
                             "p", "a", "table", "tr", "th", "td", "span"}, elements.tags
    assert not elements.handlers, elements.handlers
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "x.evil.io&lt;script&gt;document.title=&#x27;owned&#x27;&lt;/script&gt;/v1" in page


class Elements(HTMLParser):
    """Every tag name and every on* attribute in a document."""

    def __init__(self):
        super().__init__()
        self.tags, self.handlers = set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.handlers += [name for name, _ in attrs if name.startswith("on")]


def test_content_security_policy_allows_no_script_and_nothing_remote():
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives["default-src"] == "'none'"
    assert "script-src" not in directives  # falls back to 'none'
    assert directives["style-src"].startswith("'sha256-") and "unsafe" not in CSP
    assert directives["frame-ancestors"] == "'none'" and directives["base-uri"] == "'none'"
    assert HEADERS["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("query, why", [
    ({}, "path is required"),
    ({"path": ""}, "path is required"),
    ({"path": "/" + "a" * MAX_PATH}, "longer than"),
    ({"path": "apis"}, "must start with /"),
    ({"path": "/api\r\nX: y"}, "control characters"),
    ({"path": "/api\x00"}, "control characters"),
    ({"path": "/api", "method": "G E T"}, "method must be"),
    ({"path": "/api", "method": "GET" * 10}, "method must be"),
    ({"path": "/api", "method": "GÉT"}, "method must be"),
    ({"path": "/api", "method": ""}, "method must be"),
    ({"path": "/api", "peerProxied": "yes"}, "peerProxied"),
    ({"path": "/api", "credentials": "none"}, "credentials must be true or false"),
])
def test_route_query_refuses_unusable_input(query, why):
    with pytest.raises(BadQuery, match=why):
        route_query(query)


def test_route_explains_local_peer_unavailable_and_nobody():
    cache, _ = fed_cache()
    view = cache.view()
    local = explain_route(view, {"path": "/api/v1/namespaces/default/pods", "method": "get"})
    assert (local["route"], local["reason"]) == ("backend", "served locally")
    assert local["requestInfo"]["verb"] == "list" and local["request"]["method"] == "GET"
    peer = explain_route(view, {"path": PODGROUPS + "/x?watch=1"})
    assert (peer["route"], peer["candidatePeers"], peer["capablePeers"]) == (
        "peer", ["b"], ["b"])
    assert peer["requestInfo"]["resource"] == "podgroups" and peer["request"]["query"] == "watch=1"
    nobody = explain_route(view, {"path": "/apis/nope.io/v1/things"})
    assert (nobody["route"], nobody["reason"]) == ("backend", "served by nobody")
    proxied = explain_route(view, {"path": PODGROUPS, "peerProxied": "true"})
    assert (proxied["route"], proxied["reason"]) == ("backend", "peer-proxied")


def test_route_explains_a_request_without_credentials():
    """The explainer assumes credentials (as an operator's kubectl has); asked with
    ``credentials=false`` it shows that such a request never goes to a peer, while
    still naming the capable peers for the operator."""
    view = fed_cache()[0].view()
    assumed = explain_route(view, {"path": PODGROUPS})
    assert (assumed["route"], assumed["request"]["credentials"]) == ("peer", True)
    anonymous = explain_route(view, {"path": PODGROUPS, "credentials": "false"})
    assert (anonymous["route"], anonymous["reason"]) == ("backend", "no credentials")
    assert anonymous["request"]["credentials"] is False
    assert anonymous["capablePeers"] == ["b"] and anonymous["candidatePeers"] == []
    proxied = explain_route(view, {"path": PODGROUPS, "peerProxied": "true",
                                   "credentials": "false"})
    assert proxied["request"]["credentials"] is True  # a peer's hop always has them


# --------------------------------------------------------------------------- daemon


async def test_endpoints_on_a_running_daemon(aiohttp_server, root):
    async with cluster(aiohttp_server, root, extra_peers=1,
                       peer_groups=[group(HOSTILE_GROUP)]) as c:
        await ready(c)
        status, _, _ = await c.get(PODGROUPS)  # one request forwarded to a peer
        assert status == 200
        status, text = await c.admin_get("/debug/mvproxy/peers")
        assert status == 200
        doc = json.loads(text)
        assert [s["serverID"] for s in doc["servers"]] == [SELF, PEER_ID, f"{PEER_ID}-0"]
        assert all(s["reachable"] and s["source"] == "static" for s in doc["servers"])
        assert f"{HOSTILE_GROUP}/v1" in doc["servers"][1]["onlyHere"]
        assert {"group": "scheduling.k8s.io", "version": "v1alpha2", "resource": "podgroups",
                "code": "200", "count": 1} in doc["reroutes"]

        status, text = await c.admin_get("/debug/mvproxy/route?method=POST&path="
                                         + quote(PODGROUPS, safe=""))
        route = json.loads(text)
        assert status == 200 and route["route"] == "peer", route
        assert route["candidatePeers"] == [PEER_ID, f"{PEER_ID}-0"]

        async with c.sessions["plain"].get(c.admin + "/") as resp:
            page = await resp.text()
            assert resp.status == 200 and resp.content_type == "text/html"
            assert resp.headers["Content-Security-Policy"] == CSP
        assert "<script" not in page and "&lt;script&gt;" in page
        assert all(f'data-server="{s}"' in page for s in (SELF, PEER_ID, f"{PEER_ID}-0"))


@pytest.mark.parametrize("target", [
    "/debug/mvproxy/route",
    "/debug/mvproxy/route?path=",
    "/debug/mvproxy/route?path=" + "a" * 5000,
    "/debug/mvproxy/route?path=/" + "a" * 5000,
    "/debug/mvproxy/route?path=%0d%0a",
    "/debug/mvproxy/route?path=/api&method=%00",
    "/debug/mvproxy/route?path=/api&method=" + "%ff" * 10,
    "/debug/mvproxy/route?path=%2F%ff%fe%00",
    "/debug/mvproxy/route?path=/api&peerProxied=1",
])
async def test_route_answers_hostile_input_with_a_json_400(aiohttp_server, root, target):
    async with cluster(aiohttp_server, root) as c:
        status, text = await c.admin_get(target)
        assert status == 400, text
        assert set(json.loads(text)) == {"error"}


async def test_route_never_fails_on_odd_paths(aiohttp_server, root):
    """Paths the parser finds strange still get an explanation, never a 500."""
    odd = ["/", "//", "/api/v1/watch", "/apis//v1//", "/api/v1/namespaces//pods/", "/%",
           "/apis/a/b/c/d/e/f/g/h/i", "/api/v1/pods?fieldSelector=metadata.name%3D%3D",
           "/openapi/v3/apis/x/y", "/apis/" + "g" * 4000, "/api/v1/namespaces/%2e%2e/pods"]
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        for method in ("GET", "DELETE", "PROPFIND"):
            for path in odd:
                status, text = await c.admin_get("/debug/mvproxy/route?method=" + method
                                                 + "&path=" + quote(path, safe=""))
                assert status == 200, (method, path, text)
                assert json.loads(text)["route"] in ("backend", "discovery", "peer",
                                                     "unavailable", "openapi-index")


# --------------------------------------------------------------------------- workers


async def test_endpoints_through_the_workers_supervisor(backend, root, tmp_path):
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, args=("--workers", "2"))
    try:
        await wait_ready(admin)
        status, text = await admin_get(admin, "/debug/mvproxy/peers")
        doc = json.loads(text)
        assert status == 200 and doc["worker"] == 0, text
        assert [s["serverID"] for s in doc["servers"]] == ["a"] and doc["reroutes"] == []
        status, text = await admin_get(admin, "/debug/mvproxy/route?path=/api/v1/pods")
        assert status == 200 and json.loads(text)["reason"] == "served locally", text
        status, text = await admin_get(admin, "/debug/mvproxy/route?path=nope")
        assert status == 400 and json.loads(text) == {"error": "path must start with /"}
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{admin}/") as resp:
                assert resp.status == 200 and resp.headers["Content-Security-Policy"] == CSP
                assert "from worker 0" in await resp.text()
    finally:
        log = stop()
    assert "Traceback" not in log
