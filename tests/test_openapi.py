"""The merged OpenAPI v3 index: kubectl apply -f of a peer-only kind must validate."""

import json

from mvproxy import openapi
from mvproxy.cache import DiscoveryCache
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.discoverydocs import aggregated
from mvproxy.discovery import Snapshot


def snapshot(version: str) -> Snapshot:
    catalog = load_catalog(version)
    return Snapshot(core=aggregated(catalog, core=True)["items"],
                    groups=aggregated(catalog, core=False)["items"])


def view_with_peer(reachable: bool = True):
    clock = [0.0]
    cache = DiscoveryCache("a", ["b"], stale_after=10, forget_after=100, clock=lambda: clock[0])
    cache.record_success("a", snapshot("1.35"))
    cache.record_success("b", snapshot("1.36"))
    if not reachable:
        clock[0] = 20
        cache.record_failure("b")
    return cache.view()


def index_body() -> bytes:
    return json.dumps({"paths": {
        "api/v1": {"serverRelativeURL": "/openapi/v3/api/v1?hash=AA"},
        "apis/scheduling.k8s.io/v1": {
            "serverRelativeURL": "/openapi/v3/apis/scheduling.k8s.io/v1?hash=BB"},
    }}).encode()


def test_peer_only_group_versions_are_added_and_backend_entries_kept_verbatim():
    merged = json.loads(openapi.merge_index(index_body(), view_with_peer()))
    paths = merged["paths"]
    assert paths["apis/scheduling.k8s.io/v1alpha2"] == {
        "serverRelativeURL": "/openapi/v3/apis/scheduling.k8s.io/v1alpha2"}
    assert paths["api/v1"]["serverRelativeURL"] == "/openapi/v3/api/v1?hash=AA"


def test_group_versions_of_unreachable_peers_are_not_advertised():
    merged = json.loads(openapi.merge_index(index_body(), view_with_peer(reachable=False)))
    assert "apis/scheduling.k8s.io/v1alpha2" not in merged["paths"]


def test_a_body_that_is_not_an_index_is_left_to_the_backend():
    assert openapi.merge_index(b"not json", view_with_peer()) is None
    assert openapi.merge_index(b'{"kind": "Status"}', view_with_peer()) is None
