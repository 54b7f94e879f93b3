"""Discovery, version and health endpoints of the simulated kube-apiserver.

Every document is rendered and serialised once, at startup, because a catalog never
changes while a server runs: a request only negotiates which bytes to send. The
aggregated documents carry kube's caching headers (ETag = quoted uppercase hex
SHA-512 of the body, ``Vary: Accept``, ``Cache-Control: public``) so clients and
mvproxy's poller can revalidate with ``If-None-Match``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from aiohttp import web

from mvproxy.requestinfo import RequestInfo

from . import apistatus, discoverydocs
from .catalog import Catalog
from .mediatypes import DISCOVERY_CONVERSIONS, aggregated_content_type, negotiate

JSON = "application/json"


def dump(doc: object) -> bytes:
    """kube's JSON encoder output: compact, with a trailing newline."""
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


@dataclass(frozen=True)
class Document:
    body: bytes
    content_type: str = JSON
    etag: str = ""

    @classmethod
    def aggregated(cls, doc: dict, version: str) -> Document:
        body = dump(doc)
        etag = '"' + hashlib.sha512(body).hexdigest().upper() + '"'
        return cls(body, aggregated_content_type(version), etag)


#: The first release that no longer serves aggregated discovery ``v2beta1`` (its
#: feature gate AggregatedDiscoveryRemoveBetaType is on by default from 1.33); measured
#: against kube-apiserver 1.35.4 and 1.36.3, which answer such a request with 406.
V2BETA1_REMOVED = (1, 33)


def aggregated_versions(catalog: Catalog) -> tuple[str, ...]:
    """The aggregated discovery versions this release serves, best first."""
    release = tuple(int(p) for p in catalog.kubernetes_version.split(".")[:2])
    return ("v2",) if release >= V2BETA1_REMOVED else ("v2", "v2beta1")


class Discovery:
    """Pre-rendered discovery documents of one catalog, keyed by path."""

    def __init__(self, catalog: Catalog, server_address: str) -> None:
        self.aggregated: dict[tuple[str, str], Document] = {}
        versions = aggregated_versions(catalog)
        self.conversions = {key: chosen for key, chosen in DISCOVERY_CONVERSIONS.items()
                            if chosen.version in versions}
        self.groups = frozenset(g.name for g in catalog.groups)
        for prefix, core in (("api", True), ("apis", False)):
            for version in versions:
                doc = discoverydocs.aggregated(
                    catalog, core=core, api_version=f"apidiscovery.k8s.io/{version}")
                self.aggregated[(prefix, version)] = Document.aggregated(doc, version)
        self.legacy: dict[str, Document] = {
            "/api": Document(dump(discoverydocs.api_versions(server_address))),
            "/apis": Document(dump(discoverydocs.api_group_list(catalog))),
        }
        for group in catalog.groups:
            base = f"/apis/{group.name}" if group.name else "/api"
            if group.name:
                self.legacy[base] = Document(dump(discoverydocs.api_group(catalog, group.name)))
            for v in group.versions:
                listing = discoverydocs.api_resource_list(catalog, group.name, v.version)
                self.legacy[f"{base}/{v.version}"] = Document(dump(listing))

    def handle(self, request: web.Request, info: RequestInfo) -> web.StreamResponse:
        """Serve ``/api``, ``/apis`` and the per-group/version legacy documents."""
        path = "/" + "/".join(p for p in (info.api_prefix, info.api_group, info.api_version) if p)
        if info.api_prefix == "apis" and info.api_group and info.api_group not in self.groups:
            return apistatus.page_not_found()  # no handler for the group at all
        top_level = path in ("/api", "/apis")
        conversions = self.conversions if top_level else {}
        chosen = negotiate(request.headers.get("Accept"), conversions)
        if chosen is None:
            return apistatus.discovery_not_acceptable()
        if chosen.kind:
            return _send(request, self.aggregated[(info.api_prefix, chosen.version)])
        doc = self.legacy.get(path)
        if doc is None or request.path.rstrip("/") != path:
            return apistatus.path_not_found()
        return _send(request, doc)


def _send(request: web.Request, doc: Document) -> web.Response:
    if not doc.etag:
        return web.Response(body=doc.body, headers={"Content-Type": doc.content_type})
    headers = {"ETag": doc.etag, "Vary": "Accept", "Cache-Control": "public"}
    if request.headers.get("If-None-Match") == doc.etag:
        return web.Response(status=304, headers=headers)
    headers["Content-Type"] = doc.content_type
    return web.Response(body=doc.body, headers=headers)


def version_info(catalog: Catalog) -> bytes:
    """``/version``: what ``kubectl version`` prints for the server."""
    major, minor = catalog.kubernetes_version.split(".")[:2]
    return dump({
        "major": major, "minor": minor,
        "emulationMajor": major, "emulationMinor": minor,
        "minCompatibilityMajor": major, "minCompatibilityMinor": str(max(int(minor) - 1, 0)),
        "gitVersion": catalog.git_version, "gitCommit": "0" * 40, "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.25.0", "compiler": "gc",
        "platform": "linux/amd64",
    })


def health(request: web.Request) -> web.Response:
    """``/healthz``, ``/livez``, ``/readyz`` and their per-check paths: always healthy."""
    nosniff = {"X-Content-Type-Options": "nosniff"}  # as kube's health handlers send
    if "verbose" in request.query:
        check = request.path.strip("/").split("/")[0]
        return web.Response(text=f"[+]ping ok\n{check} check passed\n", headers=nosniff)
    return web.Response(text="ok", headers=nosniff)
