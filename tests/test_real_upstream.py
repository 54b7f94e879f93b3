"""Upstream's built-in Mixed Version Proxy and mvproxy side by side, on the same real
kube-apiservers 1.35.4 and 1.36.3 (issue 20 §4): the scenarios that
``scripts/upstream_comparison.py`` writes into ``docs/upstream-comparison.md``, smaller
(100 requests for the cost, a 3 s look after the peer dies), as assertions.

Each mode runs once, in its own control plane (both up at once, so that the cost
rounds alternate between them; both are stopped before the assertions): *built-in*
(the kube-apiservers' own peer proxy on, no mvproxy; clients straight at the old
kube-apiserver) and *mvproxy* (one mvproxy per kube-apiserver, the built-in proxy off;
clients at the old server's mvproxy). The new-only resource comes from the servers'
own discovery. Without the binaries these tests skip, and fail under CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from real_support import require_binaries, upstream_comparison

cmp = upstream_comparison()

VERSIONS = ("1.35.4", "1.36.3")
REQUESTS = 100  # per cost measurement
DEATH_WINDOW = 3.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """Both modes' scenarios, run once; both control planes are stopped on return."""
    binaries = require_binaries(VERSIONS)
    return cmp.run_pair(tmp_path_factory.mktemp("upstream") / "pair", VERSIONS,
                        requests=REQUESTS, rounds=2, death_window=DEATH_WINDOW,
                        false404=False, recover=False, idle=1.0, binaries=binaries)


@pytest.fixture(scope="module")
def builtin(runs):
    return runs[cmp.BUILTIN]


@pytest.fixture(scope="module")
def mvproxy(runs):
    return runs[cmp.MVPROXY]


def _steps(run) -> dict[str, object]:
    return {step.name: step for step in run.requests}


# --------------------------------------------------------------------------- requests


CRUD = [("CREATE (POST)", 201, "{kind}"), ("GET", 200, "{kind}"), ("LIST", 200, "{kind}List"),
        ("WATCH (first event)", 200, "ADDED {kind}"), ("PATCH (merge)", 200, "{kind}"),
        ("DELETE", 200, "Status"), ("GET after DELETE", 404, "Status"),
        ("GET of a name that never existed", 404, "Status")]


@pytest.mark.parametrize("mode", [cmp.BUILTIN, cmp.MVPROXY])
def test_a_new_only_resource_works_through_the_old_server(mode, request) -> None:
    run = request.getfixturevalue("builtin" if mode == cmp.BUILTIN else "mvproxy")
    assert run.new_only.gvr in run.new_only_all
    steps = _steps(run)
    for name, status, kind in CRUD:
        seen = steps[name].seen
        assert (seen.status, seen.kind) == (status, kind.format(kind=run.new_only.kind)), \
            (name, seen.describe(), seen.body[:300])
    assert steps["GET after DELETE"].seen.reason == "NotFound"


def test_only_the_builtin_proxy_repeats_headers(builtin, mvproxy) -> None:
    """Upstream's peer proxy sends its own response headers and the peer's: Audit-Id,
    Cache-Control and the priority-and-fairness ones arrive twice. mvproxy relays the
    peer's answer as it is."""
    for name, _, _ in CRUD:
        assert {"audit-id", "cache-control"} <= set(_steps(builtin)[name].seen.duplicated), name
        assert _steps(mvproxy)[name].seen.duplicated == (), name
    # A request the old server answers itself is not doubled.
    local = "a resource both serve (`/api/v1/namespaces/default`)"
    assert _steps(builtin)[local].seen.duplicated == ()


def test_what_nobody_serves_is_the_same_404(builtin, mvproxy) -> None:
    for name, answer in _steps(builtin).items():
        if "nobody serves" not in name:
            continue
        theirs, ours = answer.seen, _steps(mvproxy)[name].seen
        assert theirs.status == ours.status == 404, (name, theirs, ours)
        assert (theirs.kind, theirs.reason, theirs.message) == \
            (ours.kind, ours.reason, ours.message), name


