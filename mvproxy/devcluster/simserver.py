"""``mvproxy sim``: a simulated kube-apiserver that real kubectl and client libraries use.

One process serves one release's API surface (a catalog) over HTTPS; several, of
different releases, share one SQLite store the way real servers share etcd. This
module assembles the application (request info → authentication/audit → routing)
and runs it until SIGTERM/SIGINT. The handlers live in ``simdiscovery`` (discovery,
version, health), ``simresources`` (CRUD, subresources) and ``simwatch`` (watch).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
import ssl
from pathlib import Path
from typing import Any

from aiohttp import web

from mvproxy.errors import PKIError, UsageError
from mvproxy.logs import kv
from mvproxy.requestinfo import RequestInfo, parse_request_info

from . import apistatus, simendpoints, simlogs, simwatch
from .catalog import Catalog, disabled_keys, load_catalog
from .simauth import REQUEST_INFO
from .simdiscovery import Discovery, health, version_info
from .simmetrics import PATH as METRICS_PATH
from .simmetrics import SimMetrics
from .simopenapi import PREFIX, OpenAPI
from .simopenapiv2 import PATH as OPENAPI_V2_PATH
from .simopenapiv2 import OpenAPIV2
from .simresources import ResourceAPI
from .store import AlreadyExists, Key, Store

log = logging.getLogger(__name__)

#: Namespaces every cluster has; created by whichever server starts first.
SYSTEM_NAMESPACES = ("default", "kube-system", "kube-public")
_HEALTH = frozenset(("healthz", "livez", "readyz"))
_SHUTDOWN_GRACE = 5.0
#: Non-resource paths a real kube-apiserver serves and the simulator does not.
_KUBE_ONLY_PATHS = ("/logs", "/debug", "/.well-known", "/openid",
                    "/flowcontrol", "/ui")

SIM: web.AppKey[Sim] = web.AppKey("sim")


class Sim:
    """Routes one request by its RequestInfo to discovery, resources or health."""

    def __init__(self, catalog: Catalog, store: Store, server_address: str,
                 bookmark_interval: float) -> None:
        self.discovery = Discovery(catalog, server_address)
        self.resources = ResourceAPI(catalog, store, bookmark_interval=bookmark_interval)
        self.version = version_info(catalog)
        self.openapi = OpenAPI(catalog)
        self.openapi_v2 = OpenAPIV2(catalog)
        self.metrics = SimMetrics()

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        info: RequestInfo = request[REQUEST_INFO]
        if info.is_resource_request:
            return await self.resources.handle(request, info)
        if request.method not in ("GET", "HEAD"):
            return apistatus.method_not_allowed()
        if info.api_prefix:
            return self.discovery.handle(request, info)
        path = request.path.rstrip("/")
        if path == PREFIX or path.startswith(PREFIX + "/"):
            return self.openapi.handle(request)
        if path == OPENAPI_V2_PATH:
            return self.openapi_v2.handle(request)
        if path == METRICS_PATH:
            return self.metrics.handle(request)
        if path == "/version":
            return web.Response(body=self.version, content_type="application/json")
        if path.split("/")[1:2] and path.split("/")[1] in _HEALTH:
            return health(request)
        if any(path == p or path.startswith(p + "/") for p in _KUBE_ONLY_PATHS):
            return apistatus.not_simulated(404, f"GET {path}")
        return apistatus.page_not_found()


@web.middleware
async def request_info_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """First of all: what the request *is*, in kube's terms, for auth, audit and routing."""
    request[REQUEST_INFO] = parse_request_info(request.method, request.path,
                                               request.query_string)
    return await handler(request)


