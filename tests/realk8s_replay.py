"""The simulator measured against the real thing (issue 20 §6): one corpus of client
requests replayed against a real kube-apiserver and against ``mvproxy sim`` of the same
release, their answers compared, the differences written to
``docs/simulator-vs-real.md``.

Regenerate the report (about a minute; needs the real binaries, ``python3
scripts/dev.py kube-binaries``)::

    .venv/bin/python tests/realk8s_replay.py              # 1.35.4 and 1.36.3
    .venv/bin/python tests/realk8s_replay.py --versions 1.36.3 --out /tmp/report.md

The corpus (``SCENARIOS``): the discovery requests real clients sent
(``tests/data/kubectl-requests``) replayed with their own headers; the discovery
documents compared group by group, resource by resource; CRUD on core and apps
resources; list and watch by resourceVersion (unset, 0, exact, too old, too large);
label and field selectors; server-side Table and metadata-only output; the common
errors (400, 401, 403, 404, 405, 406, 409, 415, 422). Every step runs against both
servers in the same order with the same identity (the admin client certificate, the
viewer token, no credentials), each in its own namespace per release.

What is compared: the status, the headers a client acts on (Content-Type,
Content-Encoding, Cache-Control; presence of ETag, Audit-Id and Warning) and the body,
key by key, with volatile values masked (uids, timestamps, resourceVersions, continue
tokens, managedFields' contents, allocated IPs, ages, numbers and uids inside
messages). A difference is *accepted* when ``ACCEPTED`` explains it (a simulator limit
left alone, and why); anything else is *unexplained* and fails
``tests/test_real_sim_parity.py``.

The real side is ``realdemo.start_real_cluster`` (one etcd, one kube-apiserver per
release, its mvproxies unused here); the simulated side one ``mvproxy sim`` per release
on the same member address, sharing one store as the real servers share etcd, serving
with the same PKI and token file, so one client identity works on both.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import http.client
import json
import os
import platform
import re
import shlex
import ssl
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's mvproxy
    sys.path.insert(0, str(ROOT))

from mvproxy.devcluster.launcher import SimProcess, free_port  # noqa: E402

CAPTURED = ROOT / "tests" / "data" / "kubectl-requests" / "observed-requests.jsonl"
REPORT = ROOT / "docs" / "simulator-vs-real.md"
DEFAULT_VERSIONS = ("1.35.4", "1.36.3")
HTTP_TIMEOUT = 15.0
WATCH_WAIT = 8.0  # longest wait for the events a watch step expects
WATCH_GRACE = 0.3  # after the expected events: anything more is read and compared too
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
KUBECTL_TABLE = (f"{TABLE},application/json;as=Table;v=v1beta1;g=meta.k8s.io,"
                 "application/json")
PARTIAL = "application/json;as=PartialObjectMetadata;v=v1;g=meta.k8s.io"
PARTIAL_LIST = "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io"
AGG_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
AGG_V2BETA1 = "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList"
AGG_PROTOBUF = ("application/vnd.kubernetes.protobuf;g=apidiscovery.k8s.io;v=v2;"
                "as=APIGroupDiscoveryList")
MASK = "<masked>"

# --------------------------------------------------------------------------- talking


@dataclass
class Reply:
    """What one step got back: status, the headers compared, the body."""

    status: int
    headers: dict[str, str]  # lowercased names, only those in COMPARED_HEADERS
    body: Any  # parsed JSON, else text, else None
    events: list[Any] | None = None  # a watch's events (parsed lines), in order
    stream_ended: bool | None = None  # a watch: did the server end the stream itself?
    error: str = ""  # the request failed before an answer (connection, timeout)
    elapsed: float = 0.0  # seconds from sending to the end of the answer


COMPARED_HEADERS = ("content-type", "content-encoding", "cache-control",
                    "x-content-type-options", "etag", "audit-id", "warning", "retry-after")
PRESENCE_ONLY = frozenset(("etag", "audit-id", "warning", "retry-after"))


@dataclass
class Endpoint:
    """One server to replay against: ``side`` is "real" or "sim"."""

    side: str
    version: str  # the release asked for: 1.36.3 (real) or 1.36 (sim)
    url: str
    ca: Path
    admin_cert: tuple[Path, Path]
    tokens: dict[str, str]  # "viewer", "admin-token" -> bearer token
    front_proxy_cert: tuple[Path, Path] | None = None  # a proxy's, with no user asserted

    def context(self, user: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if user == "admin":
            ctx.load_cert_chain(str(self.admin_cert[0]), str(self.admin_cert[1]))
        elif user == "front-proxy" and self.front_proxy_cert is not None:
            ctx.load_cert_chain(str(self.front_proxy_cert[0]), str(self.front_proxy_cert[1]))
        return ctx

    def connection(self, user: str, timeout: float = HTTP_TIMEOUT) -> http.client.HTTPSConnection:
        parts = urlsplit(self.url)
        return http.client.HTTPSConnection(parts.hostname or "127.0.0.1", parts.port or 443,
                                           timeout=timeout, context=self.context(user))

    def auth_headers(self, user: str) -> dict[str, str]:
        if user in ("viewer", "admin-token"):
            return {"Authorization": f"Bearer {self.tokens[user]}"}
        if user == "badtoken":
            return {"Authorization": "Bearer not-a-token-either-server-knows"}
        return {}  # "admin": the client certificate; "anonymous": nothing


def _decode(raw: bytes, headers: dict[str, str]) -> Any:
    if headers.get("content-encoding") == "gzip":
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8", errors="replace")
    ctype = headers.get("content-type", "")
    if "json" in ctype or text[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError:
            return text
    if "protobuf" in ctype:
        return f"<{len(raw)} bytes of protobuf>"
    return text if text else None


def _kept_headers(message: http.client.HTTPMessage) -> dict[str, str]:
    return {name: message[name] for name in COMPARED_HEADERS if message[name] is not None}


# --------------------------------------------------------------------------- a session


@dataclass
class Step:
    """One request of the corpus and how its two answers are compared."""

    id: str  # "category/name", the same on both sides
    method: str
    path: str
    mode: str = "full"  # full | shape | keys | status | discovery | legacy-groups
    note: str = ""  # what the step is about, for the report


class Session:
    """Runs the corpus against one endpoint and keeps every reply by step id."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.steps: dict[str, Step] = {}
        self.replies: dict[str, Reply] = {}
        self._connections: dict[str, http.client.HTTPSConnection] = {}  # per user

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()

    def _exchange(self, user: str, method: str, path: str, data: bytes | None,
                  headers: dict[str, str], timeout: float | None = None
                  ) -> tuple[http.client.HTTPResponse, bytes]:
        """One request on this user's kept-alive connection; a connection the server
        closed while idle is replaced once (nothing was answered on it). With a
        ``timeout``: on a connection of its own, closed after."""
        if timeout is not None:
            conn = self.endpoint.connection(user, timeout=timeout)
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                return response, response.read()
            finally:
                conn.close()
        for attempt in (1, 2):
            conn = self._connections.get(user)
            reused = conn is not None
            if conn is None:
                conn = self._connections[user] = self.endpoint.connection(user)
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                raw = response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError,
                    ConnectionResetError):
                conn.close()
                del self._connections[user]
                if reused and attempt == 1:
                    continue
                raise
            except (OSError, http.client.HTTPException):
                conn.close()
                del self._connections[user]
                raise
            if response.will_close:
                conn.close()
                del self._connections[user]
            return response, raw
        raise AssertionError("unreachable")

    # -- plain requests ------------------------------------------------------------

    def send(self, step_id: str, method: str, path: str, body: Any = None, *,
             ctype: str = "application/json", accept: str | None = "application/json",
             headers: dict[str, str] | None = None, user: str = "admin",
             mode: str = "full", note: str = "", record: bool = True,
             timeout: float | None = None) -> Reply:
        sent: dict[str, str] = {}
        if accept is not None:
            sent["Accept"] = accept
        sent.update(headers or {})
        sent.update(self.endpoint.auth_headers(user))
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            sent["Content-Type"] = ctype
        started = time.monotonic()
        try:
            response, raw = self._exchange(user, method, path, data, sent, timeout)
            kept = _kept_headers(response.headers)
            reply = Reply(response.status, kept, _decode(raw, kept))
        except (OSError, http.client.HTTPException) as e:
            reply = Reply(0, {}, None, error=f"{type(e).__name__}: {e}")
        reply.elapsed = time.monotonic() - started
        if record:
            self._record(Step(step_id, method, path, mode, note), reply)
        return reply

    def _record(self, step: Step, reply: Reply) -> None:
        if step.id in self.steps:
            raise ValueError(f"step id {step.id!r} used twice")
        self.steps[step.id] = step
        self.replies[step.id] = reply

    # -- watches -------------------------------------------------------------------

    def watch(self, step_id: str, path: str, *, expect: int, accept: str = "application/json",
              during: Callable[[], None] | None = None, user: str = "admin",
              until_end: bool = False, note: str = "") -> Reply:
        """Open a watch, run ``during`` (writes, through other connections) once the
        server answered, then read events until ``expect`` arrived (and a short grace
        for more) or, with ``until_end``, until the server ends the stream."""
        sent = {"Accept": accept, **self.endpoint.auth_headers(user)}
        conn = self.endpoint.connection(user, timeout=WATCH_WAIT)
        events: list[Any] = []
        ended = False
        started = time.monotonic()
        try:
            conn.request("GET", path, headers=sent)
            response = conn.getresponse()
            kept = _kept_headers(response.headers)
            if response.status != 200:
                reply = Reply(response.status, kept, _decode(response.read(), kept))
                self._record(Step(step_id, "WATCH", path, "full", note), reply)
                return reply
            if during is not None:
                during()
            deadline = time.monotonic() + WATCH_WAIT
            grace_until: float | None = None
            while True:
                now = time.monotonic()
                limit = grace_until if grace_until is not None else deadline
                if now >= limit and not until_end:
                    break
                if now >= deadline:
                    break
                assert conn.sock is not None
                conn.sock.settimeout(max(0.01, limit - now))
                try:
                    line = response.readline()
                except TimeoutError:
                    break
                if not line:
                    ended = True
                    break
                if line.strip():
                    events.append(json.loads(line))
                if len(events) >= expect and grace_until is None and not until_end:
                    grace_until = time.monotonic() + WATCH_GRACE
            reply = Reply(200, kept, None, events=events, stream_ended=ended)
        except (OSError, http.client.HTTPException, ValueError) as e:
            reply = Reply(0, {}, None, events=events, error=f"{type(e).__name__}: {e}")
        finally:
            conn.close()
        reply.elapsed = time.monotonic() - started
        mode = "watch-until-end" if until_end else "watch"
        self._record(Step(step_id, "WATCH", path, mode, note), reply)
        return reply


