"""Checks that span several settings: the certificate files a Config names.

``config`` checks each file exists and is readable; this module checks what is in
them (expired, key does not match certificate, not signed by the CA that will verify
it) so that ``check-config`` and ``run`` fail before listening, naming the setting.
"""

from __future__ import annotations

from mvproxy import pki
from mvproxy.config import Config
from mvproxy.errors import ConfigError, Problem


def _pairs(cfg: Config) -> list[tuple[str, str | None, str | None, str | None]]:
    """(YAML path, certificate, key, CA that verifies it) for every leaf we present."""
    return [
        ("tlsCertFile", cfg.tls_cert_file, cfg.tls_private_key_file, None),
        ("backend.certFile", cfg.backend.cert_file, cfg.backend.key_file, None),
        ("peer.certFile", cfg.peer.cert_file, cfg.peer.key_file, cfg.peer.ca_file),
    ]


def _cas(cfg: Config) -> list[tuple[str, str | None]]:
    return [
        ("clientCAFile", cfg.client_ca_file),
        ("backend.caFile", cfg.backend.ca_file),
        ("peer.caFile", cfg.peer.ca_file),
    ]


def material_problems(cfg: Config) -> list[Problem]:
    """Every problem with the certificate material, each under its YAML path."""
    problems: list[Problem] = []
    for path, cert, key, ca in _pairs(cfg):
        if cert:
            found = pki.check_certificate(cert, key_file=key, ca_file=ca)
            problems += [Problem(path, f"{p.path}: {p.message}") for p in found]
    for path, ca in _cas(cfg):
        if ca:
            found = pki.check_certificate(ca)
            problems += [Problem(path, f"{p.path}: {p.message}") for p in found]
    return problems


def check(cfg: Config, source: str) -> Config:
    """Return ``cfg`` unchanged, or raise one ConfigError listing every problem."""
    problems = material_problems(cfg)
    if problems:
        raise ConfigError(source, problems)
    return cfg
