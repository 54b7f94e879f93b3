"""Certificate rotation without a restart: files re-read when they change on disk.

The files are grouped in *units* that are loaded, checked and applied together: the
listener (serving pair, client CA, peer client CA; also the identity resolver's
CAs), the backend (client pair and CA; the certificate-less twin too) and peers
(client pair and CA). A unit is re-read when the content of one of its files changes
(a hash, so Kubernetes' symlink swap of a mounted Secret, an in-place rewrite and a
rename all count). New material is used only if it passes the start-up checks of
``preflight`` for its settings and builds into SSL contexts; it then replaces the
contexts as whole objects (``tls.SwappableContext``): new connections use it, open
ones finish with what they had. Anything else is logged once per broken version,
counted by role, and the loaded material stays.

Runs on the event loop: the files are a few kilobytes, and swapping on the loop
means no connection sees half an update.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import ssl
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from cryptography import x509

from mvproxy import preflight, tls
from mvproxy.config import Config
from mvproxy.errors import PKIError, Problem
from mvproxy.identity import IdentityResolver
from mvproxy.logs import kv

log = logging.getLogger(__name__)

ROLE_OF_SETTING = {
    "tlsCertFile": "serving",
    "clientCAFile": "client-ca",
    "peer.clientCAFile": "peer-client-ca",
    "backend.certFile": "backend-client",
    "backend.caFile": "backend-ca",
    "peer.certFile": "peer-client",
    "peer.caFile": "peer-ca",
}
"""YAML setting -> ``role`` label: a fixed set, whatever the files hold."""

MAX_FILE_BYTES = 16 * 1024 * 1024
"""Larger than any certificate or CA bundle (a full system trust store is ~250 KB)."""

MAX_CAS_REPORTED = 16
"""Expiry series per CA bundle: the earliest-expiring ones, so a bundle copied from a
system trust store cannot flood /metrics."""


@dataclass(frozen=True)
class Material:
    """Loaded, not yet in use: ``apply`` puts it in service."""

    apply: Callable[[], None]
    expiries: tuple[tuple[str, int, float], ...]
    """(role, index in its file, not-after as Unix time) of every certificate in it."""


class Unit:
    """Files loaded, checked and applied together."""

    def __init__(self, name: str, *, files: Iterable[str | None], settings: Iterable[str],
                 role: str, build: Callable[[], Material]):
        self.name = name
        self.files = tuple(dict.fromkeys(f for f in files if f))
        self.settings = frozenset(settings)
        """YAML paths whose start-up problems block this unit."""
        self.role = role
        """Role counted when no setting is to blame: a file that must not be read, or
        material that passes the checks but does not build."""
        self._build = build
        self.loaded: bytes | None = None
        """Fingerprint of the files in use."""
        self.refused: bytes | None = None
        """Fingerprint of the last version refused: not retried, not logged again."""
        self.expiries: tuple[tuple[str, int, float], ...] = ()

    def fingerprint(self) -> tuple[bytes, list[str]]:
        """Hash of every file's content (or of why it cannot be read), and the files
        that must not be read at all (not a regular file, oversized)."""
        digest, unusable = hashlib.sha256(), []
        for path in self.files:
            data, problem = _file_digest(path)
            digest.update(len(path).to_bytes(4, "big") + path.encode() + data)
            if problem:
                unusable.append(problem)
        return digest.digest(), unusable

    def load(self) -> None:
        """Start-up: build and apply, or raise ``PKIError``."""
        fingerprint, _ = self.fingerprint()
        material = self._build()
        material.apply()
        self.loaded, self.expiries = fingerprint, material.expiries

    def build(self) -> Material:
        return self._build()


class CertificateReloader:
    """Checks the units' files and swaps in new material that passes the checks."""

    def __init__(self, units: Iterable[Unit], *,
                 problems: Callable[[frozenset[str]], list[Problem]],
                 on_refused: Callable[[str], None] | None = None):
        self.units = tuple(units)
        self._problems = problems
        self._on_refused = on_refused or (lambda role: None)

    def load(self) -> None:
        for unit in self.units:
            unit.load()

    def expiries(self) -> list[tuple[str, int, float]]:
        """Every certificate in use, for ``mvproxy_certificate_expiry_timestamp_seconds``."""
        return [entry for unit in self.units for entry in unit.expiries]

    def check_now(self) -> list[str]:
        """Reload every unit whose files changed; returns the names of those reloaded."""
        reloaded = []
        for unit in self.units:
            if self._check(unit):
                reloaded.append(unit.name)
        return reloaded

    def _check(self, unit: Unit) -> bool:
        fingerprint, unusable = unit.fingerprint()
        if fingerprint == unit.loaded:
            if unit.refused is not None:
                log.info("certificate files are back to the ones in use", extra=kv(unit=unit.name))
                unit.refused = None
            return False
        if fingerprint == unit.refused:
            return False
        refusals: list[tuple[str, str]] = [(unit.role, problem) for problem in unusable]
        if not refusals:
            refusals = [(ROLE_OF_SETTING.get(p.path, unit.role), f"{p.path}: {p.message}")
                        for p in self._problems(unit.settings) if p.path in unit.settings]
        material = None
        if not refusals:
            try:
                material = unit.build()
            except PKIError as exc:
                refusals = [(unit.role, str(exc))]
            except _RoleError as exc:
                refusals = [(exc.role, exc.message)]
            except (ssl.SSLError, OSError, ValueError) as exc:
                refusals = [(unit.role, f"cannot load: {exc}")]
        if unit.fingerprint()[0] != fingerprint:
            return False  # still being written: look again at the next check
        if refusals:
            unit.refused = fingerprint
            for role in sorted({role for role, _ in refusals}):
                self._on_refused(role)
            log.warning("changed certificate files cannot be used; keeping the ones loaded",
                        extra=kv(unit=unit.name, problems="; ".join(m for _, m in refusals)))
            return False
        assert material is not None
        material.apply()
        unit.loaded, unit.refused, unit.expiries = fingerprint, None, material.expiries
        earliest = min((e for _, _, e in material.expiries), default=None)
        log.info("certificates reloaded; new connections use them", extra=kv(
            unit=unit.name, earliest_expiry=None if earliest is None else
            datetime.fromtimestamp(earliest, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")))
        return True

    async def run(self, interval: float) -> None:
        """Check every ``interval`` seconds until cancelled; never dies of a bad file."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.check_now()
            except Exception:  # a bug here must not stop rotation for good, nor serving
                log.exception("certificate reload check failed")


def _file_digest(path: str) -> tuple[bytes, str | None]:
    """SHA-256 of a file, read in chunks; never blocks on a FIFO put in its place, and
    never reads a file no certificate bundle could need to be."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"unreadable: {exc.errno}".encode(), None  # the checks name it
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return b"not a regular file", f"{path} is not a regular file"
        if info.st_size > MAX_FILE_BYTES:
            return (f"oversized: {info.st_size} {info.st_mtime_ns} {info.st_ino}".encode(),
                    f"{path} is larger than {MAX_FILE_BYTES} bytes")
        return hashlib.file_digest(handle, "sha256").digest(), None


class _RoleError(Exception):
    def __init__(self, role: str, message: str):
        super().__init__(message)
        self.role, self.message = role, message


def _leaf_expiry(role: str, path: str) -> tuple[str, int, float]:
    try:
        with open(path, "rb") as handle:
            cert = x509.load_pem_x509_certificate(handle.read())
    except (OSError, ValueError) as exc:
        raise _RoleError(role, f"{path}: not a readable PEM certificate") from exc
    return role, 0, cert.not_valid_after_utc.timestamp()


def _bundle(role: str, path: str | None) -> tuple[tuple[x509.Certificate, ...],
                                                    tuple[tuple[str, int, float], ...]]:
    """The CAs of a bundle and the expiry entries of its earliest-expiring ones."""
    if not path:
        return (), ()
    try:
        cas = tls.load_ca_bundle(path, "CA file")
    except PKIError as exc:
        raise _RoleError(role, str(exc)) from exc
    entries = sorted(((role, i, ca.not_valid_after_utc.timestamp()) for i, ca in enumerate(cas)),
                     key=lambda e: e[2])
    return cas, tuple(sorted(entries[:MAX_CAS_REPORTED], key=lambda e: e[1]))


def listener_context(cfg: Config) -> ssl.SSLContext:
    """Serving context; client certificates optional, verified by the client CA or the
    peer client CA if sent (``identity`` then tells which one issued it)."""
    ctx = tls.server_context(cfg.tls_cert_file, cfg.tls_private_key_file, cfg.client_ca_file,
                             http2=cfg.listener.http2)
    peer_ca = cfg.peer.client_ca_file
    if peer_ca and peer_ca != cfg.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=peer_ca)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise PKIError(f"peer client CA file {peer_ca} contains no usable PEM "
                           "certificate") from exc
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


class DaemonTLS:
    """Every SSL context of one mvproxy, kept current by ``reloader``."""

    def __init__(self, cfg: Config, identity: IdentityResolver,
                 on_refused: Callable[[str], None] | None = None):
        self._contexts: dict[str, tls.SwappableContext] = {}
        units = [self._listener_unit(cfg, identity), self._backend_unit(cfg)]
        if cfg.peers or cfg.peer.cert_file:
            units.append(self._peer_unit(cfg))
        self.reloader = CertificateReloader(
            units, problems=lambda settings: preflight.material_problems(cfg, settings),
            on_refused=on_refused)
        self.reloader.load()

    # load() above built every unit's context or raised: the first three always exist.
    @property
    def listener(self) -> tls.SwappableContext:
        return self._contexts["listener"]

    @property
    def backend(self) -> tls.SwappableContext:
        return self._contexts["backend"]

    @property
    def backend_anonymous(self) -> tls.SwappableContext:
        return self._contexts["backend-anonymous"]

    def h2(self, name: str) -> tls.SwappableContext | None:
        """The twin of context ``name`` that offers ``h2`` (HTTP/2 upstream requests)."""
        return self._contexts.get(f"{name}-h2")

    @property
    def peer(self) -> tls.SwappableContext | None:
        """None: started without peer TLS material (no peers configured)."""
        return self._contexts.get("peer")

    def _swap(self, name: str, ctx: ssl.SSLContext) -> None:
        """The first load makes the holder; later ones replace what it holds."""
        holder = self._contexts.get(name)
        if holder is None:
            self._contexts[name] = tls.SwappableContext(ctx)
        else:
            holder.context = ctx

    def _listener_unit(self, cfg: Config, identity: IdentityResolver) -> Unit:
        def build() -> Material:
            serving = _leaf_expiry("serving", cfg.tls_cert_file)
            client_cas, client_exp = _bundle("client-ca", cfg.client_ca_file)
            peer_cas, peer_exp = _bundle("peer-client-ca", cfg.peer.client_ca_file)
            ctx = listener_context(cfg)

            def apply() -> None:
                self._swap("listener", ctx)
                identity.use_cas(client_cas, peer_cas)
            return Material(apply, (serving, *client_exp, *peer_exp))
        return Unit("listener", files=(cfg.tls_cert_file, cfg.tls_private_key_file,
                                       cfg.client_ca_file, cfg.peer.client_ca_file),
                    settings=("tlsCertFile", "clientCAFile", "peer.clientCAFile"),
                    role="serving", build=build)

    def _backend_unit(self, cfg: Config) -> Unit:
        b = cfg.backend

        def build() -> Material:
            leaf = (_leaf_expiry("backend-client", b.cert_file),) if b.cert_file else ()
            _, ca_exp = _bundle("backend-ca", b.ca_file)
            ctx = tls.client_context(b.ca_file, b.cert_file, b.key_file)
            anonymous = tls.client_context(b.ca_file)
            ctx_h2 = tls.client_context(b.ca_file, b.cert_file, b.key_file, http2=True)
            anonymous_h2 = tls.client_context(b.ca_file, http2=True)

            def apply() -> None:
                self._swap("backend", ctx)
                self._swap("backend-anonymous", anonymous)
                self._swap("backend-h2", ctx_h2)
                self._swap("backend-anonymous-h2", anonymous_h2)
            return Material(apply, (*leaf, *ca_exp))
        return Unit("backend", files=(b.cert_file, b.key_file, b.ca_file),
                    settings=("backend.certFile", "backend.caFile"),
                    role="backend-client" if b.cert_file else "backend-ca", build=build)

    def _peer_unit(self, cfg: Config) -> Unit:
        p = cfg.peer

        def build() -> Material:
            leaf = (_leaf_expiry("peer-client", p.cert_file),) if p.cert_file else ()
            _, ca_exp = _bundle("peer-ca", p.ca_file)
            ctx = tls.client_context(p.ca_file, p.cert_file, p.key_file)
            ctx_h2 = tls.client_context(p.ca_file, p.cert_file, p.key_file, http2=True)

            def apply() -> None:
                self._swap("peer", ctx)
                self._swap("peer-h2", ctx_h2)
            return Material(apply, (*leaf, *ca_exp))
        # peer.clientCAFile is read too: this certificate must chain to it (preflight).
        return Unit("peer", files=(p.cert_file, p.key_file, p.ca_file, p.client_ca_file),
                    settings=("peer.certFile", "peer.caFile"), role="peer-client", build=build)
