"""A few blocking HTTPS calls to a kube-apiserver, for setting up a dev cluster.

What a server serves (its own aggregated discovery, never merged by a peer proxy),
and creating objects once (an existing one counts as created). Every call has a
timeout; errors are ``KubeHTTPError`` with the status and the start of the body.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from mvproxy.discovery import group_name, parse_aggregated
from mvproxy.errors import MvproxyError

TIMEOUT = 10.0
MAX_DISCOVERY_BYTES = 16 * 1024 * 1024
#: Aggregated discovery, v2, this server's own view (kube-apiserver >= 1.35 and mvproxy
#: both understand profile=nopeer).
NOPEER_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList;profile=nopeer"

GVR = tuple[str, str, str]  # (group, version, resource); "" is the core group


class KubeHTTPError(MvproxyError):
    """A request to a kube-apiserver failed or answered an unexpected status."""


def request(url: str, ssl_context: ssl.SSLContext, method: str, path: str, *,
            body: object = None, accept: str = "application/json",
            timeout: float = TIMEOUT) -> tuple[int, bytes]:
    """One request to the server at ``url`` (``https://host:port``): (status, body)."""
    parts = urlsplit(url)
    conn = http.client.HTTPSConnection(parts.hostname or "127.0.0.1", parts.port or 443,
                                       timeout=timeout, context=ssl_context)
    headers = {"Accept": accept}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as e:
        raise KubeHTTPError(f"{method} {url}{path}: {e}") from e
    finally:
        conn.close()


def served_resources(url: str, ssl_context: ssl.SSLContext, *,
                     nopeer: bool = True) -> frozenset[GVR]:
    """Every (group, version, resource) the server at ``url`` serves itself, read from
    its aggregated discovery (``/api`` and ``/apis``, ``profile=nopeer``); with
    ``nopeer=False``, what it lists (through an mvproxy: the merged view)."""
    served: set[GVR] = set()
    accept = NOPEER_V2 if nopeer else NOPEER_V2.removesuffix(";profile=nopeer")
    for path in ("/api", "/apis"):
        status, body = request(url, ssl_context, "GET", path, accept=accept)
        if status != 200:
            raise KubeHTTPError(f"GET {url}{path}: {status} {body[:200]!r}")
        for group in parse_aggregated(body, max_bytes=MAX_DISCOVERY_BYTES):
            name = group_name(group)
            for version in group.get("versions") or ():
                for resource in version.get("resources") or ():
                    served.add((name, version["version"], resource["resource"]))
    return frozenset(served)


def create_objects(url: str, ssl_context: ssl.SSLContext,
                   objects: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
    """POST each (collection path, object); 201 or 409 AlreadyExists is fine."""
    for path, obj in objects:
        status, body = request(url, ssl_context, "POST", path, body=obj)
        if status not in (200, 201, 409):
            raise KubeHTTPError(f"POST {url}{path} ({obj.get('kind')} "
                                f"{obj.get('metadata', {}).get('name')}): {status} "
                                f"{body[:300]!r}")


__all__ = ["GVR", "KubeHTTPError", "create_objects", "request", "served_resources"]
