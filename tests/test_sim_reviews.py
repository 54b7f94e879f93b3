"""Access and identity reviews (issue 13): ``kubectl auth can-i`` and ``kubectl auth
whoami`` with real kubectl 1.20 (JSON, no metadata.name) and 1.36 (protobuf bodies),
through an mvproxy and through the ``-direct`` context, answered by the simulator's own
authorizer; plus the protobuf decoding of the review kinds and what hostile bodies get.

The module fixture starts a two-server demo cluster (1.35, 1.36) on loopback and stops
it at teardown. Nothing here skips.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
from conftest import kubectl_env
from e2e_support import request
from kubectl import kubectl_binary

from mvproxy.devcluster import protobuf
from mvproxy.devcluster.demo import DemoCluster, start_cluster

SID = "apiserver-0"
CONTEXTS = (SID, f"{SID}-direct")
VERSIONS = ("1.20", "1.36")
ADMIN_USER = "kubernetes-admin"
VIEWER_USER = "demo-viewer"
SSAR = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
SAR = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
SSR = "/apis/authentication.k8s.io/v1/selfsubjectreviews"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    with start_cluster(tmp_path_factory.mktemp("reviews"), ["1.35", "1.36"],
                       base_port=0) as running:
        yield running


@pytest.fixture(scope="module", params=VERSIONS)
def kc(request: pytest.FixtureRequest, cluster: DemoCluster,
       tmp_path_factory: pytest.TempPathFactory):
    """``kc(*args, context=..., user=None)`` runs the real kubectl of ``request.param``."""
    binary = kubectl_binary(request.param)
    env = kubectl_env(tmp_path_factory.mktemp("kubectl-home"))
    cache = tmp_path_factory.mktemp("kubectl-cache")

    def run(*args: str, context: str, user: str | None = None
            ) -> subprocess.CompletedProcess[str]:
        cmd = [str(binary), "--kubeconfig", str(cluster.kubeconfig), "--cache-dir",
               str(cache), "--context", context, *(["--user", user] if user else []), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env,
                              stdin=subprocess.DEVNULL, check=False)

    run.version = request.param  # type: ignore[attr-defined]
    return run


def _answer(done: subprocess.CompletedProcess[str]) -> tuple[str, int]:
    return done.stdout.strip(), done.returncode


# --- kubectl auth can-i ------------------------------------------------------------


@pytest.mark.parametrize("context", CONTEXTS)
def test_can_i_admin_yes_viewer_no(kc, context: str) -> None:
    """1.20 used to get 422 (name required), 1.3x 415 (protobuf body)."""
    done = kc("auth", "can-i", "create", "pods", context=context)
    assert _answer(done) == ("yes", 0), done.stderr
    done = kc("auth", "can-i", "create", "pods", context=context, user="viewer-token")
    assert _answer(done) == ("no", 1), done.stderr
    done = kc("auth", "can-i", "list", "pods", "-n", "default", context=context,
              user="viewer-token")
    assert _answer(done) == ("yes", 0), done.stderr


@pytest.mark.parametrize("context", CONTEXTS)
def test_can_i_matches_what_the_viewer_then_meets(kc, context: str) -> None:
    """The answer comes from the same policy as real requests: "no" means 403."""
    done = kc("auth", "can-i", "delete", "configmaps", "-n", "default", context=context,
              user="viewer-token")
    assert _answer(done) == ("no", 1), done.stderr
    done = kc("delete", "configmap", "nothing-here", "-n", "default", context=context,
              user="viewer-token")
    assert done.returncode == 1 and "forbidden" in done.stderr.lower(), done.stderr


@pytest.mark.parametrize("context", CONTEXTS)
def test_can_i_as_impersonated_user(kc, context: str) -> None:
    done = kc("auth", "can-i", "list", "configmaps", "-n", "default", "--as=jane",
              "--as-group=viewer", context=context)
    assert _answer(done) == ("yes", 0), done.stderr
    done = kc("auth", "can-i", "list", "configmaps", "-n", "default", "--as=jane",
              context=context)
    assert _answer(done) == ("no", 1), done.stderr


@pytest.mark.parametrize("context", CONTEXTS)
def test_can_i_non_resource_url(kc, context: str) -> None:
    assert _answer(kc("auth", "can-i", "get", "/healthz", context=context,
                      user="viewer-token")) == ("yes", 0)


@pytest.mark.parametrize("context", CONTEXTS)
def test_can_i_list_rules(kc, context: str) -> None:
    """SelfSubjectRulesReview: the viewer's read rule and the basic-user reviews."""
    done = kc("auth", "can-i", "--list", "-n", "default", context=context,
              user="viewer-token")
    assert done.returncode == 0, done.stderr
    assert "selfsubjectaccessreviews.authorization.k8s.io" in done.stdout
    assert "[get list watch]" in done.stdout


