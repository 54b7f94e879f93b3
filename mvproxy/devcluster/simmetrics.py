"""The simulated kube-apiserver's own ``/metrics``: a few of kube's real series.

``kubectl get --raw /metrics`` and Prometheus scrapes expect the apiserver's
exposition; the simulator keeps the three series people look at first, with kube's
names and labels: ``apiserver_request_total`` (per verb, group, version, resource,
subresource, scope, component, code), ``apiserver_current_inflight_requests``
(readOnly / mutating) and ``process_start_time_seconds``. Each server has its own
registry, so two simulators in one process (tests) do not share counts. Who may read
it is simauth's business (kube: system:masters or a ``/metrics`` nonResourceURLs rule).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

from mvproxy.requestinfo import RequestInfo

from .simauth import REQUEST_INFO

PATH = "/metrics"
_READ_ONLY = frozenset(("get", "list", "watch", "proxy"))
_LABELS = ("verb", "dry_run", "group", "version", "resource", "subresource", "scope",
           "component", "code")

disable_created_metrics()

#: What kube-apiserver labels its text exposition with (component-base's legacy
#: registry); the body is the same text format prometheus_client writes.
KUBE_METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8; escaping=underscores"


def _scope(info: RequestInfo) -> str:
    if info.namespace:
        return "namespace" if not info.name else "resource"
    if info.name:
        return "resource"
    return "cluster"


def _verb(request: web.Request, info: RequestInfo) -> str:
    """kube's metric verbs: upper case HTTP-ish (LIST, WATCH, GET, POST, APPLY, ...)."""
    if info.is_resource_request:
        if info.verb == "patch" and request.content_type == "application/apply-patch+yaml":
            return "APPLY"
        return {"create": "POST", "update": "PUT", "deletecollection": "DELETE"}.get(
            info.verb, info.verb.upper())
    return request.method.upper()


class SimMetrics:
    """One server's registry and the middleware that fills it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "apiserver_request_total",
            "Counter of apiserver requests broken out for each verb, dry run value, group, "
            "version, resource, scope, component, and HTTP response code.",
            _LABELS, registry=self.registry)
        self.inflight = Gauge(
            "apiserver_current_inflight_requests",
            "Maximal number of currently used inflight request limit of this apiserver "
            "per request kind in last second.", ["request_kind"], registry=self.registry)
        for kind in ("readOnly", "mutating"):
            self.inflight.labels(request_kind=kind).set(0)
        start = Gauge("process_start_time_seconds",
                      "Start time of the process since unix epoch in seconds.",
                      registry=self.registry)
        start.set(time.time())

    def middleware(self) -> Any:
        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            info: RequestInfo = request[REQUEST_INFO]
            kind = "readOnly" if info.verb in _READ_ONLY else "mutating"
            # Like kube, long-running requests (watches) are not "in flight".
            gauge = None if info.verb == "watch" else self.inflight.labels(request_kind=kind)
            if gauge is not None:
                gauge.inc()
            code = 500
            try:
                response = await handler(request)
                code = response.status
                return response
            except web.HTTPException as exc:
                code = exc.status
                raise
            finally:
                if gauge is not None:
                    gauge.dec()
                self._observe(request, info, code)

        return count

    def _observe(self, request: web.Request, info: RequestInfo, code: int) -> None:
        if not info.is_resource_request:
            return  # kube counts non-resource requests too, but under no resource: skip
        dry_run = "All" if "dryRun" in request.query else ""
        self.requests.labels(
            verb=_verb(request, info), dry_run=dry_run, group=info.api_group,
            version=info.api_version, resource=info.resource,
            subresource=info.subresource, scope=_scope(info), component="apiserver",
            code=str(code)).inc()

    def handle(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": KUBE_METRICS_CONTENT_TYPE})