# --------------------------------------------------------------------------- objects


def configmap(name: str, labels: dict[str, str] | None = None,
              data: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": data if data is not None else {"k": "v"}}


def pod(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {"app": name}},
            "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}


def deployment(name: str, replicas: int = 1) -> dict[str, Any]:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                         {"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}}}


def statefulset(name: str) -> dict[str, Any]:
    doc = deployment(name)
    doc["kind"] = "StatefulSet"
    doc["spec"]["serviceName"] = name
    return doc


def service(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": 8080}]}}


def lease(name: str) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
            "spec": {"holderIdentity": "parity", "leaseDurationSeconds": 30}}


def _rv(reply: Reply) -> str:
    body = reply.body if isinstance(reply.body, dict) else {}
    return str((body.get("metadata") or {}).get("resourceVersion") or "")


# --------------------------------------------------------------------------- the corpus
# Each scenario takes a session and the namespace of this release; the same calls run
# against both servers. Step ids are "category/name".


def captured_requests() -> list[dict[str, Any]]:
    """The distinct discovery requests real clients sent (tests/data/kubectl-requests):
    one per (method, path, Accept, User-Agent), in the order first seen."""
    seen: dict[tuple[str, ...], dict[str, Any]] = {}
    for line in CAPTURED.read_text("utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        headers = dict(row["headers"])
        key = (row["method"], row["path"], headers.get("Accept", ""),
               headers.get("User-Agent", ""))
        seen.setdefault(key, row)
    return list(seen.values())


def _client_name(row: dict[str, Any]) -> str:
    return row["client"].split(" (")[0].replace(" ", "-")


def scenario_captured_discovery(s: Session, ns: str) -> None:
    for row in captured_requests():
        headers = {k: v for k, v in row["headers"] if k.lower() not in ("host",)}
        accept = headers.pop("Accept", None)
        short = ("aggregated" if "apidiscovery" in (accept or "") else "plain")
        step = f"captured/{_client_name(row)} {row['method']} {row['path']} ({short})"
        s.send(step, row["method"], row["path"], accept=accept, headers=headers,
               mode="shape", note=f"Accept: {accept}")


def scenario_discovery(s: Session, ns: str) -> None:
    s.send("discovery/aggregated /api v2", "GET", "/api", accept=AGG_V2, mode="discovery")
    s.send("discovery/aggregated /apis v2", "GET", "/apis", accept=AGG_V2, mode="discovery")
    s.send("discovery/aggregated /apis v2beta1", "GET", "/apis", accept=AGG_V2BETA1,
           mode="shape")
    s.send("discovery/aggregated /apis v2 profile=nopeer", "GET", "/apis",
           accept=AGG_V2 + ";profile=nopeer", mode="shape")
    s.send("discovery/aggregated /apis protobuf, else JSON", "GET", "/apis",
           accept=f"{AGG_PROTOBUF},application/json", mode="status")
    first = s.send("discovery/aggregated /apis gzip", "GET", "/apis", accept=AGG_V2,
                   headers={"Accept-Encoding": "gzip"}, mode="status")
    etag = (first.headers.get("etag") or "") if first.status == 200 else ""
    s.send("discovery/aggregated /apis If-None-Match", "GET", "/apis", accept=AGG_V2,
           headers={"If-None-Match": etag or '"none"'}, mode="full")
    s.send("discovery/legacy /api", "GET", "/api", mode="full")
    s.send("discovery/legacy /apis", "GET", "/apis", mode="legacy-groups")
    s.send("discovery/legacy /api/v1", "GET", "/api/v1", mode="discovery")
    s.send("discovery/legacy /apis/apps", "GET", "/apis/apps", mode="full")
    s.send("discovery/legacy /apis/apps/v1", "GET", "/apis/apps/v1", mode="discovery")
    s.send("discovery/legacy /apis/apps/ (trailing slash)", "GET", "/apis/apps/", mode="full")
    s.send("discovery/unknown group /apis/nope.example.com", "GET", "/apis/nope.example.com")
    s.send("discovery/unknown version /apis/apps/v0", "GET", "/apis/apps/v0")
    s.send("discovery/unknown path /nope", "GET", "/nope")
    s.send("discovery/version", "GET", "/version", mode="keys")
    for health in ("/healthz", "/livez", "/readyz"):
        s.send(f"discovery/health {health}", "GET", health, accept=None)
    s.send("discovery/openapi v3 index", "GET", "/openapi/v3", mode="keys")
    s.send("discovery/openapi v3 apps/v1", "GET", "/openapi/v3/apis/apps/v1", mode="keys")
    s.send("discovery/openapi v2", "GET", "/openapi/v2", mode="status")
    s.send("discovery/metrics", "GET", "/metrics", accept=None, mode="status")


def scenario_crud_core(s: Session, ns: str) -> None:
    base = f"/api/v1/namespaces/{ns}"
    cms = f"{base}/configmaps"
    s.send("crud/create namespace", "POST", "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    s.send("crud/get namespace", "GET", f"/api/v1/namespaces/{ns}")
    s.send("crud/create serviceaccount default", "POST", f"{base}/serviceaccounts",
           {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    s.send("crud/create configmap", "POST", cms, configmap("cm-a", {"app": "a"}))
    s.send("crud/create configmap again: 409 AlreadyExists", "POST", cms, configmap("cm-a"))
    got = s.send("crud/get configmap", "GET", f"{cms}/cm-a")
    old_rv = _rv(got)
    changed = configmap("cm-a", {"app": "a"}, {"k": "v2"})
    changed["metadata"]["resourceVersion"] = old_rv
    s.send("crud/update configmap", "PUT", f"{cms}/cm-a", changed)
    s.send("crud/update configmap with a stale resourceVersion: 409 Conflict", "PUT",
           f"{cms}/cm-a", changed)
    s.send("crud/update configmap without resourceVersion", "PUT", f"{cms}/cm-a",
           configmap("cm-a", {"app": "a"}, {"k": "v3"}))
    s.send("crud/update configmap, name differs from URL: 400", "PUT", f"{cms}/cm-a",
           configmap("cm-b"))
    s.send("crud/update missing configmap: 404", "PUT", f"{cms}/cm-none",
           configmap("cm-none"))
    s.send("crud/patch merge", "PATCH", f"{cms}/cm-a", {"data": {"m": "1"}},
           ctype="application/merge-patch+json")
    s.send("crud/patch strategic", "PATCH", f"{cms}/cm-a",
           {"metadata": {"labels": {"s": "1"}}}, ctype="application/strategic-merge-patch+json")
    s.send("crud/patch json", "PATCH", f"{cms}/cm-a",
           [{"op": "add", "path": "/data/j", "value": "1"}], ctype="application/json-patch+json")
    s.send("crud/patch json, failing test op", "PATCH", f"{cms}/cm-a",
           [{"op": "test", "path": "/data/k", "value": "nope"}],
           ctype="application/json-patch+json")
    s.send("crud/patch with Content-Type application/json: 415", "PATCH", f"{cms}/cm-a",
           {"data": {"x": "1"}})
    s.send("crud/patch missing configmap: 404", "PATCH", f"{cms}/cm-none", {"data": {}},
           ctype="application/merge-patch+json")
    s.send("crud/apply creates", "PATCH", f"{cms}/cm-applied?fieldManager=parity",
           configmap("cm-applied", data={"a": "1"}), ctype="application/apply-patch+yaml")
    s.send("crud/apply updates", "PATCH", f"{cms}/cm-applied?fieldManager=parity",
           configmap("cm-applied", data={"a": "2"}), ctype="application/apply-patch+yaml")
    s.send("crud/create dryRun=All", "POST", f"{cms}?dryRun=All", configmap("cm-dry"))
    s.send("crud/get after dryRun: 404", "GET", f"{cms}/cm-dry")
    s.send("crud/create with dryRun=Bogus: 422", "POST", f"{cms}?dryRun=Bogus",
           configmap("cm-dry"))
    s.send("crud/create generateName", "POST", cms,
           {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "gen-"}})
    s.send("crud/list configmaps", "GET", cms)
    s.send("crud/delete with a stale precondition: 409", "DELETE", f"{cms}/cm-a",
           {"apiVersion": "v1", "kind": "DeleteOptions",
            "preconditions": {"resourceVersion": old_rv}})
    s.send("crud/delete configmap", "DELETE", f"{cms}/cm-a")
    s.send("crud/delete configmap again: 404", "DELETE", f"{cms}/cm-a")
    s.send("crud/create secret (stringData)", "POST", f"{base}/secrets",
           {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"},
            "stringData": {"password": "hunter2"}})
    s.send("crud/get secret", "GET", f"{base}/secrets/sec")
    s.send("crud/create service", "POST", f"{base}/services", service("svc"))
    s.send("crud/get service", "GET", f"{base}/services/svc")
    s.send("crud/create pod", "POST", f"{base}/pods", pod("pod-a"))
    s.send("crud/get pod", "GET", f"{base}/pods/pod-a")
    s.send("crud/get pod status", "GET", f"{base}/pods/pod-a/status")
    leases = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
    s.send("crud/create lease", "POST", leases, lease("lease-a"))
    s.send("crud/create lease without a holder", "POST", leases,
           {**lease("lease-b"), "spec": {}})
    s.send("crud/deletecollection configmaps by label", "DELETE",
           f"{cms}?labelSelector=" + quote("app=nobody"))


def scenario_apps(s: Session, ns: str) -> None:
    deps = f"/apis/apps/v1/namespaces/{ns}/deployments"
    s.send("apps/create deployment", "POST", deps, deployment("web"))
    s.send("apps/get deployment", "GET", f"{deps}/web")
    s.send("apps/get deployment scale", "GET", f"{deps}/web/scale")
    s.send("apps/patch deployment scale", "PATCH", f"{deps}/web/scale",
           {"spec": {"replicas": 3}}, ctype="application/merge-patch+json")
    s.send("apps/get deployment status", "GET", f"{deps}/web/status")
    s.send("apps/update deployment status", "PUT", f"{deps}/web/status",
           {**deployment("web"), "status": {"replicas": 3, "observedGeneration": 1}})
    s.send("apps/get deployment after status update", "GET", f"{deps}/web")
    bad = deployment("bad")
    del bad["spec"]["selector"]
    s.send("apps/create deployment without selector: 422", "POST", deps, bad)
    s.send("apps/create deployment, negative replicas: 422", "POST", deps,
           deployment("neg", replicas=-1))
    s.send("apps/create statefulset", "POST", f"/apis/apps/v1/namespaces/{ns}/statefulsets",
           statefulset("db"))
    s.send("apps/list deployments", "GET", f"{deps}?fieldSelector=" + quote("metadata.name=web"))
    s.send("apps/delete deployment", "DELETE", f"{deps}/web")
    _write(s, "POST", deps, deployment("kept"))


def scenario_errors(s: Session, ns: str) -> None:
    cms = f"/api/v1/namespaces/{ns}/configmaps"
    s.send("errors/404 object", "GET", f"{cms}/absent")
    s.send("errors/404 unknown resource", "GET", f"/api/v1/namespaces/{ns}/nopes")
    s.send("errors/404 unknown group", "GET", "/apis/nope.example.com/v1/things")
    s.send("errors/404 cluster-scoped object", "GET", "/api/v1/namespaces/absent-namespace")
    s.send("errors/404 create in a missing namespace", "POST",
           "/api/v1/namespaces/absent-namespace/configmaps", configmap("x"))
    s.send("errors/404 subresource unknown", "GET", f"{cms}/absent/nope")
    s.send("errors/403 viewer creates", "POST", cms, configmap("viewer"), user="viewer")
    s.send("errors/403 viewer deletes", "DELETE", f"{cms}/anything", user="viewer")
    s.send("errors/200 viewer lists", "GET", cms, user="viewer", mode="shape")
    s.send("errors/403 anonymous lists namespaces", "GET", "/api/v1/namespaces",
           user="anonymous")
    s.send("errors/200 anonymous /version", "GET", "/version", user="anonymous", mode="keys")
    s.send("errors/200 anonymous /healthz", "GET", "/healthz", user="anonymous", accept=None)
    s.send("errors/200 anonymous /readyz", "GET", "/readyz", user="anonymous", accept=None)
    s.send("errors/403 anonymous /api", "GET", "/api", user="anonymous")
    s.send("errors/403 anonymous /apis", "GET", "/apis", user="anonymous")
    s.send("errors/403 anonymous /apis/apps", "GET", "/apis/apps", user="anonymous")
    s.send("errors/403 anonymous /apis/nope.example.com", "GET", "/apis/nope.example.com",
           user="anonymous")
    s.send("errors/401 front-proxy certificate without X-Remote-User", "GET", "/api",
           user="front-proxy")
    s.send("errors/200 front-proxy certificate with X-Remote-User", "GET", "/api",
           user="front-proxy", headers={"X-Remote-User": "parity-user",
                                        "X-Remote-Group": "system:authenticated"},
           mode="shape")
    s.send("errors/401 unknown token", "GET", "/api/v1/namespaces", user="badtoken")
    s.send("errors/403 empty bearer token", "GET", "/api", user="anonymous",
           headers={"Authorization": "Bearer "})
    s.send("errors/403 another scheme", "GET", "/api", user="anonymous",
           headers={"Authorization": "Basic cGFyaXR5OnBhcml0eQ=="})
    s.send("errors/422 invalid name", "POST", cms, configmap("Bad_Name"))
    s.send("errors/422 invalid data key", "POST", cms, configmap("bad-key", data={"a b": "1"}))
    s.send("errors/422 no name", "POST", cms,
           {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}})
    s.send("errors/422 label value too long", "POST", cms,
           configmap("long-label", {"app": "x" * 64}))
    s.send("errors/400 malformed JSON", "POST", cms, b'{"apiVersion": "v1", "kind": ')
    s.send("errors/400 apiVersion differs from URL", "POST", cms,
           {**configmap("v"), "apiVersion": "v2"})
    s.send("errors/400 kind differs from URL", "POST", cms, {**configmap("k"), "kind": "Secret"})
    s.send("errors/400 namespace differs from URL", "POST", cms,
           {**configmap("n"), "metadata": {"name": "n", "namespace": "other"}})
    s.send("errors/405 POST to an object", "POST", f"{cms}/absent", configmap("absent"))
    s.send("errors/405 PUT to a collection", "PUT", cms, configmap("x"))
    s.send("errors/406 Accept application/xml", "GET", cms, accept="application/xml")
    s.send("errors/415 Content-Type text/plain", "POST", cms, b"hello", ctype="text/plain")


def _write(s: Session, method: str, path: str, body: Any = None, *,
           ctype: str = "application/json") -> None:
    """A write done during a watch: not a step of its own (both sides do it)."""
    s.send("", method, path, body, ctype=ctype, record=False)


def scenario_list_watch(s: Session, ns: str) -> None:
    cms = f"/api/v1/namespaces/{ns}/configmaps"
    for i in (1, 2, 3):
        _write(s, "POST", cms, configmap(f"w{i}", {"app": "w", "n": str(i)}))
    sel = "labelSelector=" + quote("app=w")
    listed = s.send("list/by label", "GET", f"{cms}?{sel}")
    rv = _rv(listed)
    s.send("list/resourceVersion=0", "GET", f"{cms}?{sel}&resourceVersion=0")
    s.send("list/resourceVersion exact", "GET",
           f"{cms}?{sel}&resourceVersion={rv}&resourceVersionMatch=Exact")
    s.send("list/resourceVersion not older than", "GET",
           f"{cms}?{sel}&resourceVersion={rv}&resourceVersionMatch=NotOlderThan")
    s.send("list/resourceVersionMatch without resourceVersion", "GET",
           f"{cms}?resourceVersionMatch=Exact")
    s.send("list/resourceVersion too large", "GET",
           f"{cms}?{sel}&resourceVersion={int(rv or 0) + 1_000_000}"
           "&resourceVersionMatch=NotOlderThan")
    s.send("list/resourceVersion not a number", "GET", f"{cms}?{sel}&resourceVersion=abc")
    page = s.send("list/limit=2", "GET", f"{cms}?{sel}&limit=2")
    token = ((page.body or {}).get("metadata") or {}).get("continue", "") \
        if isinstance(page.body, dict) else ""
    s.send("list/continue", "GET", f"{cms}?{sel}&limit=2&continue={quote(token)}")
    s.send("list/continue garbage", "GET", f"{cms}?{sel}&limit=2&continue=garbage")

    s.watch("watch/resourceVersion=0: the current objects as ADDED",
            f"{cms}?watch=1&{sel}&resourceVersion=0", expect=3)
    s.watch("watch/no resourceVersion: the current objects as ADDED",
            f"{cms}?watch=1&{sel}", expect=3)

    def changes() -> None:
        _write(s, "PATCH", f"{cms}/w1", {"data": {"k": "changed"}},
               ctype="application/merge-patch+json")
        _write(s, "POST", cms, configmap("w4", {"app": "w", "n": "4"}))
        _write(s, "DELETE", f"{cms}/w2")

    s.watch("watch/from the list's resourceVersion: MODIFIED, ADDED, DELETED",
            f"{cms}?watch=1&{sel}&resourceVersion={rv}", expect=3, during=changes)
    rv2 = _rv(s.send("list/after the changes", "GET", f"{cms}?{sel}"))

    def relabel() -> None:
        _write(s, "PATCH", f"{cms}/w3", {"metadata": {"labels": {"app": "x"}}},
               ctype="application/merge-patch+json")

    s.watch("watch/an object leaving the selector: DELETED",
            f"{cms}?watch=1&{sel}&resourceVersion={rv2}", expect=1, during=relabel)
    # A real server's watch cache starts when the server does: a resourceVersion from
    # before is too old (1.36, started after RBAC's bootstrap writes), one after it is
    # replayed (1.35, the first server, started on an empty etcd).
    s.watch("watch/resourceVersion=1: replayed by the first server, 410 by a later one",
            f"{cms}?watch=1&fieldSelector=metadata.name%3Dw1&resourceVersion=1", expect=1)
    s.watch("watch/sendInitialEvents: ADDED then the initial-events-end BOOKMARK",
            f"{cms}?watch=1&{sel}&sendInitialEvents=true&allowWatchBookmarks=true"
            "&resourceVersionMatch=NotOlderThan", expect=3)
    s.send("watch/sendInitialEvents without resourceVersionMatch", "GET",
           f"{cms}?watch=1&sendInitialEvents=true", timeout=3.0)
    s.send("watch/resourceVersionMatch without sendInitialEvents", "GET",
           f"{cms}?watch=1&resourceVersion=0&resourceVersionMatch=NotOlderThan", timeout=3.0)
    s.watch("watch/Table", f"{cms}?watch=1&{sel}&resourceVersion=0", expect=2, accept=TABLE)
    s.watch("watch/one object by field selector",
            f"{cms}?watch=1&fieldSelector=metadata.name%3Dw1&resourceVersion=0", expect=1)
    s.watch("watch/all namespaces", f"/api/v1/configmaps?watch=1&{sel}&resourceVersion=0",
            expect=2)
    s.watch("watch/timeoutSeconds=1 ends the stream",
            f"{cms}?watch=1&fieldSelector=metadata.name%3Dnone&timeoutSeconds=1",
            expect=0, until_end=True)
    s.send("watch/unsupported field selector: 400", "GET",
           f"{cms}?watch=1&fieldSelector=data.k%3Dv")


def scenario_selectors(s: Session, ns: str) -> None:
    _write(s, "POST", "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": f"{ns}-sel"}})
    cms = f"/api/v1/namespaces/{ns}-sel/configmaps"
    for i, app in enumerate(("s", "s", "t"), start=1):
        _write(s, "POST", cms, configmap(f"sel{i}", {"sel": app, "n": str(i)}))
    for label, text in (
            ("equality", "sel=s"), ("double equals", "sel==s"), ("inequality", "sel!=s"),
            ("set in", "sel in (s,t)"), ("set notin", "sel notin (s)"),
            ("exists", "sel"), ("does not exist", "!sel"), ("greater than", "n>1"),
            ("two requirements", "sel=s,n=2"),
            ("bad syntax: 400", "sel=("), ("bad key: 400", "a b=c")):
        s.send(f"selectors/label {label}", "GET", f"{cms}?labelSelector={quote(text)}")
    for label, text in (
            ("metadata.name", "metadata.name=sel1"), ("metadata.name !=", "metadata.name!=sel1"),
            ("metadata.namespace", f"metadata.namespace={ns}-sel"),
            ("unsupported field: 400", "data.k=v"), ("no operator: 400", "metadata.name")):
        s.send(f"selectors/field {label}", "GET", f"{cms}?fieldSelector={quote(text)}")
    pods = f"/api/v1/namespaces/{ns}/pods"
    for label, text in (("spec.nodeName empty", "spec.nodeName="),
                        ("status.phase=Pending", "status.phase=Pending"),
                        ("spec.restartPolicy", "spec.restartPolicy=Always")):
        s.send(f"selectors/pods {label}", "GET", f"{pods}?fieldSelector={quote(text)}")
    s.send("selectors/secrets type", "GET",
           f"/api/v1/namespaces/{ns}/secrets?fieldSelector={quote('type=Opaque')}")
    s.send("selectors/namespaces by name", "GET",
           f"/api/v1/namespaces?fieldSelector={quote('metadata.name=' + ns)}")


def scenario_tables(s: Session, ns: str) -> None:
    base = f"/api/v1/namespaces/{ns}"
    cms = f"{base}-sel/configmaps?labelSelector=" + quote("sel=s")
    s.send("table/configmaps", "GET", cms, accept=TABLE)
    s.send("table/configmaps, kubectl's Accept", "GET", cms, accept=KUBECTL_TABLE)
    s.send("table/configmaps includeObject=Object", "GET", f"{cms}&includeObject=Object",
           accept=TABLE)
    s.send("table/configmaps includeObject=None", "GET", f"{cms}&includeObject=None",
           accept=TABLE)
    s.send("table/configmaps includeObject=Bogus: 400", "GET", f"{cms}&includeObject=Bogus",
           accept=TABLE)
    s.send("table/one configmap", "GET", f"{base}-sel/configmaps/sel1", accept=TABLE)
    s.send("table/v1beta1 only", "GET", cms, accept="application/json;as=Table;v=v1beta1;"
                                                    "g=meta.k8s.io")
    for what, path in (("pods", f"{base}/pods"), ("services", f"{base}/services"),
                       ("secrets", f"{base}/secrets"),
                       ("serviceaccounts", f"{base}/serviceaccounts"),
                       ("deployments", f"/apis/apps/v1/namespaces/{ns}/deployments"
                        "?fieldSelector=" + quote("metadata.name=kept")),
                       ("statefulsets", f"/apis/apps/v1/namespaces/{ns}/statefulsets"),
                       ("leases", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"),
                       ("namespaces", "/api/v1/namespaces?fieldSelector="
                        + quote("metadata.name=" + ns))):
        s.send(f"table/{what}", "GET", path, accept=TABLE)
    s.send("table/PartialObjectMetadata", "GET", f"{base}-sel/configmaps/sel1", accept=PARTIAL)
    s.send("table/PartialObjectMetadataList", "GET", cms, accept=PARTIAL_LIST)


def scenario_namespace_lifecycle(s: Session, ns: str) -> None:
    gone = f"{ns}-gone"
    _write(s, "POST", "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": gone}})
    _write(s, "POST", f"/api/v1/namespaces/{gone}/configmaps", configmap("inside"))
    s.send("namespace/delete", "DELETE", f"/api/v1/namespaces/{gone}")
    s.send("namespace/get while deleted", "GET", f"/api/v1/namespaces/{gone}")
    s.send("namespace/create inside while deleted", "POST",
           f"/api/v1/namespaces/{gone}/configmaps", configmap("late"))


SCENARIOS: tuple[Callable[[Session, str], None], ...] = (
    scenario_captured_discovery, scenario_discovery, scenario_crud_core, scenario_apps,
    scenario_errors, scenario_list_watch, scenario_selectors, scenario_tables,
    scenario_namespace_lifecycle)


def run_corpus(endpoint: Endpoint, namespace: str) -> Session:
    session = Session(endpoint)
    try:
        for scenario in SCENARIOS:
            scenario(session, namespace)
    finally:
        session.close()
    return session


# --------------------------------------------------------------------------- masking

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_NUMBER = re.compile(r"\d+")
_VOLATILE_META = frozenset(("uid", "resourceVersion", "creationTimestamp",
                            "deletionTimestamp"))
_IP_FIELDS = frozenset(("clusterIP", "clusterIPs"))


def mask_text(text: str) -> str:
    """Uids and numbers in a message (resourceVersions, generated names' counts)."""
    return _NUMBER.sub("N", _UUID.sub("<uid>", text))


def normalize(doc: Any, *, under: str = "") -> Any:
    """``doc`` with volatile values masked, keys kept (so a missing one still shows)."""
    if isinstance(doc, list):
        return [normalize(item, under=under) for item in doc]
    if not isinstance(doc, dict):
        return doc
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if under == "metadata" and key in _VOLATILE_META:
            out[key] = MASK
        elif under == "metadata" and key == "managedFields":
            out[key] = MASK  # present or not is compared, not what it holds
        elif under == "metadata" and key == "continue":
            out[key] = MASK if value else value
        elif under == "metadata" and key == "name" and doc.get("generateName"):
            out[key] = MASK
        elif under == "spec" and key in _IP_FIELDS:
            out[key] = MASK
        elif under == "details" and key == "uid":
            out[key] = MASK
        elif key == "message" and isinstance(value, str) and doc.get("kind") == "Status":
            out[key] = mask_text(value)
        elif key == "serverAddressByClientCIDRs":
            out[key] = MASK
        else:
            out[key] = normalize(value, under=key)
    if doc.get("kind") == "Table" and isinstance(out.get("rows"), list):
        out["rows"] = _mask_table_rows(doc, out["rows"])
    return out


def _mask_table_rows(table: dict[str, Any], rows: list[Any]) -> list[Any]:
    """Cells of the Age (and other date-formatted) columns change with time."""
    columns = table.get("columnDefinitions") or []
    timed = {i for i, c in enumerate(columns)
             if isinstance(c, dict) and (c.get("name") == "Age" or c.get("format") == "date")}
    if not columns:  # a watch event after the first carries no definitions: Age is last
        timed = {-1}
    masked = []
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get("cells"), list):
            cells = list(row["cells"])
            for i in timed:
                if -len(cells) <= i < len(cells):
                    cells[i] = MASK
            row = {**row, "cells": cells}
        masked.append(row)
    return masked


