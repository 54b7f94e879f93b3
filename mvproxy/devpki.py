"""Development PKI generation: the CAs and certificates of a demo or test cluster.

``init_pki`` writes a self-contained layout (cluster CA, front-proxy CA, admin client,
and per-server serving / peer / front-proxy-client certificates, optionally a
service-account key pair; ``certs/README.md``) with private keys that are never
world-readable. ``issue_client_certificate`` adds a user certificate signed by its
cluster CA; ``rotate_front_proxy_client`` replaces a server's front-proxy client pair
(rotation tests, lifetimes of seconds); ``sidecar_config`` is the configuration of a
mvproxy that serves with a layout's certificates (tests and benchmarks start such
daemons). ``mvproxy certs init``, the demo and the tests use it; the daemon never
does (it reads certificates through ``tls``), so this module stays off the request
path.

It must not: do network I/O, or let ``cryptography`` exceptions escape (callers see
``PKIError``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mvproxy.config import SERVER_ID_RE
from mvproxy.errors import PKIError
from mvproxy.tls import StrPath

__all__ = ["init_pki", "issue_client_certificate", "rotate_front_proxy_client",
           "sidecar_config"]

#: Certificates are back-dated by this much so a peer whose clock is slightly behind
#: does not reject a freshly generated certificate as "not yet valid".
CLOCK_SKEW = timedelta(minutes=5)
#: Upper bound for ``days``: far enough for any dev cluster, well inside X.509 dates.
MAX_DAYS = 36500

CLUSTER_CA_CN = "mvproxy-ca"
FRONT_PROXY_CA_CN = "front-proxy-ca"
ADMIN_CN = "kubernetes-admin"
ADMIN_GROUP = "system:masters"
APISERVER_CN = "kube-apiserver"
MVPROXY_CN = "mvproxy"
FRONT_PROXY_CLIENT_CN = "front-proxy-client"

#: Names every local serving certificate answers to.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
#: The in-cluster names of the ``kubernetes`` Service, served by kube-apiserver.
KUBERNETES_SERVICE_HOSTS = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)

#: Top-level files of the layout; a server ID may not collide with them.
TOP_LEVEL_FILES = (
    "ca.crt",
    "ca.key",
    "front-proxy-ca.crt",
    "front-proxy-ca.key",
    "admin.crt",
    "admin.key",
)
#: The service-account key pair (``service_account_key=True``), named as kubeadm names it.
SERVICE_ACCOUNT_FILES = ("sa.key", "sa.pub")
#: Where ``issue_client_certificate`` writes ``<name>.crt`` and ``<name>.key``.
USERS_DIR = "users"
#: Files in an existing directory that init_pki keeps and ignores when deciding
#: whether the directory is "empty" (the repository ships ``certs/README.md``).
PRESERVED_FILES = ("README.md",)

_HOST_LABEL = r"[A-Za-z0-9](?:[-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
_HOST_RE = re.compile(rf"^(?:\*\.)?{_HOST_LABEL}(?:\.{_HOST_LABEL})*$")


# --------------------------------------------------------------------------- validation


def _validate_server_ids(server_ids: Sequence[str]) -> list[str]:
    """Server IDs become directory names and DNS SANs, so only DNS subdomain names pass."""
    if isinstance(server_ids, str):
        raise PKIError(f"server IDs must be a list of names, not the string {server_ids!r}")
    ids = list(server_ids)
    if not ids:
        raise PKIError("at least one server ID is required (e.g. --server-id apiserver-a)")
    seen: set[str] = set()
    for server_id in ids:
        if not isinstance(server_id, str) or not server_id:
            raise PKIError(f"invalid server ID {server_id!r}: must be a non-empty name")
        if len(server_id) > 253 or not SERVER_ID_RE.fullmatch(server_id):
            raise PKIError(
                f"invalid server ID {server_id!r}: use lowercase letters, digits, '-' and '.'"
                " (a DNS subdomain name, e.g. apiserver-a); no '/', '..' or spaces"
            )
        if server_id in TOP_LEVEL_FILES:
            raise PKIError(f"invalid server ID {server_id!r}: clashes with the file {server_id}")
        if server_id in seen:
            raise PKIError(f"duplicate server ID {server_id!r}")
        seen.add(server_id)
    return ids


def _validate_days(days: int) -> int:
    """Reject lifetimes that would make an already-expired or unrepresentable cert."""
    if isinstance(days, bool) or not isinstance(days, int):
        raise PKIError(f"days must be a whole number, got {days!r}")
    if not 1 <= days <= MAX_DAYS:
        raise PKIError(f"days must be between 1 and {MAX_DAYS}, got {days}")
    return days


def _general_name(host: str) -> x509.GeneralName:
    """An entry that parses as an IP address is an IP SAN; anything else a DNS SAN."""
    if not isinstance(host, str) or not host.strip():
        raise PKIError(f"invalid host {host!r}: must be a non-empty DNS name or IP address")
    host = host.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    if len(host) > 253 or not _HOST_RE.match(host):
        raise PKIError(f"invalid host {host!r}: not an IP address or a DNS name")
    return x509.DNSName(host.lower())


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    """SubjectAlternativeName with duplicates removed, first occurrence wins."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        name = _general_name(host)
        if name not in names:
            names.append(name)
    return x509.SubjectAlternativeName(names)


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class _Issued:
    """A generated certificate with its private key."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _new_key() -> ec.EllipticCurvePrivateKey:
    """ECDSA P-256: fast to generate and universally supported by TLS stacks."""
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _validity(
    builder: x509.CertificateBuilder, now: datetime, days: int
) -> x509.CertificateBuilder:
    return builder.not_valid_before(now - CLOCK_SKEW).not_valid_after(now + timedelta(days=days))


def _key_usage(*, signs_certificates: bool) -> x509.KeyUsage:
    """Digital signatures (ECDSA TLS) for everyone; certificate and CRL signing for CAs."""
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=signs_certificates,
        crl_sign=signs_certificates, encipher_only=False, decipher_only=False)


def _make_ca(common_name: str, now: datetime, days: int) -> _Issued:
    """A self-signed CA that may sign leaves only (path length 0)."""
    key = _new_key()
    name = _name(common_name)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs_certificates=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    cert = _validity(builder, now, days).sign(key, hashes.SHA256())
    return _Issued(cert, key)


def _make_leaf(
    issuer: _Issued,
    common_name: str,
    usages: Sequence[x509.ObjectIdentifier],
    now: datetime,
    days: int,
    *,
    organizations: Sequence[str] = (),
    hosts: Sequence[str] = (),
) -> _Issued:
    """A leaf certificate for the given extended key usages, signed by ``issuer``."""
    key = _new_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name, organizations))
        .issuer_name(issuer.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
    )
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    cert = _validity(builder, now, days).sign(issuer.key, hashes.SHA256())
    return _Issued(cert, key)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Create the key file 0600 from the start, so it is never readable by others."""
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    os.chmod(path, 0o644)  # exact mode whatever the umask