async def _no_cache(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """kube-apiserver marks every answer uncacheable but aggregated discovery's (which
    sets its own ``public``), errors and watches included."""
    response.headers.setdefault("Cache-Control", "no-cache, private")


def ensure_namespaces(store: Store) -> None:
    """Create the system namespaces; another server sharing the store may have already."""
    for name in SYSTEM_NAMESPACES:
        obj = {"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
               "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
        try:
            store.create(Key("", "namespaces", "", name), obj)
        except AlreadyExists:
            pass


def build_app(*, catalog: Catalog, store: Store, server_id: str, authenticator: Any = None,
              audit: Any = None, server_address: str = "127.0.0.1:6443",
              bookmark_interval: float = 1.0) -> web.Application:
    """The simulated kube-apiserver as an aiohttp application (no TLS: the caller's job).

    With an ``authenticator`` (``simauth.Authenticator``), requests are authenticated,
    authorized and audited; without one everything is allowed (in-process tests).
    """
    sim = Sim(catalog, store, server_address, bookmark_interval)
    middlewares: list[Any] = [request_info_middleware, sim.metrics.middleware()]
    if authenticator is not None:
        from . import simauth

        middlewares.append(simauth.auth_middleware(authenticator, audit or simauth.AuditLog(None)))
    app = web.Application(middlewares=middlewares, client_max_size=3 * 1024 * 1024)
    if authenticator is not None:
        app.on_response_prepare.append(simauth.audit_id_on_prepare)
    app.on_response_prepare.append(_no_cache)
    ensure_namespaces(store)
    app[SIM] = sim
    app[simwatch.WATCHES] = set()
    app.on_shutdown.append(simwatch.on_shutdown)
    app[simlogs.FOLLOWS] = set()
    app.on_shutdown.append(simlogs.on_shutdown)
    app.router.add_route("*", "/{tail:.*}", sim.dispatch)
    log.debug("sim app built", extra=kv(server_id=server_id,
                                        version=catalog.kubernetes_version))
    return app


# --- the process ---------------------------------------------------------------------


def _require(path: Path, what: str) -> Path:
    if not path.is_file():
        raise PKIError(f"{what} {path} not found (run `mvproxy certs init` first)")
    return path


def _tls_context(pki: Path, server_id: str) -> ssl.SSLContext:
    """Serving certificate of this server; client certificates from either CA, optional."""
    from mvproxy.tls import server_context

    server_dir = pki / server_id
    cert = _require(server_dir / "apiserver.crt", "serving certificate")
    key = _require(server_dir / "apiserver.key", "serving key")
    ca = _require(pki / "ca.crt", "cluster CA")
    front_proxy_ca = _require(pki / "front-proxy-ca.crt", "front-proxy CA")
    ctx = server_context(cert, key, ca, require_client_cert=False)
    try:
        ctx.load_verify_locations(cafile=str(front_proxy_ca))
    except (OSError, ssl.SSLError) as exc:
        raise PKIError(f"cannot load front-proxy CA {front_proxy_ca}: {exc}") from None
    return ctx


def _authentication(args: Any, pki: Path) -> tuple[Any, Any]:
    from . import simauth

    authenticator = simauth.Authenticator.from_files(
        pki / "ca.crt", pki / "front-proxy-ca.crt", args.token_auth_file)
    return authenticator, simauth.AuditLog(args.audit_log_path)


def _open_store(path: str) -> Store:
    try:
        return Store(path)
    except (sqlite3.Error, OSError) as exc:
        raise UsageError(f"cannot open store {path}: {exc}") from None


def run_sim(args: Any) -> int:
    """Serve until SIGTERM/SIGINT, then stop cleanly; input errors raise (exit 2)."""
    try:
        catalog = load_catalog(args.kubernetes_version)
        catalog = catalog.without(disabled_keys(getattr(args, "runtime_config", "")))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        advertise = simendpoints.advertise_address(
            args.bind_address, getattr(args, "advertise_address", None))
    except ValueError as exc:
        raise UsageError(f"--advertise-address: {exc}") from None
    pki = Path(args.pki)
    ctx = _tls_context(pki, args.server_id)
    authenticator, audit = _authentication(args, pki)  # opens the audit log: exit 2 if not
    try:
        store = _open_store(args.store)
    except BaseException:
        audit.close()
        raise
    try:
        address = f"{args.bind_address}:{args.secure_port}"
        app = build_app(catalog=catalog, store=store, server_id=args.server_id,
                        authenticator=authenticator, audit=audit, server_address=address)
        asyncio.run(_serve(app, ctx, args, catalog, store, advertise))
    finally:
        audit.close()
        store.close()
    return 0


async def _serve(app: web.Application, ctx: ssl.SSLContext, args: Any,
                 catalog: Catalog, store: Store, advertise: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=_SHUTDOWN_GRACE)
    await runner.setup()
    try:
        site = web.TCPSite(runner, args.bind_address, args.secure_port, ssl_context=ctx)
        try:
            await site.start()
        except OSError as exc:
            raise UsageError(f"cannot listen on {args.bind_address}:{args.secure_port}: "
                             f"{exc.strerror or exc}") from None
        # Like kube-apiserver: default/kubernetes = advertise address + own secure port.
        simendpoints.publish(store, advertise, args.secure_port)
        log.info("serving", extra=kv(server_id=args.server_id, version=catalog.git_version,
                                     address=f"https://{args.bind_address}:{args.secure_port}",
                                     advertise=advertise))
        try:
            await stop.wait()
        finally:
            simendpoints.withdraw(store, advertise)
        log.info("stopping", extra=kv(server_id=args.server_id))
    finally:
        await runner.cleanup()
