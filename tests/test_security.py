"""What an unauthenticated client can make the daemon do: reproductions from the
security issue, each against the assembled daemon over real TLS sockets.

Requests are written byte for byte (``Cluster.raw``), because the attacks are
requests no well-behaved client library would send. A *canary* listener on another
loopback port stands for "any host:port": the daemon must never connect to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import shutil
import socket
import ssl
from datetime import datetime, timedelta, timezone
from pathlib import Path

import daemon_support
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID
from daemon_support import (
    PEER_ID,
    PODGROUPS,
    Cluster,
    body_of,
    cluster,
    fake_server,
    ready,
    status_of,
)
from pki_support import issue

from mvproxy import devpki, discoveryhandler, identity, tls
from mvproxy.errors import UpstreamProtocolError
from mvproxy.listener import DownstreamConnection

WAIT_SECONDS = 10


class Canary:
    """A TCP listener that counts the connections it gets (it should get none)."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Canary:
        async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self.server = await asyncio.start_server(count, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def request(target: str, *, method: str = "GET", version: str = "HTTP/1.1",
            headers: str = "", body: bytes = b"") -> bytes:
    return (f"{method} {target} {version}\r\nHost: mvproxy\r\n{headers}\r\n").encode() + body



# --------------------------------------------------------------------------- open proxy

OFF_ORIGIN_TARGETS = {
    "absolute-form http": "http://127.0.0.1:{port}/debug/mvproxy",
    "absolute-form https": "https://127.0.0.1:{port}/api/v1/namespaces",
    "scheme-relative path": "//127.0.0.1:{port}/api/v1/namespaces",
    "scheme-relative, no port": "//127.0.0.1/api",
}


@pytest.mark.parametrize("who", ["bearer", "admin"], ids=["anonymous", "cert user"])
@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("shape", list(OFF_ORIGIN_TARGETS))
async def test_a_target_naming_another_host_is_refused_and_never_dialled(
        aiohttp_server, root, shape, method, who):
    async with Canary() as canary, cluster(aiohttp_server, root) as c:
        await ready(c)
        target = OFF_ORIGIN_TARGETS[shape].format(port=canary.port)
        body = b'{"kind":"ConfigMap"}'
        answer = await c.raw(request(target, method=method, body=body if method == "POST" else b"",
                                     headers=f"Content-Length: {len(body)}\r\n"
                                     if method == "POST" else ""), who=who)
        assert status_of(answer) == 400, answer[:300]
        status = body_of(answer)
        assert status["kind"] == "Status" and status["reason"] == "BadRequest"
        assert canary.connections == 0
        assert c.seen == {"backend": [], "peer": []}


@pytest.mark.parametrize("raw, expected", [
    (request("*", method="OPTIONS"), 400),
    (request("127.0.0.1:9443", method="CONNECT"), 400),
    (b"GET /api/v1/namespaces\r\n\r\n", 400),
    (request("/api/v1/namespaces", version="HTTP/2.0"), 505),
    (request("/api/v1/namespaces", version="HTTP/1.2"), 400),
], ids=["asterisk-form", "authority-form CONNECT", "HTTP/0.9", "HTTP/2.0 as text",
        "unknown minor version"])
async def test_targets_and_versions_mvproxy_does_not_speak_are_refused(aiohttp_server, root,
                                                                        raw, expected):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        answer = await c.raw(raw)
        assert status_of(answer) == expected, answer[:300]
        assert c.seen == {"backend": [], "peer": []}


async def test_a_path_starting_with_two_slashes_is_400_not_a_traceback(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        answer = await c.raw(request("//api//v1//namespaces"))
        assert status_of(answer) == 400
        assert "must not start with '//'" in body_of(answer)["message"]
        assert b"Traceback" not in answer


@pytest.mark.parametrize("target", [
    "/api//v1//namespaces",
    "/api/v1/namespaces/default/../../../healthz",
    "/api/v1/namespaces/%2e%2e/pods",
])
async def test_paths_are_not_normalised(aiohttp_server, root, target):
    """``..`` and inner ``//`` reach the backend as sent; the backend decides."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        answer = await c.raw(request(target))
        assert status_of(answer) == 200
        assert body_of(answer)["path"] == target
        assert c.seen["backend"] == [("GET", target)]


@pytest.mark.parametrize("coding, refused_with", [
    ("gzip, chunked", {501}),
    # Without a final chunked the body length is unknowable: the parser may refuse first.
    ("identity", {400, 501}), ("deflate", {400, 501}), ("chunked, chunked", {400, 501}),
    # llhttp refuses these only once the head is complete: the head reached the backend.
    ("chunked\t", {400}), (" chunked\t ", {400}),
])
async def test_transfer_codings_other_than_chunked_are_refused(aiohttp_server, root, coding,
                                                               refused_with):
    """Today ``gzip, chunked`` silently reached the backend without its body."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        status, _, _ = await c.get("/api/v1/namespaces/warm")  # pooled: sent by callbacks
        assert status == 200
        c.seen["backend"].clear()
        answer = await c.raw(request("/api/v1/namespaces/default/configmaps", method="POST",
                                     headers=f"Transfer-Encoding: {coding}\r\n",
                                     body=b"3\r\nabc\r\n0\r\n\r\n"))
        assert status_of(answer) in refused_with, answer[:300]
        assert c.seen == {"backend": [], "peer": []}


async def test_header_names_with_underscores_are_dropped(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        for path in ("/api/v1/namespaces", PODGROUPS):  # the backend, then the peer
            answer = await c.raw(request(path, headers="X_Remote_User: system:admin\r\n"
                                                       "X_Remote_Group: system:masters\r\n"
                                                       "Accept_Language: x\r\n"), who="bearer")
            assert status_of(answer) == 200
            names = {name.lower() for name, _ in body_of(answer)["headers"]}
            assert not any("_" in name for name in names), names


# --------------------------------------------------------------------------- anonymous


@pytest.mark.parametrize("who, headers, presented", [
    ("bearer", "", None),
    ("bearer", "Authorization: Bearer t0ken\r\n", None),
    ("admin", "", "front-proxy-client"),
], ids=["no credentials", "bearer token", "certificate user"])
async def test_the_front_proxy_certificate_goes_only_with_an_asserted_identity(
        aiohttp_server, root, who, headers, presented):
    """Anonymous and token requests reach the backend with no client certificate, so
    its own anonymous and token rules apply (kube-apiserver fails a front-proxy
    certificate without X-Remote-User with 401 before trying anonymous)."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        for path in ("/healthz", "/api/v1/namespaces"):
            answer = await c.raw(request(path, headers=headers), who=who)
            assert status_of(answer) == 200
            echoed = body_of(answer)
            assert echoed["server"] == "backend" and echoed["cn"] == presented


async def test_a_peer_hop_without_an_asserted_user_stays_anonymous(aiohttp_server, root):
    """At the peer's mvproxy: a peer-proxied request carrying no X-Remote-User (the
    original client was anonymous or used a token) goes to the backend without the
    front-proxy certificate too."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        answer = await c.raw(request(PODGROUPS, headers="x-kubernetes-peer-proxied: true\r\n"
                                                        "Authorization: Bearer t0ken\r\n"),
                             who="peer")
        echoed = body_of(answer)
        assert echoed["server"] == "backend" and echoed["cn"] is None
        answer = await c.raw(request(PODGROUPS, headers="x-kubernetes-peer-proxied: true\r\n"
                                                        "X-Remote-User: alice\r\n"), who="peer")
        echoed = body_of(answer)
        assert echoed["server"] == "backend" and echoed["cn"] == "front-proxy-client"