# --- kubectl auth whoami (1.26+) --------------------------------------------------


@pytest.mark.parametrize("context", CONTEXTS)
def test_whoami(kc, context: str) -> None:
    if kc.version == "1.20":  # the command came in 1.26: nothing to ask the server
        done = kc("auth", "whoami", context=context)
        assert done.returncode != 0 and "whoami" in done.stderr, done.stderr
        return
    done = kc("auth", "whoami", "-o", "json", context=context)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)["status"]["userInfo"]
    assert info["username"] == ADMIN_USER
    assert "system:masters" in info["groups"] and "system:authenticated" in info["groups"]
    done = kc("auth", "whoami", "-o", "json", context=context, user="viewer-token")
    info = json.loads(done.stdout)["status"]["userInfo"]
    assert (info["username"], info["uid"]) == (VIEWER_USER, "demo-viewer-uid")
    assert info["groups"] == ["viewer", "system:authenticated"]


# --- SubjectAccessReview (admin only) ---------------------------------------------


def _sar(user: str, groups: list[str], verb: str) -> dict:
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": groups, "resourceAttributes": {
                "verb": verb, "resource": "pods", "namespace": "default"}}}


@pytest.mark.parametrize("direct", (False, True))
def test_subject_access_review(cluster: DemoCluster, direct: bool) -> None:
    got = request(cluster, SID, "POST", SAR, body=_sar("bob", ["viewer"], "list"),
                  direct=direct)
    assert got.status == 201, got
    status = got.json()["status"]
    assert status["allowed"] is True and 'Group "viewer"' in status["reason"]
    got = request(cluster, SID, "POST", SAR, body=_sar("bob", ["viewer"], "create"),
                  direct=direct)
    assert got.status == 201 and got.json()["status"] == {"allowed": False}, got
    # No implied groups: a SubjectAccessReview asks about exactly the subject given.
    got = request(cluster, SID, "POST", SAR, body=_sar("bob", [], "get"), direct=direct)
    assert got.json()["status"] == {"allowed": False}, got


@pytest.mark.parametrize("direct", (False, True))
def test_subject_access_review_needs_create_permission(cluster: DemoCluster,
                                                       direct: bool) -> None:
    got = request(cluster, SID, "POST", SAR, body=_sar("bob", ["system:masters"], "get"),
                  cert=None, token=cluster.tokens["viewer-token"], direct=direct)
    assert got.status == 403, got
    assert 'cannot create resource "subjectaccessreviews"' in got.json()["message"]


def test_reviews_refuse_anonymous_and_bad_specs(cluster: DemoCluster) -> None:
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"verb": "get", "resource": "pods"}}}
    # system:basic-user is bound to system:authenticated only: anonymous gets 403
    assert request(cluster, SID, "POST", SSAR, body=body, cert=None).status == 403
    assert request(cluster, SID, "POST", SSR, body={}, cert=None).status == 403
    for spec in ({}, {"resourceAttributes": {"verb": "get"},
                      "nonResourceAttributes": {"path": "/", "verb": "get"}},
                 {"resourceAttributes": "pods"}):
        got = request(cluster, SID, "POST", SSAR, body={**body, "spec": spec})
        assert got.status == 422, got
    got = request(cluster, SID, "POST", SAR, body={**_sar("", [], "get")})
    assert got.status == 422 and "at least one of user or group" in got.json()["message"]
    got = request(cluster, SID, "POST", SAR, body=_sar("bob", "viewer", "get"))  # type: ignore[arg-type]
    assert got.status == 422, got


def test_reviews_are_not_stored(cluster: DemoCluster) -> None:
    body = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "metadata": {"name": "kept?"},
            "spec": {"resourceAttributes": {"verb": "get", "resource": "pods"}}}
    assert request(cluster, SID, "POST", SSAR, body=body).status == 201
    assert request(cluster, SID, "GET", SSAR + "/kept%3F").status == 405


# --- protobuf ----------------------------------------------------------------------


def _key(number: int, wire: int) -> bytes:
    return bytes([number << 3 | wire])


