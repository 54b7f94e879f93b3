"""TLS at run time: every SSL context mvproxy uses, and certificates checked and read.

This module owns:

* ``server_context`` / ``client_context`` — every ``ssl.SSLContext`` mvproxy uses, so TLS
  policy (TLS 1.2 minimum, verification, ALPN) lives in one place;
* ``SwappableContext`` — an SSL context a certificate reload may replace (``certreload``);
* ``check_certificate`` — problems with certificate files described in words, for
  ``check-config`` and startup;
* ``subject_identity`` / ``common_names`` / ``issued_by_any`` — what ``identity`` reads
  from a peer's certificate.

Generating certificates is ``devpki``'s job, not this module's: the request path
imports this one. It must not: do network I/O, decide who is trusted as a peer (that
is ``identity.py``), put key material into any message, or let ``ssl``/``cryptography``
exceptions escape — callers see ``PKIError`` (or a list of ``Problem``).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from mvproxy.errors import PKIError, Problem

__all__ = [
    "SwappableContext",
    "check_certificate",
    "client_context",
    "current_context",
    "server_context",
    "subject_identity",
]

StrPath = str | os.PathLike[str]

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


# --------------------------------------------------------------------------- SSL contexts


def _require_readable(path: StrPath, what: str) -> None:
    """Name the missing/unreadable file ourselves: ssl's FileNotFoundError does not."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise PKIError(f"cannot read {what} {path}: {e.strerror or e}") from e


