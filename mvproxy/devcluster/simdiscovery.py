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


class Discovery:
    """Pre-rendered discovery documents of one catalog, keyed by path."""

    def __init__(self, catalog: Catalog, server_address: str) -> None:
        self.aggregated: dict[tuple[str, str], Document] = {}
        for prefix, core in (("api", True), ("apis", False)):
            for version in ("v2", "v2beta1"):
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
        top_level = path in ("/api", "/apis")
        conversions = DISCOVERY_CONVERSIONS if top_level else {}
        chosen = negotiate(request.headers.get("Accept"), conversions)
        if chosen is None:
            return apistatus.not_acceptable()
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
    if "verbose" in request.query:
        check = request.path.strip("/").split("/")[0]
        return web.Response(text=f"[+]ping ok\n{check} check passed\n")
    return web.Response(text="ok")