def test_legacy_discovery_and_aggregated_headers(builtin, mvproxy) -> None:
    """``/apis/<g>/<v>`` of a group/version both serve: upstream's old server answers
    its own list, without the new-only resource; mvproxy adds what only peers list.
    Aggregated ``/apis`` carries an ETag and revalidates to 304 in both;
    ``profile=nopeer`` is the old server's own view."""
    for run in (builtin, mvproxy):
        steps = _steps(run)
        group, version, resource = run.new_only.gvr
        legacy = steps[f"legacy discovery `/apis/{group}/{version}`"]
        names = legacy.note.split(": ")[1].split(", ")
        assert legacy.seen.status == 200, (run.mode, legacy.seen.describe())
        assert (resource in names) is (run.mode == cmp.MVPROXY), (run.mode, legacy.note)
        merged = steps["`/apis`, aggregated v2"].seen
        assert merged.status == 200 and merged.etag.startswith('"'), (run.mode, merged)
        assert steps["`/apis` again with that `If-None-Match`"].seen.status == 304, run.mode
        nopeer = steps["`/apis`, `profile=nopeer`"]
        own = cmp.listed(run.discovery[cmp.OLD]["own_apis"])
        assert nopeer.seen.status == 200 and nopeer.note == f"{len(own)} resources", \
            (run.mode, nopeer.note)


# --------------------------------------------------------------------------- identity


def _identity(run) -> dict[str, object]:
    return {step.name: step for step in run.identity}


def test_plain_requests_reach_the_new_server_as_the_user(builtin, mvproxy) -> None:
    for run in (builtin, mvproxy):
        for name, step in _identity(run).items():
            if not name.startswith(("GET, client", "GET, bearer", "GET, certificate")):
                continue
            assert step.seen.status == 200, (run.mode, name, step.seen.describe())
            entry = step.audit_new
            assert entry is not None, (run.mode, name)
            # The client's own address first: both hops append theirs (X-Forwarded-For).
            assert entry["sourceIPs"][0] == cmp.CLIENT_HOST, (run.mode, name, entry)
            user = entry["user"]["username"]
            if "Impersonate" in name:
                if run.mode == cmp.BUILTIN:
                    # Upstream asserts the impersonated user; the peer's audit never
                    # learns who impersonated.
                    assert user == "demo-viewer" and "impersonatedUser" not in entry
                else:
                    # mvproxy forwards the impersonation headers: the peer authorizes it.
                    assert user == "kubernetes-admin"
                    assert entry["impersonatedUser"]["username"] == "demo-viewer"
            else:
                assert user == ("demo-admin" if "token" in name else "kubernetes-admin")


def test_upgrade_requests_lose_the_user_only_upstream(builtin, mvproxy) -> None:
    """Upstream's upgrade path, seen on real servers (docs/upstream-comparison.md,
    "Identity"): an upgrade request (exec, attach, port-forward's way in) proxied by
    kube-apiserver reaches the peer with no user at all, which answers 401; through
    mvproxy the peer sees the user."""
    upgrades = [n for n in _identity(builtin) if "Upgrade" in n]
    assert len(upgrades) == 4
    for name in upgrades:
        theirs, ours = _identity(builtin)[name], _identity(mvproxy)[name]
        assert (theirs.seen.status, theirs.seen.reason) == (401, "Unauthorized"), \
            (name, theirs.seen.describe())
        assert theirs.audit_new is not None and not theirs.audit_new["user"], theirs.audit_new
        # The old server authenticated the user before proxying it away.
        assert theirs.audit_old is not None and theirs.audit_old["user"]["username"]
        assert ours.seen.status == 200, (name, ours.seen.describe())
        assert ours.audit_new["user"]["username"] == (
            "demo-admin" if "token" in name else "kubernetes-admin")


