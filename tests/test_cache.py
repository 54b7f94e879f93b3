"""DiscoveryCache: generations, readiness, reachability, forgetting and the routing index.

Snapshots come from the real 1.35 and 1.36 discovery catalogs: 1.35 serves
``scheduling.k8s.io/v1alpha1`` and 1.36 replaces it with ``v1alpha2`` (with the new
``podgroups/status`` subresource), the shape of a real rolling upgrade. Time is an
injected clock; nothing here sleeps.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping

import pytest

from mvproxy import discovery
from mvproxy.cache import CacheView, DiscoveryCache, Document
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.discoverydocs import aggregated
from mvproxy.discovery import Snapshot

SELF = "apiserver-a"
SCHED = "scheduling.k8s.io"
OLD_GV = (SCHED, "v1alpha1")  # 1.35 only
NEW_GV = (SCHED, "v1alpha2")  # 1.36 only
STALE_AFTER = 15.0
FORGET_AFTER = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def documents(version: str) -> tuple[dict, dict]:
    catalog = load_catalog(version)
    return aggregated(catalog, core=True), aggregated(catalog, core=False)


def snapshot(version: str, *, without: tuple[str, str] | None = None) -> Snapshot:
    """A server's snapshot as polling builds it: parsed from the rendered bytes."""
    core, groups = (copy.deepcopy(d) for d in documents(version))
    if without is not None:
        for group in groups["items"]:
            if group["metadata"]["name"] == without[0]:
                group["versions"] = [v for v in group["versions"] if v["version"] != without[1]]
    return Snapshot(core=parse(core), groups=parse(groups))


def parse(doc: dict) -> tuple[dict, ...]:
    return discovery.parse_aggregated(json.dumps(doc).encode(), max_bytes=1 << 20)


@pytest.fixture(scope="module")
def v135() -> Snapshot:
    return snapshot("1.35")


@pytest.fixture(scope="module")
def v136() -> Snapshot:
    return snapshot("1.36")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def new_cache(clock: Clock, peers=("apiserver-b",)) -> DiscoveryCache:
    return DiscoveryCache(SELF, peers, stale_after=STALE_AFTER, forget_after=FORGET_AFTER,
                          clock=clock)


def freshness(view: CacheView) -> dict[tuple[str, str], str]:
    merged = view.merged()
    assert merged is not None
    return {(discovery.group_name(g), v["version"]): v.get("freshness", "")
            for g in (*merged.core, *merged.groups) for v in g.get("versions") or ()}


def render(view: CacheView):
    calls = []

    def render_merged() -> bytes:
        calls.append(view.generation)
        merged = view.merged()
        return discovery.render_aggregated((*merged.core, *merged.groups))

    return render_merged, calls


# --------------------------------------------------------------------------- generations

def test_first_success_publishes_and_identical_repoll_keeps_the_generation(clock, v135):
    cache = new_cache(clock, peers=())
    assert cache.generation == 0
    cache.record_success(SELF, v135)
    view = cache.view()
    assert view.generation == 1 and view.backend.snapshot is v135
    render_merged, calls = render(view)
    doc, was_cached = view.document(("aggregated", "v2"), render_merged)
    assert isinstance(doc, Document) and not was_cached and calls == [1]
    assert doc.etag == discovery.etag(doc.body)

    clock.now += 5
    cache.record_success(SELF, v135)          # 304: the poller hands back the same object
    cache.record_success(SELF, snapshot("1.35"))  # 200 with identical content
    clock.now += 5
    cache.record_failure(SELF)                # within staleAfter: nothing visible changes
    after = cache.view()
    assert cache.generation == 1 and after.generation == 1
    again, was_cached = after.document(("aggregated", "v2"), render_merged)
    assert was_cached and again is doc and calls == [1]
    assert after.backend.last_success == 1005.0 and after.backend.first_failure == 1010.0


