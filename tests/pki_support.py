"""Certificates made on the fly for rotation tests: a new leaf signed by a CA of a
development PKI tree, written by rename as cert-manager or a careful operator would."""

from __future__ import annotations

import ipaddress
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def issue(tree: Path, stem: str, *, ca: str = "ca", days: float = 30, key_of: str | None = None,
          cn: str = "mvproxy", usage=ExtendedKeyUsageOID.SERVER_AUTH,
          orgs: tuple[str, ...] = (), dns: tuple[str, ...] = ("localhost",)) -> x509.Certificate:
    """A new ``<stem>.crt``/``.key`` signed by ``tree/<ca>``, written by rename (as a
    careful operator or cert-manager would). ``days`` < 0: already expired.
    ``key_of``: write no key, sign the public key of that other stem's key instead
    (so the key on disk no longer matches)."""
    ca_cert = x509.load_pem_x509_certificate((tree / f"{ca}.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((tree / f"{ca}.key").read_bytes(), None)
    key = (serialization.load_pem_private_key((tree / f"{key_of}.key").read_bytes(), None)
           if key_of else ec.generate_private_key(ec.SECP256R1()))
    now = datetime.now(timezone.utc)
    start, end = (now - timedelta(days=2), now + timedelta(days=days)) if days > 0 else \
        (now - timedelta(days=3), now - timedelta(days=1))
    names = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([*names, x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName(
                [*map(x509.DNSName, dns), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    replace(tree / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM))
    if not key_of:
        replace(tree / f"{stem}.key", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return cert


def replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