def test_where_authorization_happens(builtin, mvproxy) -> None:
    """kube-apiserver authorizes before it proxies: a read-only user's write is
    refused by the old server and never reaches the new one. mvproxy cannot judge a
    token, so the new server refuses it, in the same words. A request with no
    credentials is the old server's to answer in both (mvproxy never sends one to a
    peer)."""
    write = "POST, bearer token of demo-viewer (may only read)"
    theirs, ours = _identity(builtin)[write], _identity(mvproxy)[write]
    assert theirs.audit_new is None and theirs.audit_old["responseStatus"]["code"] == 403
    assert ours.audit_new is not None and ours.audit_new["responseStatus"]["code"] == 403
    assert ours.audit_new["user"]["username"] == "demo-viewer"
    for step in (theirs, ours):
        assert (step.seen.status, step.seen.reason) == (403, "Forbidden"), step.seen
    assert theirs.seen.message == ours.seen.message

    anonymous = "GET, no credentials at all"
    theirs, ours = _identity(builtin)[anonymous], _identity(mvproxy)[anonymous]
    for step in (theirs, ours):
        assert (step.seen.status, step.seen.reason) == (403, "Forbidden"), step.seen
        assert step.audit_new is None, step.audit_new
        assert step.audit_old["user"]["username"] == "system:anonymous"
    assert theirs.seen.message == ours.seen.message


def test_the_peer_gets_the_request_as_sent_only_through_mvproxy(builtin, mvproxy) -> None:
    """Upstream rebuilds the URL: the escaped name arrives decoded, the query keys
    sorted (docs/upstream-comparison.md); mvproxy sends path and query byte for byte."""
    (theirs,) = [s for s in builtin.identity if "escaped name" in s.name]
    (ours,) = [s for s in mvproxy.identity if "escaped name" in s.name]
    assert theirs.seen.status == ours.seen.status == 200
    assert theirs.note == "received as `…/cmp-ident?marker=builtin-uri&pretty=true&z=1`", \
        theirs.note
    assert ours.note == "received as sent", ours.note


# --------------------------------------------------------------------------- discovery


def test_merged_discovery_is_upstreams(builtin, mvproxy) -> None:
    """Group by group, version by version, resource by resource, through each server:
    mvproxy's merged /apis and /api equal kube-apiserver's peer-aggregated ones."""
    for sid in (cmp.OLD, cmp.NEW):
        for path in ("apis", "api"):
            diffs = cmp.compare_discovery(builtin.discovery[sid][path],
                                          mvproxy.discovery[sid][path])
            unexplained = [d for d in diffs if not cmp.explain(d, {})]
            assert unexplained == [], (sid, path, unexplained)
        # The union of both servers' own views, through either server, in both.
        union = cmp.listed(mvproxy.discovery[cmp.OLD]["own_apis"]) | cmp.listed(
            mvproxy.discovery[cmp.NEW]["own_apis"])
        assert cmp.listed(mvproxy.discovery[sid]["apis"]) == union
        assert cmp.listed(builtin.discovery[sid]["apis"]) == union


def test_discovery_forms_upstream_does_not_merge(builtin, mvproxy) -> None:
    """Only aggregated v2 is peer-aggregated upstream. Since 1.33 kube-apiserver no
    longer serves v2beta1: a client asking for it, then JSON, gets the old server's own
    legacy APIGroupList; mvproxy offers v2beta1 only where its backend does, so it
    answers the merged legacy APIGroupList. Protobuf: upstream merges it; mvproxy
    encodes only JSON and skips to the client's next clause."""
    beta = "`/apis`, aggregated v2beta1 then JSON (client-go 1.26–1.29)"
    assert _steps(builtin)[beta].seen.kind == "APIGroupList"
    assert _steps(mvproxy)[beta].seen.kind == "APIGroupList"
    assert _steps(mvproxy)[beta].seen.content_type == "application/json"
    proto = "`/apis`, aggregated protobuf first, then JSON"
    assert _steps(builtin)[proto].seen.kind == "protobuf"
    assert _steps(mvproxy)[proto].seen.kind == "APIGroupDiscoveryList"


def test_openapi_of_a_shared_group_version_has_the_new_kind_only_through_mvproxy(
        builtin, mvproxy) -> None:
    """``kubectl explain`` of a new-only resource in a group/version the old server
    serves too: upstream's old server answers its own ``/openapi/v3/apis/<g>/<v>``,
    without the schema; mvproxy adds the peer's paths and schemas to it."""
    group, version, _ = builtin.new_only.gvr
    name = f"OpenAPI v3 `/openapi/v3/apis/{group}/{version}`"
    theirs, ours = _steps(builtin)[name], _steps(mvproxy)[name]
    assert theirs.seen.status == 200 and theirs.note.endswith("schema absent"), theirs.note
    assert ours.seen.status == 200 and ours.note.endswith("schema present"), ours.note