# --------------------------------------------------------------------------- diffing


@dataclass(frozen=True)
class Diff:
    """One difference: ``where`` is "status", "header <name>" or a body path."""

    where: str
    real: str
    sim: str


def _show(value: Any, limit: int = 90) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


_ABSENT = _Absent()


def _key_of(item: Any) -> str | None:
    """How list items are matched up: by name where they have one."""
    if not isinstance(item, dict):
        return None
    meta = item.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("name"), str) and meta["name"] != MASK:
        return meta["name"]
    for field_name in ("name", "resource", "group", "version", "type"):
        if isinstance(item.get(field_name), str) and field_name != "type":
            return f"{field_name}={item[field_name]}"
    return None


def diff_values(real: Any, sim: Any, path: str = "") -> list[Diff]:
    if isinstance(real, dict) and isinstance(sim, dict):
        out: list[Diff] = []
        for key in list(real) + [k for k in sim if k not in real]:
            sub = f"{path}.{key}" if path else key
            out += diff_values(real.get(key, _ABSENT), sim.get(key, _ABSENT), sub)
        return out
    if isinstance(real, list) and isinstance(sim, list):
        real_keys = [_key_of(x) for x in real]
        sim_keys = [_key_of(x) for x in sim]
        keyed = (all(real_keys) and all(sim_keys) and len(set(real_keys)) == len(real_keys)
                 and len(set(sim_keys)) == len(sim_keys))
        if keyed and real_keys != sim_keys:
            by_real = dict(zip(real_keys, real, strict=True))
            by_sim = dict(zip(sim_keys, sim, strict=True))
            out = []
            for key in list(by_real) + [k for k in by_sim if k not in by_real]:
                out += diff_values(by_real.get(key, _ABSENT), by_sim.get(key, _ABSENT),
                                   f"{path}[{key}]")
            return out
        out = []
        for i in range(max(len(real), len(sim))):
            out += diff_values(real[i] if i < len(real) else _ABSENT,
                               sim[i] if i < len(sim) else _ABSENT, f"{path}[{i}]")
        return out
    if real == sim:
        return []
    return [Diff(path or "body", _show(real), _show(sim))]