def test_changed_snapshot_bumps_generation_and_rerenders(clock, v135, v136):
    cache = new_cache(clock, peers=())
    cache.record_success(SELF, v135)
    old = cache.view()
    old_doc, _ = old.document(("k",), lambda: b"old")
    cache.record_success(SELF, v136)
    new = cache.view()
    assert new.generation == old.generation + 1
    doc, was_cached = new.document(("k",), lambda: b"new")
    assert not was_cached and doc.body == b"new"
    # The old view is unchanged: a request that read it stays consistent.
    assert old.backend.snapshot is v135 and old.document(("k",), lambda: b"x") == (old_doc, True)


def test_merged_is_computed_once_per_generation(clock, v135, v136):
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    cache.record_success("apiserver-b", v136)
    view = cache.view()
    assert view.merged() is view.merged()
    clock.now += 1
    cache.record_success("apiserver-b", v136)
    assert cache.view().merged() is view.merged()


@pytest.mark.parametrize("change", ["reachability", "polled", "membership", "forgotten"])
def test_visible_changes_bump_the_generation(clock, v135, change):
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    if change != "polled":
        cache.record_success("apiserver-b", v135)
    before = cache.generation
    if change == "reachability":
        clock.now += STALE_AFTER
        cache.record_failure("apiserver-b")
    elif change == "polled":
        cache.record_failure("apiserver-b")
    elif change == "membership":
        cache.set_peers(["apiserver-b", "apiserver-c"])
    else:
        clock.now += FORGET_AFTER
        cache.record_failure("apiserver-b")
    assert cache.generation == before + 1


def test_unknown_server_and_unchanged_membership_are_ignored(clock, v135):
    cache = new_cache(clock)
    cache.record_success("apiserver-z", v135)
    cache.record_failure("apiserver-z")
    cache.set_peers(["apiserver-b"])
    assert cache.generation == 0 and cache.state("apiserver-z") is None


def test_peer_order_from_membership_is_not_a_change(clock, v135):
    cache = new_cache(clock, peers=("apiserver-b", "apiserver-c"))
    cache.record_success("apiserver-b", v135)
    view = cache.view()
    cache.set_peers(["apiserver-c", "apiserver-b"])  # e.g. DNS answers in another order
    cache.set_peers(["apiserver-b", "apiserver-c", "apiserver-b"])
    assert cache.view() is view


# --------------------------------------------------------------------------- readiness

def test_synced_only_after_backend_and_every_peer_polled(clock, v135):
    cache = new_cache(clock, peers=("apiserver-b", "apiserver-c"))
    assert not cache.view().synced
    cache.record_success(SELF, v135)
    assert not cache.view().synced
    cache.record_failure("apiserver-b")  # a failed poll counts as polled
    assert not cache.view().synced
    cache.record_success("apiserver-c", v135)
    assert cache.view().synced
    cache.set_peers(["apiserver-b", "apiserver-c", "apiserver-d"])
    assert not cache.view().synced  # a new peer has not been polled yet


def test_peers_never_polled_keep_readiness_off_even_when_backend_is(clock, v135):
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    assert not cache.view().synced
    assert new_cache(clock, peers=()).view().synced is False


# --------------------------------------------------------------------------- reachability

def test_stale_after_marks_only_versions_no_reachable_server_lists(clock, v135, v136):
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    cache.record_success("apiserver-b", v136)
    assert cache.view().reachable == {"apiserver-b"}
    assert freshness(cache.view())[NEW_GV] == discovery.CURRENT

    clock.now += STALE_AFTER - 1
    cache.record_failure("apiserver-b")
    assert cache.view().reachable == {"apiserver-b"}

    clock.now += 1
    cache.record_failure("apiserver-b")
    view = cache.view()
    assert view.reachable == frozenset()
    fresh = freshness(view)
    assert fresh[NEW_GV] == discovery.STALE          # only the unreachable peer lists it
    assert fresh[OLD_GV] == discovery.CURRENT        # only the backend lists it
    assert fresh[("apps", "v1")] == discovery.CURRENT  # both list it
    assert fresh[("", "v1")] == discovery.CURRENT
    # Routing still knows who is capable; ``reachable`` filters.
    assert view.capable_peers(SCHED, "v1alpha2", "podgroups") == ("apiserver-b",)
    assert view.peers["apiserver-b"].snapshot is v136

    clock.now += 1
    cache.record_success("apiserver-b", v136)
    view = cache.view()
    assert view.reachable == {"apiserver-b"}
    assert freshness(view)[NEW_GV] == discovery.CURRENT


