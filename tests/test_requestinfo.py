"""RequestInfo parsing: one table row per kube-apiserver rule, each checking the whole result."""

from __future__ import annotations

from urllib.parse import urlencode

import pytest

from mvproxy.requestinfo import RequestInfo, is_long_running, parse_request_info


def res(
    path: str,
    verb: str,
    version: str,
    resource: str,
    *,
    group: str = "",
    ns: str = "",
    name: str = "",
    sub: str = "",
    parts: tuple[str, ...],
) -> RequestInfo:
    """Expected resource request (api_prefix follows from the group)."""
    return RequestInfo(
        is_resource_request=True,
        path=path,
        verb=verb,
        api_prefix="apis" if group else "api",
        api_group=group,
        api_version=version,
        namespace=ns,
        resource=resource,
        subresource=sub,
        name=name,
        parts=parts,
    )


def nonres(path: str, verb: str, prefix: str = "", group: str = "",
           version: str = "") -> RequestInfo:
    """Expected non-resource request."""
    return RequestInfo(False, path, verb, prefix, group, version, "", "", "", "", ())


def case(method: str, path: str, expected: RequestInfo, *, id: str,
         query: dict[str, str] | None = None):
    return pytest.param(method, path, query or {}, expected, id=id)


CASES = [
    # --- core group, cluster-scoped and namespaced -------------------------------------
    case("GET", "/api/v1/nodes", res("/api/v1/nodes", "list", "v1", "nodes", parts=("nodes",)),
         id="core-cluster-collection-GET-is-list"),
    case("GET", "/api/v1/nodes/n1",
         res("/api/v1/nodes/n1", "get", "v1", "nodes", name="n1", parts=("nodes", "n1")),
         id="core-cluster-named-GET-is-get"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         id="namespaced-resource-across-all-namespaces-has-empty-namespace"),
    case("GET", "/api/v1/namespaces/ns/pods",
         res("/api/v1/namespaces/ns/pods", "list", "v1", "pods", ns="ns", parts=("pods",)),
         id="core-namespaced-collection-GET-is-list"),
    case("GET", "/api/v1/namespaces/ns/pods/p",
         res("/api/v1/namespaces/ns/pods/p", "get", "v1", "pods", ns="ns", name="p",
             parts=("pods", "p")),
         id="core-namespaced-named-GET-is-get"),
    # --- named groups --------------------------------------------------------------------
    case("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles/admin",
         res("/apis/rbac.authorization.k8s.io/v1/clusterroles/admin", "get", "v1", "clusterroles",
             group="rbac.authorization.k8s.io", name="admin", parts=("clusterroles", "admin")),
         id="group-cluster-named-GET-is-get"),
    case("GET", "/apis/apps/v1/namespaces/ns/deployments",
         res("/apis/apps/v1/namespaces/ns/deployments", "list", "v1", "deployments", group="apps",
             ns="ns", parts=("deployments",)),
         id="group-namespaced-collection-GET-is-list"),
    case("POST", "/apis/apps/v1beta3/namespaces/ns/deployments",
         res("/apis/apps/v1beta3/namespaces/ns/deployments", "create", "v1beta3", "deployments",
             group="apps", ns="ns", parts=("deployments",)),
         id="POST-is-create"),
    # --- verbs from methods --------------------------------------------------------------
    case("PUT", "/api/v1/namespaces/ns/configmaps/c",
         res("/api/v1/namespaces/ns/configmaps/c", "update", "v1", "configmaps", ns="ns", name="c",
             parts=("configmaps", "c")),
         id="PUT-is-update"),
    case("PATCH", "/api/v1/namespaces/ns/configmaps/c",
         res("/api/v1/namespaces/ns/configmaps/c", "patch", "v1", "configmaps", ns="ns", name="c",
             parts=("configmaps", "c")),
         id="PATCH-is-patch"),
    case("DELETE", "/api/v1/namespaces/ns/configmaps/c",
         res("/api/v1/namespaces/ns/configmaps/c", "delete", "v1", "configmaps", ns="ns", name="c",
             parts=("configmaps", "c")),
         id="DELETE-named-is-delete"),
    case("DELETE", "/api/v1/namespaces/ns/configmaps",
         res("/api/v1/namespaces/ns/configmaps", "deletecollection", "v1", "configmaps", ns="ns",
             parts=("configmaps",)),
         id="DELETE-collection-is-deletecollection"),
    case("DELETE", "/apis/apps/v1/deployments",
         res("/apis/apps/v1/deployments", "deletecollection", "v1", "deployments", group="apps",
             parts=("deployments",)),
         id="DELETE-group-cluster-collection-is-deletecollection"),
    case("DELETE", "/api/v1/namespaces/ns/pods",
         res("/api/v1/namespaces/ns/pods", "deletecollection", "v1", "pods", ns="ns",
             parts=("pods",)),
         query={"fieldSelector": "metadata.name=p"},
         id="DELETE-collection-ignores-fieldSelector-name"),
    case("HEAD", "/api/v1/namespaces/ns/pods/p",
         res("/api/v1/namespaces/ns/pods/p", "get", "v1", "pods", ns="ns", name="p",
             parts=("pods", "p")),
         id="HEAD-named-is-get"),
    case("HEAD", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         id="HEAD-collection-is-list"),
    case("OPTIONS", "/api/v1/pods", res("/api/v1/pods", "", "v1", "pods", parts=("pods",)),
         id="unknown-method-on-resource-has-empty-verb"),
    # --- the namespaces resource ---------------------------------------------------------
    case("GET", "/api/v1/namespaces",
         res("/api/v1/namespaces", "list", "v1", "namespaces", parts=("namespaces",)),
         id="namespaces-collection-has-no-namespace"),
    case("DELETE", "/api/v1/namespaces",
         res("/api/v1/namespaces", "deletecollection", "v1", "namespaces", parts=("namespaces",)),
         id="namespaces-collection-DELETE-is-deletecollection"),
    case("GET", "/api/v1/namespaces/ns",
         res("/api/v1/namespaces/ns", "get", "v1", "namespaces", ns="ns", name="ns",
             parts=("namespaces", "ns")),
         id="namespaces-ns-is-the-namespace-object"),
    case("PUT", "/api/v1/namespaces/ns/status",
         res("/api/v1/namespaces/ns/status", "update", "v1", "namespaces", ns="ns", name="ns",
             sub="status", parts=("namespaces", "ns", "status")),
         id="namespaces-ns-status-is-namespace-subresource"),
    case("PUT", "/api/v1/namespaces/ns/finalize",
         res("/api/v1/namespaces/ns/finalize", "update", "v1", "namespaces", ns="ns", name="ns",
             sub="finalize", parts=("namespaces", "ns", "finalize")),
         id="namespaces-ns-finalize-is-namespace-subresource"),
    # --- subresources --------------------------------------------------------------------
    case("POST", "/api/v1/namespaces/ns/pods/p/exec",
         res("/api/v1/namespaces/ns/pods/p/exec", "create", "v1", "pods", ns="ns", name="p",
             sub="exec", parts=("pods", "p", "exec")),
         id="subresource-pods-exec"),
    case("PUT", "/apis/apps/v1/namespaces/ns/deployments/d/scale",
         res("/apis/apps/v1/namespaces/ns/deployments/d/scale", "update", "v1", "deployments",
             group="apps", ns="ns", name="d", sub="scale", parts=("deployments", "d", "scale")),
         id="subresource-deployments-scale"),
    case("PATCH", "/api/v1/namespaces/ns/pods/p/resize",
         res("/api/v1/namespaces/ns/pods/p/resize", "patch", "v1", "pods", ns="ns", name="p",
             sub="resize", parts=("pods", "p", "resize")),
         id="subresource-pods-resize"),
    case("GET", "/api/v1/namespaces/ns/pods/p/proxy/a/b",
         res("/api/v1/namespaces/ns/pods/p/proxy/a/b", "get", "v1", "pods", ns="ns", name="p",
             sub="proxy", parts=("pods", "p", "proxy", "a", "b")),
         id="subresource-proxy-keeps-extra-parts"),
    # --- legacy verb segments ------------------------------------------------------------
    case("GET", "/api/v1/watch/pods",
         res("/api/v1/watch/pods", "watch", "v1", "pods", parts=("pods",)),
         id="legacy-watch-segment-cluster-wide"),
    case("GET", "/api/v1/watch/namespaces/ns/pods",
         res("/api/v1/watch/namespaces/ns/pods", "watch", "v1", "pods", ns="ns", parts=("pods",)),
         id="legacy-watch-segment-namespaced"),
    case("GET", "/apis/apps/v1/watch/namespaces/ns/deployments/d",
         res("/apis/apps/v1/watch/namespaces/ns/deployments/d", "watch", "v1", "deployments",
             group="apps", ns="ns", name="d", parts=("deployments", "d")),
         id="legacy-watch-segment-named-group"),
    case("GET", "/api/v1/watch/pods",
         res("/api/v1/watch/pods", "watch", "v1", "pods", parts=("pods",)),
         query={"fieldSelector": "metadata.name=p"},
         id="legacy-watch-segment-ignores-fieldSelector-name"),
    case("GET", "/api/v1/proxy/namespaces/ns/pods/p/a/b",
         res("/api/v1/proxy/namespaces/ns/pods/p/a/b", "proxy", "v1", "pods", ns="ns", name="p",
             parts=("pods", "p", "a", "b")),
         id="legacy-proxy-segment-has-no-subresource"),
    case("GET", "/api/v1/watch", res("/api/v1/watch", "get", "v1", "", parts=()),
         id="legacy-verb-segment-alone-is-resource-request-without-resource"),
    # --- watch from the query ------------------------------------------------------------
    case("GET", "/api/v1/pods", res("/api/v1/pods", "watch", "v1", "pods", parts=("pods",)),
         query={"watch": "true"}, id="list-with-watch-true-is-watch"),
    case("GET", "/api/v1/namespaces/ns/pods",
         res("/api/v1/namespaces/ns/pods", "watch", "v1", "pods", ns="ns",
             parts=("pods",)),
         query={"watch": "1"}, id="list-with-watch-1-is-watch"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "watch", "v1", "pods", parts=("pods",)),
         query={"watch": ""}, id="list-with-empty-watch-is-watch"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         query={"watch": "FALSE"}, id="list-with-watch-false-any-case-is-list"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         query={"watch": "0"}, id="list-with-watch-0-is-list"),
    case("GET", "/api/v1/namespaces/ns/pods/p",
         res("/api/v1/namespaces/ns/pods/p", "get", "v1", "pods", ns="ns",
             name="p", parts=("pods", "p")),
         query={"watch": "true"}, id="named-get-ignores-watch-query"),
    # --- fieldSelector metadata.name -----------------------------------------------------
    case("GET", "/api/v1/namespaces/ns/pods",
         res("/api/v1/namespaces/ns/pods", "list", "v1", "pods", ns="ns",
             name="p1", parts=("pods",)),
         query={"fieldSelector": "metadata.name=p1"}, id="fieldSelector-metadata-name-sets-name"),
    case("GET", "/api/v1/pods",
         res("/api/v1/pods", "watch", "v1", "pods", name="p1", parts=("pods",)),
         query={"watch": "true", "fieldSelector": "metadata.name==p1"},
         id="fieldSelector-double-equals-on-watch-sets-name"),
    case("GET", "/api/v1/pods",
         res("/api/v1/pods", "list", "v1", "pods", name="p1", parts=("pods",)),
         query={"fieldSelector": "status.phase=Running,metadata.name=p1"},
         id="fieldSelector-name-inside-conjunction-sets-name"),
    case("GET", "/api/v1/pods",
         res("/api/v1/pods", "list", "v1", "pods", name="a", parts=("pods",)),
         query={"fieldSelector": "metadata.name=b,metadata.name=a"},
         id="fieldSelector-first-sorted-name-term-wins"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         query={"fieldSelector": "metadata.name!=p1"}, id="fieldSelector-not-equal-sets-no-name"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         query={"fieldSelector": "spec.nodeName=n1"}, id="fieldSelector-other-field-sets-no-name"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "watch", "v1", "pods", parts=("pods",)),
         query={"fieldSelector": "metadata.name=p1,foo", "watch": "true"},
         id="fieldSelector-invalid-term-sets-no-name-but-keeps-watch"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         query={"fieldSelector": "metadata.name=a=b"},
         id="fieldSelector-unescaped-equals-sets-no-name"),
    case("GET", "/api/v1/pods",
         res("/api/v1/pods", "list", "v1", "pods", name="a,b", parts=("pods",)),
         query={"fieldSelector": "metadata.name=a\\,b"},
         id="fieldSelector-escaped-comma-is-unescaped"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         query={"fieldSelector": "metadata.name=a/b"},
         id="fieldSelector-name-with-slash-is-not-a-name"),
    case("GET", "/api/v1/pods", res("/api/v1/pods", "list", "v1", "pods", parts=("pods",)),
         query={"fieldSelector": "metadata.name=.."}, id="fieldSelector-dotdot-is-not-a-name"),
    case("GET", "/api/v1/namespaces/ns/pods/p",
         res("/api/v1/namespaces/ns/pods/p", "get", "v1", "pods", ns="ns",
             name="p", parts=("pods", "p")),
         query={"fieldSelector": "metadata.name=other"},
         id="fieldSelector-ignored-when-path-has-name"),
    # --- discovery and other non-resource paths ------------------------------------------
    case("GET", "/api", nonres("/api", "get", "api"), id="discovery-api-root"),
    case("GET", "/api/v1", nonres("/api/v1", "get", "api", "", "v1"), id="discovery-core-version"),
    case("GET", "/apis", nonres("/apis", "get", "apis"), id="discovery-apis-root"),
    case("GET", "/apis/apps", nonres("/apis/apps", "get", "apis", "apps"), id="discovery-group"),
    case("GET", "/apis/apps/v1", nonres("/apis/apps/v1", "get", "apis", "apps", "v1"),
         id="discovery-group-version-keeps-group-and-version"),
    case("GET", "/apis/apps/v1/", nonres("/apis/apps/v1/", "get", "apis", "apps", "v1"),
         id="discovery-group-version-trailing-slash"),
    case("GET", "/apis/", nonres("/apis/", "get", "apis"), id="discovery-apis-root-trailing-slash"),
    case("GET", "/openapi/v3/apis/apps/v1", nonres("/openapi/v3/apis/apps/v1", "get"),
         id="openapi-v3-group-version-is-non-api-path"),
    case("GET", "/healthz", nonres("/healthz", "get"), id="healthz-is-non-resource"),
    case("GET", "/version", nonres("/version", "get"), id="version-is-non-resource"),
    case("HEAD", "/", nonres("/", "head"), id="root-is-non-resource-with-lowercased-method"),
    case("POST", "", nonres("", "post"), id="empty-path-is-non-resource"),
    case("GET", "/badprefix/v1/pods", nonres("/badprefix/v1/pods", "get"),
         id="unknown-prefix-is-non-resource"),
    case("GET", "/apis/v1/pods", nonres("/apis/v1/pods", "get", "apis", "v1", "pods"),
         id="apis-without-group-is-discovery-shaped"),
    # --- slashes ---------------------------------------------------------------------------
    case("GET", "/api/v1/namespaces/ns/pods/",
         res("/api/v1/namespaces/ns/pods/", "list", "v1", "pods", ns="ns", parts=("pods",)),
         id="trailing-slash-is-ignored"),
    case("GET", "//api/v1/pods//", res("//api/v1/pods//", "list", "v1", "pods", parts=("pods",)),
         id="repeated-leading-and-trailing-slashes-are-ignored"),
    case("GET", "/api/v1//pods",
         res("/api/v1//pods", "get", "v1", "", name="pods", parts=("", "pods")),
         id="inner-double-slash-is-an-empty-segment-like-kube"),
    case("GET", "/apis/apps/v1/namespaces//deployments",
         res("/apis/apps/v1/namespaces//deployments", "list", "v1", "deployments", group="apps",
             parts=("deployments",)),
         id="empty-namespace-segment-gives-empty-namespace"),
]


