"""The merged OpenAPI v3 index: kubectl apply -f of a peer-only kind must validate."""

import gzip
import json
from pathlib import Path

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


# --------------------------------------------------------------------------- documents
# A group/version both servers serve, only the newer with more in it: real 1.35.4 and
# 1.36.3 admissionregistration.k8s.io/v1 (tests/data/real-discovery/README.md).

REAL = Path(__file__).resolve().parent / "data" / "real-discovery"
ADMISSION = "admissionregistration.k8s.io"
MAP_PATHS = {"/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies",
             "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies/{name}",
             "/apis/admissionregistration.k8s.io/v1/watch/mutatingadmissionpolicies",
             "/apis/admissionregistration.k8s.io/v1/watch/mutatingadmissionpolicies/{name}"}


def real_document(release: str) -> bytes:
    return gzip.decompress((REAL / f"openapi-{ADMISSION}-v1-{release}.json.gz").read_bytes())


def _refs(node) -> set[str]:
    return set(openapi._refs(node))


def test_a_real_old_document_gains_the_new_servers_resources_and_keeps_its_own():
    old, new = real_document("1.35.4"), real_document("1.36.3")
    peer_only = {("mutatingadmissionpolicies", ""), ("mutatingadmissionpolicybindings", "")}
    merged = json.loads(openapi.merge_document(old, new, ADMISSION, "v1", peer_only))
    own, theirs = json.loads(old), json.loads(new)
    # Every path of the new server's is there: its own, the old one's, nothing else.
    assert set(merged["paths"]) == set(theirs["paths"])
    assert MAP_PATHS <= set(merged["paths"]) - set(own["paths"])
    for path, item in own["paths"].items():
        assert merged["paths"][path] == item, path  # the backend's own, unchanged
    schemas = merged["components"]["schemas"]
    for name, schema in own["components"]["schemas"].items():
        assert schemas[name] == schema, name  # shared schemas stay the backend's
    kinds = {tuple(g.values()) for s in schemas.values()
             for g in s.get("x-kubernetes-group-version-kind", ())}
    assert (ADMISSION, "MutatingAdmissionPolicy", "v1") in kinds  # what kubectl explain finds
    assert _refs(merged) <= set(schemas), _refs(merged) - set(schemas)  # every $ref resolves
    # Only what the added paths need: 1.36's ListMeta refers to ShardInfo, 1.35's does not.
    assert "io.k8s.apimachinery.pkg.apis.meta.v1.ShardInfo" not in schemas
    assert (merged["openapi"], merged["info"]) == (own["openapi"], own["info"])


def test_only_paths_of_what_only_peers_serve_are_added():
    def document(paths: dict, schemas: dict) -> bytes:
        return json.dumps({"openapi": "3.0.0", "paths": paths,
                           "components": {"schemas": schemas}}).encode()

    ref = {"$ref": "#/components/schemas/Pod"}
    backend = document({"/api/v1/namespaces/{namespace}/pods/{name}": {"get": ref}},
                       {"Pod": {"description": "old"}})
    peer = document({
        "/api/v1/namespaces/{namespace}/pods/{name}": {"get": ref},
        "/api/v1/namespaces/{namespace}/pods/{name}/resize": {"patch": ref},
        "/api/v1/namespaces/{namespace}/pods/{name}/ephemeralcontainers": {"patch": {
            "$ref": "#/components/schemas/Other"}},
        "/api/v1/widgets": {"get": {"$ref": "#/components/schemas/Widget"}},
    }, {"Pod": {"description": "new"}, "Other": {}, "Widget": {
        "properties": {"part": {"$ref": "#/components/schemas/Part"}}}, "Part": {}})
    merged = json.loads(openapi.merge_document(
        backend, peer, "", "v1", {("pods", "resize"), ("widgets", "")}))
    assert set(merged["paths"]) == {"/api/v1/namespaces/{namespace}/pods/{name}",
                                    "/api/v1/namespaces/{namespace}/pods/{name}/resize",
                                    "/api/v1/widgets"}
    assert merged["components"]["schemas"] == {"Pod": {"description": "old"}, "Widget": {
        "properties": {"part": {"$ref": "#/components/schemas/Part"}}}, "Part": {}}
    # Nothing to add: the backend's bytes as they are; not documents: None.
    assert openapi.merge_document(backend, backend, "", "v1", {("widgets", "")}) is backend
    for bad in (b"nope", b"[]", b'{"paths": {}}', b'{"paths": [], "components": {}}'):
        assert openapi.merge_document(backend, bad, "", "v1", {("widgets", "")}) is None


def test_the_index_entry_of_a_merged_document_loses_the_backends_hash():
    """1.36's resource.k8s.io/v1beta2 has devicetaintrules/status, 1.35's does not."""
    body = json.dumps({"paths": {
        "apis/resource.k8s.io/v1beta2": {
            "serverRelativeURL": "/openapi/v3/apis/resource.k8s.io/v1beta2?hash=CC"},
        "api/v1": {"serverRelativeURL": "/openapi/v3/api/v1?hash=AA"}}}).encode()
    paths = json.loads(openapi.merge_index(body, view_with_peer()))["paths"]
    assert paths["apis/resource.k8s.io/v1beta2"] == {
        "serverRelativeURL": "/openapi/v3/apis/resource.k8s.io/v1beta2"}
    assert paths["api/v1"]["serverRelativeURL"] == "/openapi/v3/api/v1?hash=AA"
    down = json.loads(openapi.merge_index(body, view_with_peer(reachable=False)))["paths"]
    assert down["apis/resource.k8s.io/v1beta2"]["serverRelativeURL"].endswith("?hash=CC")