def _write_service_account_keys(root: Path) -> list[Path]:
    """RSA 2048, as kubeadm writes it: ``sa.key`` (PKCS#1, 0600) and ``sa.pub`` (SPKI).
    kube-apiserver signs service-account tokens with it; every server shares it."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    written = []
    for name, data, mode in (("sa.key", private, 0o600), ("sa.pub", public, 0o644)):
        fd = os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(root / name, mode)
        written.append(root / name)
    return written


def _write_pair(directory: Path, stem: str, issued: _Issued) -> list[Path]:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    _write_cert(cert_path, issued.cert)
    _write_key(key_path, issued.key)
    return [cert_path, key_path]


def _server_hosts(server_id: str, hosts: Sequence[str]) -> list[str]:
    """SANs of mvproxy's serving and peer certificates."""
    return [*hosts, *LOOPBACK_HOSTS, "kubernetes.default.svc", server_id]


def _generate_layout(
    root: Path, server_ids: Sequence[str], hosts: Sequence[str], days: int,
    server_hosts: Mapping[str, Sequence[str]], service_account_key: bool,
) -> list[str]:
    """Write the whole PKI under ``root``; returns paths relative to ``root``."""
    now = datetime.now(UTC).replace(microsecond=0)
    server_auth, client_auth = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH
    ca = _make_ca(CLUSTER_CA_CN, now, days)
    front_ca = _make_ca(FRONT_PROXY_CA_CN, now, days)
    admin = _make_leaf(ca, ADMIN_CN, [client_auth], now, days, organizations=[ADMIN_GROUP])

    written = _write_pair(root, "ca", ca)
    written += _write_pair(root, "front-proxy-ca", front_ca)
    written += _write_pair(root, "admin", admin)
    for server_id in server_ids:
        sub = root / server_id
        sub.mkdir()
        os.chmod(sub, 0o755)
        own = [*server_hosts.get(server_id, ()), *hosts]
        apiserver_hosts = [*own, *LOOPBACK_HOSTS, *KUBERNETES_SERVICE_HOSTS]
        mvproxy_hosts = _server_hosts(server_id, own)
        leaves = {
            "apiserver": _make_leaf(
                ca, APISERVER_CN, [server_auth], now, days, hosts=apiserver_hosts
            ),
            "mvproxy": _make_leaf(ca, MVPROXY_CN, [server_auth], now, days, hosts=mvproxy_hosts),
            "front-proxy-client": _make_leaf(
                front_ca, FRONT_PROXY_CLIENT_CN, [client_auth], now, days
            ),
        }
        for stem, issued in leaves.items():
            written += _write_pair(sub, stem, issued)
    if service_account_key:
        written += _write_service_account_keys(root)
    return [str(p.relative_to(root)) for p in written]