@pytest.mark.parametrize("query_form", ["mapping", "string"])
@pytest.mark.parametrize(("method", "path", "query", "expected"), CASES)
def test_parse_request_info(method, path, query, expected, query_form):
    q = query if query_form == "mapping" else urlencode(query)
    assert parse_request_info(method, path, q) == expected


def test_query_defaults_to_empty():
    assert parse_request_info("GET", "/api/v1/pods").verb == "list"


@pytest.mark.parametrize(
    ("query", "verb", "name"),
    [
        pytest.param("watch=1&watch=0", "watch", "", id="first-value-wins"),
        pytest.param("w%61tch=true", "watch", "", id="percent-encoded-key-is-decoded"),
        pytest.param("watch", "watch", "", id="bare-key-is-empty-value-so-watch"),
        pytest.param("watch=1;x=y", "list", "", id="pair-with-semicolon-is-skipped"),
        pytest.param("watch=%zz", "list", "", id="pair-with-bad-escape-is-skipped"),
        pytest.param("limit=500&resourceVersion=0", "list", "", id="unrelated-keys-fast-path"),
        pytest.param("fieldSelector=metadata.name%3Dp1", "list", "p1",
                     id="encoded-selector-is-decoded"),
        pytest.param("fieldSelector=metadata.name=a+b", "list", "a b", id="plus-is-space"),
    ],
)
def test_raw_query_string_parsing(query, verb, name):
    info = parse_request_info("GET", "/api/v1/pods", query)
    assert (info.verb, info.name) == (verb, name)


