"""mvproxy's simulator against real kube-apiservers 1.35.4 and 1.36.3 (issue 20 §6).

The corpus of ``tests/realk8s_replay.py`` (the discovery requests real clients sent,
CRUD on core and apps resources, list and watch by resourceVersion, selectors, Table
output, the common errors) is replayed against each real server and a simulator of
its release; their answers must agree, key by key, except where ``ACCEPTED`` says why
not. So a change to the simulator that moves it away from the real thing fails here,
and so does a real release that changes what the simulator copies.

One module-scoped environment (one etcd, both kube-apiservers, both simulators); the
replay itself takes about half a minute. Without the binaries (``python3
scripts/dev.py kube-binaries``) this skips, and fails under CI.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import realk8s_replay as replay
from process_support import pid_alive
from real_support import require_binaries

VERSIONS = ("1.35.4", "1.36.3")

#: Steps whose answers must be the same in every respect but managedFields (which the
#: simulator keeps none of): the errors, conflicts and status bodies clients act on,
#: list and watch semantics, selectors, Tables and the discovery requests real clients
#: sent. Each glob must match at least one step.
IDENTICAL = (
    "captured/*", "errors/4*", "errors/200 *", "crud/*: 4*", "crud/patch json, failing test op",
    "crud/delete configmap", "crud/create secret (stringData)", "crud/get secret",
    "crud/update configmap*", "crud/patch merge", "crud/patch strategic", "crud/patch json",
    "crud/apply *", "crud/create dryRun=All", "crud/list configmaps",
    "crud/deletecollection *", "apps/get deployment scale", "apps/patch deployment scale",
    "apps/delete deployment", "list/*", "watch/*", "selectors/label *", "selectors/field *",
    "selectors/secrets type", "selectors/namespaces by name", "table/configmaps*",
    "table/one configmap", "table/v1beta1 only", "table/secrets", "table/serviceaccounts",
    "table/leases", "table/namespaces", "table/PartialObjectMetadata*",
    "discovery/aggregated /apis v2beta1",
    "discovery/aggregated /apis v2 profile=nopeer", "discovery/aggregated /apis gzip",
    "discovery/aggregated /apis If-None-Match", "discovery/legacy /api",
    "discovery/legacy /apis/apps", "discovery/legacy /apis/apps/ (trailing slash)",
    "discovery/unknown *", "discovery/version", "discovery/health *",
    "discovery/openapi v3 *", "discovery/openapi v2", "discovery/metrics",
    "namespace/delete",
)
#: Steps that differ only as ACCEPTED explains, and are not identical for that reason.
NOT_IDENTICAL = ("selectors/label bad syntax: 400", "selectors/label bad key: 400",
                 "errors/400 malformed JSON", "errors/400 apiVersion differs from URL",
                 "errors/400 kind differs from URL", "list/continue garbage")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, replay.VersionResult]]:
    root = require_binaries(VERSIONS)
    directory = tmp_path_factory.mktemp("real-sim")
    pids: list[int] = []
    with replay.environment(directory, VERSIONS, root) as env:
        pids = [p.pid for p in [*env.cluster.processes, *env.sims.values()] if p.pid]
        yield {release: replay.replay(real, sim, replay.namespace_for(release))
               for release, real, sim in env.pairs()}
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], "processes left running"


def _describe(found: list[tuple[replay.StepResult, replay.Diff]]) -> str:
    return "\n".join(f"{r.step.id}: {d.where}: real {d.real}, simulator {d.sim}"
                     for r, d in found)


@pytest.mark.parametrize("version", VERSIONS)
def test_no_difference_is_unexplained(results: dict[str, replay.VersionResult],
                                      version: str) -> None:
    found = results[version].unexplained
    assert not found, f"{len(found)} unexplained differences:\n{_describe(found)}"


def _matching(result: replay.VersionResult, pattern: str) -> list[replay.StepResult]:
    return [s for s in result.steps if replay.glob(s.step.id, pattern)
            and s.step.id not in NOT_IDENTICAL]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("pattern", IDENTICAL)
def test_what_clients_act_on_is_identical(results: dict[str, replay.VersionResult],
                                          version: str, pattern: str) -> None:
    steps = _matching(results[version], pattern)
    assert steps, f"no step matches {pattern!r}"
    found = [(s, d) for s in steps for d in s.diffs
             if replay.general(d.where) != "metadata.managedFields"]
    assert not found, _describe(found)


def test_every_accepted_difference_still_occurs(
        results: dict[str, replay.VersionResult]) -> None:
    """A rule nothing matches any more is stale: the simulator or a release changed."""
    used = {id(rule) for r in results.values() for s in r.steps for _, rule in s.accepted}
    stale = [rule.reason for rule in replay.ACCEPTED if id(rule) not in used]
    assert not stale, "ACCEPTED rules that match nothing:\n" + "\n".join(stale)


def test_the_corpus_is_what_the_issue_names(results: dict[str, replay.VersionResult]) -> None:
    result = results[VERSIONS[-1]]
    categories = {s.step.id.split("/")[0] for s in result.steps}
    assert categories >= {"captured", "discovery", "crud", "apps", "errors", "list", "watch",
                          "selectors", "table", "namespace"}
    statuses = {s.real.status for s in result.steps}
    assert statuses >= {200, 201, 304, 400, 401, 403, 404, 405, 406, 409, 410, 415, 422,
                        504} - {410}  # a watch's 410 arrives as an ERROR event
    assert any(e.get("type") == "ERROR" and e["object"].get("code") == 410
               for s in result.steps for e in s.real.events or [])
    captured = [s for s in result.steps if s.step.id.startswith("captured/")]
    assert len(captured) == len(replay.captured_requests()) > 10
    assert all(s.real.status == 200 for s in captured)
