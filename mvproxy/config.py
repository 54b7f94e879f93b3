"""mvproxy's configuration: one YAML file plus flag overrides → frozen dataclasses.

The file is Kubernetes component-config style (``apiVersion: mvproxy.io/v1alpha1``,
``kind: MvproxyConfiguration``, camelCase keys); the dataclasses use snake_case.
The dataclasses below *are* the schema: each field names its YAML key and parser in
its metadata and documents its unit, default and reason right where it is defined.
One walker (``_Section``) reads them, so adding a setting is adding one field.

This module owns parsing and validation only. It reports every problem at once, by
YAML path, in one ``ConfigError``. It must not do I/O beyond reading the file and
checking that the files it names exist and are readable, and it never builds SSL
contexts, sockets or loggers: that is the job of the modules that *complete* the
config (``tls``, ``app``). Reading and parsing the YAML file is ``configfile``'s job,
so this model (imported on the request path) never imports PyYAML; runtime code never
re-reads YAML.

Durations are written as Go-style strings (``5s``, ``1m30s``, ``500ms``) and stored
as float seconds. File paths are stored absolute: paths from the file are relative
to the file's directory (as kubelet does), paths from flags to the working directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mvproxy.errors import ConfigError, Problem

API_VERSION = "mvproxy.io/v1alpha1"
KIND = "MvproxyConfiguration"

FLAGS_SOURCE = "<flags>"
"""``ConfigError.source`` when there is no file and every value came from flags."""

# ---------------------------------------------------------------------------
# Durations
# ---------------------------------------------------------------------------

_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_DURATION = re.compile(r"(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ms|h|m|s))+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|h|m|s)")
_DURATION_EXAMPLES = "e.g. '5s', '1m30s' or '500ms'"


def parse_duration(text: str) -> float:
    """Parse a Go-style duration (``5s``, ``1m30s``, ``2.5s``, ``500ms``) into seconds.

    Units are ``h``, ``m``, ``s`` and ``ms``. A bare number is rejected: ``5`` could
    mean seconds or milliseconds, and guessing wrong is a silent 1000× error.
    """
    if isinstance(text, str) and re.fullmatch(r"\d+(?:\.\d*)?|\.\d+", text):
        raise ValueError(f"invalid duration {text!r}: a unit is required (h, m, s or ms), "
                         f"{_DURATION_EXAMPLES}")
    if not isinstance(text, str) or not _DURATION.fullmatch(text):
        raise ValueError(f"invalid duration {text!r}: expected numbers with units "
                         f"(h, m, s, ms), {_DURATION_EXAMPLES}")
    return sum(float(number) * _DURATION_UNITS[unit]
               for number, unit in _DURATION_PART.findall(text))


def format_duration(seconds: float) -> str:
    """Render seconds the way ``parse_duration`` reads them: 90.0 → ``1m30s``,
    0.5 → ``500ms``."""
    if 0 < seconds < 1:
        return f"{seconds * 1000:g}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{int(hours)}h" if hours else "") + (f"{int(minutes)}m" if minutes else "")
    return text + (f"{secs:g}s" if secs or not text else "")


# ---------------------------------------------------------------------------
# The walker's plumbing: context, sentinels, leaf parsers
# ---------------------------------------------------------------------------

_INVALID: Any = type("_Invalid", (), {"__repr__": lambda self: "<invalid>"})()
"""Stands in for a value whose problem is already reported, so later checks skip it."""

_DERIVED: Any = object()
"""Marks an absent key whose default is computed from its section's other values."""


class _Invalid(Exception):
    """Raised by a parser; the walker turns it into a ``Problem`` at the current path."""


@dataclass
class _Context:
    """What the walker needs besides the document: where paths are relative to, and the
    sink for problems."""

    file_dir: str | None
    """Directory of the configuration file; None when there is no file."""
    override_keys: tuple[str, ...]
    """Dotted YAML paths that came from flags: their relative paths are relative to the CWD."""
    problems: list[Problem] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def resolve(self, path: str, name: str) -> str:
        """Make a file name absolute, relative to the config file or (from flags) the CWD."""
        if self.file_dir is None or self._from_override(path):
            return os.path.abspath(name)
        return os.path.normpath(os.path.join(self.file_dir, name))

    def _from_override(self, path: str) -> bool:
        return any(path == key or path.startswith((key + ".", key + "["))
                   for key in self.override_keys)


