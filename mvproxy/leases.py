"""Reading and writing membership Leases (``coordination.k8s.io/v1``); no I/O here.

Two kinds of Lease name a peer:

* an mvproxy's own: label ``app.kubernetes.io/name=mvproxy``, named
  ``mvproxy-<serverID>``, ``holderIdentity`` = the server ID, its URL in the
  ``mvproxy.io/advertise-url`` annotation;
* a kube-apiserver identity Lease (label ``apiserver.kubernetes.io/identity``) that
  carries ``kubernetes.io/peer-advertise-address`` (``host:port``): a server running
  upstream's built-in peer proxy. Its server ID is the Lease's *name*, as upstream
  uses it (``holderIdentity`` there is ``<name>_<uuid>``).

Anyone who can write Leases in the namespace can write such an object, so every field
is checked and a bad Lease raises ``LeaseRejected`` with a short reason for metrics.
A URL from a Lease only says where to connect: the peer is still verified by
``peer.caFile`` (TLS), so a Lease cannot make mvproxy trust a server that is not a peer.

Expiry trusts ``renewTime`` only up to what this process has seen: a Lease expires
``leaseDurationSeconds`` after the earlier of its ``renewTime`` and the moment this
process first observed that ``renewTime``. A writer that claims a renewal in the far
future (``9999-12-31``) gets one lease duration from when we saw it, not a permanent
peer; a real holder renews, each renewal is a new observation, so it stays listed, and
a peer whose clock runs ahead is still dropped ``leaseDurationSeconds`` after its last
renewal reached us.
"""

from __future__ import annotations

import calendar
import ipaddress
import math
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mvproxy.config import LEASE_NAME_PREFIX, SERVER_ID_RE

MVPROXY_LABEL = "app.kubernetes.io/name"
MVPROXY_LABEL_VALUE = "mvproxy"
MVPROXY_SELECTOR = f"{MVPROXY_LABEL}={MVPROXY_LABEL_VALUE}"
URL_ANNOTATION = "mvproxy.io/advertise-url"
IDENTITY_LABEL = "apiserver.kubernetes.io/identity"
IDENTITY_SELECTOR = IDENTITY_LABEL  # "has the label", whatever component wrote it
PEER_ADDRESS_ANNOTATION = "kubernetes.io/peer-advertise-address"

MAX_URL_CHARS = 512
"""A longer advertised address is refused (a real one is ~30 characters)."""
MAX_DURATION_SECONDS = 24 * 3600
"""Upstream's identity Leases last 3600 s; a longer claim only keeps a dead peer listed."""

_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?Z")


class LeaseRejected(ValueError):
    """A Lease that does not name a usable peer; ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class LeasePeer:
    """A peer named by a Lease; ``expires`` says until when it counts."""

    server_id: str
    url: str
    renewed: float
    """``spec.renewTime`` as the writer claims it (wall-clock seconds)."""
    duration: int
    observed: float = math.inf
    """When this process first saw this ``renewed`` (inf: not observed, trust renewTime)."""

    @property
    def expires(self) -> float:
        """Wall-clock seconds (time.time()) after which the Lease no longer counts: a
        renewTime later than our first sight of it is not believed (module docstring)."""
        return min(self.renewed, self.observed) + self.duration


def lease_name(server_id: str) -> str:
    return LEASE_NAME_PREFIX + server_id


def format_time(seconds: float) -> str:
    """RFC 3339 with microseconds, as kube's MicroTime."""
    whole = int(seconds)
    micros = int(round((seconds - whole) * 1e6)) % 1000000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{micros:06d}Z"


def parse_time(text: object) -> float:
    match = _TIME.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise LeaseRejected("bad_time", f"renewTime is not an RFC 3339 UTC time: {_short(text)}")
    y, mo, d, h, mi, s, frac = match.groups()
    try:
        whole = calendar.timegm((int(y), int(mo), int(d), int(h), int(mi), int(s), 0, 0, 0))
        time.gmtime(whole)  # range check
    except (ValueError, OverflowError):
        raise LeaseRejected("bad_time", f"renewTime is out of range: {_short(text)}") from None
    return whole + (float("0." + frac) if frac else 0.0)