_TOP_LEVEL_STEMS = ("ca", "front-proxy-ca", "admin")
_SERVER_STEMS = ("apiserver", "mvproxy", "front-proxy-client")
_OLD_SERVER_STEMS = ("peer",)
"""Written by earlier versions (a cluster-CA peer certificate); ``--force`` may replace them."""


def _pair_names(stems: Sequence[str]) -> frozenset[str]:
    return frozenset(f"{stem}.{ext}" for stem in stems for ext in ("crt", "key"))


def _foreign_content(directory: Path) -> list[str]:
    """Entries ``--force`` must not delete: anything ``init_pki`` would not have written.

    A server-ID directory counts as ours only if it holds nothing but our pairs, so a
    mistyped DIR (a project folder, a home directory) is never wiped.
    """
    ours = _pair_names(_TOP_LEVEL_STEMS) | set(SERVICE_ACCOUNT_FILES)
    per_server = _pair_names(_SERVER_STEMS + _OLD_SERVER_STEMS)
    foreign = []
    for entry in directory.iterdir():
        if entry.name in PRESERVED_FILES or entry.name.startswith(".") or entry.name in ours:
            continue
        children = [c.name for c in entry.iterdir()] if entry.is_dir() and \
            not entry.is_symlink() else []
        if children and all(name in per_server for name in children):
            continue
        if entry.name == USERS_DIR and all(name.endswith((".crt", ".key"))
                                           for name in children):
            continue
        foreign.append(entry.name)
    return sorted(foreign)


def _existing_content(directory: Path) -> list[str]:
    """Entries init_pki would overwrite; README.md and dotfiles don't count."""
    return sorted(
        entry.name
        for entry in directory.iterdir()
        if entry.name not in PRESERVED_FILES and not entry.name.startswith(".")
    )


