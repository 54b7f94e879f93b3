"""The ``default/kubernetes`` Endpoints and EndpointSlice, kept as kube-apiserver keeps them.

kube-apiserver's endpoint reconciler (the default "lease" one) publishes every live
server's ``--advertise-address`` with the port it serves on itself (``--secure-port``):
that is where in-cluster clients of the ``kubernetes`` Service connect, so a layout
that puts a proxy in front of kube-apiserver is right only if the proxy listens there.
Simulated servers sharing a store do the same: each adds its address on start-up
(taking over the port, as the real reconciler rewrites a stale one) and removes it on
a graceful stop. Unlike real validation, loopback addresses are allowed: tests run on
loopback.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable

from .store import AlreadyExists, Conflict, Key, NotFound, Store

log = logging.getLogger(__name__)

NAME = "kubernetes"
ENDPOINTS = Key("", "endpoints", "default", NAME)
SLICE = Key("discovery.k8s.io", "endpointslices", "default", NAME)
_ATTEMPTS = 10  # optimistic-concurrency retries against other servers of the store


def advertise_address(bind_address: str, advertise: str | None) -> str:
    """The address to publish: ``advertise``, else the bind address (loopback if that is
    unspecified: the simulator serves loopback only). ValueError if not an IP address."""
    text = advertise or bind_address or "0.0.0.0"
    ip = ipaddress.ip_address(text)
    if ip.is_unspecified:
        ip = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
    return str(ip)


def _items(value: object, key: str) -> list[dict]:
    """``value[key]`` as a list of mappings; anything else (a client may have written
    the object in any shape) counts as empty."""
    items = value.get(key) if isinstance(value, dict) else None
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _addresses(current: dict | None) -> list[str]:
    found: list[str] = []
    for subset in _items(current, "subsets"):
        for address in _items(subset, "addresses"):
            ip = address.get("ip")
            if isinstance(ip, str) and ip not in found:
                found.append(ip)
    return found


def _endpoints(addresses: list[str], port: int) -> dict:
    subsets = [{"addresses": [{"ip": ip} for ip in addresses],
                "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}] \
        if addresses else []
    return {"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": NAME, "namespace": "default",
                         "labels": {"endpointslice.kubernetes.io/skip-mirror": "true"}},
            "subsets": subsets}


def _slice(addresses: list[str], port: int) -> dict:
    family = "IPv6" if addresses and ":" in addresses[0] else "IPv4"
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": NAME, "namespace": "default",
                         "labels": {"kubernetes.io/service-name": NAME}},
            "addressType": family,
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}
                          for ip in addresses],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}]}


def _port(current: dict | None) -> int | None:
    for subset in _items(current, "subsets"):
        for port in _items(subset, "ports"):
            if type(port.get("port")) is int and 0 < port["port"] < 65536:
                return port["port"]
    return None


def _write(store: Store, change: Callable[[list[str]], list[str]], port: int | None) -> None:
    """Read-modify-write of both objects, retried when another server got there first."""
    for _ in range(_ATTEMPTS):
        try:
            current = store.get(ENDPOINTS)
        except NotFound:
            current = None
        addresses = change(_addresses(current))
        final_port = port if port is not None else _port(current)
        if final_port is None:
            return  # nothing was published and nothing is to be
        wanted = _endpoints(addresses, final_port)
        try:
            if current is None:
                store.create(ENDPOINTS, wanted)
            else:
                wanted["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                store.update(ENDPOINTS, wanted)
        except (Conflict, AlreadyExists, NotFound):
            continue
        _put_slice(store, _slice(addresses, final_port))
        return
    log.warning("default/kubernetes endpoints not updated: the store kept changing")


def _put_slice(store: Store, wanted: dict) -> None:
    for _ in range(_ATTEMPTS):
        try:
            store.update(SLICE, wanted)
            return
        except NotFound:
            try:
                store.create(SLICE, wanted)
                return
            except AlreadyExists:
                continue


def publish(store: Store, address: str, port: int) -> None:
    """Add this server's ``address`` and make ``port`` the published one."""
    _write(store, lambda found: sorted({*found, address}), port)


def withdraw(store: Store, address: str) -> None:
    """Remove this server's address (graceful stop), keeping the others'."""
    _write(store, lambda found: [ip for ip in found if ip != address], None)
