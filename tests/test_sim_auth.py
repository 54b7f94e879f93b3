"""The simulated API server's identity rules, over real TLS on 127.0.0.1.

A tiny app (request-info middleware, then auth_middleware, then a handler echoing the
user) is served with the sim's TLS setup: trusting the cluster CA and the front-proxy
CA, client certificates optional.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mvproxy.devcluster.simauth import (
    REQUEST_INFO,
    USER,
    AuditLog,
    Authenticator,
    UserInfo,
    audit_id_on_prepare,
    auth_middleware,
    load_token_file,
)
from mvproxy.devpki import init_pki
from mvproxy.errors import ConfigError, UsageError
from mvproxy.requestinfo import parse_request_info
from mvproxy.tls import client_context, server_context

SERVER_ID = "sim-a"
TOKENS = ('admin-token,alice,uid-alice,"system:masters,dev"\n'
          "viewer-token,vera,uid-vera,viewer\n"
          "plain-token,paul,uid-paul\n")


# --------------------------------------------------------------------------- PKI


def _issue(directory: Path, ca_stem: str, stem: str, cn: str, orgs: tuple[str, ...] = ()) -> None:
    """A client certificate ``stem.crt|key`` signed by ``ca_stem.crt|key``."""
    ca_cert = x509.load_pem_x509_certificate((directory / f"{ca_stem}.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / f"{ca_stem}.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([*(x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs),
                         x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.now(timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (directory / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{stem}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("simauth") / "pki"
    init_pki(directory, [SERVER_ID])
    _issue(directory, "ca", "bob", "bob", ("viewer", "team-b"))
    _issue(directory, "ca", "carol", "carol")
    _issue(directory, "front-proxy-ca", "intruder", "intruder")
    (directory / "tokens.csv").write_text(TOKENS)
    return directory


def _client_cert(pki: Path, name: str) -> tuple[Path, Path]:
    paths = {"admin": ("admin.crt", "admin.key"),
             "front-proxy": (f"{SERVER_ID}/front-proxy-client.crt",
                             f"{SERVER_ID}/front-proxy-client.key")}
    crt, key = paths.get(name, (f"{name}.crt", f"{name}.key"))
    return pki / crt, pki / key


# --------------------------------------------------------------------------- the app


async def _echo_user(request: web.Request) -> web.Response:
    user = request[USER]
    return web.json_response({"name": user.name, "uid": user.uid, "groups": list(user.groups),
                              "extra": {k: list(v) for k, v in user.extra.items()}})


@web.middleware
async def _request_info(request: web.Request, handler: Any) -> web.StreamResponse:
    request[REQUEST_INFO] = parse_request_info(request.method, request.path,
                                                 request.query_string)
    return await handler(request)


def _server_ssl(pki: Path) -> ssl.SSLContext:
    ctx = server_context(pki / SERVER_ID / "apiserver.crt", pki / SERVER_ID / "apiserver.key",
                         pki / "ca.crt")
    ctx.load_verify_locations(pki / "front-proxy-ca.crt")
    return ctx


@pytest.fixture
def audit_path(tmp_path: Path) -> Path:
    return tmp_path / "audit.log"


@pytest.fixture
async def base_url(pki: Path, audit_path: Path, aiohttp_server: Any) -> Any:
    authn = Authenticator.from_files(pki / "ca.crt", pki / "front-proxy-ca.crt",
                                     pki / "tokens.csv")
    audit = AuditLog(audit_path)
    app = web.Application(middlewares=[_request_info, auth_middleware(authn, audit)])
    app.on_response_prepare.append(audit_id_on_prepare)
    app.router.add_route("*", "/{tail:.*}", _echo_user)
    server = await aiohttp_server(app, ssl=_server_ssl(pki))
    yield f"https://127.0.0.1:{server.port}"
    audit.close()


async def call(base_url: str, pki: Path, method: str, path: str, *, cert: str | None = None,
               token: str | None = None, headers: dict[str, str] | None = None,
               ) -> tuple[int, dict[str, Any], Any]:
    """(status, response headers, JSON body) of one request over mutual TLS."""
    crt, key = _client_cert(pki, cert) if cert else (None, None)
    ctx = client_context(pki / "ca.crt", crt, key)
    hdrs = dict(headers or {})
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        async with session.request(method, base_url + path, headers=hdrs) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)


# --------------------------------------------------------------------------- authentication


async def test_cluster_ca_client_cert_is_user_cn_with_groups_o(base_url: str, pki: Path) -> None:
    status, _, body = await call(base_url, pki, "GET", "/api/v1/pods", cert="bob")
    assert status == 200
    assert body["name"] == "bob"
    assert body["groups"] == ["viewer", "team-b", "system:authenticated"]


async def test_admin_cert_is_system_masters(base_url: str, pki: Path) -> None:
    status, _, body = await call(base_url, pki, "POST", "/api/v1/namespaces/default/pods",
                                 cert="admin")
    assert status == 200
    assert body["name"] == "kubernetes-admin"
    assert "system:masters" in body["groups"]


async def test_token_from_csv_file_gives_user_uid_and_groups(base_url: str, pki: Path) -> None:
    status, _, body = await call(base_url, pki, "GET", "/api/v1/pods", token="admin-token")
    assert status == 200
    assert body == {"name": "alice", "uid": "uid-alice", "extra": {},
                    "groups": ["system:masters", "dev", "system:authenticated"]}


async def test_bad_token_is_401_even_on_public_paths(base_url: str, pki: Path) -> None:
    for path in ("/api/v1/pods", "/healthz"):
        status, _, body = await call(base_url, pki, "GET", path, token="nope")
        assert status == 401, path
        assert body["kind"] == "Status"
        assert (body["reason"], body["message"], body["code"]) == \
            ("Unauthorized", "Unauthorized", 401)


async def test_no_credentials_is_403_on_api_and_200_on_public_paths(
        base_url: str, pki: Path) -> None:
    """kube-apiserver's default --anonymous-auth: no credentials is system:anonymous on
    every path, which RBAC lets read only the public ones; the rest is 403, not 401
    (as measured against kube-apiserver 1.35 and 1.36, tests/realk8s_replay.py)."""
    status, _, body = await call(base_url, pki, "GET", "/api")
    assert status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == 'forbidden: User "system:anonymous" cannot get path "/api"'
    assert body["details"] == {}
    for path in ("/healthz", "/livez", "/readyz", "/version"):
        status, _, body = await call(base_url, pki, "GET", path)
        assert status == 200, path
        assert body["name"] == "system:anonymous"
        assert body["groups"] == ["system:unauthenticated"]


async def test_front_proxy_cert_with_x_remote_headers_is_that_user(
        base_url: str, pki: Path) -> None:
    headers = {"X-Remote-User": "dora", "X-Remote-Extra-Scopes%2FA": "s1"}
    hdrs = list(headers.items()) + [("X-Remote-Group", "viewer"), ("X-Remote-Group", "b,c")]
    crt, key = _client_cert(pki, "front-proxy")
    ctx = client_context(pki / "ca.crt", crt, key)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        async with session.get(base_url + "/api/v1/pods", headers=hdrs) as resp:
            assert resp.status == 200
            body = await resp.json()
    assert body["name"] == "dora"
    # each header value is one group (no comma splitting), as in kube
    assert body["groups"] == ["viewer", "b,c", "system:authenticated"]
    assert body["extra"] == {"scopes/a": ["s1"]}


async def test_front_proxy_cert_without_x_remote_user_is_401(base_url: str, pki: Path) -> None:
    """kube: requestheader does not apply and the cert is not from the client CA."""
    status, _, _ = await call(base_url, pki, "GET", "/api", cert="front-proxy")
    assert status == 401


async def test_cluster_ca_user_cert_sending_x_remote_user_is_ignored(
        base_url: str, pki: Path) -> None:
    status, _, body = await call(base_url, pki, "GET", "/api/v1/pods", cert="bob",
                                 headers={"X-Remote-User": "kubernetes-admin",
                                          "X-Remote-Group": "system:masters"})
    assert status == 200
    assert body["name"] == "bob"
    assert "system:masters" not in body["groups"]


async def test_front_proxy_cert_with_cn_not_allowed_has_headers_ignored(
        base_url: str, pki: Path) -> None:
    headers = {"X-Remote-User": "kubernetes-admin", "X-Remote-Group": "system:masters"}
    status, _, body = await call(base_url, pki, "GET", "/api/v1/pods", cert="intruder",
                                 headers=headers)
    assert status == 401
    # with a valid token the request is the token's user, not the asserted one
    status, _, body = await call(base_url, pki, "GET", "/api/v1/pods", cert="intruder",
                                 headers=headers, token="viewer-token")
    assert status == 200
    assert body["name"] == "vera"


# --------------------------------------------------------------------------- authorization


async def test_viewer_may_list_but_gets_403_with_kube_message_on_create(
        base_url: str, pki: Path) -> None:
    status, _, _ = await call(base_url, pki, "GET", "/api/v1/namespaces/default/pods",
                              cert="bob")
    assert status == 200
    status, _, body = await call(base_url, pki, "POST", "/api/v1/namespaces/default/pods",
                                 cert="bob")
    assert status == 403
    assert body["reason"] == "Forbidden"
    assert body["message"] == ('pods is forbidden: User "bob" cannot create resource "pods" '
                               'in API group "" in the namespace "default"')
    assert body["details"] == {"kind": "pods"}


async def test_forbidden_message_names_object_group_and_cluster_scope(
        base_url: str, pki: Path) -> None:
    status, _, body = await call(base_url, pki, "DELETE", "/apis/rbac.authorization.k8s.io/v1/"
                                 "clusterroles/edit", cert="bob")
    assert status == 403
    assert body["message"] == (
        'clusterroles.rbac.authorization.k8s.io "edit" is forbidden: User "bob" cannot '
        'delete resource "clusterroles" in API group "rbac.authorization.k8s.io" '
        'at the cluster scope')


async def test_websocket_exec_by_viewer_needs_create(base_url: str, pki: Path) -> None:
    status, _, body = await call(base_url, pki, "GET",
                                 "/api/v1/namespaces/default/pods/p/exec?command=ls",
                                 cert="bob")
    assert status == 403
    assert 'cannot create resource "pods/exec"' in body["message"]


async def test_authenticated_user_may_read_discovery_but_not_other_paths(
        base_url: str, pki: Path) -> None:
    for path in ("/api", "/apis/apps/v1", "/version", "/openapi/v3"):
        status, _, _ = await call(base_url, pki, "GET", path, cert="carol")
        assert status == 200, path
    status, _, body = await call(base_url, pki, "GET", "/metrics", cert="carol")
    assert status == 403
    assert body["message"] == 'forbidden: User "carol" cannot get path "/metrics"'
    status, _, _ = await call(base_url, pki, "GET", "/metrics", cert="bob")  # viewer
    assert status == 200


# --------------------------------------------------------------------------- impersonation


async def test_impersonation_by_master_is_allowed_and_audited(
        base_url: str, pki: Path, audit_path: Path) -> None:
    status, _, body = await call(base_url, pki, "GET", "/api/v1/pods", cert="admin",
                                 headers={"Impersonate-User": "erin",
                                          "Impersonate-Group": "viewer",
                                          "Impersonate-Extra-Reason": "debug"})
    assert status == 200
    assert body["name"] == "erin"
    assert body["groups"] == ["viewer", "system:authenticated"]
    assert body["extra"] == {"reason": ["debug"]}
    event = json.loads(audit_path.read_text().splitlines()[-1])
    assert event["user"]["username"] == "kubernetes-admin"
    assert event["impersonatedUser"]["username"] == "erin"


async def test_impersonation_by_viewer_is_403(base_url: str, pki: Path) -> None:
    status, _, body = await call(base_url, pki, "GET", "/api/v1/pods", cert="bob",
                                 headers={"Impersonate-User": "kubernetes-admin"})
    assert status == 403
    assert body["message"] == ('users "kubernetes-admin" is forbidden: User "bob" cannot '
                               'impersonate resource "users" in API group "" '
                               'at the cluster scope')


async def test_impersonated_user_is_authorized_as_itself(base_url: str, pki: Path) -> None:
    status, _, body = await call(base_url, pki, "POST", "/api/v1/namespaces/default/pods",
                                 cert="admin", headers={"Impersonate-User": "erin"})
    assert status == 403
    assert 'User "erin" cannot create' in body["message"]


# --------------------------------------------------------------------------- audit


async def test_audit_line_has_user_groups_verb_uri_code_and_peer_proxied(
        base_url: str, pki: Path, audit_path: Path) -> None:
    status, headers, _ = await call(
        base_url, pki, "GET", "/api/v1/namespaces/default/pods?limit=5", token="viewer-token",
        headers={"x-kubernetes-peer-proxied": "true", "Audit-ID": "abc-123",
                 "User-Agent": "kubectl/v1.36.3"})
    assert status == 200
    assert headers["Audit-Id"] == "abc-123"
    lines = audit_path.read_text().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["kind"] == "Event" and event["apiVersion"] == "audit.k8s.io/v1"
    assert event["level"] == "Metadata" and event["stage"] == "ResponseComplete"
    assert event["auditID"] == "abc-123"
    assert event["user"] == {"username": "vera", "uid": "uid-vera",
                             "groups": ["viewer", "system:authenticated"]}
    assert event["verb"] == "list"
    assert event["requestURI"] == "/api/v1/namespaces/default/pods?limit=5"
    assert event["responseStatus"]["code"] == 200
    assert event["objectRef"] == {"resource": "pods", "namespace": "default",
                                  "apiVersion": "v1"}
    assert event["peerProxied"] == "true"
    assert event["annotations"]["mvproxy.io/peer-proxied"] == "true"
    assert event["sourceIPs"] == ["127.0.0.1"]
    assert event["userAgent"] == "kubectl/v1.36.3"
    assert "viewer-token" not in lines[0]


async def test_audit_records_denials_and_generates_ids(
        base_url: str, pki: Path, audit_path: Path) -> None:
    _, h401, _ = await call(base_url, pki, "GET", "/api", token="wrong-token")
    _, h403, _ = await call(base_url, pki, "POST", "/api/v1/namespaces/default/pods",
                            cert="bob")
    events = [json.loads(line) for line in audit_path.read_text().splitlines()]
    assert [e["responseStatus"]["code"] for e in events] == [401, 403]
    assert events[0]["user"] == {}
    assert events[0]["peerProxied"] is None
    assert "wrong-token" not in audit_path.read_text()
    assert events[1]["annotations"]["authorization.k8s.io/decision"] == "forbid"
    assert [e["auditID"] for e in events] == [h401["Audit-Id"], h403["Audit-Id"]]
    assert h401["Audit-Id"] != h403["Audit-Id"]


# --------------------------------------------------------------------------- token file


def test_token_file_with_malformed_line_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text("good,alice,1\n\nbad,bob\n")
    with pytest.raises(ConfigError) as err:
        load_token_file(path)
    assert f"{path}:3" in str(err.value)
    assert "at least 3 columns" in str(err.value)


def test_token_file_groups_are_optional_and_empty_tokens_skipped(tmp_path: Path) -> None:
    path = tmp_path / "tokens.csv"
    path.write_text(',nobody,0\nt1, alice, 1, "a,b"\nt2,bob,2\n')
    tokens = load_token_file(path)
    assert tokens == {"t1": UserInfo("alice", "1", ("a", "b")), "t2": UserInfo("bob", "2")}


def test_missing_ca_file_is_a_clear_error(tmp_path: Path, pki: Path) -> None:
    from mvproxy.errors import PKIError

    with pytest.raises(PKIError, match="missing.crt"):
        Authenticator.from_files(tmp_path / "missing.crt", pki / "front-proxy-ca.crt")


# --------------------------------------------------------------------------- audit log path


def test_unwritable_audit_log_is_a_clear_startup_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    path = blocker / "audit.log"
    with pytest.raises(UsageError) as err:
        AuditLog(path)
    assert str(err.value).startswith(f"cannot open audit log {path}:")
    assert err.value.exit_code == 2


def test_audit_log_is_opened_at_startup(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    audit = AuditLog(path)
    try:
        assert path.exists()  # before any request
        audit.write({"a": 1})
        assert json.loads(path.read_text()) == {"a": 1}
    finally:
        audit.close()


def test_sim_with_unwritable_audit_log_exits_2_with_one_message(
        tmp_path: Path, pki: Path) -> None:
    path = tmp_path / "missing-dir" / "audit.log"
    done = subprocess.run(
        [sys.executable, "-m", "mvproxy", "sim", "--server-id", SERVER_ID, "--pki", str(pki),
         "--secure-port", "1", "--store", str(tmp_path / "s.db"),
         "--audit-log-path", str(path)],
        capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        f"mvproxy: error: cannot open audit log {path}: No such file or directory"]


@pytest.mark.parametrize(("forwarded_for", "real_ip", "remote", "expected"), [
    ("", "", "127.0.0.1", ["127.0.0.1"]),
    ("127.0.0.2", "", "127.0.0.1", ["127.0.0.2", "127.0.0.1"]),
    ("127.0.0.2, 127.0.0.1", "", "127.0.0.1", ["127.0.0.2", "127.0.0.1"]),
    ("127.0.0.1, 127.0.0.2", "", "127.0.0.1", ["127.0.0.1", "127.0.0.2", "127.0.0.1"]),
    ("not-an-ip, 127.0.0.2,, ", "", "127.0.0.1", ["127.0.0.2", "127.0.0.1"]),
    ("127.0.0.2", "127.0.0.2", "127.0.0.1", ["127.0.0.2", "127.0.0.1"]),
    ("127.0.0.2", "127.0.0.3", "127.0.0.1", ["127.0.0.2", "127.0.0.3", "127.0.0.1"]),
    ("", "garbage", "127.0.0.1", ["127.0.0.1"]),
    ("127.000.000.002", "", "::ffff:127.0.0.1", ["127.0.0.2", "127.0.0.1"]),
    ("fe80::1%eth0, ::1", "", "::1", ["::1"]),
    ("1" * 5000 + ".1.1.1", "", "127.0.0.1", ["127.0.0.1"]),
])
def test_source_ips_as_kube_apiserver_computes_them(forwarded_for, real_ip, remote, expected):
    """kube's ``SourceIPs`` (staging/src/k8s.io/apimachinery/pkg/util/net/http.go): valid
    ``X-Forwarded-For`` entries, then ``X-Real-Ip`` unless listed, then the connection's
    address unless it is already the last entry."""
    from mvproxy.devcluster.simauth import source_ips

    assert source_ips(forwarded_for, real_ip, remote) == expected