def _swap_into_place(staging: Path, directory: Path) -> None:
    """Replace ``directory`` by ``staging`` with two renames, restoring it on failure."""
    if not directory.exists():
        os.rename(staging, directory)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
    backup.rmdir()
    os.rename(directory, backup)
    try:
        os.rename(staging, directory)
    except BaseException:
        os.rename(backup, directory)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def init_pki(
    directory: StrPath,
    server_ids: Sequence[str],
    hosts: Sequence[str] = (),
    days: int = 365,
    force: bool = False,
    *,
    server_hosts: Mapping[str, Sequence[str]] | None = None,
    service_account_key: bool = False,
) -> list[Path]:
    """Generate a development PKI under ``directory``; returns the files written.

    ``hosts`` are extra SANs of every server's certificates, ``server_hosts`` (server
    ID -> hosts) of one server's only (e.g. its own 127.0.0.x). ``service_account_key``
    adds ``sa.key``/``sa.pub`` (RSA), the key pair kube-apiserver signs tokens with.

    Everything is generated in a sibling temporary directory and renamed into place, so
    an error never leaves a half-written PKI behind. An existing directory is only
    replaced with ``force`` (its README.md and dotfiles are carried over).
    """
    directory = Path(directory)
    ids = _validate_server_ids(server_ids)
    days = _validate_days(days)
    if isinstance(hosts, str):
        raise PKIError(f"hosts must be a list of names, not the string {hosts!r}")
    hosts = list(hosts)
    own_hosts = {sid: list(h) for sid, h in (server_hosts or {}).items()}
    unknown = sorted(set(own_hosts) - set(ids))
    if unknown:
        raise PKIError(f"server_hosts names unknown server ID(s) {', '.join(unknown)}")
    for sid in ids:  # validate hosts before touching the disk
        if isinstance(own_hosts.get(sid), str):
            raise PKIError(f"hosts of {sid} must be a list of names, not a string")
        _san(_server_hosts(sid, [*own_hosts.get(sid, ()), *hosts]))

    if directory.exists() and not directory.is_dir():
        raise PKIError(f"{directory} exists and is not a directory")
    if directory.is_dir() and force:
        foreign = _foreign_content(directory)
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise PKIError(f"{directory} holds files that mvproxy certs init did not write "
                           f"({shown}); refusing to replace it even with --force")
    if directory.is_dir() and not force:
        existing = _existing_content(directory)
        if existing:
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            raise PKIError(
                f"{directory} already contains {shown}; pass --force to overwrite the PKI there"
            )

    target = directory.absolute()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
    except OSError as e:
        raise PKIError(f"cannot create {directory}: {e.strerror or e}") from e
    try:
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide certificates; keys stay 0600
        relative = _generate_layout(staging, ids, hosts, days, own_hosts, service_account_key)
        if directory.is_dir():
            for name in PRESERVED_FILES:
                if (directory / name).is_file():
                    shutil.copy2(directory / name, staging / name)
            for entry in directory.iterdir():
                if entry.name.startswith(".") and not (staging / entry.name).exists():
                    copy = (
                        shutil.copytree
                        if entry.is_dir() and not entry.is_symlink()
                        else shutil.copy2
                    )
                    copy(entry, staging / entry.name)
        _swap_into_place(staging, target)
    except OSError as e:
        raise PKIError(f"cannot write PKI to {directory}: {e.strerror or e}") from e
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return [directory / rel for rel in relative]


def _load_ca(directory: Path, stem: str = "ca") -> _Issued:
    """A CA of an ``init_pki`` directory (the cluster CA, or ``front-proxy-ca``), for
    signing more certificates."""
    try:
        cert = x509.load_pem_x509_certificate((directory / f"{stem}.crt").read_bytes())
        key = serialization.load_pem_private_key((directory / f"{stem}.key").read_bytes(), None)
    except (OSError, ValueError, TypeError) as e:
        what = "the cluster CA" if stem == "ca" else stem
        raise PKIError(f"cannot read {what} in {directory} ({stem}.crt, {stem}.key): {e}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PKIError(f"{directory / f'{stem}.key'} is not the ECDSA key mvproxy certs init "
                       "writes")
    return _Issued(cert, key)