def _shape(body: Any) -> Any:
    """What a "shape" step compares: kind, apiVersion, the top-level keys, and the keys
    of the first entry of each top-level list."""
    if not isinstance(body, dict):
        return type(body).__name__
    shape: dict[str, Any] = {"keys": dict.fromkeys(body, "present")}
    for key in ("kind", "apiVersion"):
        if key in body:
            shape[key] = body[key]
    for key, value in body.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            shape[f"{key}[0] keys"] = dict.fromkeys(value[0], "present")
    return shape


def _discovery_entries(body: Any) -> dict[str, Any]:
    """group/version/resource -> its attributes, from an aggregated discovery document
    (APIGroupDiscoveryList) or an APIResourceList; subresources under resource/sub."""
    entries: dict[str, Any] = {}
    if not isinstance(body, dict):
        return entries
    if body.get("kind") == "APIResourceList":
        gv = body.get("groupVersion", "")
        for r in body.get("resources") or []:
            attrs = {k: (sorted(v) if isinstance(v, list) else v)
                     for k, v in r.items() if k not in ("name", "storageVersionHash")}
            attrs["storageVersionHash present"] = "storageVersionHash" in r
            entries[f"{gv} {r.get('name')}"] = attrs
        return entries
    for group in body.get("items") or []:
        gname = (group.get("metadata") or {}).get("name", "")
        for version in group.get("versions") or []:
            gv = f"{gname}/{version.get('version')}" if gname else version.get("version")
            entries[f"{gv}"] = {"freshness": version.get("freshness", _ABSENT)}
            for r in version.get("resources") or []:
                attrs = {k: (sorted(v) if isinstance(v, list) and all(
                    isinstance(x, str) for x in v) else v)
                    for k, v in r.items() if k not in ("resource", "subresources")}
                entries[f"{gv} {r.get('resource')}"] = attrs
                for sub in r.get("subresources") or []:
                    sattrs = {k: (sorted(v) if isinstance(v, list) else v)
                              for k, v in sub.items() if k != "subresource"}
                    entries[f"{gv} {r.get('resource')}/{sub.get('subresource')}"] = sattrs
    return entries