def own_lease(server_id: str, namespace: str, url: str, duration: float, now: float,
              previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """This mvproxy's Lease, renewed at ``now`` (kept resourceVersion: a safe update)."""
    metadata: dict[str, Any] = {
        "name": lease_name(server_id), "namespace": namespace,
        "labels": {MVPROXY_LABEL: MVPROXY_LABEL_VALUE},
        "annotations": {URL_ANNOTATION: url},
    }
    spec: dict[str, Any] = {"holderIdentity": server_id,
                            "leaseDurationSeconds": max(1, int(round(duration))),
                            "renewTime": format_time(now)}
    if previous is not None:
        metadata["resourceVersion"] = (previous.get("metadata") or {}).get("resourceVersion")
        acquired = (previous.get("spec") or {}).get("acquireTime")
        spec["acquireTime"] = (acquired if isinstance(acquired, str) and acquired
                               else format_time(now))
    else:
        spec["acquireTime"] = format_time(now)
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": spec}


def parse_lease(obj: object, observed: float = math.inf) -> LeasePeer:
    """The peer a Lease names, or ``LeaseRejected``; ``observed``: when this process
    saw it (see the module docstring for expiry). Expiry is left to the caller."""
    if not isinstance(obj, dict):
        raise LeaseRejected("malformed", "not an object")
    meta, spec = obj.get("metadata"), obj.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        raise LeaseRejected("malformed", "metadata or spec missing")
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    if not isinstance(labels, dict) or not isinstance(annotations, dict):
        raise LeaseRejected("malformed", "labels or annotations are not maps")
    name = meta.get("name")
    if labels.get(MVPROXY_LABEL) == MVPROXY_LABEL_VALUE:
        server_id = _check_server_id(spec.get("holderIdentity"))
        if name != lease_name(server_id):
            raise LeaseRejected("name_mismatch", f"holderIdentity {server_id!r} does not "
                                                 f"match the Lease name {_short(name)}")
        url = _check_url(annotations.get(URL_ANNOTATION))
    elif IDENTITY_LABEL in labels:
        server_id = _check_server_id(name)
        url = _address_url(annotations.get(PEER_ADDRESS_ANNOTATION))
    else:
        raise LeaseRejected("not_membership", "neither an mvproxy nor an identity Lease")
    duration = _duration(spec)
    return LeasePeer(server_id, url, parse_time(spec.get("renewTime")),
                     duration, observed)


def _duration(spec: dict[str, Any]) -> int:
    duration = spec.get("leaseDurationSeconds")
    if type(duration) is not int or not 1 <= duration <= MAX_DURATION_SECONDS:
        raise LeaseRejected("bad_duration", "leaseDurationSeconds must be 1.."
                                            f"{MAX_DURATION_SECONDS}, got {_short(duration)}")
    return duration


def _check_server_id(value: object) -> str:
    if not isinstance(value, str) or len(value) > 253 or not SERVER_ID_RE.fullmatch(value):
        raise LeaseRejected("bad_server_id", f"server ID is not a DNS name: {_short(value)}")
    return value


def _check_url(value: object) -> str:
    if not isinstance(value, str) or len(value) > MAX_URL_CHARS:
        raise LeaseRejected("bad_url", f"{URL_ANNOTATION} missing or too long")
    try:
        parts = urlsplit(value)
        port = parts.port
        host = parts.hostname
    except ValueError:
        raise LeaseRejected("bad_url", f"unparseable URL {_short(value)}") from None
    if parts.scheme != "https" or not host:
        raise LeaseRejected("bad_url", f"not an https:// URL: {_short(value)}")
    if parts.username is not None or parts.path not in ("", "/") or parts.query \
            or parts.fragment:
        raise LeaseRejected("bad_url", "URL has credentials, a path or a query")
    _check_host(host)
    return f"https://{_bracket(host)}:{port or 443}"


def _address_url(value: object) -> str:
    """``host:port`` (``[v6]:port``), upstream's peer-advertise-address, as a URL."""
    if value is None:
        raise LeaseRejected("no_address", f"no {PEER_ADDRESS_ANNOTATION} annotation "
                                          "(upstream's peer proxy is off on that server)")
    if not isinstance(value, str) or len(value) > MAX_URL_CHARS or "/" in value \
            or "@" in value:
        raise LeaseRejected("bad_url", f"{PEER_ADDRESS_ANNOTATION} missing or malformed")
    return _check_url(f"https://{value}")


def _check_host(host: str) -> None:
    """Refuse addresses no peer has: unspecified, multicast, link-local (cloud metadata)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not SERVER_ID_RE.fullmatch(host.lower()) or len(host) > 253:
            raise LeaseRejected("bad_url", f"host is neither an IP nor a DNS name: "
                                           f"{_short(host)}") from None
        return
    if ip.is_unspecified or ip.is_multicast or ip.is_link_local or ip.is_reserved:
        raise LeaseRejected("forbidden_address", f"address {ip} cannot be a peer")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _short(value: object) -> str:
    """A bounded rendering of hostile input for logs."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