# --------------------------------------------------------------------------- what only peers serve

PEER_ONLY = {  # the fake backend is 1.35, the fake peer 1.36
    "resource": PODGROUPS,
    "group version": "/apis/scheduling.k8s.io/v1alpha2",
    "OpenAPI of a group version": "/openapi/v3/apis/scheduling.k8s.io/v1alpha2",
}
NOBODY = "/apis/nothing.example.com/v1/namespaces/default/widgets"
UPGRADE = "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n" \
          "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


async def _anonymous(c: Cluster, path: str) -> list[tuple[int, str]]:
    """(status, answering server) of the same request without credentials, sent the
    ways that reach the engine differently: three on one keep-alive connection (the
    later ones on an idle pooled upstream connection) and one upgrade (a tunnel)."""
    answers = []
    for _ in range(3):
        status, _, body = await c.get(path, who="bearer")
        answers.append((status, json.loads(body).get("server", "")))
    raw = await c.raw(request(path, headers=UPGRADE), who="bearer")
    answers.append((status_of(raw), body_of(raw).get("server", "")))
    return answers


@pytest.mark.parametrize("what", list(PEER_ONLY))
async def test_without_credentials_what_only_peers_serve_is_answered_by_the_backend(
        aiohttp_server, root, what):
    """Issue 19: an anonymous request for what only a peer serves went to the peer (a
    slower refusal, an oracle for what peers serve). Now the backend answers it exactly
    as it answers something nobody serves, and the peer sees nothing; a token (even a
    junk one) or a certificate user still reaches the peer."""
    path = PEER_ONLY[what]
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        # First with credentials: they reach the peer, and leave pooled connections to it.
        status, _, body = await c.get(path, who="bearer",
                                      headers={"Authorization": "Bearer junk"})
        assert (status, json.loads(body)["server"]) == (200, "peer")
        status, _, body = await c.get(path, who="admin")
        assert (status, json.loads(body)["server"]) == (200, "peer")
        assert c.seen["peer"] == [("GET", path)] * 2
        nobody = await _anonymous(c, NOBODY)
        assert nobody == [(200, "backend")] * 4, nobody
        assert await _anonymous(c, path) == nobody
        assert c.seen["peer"] == [("GET", path)] * 2  # nothing more
        assert c.seen["backend"].count(("GET", path)) == 4
        assert await c.metric("apiserver_rerouted_request_total", code="200",
                              group="scheduling.k8s.io", version="v1alpha2") == 2