def diff_discovery(real: Any, sim: Any) -> list[Diff]:
    """Entries only one side serves, then attribute differences of the shared ones;
    group/versions wholly on one side are one line each, not a line per resource."""
    a, b = _discovery_entries(real), _discovery_entries(sim)
    out: list[Diff] = []
    gvs = lambda entries: {k for k in entries if " " not in k}  # noqa: E731
    only_real_gv, only_sim_gv = gvs(a) - gvs(b), gvs(b) - gvs(a)
    for gv in sorted(only_real_gv):
        out.append(Diff(f"[{gv}]", "served", "(absent)"))
    for gv in sorted(only_sim_gv):
        out.append(Diff(f"[{gv}]", "(absent)", "served"))
    skip = only_real_gv | only_sim_gv
    for key in sorted(set(a) | set(b)):
        if key.split(" ")[0] in skip and " " in key:
            continue
        if key in skip:
            continue
        if key not in b:
            out.append(Diff(f"[{key}]", "served", "(absent)"))
        elif key not in a:
            out.append(Diff(f"[{key}]", "(absent)", "served"))
        else:
            out += diff_values(a[key], b[key], f"[{key}]")
    return out


def _legacy_groups(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        return {}
    return {g.get("name"): {"versions": sorted(v.get("version") for v in g.get("versions") or []),
                            "preferredVersion": (g.get("preferredVersion") or {}).get("version")}
            for g in body.get("groups") or []}


def compare(step: Step, real: Reply, sim: Reply) -> list[Diff]:
    out: list[Diff] = []
    if real.error or sim.error:
        if real.error != sim.error:
            out.append(Diff("error", real.error or "(none)", sim.error or "(none)"))
        return out
    if real.status != sim.status:
        out.append(Diff("status", str(real.status), str(sim.status)))
    for name in COMPARED_HEADERS:
        a, b = real.headers.get(name), sim.headers.get(name)
        if name in PRESENCE_ONLY:
            a = "present" if a is not None else None
            b = "present" if b is not None else None
        if name == "content-type" and a and b:
            a, b = a.replace(" ", ""), b.replace(" ", "")
        if a != b:
            out.append(Diff(f"header {name}", a or "(absent)", b or "(absent)"))
    if step.mode == "status":
        return out
    if real.events is not None or sim.events is not None:
        errored = any(events and isinstance(events[-1], dict) and events[-1].get("type")
                      == "ERROR" for events in (real.events, sim.events))
        if (step.mode == "watch-until-end" or errored) and real.stream_ended != sim.stream_ended:
            out.append(Diff("stream ended by the server", str(real.stream_ended),
                            str(sim.stream_ended)))
        return out + diff_values(normalize(real.events or []), normalize(sim.events or []),
                                 "events")
    if step.mode == "discovery":
        return out + diff_discovery(real.body, sim.body)
    if step.mode == "legacy-groups":
        return out + diff_values(_legacy_groups(real.body), _legacy_groups(sim.body), "groups")
    if step.mode == "keys":
        a = dict.fromkeys(real.body, "present") if isinstance(real.body, dict) \
            else type(real.body).__name__
        b = dict.fromkeys(sim.body, "present") if isinstance(sim.body, dict) \
            else type(sim.body).__name__
        return out + diff_values(a, b, "keys")
    if step.mode == "shape":
        return out + diff_values(_shape(real.body), _shape(sim.body), "shape")
    return out + diff_values(normalize(real.body), normalize(sim.body))


# --------------------------------------------------------------------------- accepted


@dataclass(frozen=True)
class Accepted:
    """Differences left alone: steps (a glob on the step id) x places (globs on where
    the difference is, as ``general`` writes it: without the list item it is in)."""

    steps: str
    where: tuple[str, ...]
    reason: str
    versions: tuple[str, ...] = ()  # releases it applies to (empty: all)
    real: str = "*"  # a glob on each side's value as the report shows it
    sim: str = "*"

    def covers(self, step_id: str, diff: Diff, version: str) -> bool:
        if self.versions and not any(version.lstrip("v").startswith(v) for v in self.versions):
            return False
        if not (glob(step_id, self.steps) and glob(diff.real, self.real)
                and glob(diff.sim, self.sim)):
            return False
        return any(glob(general(diff.where), w) or glob(diff.where, w) for w in self.where)


def glob(text: str, pattern: str) -> bool:
    """``*`` matches anything; every other character, brackets included, itself."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), text, re.S) is not None


_POD_DEFAULTS = ("containers[].resources", "containers[].volumeMounts",
                 "containers[].terminationMessagePath", "containers[].terminationMessagePolicy",
                 "containers[].imagePullPolicy", "restartPolicy", "terminationGracePeriodSeconds",
                 "dnsPolicy", "serviceAccountName", "serviceAccount", "securityContext",
                 "schedulerName", "tolerations", "priority", "enableServiceLinks",
                 "preemptionPolicy", "volumes")
_DEFAULTED = (
    *(f"spec.{f}" for f in _POD_DEFAULTS), *(f"spec.template.spec.{f}" for f in _POD_DEFAULTS),
    "status.qosClass",
    # Deployments and StatefulSets
    "spec.strategy", "spec.revisionHistoryLimit", "spec.progressDeadlineSeconds",
    "spec.podManagementPolicy", "spec.updateStrategy",
    "spec.persistentVolumeClaimRetentionPolicy",
    # Services
    "spec.ports[].protocol", "spec.clusterIP", "spec.clusterIPs", "spec.type",
    "spec.sessionAffinity", "spec.ipFamilies", "spec.ipFamilyPolicy",
    "spec.internalTrafficPolicy")

#: Differences the simulator keeps on purpose, each with why (see the report).
ACCEPTED: tuple[Accepted, ...] = (
    Accepted("*", ("metadata.managedFields",),
             "No server-side apply field tracking: the simulator keeps no managedFields "
             "(mvproxy never reads object bodies; kubectl hides the field by default)."),
    Accepted("*", _DEFAULTED,
             "kube's defaulting and admission mutations are not simulated: the simulator "
             "stores what the client sent (no field defaults, no service-account token "
             "volume, default tolerations or priority, no cluster IP allocated).",
             sim="(absent)"),
    Accepted("*", ("status",),
             "The initial status kube defaults on workloads and Services (part of the "
             "defaulting above).", real="{*}", sim="(absent)"),
    Accepted("table/services", ("cells[]",),
             "No cluster IP is allocated (defaulting above), so CLUSTER-IP shows <none>.",
             real="'10.*'", sim="'<none>'"),
    Accepted("selectors/pods status.phase=Pending", ("items[pod-a]",),
             "A real pod stays Pending (no node here); the simulator's runs (the kubelet "
             "below).", sim="(absent)"),
    Accepted("selectors/pods spec.restartPolicy", ("items[pod-a]",),
             "restartPolicy is defaulted by kube only (defaulting above), so the selector "
             "finds nothing in the simulator.", sim="(absent)"),
    Accepted("*", ("status.phase", "cells[]"),
             "The simulator plays the kubelet: a pod runs at once (so exec, attach, logs "
             "and port-forward work); with no node here a real pod stays Pending, which "
             "status.phase selectors and the STATUS column show too.",
             real="*Pending*"),
    Accepted("*", ("status.conditions",),
             "The running pod's conditions (the kubelet above).", real="(absent)"),
    Accepted("apps/create deployment*: 422", ("*",),
             "Per-kind spec validation is not simulated (names, metadata, labels and "
             "ConfigMap/Secret keys are): the simulator accepts the Deployment."),
    Accepted("errors/400 *", ("message",),
             "Same status, reason and code; the text is Go's decoder's own wording."),
    Accepted("list/continue garbage", ("message",),
             "Same status and prefix; the rest is Go's JSON decoder's wording about kube's "
             "own token format."),
    Accepted("selectors/label bad *: 400", ("message",),
             "Same status and reason; the text is kube's label-selector lexer's wording."),
    Accepted("discovery/*", ("[*/v*alpha*]", "[*/v*beta*]", "[*/v*alpha*] *", "[*/v*beta*] *",
                             "groups.*.versions[]", "groups.internal.apiserver.k8s.io",
                             "groups.storagemigration.k8s.io"),
             "Catalogs come from upstream's api/discovery snapshots, made with every alpha "
             "and beta API switched on (mvproxy's tests rely on 1.36's alpha "
             "scheduling.k8s.io/v1alpha2); the real servers run with their defaults."),
    Accepted("discovery/aggregated /apis v2", ("[admissionregistration.k8s.io/v1 "
                                               "mutatingadmissionpolic*]",),
             "The 1.35 snapshot lists MutatingAdmissionPolicy v1 (switched on there; on by "
             "default only from 1.36).", versions=("1.35",)),
    Accepted("discovery/*", ("[* *].storageVersionHash present",),
             "Legacy discovery omits storageVersionHash (only the storage version migrator "
             "reads it)."),
    Accepted("discovery/*", ("[v1 pods/checkpoint]",),
             "The core group of every catalog comes from one upstream /api/v1 snapshot "
             "(with pods/resize added from 1.33, as real servers list it): it lists the "
             "alpha pods/checkpoint, which real servers do not by default."),
    Accepted("discovery/aggregated /apis protobuf, else JSON", ("header *",),
             "The simulator encodes discovery as JSON only (mvproxy asks its backends for "
             "JSON); kube answers such a client in protobuf."),
    Accepted("table/deployments", ("columnDefinitions[].description",),
             "Column descriptions are one release's API documentation (1.36's); 1.35's "
             "Deployment selector description is one sentence shorter.", versions=("1.35",)),
    Accepted("namespace/*", ("*",),
             "No namespace controller: the simulator empties and removes a namespace at "
             "once (its DELETE answers as kube's, Terminating), where a real control plane "
             "keeps it Terminating until kube-controller-manager has emptied it, refusing "
             "new content meanwhile."),
)


# --------------------------------------------------------------------------- results


@dataclass
class StepResult:
    step: Step
    real: Reply
    sim: Reply
    diffs: list[Diff]
    accepted: list[tuple[Diff, Accepted]] = field(default_factory=list)
    unexplained: list[Diff] = field(default_factory=list)


@dataclass
class VersionResult:
    real_version: str  # the real server's /version gitVersion
    sim_version: str
    namespace: str
    steps: list[StepResult]

    @property
    def unexplained(self) -> list[tuple[StepResult, Diff]]:
        return [(r, d) for r in self.steps for d in r.unexplained]


def compare_sessions(real: Session, sim: Session, release: str) -> list[StepResult]:
    if list(real.steps) != list(sim.steps):
        raise AssertionError(f"the corpus ran differently: {list(real.steps)} vs "
                             f"{list(sim.steps)}")
    results = []
    for step_id, step in real.steps.items():
        diffs = compare(step, real.replies[step_id], sim.replies[step_id])
        result = StepResult(step, real.replies[step_id], sim.replies[step_id], diffs)
        for d in diffs:
            rule = next((a for a in ACCEPTED if a.covers(step_id, d, release)), None)
            if rule is None:
                result.unexplained.append(d)
            else:
                result.accepted.append((d, rule))
        results.append(result)
    return results


def _git_version(endpoint: Endpoint) -> str:
    session = Session(endpoint)
    try:
        reply = session.send("v", "GET", "/version", record=False)
    finally:
        session.close()
    return reply.body.get("gitVersion", "?") if isinstance(reply.body, dict) else "?"


def replay(real: Endpoint, sim: Endpoint, namespace: str) -> VersionResult:
    """The corpus against both servers, real first, then the comparison."""
    real_session = run_corpus(real, namespace)
    sim_session = run_corpus(sim, namespace)
    return VersionResult(_git_version(real), _git_version(sim), namespace,
                         compare_sessions(real_session, sim_session, real.version))


# --------------------------------------------------------------------------- environment


def namespace_for(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"parity-{major}-{minor}"


def sim_release(version: str) -> str:
    return ".".join(version.split(".")[:2])


@dataclass
class Environment:
    """The real cluster and one simulator per release, and endpoints for both."""

    cluster: Any  # RealCluster
    sims: dict[str, SimProcess]  # server id -> its simulator

    def pairs(self) -> Iterator[tuple[str, Endpoint, Endpoint]]:
        """(release, real endpoint, simulator endpoint) per server."""
        pki = self.cluster.pki
        tokens = {"viewer": self.cluster.tokens["viewer-token"],
                  "admin-token": self.cluster.tokens["admin-token"]}
        admin = (pki / "admin.crt", pki / "admin.key")
        for server in self.cluster.servers:
            sim = self.sims[server.id]
            proxy = (pki / server.id / "front-proxy-client.crt",
                     pki / server.id / "front-proxy-client.key")
            yield (server.version,
                   Endpoint("real", server.version, server.backend_url, pki / "ca.crt",
                            admin, tokens, proxy),
                   Endpoint("sim", sim.kubernetes_version, sim.url, pki / "ca.crt",
                            admin, tokens, proxy))


@contextlib.contextmanager
def environment(directory: Path, versions: Sequence[str],
                binaries: Path | None = None) -> Iterator[Environment]:
    """Start the real cluster, then a simulator beside each of its servers (same
    address, PKI and tokens; one store shared by the simulators); stop all of it."""
    from mvproxy.devcluster.demo import version_key
    from mvproxy.devcluster.launcher import stop_all
    from mvproxy.devcluster.realdemo import start_real_cluster

    cluster = start_real_cluster(directory, versions, base_port=0, binaries=binaries)
    sims: dict[str, SimProcess] = {}
    try:
        store = directory / "sim-store.db"
        for name in ("sim-store.db", "sim-store.db-wal", "sim-store.db-shm"):
            (directory / name).unlink(missing_ok=True)
        # One after another, oldest first, as the real servers started: each one's watch
        # history begins where the store was when it started.
        for server in sorted(cluster.servers, key=lambda s: version_key(s.version)):
            sim = SimProcess(
                kubernetes_version=sim_release(server.version), server_id=server.id,
                pki_dir=cluster.pki, port=free_port(server.host), store=store,
                log_dir=directory / "logs", bind_address=server.host,
                token_auth_file=directory / "tokens.csv",
                audit_log_path=directory / server.id / "sim-audit.log")
            sim.name = f"{server.id}-sim"
            sim.log_path = directory / "logs" / f"{sim.name}.log"
            sims[server.id] = sim
            sim.start()
            sim.wait_ready(60)
        yield Environment(cluster, sims)
    finally:
        try:
            stop_all(list(sims.values()))
        finally:
            cluster.stop()


# --------------------------------------------------------------------------- the report


#: What the replay found and the simulator now does as the real servers do, with the
#: regression test of each in tests/test_sim_parity_fixes.py.
FIXED: tuple[tuple[str, str], ...] = (
    ("No credentials: 401 Unauthorized. kube-apiserver (default --anonymous-auth) takes "
     "them as system:anonymous and RBAC answers 403 Forbidden beyond /healthz, /livez, "
     "/readyz and /version; an empty bearer token or another scheme is anonymous too",
     "test_no_credentials_is_system_anonymous_and_forbidden"),
    ("List items carried kind and apiVersion (kube writes them on the list only)",
     "test_list_items_carry_no_kind_or_api_version"),
    ("metadata.generation on every object (kube: only on kinds whose strategy tracks it)",
     "test_generation_only_where_kube_tracks_it"),
    ("DELETE answered the object; kube answers a Success Status naming it, except for "
     "the kinds it returns (pods, services, namespaces (Terminating), ...)",
     "test_delete_answers_a_success_status_for_most_resources"),
    ("A namespace's DELETE answer showed it Active",
     "test_delete_answers_the_object_where_kube_does"),
    ("A stale delete precondition: another message, details.kind the resource",
     "test_a_stale_delete_precondition_names_the_kind"),
    ("Secret stringData stored as sent (kube folds it into data)",
     "test_secret_string_data_is_folded_into_data"),
    ("A dry-run create answered without uid and creationTimestamp",
     "test_dry_run_create_is_filled_in_like_a_real_one"),
    ("422 Invalid named the resource in details.kind and had no causes",
     "test_invalid_names_the_kind_and_lists_causes"),
    ("Label keys/values and ConfigMap/Secret keys were not validated (201 for what kube "
     "refuses with 422)", "test_labels_and_configuration_keys_are_validated"),
    ("dryRun=<other> was 400; kube: 422 against CreateOptions (UpdateOptions, ...)",
     "test_bad_dry_run_is_422_against_the_options_kind"),
    ("406, 415 (body and patch type) and a failing JSON patch test worded otherwise",
     "test_media_type_refusals_read_as_kubes"),
    ("An unknown API group or path got a JSON Status; kube has no handler there and "
     "answers Go's plain-text 404", "test_unknown_groups_and_paths_get_gos_plain_404"),
    ("No Cache-Control (kube: no-cache, private on everything but aggregated discovery); "
     "no X-Content-Type-Options on 403s and health checks",
     "test_api_answers_are_not_cacheable_but_discovery_is"),
    ("resourceVersion options not validated (resourceVersionMatch without "
     "resourceVersion, a non-numeric one, sendInitialEvents without NotOlderThan)",
     "test_list_resource_version_options_are_validated"),
    ("A list at a resourceVersion not reached yet answered at once; kube waits 3 s, then "
     "504 with Retry-After", "test_a_list_from_the_future_times_out_with_retry_after"),
    ("A watch from before the server started was replayed; kube's watch cache starts with "
     "the server, so it is 410 Expired", "test_a_watch_from_before_the_server_started_is_410"),
    ("An object leaving a watch's selector came as DELETED with its new state; kube "
     "sends the last state the watcher saw, at the change's resourceVersion",
     "test_an_object_leaving_the_selector_is_deleted_as_last_seen"),
    ("Aggregated discovery v2beta1 served by every release; gone from 1.33 (406)",
     "test_v2beta1_aggregated_discovery_is_gone_from_1_33"),
    ("OpenAPI: the v3 index labelled JSON (kube: text/plain), documents without ETag",
     "test_openapi_index_is_text_and_documents_have_etags"),
    ("/metrics content type", "test_metrics_are_labelled_as_kube_labels_them"),
    ("Secrets, StatefulSets and Leases printed with the default columns; column "
     "descriptions cut to a sentence",
     "test_tables_have_kubes_columns_for_secrets_statefulsets_leases"),
    ("Pod RESTARTS as a number, Deployment UP-TO-DATE/AVAILABLE typed integer",
     "test_deployment_counts_are_typed_string_and_pod_restarts_are_text"),
    ("includeObject and field-selector syntax refusals worded otherwise",
     "test_table_include_object_refusal_reads_as_kubes"),
)


def _machine() -> str:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{platform.node() or 'unknown host'}: {os.cpu_count()} vCPUs ({cpu or '?'}), "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _some(items: Sequence[str], limit: int) -> str:
    shown = ", ".join(f"`{i}`" for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def render_report(results: Sequence[VersionResult], *, command: str, elapsed: float,
                  when: dt.datetime | None = None) -> str:
    when = when or dt.datetime.now(dt.timezone.utc)
    clients = sorted({_client_name(row).replace("-", " ") for row in captured_requests()})
    lines = [
        "# mvproxy's simulator against the real kube-apiserver",
        "",
        "<!-- Generated by tests/realk8s_replay.py; do not edit by hand. -->",
        "",
        f"Generated {when:%Y-%m-%d %H:%M} UTC on {_machine()}, in {elapsed:.0f} s. "
        f"Regenerate with `{command}` (needs the real binaries: "
        "`python3 scripts/dev.py kube-binaries`); `tests/test_real_sim_parity.py` runs the "
        "same replay and fails on any difference not explained below.",
        "",
        "One corpus of requests (`tests/realk8s_replay.py`) went to a real kube-apiserver "
        "and to `mvproxy sim` of the same release, in the same order, as the same users "
        "(the admin client certificate, the viewer token, no credentials): the discovery "
        "requests real clients sent (" + ", ".join(clients) + "; from "
        "`tests/data/kubectl-requests/`, with their own headers), the discovery documents "
        "(compared group by group, resource by resource), CRUD on core and apps "
        "resources, list and watch by resourceVersion (unset, 0, exact, from before the "
        "server started, from the future), label and field selectors, Table and "
        "metadata-only output, and 400/401/403/404/405/406/409/415/422 errors. Compared: "
        "status, the headers a client acts on (Content-Type, Content-Encoding, "
        "Cache-Control, X-Content-Type-Options; ETag, Audit-Id, Warning and Retry-After "
        "present or not) and the body key by key, with volatile values masked (uids, "
        "timestamps, resourceVersions, continue tokens, managedFields' contents, "
        "allocated IPs, ages, numbers and uids inside messages).",
        "",
        "| real kube-apiserver | simulator | steps | identical | differences left alone "
        "| unexplained |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        same = sum(1 for s in r.steps if not s.diffs)
        accepted = sum(len(s.accepted) for s in r.steps)
        lines.append(f"| {r.real_version} | {r.sim_version} | {len(r.steps)} | {same} | "
                     f"{accepted} | {len(r.unexplained)} |")
    lines += ["", "## Fixed in the simulator", "",
              "Differences this replay found that tests rely on (a status, a Status body, "
              "watch and list semantics, what kubectl prints), each now answered as the "
              "real servers do, with its regression test in "
              "`tests/test_sim_parity_fixes.py`. mvproxy itself needed no change: it "
              "passes these answers through, and the tests that had encoded the "
              "simulator's old ones (anonymous 401s in `test_discovery_e2e.py`, "
              "`test_proxy_e2e.py`, `test_sim_e2e.py`, `test_sim_auth.py`; a JSON 404 for "
              "unknown groups) now assert the real ones.", ""]
    lines += [f"- {what} (`{test}`)." for what, test in FIXED]
    lines += ["", "## Left alone, and why", ""]
    by_rule: dict[int, list[tuple[str, StepResult, Diff]]] = defaultdict(list)
    for r in results:
        for s in r.steps:
            for d, rule in s.accepted:
                by_rule[id(rule)].append((r.real_version, s, d))
    for rule in ACCEPTED:
        found = by_rule.get(id(rule), [])
        places = sorted({general(d.where) for _, _, d in found})
        steps = sorted({s.step.id for _, s, _ in found})
        versions = sorted({v for v, _, _ in found})
        lines.append(f"- **{rule.reason}** {_count(len(found), 'difference')} in "
                     f"{_count(len(steps), 'step')} "
                     f"({', '.join(versions) or 'none'}): {_some(places, 6)}; "
                     f"in {_some(steps, 4)}.")
    lines += ["", "## Unexplained differences", ""]
    unexplained = [(r, s, d) for r in results for s in r.steps for d in s.unexplained]
    if not unexplained:
        lines.append("None.")
    else:
        lines += ["| release | step | where | real | simulator |", "|---|---|---|---|---|"]
        lines += [f"| {r.real_version} | {_cell(s.step.id)} | {_cell(d.where)} | "
                  f"{_cell(d.real)} | {_cell(d.sim)} |" for r, s, d in unexplained]
    identical = sorted(set.intersection(*({s.step.id for s in r.steps if not s.diffs}
                                          for r in results))) if results else []
    lines += ["", "## Identical in every release", "",
              f"{len(identical)} steps: " + (", ".join(f"`{i}`" for i in identical) or "none")]
    common = pervasive(results)
    lines += ["", "## Every difference", "",
              "Those seen in many answers first (list items and watch events included), "
              "once each; then the rest, step by step.", "",
              "| where | real | simulator | steps | why |", "|---|---|---|---|---|"]
    for key, (count, reason) in sorted(common.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {_cell(key[0])} | {_cell(key[1])} | {_cell(key[2])} | {count} | "
                     f"{_cell(reason)} |")
    for r in results:
        rows = []
        for s in r.steps:
            why = {id(d): rule.reason for d, rule in s.accepted}
            for d in s.diffs:
                if (general(d.where), d.real, d.sim) in common:
                    continue
                rows.append(f"| {_cell(s.step.id)} | {_cell(d.where)} | {_cell(d.real)} | "
                            f"{_cell(d.sim)} | {_cell(why.get(id(d), '**unexplained**'))} |")
        lines += ["", f"### {r.real_version} against simulator {r.sim_version}", ""]
        lines += (["| step | where | real | simulator | why |", "|---|---|---|---|---|", *rows]
                  if rows else ["None beyond those above."])
    return "\n".join(lines) + "\n"


def summarize(results: Sequence[VersionResult]) -> str:
    counts: Counter[str] = Counter()
    per: dict[str, int] = defaultdict(int)
    for r in results:
        for s in r.steps:
            per[r.real_version] += len(s.unexplained)
            counts["accepted"] += len(s.accepted)
            counts["unexplained"] += len(s.unexplained)
    return (f"{counts['unexplained']} unexplained, {counts['accepted']} accepted "
            f"differences ({', '.join(f'{v}: {n}' for v, n in per.items())})")


_ITEM_PREFIX = re.compile(r"^(?:(?:items|events|rows)\[[^\]]*\]\.(?:object\.)?)+")
_INDEX = re.compile(r"\[\d+\]")
PERVASIVE = 6  # distinct steps before a difference is shown once for all


def general(where: str) -> str:
    """A body path without the list item it is in: ``items[a].metadata.x`` ->
    ``metadata.x``, ``events[2].object.spec.y[0]`` -> ``spec.y[]``."""
    return _INDEX.sub("[]", _ITEM_PREFIX.sub("", where))


def pervasive(results: Sequence[VersionResult]) -> dict[tuple[str, str, str], tuple[int, str]]:
    """(general where, real, sim) seen in at least PERVASIVE steps -> (steps, why)."""
    steps: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    why: dict[tuple[str, str, str], str] = {}
    for r in results:
        for s in r.steps:
            reasons = {id(d): rule.reason for d, rule in s.accepted}
            for d in s.diffs:
                key = (general(d.where), d.real, d.sim)
                steps[key].add(f"{r.real_version} {s.step.id}")
                if id(d) not in reasons:
                    why[key] = "**unexplained**"
                else:
                    why.setdefault(key, reasons[id(d)])
    return {k: (len(v), why[k]) for k, v in steps.items() if len(v) >= PERVASIVE}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=",".join(DEFAULT_VERSIONS),
                        help="real releases, comma separated (default %(default)s)")
    parser.add_argument("--out", type=Path, default=REPORT, help="default %(default)s")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mvproxy-sim-vs-real"),
                        help="working directory for the servers (default %(default)s)")
    parser.add_argument("--kube-binaries", type=Path, default=None)
    args = parser.parse_args(argv)
    versions = [v.strip() for v in args.versions.split(",") if v.strip()]
    started = time.monotonic()
    results = []
    with environment(args.dir, versions, args.kube_binaries) as env:
        for release, real, sim in env.pairs():
            results.append(replay(real, sim, namespace_for(release)))
    elapsed = time.monotonic() - started
    shown = [".venv/bin/python", "tests/realk8s_replay.py"]
    if versions != list(DEFAULT_VERSIONS):
        shown += ["--versions", ",".join(versions)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render_report(results, command=shlex.join(shown), elapsed=elapsed),
                        "utf-8")
    print(f"{args.out}: {summarize(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