def _pem_problem(path: StrPath, kind: str) -> str | None:
    """Why ``path`` is not a usable PEM ``kind`` ("certificate" or "key"), or None."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    try:
        if kind == "certificate":
            x509.load_pem_x509_certificate(data)
        else:
            serialization.load_pem_private_key(data, password=None)
    except TypeError:
        return f"private key {path} is encrypted; mvproxy needs an unencrypted key"
    except (ValueError, UnsupportedAlgorithm):
        return f"{path} is not a PEM {'certificate' if kind == 'certificate' else 'private key'}"
    return None


def _load_cert_chain(ctx: ssl.SSLContext, cert_file: StrPath, key_file: StrPath | None) -> None:
    """load_cert_chain with every failure turned into a PKIError that names the files."""
    _require_readable(cert_file, "certificate")
    if key_file is not None:
        _require_readable(key_file, "private key")
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        key_name = key_file if key_file is not None else cert_file
        if e.reason == "KEY_VALUES_MISMATCH":
            raise PKIError(f"private key {key_name} does not match certificate {cert_file}") from e
        detail = _pem_problem(cert_file, "certificate") or (
            _pem_problem(key_file, "key") if key_file is not None else None
        )
        raise PKIError(
            detail or f"cannot load certificate {cert_file} with key {key_name}: {e.reason or e}"
        ) from e
    except OSError as e:
        raise PKIError(f"cannot load certificate {cert_file} / key {key_file}: {e}") from e


def _load_ca(ctx: ssl.SSLContext, ca_file: StrPath, what: str) -> None:
    _require_readable(ca_file, what)
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except (ssl.SSLError, OSError, ValueError) as e:
        raise PKIError(f"{what} {ca_file} contains no usable PEM certificate") from e


def _base_context(protocol: int, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(list(alpn))
    return ctx


SESSION_TICKETS = 0
"""TLS 1.3 session tickets a server sends after each handshake (OpenSSL's default is 2).
None: mvproxy's clients keep no TLS session cache (client-go, kubectl, mvproxy's own
upstream connections), so a ticket is never used, and OpenSSL 3.0 pays for each one by
re-parsing the session, client certificate included: ~140 µs per ticket in-process,
~245 in ``bench/run.py`` (two are a third of a full mTLS connection; see
docs/performance.md). No ticket also means no resumed session outlives a certificate
reload that removed its CA. TLS 1.2 is left as it is."""


def server_context(
    cert_file: StrPath,
    key_file: StrPath,
    client_ca_file: StrPath | None = None,
    *,
    require_client_cert: bool = False,
    http2: bool = False,
) -> ssl.SSLContext:
    """TLS server context; client certificates are verified against ``client_ca_file``.

    Without ``require_client_cert`` a client may still connect without a certificate
    (bearer tokens), but one it presents must chain to the CA. ``http2``: ``h2`` is
    offered in ALPN before ``http/1.1`` (the server's order decides in OpenSSL).
    """
    if require_client_cert and client_ca_file is None:
        raise PKIError("requiring client certificates needs a client CA file")
    ctx = _base_context(ssl.PROTOCOL_TLS_SERVER,
                        ("h2", "http/1.1") if http2 else ("http/1.1",))
    ctx.num_tickets = SESSION_TICKETS
    _load_cert_chain(ctx, cert_file, key_file)
    if client_ca_file is not None:
        _load_ca(ctx, client_ca_file, "client CA file")
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def client_context(
    ca_file: StrPath | None = None,
    cert_file: StrPath | None = None,
    key_file: StrPath | None = None,
    *,
    http2: bool = False,
) -> ssl.SSLContext:
    """TLS client context that always verifies the server (system trust if no CA file);
    ``http2``: offering ``h2`` before ``http/1.1``."""
    if key_file is not None and cert_file is None:
        raise PKIError(f"private key {key_file} given without a client certificate")
    ctx = _base_context(ssl.PROTOCOL_TLS_CLIENT, ("h2", "http/1.1") if http2 else ("http/1.1",))
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    if ca_file is None:
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:
        _load_ca(ctx, ca_file, "CA file")
    if cert_file is not None:
        _load_cert_chain(ctx, cert_file, key_file)
    return ctx


class SwappableContext:
    """An SSL context that a certificate reload replaces as a whole.

    Whoever opens a connection reads ``context`` once, at the handshake: connections
    made with the old object keep it (and finish), new ones get the new material. A
    whole new object, rather than ``load_cert_chain`` into the live one, because a CA
    can only be added to a context, never removed, and a load that fails half-way
    would leave a certificate without its key.
    """

    __slots__ = ("context",)

    def __init__(self, context: ssl.SSLContext):
        self.context = context


def current_context(source: ssl.SSLContext | SwappableContext) -> ssl.SSLContext:
    """The context a new connection should use now."""
    return source.context if isinstance(source, SwappableContext) else source


# --------------------------------------------------------------------------- inspection


def _format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime(_TIME_FORMAT)


def _read_file(path: StrPath) -> bytes | Problem:
    """The file's bytes, or what stopped us reading it."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        return Problem(str(path), f"cannot read: {e.strerror or e}")


def _key_problems(cert: x509.Certificate, cert_file: StrPath, key_file: StrPath) -> list[Problem]:
    data = _read_file(key_file)
    if isinstance(data, Problem):
        return [data]
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        return [
            Problem(str(key_file), "private key is encrypted; mvproxy needs an unencrypted key")
        ]
    except (ValueError, UnsupportedAlgorithm):
        return [Problem(str(key_file), "not a PEM private key")]
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        return [Problem(str(key_file), f"private key does not match certificate {cert_file}")]
    return []


def issued_by_any(cert: x509.Certificate, cas: Sequence[x509.Certificate]) -> bool:
    """Whether one of ``cas`` directly signed ``cert`` (name and signature both match)."""
    for ca in cas:
        if ca.subject != cert.issuer:
            continue
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
            continue
        return True
    return False


def load_ca_bundle(path: StrPath, what: str) -> tuple[x509.Certificate, ...]:
    """Every certificate in a PEM bundle; PKIError naming ``what`` and the file otherwise."""
    try:
        return tuple(x509.load_pem_x509_certificates(Path(path).read_bytes()))
    except OSError as exc:
        raise PKIError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise PKIError(f"{what} {path} is not a PEM certificate bundle") from exc


def _ca_problems(cert: x509.Certificate, cert_file: StrPath, ca_file: StrPath) -> list[Problem]:
    data = _read_file(ca_file)
    if isinstance(data, Problem):
        return [data]
    try:
        cas = x509.load_pem_x509_certificates(data)
    except ValueError:
        return [Problem(str(ca_file), "not a PEM certificate bundle")]
    if not issued_by_any(cert, cas):
        issuer = cert.issuer.rfc4514_string() or "(empty)"
        return [
            Problem(
                str(cert_file),
                f"not signed by any certificate in {ca_file} (issuer is {issuer})",
            )
        ]
    return []


def check_certificate(
    cert_file: StrPath,
    *,
    key_file: StrPath | None = None,
    ca_file: StrPath | None = None,
    now: datetime | None = None,
) -> list[Problem]:
    """Everything wrong with a certificate (and its key / CA), in words; never raises."""
    data = _read_file(cert_file)
    if isinstance(data, Problem):
        return [data]
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError:
        return [Problem(str(cert_file), "not a PEM certificate")]
    now = now or datetime.now(UTC)
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    problems: list[Problem] = []
    if now > cert.not_valid_after_utc:
        problems.append(
            Problem(str(cert_file), f"expired on {_format_time(cert.not_valid_after_utc)}")
        )
    elif now < cert.not_valid_before_utc:
        problems.append(
            Problem(str(cert_file), f"not valid until {_format_time(cert.not_valid_before_utc)}")
        )
    if key_file is not None:
        problems += _key_problems(cert, cert_file, key_file)
    if ca_file is not None:
        problems += _ca_problems(cert, cert_file, ca_file)
    return problems


def subject_identity(der_cert: bytes) -> tuple[str, tuple[str, ...]]:
    """(CN, organisations) of a certificate: Kubernetes' user name and groups.

    Read as Go's ``pkix.Name`` does (kube-apiserver's x509 authenticator): the *last*
    CN wins, every O counts, in order. Callers that grant rights should refuse a
    subject with several CNs (``common_names``) rather than pick one.
    """
    cert = _load_der(der_cert)
    common_names = _common_names(cert)
    cn = common_names[-1] if common_names else ""
    orgs = tuple(str(a.value) for a in cert.subject.get_attributes_for_oid(
        NameOID.ORGANIZATION_NAME))
    return cn, orgs


NODE_GROUP = "system:nodes"


def peer_serving_problem(der_cert: bytes, server_id: str, *, must_name: bool) -> str | None:
    """Why a serving certificate that ``peer.caFile`` verified is still no peer's, or None.

    The cluster CA also signs kubelets' serving certificates (``system:nodes``), which
    are never an mvproxy's. A peer found through a Lease or DNS must also be named in
    its own certificate (a DNS SAN equal to its server ID, as ``certs init`` writes):
    otherwise whoever may write a Lease could point a peer ID at any server the CA
    vouches for, and user requests (bearer tokens included) would go there.
    """
    try:
        cert = _load_der(der_cert)
    except PKIError:
        return "its serving certificate cannot be parsed"
    orgs = {str(a.value) for a in cert.subject.get_attributes_for_oid(
        NameOID.ORGANIZATION_NAME)}
    if NODE_GROUP in orgs:
        return "its serving certificate is a kubelet's (O=system:nodes), not a peer's"
    if must_name:
        try:
            names = cert.extensions.get_extension_for_class(
                x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            names = []
        if server_id not in names:
            return f"its serving certificate does not name {server_id!r} (DNS SAN)"
    return None


def common_names(der_cert: bytes) -> tuple[str, ...]:
    """Every CN of the subject, in order (more than one is ambiguous: OpenSSL-based tools
    read the first, Go the last)."""
    return _common_names(_load_der(der_cert))


def _common_names(cert: x509.Certificate) -> tuple[str, ...]:
    return tuple(str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME))


def _load_der(der_cert: bytes) -> x509.Certificate:
    try:
        return x509.load_der_x509_certificate(der_cert)
    except (ValueError, TypeError) as e:
        raise PKIError("peer certificate is not valid DER") from e


def shared_cas(first: StrPath, second: StrPath) -> list[str]:
    """Subjects of the CAs found in both PEM bundles, compared by public key (a CA
    re-issued with the same key signs the same certificates)."""
    def keys(path: StrPath) -> dict[bytes, str]:
        spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        return {cert.public_key().public_bytes(*spki): cert.subject.rfc4514_string()
                for cert in load_ca_bundle(path, "CA file")}

    theirs = keys(second)
    return sorted({subject for key, subject in keys(first).items() if key in theirs})