async def test_without_credentials_unreachable_peers_are_not_a_503(aiohttp_server, root):
    """The 503 "served only by peers that are unreachable" names what peers serve: a
    request without credentials gets the backend's answer instead, while one with a
    token still gets the 503 (mvproxy cannot tell a junk token from a real one), which
    names the peers only to a client with a verified certificate."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        c.health["discovery"] = False  # the peer's polls fail: unreachable after staleAfter

        async def peer_down() -> bool:
            return not (await c.debug())["peers"][PEER_ID]["reachable"]
        await c.until(peer_down, "the peer marked unreachable")
        for path in PEER_ONLY.values():
            assert await _anonymous(c, path) == await _anonymous(c, NOBODY), path
            status, _, body = await c.get(path, who="bearer",
                                          headers={"Authorization": "Bearer junk"})
            assert status == 503
            assert b"served only by peers that are unreachable now" in body
            assert PEER_ID.encode() not in body  # a token mvproxy cannot check: no names
        assert c.seen["peer"] == []
        assert await c.metric("apiserver_peer_proxy_errors_total",
                              type="endpoint_resolution", resource="podgroups") == 1


PEER_GROUP = {"metadata": {"name": "peeronly.example.io"}, "versions": [{
    "version": "v1", "freshness": "Current", "resources": [{
        "resource": "widgets", "scope": "Namespaced", "singularResource": "widget",
        "responseKind": {"group": "", "version": "", "kind": "Widget"},
        "verbs": ["get", "list"]}]}]}


def deadline_before_authentication(app) -> None:
    """``/apis/<g>`` as kube-apiserver's filter chain answers it: a bad ``timeout`` is a
    400 before authentication (``WithRequestDeadline``), then anonymous gets 403."""
    async def group(request):
        timeout = request.query.get("timeout")
        if timeout is not None and not timeout.endswith("s"):
            return web.json_response({"kind": "Status", "code": 400,
                                      "message": "invalid timeout"}, status=400)
        if "Authorization" not in request.headers:
            return web.json_response({"kind": "Status", "code": 403, "message": "forbidden"},
                                     status=403)
        return web.json_response({"kind": "Status", "code": 404}, status=404)
    app.router.add_get("/apis/{group}", group)


async def test_a_group_only_peers_serve_is_refused_like_an_unknown_one_whatever_the_query(
        aiohttp_server, root):
    """Review of issue 19: the authorization probe for ``GET /apis/<g>`` dropped the
    client's query, so ``?timeout=x`` got 403 for a group some server serves and 400
    (the backend's own check, before authentication) for an unknown one."""
    async with cluster(aiohttp_server, root, backend_routes=deadline_before_authentication,
                       peer_groups=[PEER_GROUP]) as c:
        await ready(c)
        for query in ("", "?timeout=x", "?timeout=5s"):
            known = await c.raw(request(f"/apis/peeronly.example.io{query}"), who="bearer")
            unknown = await c.raw(request(f"/apis/nothing.example.io{query}"), who="bearer")
            assert status_of(known) == status_of(unknown) != 200, query
        assert ("GET", "/apis/peeronly.example.io?timeout=x") in c.seen["backend"]


@pytest.mark.parametrize("authorization", [
    ["x"], ["Basic YTpi"], ["Bearer"], ["", "Bearer junk"]],
    ids=["no scheme", "basic", "no token", "a second field"])
async def test_what_kube_reads_as_anonymous_counts_as_no_credentials(
        aiohttp_server, root, authorization):
    """Review of issue 19: any non-empty ``Authorization`` counted as a token, though
    kube-apiserver reads only the first field, and only ``Bearer <token>``: such a
    request reached the peer as anonymous, an oracle at no cost."""
    headers = "".join(f"Authorization: {value}\r\n" for value in authorization)
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        answer = await c.raw(request(PODGROUPS, headers=headers), who="bearer")
        assert body_of(answer)["server"] == "backend"
        assert c.seen["peer"] == []


# --------------------------------------------------------------------------- peer trust


def client_cert_context(root: Path, directory: Path, *cns: str, ca: str = "ca",
                        orgs: tuple[str, ...] = ()) -> ssl.SSLContext:
    """A TLS client context presenting a new certificate from ``root``'s CA ``ca``
    with the given CNs in order (what the CSR API or a careless CA could issue)."""
    ca_cert = x509.load_pem_x509_certificate((root / f"{ca}.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((root / f"{ca}.key").read_bytes(),
                                                password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn) for cn in cns]
                        + [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs])
    now = datetime.now(timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .sign(ca_key, hashes.SHA256()))
    cert_file, key_file = directory / "client.crt", directory / "client.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return tls.client_context(root / "ca.crt", cert_file, key_file)


CLAIMS = ("x-kubernetes-peer-proxied: true\r\nX-Remote-User: system:admin\r\n"
          "X-Remote-Group: system:masters\r\n")


