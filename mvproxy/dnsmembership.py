"""Membership from DNS: every address of one name (a headless Service) is a peer.

Every ``interval`` the name is resolved and each address is asked who it is with one
TLS handshake to ``https://<address>:<port>``, verified by ``peer.caFile`` for that
address (as every peer connection is). The server ID is read from the certificate
that handshake verified: the one DNS SAN left after dropping ``localhost``, the
``kubernetes*`` service names, the resolved name itself and anything that is not a
server ID (``mvproxy certs init`` writes exactly that layout). A certificate with no
such SAN, or several, names no peer: counted and ignored. Nothing the DNS answer says
is trusted beyond "try this address".

A failed resolution or probe keeps what was known (an address whose probe failed
keeps its last server ID), so a DNS hiccup does not empty the peer list.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from mvproxy.config import SERVER_ID_RE
from mvproxy.logs import kv
from mvproxy.membership import Peer
from mvproxy.metrics import Metrics
from mvproxy.tls import SwappableContext, current_context, peer_serving_problem

log = logging.getLogger(__name__)

MAX_ADDRESSES = 256
"""Addresses probed per round at most (sorted); more are counted and ignored."""
_GENERIC = ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(name: str, port: int) -> list[str]:
    """The name's addresses (A and AAAA), deduplicated, sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})  # the address (typed str | int)


def server_id_from_cert(cert: dict[str, Any], resolved_name: str) -> str | None:
    """The one server-ID DNS SAN of a verified certificate (``getpeercert()`` form)."""
    names = {value.lower() for kind, value in cert.get("subjectAltName", ()) if kind == "DNS"}
    left = {n for n in names
            if n not in _GENERIC and not n.startswith("kubernetes.default.svc.")
            and n != resolved_name.lower() and "*" not in n and len(n) <= 253
            and SERVER_ID_RE.fullmatch(n) and not _is_ip(n)}
    return left.pop() if len(left) == 1 else None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class DNSMembership:
    def __init__(self, *, name: str, port: int, interval: float,
                 ssl_context: ssl.SSLContext | SwappableContext,
                 timeout: float, metrics: Metrics | None = None,
                 on_change: Callable[[], None] | None = None, resolver: Resolver = resolve):
        self.name, self.port, self.interval = name, port, interval
        self._ssl = ssl_context
        self._timeout = timeout
        self._metrics = metrics
        self._on_change = on_change or (lambda: None)
        self._resolve = resolver
        self._ids: dict[str, str] = {}
        """address -> server ID learned from its certificate."""
        self._peers: tuple[Peer, ...] = ()
        self._failing: str | None = None
        self._logged: set[tuple[str, str]] = set()

    def peers(self) -> tuple[Peer, ...]:
        return self._peers

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)

    async def refresh(self) -> None:
        """One round: resolve, probe every address, publish. Never raises."""
        try:
            async with asyncio.timeout(self._timeout):
                addresses = await self._resolve(self.name, self.port)
        except (OSError, TimeoutError, UnicodeError) as exc:
            self._error("resolve", f"cannot resolve {self.name}: {type(exc).__name__}")
            return
        if self._failing:
            log.info("DNS membership works again", extra=kv(name=self.name))
            self._failing = None
        if len(addresses) > MAX_ADDRESSES:
            self._reject("*", "too_many", f"{len(addresses)} addresses, using {MAX_ADDRESSES}")
            addresses = addresses[:MAX_ADDRESSES]
        learned = await asyncio.gather(*(self._probe(a) for a in addresses))
        ids = {a: sid for a, sid in zip(addresses, learned, strict=True) if sid is not None}
        self._ids = ids
        peers = tuple(sorted({Peer(sid, _url(a, self.port), "dns") for a, sid in ids.items()},
                             key=lambda p: (p.server_id, p.url)))
        if peers != self._peers:
            self._peers = peers
            self._on_change()

    async def _probe(self, address: str) -> str | None:
        writer = None
        try:
            async with asyncio.timeout(self._timeout):
                _, writer = await asyncio.open_connection(
                    address, self.port, ssl=current_context(self._ssl), server_hostname=address)
                cert = writer.get_extra_info("peercert") or {}
                ssl_object = writer.get_extra_info("ssl_object")
                der = ssl_object.getpeercert(binary_form=True) if ssl_object else None
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            self._reject(address, "unverified" if isinstance(exc, ssl.SSLError) else "unreachable",
                         type(exc).__name__)
            return self._ids.get(address)  # keep what we knew: a blip is not a departure
        finally:
            if writer is not None:
                writer.transport.abort()
        problem = peer_serving_problem(der, "", must_name=False) if der else "no certificate"
        if problem:  # e.g. a kubelet's certificate: the cluster CA signs those too
            self._reject(address, "not_a_peer", problem)
            return None
        server_id = server_id_from_cert(cert, self.name)
        if server_id is None:
            self._reject(address, "no_server_id", "its certificate has no single server-ID "
                                                  "DNS SAN")
        return server_id

    def _reject(self, address: str, reason: str, detail: str) -> None:
        if self._metrics is not None:
            self._metrics.membership_rejected.labels("dns", reason).inc()
        key = (address, reason)
        if key not in self._logged and len(self._logged) < MAX_ADDRESSES * 4:
            self._logged.add(key)
            log.warning("ignoring a DNS address that names no usable peer",
                        extra=kv(name=self.name, address=address, reason=reason, detail=detail))

    def _error(self, reason: str, message: str) -> None:
        if self._metrics is not None:
            self._metrics.membership_errors.labels("dns", reason).inc()
        if self._failing != reason:
            self._failing = reason
            log.warning(message + "; keeping the known peers", extra=kv(name=self.name))


def _url(address: str, port: int) -> str:
    return f"https://[{address}]:{port}" if ":" in address else f"https://{address}:{port}"