def rotate_front_proxy_client(directory: StrPath, server_id: str, *,
                              lifetime: timedelta) -> x509.Certificate:
    """Replace server ``server_id``'s ``front-proxy-client`` pair in the ``init_pki``
    directory ``directory`` with a new key and certificate from its front-proxy CA,
    valid from now (back-dated by ``CLOCK_SKEW``) for ``lifetime``, which may be
    seconds: certificate rotation and expiry tests. Both files are written aside and
    renamed into place one right after the other (a reader may still see one new file
    and one old: mvproxy's reloader looks again at its next check). Returns the new
    certificate."""
    root = Path(directory)
    sub = root / server_id
    if not SERVER_ID_RE.fullmatch(server_id or "") or not sub.is_dir():
        raise PKIError(f"no server {server_id!r} in {root}")
    if lifetime <= timedelta(0):
        raise PKIError(f"lifetime must be positive, got {lifetime}")
    ca = _load_ca(root, "front-proxy-ca")
    now = datetime.now(UTC)
    key = _new_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(FRONT_PROXY_CLIENT_CN))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            ca.key.public_key()), critical=False)
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + lifetime)
    )
    issued = _Issued(builder.sign(ca.key, hashes.SHA256()), key)
    staging = Path(tempfile.mkdtemp(prefix=".rotate-", dir=sub))
    try:
        _write_pair(staging, "front-proxy-client", issued)
        os.replace(staging / "front-proxy-client.key", sub / "front-proxy-client.key")
        os.replace(staging / "front-proxy-client.crt", sub / "front-proxy-client.crt")
    except OSError as e:
        raise PKIError(f"cannot write {sub / 'front-proxy-client.crt'}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return issued.cert


def issue_client_certificate(
    directory: StrPath,
    name: str,
    common_name: str,
    organizations: Sequence[str] = (),
    days: int = 365,
) -> tuple[Path, Path]:
    """Sign a user's client certificate with the cluster CA of the ``init_pki``
    directory ``directory``: ``users/<name>.crt`` and ``.key`` (replaced if present).

    The user is ``common_name`` and its groups ``organizations``, as kube-apiserver
    reads them (e.g. ``system:kube-controller-manager``, or a user in no group).
    Returns (certificate, key).
    """
    root = Path(directory)
    if not SERVER_ID_RE.fullmatch(name or ""):
        raise PKIError(f"invalid certificate name {name!r}: use lowercase letters, digits, "
                       "'-' and '.'")
    if not isinstance(common_name, str) or not common_name.strip():
        raise PKIError(f"invalid common name {common_name!r}")
    if isinstance(organizations, str):
        raise PKIError(f"organizations must be a list, not the string {organizations!r}")
    days = _validate_days(days)
    ca = _load_ca(root)
    now = datetime.now(UTC).replace(microsecond=0)
    issued = _make_leaf(ca, common_name, [ExtendedKeyUsageOID.CLIENT_AUTH], now, days,
                        organizations=list(organizations))
    users = root / USERS_DIR
    try:
        users.mkdir(mode=0o755, exist_ok=True)
        for ext in ("crt", "key"):
            (users / f"{name}.{ext}").unlink(missing_ok=True)
        cert_path, key_path = _write_pair(users, name, issued)
    except OSError as e:
        raise PKIError(f"cannot write {users / name}.crt: {e.strerror or e}") from e
    return cert_path, key_path


def sidecar_config(pki: StrPath, backend: str, port: int, admin: int, *,
                   server_id: str = "a", member: str = "a") -> dict[str, Any]:
    """An MvproxyConfiguration document (a dict, before YAML) for a mvproxy on
    127.0.0.1 in front of ``backend``, serving and authenticating with ``init_pki``'s
    layout in ``pki``: the certificates of ``member``'s directory, the cluster CA for
    clients and the backend. Callers add the sections their case needs."""
    root, own = Path(pki), Path(pki) / member
    return {
        "apiVersion": "mvproxy.io/v1alpha1", "kind": "MvproxyConfiguration",
        "serverID": server_id, "bindAddress": "127.0.0.1", "securePort": port,
        "tlsCertFile": str(own / "mvproxy.crt"),
        "tlsPrivateKeyFile": str(own / "mvproxy.key"),
        "clientCAFile": str(root / "ca.crt"),
        "backend": {"url": backend, "caFile": str(root / "ca.crt"),
                    "certFile": str(own / "front-proxy-client.crt"),
                    "keyFile": str(own / "front-proxy-client.key")},
        "admin": {"bindAddress": "127.0.0.1", "port": admin},
    }