async def test_a_user_certificate_named_like_a_peer_cannot_claim_users(aiohttp_server, root,
                                                                        tmp_path):
    """The cluster CA signs users; one named front-proxy-client (the CSR API can issue
    it) is that user, not a peer: its X-Remote-* claims are replaced, not believed."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        c.contexts["csr"] = client_cert_context(root, tmp_path, devpki.FRONT_PROXY_CLIENT_CN)
        answer = await c.raw(request(PODGROUPS, headers=CLAIMS), who="csr")
        echoed = body_of(answer)
        assert echoed["server"] == "peer"  # routed as a user's request, not kept local
        claimed = {(k.lower(), v) for k, v in echoed["headers"]}
        assert ("x-remote-user", devpki.FRONT_PROXY_CLIENT_CN) in claimed
        assert ("x-remote-user", "system:admin") not in claimed
        assert ("x-remote-group", "system:masters") not in claimed


@pytest.mark.parametrize("ca, cns", [
    ("front-proxy-ca", ("front-proxy-client", "alice")),
    ("front-proxy-ca", ("alice", "front-proxy-client")),
    ("ca", ("alice", "kubernetes-admin")),
], ids=["peer name first", "peer name last", "user certificate"])
async def test_a_certificate_with_several_common_names_gets_401(aiohttp_server, root, tmp_path,
                                                                ca, cns):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        c.contexts["odd"] = client_cert_context(root, tmp_path, *cns, ca=ca)
        answer = await c.raw(request("/api/v1/namespaces", headers=CLAIMS), who="odd")
        assert status_of(answer) == 401, answer[:300]
        assert "more than one common name" in body_of(answer)["message"]
        assert c.seen == {"backend": [], "peer": []}


# --------------------------------------------------------------------------- review findings


async def test_a_pipelining_flood_is_cut_off(aiohttp_server, root):
    """Thousands of tiny requests in one write, never reading: at most a bounded number
    is parsed ahead, then 400 and the connection ends; others are served meanwhile."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        answer = await c.raw(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n" * 5000, who="bearer")
        statuses = [int(s) for s in answer.split(b"HTTP/1.1 ")[1:] for s in [s[:3]]]
        assert len(statuses) <= 40 and statuses[-1] == 400, statuses[-3:]
        assert len(c.seen["backend"]) <= 40
        status, _, _ = await c.get("/api/v1/namespaces")
        assert status == 200


async def test_an_endless_header_is_cut_off_at_max_header_bytes(aiohttp_server, root):
    """llhttp reports a header only once it ends: the head is counted as it arrives."""
    async with cluster(aiohttp_server, root, listener={"maxHeaderBytes": 4096}) as c:
        await ready(c)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", c.port, ssl=c.contexts["bearer"], server_hostname="127.0.0.1")
        writer.write(b"GET /version HTTP/1.1\r\nX-Big: ")
        sent = 0
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while sent < 4 * 1024 * 1024:  # far beyond the limit, never ending the header
                writer.write(b"a" * 16384)
                await writer.drain()
                sent += 16384
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert status_of(answer) == 431  # before the header ended: it never does