Parser = Callable[[Any, str, _Context], Any]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def describe(value: object) -> str:
    """Name a bad value for a message: scalars by repr, containers by kind (they can be huge)."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _run(parse: Parser, value: object, path: str, ctx: _Context) -> Any:
    try:
        return parse(value, path, ctx)
    except _Invalid as problem:
        ctx.add(path, str(problem))
        return _INVALID


def _string(value: object, path: str, ctx: _Context) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"must be a non-empty string, got {describe(value)}")
    return value


_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
SERVER_ID_RE = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")
"""A server ID: a DNS subdomain name (it becomes a directory name and a certificate SAN)."""


def _server_id(value: object, path: str, ctx: _Context) -> str:
    text = _string(value, path, ctx)
    if len(text) > 253 or not SERVER_ID_RE.fullmatch(text):
        raise _Invalid(
            "must be a lowercase DNS name (a-z, 0-9, '-', '.'; starts and ends alphanumeric;"
            f" at most 253 characters), got {text!r}"
        )
    return text


def _ip_address(value: object, path: str, ctx: _Context) -> str:
    text = _string(value, path, ctx)
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise _Invalid(f"must be an IP address, got {text!r}") from None
    return text


def _https_url(value: object, path: str, ctx: _Context) -> str:
    text = _string(value, path, ctx)
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a bad port
        ok = parts.scheme == "https" and bool(parts.hostname)
    except ValueError:  # bad port, or an unbalanced [IPv6] host
        ok = False
    if not ok:
        raise _Invalid(f"must be an https:// URL, got {text!r}")
    if parts.username is not None or parts.path not in ("", "/") or parts.query or parts.fragment:
        # Requests keep their own path, and a user:password would land in Host and logs.
        raise _Invalid(f"must be https://host[:port] with no credentials, path or query, "
                       f"got {urlsplit(text)._replace(netloc=parts.hostname or '').geturl()!r}")
    return text


def _readable_file(value: object, path: str, ctx: _Context) -> str:
    resolved = ctx.resolve(path, _string(value, path, ctx))
    if not os.path.exists(resolved):
        raise _Invalid(f"no such file: {resolved!r}")
    if not os.path.isfile(resolved):
        raise _Invalid(f"not a regular file: {resolved!r}")
    if not os.access(resolved, os.R_OK):
        raise _Invalid(f"file is not readable: {resolved!r}")
    return resolved


def _integer(low: int, high: int | None = None) -> Parser:
    def parse(value: object, path: str, ctx: _Context) -> int:
        if type(value) is not int:  # not isinstance: YAML's `true` must not pass as 1
            raise _Invalid(f"must be an integer, got {describe(value)}")
        if value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f">= {low}"
            raise _Invalid(f"must be {bounds}, got {value!r}")
        return value

    return parse


def _duration(*, allow_zero: bool = False) -> Parser:
    def parse(value: object, path: str, ctx: _Context) -> float:
        if not isinstance(value, str):
            raise _Invalid(f"must be a duration with a unit, {_DURATION_EXAMPLES}, "
                           f"got {describe(value)}")
        try:
            seconds = parse_duration(value)
        except ValueError as error:
            raise _Invalid(str(error)) from None
        if seconds == 0 and not allow_zero:
            raise _Invalid(f"must be > 0, got {value!r}")
        return seconds

    setattr(parse, "duration", True)  # noqa: B010 - marks it for ``default_text``
    return parse


def _fraction(high: float) -> Parser:
    def parse(value: object, path: str, ctx: _Context) -> float:
        if type(value) not in (int, float):  # not isinstance: YAML's `true` is no number
            raise _Invalid(f"must be a number, got {describe(value)}")
        if not 0 <= value <= high:  # type: ignore[operator]  # int or float
            raise _Invalid(f"must be between 0 and {high:g}, got {value!r}")
        return float(value)  # type: ignore[arg-type]

    return parse


def _boolean(value: object, path: str, ctx: _Context) -> bool:
    if not isinstance(value, bool):  # 1 or the string "true" is a mistake, not a yes
        raise _Invalid(f"must be true or false, got {describe(value)}")
    return value


def _choice(*options: str) -> Parser:
    def parse(value: object, path: str, ctx: _Context) -> str:
        if value not in options:
            raise _Invalid(f"must be one of {', '.join(map(repr, options))}, "
                           f"got {describe(value)}")
        return value

    return parse


def _list_of(item: Parser, *, non_empty: bool = False) -> Parser:
    def parse(value: object, path: str, ctx: _Context) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise _Invalid(f"must be a list, got {describe(value)}")
        if non_empty and not value:
            raise _Invalid("must not be empty")
        return tuple(_run(item, element, f"{path}[{index}]", ctx)
                     for index, element in enumerate(value))

    return parse


# ---------------------------------------------------------------------------
# The mapping walker
# ---------------------------------------------------------------------------


def _key(name: str, parse: Parser, *, derive: tuple[str, Callable[[Any], Any]] | None = None,
         **kwargs: Any) -> Any:
    """A dataclass field read from YAML key ``name`` by ``parse``.

    ``derive=(attr, fn)`` computes the value as ``fn(<value of attr>)`` when the key is
    absent; the field's own default then only serves direct construction (tests).
    """
    metadata: dict[str, Any] = {"key": name, "parse": parse}
    if derive is not None:
        metadata["derive"] = derive
    return field(metadata=metadata, **kwargs)


class _Section:
    """Parser for a YAML mapping whose keys are the ``_key`` fields of dataclass ``cls``.

    Always builds ``cls`` (fields may hold ``_INVALID``) so checks further up can still
    look at the valid parts; ``load_config`` raises before such an object escapes.
    """

    def __init__(self, cls: type, *, ignore: tuple[str, ...] = ()):
        self.cls = cls
        self.fields = {f.metadata["key"]: f for f in dataclasses.fields(cls)}
        self.ignore = ignore  # keys known here but validated elsewhere (apiVersion, kind)

    def __call__(self, raw: object, path: str, ctx: _Context) -> Any:
        if not isinstance(raw, dict):
            raise _Invalid(f"must be a mapping, got {describe(raw)}")
        self._report_unknown_keys(raw, path, ctx)
        values = {f.name: self._parse_key(raw, key, f, _join(path, key), ctx)
                  for key, f in self.fields.items()}
        self._derive(values)
        if check := _CHECKS.get(self.cls):
            check(values, path, ctx)
        return self.cls(**values)

    def _report_unknown_keys(self, raw: dict[Any, Any], path: str, ctx: _Context) -> None:
        known = [*self.fields, *self.ignore]
        for key in raw:
            if key not in known:
                ctx.add(_join(path, str(key)), "unknown key" + _did_you_mean(str(key), known))

    @staticmethod
    def _parse_key(raw: dict[Any, Any], key: str, f: dataclasses.Field[Any], path: str,
                   ctx: _Context) -> Any:
        parse = f.metadata["parse"]
        if raw.get(key) is not None:  # YAML null means "not set", as in Kubernetes objects
            return _run(parse, raw[key], path, ctx)
        if "derive" in f.metadata:
            return _DERIVED
        if isinstance(parse, _Section):  # absent section: report its required keys by full path
            return _run(parse, {}, path, ctx)
        if f.default is not dataclasses.MISSING:
            return f.default
        ctx.add(path, "required")
        return _INVALID

    def _derive(self, values: dict[str, Any]) -> None:
        for f in self.fields.values():
            if values[f.name] is _DERIVED:
                source, compute = f.metadata["derive"]
                values[f.name] = _INVALID if values[source] is _INVALID else compute(values[source])


def _did_you_mean(key: str, known: list[str]) -> str:
    lowered = {name.lower(): name for name in known}
    matches = difflib.get_close_matches(key.lower(), list(lowered), n=1)
    return f" (did you mean {lowered[matches[0]]!r}?)" if matches else ""




# ---------------------------------------------------------------------------
# The schema (dataclasses)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendConfig:
    """The one kube-apiserver this mvproxy fronts (YAML ``backend``)."""

    url: str = _key("url", _https_url)
    """``https://`` URL of the backend, usually ``https://127.0.0.1:<port>``. Required."""
    ca_file: str | None = _key("caFile", _readable_file, default=None)
    """PEM bundle that verifies the backend's serving certificate (None: the system trust store)."""
    cert_file: str | None = _key("certFile", _readable_file, default=None)
    """Front-proxy client certificate presented to the backend (None: none). It is what
    makes the backend trust mvproxy's ``X-Remote-*`` headers (requestheader authentication).
    Set together with ``key_file``."""
    key_file: str | None = _key("keyFile", _readable_file, default=None)
    """Private key of ``cert_file`` (None: none). Set together with ``cert_file``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerConfig:
    """How mvproxy talks to, and recognises, peers (YAML ``peer``).

    Two CAs, as in kube-apiserver: ``ca_file`` verifies the peers' *serving*
    certificates (upstream's ``--peer-ca-file``); ``client_ca_file`` verifies the
    *client* certificates peers present, and must be a CA that signs only proxies
    (kubeadm's front-proxy CA), because a peer may assert any user.
    """

    ca_file: str | None = _key("caFile", _readable_file, default=None)
    """PEM bundle that verifies peers' serving certificates (None: no peers). Required when
    peers are configured, like upstream's ``--peer-ca-file``; usually the cluster CA."""
    client_ca_file: str | None = _key("clientCAFile", _readable_file, default=None)
    """PEM bundle that verifies the client certificates of peers (None: no peers). Required
    when peers are configured. Use a CA that signs only proxies, such as kubeadm's
    ``front-proxy-ca.crt``: whoever holds a certificate it signs with an allowed name can
    claim to be any user. Refused if it shares a CA with ``clientCAFile`` (which signs user
    certificates, and the CSR API can issue one named like a peer) unless
    ``insecureSharedCA`` is set."""
    cert_file: str | None = _key("certFile", _readable_file, default=None)
    """Client certificate this mvproxy presents to peers (None). Required when peers are
    configured; usually the front-proxy client certificate, which a peer that is a real
    kube-apiserver also accepts through requestheader authentication."""
    key_file: str | None = _key("keyFile", _readable_file, default=None)
    """Private key of ``cert_file`` (None). Required when peers are configured."""
    allowed_names: tuple[str, ...] = _key(
        "allowedNames", _list_of(_string, non_empty=True), default=("front-proxy-client",)
    )
    """Client-certificate CNs (from ``client_ca_file``) trusted as peers
    (``("front-proxy-client",)``, kubeadm's requestheader allowed name)."""
    insecure_shared_ca: bool = _key("insecureSharedCA", _boolean, default=False)
    """Accept a ``client_ca_file`` that shares a CA with ``clientCAFile`` (false). Insecure:
    any certificate that CA issues with an allowed name, a user's included, can then act
    as a peer and claim any user, ``system:masters`` too. For test clusters only."""
    advertise_url: str | None = _key("advertiseURL", _https_url, default=None)
    """``https://`` URL peers should use to reach this mvproxy (None: not advertised).
    Only dynamic membership publishes it; static peers are configured on every side."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StaticPeer:
    """One entry of ``peers.static``: another mvproxy, named and addressed."""

    server_id: str = _key("serverID", _server_id)
    """The peer's server ID (same rules as ``Config.server_id``). Required, unique."""
    url: str = _key("url", _https_url)
    """``https://`` URL of the peer's mvproxy listener. Required, unique."""


LEASE_NAME_PREFIX = "mvproxy-"
"""An mvproxy's Lease is named ``mvproxy-<serverID>``: apart from kube-apiserver's own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LeasesConfig:
    """YAML ``peers.leases``: peers from ``coordination.k8s.io/v1`` Leases, read and
    written through the backend (each mvproxy holds one; see docs/membership.md)."""

    enabled: bool = _key("enabled", _boolean, default=False)
    """Publish this mvproxy's Lease and take the other unexpired ones as peers (false).
    Needs ``peer.advertiseURL`` and the backend client certificate."""
    namespace: str = _key("namespace", _server_id, default="kube-system")
    """Namespace of the Leases (kube-system, where kube-apiserver keeps its identity Leases)."""
    lease_duration: float = _key("leaseDuration", _duration(), default=30.0)
    """Seconds a Lease stays valid after its last renewal (30s): how long a killed mvproxy
    remains a peer. Must be > renewPeriod."""
    renew_period: float = _key("renewPeriod", _duration(), default=10.0)
    """Seconds between renewals of this mvproxy's own Lease (10s); also how often the
    peer list is re-checked for expired Leases."""
    api_server_identity: bool = _key("apiServerIdentity", _boolean, default=False)
    """Also take kube-apiserver identity Leases (label ``apiserver.kubernetes.io/identity``)
    that carry ``kubernetes.io/peer-advertise-address`` as peers (false), so built-in MVP
    servers and mvproxies route to each other. Their IDs are in no certificate: only
    ``peer.caFile`` vouches for them, so enable it only with a CA that signs peers alone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DNSConfig:
    """YAML ``peers.dns``: peers from the addresses of one DNS name (a headless Service)."""

    name: str | None = _key("name", _server_id, default=None)
    """DNS name whose A/AAAA records are the peers' mvproxies (None: DNS membership off)."""
    port: int = _key("port", _integer(1, 65535), default=6443)
    """TCP port of the peers' mvproxy listeners at those addresses (6443)."""
    interval: float = _key("interval", _duration(), default=10.0)
    """Seconds between resolutions (10s): how fast a DNS change reaches routing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PeersConfig:
    """YAML ``peers``: the membership sources; any combination may be used."""

    static: tuple[StaticPeer, ...] = _key("static", _list_of(_Section(StaticPeer)), default=())
    """Peers listed by hand (empty: no peers; everything is served by the backend)."""
    leases: LeasesConfig = _key("leases", _Section(LeasesConfig), default_factory=LeasesConfig)
    """Lease membership (off)."""
    dns: DNSConfig = _key("dns", _Section(DNSConfig), default_factory=DNSConfig)
    """DNS membership (off)."""

    @property
    def dynamic(self) -> bool:
        """Whether Leases or DNS are used (a value already reported as invalid is not)."""
        return (isinstance(self.leases, LeasesConfig) and self.leases.enabled is True) or \
            (isinstance(self.dns, DNSConfig) and isinstance(self.dns.name, str))


@dataclass(frozen=True, kw_only=True, slots=True)
class DiscoveryConfig:
    """Polling of ``/api`` and ``/apis`` on the backend and every peer (YAML ``discovery``)."""

    poll_interval: float = _key("pollInterval", _duration(), default=5.0)
    """Seconds between polls of each server (5s). ETags make an unchanged poll cheap, and
    a new version appears within one interval during an upgrade."""
    stale_after: float = _key("staleAfter", _duration(), default=15.0,
                              derive=("poll_interval", lambda poll: 3 * poll))
    """Seconds without a successful poll before a peer's group/versions are served with
    ``freshness: Stale`` (default 3 × poll_interval: one lost poll is not an outage).
    Must be >= poll_interval."""
    forget_after: float = _key("forgetAfter", _duration(), default=600.0,
                               derive=("stale_after", lambda stale: max(600.0, stale)))
    """Seconds without a successful poll before a peer's snapshot is dropped (default
    max(10m, stale_after)). Long, so a restarting peer does not make its resources look
    deleted. Must be >= stale_after."""
    timeout: float = _key("timeout", _duration(), default=5.0,
                          derive=("poll_interval", lambda poll: min(5.0, poll)))
    """Seconds one poll may take (default min(5s, poll_interval)), so a hung peer cannot
    delay the next round."""
    max_document_bytes: int = _key("maxDocumentBytes", _integer(1), default=32 * 1024 * 1024)
    """Largest discovery body read, in bytes (33554432 = 32 MiB); a bigger one is a failed
    poll. Caps the memory a broken or hostile peer can make us hold."""


def _host_name(value: object, path: str, ctx: _Context) -> str:
    """A DNS name as a ``Host`` header carries it, without port or scheme (stored
    lowercase, without a final dot: names are case-insensitive)."""
    text = _string(value, path, ctx)
    name = text.lower().removesuffix(".")
    if len(name) > 253 or not SERVER_ID_RE.fullmatch(name):
        raise _Invalid("must be a DNS name (letters, digits, '-' and '.', no port, scheme or "
                       f"wildcard; IP addresses and localhost are always allowed), got {text!r}")
    return name


@dataclass(frozen=True, kw_only=True, slots=True)
class AdminConfig:
    """The admin listener: ``/metrics``, ``/healthz``, ``/livez``, ``/readyz``,
    ``/debug/mvproxy`` and the status page; optionally ``/metrics`` alone on a second
    address, for Prometheus off the node."""

    bind_address: str = _key("bindAddress", _ip_address, default="127.0.0.1")
    """IP address the admin listener binds (127.0.0.1): it is unauthenticated plain HTTP."""
    port: int = _key("port", _integer(0, 65535), default=9443)
    """TCP port of the admin listener (9443; 0 picks a free port, for tests)."""
    allowed_hosts: tuple[str, ...] = _key("allowedHosts", _list_of(_host_name), default=())
    """DNS names the admin and metrics listeners answer for in ``Host``, besides IP
    addresses and ``localhost`` (none). Any other ``Host`` gets 421: a web page whose
    name an attacker rebinds to 127.0.0.1 (DNS rebinding) must not read the debug
    endpoints from a browser on the node."""
    metrics_bind_address: str | None = _key("metricsBindAddress", _ip_address, default=None)
    """IP address of a second listener that serves ``/metrics`` alone (None: none). For
    scraping from off the node (the node IP) while the admin listener, with the status
    page and ``/debug/mvproxy``, stays on 127.0.0.1. Plain HTTP, unauthenticated."""
    metrics_port: int = _key("metricsPort", _integer(0, 65535), default=9444)
    """TCP port of the metrics listener (9444; 0 picks a free port), when
    ``metricsBindAddress`` is set."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggingConfig:
    """Log output (YAML ``logging``)."""

    format: str = _key("format", _choice("text", "json"), default="text")
    """``text`` for people, ``json`` for log collectors (text)."""
    verbosity: int = _key("verbosity", _integer(0, 10), default=2)
    """klog-style level 0..10 (2): 0-2 lifecycle facts, warnings and errors, 4+ per-request
    decisions, 6+ library debug output."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeoutsConfig:
    """Upstream timeouts (YAML ``timeouts``). Watches and upgrades get no total timeout."""

    connect: float = _key("connect", _duration(), default=5.0)
    """Seconds to establish TCP + TLS to the backend or a peer (5s); failing fast lets a
    request fail over to the next capable peer."""
    request: float = _key("request", _duration(), default=60.0)
    """Seconds a short (non-watch) upstream request may take in total (60s), matching
    kube-apiserver's default ``--request-timeout``."""
    shutdown_grace_period: float = _key("shutdownGracePeriod", _duration(allow_zero=True),
                                        default=30.0)
    """Seconds SIGTERM waits for in-flight requests before closing them (30s; 0: at once)."""
    shutdown_delay: float = _key("shutdownDelay", _duration(allow_zero=True), default=0.0)
    """Seconds between SIGTERM and closing the listener (0s, kube-apiserver's
    ``--shutdown-delay-duration`` default): ``/readyz`` fails at once and new requests
    are still served meanwhile, so load balancers notice before connections are refused.
    Beside kube-apiserver, use the same value as its flag."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ListenerConfig:
    """Resource limits of the downstream listener (YAML ``listener``). The defaults are
    kube-apiserver's own (``secure_serving.go``), so clients see the same limits."""

    header_read_timeout: float = _key("headerReadTimeout", _duration(), default=32.0)
    """Seconds for the TLS handshake, and for a request head once its first byte arrived
    (32s). Slow or silent clients are closed instead of holding a connection."""
    idle_timeout: float = _key("idleTimeout", _duration(), default=90.0)
    """Seconds a keep-alive connection may wait for its next request (90s)."""
    max_header_bytes: int = _key("maxHeaderBytes", _integer(1024, 64 * 1024 * 1024),
                                 default=1 << 20)
    """Largest request line plus header fields, in bytes (1048576 = 1 MiB); larger gets 431."""
    max_connections: int = _key("maxConnections", _integer(0), default=0)
    """Downstream connections open at once (0: derived from the open-file limit, half of
    it less a reserve, since each connection may hold one upstream connection too). At
    the limit new clients wait in the kernel's backlog, and descriptors stay free for
    discovery polls."""
    max_pending_handshakes: int = _key("maxPendingHandshakes", _integer(1), default=256)
    """TLS handshakes in progress at once (256). A client may send ~100 KiB of
    ClientHello and then stall until ``headerReadTimeout``, holding ~0.5 MB before it
    has proven anything; beyond this, new clients wait in the kernel's backlog. A
    handshake takes about a millisecond of CPU, so 256 at once is far from a limit for
    honest clients."""
    http2: bool = _key("http2", _boolean, default=True)
    """Offer HTTP/2 (``h2`` in ALPN) besides HTTP/1.1 (true, as kube-apiserver does):
    kubectl and client-go then carry all their requests and watches on one connection.
    An HTTP/2 request costs more CPU than an HTTP/1.1 one (docs/http2.md); false makes
    every client fall back to HTTP/1.1."""
    max_concurrent_streams: int = _key("maxConcurrentStreams", _integer(1, 10_000),
                                       default=100)
    """Streams one HTTP/2 connection may have open at once (100, kube-apiserver's); a
    stream the client reset counts until its request has ended."""
    goaway_chance: float = _key("goawayChance", _fraction(0.02), default=0.0)
    """Chance (0 to 0.02) that an HTTP/2 connection is asked to end (``GOAWAY``) after a
    request, as kube-apiserver's ``--goaway-chance``: long-lived clients behind a load
    balancer then spread over the mvproxies. 0: never."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CertificatesConfig:
    """Re-reading certificate files while running (YAML ``certificates``)."""

    reload_interval: float = _key("reloadInterval", _duration(allow_zero=True), default=5.0)
    """Seconds between checks of every certificate, key and CA file for a change (5s; 0:
    never, a restart is then needed). A changed file that parses and passes the
    start-up checks is used for new connections; a broken one is logged and ignored."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Everything ``mvproxy run`` needs, validated; built only by ``load_config`` (or tests)."""

    server_id: str = _key("serverID", _server_id)
    """This member's stable name (``apiserver-a``): lowercase DNS name. Required. Names this
    server in merged discovery order, metrics and logs; peers must use other names."""
    bind_address: str = _key("bindAddress", _ip_address, default="0.0.0.0")
    """IP address of the downstream listener (0.0.0.0: every interface, like kube-apiserver)."""
    secure_port: int = _key("securePort", _integer(1, 65535), default=6443)
    """TCP port of the downstream listener (6443: where clients already connect; move the
    backend to another port or to loopback)."""
    tls_cert_file: str = _key("tlsCertFile", _readable_file)
    """PEM certificate (chain) the downstream listener serves. Required."""
    tls_private_key_file: str = _key("tlsPrivateKeyFile", _readable_file)
    """Private key of ``tls_cert_file``. Required."""
    client_ca_file: str | None = _key("clientCAFile", _readable_file, default=None)
    """PEM bundle that verifies downstream client certificates (None: no client-certificate
    authentication of downstreams; bearer tokens still pass through)."""
    backend: BackendConfig = _key("backend", _Section(BackendConfig))
    """The kube-apiserver this mvproxy fronts. Required (``backend.url``)."""
    peer: PeerConfig = _key("peer", _Section(PeerConfig), default_factory=PeerConfig)
    """mTLS material and trusted names for peers."""
    membership: PeersConfig = _key("peers", _Section(PeersConfig), default_factory=PeersConfig)
    """Membership sources, YAML ``peers`` (``static``, ``leases``, ``dns``)."""

    discovery: DiscoveryConfig = _key("discovery", _Section(DiscoveryConfig),
                                      default_factory=DiscoveryConfig)
    """Discovery polling intervals and limits."""
    admin: AdminConfig = _key("admin", _Section(AdminConfig), default_factory=AdminConfig)
    """Admin (metrics and health) listener."""
    logging: LoggingConfig = _key("logging", _Section(LoggingConfig), default_factory=LoggingConfig)
    """Log format and verbosity."""
    timeouts: TimeoutsConfig = _key("timeouts", _Section(TimeoutsConfig),
                                    default_factory=TimeoutsConfig)
    """Upstream connect/request timeouts and the shutdown grace period."""
    upstream_http2: str = _key("upstreamHTTP2", _choice("longRunning", "all", "off"),
                               default="longRunning")
    """Which requests go to the backend and peers over HTTP/2 where they speak it:
    ``longRunning`` (watches, ``logs -f``: many share one connection, as client-go's
    share theirs), ``all``, or ``off`` (HTTP/1.1 only). Short requests stay on pooled
    HTTP/1.1 by default: HTTP/2 costs more CPU per request (docs/http2.md). Upgrades
    (exec, attach, port-forward) always use HTTP/1.1."""
    listener: ListenerConfig = _key("listener", _Section(ListenerConfig),
                                    default_factory=ListenerConfig)
    """Limits of the downstream listener: header and idle timeouts, sizes, connections."""
    certificates: CertificatesConfig = _key("certificates", _Section(CertificatesConfig),
                                            default_factory=CertificatesConfig)
    """How often certificate files are checked for rotation."""
    workers: int = _key("workers", _integer(1, 64), default=1)
    """Processes serving ``securePort`` together (SO_REUSEPORT), each on one core (1).
    Above 1 a supervisor process runs the admin listener, adds the workers' metrics up
    and restarts a worker that dies; each worker polls discovery itself."""

    @property
    def peers(self) -> tuple[StaticPeer, ...]:
        """The statically configured peers, ``peers.static`` (empty)."""
        return self.membership.static


# ---------------------------------------------------------------------------
# Cross-field checks, run on a section's values before it is built
# ---------------------------------------------------------------------------


def _valid(*values: object) -> bool:
    return all(value is not _INVALID for value in values)


def _check_backend(v: dict[str, Any], path: str, ctx: _Context) -> None:
    if v["cert_file"] is not None and v["key_file"] is None:
        ctx.add(_join(path, "keyFile"), "required when certFile is set")
    if v["key_file"] is not None and v["cert_file"] is None:
        ctx.add(_join(path, "certFile"), "required when keyFile is set")


def _check_leases(v: dict[str, Any], path: str, ctx: _Context) -> None:
    duration, renew = v["lease_duration"], v["renew_period"]
    if _valid(duration, renew) and renew >= duration:
        ctx.add(_join(path, "renewPeriod"),
                f"must be < leaseDuration ({format_duration(duration)}), "
                f"got {format_duration(renew)!r}")


def _check_peers_section(v: dict[str, Any], path: str, ctx: _Context) -> None:
    if v["static"] is not _INVALID:
        _report_duplicates(v["static"], "server_id", "serverID", _join(path, "static"), ctx)
        _report_duplicates(v["static"], "url", "url", _join(path, "static"), ctx)


def _report_duplicates(items: tuple[Any, ...], attr: str, key: str, path: str,
                       ctx: _Context) -> None:
    first_index: dict[object, int] = {}
    for index, item in enumerate(items):
        value = getattr(item, attr, _INVALID)
        if value is _INVALID:
            continue
        if value in first_index:
            ctx.add(f"{path}[{index}].{key}",
                    f"duplicate {value!r} (already used by {path}[{first_index[value]}])")
        first_index.setdefault(value, index)


def _check_discovery(v: dict[str, Any], path: str, ctx: _Context) -> None:
    poll, stale, forget = v["poll_interval"], v["stale_after"], v["forget_after"]
    if _valid(poll, stale) and stale < poll:
        ctx.add(_join(path, "staleAfter"), _not_below("pollInterval", poll, stale))
    if _valid(stale, forget) and forget < stale:
        ctx.add(_join(path, "forgetAfter"), _not_below("staleAfter", stale, forget))


def _not_below(name: str, floor: float, value: float) -> str:
    return f"must be >= {name} ({format_duration(floor)}), got {format_duration(value)!r}"


def _check_admin(v: dict[str, Any], path: str, ctx: _Context) -> None:
    """The metrics listener cannot share the admin listener's port on an overlapping
    address (the bind would fail at start, after check-config said yes)."""
    address, port = v["metrics_bind_address"], v["metrics_port"]
    if address is None or not _valid(address, port, v["bind_address"], v["port"]):
        return
    unspecified = {"0.0.0.0", "::"}
    overlap = address == v["bind_address"] or address in unspecified or \
        v["bind_address"] in unspecified
    if port != 0 and port == v["port"] and overlap:
        ctx.add(_join(path, "metricsPort"),
                f"must differ from port ({port}) on an overlapping address")


def _check_config(v: dict[str, Any], path: str, ctx: _Context) -> None:
    peer, membership = v["peer"], v["membership"]
    if not _valid(membership) or not _valid(membership.static):
        return
    peers = membership.static
    _check_dynamic(v, ctx)
    if (peers or membership.dynamic) and _valid(peer):
        for attr, key in (("ca_file", "caFile"), ("client_ca_file", "clientCAFile"),
                          ("cert_file", "certFile"), ("key_file", "keyFile")):
            if getattr(peer, attr) is None:
                ctx.add(f"peer.{key}", "required when peers are configured")
    for index, static in enumerate(peers):
        if _valid(v["server_id"], static) and static.server_id == v["server_id"]:
            ctx.add(f"peers.static[{index}].serverID",
                    f"must differ from the top-level serverID {v['server_id']!r}")


def _check_dynamic(v: dict[str, Any], ctx: _Context) -> None:
    """Leases are written with the backend's client certificate, and name this server."""
    leases = v["membership"].leases
    if not _valid(leases) or leases.enabled is not True:
        return
    if _valid(v["peer"]) and v["peer"].advertise_url is None:
        ctx.add("peer.advertiseURL", "required when peers.leases.enabled is true")
    if _valid(v["backend"]) and v["backend"].cert_file is None:
        ctx.add("backend.certFile", "required when peers.leases.enabled is true (the Lease "
                                    "is written through the backend as a front proxy)")
    if _valid(v["server_id"]) and len(LEASE_NAME_PREFIX + v["server_id"]) > 253:
        ctx.add("serverID", f"at most {253 - len(LEASE_NAME_PREFIX)} characters when "
                            "peers.leases.enabled is true (it names the Lease)")


_CHECKS: dict[type, Callable[[dict[str, Any], str, _Context], None]] = {
    BackendConfig: _check_backend,
    LeasesConfig: _check_leases,
    PeersConfig: _check_peers_section,
    DiscoveryConfig: _check_discovery,
    AdminConfig: _check_admin,
    Config: _check_config,
}

_CONFIG = _Section(Config, ignore=("apiVersion", "kind"))


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def from_document(document: dict[Any, Any] | None, source: str | None,
                  overrides: Mapping[str, object] | None = None) -> Config:
    """Override, validate: a parsed configuration file becomes a ``Config``.

    ``document`` None means no file (an empty document; apiVersion and kind implied);
    ``source`` is the file's path (relative paths in it are read from its directory).
    ``overrides`` maps dotted camelCase YAML paths (``backend.url``, ``peers.static``)
    to raw YAML-shaped values from flags; they win over the file, None values are skipped.
    Raises ``ConfigError`` listing every problem; its source is the path or ``<flags>``.
    """
    if document is None:
        source = None
        document = {"apiVersion": API_VERSION, "kind": KIND}
    flags = {key: value for key, value in (overrides or {}).items() if value is not None}
    file_dir = os.path.dirname(os.path.abspath(source)) if source is not None else None
    ctx = _Context(file_dir=file_dir, override_keys=tuple(flags))
    _apply_overrides(document, flags, ctx)
    _check_header(document, ctx)
    config = _run(_CONFIG, document, "", ctx)
    if ctx.problems:
        raise ConfigError(source if source is not None else FLAGS_SOURCE, ctx.problems)
    return config


def _apply_overrides(document: dict[Any, Any], flags: Mapping[str, object], ctx: _Context) -> None:
    for dotted, value in flags.items():
        *parents, leaf = dotted.split(".")
        node = _descend(document, parents, dotted, ctx)
        if node is not None:
            node[leaf] = value


def _descend(document: dict[Any, Any], parents: list[str], dotted: str,
             ctx: _Context) -> dict[Any, Any] | None:
    """Walk to the mapping that holds an override's leaf, creating missing mappings."""
    node = document
    for depth, part in enumerate(parents):
        child = node.get(part)
        if child is not None and not isinstance(child, dict):
            ctx.add(dotted, f"cannot override: {'.'.join(parents[: depth + 1])!r} is not a mapping")
            return None
        # Copy on the way down: a YAML anchor may share this mapping with another section.
        node[part] = child = dict(child or {})
        node = child
    return node


def default_text(dotted: str) -> str | None:
    """The default of the setting at YAML path ``dotted`` (``admin.bindAddress``) as a
    flag would write it (``127.0.0.1``, ``5s``, a comma-separated list), for ``--help``
    (read from the schema, so help never contradicts it); None when there is none to
    show: required, derived from another setting, unset or empty."""
    cls: type = Config
    *parents, leaf = dotted.split(".")
    for part in parents:
        cls = _schema_field(cls, part).metadata["parse"].cls
    found = _schema_field(cls, leaf)
    value = found.default
    if "derive" in found.metadata or value is dataclasses.MISSING or value in (None, ()):
        return None
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if getattr(found.metadata["parse"], "duration", False):
        return format_duration(value)
    return str(value)


def _schema_field(cls: type, key: str) -> dataclasses.Field[Any]:
    for candidate in dataclasses.fields(cls):
        if candidate.metadata["key"] == key:
            return candidate
    raise KeyError(f"{cls.__name__} has no key {key!r}")


def _check_header(document: dict[Any, Any], ctx: _Context) -> None:
    for key, expected in (("apiVersion", API_VERSION), ("kind", KIND)):
        value = document.get(key)
        if value is None:
            ctx.add(key, f"required (must be {expected!r})")
        elif value != expected:
            ctx.add(key, f"must be {expected!r}, got {describe(value)}")