def test_unreachable_backend_is_stale_too(clock, v135, v136):
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    cache.record_success("apiserver-b", v136)
    clock.now += STALE_AFTER
    cache.record_failure(SELF)
    assert not cache.view().backend.reachable
    fresh = freshness(cache.view())
    assert fresh[OLD_GV] == discovery.STALE and fresh[NEW_GV] == discovery.CURRENT


def test_peer_that_never_answered_is_unreachable_from_its_first_failure(clock, v135):
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    cache.record_failure("apiserver-b")
    state = cache.state("apiserver-b")
    assert state.polled and not state.reachable and state.snapshot is None
    assert cache.view().reachable == frozenset()


def test_forgotten_after_forget_after_is_gone_from_index_and_merged(clock, v135, v136):
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    cache.record_success("apiserver-b", v136)
    clock.now += FORGET_AFTER - 1
    cache.record_failure("apiserver-b")
    assert NEW_GV in freshness(cache.view())

    clock.now += 1
    cache.record_failure("apiserver-b")
    view = cache.view()
    assert view.peers["apiserver-b"].snapshot is None
    assert view.capable_peers(SCHED, "v1alpha2", "podgroups") == ()
    assert view.capable_peers("apps", "v1", "deployments") == ()
    assert view.capable_group_version_peers(*NEW_GV) == ()
    assert NEW_GV not in freshness(view)
    assert view.merged() == discovery.merge({SELF: v135})

    # It answers again: its snapshot comes back whole.
    clock.now += 1
    cache.record_success("apiserver-b", v136)
    assert cache.view().capable_group_version_peers(*NEW_GV) == ("apiserver-b",)


# --------------------------------------------------------------------------- membership

def test_removing_the_last_peer_changes_the_merged_view(clock, v135, v136):
    """Upstream §8.4: an empty peer set must invalidate the merged document too."""
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    cache.record_success("apiserver-b", v136)
    view = cache.view()
    render_merged, calls = render(view)
    with_peer, _ = view.document(("aggregated", "v2"), render_merged)
    assert NEW_GV in freshness(view)

    cache.set_peers([])
    after = cache.view()
    assert after.generation == view.generation + 1
    assert after.peers == {} and after.reachable == frozenset() and after.synced
    assert NEW_GV not in freshness(after)
    assert after.merged() == discovery.merge({SELF: v135})
    render_after, calls_after = render(after)
    doc, was_cached = after.document(("aggregated", "v2"), render_after)
    assert not was_cached and doc.etag != with_peer.etag and calls_after == [after.generation]
    assert after.capable_group_version_peers(*NEW_GV) == ()


def test_set_peers_keeps_known_state_and_forgets_removed(clock, v135, v136):
    cache = new_cache(clock, peers=("apiserver-b", "apiserver-c"))
    cache.record_success("apiserver-b", v136)
    cache.record_success("apiserver-c", v136)
    cache.set_peers(["apiserver-b"])
    assert cache.peer_ids() == ("apiserver-b",)
    assert cache.state("apiserver-b").snapshot is v136
    assert cache.state("apiserver-c") is None
    assert cache.view().capable_group_version_peers(*NEW_GV) == ("apiserver-b",)
    cache.set_peers(["apiserver-b", "apiserver-c"])
    assert cache.state("apiserver-c").snapshot is None  # re-added: starts from nothing