def _ld(number: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return _key(number, 2) + bytes([len(payload)]) + payload


def _envelope(api_version: str, kind: str, raw: bytes) -> bytes:
    type_meta = _ld(1, api_version.encode()) + _ld(2, kind.encode())
    return protobuf.MAGIC + _ld(1, type_meta) + _ld(2, raw)


def test_protobuf_self_subject_access_review() -> None:
    attrs = (_ld(1, b"default") + _ld(2, b"create") + _ld(5, b"pods")
             + _ld(8, _ld(1, b"metadata.name=x")))
    body = _envelope("authorization.k8s.io/v1", "SelfSubjectAccessReview",
                     _ld(1, b"") + _ld(2, _ld(1, attrs)))
    assert protobuf.decode(body) == {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {
            "namespace": "default", "verb": "create", "resource": "pods",
            "fieldSelector": {"rawSelector": "metadata.name=x"}}}}


def test_protobuf_subject_access_review_extra_and_self_subject_review() -> None:
    extra = _ld(5, _ld(1, b"scopes") + _ld(2, _ld(1, b"a") + _ld(1, b"b")))
    spec = (_ld(2, _ld(1, b"/healthz") + _ld(2, b"get")) + _ld(3, b"bob")
            + _ld(4, b"g1") + _ld(4, b"g2") + extra + _ld(6, b"u-1"))
    doc = protobuf.decode(_envelope("authorization.k8s.io/v1", "SubjectAccessReview",
                                    _ld(2, spec)))
    assert doc["spec"] == {"nonResourceAttributes": {"path": "/healthz", "verb": "get"},
                           "user": "bob", "groups": ["g1", "g2"],
                           "extra": {"scopes": ["a", "b"]}, "uid": "u-1"}
    ssr = protobuf.decode(_envelope("authentication.k8s.io/v1", "SelfSubjectReview",
                                    _ld(1, b"")))
    assert ssr == {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}


@pytest.mark.parametrize("raw", [
    _key(2, 0) + b"\x05",  # spec as a varint
    _ld(2, _key(1, 0) + b"\x07"),  # resourceAttributes as a varint
    _ld(2, _ld(5, b"\x01")),  # an extra entry that is not a message
    _ld(2, _ld(5, _key(1, 0) + b"\x01")),  # an extra key that is not a string
    _ld(2, _ld(1, _ld(2, b"\xff\xfe"))),  # a verb that is not UTF-8
])
def test_protobuf_hostile_review_bodies_are_clear_errors(raw: bytes) -> None:
    with pytest.raises(protobuf.ProtobufError):
        protobuf.decode(_envelope("authorization.k8s.io/v1", "SubjectAccessReview", raw))


@pytest.mark.parametrize("envelope", [
    _key(1, 0) + b"\x05",  # typeMeta as a varint
    _ld(1, _ld(1, b"authorization.k8s.io/v1") + _ld(2, b"SubjectAccessReview"))
    + _key(2, 0) + b"\x05",  # the object as a varint
])
def test_protobuf_hostile_envelopes_are_clear_errors(envelope: bytes) -> None:
    with pytest.raises(protobuf.ProtobufError):
        protobuf.decode(protobuf.MAGIC + envelope)


def test_hostile_protobuf_review_over_http_is_415_not_500(cluster: DemoCluster) -> None:
    for raw in (_key(2, 0) + b"\x05", _ld(2, _ld(5, b"\x01")), _ld(2, b"\x80")):
        got = _post_raw(cluster, SSAR, _envelope("authorization.k8s.io/v1",
                                                  "SelfSubjectAccessReview", raw))
        assert got[0] in (400, 415), got


def _post_raw(cluster: DemoCluster, path: str, body: bytes) -> tuple[int, bytes]:
    import http.client

    from e2e_support import tls_context

    port = cluster.server(SID).backend_port
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10,
                                       context=tls_context(cluster))
    try:
        conn.request("POST", path, body=body, headers={
            "Content-Type": protobuf.CONTENT_TYPE,
            "Accept": "application/vnd.kubernetes.protobuf, application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_protobuf_review_answer_is_json(cluster: DemoCluster) -> None:
    """kubectl accepts protobuf or JSON: the sim answers JSON, which kubectl decodes."""
    attrs = _ld(2, b"get") + _ld(5, b"pods")
    status, raw = _post_raw(cluster, SSAR, _envelope(
        "authorization.k8s.io/v1", "SelfSubjectAccessReview", _ld(2, _ld(1, attrs))))
    assert status == 201, raw
    assert json.loads(raw)["status"]["allowed"] is True