# --------------------------------------------------------------------------- cost


def test_a_rerouted_get_costs_the_old_kube_apiserver_nothing_with_mvproxy(builtin,
                                                                          mvproxy) -> None:
    """Same client, same requests: every one answered; upstream's reroute runs the
    whole request chain on the old kube-apiserver too, mvproxy's never touches it."""
    theirs, ours = builtin.cost[0], mvproxy.cost[0]
    for cost in builtin.cost + mvproxy.cost:
        assert cost.errors == 0 and cost.requests == REQUESTS, cost
        assert 0 < cost.p50_ms <= cost.p99_ms, cost
    assert theirs.cpu_us["old kube-apiserver"] > 3 * ours.cpu_us["old kube-apiserver"], \
        (theirs, ours)
    assert ours.cpu_us["old mvproxy"] > 0 and ours.cpu_us["new mvproxy"] > 0, ours


# --------------------------------------------------------------------------- metrics


def test_proxy_metrics(builtin, mvproxy) -> None:
    """kube-apiserver 1.35 counts reroutes by code alone (the group/version/resource
    labels came in 1.36) and, its gate off by default, registers none of the
    peer-aggregated discovery counters; mvproxy exports upstream's 1.36 names and
    labels, and its own."""
    reroutes = builtin.metrics["apiserver_rerouted_request_total"]
    assert reroutes and all(line.startswith('apiserver_rerouted_request_total{code="')
                            and "group=" not in line for line in reroutes), reroutes
    assert not any(name.startswith("aggregator_discovery_peer") for name in builtin.metrics)
    ours = mvproxy.metrics
    group, version, resource = mvproxy.new_only.gvr
    assert any(f'group="{group}"' in line and f'resource="{resource}"' in line
               and 'code="200"' in line for line in ours["apiserver_rerouted_request_total"])
    assert {"mvproxy_peer_up", "apiserver_peer_proxy_errors_total",
            "aggregator_discovery_peer_aggregated_cache_hits_total"} <= set(ours)


# --------------------------------------------------------------------------- a peer dies


def test_when_the_peer_dies(builtin, mvproxy) -> None:
    """The new member SIGKILLed with a watch open through the old server: the watch
    ends at once in both; upstream then answers 503 in plain text with no
    Retry-After (the peer's endpoint record outlives it by up to 15 s) and keeps
    listing the peer's resources; mvproxy answers a 503 Status with Retry-After."""
    (theirs,), (ours,) = builtin.deaths, mvproxy.deaths
    for death in (theirs, ours):
        assert death.watch_end.startswith(("ended", "broke")), death.watch_end
        assert float(death.watch_end.split()[2]) < DEATH_WINDOW, death.watch_end
        assert death.timeline, death
    first = theirs.timeline[0]
    assert (first.get.status, first.get.kind, first.get.retry_after) == (503, "text", None), \
        first.get.describe()
    assert first.get.message.startswith("error trying to reach service"), first.get.message
    assert all(s.listed for s in theirs.timeline)
    for sample in ours.timeline:
        seen = sample.get
        assert (seen.status, seen.kind, seen.reason) == (503, "Status", "ServiceUnavailable"), \
            seen.describe()
        assert seen.retry_after is not None and int(seen.retry_after) >= 1


def test_the_doc_was_generated_from_these_scenarios() -> None:
    """docs/upstream-comparison.md exists, says how to regenerate it, and covers both
    pairs; the claims about upstream in the README and the docs pages cite it."""
    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "upstream-comparison.md").read_text()
    assert "python3 scripts/upstream_comparison.py" in doc.split("\n\n")[1]
    for pair in ("## 1.35.4 + 1.36.3", "## 1.36.3 + 1.37.2"):
        assert pair in doc
    assert "docs/upstream-comparison.md" in (root / "README.md").read_text()
    for page in ("routing.md", "security.md", "deploy-kubeadm.md", "operations.md",
                 "performance.md", "architecture.md"):
        assert "](upstream-comparison.md" in (root / "docs" / page).read_text(), page
