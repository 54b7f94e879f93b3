"""Checks that span several settings: the certificate files a Config names.

``config`` checks each file exists and is readable; this module checks what is in
them (expired, key does not match certificate, not signed by the CA that will verify
it, a peer client CA that also signs users) so that ``check-config`` and ``run``
fail before listening, naming the setting.
"""

from __future__ import annotations

from collections.abc import Collection

from mvproxy import tls
from mvproxy.config import Config
from mvproxy.errors import ConfigError, PKIError, Problem


def _pairs(cfg: Config) -> list[tuple[str, str | None, str | None, str | None]]:
    """(YAML path, certificate, key, CA that verifies it) for every leaf we present."""
    return [
        ("tlsCertFile", cfg.tls_cert_file, cfg.tls_private_key_file, None),
        ("backend.certFile", cfg.backend.cert_file, cfg.backend.key_file, None),
        # Peers configured like this one verify it with their peer.clientCAFile.
        ("peer.certFile", cfg.peer.cert_file, cfg.peer.key_file, cfg.peer.client_ca_file),
    ]


def _cas(cfg: Config) -> list[tuple[str, str | None]]:
    return [
        ("clientCAFile", cfg.client_ca_file),
        ("backend.caFile", cfg.backend.ca_file),
        ("peer.caFile", cfg.peer.ca_file),
        ("peer.clientCAFile", cfg.peer.client_ca_file),
    ]


def shared_ca_problems(cfg: Config) -> list[Problem]:
    """A peer client CA that also signs users lets a user certificate named like a peer
    (the CSR API issues those) assert any identity, ``system:masters`` included."""
    peer_ca, client_ca = cfg.peer.client_ca_file, cfg.client_ca_file
    if not peer_ca or not client_ca or cfg.peer.insecure_shared_ca:
        return []
    try:
        shared = tls.shared_cas(peer_ca, client_ca)
    except PKIError:
        return []  # unreadable bundles are reported by material_problems
    if not shared:
        return []
    return [Problem("peer.clientCAFile", (
        f"shares a CA with clientCAFile ({'; '.join(shared)}): every certificate that CA "
        "issues to a user with an allowed peer name could act as a peer and claim any "
        "user; use a CA that signs only proxies (kubeadm's front-proxy-ca.crt), or set "
        "peer.insecureSharedCA: true for a test cluster"))]


def material_problems(cfg: Config, only: Collection[str] | None = None) -> list[Problem]:
    """Every problem with the certificate material, each under its YAML path; with
    ``only``, just the checks of those settings (a certificate reload reads no file
    outside the group it reloads)."""
    def wanted(path: str) -> bool:
        return only is None or path in only

    problems: list[Problem] = []
    for path, cert, key, ca in _pairs(cfg):
        if cert and wanted(path):
            found = tls.check_certificate(cert, key_file=key, ca_file=ca)
            problems += [Problem(path, f"{p.path}: {p.message}") for p in found]
    for path, ca in _cas(cfg):
        if ca and wanted(path):
            found = tls.check_certificate(ca)
            problems += [Problem(path, f"{p.path}: {p.message}") for p in found]
    return problems + (shared_ca_problems(cfg) if wanted("peer.clientCAFile") else [])


def check(cfg: Config, source: str) -> Config:
    """Return ``cfg`` unchanged, or raise one ConfigError listing every problem."""
    problems = material_problems(cfg)
    if problems:
        raise ConfigError(source, problems)
    return cfg