# --------------------------------------------------------------------------- routing index

def test_capable_index_covers_resources_subresources_and_group_versions(clock, v135, v136):
    cache = new_cache(clock, peers=("apiserver-c", "apiserver-b"))
    cache.record_success(SELF, v136)  # the backend is never a "capable peer"
    cache.record_success("apiserver-b", v135)
    cache.record_success("apiserver-c", v136)
    view = cache.view()
    assert isinstance(view.capable, Mapping) and isinstance(view.capable_gv, Mapping)
    both = ("apiserver-b", "apiserver-c")  # sorted by server ID
    assert view.capable_peers("", "v1", "pods") == both
    assert view.capable_peers("", "v1", "pods", "exec") == both
    assert view.capable_peers("", "v1", "pods", "nosuch") == ()
    assert view.capable_peers(SCHED, "v1alpha2", "podgroups") == ("apiserver-c",)
    assert view.capable_peers(SCHED, "v1alpha2", "podgroups", "status") == ("apiserver-c",)
    assert view.capable_peers(SCHED, "v1alpha1", "workloads") == ("apiserver-b",)
    assert view.capable_peers("resource.k8s.io", "v1beta2", "devicetaintrules",
                              "status") == ("apiserver-c",)
    assert view.capable_group_version_peers(*OLD_GV) == ("apiserver-b",)
    assert view.capable_group_version_peers(*NEW_GV) == ("apiserver-c",)
    assert view.capable_group_version_peers("apps", "v1") == both
    assert view.capable_group_version_peers("nosuch.io", "v1") == ()
    # Every key is an exact tuple: a lookup is one dict access.
    assert ("", "v1", "pods", "") in view.capable
    assert ("", "v1", "pods", "exec") in view.capable


def test_merged_groups_are_the_groups_routing_knows(clock, v135, v136):
    """Routing sends ``/apis/<g>`` to merged discovery when ``local_groups`` or
    ``capable_group`` has g, without merging: ``merged_group`` must find exactly those
    (a group listed without versions is in neither), also once the peer is unreachable."""
    empty = {"metadata": {"name": "empty.example.com"}, "versions": []}
    widgets = {"metadata": {"name": "widgets.example.com"},
               "versions": [{"version": "v1", "resources": []}]}
    cache = new_cache(clock)
    cache.record_success(SELF, Snapshot(v135.core, (*v135.groups, empty)))
    cache.record_success("apiserver-b", Snapshot(v136.core, (*v136.groups, empty, widgets)))
    views = [cache.view()]
    clock.now += STALE_AFTER + 1
    cache.record_failure("apiserver-b")
    views.append(cache.view())
    assert views[1].reachable == frozenset()
    for view in views:
        routed = (set(view.local_groups) | set(view.capable_group)) - {""}  # "": core
        named = {discovery.group_name(g) for g in view.merged().groups}
        assert {n for n in named if view.merged_group(n) is not None} == routed
        assert "widgets.example.com" in routed and "empty.example.com" not in routed
        assert view.merged_group("empty.example.com") is None


def test_group_version_deleted_everywhere_disappears_after_the_next_polls(clock, v135):
    cache = new_cache(clock)
    cache.record_success(SELF, v135)
    cache.record_success("apiserver-b", v135)
    assert OLD_GV in freshness(cache.view())

    gone = snapshot("1.35", without=OLD_GV)
    clock.now += 5
    cache.record_success("apiserver-b", gone)
    view = cache.view()
    assert freshness(view)[OLD_GV] == discovery.CURRENT  # the backend still serves it
    assert view.capable_group_version_peers(*OLD_GV) == ()

    cache.record_success(SELF, gone)
    view = cache.view()
    assert OLD_GV not in freshness(view)
    assert (SCHED, "v1") in freshness(view)
    assert view.capable_peers(SCHED, "v1alpha1", "workloads") == ()
