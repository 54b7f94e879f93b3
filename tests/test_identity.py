"""identity: who a downstream is, from its (already TLS-verified) client certificate.

The PKI is the development one (``devpki.init_pki``): the cluster CA signs the admin
certificate and, here, user certificates; the front-proxy CA signs only the
``front-proxy-client`` certificates, which are what peers present. A second,
unrelated PKI provides look-alike certificates whose CAs have the *same names* but
other keys: only the signature tells them apart.

Expectations, from docs/security.md "Identity": peers are proven by a CA that signs only
proxies, so a *cluster-CA* certificate named like a peer (the CSR API can issue one)
is an ordinary USER; a certificate with several CNs identifies nobody.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from multidict import CIMultiDict

from mvproxy import devpki, identity, tls
from mvproxy.identity import (
    ANONYMOUS,
    ANONYMOUS_DOWNSTREAM,
    PEER,
    REFUSED,
    USER,
    Downstream,
    IdentityResolver,
    has_credentials,
    identity_headers,
    is_peer_proxied,
)

PEER_NAME = devpki.FRONT_PROXY_CLIENT_CN


def issue(root: Path, *cns: str, orgs: tuple[str, ...] = (), ca: str = "ca") -> bytes:
    """DER of a client certificate signed by ``root``'s CA ``ca`` (``ca`` or
    ``front-proxy-ca``), with the CNs in ``cns`` in that order."""
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn) for cn in cns] + [
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    return issue_with_subject(root, x509.Name(attrs), ca=ca)


def issue_with_subject(root: Path, subject: x509.Name, *, ca: str = "ca") -> bytes:
    """DER of a client certificate for ``subject`` signed by ``root``'s CA ``ca``."""
    ca_cert = x509.load_pem_x509_certificate((root / f"{ca}.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((root / f"{ca}.key").read_bytes(),
                                                password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject)
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


def der(path: Path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(
        serialization.Encoding.DER)


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> tuple[Path, Path]:
    """(cluster PKI, rogue PKI with same-named CAs)."""
    good = tmp_path_factory.mktemp("pki") / "pki"
    rogue = tmp_path_factory.mktemp("rogue") / "pki"
    devpki.init_pki(good, ["a", "b"], days=2)
    devpki.init_pki(rogue, ["x"], days=2)
    return good, rogue


@pytest.fixture(scope="module")
def certs(roots) -> dict[str, bytes]:
    good, rogue = roots
    return {
        "peer a": der(good / "a" / "front-proxy-client.crt"),
        "peer b": der(good / "b" / "front-proxy-client.crt"),
        "admin": der(good / "admin.crt"),
        "alice": issue(good, "alice", orgs=("viewer", "team-x")),
        "no cn": issue(good, orgs=("viewer",)),
        "serving cert (CN mvproxy)": der(good / "a" / "mvproxy.crt"),
        "cluster CA, named like a peer": issue(good, PEER_NAME, orgs=("system:masters",)),
        "front-proxy CA, other name": issue(good, "aggregator", ca="front-proxy-ca"),
        "rogue peer": der(rogue / "x" / "front-proxy-client.crt"),
        "rogue admin": der(rogue / "admin.crt"),
        "rogue alice": issue(rogue, "alice", orgs=("viewer",)),
        "two CNs, peer first (front-proxy CA)": issue(good, PEER_NAME, "alice",
                                                      ca="front-proxy-ca"),
        "two CNs, peer last (front-proxy CA)": issue(good, "alice", PEER_NAME,
                                                     ca="front-proxy-ca"),
        "two CNs (cluster CA)": issue(good, "alice", "kubernetes-admin",
                                      orgs=("system:masters",)),
        "two CNs (rogue CA)": issue(rogue, "alice", "bob"),
    }


@pytest.fixture(scope="module")
def resolver(roots) -> IdentityResolver:
    """The documented deployment: users from the cluster CA, peers from the front-proxy CA."""
    good, _ = roots
    return IdentityResolver(client_ca_file=str(good / "ca.crt"),
                            peer_client_ca_file=str(good / "front-proxy-ca.crt"),
                            peer_allowed_names=[PEER_NAME])


@pytest.mark.parametrize("name, expected", [
    ("peer a", Downstream(PEER, PEER_NAME)),
    ("peer b", Downstream(PEER, PEER_NAME)),
    ("admin", Downstream(USER, "kubernetes-admin", ("system:masters",))),
    ("alice", Downstream(USER, "alice", ("viewer", "team-x"))),
    ("serving cert (CN mvproxy)", Downstream(USER, "mvproxy")),
    ("cluster CA, named like a peer", Downstream(USER, PEER_NAME, ("system:masters",))),
    ("no cn", ANONYMOUS_DOWNSTREAM),
    ("front-proxy CA, other name", ANONYMOUS_DOWNSTREAM),
    ("rogue peer", ANONYMOUS_DOWNSTREAM),
    ("rogue admin", ANONYMOUS_DOWNSTREAM),
    ("rogue alice", ANONYMOUS_DOWNSTREAM),
    ("two CNs (rogue CA)", ANONYMOUS_DOWNSTREAM),
], ids=[
    "front-proxy client cert is a PEER",
    "every server's front-proxy client cert is a PEER",
    "admin cert is a USER in system:masters",
    "user cert: CN is the user, O the groups",
    "cluster-CA cert whose CN is not an allowed name is a USER",
    "cluster-CA cert named like a peer is only a USER (CSR API attack)",
    "cluster-CA cert without a CN is ANONYMOUS",
    "front-proxy-CA cert with another name is ANONYMOUS",
    "peer look-alike from an untrusted same-named CA is ANONYMOUS",
    "admin look-alike from an untrusted CA is ANONYMOUS",
    "user look-alike from an untrusted CA is ANONYMOUS",
    "several CNs from an untrusted CA is ANONYMOUS",
])
def test_roles_by_issuing_ca_and_name(resolver, certs, name, expected):
    got = resolver.resolve(certs[name])
    if expected.kind == USER:  # and the credential kube-apiserver records for it
        import hashlib
        expected = dataclasses.replace(
            expected, credential_id="X509SHA256=" + hashlib.sha256(certs[name]).hexdigest())
    assert got == expected


@pytest.mark.parametrize("name", [
    "two CNs, peer first (front-proxy CA)",
    "two CNs, peer last (front-proxy CA)",
    "two CNs (cluster CA)",
])
def test_a_certificate_with_several_common_names_is_refused(resolver, certs, name):
    """``/CN=front-proxy-client/CN=alice``: OpenSSL shows the first, Go uses the last;
    either reading would be wrong for one side, so the certificate identifies nobody."""
    found = resolver.resolve(certs[name])
    assert found.kind == REFUSED and not found.is_peer
    assert "more than one common name" in found.reason


def test_names_are_read_as_go_reads_them(roots):
    """kube-apiserver's x509 authenticator: the last CN, every O in order."""
    good, _ = roots
    assert tls.subject_identity(issue(good, "first", "last", orgs=("o1", "o2"))) == (
        "last", ("o1", "o2"))
    assert tls.common_names(issue(good, "first", "last")) == ("first", "last")


@pytest.mark.parametrize("cert", [None, b""], ids=["no certificate", "empty certificate"])
def test_no_certificate_is_anonymous(resolver, cert):
    assert resolver.resolve(cert) is ANONYMOUS_DOWNSTREAM
    assert ANONYMOUS_DOWNSTREAM.kind == ANONYMOUS and not ANONYMOUS_DOWNSTREAM.is_peer


def test_peer_name_not_allowed_is_anonymous(roots, certs):
    good, _ = roots
    strict = IdentityResolver(client_ca_file=str(good / "ca.crt"),
                              peer_client_ca_file=str(good / "front-proxy-ca.crt"),
                              peer_allowed_names=["someone-else"])
    assert strict.resolve(certs["peer a"]) is ANONYMOUS_DOWNSTREAM


def test_a_shared_ca_makes_any_user_certificate_with_the_name_a_peer(roots, certs):
    """Why preflight refuses peer.clientCAFile == clientCAFile: with one CA for both,
    the cluster-CA certificate named like a peer *is* a peer."""
    good, _ = roots
    shared = IdentityResolver(client_ca_file=str(good / "ca.crt"),
                              peer_client_ca_file=str(good / "ca.crt"),
                              peer_allowed_names=[PEER_NAME])
    assert shared.resolve(certs["cluster CA, named like a peer"]).is_peer


def test_without_client_ca_only_peers_are_recognised(roots, certs):
    good, _ = roots
    peers_only = IdentityResolver(client_ca_file=None,
                                  peer_client_ca_file=str(good / "front-proxy-ca.crt"),
                                  peer_allowed_names=[PEER_NAME])
    assert peers_only.resolve(certs["peer a"]).kind == PEER
    assert peers_only.resolve(certs["admin"]) is ANONYMOUS_DOWNSTREAM
    nothing = IdentityResolver(client_ca_file=None, peer_client_ca_file=None,
                               peer_allowed_names=[PEER_NAME])
    assert nothing.resolve(certs["peer a"]) is ANONYMOUS_DOWNSTREAM


def test_unreadable_ca_file_is_a_pki_error(tmp_path):
    from mvproxy.errors import PKIError
    with pytest.raises(PKIError, match="client CA file"):
        IdentityResolver(client_ca_file=str(tmp_path / "missing.crt"), peer_client_ca_file=None,
                         peer_allowed_names=[])


# --------------------------------------------------------------------------- memoisation

def test_memoised_by_der(roots, certs, monkeypatch):
    good, _ = roots
    r = IdentityResolver(client_ca_file=str(good / "ca.crt"),
                         peer_client_ca_file=str(good / "front-proxy-ca.crt"),
                         peer_allowed_names=[PEER_NAME])
    calls = []
    original = r._classify
    monkeypatch.setattr(r, "_classify", lambda d: calls.append(d) or original(d))
    first = r.resolve(certs["alice"])
    assert r.resolve(certs["alice"]) is first
    assert r.resolve(bytes(certs["alice"])) is first  # equal bytes, other object
    assert len(calls) == 1


def test_memo_is_bounded(roots, certs, monkeypatch):
    good, _ = roots
    r = IdentityResolver(client_ca_file=str(good / "ca.crt"),
                         peer_client_ca_file=str(good / "front-proxy-ca.crt"),
                         peer_allowed_names=[PEER_NAME], memo_size=2)
    calls = []
    original = r._classify
    monkeypatch.setattr(r, "_classify", lambda d: calls.append(d) or original(d))
    for name in ("alice", "admin", "peer a", "alice"):
        r.resolve(certs[name])
    assert len(calls) == 4  # alice was evicted by the third certificate
    assert len(r._memo) == 2


# --------------------------------------------------------------------------- peer-proxied

PEER_DS = Downstream(PEER, PEER_NAME)
USER_DS = Downstream(USER, "alice", ("viewer",))


@pytest.mark.parametrize("downstream, value, expected", [
    (PEER_DS, "true", True),
    (PEER_DS, "True", True),
    (PEER_DS, "TRUE", True),
    (PEER_DS, "false", False),
    (PEER_DS, "1", False),
    (PEER_DS, "", False),
    (PEER_DS, " true", False),
    (PEER_DS, None, False),
    (USER_DS, "true", False),
    (ANONYMOUS_DOWNSTREAM, "true", False),
], ids=[
    "peer with true", "peer with True", "peer with TRUE", "peer with false", "peer with 1",
    "peer with empty value", "peer with padded value", "peer without the header",
    "user with true is not trusted", "anonymous with true is not trusted",
])
def test_is_peer_proxied(downstream, value, expected):
    headers = CIMultiDict() if value is None else CIMultiDict(
        {"X-Kubernetes-Peer-Proxied": value})  # header names are case-insensitive
    assert is_peer_proxied(downstream, headers) is expected


def test_identity_headers():
    assert identity_headers(Downstream(USER, "alice", ("viewer", "team-x"))) == [
        ("X-Remote-User", "alice"), ("X-Remote-Group", "viewer"), ("X-Remote-Group", "team-x")]
    assert identity_headers(Downstream(USER, "bob")) == [("X-Remote-User", "bob")]
    assert identity_headers(PEER_DS) == []  # a peer's own X-Remote-* pass through instead
    assert identity_headers(ANONYMOUS_DOWNSTREAM) == []


def test_a_certificate_users_credential_id_and_uid_go_upstream(roots):
    """What kube-apiserver's x509 authenticator adds to a certificate user (1.33+,
    staging/src/k8s.io/apiserver/pkg/authentication/request/x509/x509.go): the extra
    authentication.kubernetes.io/credential-id, X509SHA256=<hex SHA-256 of the DER>,
    and the UID from the subject's 1.3.6.1.4.1.57683.2 attribute. Sent as requestheader
    fields, the key path-escaped (read back lowercased and unescaped)."""
    import hashlib

    good, _ = roots
    resolver = IdentityResolver(client_ca_file=str(good / "ca.crt"),
                                peer_client_ca_file=str(good / "front-proxy-ca.crt"),
                                peer_allowed_names=[PEER_NAME])

    def with_subject(*attributes: x509.NameAttribute) -> bytes:
        return issue_with_subject(good, x509.Name(list(attributes)))

    cn = x509.NameAttribute(NameOID.COMMON_NAME, "carol")
    org = x509.NameAttribute(NameOID.ORGANIZATION_NAME, "team-c")
    uid = x509.NameAttribute(identity.X509_UID, "carol-uid-1")
    der = with_subject(cn, org, uid)
    carol = resolver.resolve(der)
    fingerprint = "X509SHA256=" + hashlib.sha256(der).hexdigest()
    assert (carol.kind, carol.user, carol.groups, carol.uid, carol.credential_id) == (
        USER, "carol", ("team-c",), "carol-uid-1", fingerprint)
    assert identity_headers(carol) == [
        ("X-Remote-User", "carol"), ("X-Remote-Group", "team-c"),
        ("X-Remote-Uid", "carol-uid-1"),
        ("X-Remote-Extra-Authentication.kubernetes.io%2Fcredential-id", fingerprint)]
    assert carol.header_lines == "".join(
        f"{n}: {v}\r\n" for n, v in identity_headers(carol)).encode()
    # No UID attribute: no X-Remote-Uid; several, or an empty one: kube refuses it.
    plain = resolver.resolve(with_subject(cn))
    assert plain.uid == "" and b"X-Remote-Uid" not in plain.header_lines
    for bad in (with_subject(cn, uid, x509.NameAttribute(identity.X509_UID, "other")),
                with_subject(cn, x509.NameAttribute(identity.X509_UID, ""))):
        assert resolver.resolve(bad).kind == REFUSED
    # A UID that cannot be sent as it is: refused like such a name.
    assert resolver.resolve(with_subject(
        cn, x509.NameAttribute(identity.X509_UID, "a\tb "))).kind == REFUSED


def test_constants_match_upstream_names():
    assert identity.PEER_PROXIED == "x-kubernetes-peer-proxied"
    assert (identity.REMOTE_USER, identity.REMOTE_GROUP) == ("X-Remote-User", "X-Remote-Group")


# --------------------------------------------------------------------------- credentials

BEARER_PROTOCOL = b"base64url.bearer.authorization.k8s.io.dG9rZW4, v5.channel.k8s.io"


@pytest.mark.parametrize("downstream, raw, upgrade, expected", [
    (PEER_DS, [], False, True),
    (USER_DS, [], False, True),
    (ANONYMOUS_DOWNSTREAM, [], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Accept", b"application/json")], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b"Bearer t0ken")], False, True),
    (ANONYMOUS_DOWNSTREAM, [(b"authorization", b"bearer junk")], False, True),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b"  Bearer t0ken  ")], False, True),
    (ANONYMOUS_DOWNSTREAM, [(b"AUTHORIZATION", b"Basic YTpi")], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b"x")], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b"Bearer")], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b"Bearer  t0ken")], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b"")], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b" \t")], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b""), (b"Authorization", b"Bearer x")],
     False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Authorization", b"Bearer x"),
                            (b"Connection", b"keep-alive, Authorization")], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Sec-WebSocket-Protocol", BEARER_PROTOCOL)], True, True),
    (ANONYMOUS_DOWNSTREAM, [(b"Sec-WebSocket-Protocol", BEARER_PROTOCOL)], False, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Sec-WebSocket-Protocol", BEARER_PROTOCOL),
                            (b"Connection", b"Upgrade, Sec-WebSocket-Protocol")], True, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Sec-WebSocket-Protocol",
                             b"base64url.bearer.authorization.k8s.io.")], True, False),
    (ANONYMOUS_DOWNSTREAM, [(b"Sec-WebSocket-Protocol", b"v5.channel.k8s.io")], True, False),
    (ANONYMOUS_DOWNSTREAM, [(b"X-Authorization", b"Bearer x"),
                            (b"Impersonate-User", b"system:admin"),
                            (b"X-Remote-User", b"system:admin")], False, False),
], ids=[
    "peer", "certificate user", "nothing", "other headers only", "bearer token",
    "junk token, any case (mvproxy cannot judge it)", "surrounding blanks trimmed",
    "another scheme (kube reads it as anonymous)", "no scheme", "Bearer without a token",
    "two spaces: an empty token", "empty Authorization", "blank Authorization",
    "only the first Authorization counts (Go's Header.Get)",
    "Authorization named in Connection (forwarding drops it)",
    "bearer token as a WebSocket subprotocol", "the subprotocol outside an upgrade",
    "the subprotocol named in Connection", "the subprotocol with an empty token",
    "WebSocket subprotocol without a token", "look-alikes and claims are not credentials",
])
def test_has_credentials(downstream, raw, upgrade, expected):
    """Without credentials routing never sends a request to a peer: only what an API
    server could authenticate counts, and a token counts whether or not it is valid."""
    assert has_credentials(downstream, raw, upgrade=upgrade) is expected


def test_downstream_kinds_are_an_enum_that_keeps_its_words():
    assert [(k.name, str(k)) for k in identity.Kind] == [
        ("PEER", "peer"), ("USER", "user"), ("ANONYMOUS", "anonymous"), ("REFUSED", "refused")]
    assert identity.ANONYMOUS_DOWNSTREAM.kind == "anonymous"
    assert identity.ANONYMOUS_DOWNSTREAM.kind is identity.Kind.ANONYMOUS