async def test_too_many_header_fields_get_431(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        fields = "".join(f"x{i}: a\r\n" for i in range(1100))
        assert status_of(await c.raw(request("/version", headers=fields))) == 431


async def test_a_body_the_probe_does_not_send_is_not_announced(aiohttp_server, root):
    """Discovery answers probe the backend without the client's body: announcing its
    Content-Length made the backend read the next client's request as that body."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        body = b"x" * 40
        for _ in range(3):
            await c.raw(request("/apis", headers="Accept: application/json;g=apidiscovery.k8s.io"
                                                 ";v=v2;as=APIGroupDiscoveryList\r\n"
                                                 f"Content-Length: {len(body)}\r\n", body=body),
                        who="bearer")
        answer = await c.raw(request("/api/v1/namespaces/victim"), who="bearer")
        assert status_of(answer) == 200
        assert ("GET", "/api/v1/namespaces/victim") in c.seen["backend"]


async def test_an_upgrade_with_a_body_is_refused(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        answer = await c.raw(request("/api/v1/namespaces/x", headers="Connection: Upgrade\r\n"
                                     "Upgrade: websocket\r\nContent-Length: 5\r\n", body=b"hello"))
        assert status_of(answer) == 400
        assert c.seen == {"backend": [], "peer": []}


async def test_request_trailers_are_not_forwarded(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        smuggle = (b"POST /api/v1/namespaces/default/secrets HTTP/1.1\r\nHost: x\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n"
                   b"X_Remote_Group: system:masters\r\nX-Remote-User: root\r\n\r\n")
        assert status_of(await c.raw(smuggle, who="bearer")) == 200
        echoed = body_of(await c.raw(request("/api/v1/namespaces/victim"), who="bearer"))
        names = {k.lower() for k, _ in echoed["headers"]}
        assert not names & {"x_remote_group", "x-remote-user", "x-remote-group"}


def reading_create(app: web.Application) -> None:
    async def create(request: web.Request) -> web.Response:
        return web.json_response({"read": len(await request.read())}, status=201)
    app.router.add_post("/api/v1/namespaces/default/secrets", create)


async def test_a_body_that_stops_arriving_gets_408(aiohttp_server, root):
    async with cluster(aiohttp_server, root, listener={"headerReadTimeout": "500ms"},
                       backend_routes=reading_create) as c:
        await ready(c)
        answer = await c.raw(request("/api/v1/namespaces/default/secrets", method="POST",
                                     headers="Content-Length: 100\r\n", body=b"0123456789"))
        assert status_of(answer) == 408
        assert "no request body byte" in body_of(answer)["message"]


async def test_connect_is_refused_whatever_its_target(aiohttp_server, root):
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        answer = await c.raw(request("/api/v1/namespaces", method="CONNECT"))
        assert status_of(answer) == 405
        assert c.seen == {"backend": [], "peer": []}


# --------------------------------------------------------------------------- discovery probes

AGGREGATED = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"


def probes(c: Cluster) -> list[str]:
    return [auth for what, auth in c.seen["backend"] if what == "PROBE /apis"]


async def test_a_discovery_yes_is_remembered_briefly_per_credentials(aiohttp_server, root):
    """Merged discovery asks the backend first with the client's credentials; a yes is
    reused for the same credentials (10 s), a new token is asked about again."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        for token in ("alpha", "alpha", "alpha", "beta"):
            answer = await c.raw(request("/apis", headers=f"Accept: {AGGREGATED}\r\n"
                                                          f"Authorization: Bearer {token}\r\n"),
                                 who="bearer")
            assert status_of(answer) == 200
        assert probes(c) == ["Bearer alpha", "Bearer beta"]


async def test_connection_tokens_are_read_alike_by_both_header_filters(aiohttp_server, root):
    """Only space and tab surround a Connection token: with ``\\xa0authorization`` the
    text filter (discovery probes) dropped Authorization and the bytes filter (the hot
    path) kept it, so a probe went out without the credentials it was cached under."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        odd = b"Connection: keep-alive, \xa0authorization\r\nAuthorization: Bearer gamma\r\n"
        answer = await c.raw(b"GET /apis HTTP/1.1\r\nHost: x\r\nAccept: "
                             + AGGREGATED.encode() + b"\r\n" + odd + b"\r\n", who="bearer")
        assert status_of(answer) == 200
        assert probes(c) == ["Bearer gamma"]
        echoed = body_of(await c.raw(b"GET /api/v1/namespaces/x HTTP/1.1\r\nHost: x\r\n" + odd
                                     + b"\r\n", who="bearer"))
        assert ["Authorization", "Bearer gamma"] in echoed["headers"]


# --------------------------------------------------------------------------- second review


def slow_route(app: web.Application) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.json_response({"server": "backend", "path": request.raw_path})
    app.router.add_get("/api/v1/namespaces/slow", slow)


async def test_pipelined_answers_keep_their_order_while_the_client_reads_nothing(
        aiohttp_server, root):
    """Requests that arrived while mvproxy waited for the client to read each queued a
    start of their own: once it read, they ran at once and a fast answer overtook a slow
    one (and a watch among them outlived the connection). One at a time, in order."""
    async with cluster(aiohttp_server, root, backend_routes=slow_route) as c:
        await ready(c)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", c.port))
        reader, writer = await asyncio.open_connection(
            sock=sock, ssl=c.contexts["admin"], server_hostname="127.0.0.1")
        try:
            # Whole discovery documents, answered at once, until the socket is full. Eight
            # at a time, each batch parsed before the next is sent: requests of one read
            # wait for llhttp's verdict on all of it, and a read may hold at most
            # MAX_PIPELINED of them.
            downstream = await _connection_of(c, sock.getsockname())
            filler = request("/apis", headers=f"Accept: {AGGREGATED}\r\n")
            answered = await _discovery_answers(c)
            for _ in range(25):
                writer.write(filler * 8)
                await writer.drain()
                answered += 8
                await c.until(lambda answered=answered: _at_least(c, answered, downstream),
                              "the batch answered, or the socket full")
                if downstream.paused_writing:
                    break
            else:
                pytest.fail("200 discovery documents did not fill the socket")
            writer.write(request("/api/v1/namespaces/slow"))
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(request("/api/v1/namespaces/fast"))
            await writer.drain()
            received = bytearray()
            async with asyncio.timeout(WAIT_SECONDS):
                while b'"/api/v1/namespaces/fast"' not in received:
                    chunk = await reader.read(1 << 20)
                    assert chunk, "the connection closed early"
                    received += chunk
        finally:
            writer.close()
        order = re.findall(rb'"path": "(/api/v1/namespaces/\w+)"', bytes(received))
        assert order == [b"/api/v1/namespaces/slow", b"/api/v1/namespaces/fast"]


async def _connection_of(c: Cluster, client: tuple) -> DownstreamConnection:
    """The daemon's side of the client connection from address ``client``."""
    found: list[DownstreamConnection] = []

    def peer(conn: DownstreamConnection) -> object:
        with contextlib.suppress(AttributeError):  # a closed TLS transport has no socket
            if not conn.closing and conn.transport is not None:
                return conn.transport.get_extra_info("peername")
        return None

    async def accepted() -> bool:
        found[:] = [conn for conn in gc.get_objects()
                    if isinstance(conn, DownstreamConnection) and peer(conn) == client]
        return bool(found)

    await c.until(accepted, "the daemon to accept the connection")
    return found[0]


async def _discovery_answers(c: Cluster) -> float:
    return await c.metric("mvproxy_request_duration_seconds_count", route="discovery") or 0


async def _at_least(c: Cluster, answers: float, downstream: DownstreamConnection) -> bool:
    return downstream.paused_writing or await _discovery_answers(c) >= answers


def dies_once(app: web.Application) -> None:
    died = []

    async def die(request: web.Request) -> web.Response:
        if not died:
            died.append(True)
            request.transport.abort()  # a restart racing a reused pooled connection
            await asyncio.sleep(1)
        return web.json_response({"path": request.raw_path})
    app.router.add_get("/api/v1/namespaces/dies", die)


async def test_a_body_gone_with_a_dead_connection_is_not_announced_again(aiohttp_server, root):
    """A reused connection died after taking the request's body: resending the head with
    its Content-Length and no body made the backend read the next client's request as
    that body. The client gets 502; the pooled connections stay in step."""
    async with cluster(aiohttp_server, root, backend_routes=dies_once) as c:
        await ready(c)
        assert status_of(await c.raw(request("/api/v1/namespaces/warm"))) == 200  # pooled
        answer = await c.raw(request("/api/v1/namespaces/dies",
                                     headers="Content-Length: 40\r\n", body=b"G" * 40))
        assert status_of(answer) == 502, answer[:300]
        for i in range(3):
            victim = await c.raw(request(f"/api/v1/namespaces/victim{i}"))
            assert status_of(victim) == 200, victim[:300]
            assert body_of(victim)["path"] == f"/api/v1/namespaces/victim{i}"


@pytest.mark.parametrize("tail", [b"0\r\nX-Trailer: ", b"5;ext="],
                         ids=["endless trailer", "endless chunk extension"])
async def test_chunk_framing_is_bounded_like_a_head(aiohttp_server, root, tail):
    """llhttp reports trailers and chunk extensions only once they end: they are counted
    as they arrive against maxHeaderBytes (one client once held 260 MB this way)."""
    async with cluster(aiohttp_server, root, listener={"maxHeaderBytes": 4096},
                       backend_routes=reading_create) as c:
        await ready(c)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", c.port, ssl=c.contexts["bearer"], server_hostname="127.0.0.1")
        writer.write(b"POST /api/v1/namespaces/default/secrets HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n" + tail)
        sent = 0
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            while sent < 4 * 1024 * 1024:  # far beyond the limit, never ending
                writer.write(b"a" * 16384)
                await writer.drain()
                sent += 16384
        answer = await asyncio.wait_for(reader.read(), WAIT_SECONDS)
        writer.close()
        assert status_of(answer) == 431, answer[:300]
        assert "chunk framing or trailers" in body_of(answer)["message"]


async def test_a_continuation_cancelled_before_it_starts_still_settles_the_gauges(
        aiohttp_server, root):
    """The race, made deterministic: a pooled backend connection fails (the request goes
    on in a task) and, in the same loop turn, the client leaves, so the task is cancelled
    before it runs. The in-flight gauge must come back to zero."""
    async with cluster(aiohttp_server, root, backend_routes=slow_route) as c:
        await ready(c)
        assert status_of(await c.raw(request("/api/v1/namespaces/warm"))) == 200
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", c.port, ssl=c.contexts["admin"], server_hostname="127.0.0.1")
        writer.write(request("/api/v1/namespaces/slow"))
        await writer.drain()
        in_flight = []
        for _ in range(100):
            in_flight = [conn for conn in gc.get_objects()
                         if isinstance(conn, DownstreamConnection) and conn._active is not None
                         and conn._active.cancel_hook is not None]
            if in_flight:
                break
            await asyncio.sleep(0.02)
        assert len(in_flight) == 1
        downstream = in_flight[0]
        assert await c.metric("mvproxy_inflight_requests", route="backend") == 1
        forwarded = downstream._active.cancel_hook.__self__  # the callback-driven request
        forwarded.relay.on_error(UpstreamProtocolError("backend", "connection reset"))
        downstream.cancel()  # the client left in the same turn
        await asyncio.sleep(0.1)
        writer.close()
        assert await c.metric("mvproxy_inflight_requests", route="backend") == 0


@pytest.mark.parametrize("cn", [" admin", "admin\t", "ad\x7fmin"])
async def test_a_subject_the_backend_would_trim_identifies_nobody(aiohttp_server, root,
                                                                 tmp_path, cn):
    """Go trims header values: CN " admin" would arrive as admin through mvproxy while
    direct x509 authentication sees " admin". Such a subject gets 401."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        c.contexts["odd"] = client_cert_context(root, tmp_path, cn)
        answer = await c.raw(request("/api/v1/namespaces"), who="odd")
        assert status_of(answer) == 401, answer[:300]
        assert c.seen["backend"] == []


def no_content(app: web.Application) -> None:
    async def delete(request: web.Request) -> web.Response:
        # aiohttp drops the field itself; other servers send it: written by hand.
        request.transport.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
        request.transport.close()
        return web.Response(status=204)
    app.router.add_delete("/api/v1/namespaces/default/configmaps/gone", delete)


async def test_a_204_is_relayed_without_content_length(aiohttp_server, root):
    async with cluster(aiohttp_server, root, backend_routes=no_content) as c:
        await ready(c)
        answer = await c.raw(request("/api/v1/namespaces/default/configmaps/gone",
                                     method="DELETE"))
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert status_of(answer) == 204 and b"content-length" not in head, answer


# --------------------------------------------------------------------------- dynamic peers


def _kubelet_serving(tree: Path) -> tuple[Path, Path]:
    """A kubelet-style serving certificate from the cluster CA (the CSR API issues
    these): CN system:node:worker-1, O system:nodes, SANs worker-1 and 127.0.0.1."""
    issue(tree, "kubelet", cn="system:node:worker-1", orgs=("system:nodes",),
          dns=("worker-1",))
    return tree / "kubelet.crt", tree / "kubelet.key"


async def test_a_bearer_token_never_reaches_a_dns_address_that_is_not_a_peer(
        aiohttp_server, root, tmp_path):
    """Attacker review (issue 11): DNS (or a Lease) pointing at a server the cluster CA
    vouches for — here a kubelet's serving certificate — must not become a peer, so no
    user request (bearer token included) is ever sent there."""
    tree = tmp_path / "pki"
    shutil.copytree(root, tree)
    crt, key = _kubelet_serving(tree)
    seen: list = []
    impostor = await aiohttp_server(fake_server("impostor", "1.36", seen=seen),
                                    ssl=tls.server_context(crt, key))
    dns = {"peers.static": [],
           "peers.dns": {"name": "localhost", "port": impostor.port, "interval": "200ms"}}
    async with cluster(aiohttp_server, root, extra=dns) as c:
        c.gate.set()
        await c.until(lambda: _rejected(c, "dns", "not_a_peer"), "the impostor's rejection")
        status, _, body = await c.get(PODGROUPS, who="bearer",
                                      headers={"Authorization": "Bearer SECRET-TOKEN"})
        assert "worker-1" not in (await c.debug()).get("peers", {})
    assert status == 200 and json.loads(body)["server"] == "backend", body  # not the impostor
    assert seen == [], seen


async def _rejected(c, source: str, reason: str) -> bool:
    return bool(await c.metric("mvproxy_membership_rejected_total", source=source,
                               reason=reason))


@pytest.mark.parametrize(("cn", "orgs", "dns", "must_name", "problem"), [
    ("mvproxy", (), ("apiserver-b",), True, None),
    ("mvproxy", (), ("localhost",), True, "does not name 'apiserver-b'"),
    ("mvproxy", (), ("localhost",), False, None),
    ("system:node:apiserver-b", ("system:nodes",), ("apiserver-b",), True, "kubelet"),
    ("system:node:apiserver-b", ("system:nodes",), ("apiserver-b",), False, "kubelet"),
], ids=["names itself", "names another", "static: name not required",
        "kubelet named like the peer", "kubelet as a static peer"])
def test_peer_serving_certificates(tmp_path, root, cn, orgs, dns, must_name, problem):
    tree = tmp_path / "pki"
    shutil.copytree(root, tree)
    cert = issue(tree, "leaf", cn=cn, orgs=orgs, dns=dns)
    found = tls.peer_serving_problem(cert.public_bytes(Encoding.DER), "apiserver-b",
                                     must_name=must_name)
    assert (found is None) if problem is None else (problem in (found or "")), found


# --------------------------------------------------------------------------- attacker's review

V2BETA1_FIRST = "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList"


def _slow_v2beta1_backend(monkeypatch, asked: list[str]) -> None:
    """The backend answers aggregated v2beta1 questions late (an overloaded server):
    ``asked`` collects the Authorization of each such question."""
    made = daemon_support.fake_server

    def fake(name, version, *args, **kwargs):
        app = made(name, version, *args, **kwargs)
        if name != "backend":
            return app

        @web.middleware
        async def slow(request: web.Request, handler):
            if "v=v2beta1" in request.headers.get("Accept", "") \
                    and "Authorization" in request.headers:
                asked.append(request.headers["Authorization"])
                await asyncio.sleep(5)  # longer than the 300 ms timeouts.request below
            return await handler(request)
        app.middlewares.insert(0, slow)
        return app
    monkeypatch.setattr(daemon_support, "fake_server", fake)


async def test_a_v2beta1_question_the_backend_answers_late_is_not_asked_twice(
        aiohttp_server, root, monkeypatch):
    """An overloaded backend that does not answer the v2beta1 question in time is not
    asked again by the same client request (a retry storm on a slow server): the client
    gets one 504 Status after one probe."""
    asked: list[str] = []
    _slow_v2beta1_backend(monkeypatch, asked)
    async with cluster(aiohttp_server, root, timeouts={"request": "300ms"}) as c:
        await ready(c)
        answer = await c.raw(request("/apis", headers=f"Accept: {V2BETA1_FIRST}\r\n"
                                                      "Authorization: Bearer alpha\r\n"),
                             who="bearer")
        assert status_of(answer) == 504, answer[:300]
        assert body_of(answer)["kind"] == "Status"
        assert asked == ["Bearer alpha"]


async def test_one_token_cannot_push_other_clients_out_of_the_discovery_memo(
        aiohttp_server, root, monkeypatch):
    """A client with one valid token that varies what kube-apiserver ignores in its
    credentials ('Bearer <token> <n>') would fill the memo of backend yeses and push
    every other client's out, each of their discovery requests then costing a probe:
    it holds only its share, and the other client's yes is still used."""
    monkeypatch.setattr(discoveryhandler, "AUTHORIZED_MAX", 4)  # 10,000 in production

    async def ask(authorization: str) -> None:
        answer = await c.raw(request("/apis", headers=f"Accept: {AGGREGATED}\r\n"
                                                      f"Authorization: {authorization}\r\n"),
                             who="bearer")
        assert status_of(answer) == 200

    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        await ask("Bearer victim")
        for n in range(8):
            await ask(f"Bearer attacker {n}")
        await ask("Bearer victim")
        assert probes(c).count("Bearer victim") == 1


async def test_a_flood_from_one_credential_leaves_others_yeses_and_the_memo_bounded(
        aiohttp_server, root, monkeypatch):
    """Every spelling of one token kube-apiserver reads as that token (a tail after it,
    the scheme in another case, spaces around it, ``Authorization-*`` lines beside it),
    and a certificate user sending any tokens at all, count as one credential each: the
    victim's yes outlives both floods, each flooder holds at most its share, and the
    memo never exceeds its cap."""
    monkeypatch.setattr(discoveryhandler, "AUTHORIZED_MAX", 6)
    monkeypatch.setattr(discoveryhandler, "AUTHORIZED_PER_CREDENTIAL", 2)

    async def ask(authorization: str, who: str = "bearer", extra: str = "") -> None:
        answer = await c.raw(request("/apis", headers=f"Accept: {AGGREGATED}\r\n"
                                                      f"Authorization: {authorization}\r\n"
                                                      f"{extra}"), who=who)
        assert status_of(answer) == 200

    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        memo = c.daemon.proxy.discovery._authorized
        await ask("Bearer victim")
        for n in range(12):
            await ask(f"Bearer flood {n}")
            await ask(f"bEaReR flood{' ' * (n + 1)}", extra=f"Authorization-X: {n}\r\n")
            await ask(f"Bearer flood-as-admin-{n}", who="admin")
            assert len(memo) <= 1 + 2 + 2  # the victim's, and each flooder's share
        await ask("Bearer victim")
        assert probes(c).count("Bearer victim") == 1
        assert len([auth for auth in probes(c) if "flood" in auth]) == 36  # none reused
        # Distinct tokens are distinct credentials: the cap still bounds them all.
        for n in range(6):
            await ask(f"Bearer other-{n}")
            assert len(memo) <= 6


@pytest.mark.parametrize(("lines", "same_as_token"), [
    ((b"authorization\0Bearer tok",), True),
    ((b"authorization\0bearer tok ignored tail",), True),
    ((b"authorization\0  BEARER tok  ", b"authorization-x\0n"), True),
    ((b"authorization\0Bearer tok", b"impersonate-user\0someone"), True),
    ((b"authorization\0Bearer tok", b"authorization\0Bearer second"), True),
    ((b"authorization\0Bearer tok2",), False),
    ((b"authorization\0Bearer  tok",), False),  # kube reads an empty token: anonymous
    ((b"authorization\0Basic tok",), False),
])
def test_a_credential_is_what_kube_apiserver_authenticates(lines, same_as_token):
    """kube's token authenticator: the first ``Authorization`` value, trimmed, split on
    spaces into at most three, scheme ``bearer`` in any case, token the second part."""
    anonymous = type("Exchange", (), {"downstream": identity.ANONYMOUS_DOWNSTREAM})
    token = discoveryhandler.credential_of(anonymous, (b"authorization\0Bearer tok",))
    assert (discoveryhandler.credential_of(anonymous, lines) == token) is same_as_token
    nothing = discoveryhandler.credential_of(anonymous, ())
    assert discoveryhandler.credential_of(anonymous, (b"authorization\0Basic tok",)) == nothing


def test_a_certificate_users_credential_is_its_identity_whatever_it_sends():
    admin = type("Exchange", (), {"downstream": identity.user_downstream(
        "admin", ("system:masters",))})
    other = type("Exchange", (), {"downstream": identity.user_downstream("other", ())})
    first = discoveryhandler.credential_of(admin, (b"authorization\0Bearer a",))
    assert discoveryhandler.credential_of(admin, (b"authorization\0Bearer b",)) == first
    assert discoveryhandler.credential_of(admin, ()) == first
    assert discoveryhandler.credential_of(other, ()) != first


def test_the_yes_memo_keeps_each_credentials_share_and_the_total_cap():
    memo = discoveryhandler.AuthorizedMemo(max_entries=6, per_credential=2)
    memo.remember((b"victim", "/apis"), b"v", 10.0)
    for n in range(20):
        memo.remember((f"flood {n}".encode(), "/apis"), b"f", 10.0)
        assert memo.held_by(b"f") <= 2 and len(memo) <= 3
    assert memo.until((b"victim", "/apis")) == 10.0
    assert memo.until((b"flood 19", "/apis")) == 10.0  # its newest kept, its oldest gone
    assert memo.until((b"flood 0", "/apis")) == 0.0
    for n in range(20):  # distinct credentials: the oldest of all goes first
        memo.remember((f"other {n}".encode(), "/apis"), f"o{n}".encode(), 10.0)
        assert len(memo) <= 6
    assert memo.until((b"victim", "/apis")) == 0.0 and memo.held_by(b"v") == 0
    assert sorted(memo) == [(f"other {n}".encode(), "/apis") for n in range(14, 20)]
    memo.remember((b"other 19", "/apis"), b"o19", 20.0)  # renewed in place
    assert memo.until((b"other 19", "/apis")) == 20.0 and len(memo) == 6


async def test_a_discovery_yes_for_one_identity_is_not_reused_for_another_with_its_token(
        aiohttp_server, root):
    """The memo's key holds the connection's TLS identity with the credential lines: a
    yes a certificate user got with a token is asked again for a client without that
    certificate sending the same token, and again on each new connection only while
    the yes is not remembered (same identity, same token: reused)."""
    async with cluster(aiohttp_server, root) as c:
        await ready(c)
        for who in ("admin", "admin", "bearer", "bearer"):
            answer = await c.raw(request("/apis", headers=f"Accept: {AGGREGATED}\r\n"
                                                          "Authorization: Bearer alpha\r\n"),
                                 who=who)
            assert status_of(answer) == 200
        assert probes(c) == ["Bearer alpha", "Bearer alpha"]