def test_request_info_is_immutable():
    info = parse_request_info("GET", "/api/v1/pods")
    with pytest.raises(AttributeError):
        info.verb = "get"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        pytest.param("GET", "/api/v1/pods", "watch=true", True, id="watch-via-query"),
        pytest.param("GET", "/api/v1/watch/namespaces/ns/pods", "", True,
                     id="watch-via-legacy-segment"),
        pytest.param("GET", "/api/v1/pods", "watch=false", False, id="plain-list"),
        pytest.param("GET", "/api/v1/namespaces/ns/pods/p", "", False, id="plain-get"),
        pytest.param("POST", "/api/v1/namespaces/ns/pods/p/exec", "command=sh", True, id="exec"),
        pytest.param("POST", "/api/v1/namespaces/ns/pods/p/attach", "", True, id="attach"),
        pytest.param("POST", "/api/v1/namespaces/ns/pods/p/portforward", "", True,
                     id="portforward"),
        pytest.param("GET", "/api/v1/namespaces/ns/services/s/proxy/x", "", True,
                     id="proxy-subresource"),
        pytest.param("GET", "/api/v1/proxy/namespaces/ns/pods/p", "", True, id="legacy-proxy-verb"),
        pytest.param("GET", "/api/v1/namespaces/ns/pods/p/log", "follow=true", True,
                     id="log-follow-true"),
        pytest.param("GET", "/api/v1/namespaces/ns/pods/p/log", "follow=1&container=c", True,
                     id="log-follow-1"),
        pytest.param("GET", "/api/v1/namespaces/ns/pods/p/log", "follow=false", True,
                     id="log-follow-false"),
        pytest.param("GET", "/api/v1/namespaces/ns/pods/p/log", "tailLines=10", True,
                     id="log-without-follow"),
        pytest.param("GET", "/api/v1/namespaces/ns/pods/p/status", "follow=true", False,
                     id="status-is-not"),
        pytest.param("GET", "/debug/pprof/profile", "seconds=30", True, id="pprof-non-resource"),
        pytest.param("GET", "/healthz", "watch=true", False, id="non-resource-never-watch"),
    ],
)
def test_is_long_running(method, path, query, expected):
    """As kube-apiserver: ``BasicLongRunningRequestCheck`` (staging/src/k8s.io/apiserver/
    pkg/server/filters/longrunning.go) with verbs {watch, proxy} and subresources
    {attach, exec, log, portforward, proxy} (pkg/controlplane/apiserver/config.go)."""
    assert is_long_running(parse_request_info(method, path, query)) is expected
