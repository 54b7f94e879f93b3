"""Tests for mvproxy.devpki and mvproxy.tls: the generated layout, SSL contexts and
certificate checks."""

from __future__ import annotations

import socket
import ssl
import stat
import subprocess
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mvproxy.config import from_document
from mvproxy.devpki import init_pki, sidecar_config
from mvproxy.errors import PKIError, Problem
from mvproxy.tls import (
    check_certificate,
    client_context,
    server_context,
    subject_identity,
)

SERVER_IDS = ("apiserver-a", "apiserver-b")
HOSTS = ("mvproxy.example.test", "10.0.0.5")
TIMEOUT = 5.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    directory = tmp_path_factory.mktemp("pki") / "certs"
    written = init_pki(directory, SERVER_IDS, HOSTS, days=30)
    return directory, written


@pytest.fixture(scope="module")
def pki_dir(pki: tuple[Path, list[Path]]) -> Path:
    return pki[0]


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second, unrelated PKI: its CA must not vouch for the first one's certificates."""
    directory = tmp_path_factory.mktemp("other") / "certs"
    init_pki(directory, ["apiserver-a"])
    return directory


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def san(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(names.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    return dns, ips


def ekus(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def cn(cert: x509.Certificate) -> str:
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


# --------------------------------------------------------------------------- layout


def test_layout_is_the_documented_one(pki: tuple[Path, list[Path]]) -> None:
    directory, written = pki
    expected = {
        "ca.crt",
        "ca.key",
        "front-proxy-ca.crt",
        "front-proxy-ca.key",
        "admin.crt",
        "admin.key",
    }
    for server_id in SERVER_IDS:
        for stem in ("apiserver", "mvproxy", "front-proxy-client"):
            expected |= {f"{server_id}/{stem}.crt", f"{server_id}/{stem}.key"}
    assert {str(p.relative_to(directory)) for p in written} == expected
    assert all(p.is_file() for p in written)
    assert not [p for p in directory.parent.iterdir() if p.name != "certs"], "temp dirs left behind"


def test_keys_are_private_and_certs_readable(pki: tuple[Path, list[Path]]) -> None:
    _, written = pki
    for path in written:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o600 if path.suffix == ".key" else 0o644), path
        if path.suffix == ".key":
            assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8


@pytest.mark.parametrize(
    ("leaf", "ca"),
    [
        ("admin.crt", "ca.crt"),
        ("apiserver-a/apiserver.crt", "ca.crt"),
        ("apiserver-a/mvproxy.crt", "ca.crt"),
        ("apiserver-b/front-proxy-client.crt", "front-proxy-ca.crt"),
    ],
)
def test_chains_verify_with_cryptography_and_openssl(pki_dir: Path, leaf: str, ca: str) -> None:
    load(pki_dir / leaf).verify_directly_issued_by(load(pki_dir / ca))
    result = subprocess.run(
        ["openssl", "verify", "-CAfile", str(pki_dir / ca), str(pki_dir / leaf)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith(": OK")


def test_front_proxy_client_is_not_trusted_by_cluster_ca(pki_dir: Path) -> None:
    result = subprocess.run(
        [
            "openssl",
            "verify",
            "-CAfile",
            str(pki_dir / "ca.crt"),
            str(pki_dir / "apiserver-a/front-proxy-client.crt"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0


def test_cas(pki_dir: Path) -> None:
    for name, common_name in (("ca.crt", "mvproxy-ca"), ("front-proxy-ca.crt", "front-proxy-ca")):
        cert = load(pki_dir / name)
        assert cn(cert) == common_name
        basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        assert basic.ca and basic.path_length == 0
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        assert usage.key_cert_sign and usage.crl_sign and usage.digital_signature
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
        assert cert.public_key().curve.name == "secp256r1"


def test_subjects_and_ekus(pki_dir: Path) -> None:
    server, client = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    admin = load(pki_dir / "admin.crt")
    assert subject_identity(admin.public_bytes(serialization.Encoding.DER)) == (
        "kubernetes-admin",
        ("system:masters",),
    )
    assert ekus(admin) == {client}
    expectations = {
        "apiserver": ("kube-apiserver", {server}),
        "mvproxy": ("mvproxy", {server}),
        "front-proxy-client": ("front-proxy-client", {client}),
    }
    for stem, (common_name, usages) in expectations.items():
        cert = load(pki_dir / "apiserver-a" / f"{stem}.crt")
        assert cn(cert) == common_name, stem
        assert ekus(cert) == usages, stem
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier)
        cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        assert cert.not_valid_before_utc < datetime.now(timezone.utc) - timedelta(minutes=4)
        lifetime = cert.not_valid_after_utc - datetime.now(timezone.utc)
        assert timedelta(days=29) < lifetime <= timedelta(days=30)


def test_sans(pki_dir: Path) -> None:
    dns, ips = san(load(pki_dir / "apiserver-b/apiserver.crt"))
    assert dns == {
        "mvproxy.example.test",
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    }
    assert ips == {"10.0.0.5", "127.0.0.1", "::1"}
    for stem in ("mvproxy",):
        dns, ips = san(load(pki_dir / f"apiserver-b/{stem}.crt"))
        assert dns == {"mvproxy.example.test", "localhost", "kubernetes.default.svc", "apiserver-b"}
        assert ips == {"10.0.0.5", "127.0.0.1", "::1"}


# --------------------------------------------------------------------------- init_pki refusals


def test_refuses_existing_directory_without_force(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    init_pki(directory, ["apiserver-a"])
    before = (directory / "ca.crt").read_bytes()
    with pytest.raises(PKIError) as err:
        init_pki(directory, ["apiserver-a"])
    assert str(directory) in str(err.value) and "--force" in str(err.value)
    assert (directory / "ca.crt").read_bytes() == before


def test_force_overwrites_and_keeps_readme(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    init_pki(directory, ["apiserver-a"])
    before = (directory / "ca.crt").read_bytes()
    (directory / "README.md").write_text("docs\n")
    written = init_pki(directory, ["apiserver-b"], force=True)
    assert (directory / "ca.crt").read_bytes() != before
    assert (directory / "README.md").read_text() == "docs\n"
    assert not (directory / "apiserver-a").exists(), "stale server left behind"
    assert all(p.exists() for p in written)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["certs"]


def test_directory_with_only_readme_needs_no_force(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    directory.mkdir()
    (directory / "README.md").write_text("docs\n")
    init_pki(directory, ["apiserver-a"])
    assert (directory / "README.md").read_text() == "docs\n"
    assert (directory / "apiserver-a/front-proxy-client.crt").is_file()


@pytest.mark.parametrize(
    ("server_ids", "fragment"),
    [
        ([], "at least one server ID"),
        ([""], "invalid server ID ''"),
        (["../evil"], "invalid server ID '../evil'"),
        (["a/b"], "invalid server ID 'a/b'"),
        (["a..b"], "invalid server ID 'a..b'"),
        (["ApiServer"], "invalid server ID 'ApiServer'"),
        (["has space"], "invalid server ID 'has space'"),
        (["ca.crt"], "clashes"),
        (["apiserver-a", "apiserver-a"], "duplicate server ID 'apiserver-a'"),
        ("apiserver-a", "not the string"),
    ],
)
def test_bad_server_ids_rejected(tmp_path: Path, server_ids: object, fragment: str) -> None:
    with pytest.raises(PKIError) as err:
        init_pki(tmp_path / "certs", server_ids)  # type: ignore[arg-type]
    assert fragment in str(err.value)
    assert list(tmp_path.iterdir()) == [], "nothing may be written on error"


@pytest.mark.parametrize("days", [0, -1, True, 1.5])
def test_bad_days_rejected(tmp_path: Path, days: object) -> None:
    with pytest.raises(PKIError, match="days"):
        init_pki(tmp_path / "certs", ["apiserver-a"], days=days)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_bad_host_rejected(tmp_path: Path) -> None:
    with pytest.raises(PKIError, match="invalid host 'not a host'"):
        init_pki(tmp_path / "certs", ["apiserver-a"], hosts=["not a host"])
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- TLS handshakes


def handshake(
    server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str = "localhost",
    sessions: list[ssl.SSLSession | None] | None = None,
) -> tuple[object, object]:
    """Run one TLS exchange over loopback; returns (server outcome, client outcome).

    The server's outcome is the peer's DER certificate (or None) or the exception it hit;
    the client's is the bytes it read after the handshake or its exception. ``sessions``
    gets the client's TLS session once it read them (with any tickets sent before).
    """
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT)
    port = listener.getsockname()[1]
    outcome: dict[str, object] = {}

    def serve() -> None:
        conn = None
        try:
            conn, _ = listener.accept()
            conn.settimeout(TIMEOUT)
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                outcome["server"] = tls.getpeercert(binary_form=True)
                tls.sendall(b"ok")
        except (OSError, ssl.SSLError) as e:
            outcome["server"] = e
        finally:
            if conn is not None:
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = None
    try:
        client = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        with client_ctx.wrap_socket(client, server_hostname=server_hostname) as tls:
            client_result: object = tls.recv(2)
            if sessions is not None:
                sessions.append(tls.session)
    except (OSError, ssl.SSLError) as e:
        client_result = e
    finally:
        if client is not None:
            client.close()
        thread.join(TIMEOUT)
        listener.close()
    assert not thread.is_alive(), "server thread hung"
    return outcome["server"], client_result


def mtls_server(pki_dir: Path) -> ssl.SSLContext:
    return server_context(
        pki_dir / "apiserver-a/mvproxy.crt",
        pki_dir / "apiserver-a/mvproxy.key",
        pki_dir / "ca.crt",
        require_client_cert=True,
    )


def test_mutual_tls_handshake_identifies_user(pki_dir: Path) -> None:
    client = client_context(pki_dir / "ca.crt", pki_dir / "admin.crt", pki_dir / "admin.key")
    server_result, client_result = handshake(mtls_server(pki_dir), client)
    assert client_result == b"ok"
    assert isinstance(server_result, bytes)
    assert subject_identity(server_result) == ("kubernetes-admin", ("system:masters",))


def test_mvproxy_cert_serves_peers_by_server_id(pki_dir: Path) -> None:
    server = server_context(pki_dir / "apiserver-b/mvproxy.crt",
                            pki_dir / "apiserver-b/mvproxy.key")
    _, client_result = handshake(server, client_context(pki_dir / "ca.crt"), "apiserver-b")
    assert client_result == b"ok"


def test_force_replaces_a_layout_with_old_peer_certificates(tmp_path: Path) -> None:
    """Earlier versions wrote ID/peer.crt; such a directory is still ours to replace."""
    directory = tmp_path / "certs"
    init_pki(directory, ["apiserver-a"])
    for ext in ("crt", "key"):
        (directory / "apiserver-a" / f"peer.{ext}").write_text("old\n")
    init_pki(directory, ["apiserver-a"], force=True)
    assert not (directory / "apiserver-a/peer.crt").exists()


def test_handshake_without_client_cert_is_refused(pki_dir: Path) -> None:
    server_result, client_result = handshake(
        mtls_server(pki_dir), client_context(pki_dir / "ca.crt")
    )
    assert isinstance(server_result, ssl.SSLError)
    assert client_result != b"ok"


def test_optional_client_cert_allows_anonymous(pki_dir: Path) -> None:
    server = server_context(
        pki_dir / "apiserver-a/mvproxy.crt", pki_dir / "apiserver-a/mvproxy.key", pki_dir / "ca.crt"
    )
    server_result, client_result = handshake(server, client_context(pki_dir / "ca.crt"))
    assert client_result == b"ok"
    assert server_result is None


def test_client_with_wrong_ca_refuses_server(pki_dir: Path, other_pki: Path) -> None:
    server_result, client_result = handshake(
        mtls_server(pki_dir), client_context(other_pki / "ca.crt")
    )
    assert isinstance(client_result, ssl.SSLCertVerificationError)
    assert "certificate verify failed" in str(client_result)


def test_client_refuses_wrong_hostname(pki_dir: Path) -> None:
    server = server_context(
        pki_dir / "apiserver-a/mvproxy.crt", pki_dir / "apiserver-a/mvproxy.key"
    )
    _, client_result = handshake(server, client_context(pki_dir / "ca.crt"), "apiserver-b")
    assert isinstance(client_result, ssl.SSLCertVerificationError)


def test_server_sends_no_session_ticket(pki_dir: Path) -> None:
    """A client that would resume finds nothing to resume with: no TLS 1.3 ticket arrives
    (mvproxy's clients never resume, and each ticket costs the server a re-parse)."""
    client = client_context(pki_dir / "ca.crt", pki_dir / "admin.crt", pki_dir / "admin.key")
    sessions: list[ssl.SSLSession | None] = []
    server_result, client_result = handshake(mtls_server(pki_dir), client, sessions=sessions)
    assert client_result == b"ok" and isinstance(server_result, bytes)
    assert sessions and sessions[0] is not None
    assert not sessions[0].has_ticket


def test_contexts_policy(pki_dir: Path) -> None:
    server = mtls_server(pki_dir)
    assert server.minimum_version == ssl.TLSVersion.TLSv1_2
    assert server.verify_mode == ssl.CERT_REQUIRED
    client = client_context()
    assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED
    assert client.minimum_version == ssl.TLSVersion.TLSv1_2


# --------------------------------------------------------------------------- context errors


def test_server_context_with_mismatched_key_names_files(pki_dir: Path) -> None:
    cert, key = pki_dir / "apiserver-a/mvproxy.crt", pki_dir / "apiserver-a/apiserver.key"
    with pytest.raises(PKIError) as err:
        server_context(cert, key)
    assert str(err.value) == f"private key {key} does not match certificate {cert}"
    assert isinstance(err.value.__cause__, ssl.SSLError)


def test_missing_files_are_named(pki_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.key"
    with pytest.raises(PKIError, match=f"cannot read private key {missing}: No such file"):
        server_context(pki_dir / "ca.crt", missing)
    with pytest.raises(PKIError, match=f"cannot read CA file {missing}"):
        client_context(missing)
    with pytest.raises(PKIError, match=f"cannot read client CA file {missing}"):
        server_context(pki_dir / "admin.crt", pki_dir / "admin.key", missing)


def test_garbage_files_are_named(pki_dir: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    with pytest.raises(PKIError, match=f"{garbage} is not a PEM certificate"):
        server_context(garbage, pki_dir / "admin.key")
    with pytest.raises(PKIError, match=f"{garbage} is not a PEM private key"):
        server_context(pki_dir / "admin.crt", garbage)
    with pytest.raises(PKIError, match=f"CA file {garbage} contains no usable PEM certificate"):
        client_context(garbage)


def test_require_client_cert_needs_a_ca(pki_dir: Path) -> None:
    with pytest.raises(PKIError, match="client CA"):
        server_context(pki_dir / "admin.crt", pki_dir / "admin.key", require_client_cert=True)


# --------------------------------------------------------------------------- check_certificate


def test_generated_certificates_check_clean(pki_dir: Path) -> None:
    for stem in ("apiserver", "mvproxy"):
        problems = check_certificate(
            pki_dir / f"apiserver-a/{stem}.crt",
            key_file=pki_dir / f"apiserver-a/{stem}.key",
            ca_file=pki_dir / "ca.crt",
        )
        assert problems == []
    assert (
        check_certificate(
            pki_dir / "apiserver-a/front-proxy-client.crt", ca_file=pki_dir / "front-proxy-ca.crt"
        )
        == []
    )


def write_cert_signed_by_ca(
    pki_dir: Path, path: Path, not_before: datetime, not_after: datetime
) -> None:
    ca = load(pki_dir / "ca.crt")
    ca_key = serialization.load_pem_private_key((pki_dir / "ca.key").read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "old")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def test_check_finds_expired(pki_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "old.crt"
    write_cert_signed_by_ca(
        pki_dir,
        path,
        datetime(2019, 1, 1, tzinfo=timezone.utc),
        datetime(2020, 1, 1, tzinfo=timezone.utc),
    )
    problems = check_certificate(path, ca_file=pki_dir / "ca.crt")
    assert problems == [Problem(str(path), "expired on 2020-01-01T00:00:00Z")]
    assert str(problems[0]) == f"{path}: expired on 2020-01-01T00:00:00Z"


def test_check_finds_not_yet_valid(pki_dir: Path) -> None:
    path = pki_dir / "admin.crt"
    problems = check_certificate(path, now=datetime(2000, 1, 1, tzinfo=timezone.utc))
    assert len(problems) == 1 and problems[0].message.startswith("not valid until ")


def test_check_finds_mismatched_key(pki_dir: Path) -> None:
    cert, key = pki_dir / "admin.crt", pki_dir / "ca.key"
    problems = check_certificate(cert, key_file=key)
    assert problems == [Problem(str(key), f"private key does not match certificate {cert}")]
    assert "PRIVATE KEY" not in str(problems)


def test_check_finds_wrong_ca(pki_dir: Path, other_pki: Path) -> None:
    cert = pki_dir / "apiserver-a/mvproxy.crt"
    problems = check_certificate(cert, ca_file=other_pki / "ca.crt")
    assert len(problems) == 1 and problems[0].path == str(cert)
    assert problems[0].message.startswith(
        f"not signed by any certificate in {other_pki / 'ca.crt'}"
    )
    # Right issuer name, wrong signature is still caught; front-proxy CA is a different name.
    assert check_certificate(cert, ca_file=pki_dir / "front-proxy-ca.crt")


def test_check_accepts_ca_bundle(pki_dir: Path, other_pki: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes((other_pki / "ca.crt").read_bytes() + (pki_dir / "ca.crt").read_bytes())
    assert check_certificate(pki_dir / "admin.crt", ca_file=bundle) == []


def test_check_same_name_other_ca_is_rejected(pki_dir: Path, other_pki: Path) -> None:
    # Both CAs are called mvproxy-ca: only the signature tells them apart.
    assert load(other_pki / "ca.crt").subject == load(pki_dir / "ca.crt").subject
    assert check_certificate(pki_dir / "admin.crt", ca_file=other_pki / "ca.crt")


def test_check_garbage_and_missing_never_raise(pki_dir: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.crt"
    garbage.write_bytes(b"\x00\x01 not pem")
    assert check_certificate(garbage) == [Problem(str(garbage), "not a PEM certificate")]
    missing = tmp_path / "missing.crt"
    [problem] = check_certificate(missing)
    assert problem.path == str(missing) and problem.message.startswith("cannot read")
    assert check_certificate(pki_dir / "admin.crt", key_file=garbage) == [
        Problem(str(garbage), "not a PEM private key")
    ]
    assert check_certificate(pki_dir / "admin.crt", ca_file=garbage) == [
        Problem(str(garbage), "not a PEM certificate bundle")
    ]
    assert check_certificate(tmp_path)[0].message.startswith("cannot read")


def test_subject_identity_of_front_proxy_client(pki_dir: Path) -> None:
    cert = load(pki_dir / "apiserver-a/front-proxy-client.crt")
    assert subject_identity(cert.public_bytes(serialization.Encoding.DER)) == (
        "front-proxy-client",
        (),
    )
    with pytest.raises(PKIError):
        subject_identity(b"junk")


def test_force_never_deletes_files_it_did_not_write(tmp_path):
    """A mistyped DIR must not be wiped: --force replaces only a PKI."""
    target = tmp_path / "project"
    (target / "src").mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(PKIError, match="notes.txt, src"):
        init_pki(target, ["apiserver-a"], force=True)
    assert (target / "notes.txt").read_text() == "keep me" and (target / "src").is_dir()


# --------------------------------------------------------------------------- real-server extras


def test_server_hosts_go_to_that_server_only(tmp_path: Path) -> None:
    """Each kube-apiserver of ``mvproxy demo --real`` has its own 127.0.0.x."""
    directory = tmp_path / "certs"
    init_pki(directory, SERVER_IDS, ["10.96.0.1"],
             server_hosts={"apiserver-a": ["127.0.0.2"], "apiserver-b": ["127.0.0.3"]})
    for sid, own, other in (("apiserver-a", "127.0.0.2", "127.0.0.3"),
                            ("apiserver-b", "127.0.0.3", "127.0.0.2")):
        for stem in ("apiserver", "mvproxy"):
            _, ips = san(load(directory / sid / f"{stem}.crt"))
            assert {own, "10.96.0.1", "127.0.0.1"} <= ips and other not in ips, (sid, stem)
    with pytest.raises(PKIError, match="apiserver-z"):
        init_pki(tmp_path / "bad", SERVER_IDS, server_hosts={"apiserver-z": ["127.0.0.9"]})
    with pytest.raises(PKIError, match="invalid host"):
        init_pki(tmp_path / "bad", SERVER_IDS, server_hosts={"apiserver-a": ["no_such host"]})
    assert not (tmp_path / "bad").exists()


def test_service_account_key_pair_is_rsa_and_survives_force(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import rsa

    directory = tmp_path / "certs"
    written = init_pki(directory, ["apiserver-a"], service_account_key=True)
    assert {directory / "sa.key", directory / "sa.pub"} <= set(written)
    key = serialization.load_pem_private_key((directory / "sa.key").read_bytes(), None)
    assert isinstance(key, rsa.RSAPrivateKey) and key.key_size == 2048
    assert (directory / "sa.key").read_text().startswith("-----BEGIN RSA PRIVATE KEY")
    public = serialization.load_pem_public_key((directory / "sa.pub").read_bytes())
    assert public.public_numbers() == key.public_key().public_numbers()
    assert stat.S_IMODE((directory / "sa.key").stat().st_mode) == 0o600
    # --force recognises the pair (and users/) as its own, and writes a new one.
    from mvproxy.devpki import issue_client_certificate
    issue_client_certificate(directory, "alice", "alice")
    init_pki(directory, ["apiserver-a"], force=True, service_account_key=True)
    again = serialization.load_pem_private_key((directory / "sa.key").read_bytes(), None)
    assert again.public_key().public_numbers() != key.public_key().public_numbers()
    assert not (directory / "users").exists()


def test_issued_client_certificate_names_the_user_and_chains_to_the_ca(tmp_path: Path) -> None:
    from mvproxy.devpki import issue_client_certificate

    directory = tmp_path / "certs"
    init_pki(directory, ["apiserver-a"])
    crt, key = issue_client_certificate(directory, "kcm", "system:kube-controller-manager")
    assert (crt, key) == (directory / "users/kcm.crt", directory / "users/kcm.key")
    cert = load(crt)
    der = cert.public_bytes(serialization.Encoding.DER)
    assert subject_identity(der) == ("system:kube-controller-manager", ())
    assert ekus(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    cert.verify_directly_issued_by(load(directory / "ca.crt"))
    crt, _ = issue_client_certificate(directory, "bob", "bob", ["dev", "ops"])  # a second one
    assert subject_identity(load(crt).public_bytes(serialization.Encoding.DER)) == \
        ("bob", ("dev", "ops"))
    with pytest.raises(PKIError, match="invalid certificate name"):
        issue_client_certificate(directory, "../x", "x")
    with pytest.raises(PKIError, match="cluster CA"):
        issue_client_certificate(tmp_path / "nothing", "x", "x")


def test_a_rotated_front_proxy_client_pair_lives_as_long_as_asked(tmp_path: Path) -> None:
    """For rotation and expiry tests against real servers: seconds, not days."""
    from mvproxy.devpki import rotate_front_proxy_client

    directory = tmp_path / "certs"
    init_pki(directory, ["apiserver-a"])
    crt = directory / "apiserver-a" / "front-proxy-client.crt"
    key = directory / "apiserver-a" / "front-proxy-client.key"
    before = load(crt)
    cert = rotate_front_proxy_client(directory, "apiserver-a", lifetime=timedelta(seconds=20))
    assert load(crt) == cert and cert.serial_number != before.serial_number
    left = cert.not_valid_after_utc - datetime.now(timezone.utc)
    assert timedelta(seconds=15) < left <= timedelta(seconds=20)
    assert cert.not_valid_before_utc < datetime.now(timezone.utc)
    assert cn(cert) == "front-proxy-client" and ekus(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    cert.verify_directly_issued_by(load(directory / "front-proxy-ca.crt"))
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    assert private.public_key().public_numbers() == cert.public_key().public_numbers()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert sorted(p.name for p in crt.parent.iterdir()) == sorted(
        p.name for p in before_names(directory))  # nothing left aside
    with pytest.raises(PKIError, match="no server"):
        rotate_front_proxy_client(directory, "apiserver-z", lifetime=timedelta(seconds=5))
    with pytest.raises(PKIError, match="positive"):
        rotate_front_proxy_client(directory, "apiserver-a", lifetime=timedelta(0))


def before_names(directory: Path) -> list[Path]:
    return [directory / "apiserver-a" / f"{stem}.{ext}"
            for stem in ("apiserver", "mvproxy", "front-proxy-client") for ext in ("crt", "key")]


def test_sidecar_config_is_a_valid_configuration_over_the_layout(pki_dir: Path) -> None:
    """Tests and benchmarks start daemons from it: it must validate as it is, and name
    the files ``init_pki`` wrote for the member."""
    doc = sidecar_config(pki_dir, "https://127.0.0.1:6443", 8443, 8444,
                         server_id="b", member="apiserver-a")
    config = from_document(doc, "<test>")
    assert (config.server_id, config.secure_port, config.admin.port) == ("b", 8443, 8444)
    for path in (doc["tlsCertFile"], doc["tlsPrivateKeyFile"], doc["clientCAFile"],
                 *(doc["backend"][key] for key in ("caFile", "certFile", "keyFile"))):
        assert Path(path).is_file() and Path(path).is_relative_to(pki_dir)
    assert Path(doc["tlsCertFile"]).parent.name == "apiserver-a"
