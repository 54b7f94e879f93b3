#!/usr/bin/env python3
"""mvproxy side by side with upstream's built-in Mixed Version Proxy, on the same real
kube-apiservers, and the false 404 it exists for (issue 20 §4 and §5).

    python3 scripts/upstream_comparison.py [--pairs 1.35.4,1.36.3 1.36.3,1.37.2]
        [--requests 2000] [--output docs/upstream-comparison.md]

writes ``docs/upstream-comparison.md`` from real runs. It needs the binaries that
``python3 scripts/dev.py kube-binaries`` caches; run with the system Python, it makes
``.venv`` (as ``dev.py`` does) and re-runs itself there. Each pair of releases runs
twice, each time in a fresh control plane of one etcd and one kube-apiserver per
release (``mvproxy.devcluster.realdemo``), the older started first as in an upgrade:

* **built-in**: the kube-apiservers with their own peer proxy on (``--peer-ca-file``,
  ``--peer-advertise-ip``, ``--peer-advertise-port``, the feature gate
  ``UnknownVersionInteroperabilityProxy=true``; the proxy client certificate and
  requestheader flags are kubeadm's, which every server of the demo has) and no
  mvproxy; clients talk to a kube-apiserver directly;
* **mvproxy**: one mvproxy in front of each kube-apiserver, the built-in proxy off (no
  ``--peer-ca-file``); clients talk to an mvproxy.

Then a third, smaller run per pair, **both** (``BOTH``): the built-in proxy on and an
mvproxy in front of each server, to show a rerouted request is served once (no second
hop, no loop, the client's identity kept).

Every request comes from the same client code (Python's ``http.client``, HTTP/1.1 over
TLS, bound to ``CLIENT_HOST`` so audit logs show where it came from), aimed at the
*old* server's entry point: its kube-apiserver (built-in) or its mvproxy.

``tests/test_real_upstream.py`` and ``tests/test_real_false404.py`` load this file and
assert the same scenarios, smaller; this generator is not part of the suite.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import functools
import http.client
import json
import os
import platform
import random
import re
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "upstream-comparison.md"
DEFAULT_PAIRS = (("1.35.4", "1.36.3"), ("1.36.3", "1.37.2"))
DEFAULT_REQUESTS = 2000

BUILTIN, MVPROXY = "built-in", "mvproxy"
MODES = (BUILTIN, MVPROXY)
BOTH = "both"  # the built-in proxy on and mvproxy in front: a third, smaller run
OLD, NEW = "apiserver-0", "apiserver-1"  # member 0 runs the older release
CLIENT_HOST = "127.0.0.9"  # every request leaves from here (the audit's sourceIPs)
HTTP_TIMEOUT = 15.0
SYNC_TIMEOUT = 90.0
GATE = "UnknownVersionInteroperabilityProxy"
AGGREGATED_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
NOPEER_V2 = AGGREGATED_V2 + ";profile=nopeer"

GVR = tuple[str, str, str]


# --------------------------------------------------------------------------- venv


def _reexec_in_venv() -> None:
    """Run under the repository's venv (made or refreshed by dev.py) if not already."""
    venv = Path(os.environ.get("MVPROXY_VENV", ROOT / ".venv"))
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("mvproxy_dev", ROOT / "scripts" / "dev.py")
    assert spec and spec.loader
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    dev.ensure_env()
    python = venv / "bin" / "python"
    os.execv(python, [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])


# --------------------------------------------------------------------------- what a client sees


@dataclass
class Seen:
    """One answer, as a client sees it."""

    status: int | None  # None: no HTTP answer at all (error says why)
    content_type: str = ""
    kind: str = ""  # the JSON kind, "text" for plain text, "" for no body
    reason: str = ""  # a Status's reason
    message: str = ""  # a Status's message, or the first line of a text body
    retry_after: str | None = None
    etag: str = ""
    duplicated: tuple[str, ...] = ()  # header names the answer carries more than once
    error: str = ""
    elapsed: float = 0.0
    body: bytes = b""

    def describe(self) -> str:
        """``201 MutatingAdmissionPolicy``, ``503 Status ServiceUnavailable, Retry-After 1``,
        ``503 text/plain "error trying to reach service: ..."``."""
        if self.status is None:
            return f"no answer ({self.error})"
        parts = [str(self.status)]
        if self.kind == "text":
            parts.append(f"text/plain `{_short(self.message)}`")
        elif self.kind == "Status":
            parts.append(f"Status {self.reason}".rstrip())
        elif self.kind:
            parts.append(self.kind)
        text = " ".join(parts)
        if self.retry_after is not None:
            text += f", Retry-After {self.retry_after}"
        return text


def _short(text: str, limit: int = 90) -> str:
    text = re.sub(r"127\.0\.0\.\d+:\d+", "HOST:PORT", text.strip())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def seen_from(status: int, headers: http.client.HTTPMessage, body: bytes,
              elapsed: float = 0.0) -> Seen:
    content_type = headers.get("Content-Type", "") or ""
    names = [k.lower() for k in headers.keys()]
    duplicated = tuple(sorted({n for n in names if names.count(n) > 1}))
    seen = Seen(status, content_type, retry_after=headers.get("Retry-After"),
                etag=headers.get("ETag", "") or "", duplicated=duplicated, elapsed=elapsed,
                body=body)
    if "protobuf" in content_type and body:
        seen.kind = "protobuf"
    elif body.lstrip()[:1] == b"{":
        # JSON, whatever the type says (kube-apiserver serves /openapi/v3 as text/plain)
        try:
            doc = json.loads(body)
        except ValueError:
            seen.kind = "invalid JSON"
        else:
            if isinstance(doc, dict):
                seen.kind = str(doc.get("kind") or "JSON")
                if seen.kind == "Status":
                    seen.reason = str(doc.get("reason") or "")
                    seen.message = str(doc.get("message") or "")
    elif body:
        seen.kind = "text"
        seen.message = body.decode("utf-8", "replace").splitlines()[0] if body.strip() else ""
    return seen


@dataclass
class Client:
    """One identity at one entry point (``host:port``): the admin's client certificate,
    or a bearer token with no certificate."""

    host: str
    port: int
    context: ssl.SSLContext
    token: str | None = None
    source: str = CLIENT_HOST

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        sent = {"Accept": "application/json", "User-Agent": "upstream-comparison"}
        if self.token:
            sent["Authorization"] = f"Bearer {self.token}"
        sent.update(extra or {})
        return sent

    def connect(self, timeout: float = HTTP_TIMEOUT) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                           context=self.context,
                                           source_address=(self.source, 0))

    def call(self, method: str, path: str, *, body: Any = None,
             headers: dict[str, str] | None = None, timeout: float = HTTP_TIMEOUT,
             content_type: str = "application/json") -> Seen:
        sent = self.headers(headers)
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            sent["Content-Type"] = content_type
        conn = self.connect(timeout)
        started = time.monotonic()
        try:
            conn.request(method, path, body=data, headers=sent)
            response = conn.getresponse()
            payload = response.read()
            return seen_from(response.status, response.headers, payload,
                             time.monotonic() - started)
        except (OSError, http.client.HTTPException) as e:
            return Seen(None, error=f"{type(e).__name__}: {e}",
                        elapsed=time.monotonic() - started)
        finally:
            conn.close()

    def json(self, path: str, accept: str = "application/json") -> Any:
        seen = self.call("GET", path, headers={"Accept": accept})
        if seen.status != 200:
            raise AssertionError(f"GET {path} via {self.host}:{self.port}: {seen.describe()} "
                                 f"{seen.body[:300]!r}")
        return json.loads(seen.body)

    @contextlib.contextmanager
    def stream(self, path: str, timeout: float = HTTP_TIMEOUT
               ) -> Iterator[tuple[Seen, http.client.HTTPResponse]]:
        """A long-running GET (a watch): its head as ``Seen`` and the open response."""
        conn = self.connect(timeout)
        try:
            conn.request("GET", path, headers=self.headers())
            response = conn.getresponse()
            yield seen_from(response.status, response.headers, b""), response
        finally:
            conn.close()

    def upgrade(self, path: str, protocol: str, timeout: float = 5.0) -> Seen:
        """``GET path`` asking to switch protocols, as kubectl exec does: SPDY/3.1
        (client-go's SPDY executor) or a WebSocket (kubectl 1.31+), on a raw TLS
        socket; the answer up to its body's end (or the 101 head)."""
        if protocol == "spdy":
            upgrade = {"Connection": "Upgrade", "Upgrade": "SPDY/3.1",
                       "X-Stream-Protocol-Version": "v4.channel.k8s.io"}
        else:
            key = base64.b64encode(os.urandom(16)).decode()
            upgrade = {"Connection": "Upgrade", "Upgrade": "websocket",
                       "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": key,
                       "Sec-WebSocket-Protocol": "v5.channel.k8s.io"}
        head = f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        for name, value in self.headers(upgrade).items():
            head += f"{name}: {value}\r\n"
        raw = socket.create_connection((self.host, self.port), timeout,
                                       source_address=(self.source, 0))
        started = time.monotonic()
        try:
            with self.context.wrap_socket(raw, server_hostname=self.host) as tls:
                tls.sendall((head + "\r\n").encode())
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = tls.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head_bytes, _, rest = data.partition(b"\r\n\r\n")
                lines = head_bytes.decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                message = http.client.HTTPMessage()
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    message[name.strip()] = value.strip()
                length = int(message.get("Content-Length") or 0)
                if status != 101:
                    while len(rest) < length:
                        chunk = tls.recv(65536)
                        if not chunk:
                            break
                        rest += chunk
                return seen_from(status, message, rest[:length] if length else rest,
                                 time.monotonic() - started)
        except (OSError, ValueError, IndexError) as e:
            return Seen(None, error=f"{type(e).__name__}: {e}")


# --------------------------------------------------------------------------- the pair


def builtin_flags(pki: Path, host: str, port: int) -> list[str]:
    """What turns kube-apiserver's own peer proxy on (the proxy client certificate and
    requestheader flags are already kubeadm's): peers' serving certificates verified by
    the cluster CA, the peer address this member's own, the gate on (alpha and off in
    1.35; beta and on from 1.36, where it is given anyway)."""
    return ["--peer-ca-file", str(pki / "ca.crt"), "--peer-advertise-ip", host,
            "--peer-advertise-port", str(port), f"--feature-gates={GATE}=true"]


def start_pair(directory: Path, versions: Sequence[str], mode: str, *,
               binaries: Path | None = None) -> Any:
    """A running ``RealCluster`` of ``versions`` in ``mode``, ready for the scenarios
    (built-in, and ``BOTH``: the built-in proxy on and an mvproxy in front of each
    server, once each server's peer proxy reaches the others)."""
    from mvproxy.devcluster.realdemo import member_host, start_real_cluster
    from mvproxy.errors import UsageError

    if mode == MVPROXY:
        return start_real_cluster(directory, versions, 0, binaries=binaries)
    mvproxies = mode == BOTH
    # The peer flags name each kube-apiserver's port, so the ports are fixed up front:
    # a base below the ephemeral range, another one if something holds a port.
    pki = Path(directory).absolute() / "pki"
    last: Exception | None = None
    for _ in range(20):
        base = random.randrange(20000, 30000, 10)
        extra = {f"apiserver-{i}": builtin_flags(pki, member_host(i), base + 100 + i)
                 for i in range(len(versions))}
        try:
            cluster = start_real_cluster(directory, versions, base, binaries=binaries,
                                         extra_apiserver_args=extra, mvproxies=mvproxies)
        except UsageError as e:
            if "in use" not in str(e):
                raise
            last = e
            continue
        try:
            wait_builtin_synced(cluster)
        except BaseException:
            cluster.stop()
            raise
        return cluster
    raise RuntimeError(f"no free ports for the built-in pair: {last}")


def entry(cluster: Any, sid: str, mode: str) -> tuple[str, int]:
    """Where a client reaches server ``sid``: its kube-apiserver (built-in) or its
    mvproxy."""
    server = cluster.server(sid)
    return server.host, server.backend_port if mode == BUILTIN else server.proxy_port


def admin_client(cluster: Any, sid: str, mode: str, *, direct: bool = False) -> Client:
    host, port = entry(cluster, sid, BUILTIN if direct else mode)
    return Client(host, port, cluster.admin_context())


def token_client(cluster: Any, sid: str, mode: str, token: str = "admin-token") -> Client:
    from mvproxy.tls import client_context

    host, port = entry(cluster, sid, mode)
    return Client(host, port, client_context(cluster.ca), token=cluster.tokens[token])


def listed(doc: dict[str, Any]) -> frozenset[GVR]:
    """(group, version, resource) of an aggregated discovery document."""
    out = set()
    for group in doc.get("items") or ():
        name = (group.get("metadata") or {}).get("name", "")
        for version in group.get("versions") or ():
            for resource in version.get("resources") or ():
                out.add((name, version["version"], resource["resource"]))
    return frozenset(out)


def merged_view(client: Client) -> frozenset[GVR]:
    """What ``client``'s entry point lists in /api and /apis (aggregated v2, no profile)."""
    return listed(client.json("/api", AGGREGATED_V2)) | listed(
        client.json("/apis", AGGREGATED_V2))


def wait_until(probe: Callable[[], Any], what: str, timeout: float = 30.0,
               pause: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s (last: {last!r})")
        time.sleep(pause)


def wait_builtin_synced(cluster: Any, timeout: float = SYNC_TIMEOUT) -> None:
    """Until every kube-apiserver's peer-aggregated /apis lists what every server
    serves and the old one proxies a new-only collection (its peer discovery syncs on
    identity Lease events, retried while a peer's endpoint record is not written yet)."""
    union = frozenset().union(*(cluster.served(s.id) for s in cluster.servers))
    new_only = sorted(cluster.served(NEW) - cluster.served(OLD))

    def synced() -> bool:
        for server in cluster.servers:
            client = admin_client(cluster, server.id, BUILTIN)
            if not union <= merged_view(client):
                return False
        if new_only:
            group, version, resource = new_only[0]
            path = f"/apis/{group}/{version}/{resource}"
            return admin_client(cluster, OLD, BUILTIN).call("GET", path).status == 200
        return True

    wait_until(synced, "the built-in peer proxy synced", timeout, pause=0.5)


# --------------------------------------------------------------------------- new-only objects


#: A manifest per new-only resource these releases have (the first one the new server
#: alone serves is used): MutatingAdmissionPolicy (1.36), ClusterTrustBundle (1.37).
def _map_object(name: str) -> dict[str, Any]:
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {"matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                "resources": ["configmaps"]}]},
                "failurePolicy": "Fail", "reinvocationPolicy": "Never",
                "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {
                    "expression": 'Object{metadata: Object.metadata{labels: {"cmp": "x"}}}'}}]}}


def _ctb_object(name: str, ca_pem: str) -> dict[str, Any]:
    return {"apiVersion": "certificates.k8s.io/v1", "kind": "ClusterTrustBundle",
            "metadata": {"name": name}, "spec": {"trustBundle": ca_pem}}


@dataclass(frozen=True)
class NewOnly:
    """A cluster-scoped resource only the newer server serves, and how to make one."""

    group: str
    version: str
    resource: str
    kind: str
    make: Callable[[str], dict[str, Any]]

    @property
    def collection(self) -> str:
        return f"/apis/{self.group}/{self.version}/{self.resource}"

    @property
    def gvr(self) -> GVR:
        return (self.group, self.version, self.resource)


def pick_new_only(cluster: Any) -> NewOnly:
    """The new-only resource the scenarios use, from the servers' own discovery."""
    only = cluster.served(NEW) - cluster.served(OLD)
    ca_pem = Path(cluster.ca).read_text()
    known = [
        NewOnly("admissionregistration.k8s.io", "v1", "mutatingadmissionpolicies",
                "MutatingAdmissionPolicy", _map_object),
        NewOnly("certificates.k8s.io", "v1", "clustertrustbundles", "ClusterTrustBundle",
                functools.partial(_ctb_object, ca_pem=ca_pem)),
    ]
    for candidate in known:
        if candidate.gvr in only:
            return candidate
    raise AssertionError(f"none of {[k.gvr for k in known]} is new-only here: {sorted(only)}")


# --------------------------------------------------------------------------- scenarios


@dataclass
class Step:
    """One scenario row: what the client saw, and for a rerouted request what the
    serving (new) server's audit log recorded."""

    name: str
    seen: Seen
    audit_new: dict[str, Any] | None = None
    audit_old: dict[str, Any] | None = None
    note: str = ""


def read_watch_event(response: http.client.HTTPResponse) -> str:
    """``ADDED MutatingAdmissionPolicy`` for the first event line, or why not."""
    try:
        line = response.readline()
    except (OSError, http.client.HTTPException) as e:
        return f"no event ({type(e).__name__})"
    if not line:
        return "stream ended"
    event = json.loads(line)
    return f"{event.get('type')} {(event.get('object') or {}).get('kind')}"


def request_scenarios(cluster: Any, mode: str, new_only: NewOnly,
                      name: str = "cmp-probe") -> list[Step]:
    """Create, get, list, watch, patch, delete a new-only object through the old
    server; what nobody serves; discovery of the new-only group."""
    client = admin_client(cluster, OLD, mode)
    item = f"{new_only.collection}/{name}"
    steps = [Step("CREATE (POST)", client.call("POST", new_only.collection,
                                               body=new_only.make(name)))]
    steps.append(Step("GET", client.call("GET", item)))
    steps.append(Step("LIST", client.call("GET", new_only.collection)))
    with client.stream(f"{new_only.collection}?watch=1&resourceVersion=0&"
                       f"fieldSelector=metadata.name%3D{name}") as (head, response):
        head.kind = read_watch_event(response) if head.status == 200 else head.kind
        steps.append(Step("WATCH (first event)", head))
    steps.append(Step("PATCH (merge)", client.call(
        "PATCH", item, body={"metadata": {"labels": {"patched": "yes"}}},
        content_type="application/merge-patch+json")))
    steps.append(Step("DELETE", client.call("DELETE", item)))
    steps.append(Step("GET after DELETE", client.call("GET", item)))
    steps.append(Step("GET of a name that never existed",
                      client.call("GET", f"{new_only.collection}/never-made")))
    steps.append(Step("a group nobody serves (`/apis/nosuch.example.com/v1/things`)",
                      client.call("GET", "/apis/nosuch.example.com/v1/things")))
    steps.append(Step(f"a resource nobody serves in `{new_only.group}/{new_only.version}`",
                      client.call("GET", f"/apis/{new_only.group}/{new_only.version}/"
                                  "nosuchthings")))
    for group, version in new_only_versions(cluster):
        for path in (f"/apis/{group}/{version}", f"/apis/{group}"):
            seen = client.call("GET", path)
            steps.append(Step(f"legacy discovery `{path}`", seen, note=legacy_note(seen)))
    steps += discovery_header_steps(client, sorted({g for g, _ in new_only_versions(cluster)}))
    steps += openapi_steps(cluster, client, new_only)
    steps.append(Step("a resource both serve (`/api/v1/namespaces/default`)",
                      client.call("GET", "/api/v1/namespaces/default")))
    return steps


def new_only_versions(cluster: Any) -> list[tuple[str, str]]:
    """Each group/version holding a resource only the new server serves."""
    return sorted({(g, v) for g, v, _ in cluster.served(NEW) - cluster.served(OLD)})


def legacy_note(seen: Seen) -> str:
    """What a legacy discovery answer lists: resources of an APIResourceList, versions
    of an APIGroup."""
    if seen.status != 200:
        return ""
    doc = json.loads(seen.body)
    if seen.kind == "APIResourceList":
        names = sorted(r["name"] for r in doc.get("resources") or () if "/" not in r["name"])
        return "resources: " + ", ".join(names)
    if seen.kind == "APIGroup":
        return ("versions: " + ", ".join(v["version"] for v in doc.get("versions") or ())
                + f"; preferred {(doc.get('preferredVersion') or {}).get('version')}")
    return ""


def discovery_header_steps(client: Client, groups: Sequence[str]) -> list[Step]:
    """Aggregated /apis: the answer's type and ETag, a revalidation, the nopeer
    profile, and the v2beta1 and protobuf kubectl also offers."""
    steps = []
    merged = client.call("GET", "/apis", headers={"Accept": AGGREGATED_V2})
    steps.append(Step("`/apis`, aggregated v2", merged,
                      note=f"Content-Type `{merged.content_type}`; ETag "
                      f"{_etag(merged) or 'none'}"))
    if merged.etag:
        again = client.call("GET", "/apis", headers={"Accept": AGGREGATED_V2,
                                                      "If-None-Match": merged.etag})
        steps.append(Step("`/apis` again with that `If-None-Match`", again))
    nopeer = client.call("GET", "/apis", headers={"Accept": NOPEER_V2})
    steps.append(Step("`/apis`, `profile=nopeer`", nopeer,
                      note=f"{len(listed(json.loads(nopeer.body)))} resources"
                      if nopeer.status == 200 else ""))
    beta = client.call("GET", "/apis", headers={
        "Accept": AGGREGATED_V2.replace("v=v2", "v=v2beta1") + ",application/json"})
    note = f"Content-Type `{beta.content_type}`"
    if beta.status == 200:
        doc = json.loads(beta.body)
        names = ({(g.get("metadata") or {}).get("name") for g in doc.get("items") or ()}
                 | {g.get("name") for g in doc.get("groups") or ()})
        for group in groups:
            note += f"; `{group}` {'listed' if group in names else 'absent'}"
    steps.append(Step("`/apis`, aggregated v2beta1 then JSON (client-go 1.26–1.29)", beta,
                      note=note))
    proto = client.call("GET", "/apis", headers={
        "Accept": "application/vnd.kubernetes.protobuf;g=apidiscovery.k8s.io;v=v2;"
                  "as=APIGroupDiscoveryList," + AGGREGATED_V2})
    steps.append(Step("`/apis`, aggregated protobuf first, then JSON", proto,
                      note=f"Content-Type `{proto.content_type}`"))
    return steps


def openapi_steps(cluster: Any, client: Client, new_only: NewOnly) -> list[Step]:
    """What ``kubectl apply`` and ``kubectl explain`` read: the OpenAPI v3 index (does
    it list each new-only group/version?) and the scenario resource's group/version
    document (does it hold the new-only kind's schema?)."""
    index = client.call("GET", "/openapi/v3")
    note = ""
    if index.status == 200:
        paths = json.loads(index.body).get("paths") or {}
        note = "; ".join(f"`apis/{g}/{v}` {'listed' if f'apis/{g}/{v}' in paths else 'absent'}"
                         for g, v in new_only_versions(cluster))
    steps = [Step("OpenAPI v3 index `/openapi/v3`", index,
                  note=f"Content-Type `{index.content_type}`; {note}")]
    gv = client.call("GET", f"/openapi/v3/apis/{new_only.group}/{new_only.version}")
    note = ""
    if gv.status == 200:
        schemas = (json.loads(gv.body).get("components") or {}).get("schemas") or {}
        has = any(name.endswith(f".{new_only.kind}") for name in schemas)
        note = f"{new_only.kind} schema {'present' if has else 'absent'}"
    steps.append(Step(f"OpenAPI v3 `/openapi/v3/apis/{new_only.group}/{new_only.version}`",
                      gv, note=note))
    return steps


def _etag(seen: Seen) -> str:
    """An ETag shortened for a table: its form matters, not its digits."""
    tag = seen.etag
    return f"`{tag}`" if len(tag) <= 24 else f"`{tag[:10]}…{tag[-3:]}` ({len(tag)} chars)"


def audit_entries(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text("utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def wait_audit(path: Path, marker: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """The last audit entry whose requestURI holds ``marker``, or None in time."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in audit_entries(path) if marker in e.get("requestURI", "")]
        if found:
            return found[-1]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def who(entry: dict[str, Any] | None) -> str:
    """``kubernetes-admin [system:masters, system:authenticated] from 127.0.0.9, 127.0.0.1``."""
    if entry is None:
        return "no audit entry"
    user = entry.get("user") or {}
    name = user.get("username") or "(no user)"
    text = name
    groups = [g for g in user.get("groups") or () if g != "system:authenticated"]
    if groups:
        text += f" [{', '.join(groups)}]"
    imp = entry.get("impersonatedUser")
    if imp:
        text += f" as {imp.get('username')}"
    code = (entry.get("responseStatus") or {}).get("code")
    return f"{text}; sourceIPs {', '.join(entry.get('sourceIPs') or ())}; code {code}"


def wait_audits(cluster: Any, marker: str, timeout: float = 10.0, extra: float = 1.0
                ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(old, new) servers' last audit entries whose requestURI holds ``marker``: once
    one of them has it, the other gets ``extra`` seconds more (a request decided on one
    server never reaches the other)."""
    logs = (cluster.server(OLD).audit_log, cluster.server(NEW).audit_log)
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any] | None] = [None, None]
    while True:
        for i, path in enumerate(logs):
            if found[i] is None:
                found[i] = wait_audit(path, marker, timeout=0.0)
        if all(found) or time.monotonic() >= deadline:
            return found[0], found[1]
        if any(found):
            deadline = min(deadline, time.monotonic() + extra)
        time.sleep(0.1)


def saw(step: Step) -> str:
    """The new server's view of a step, or the old server's if it never got there."""
    if step.audit_new is not None:
        text = who(step.audit_new)
    elif step.audit_old is not None:
        text = f"never reached it; the old server answered: {who(step.audit_old)}"
    else:
        text = "no audit entry on either server"
    return f"{text}; {step.note}" if step.note else text


def identity_scenarios(cluster: Any, mode: str, new_only: NewOnly) -> list[Step]:
    """Requests for the new-only resource through the old server, as a certificate
    user, a token user and an impersonating admin, plain and as SPDY and WebSocket
    upgrades; a read-only user's write; no credentials at all; a query out of order
    and an escaped name: what the client got, and what each server's audit log says
    (who asked, which server decided, the URI the new server received)."""
    from mvproxy.tls import client_context

    tag = mode.replace("-", "")
    steps = []
    people: list[tuple[str, Client, dict[str, str]]] = [
        ("client certificate (kubernetes-admin)", admin_client(cluster, OLD, mode), {}),
        ("bearer token (demo-admin)", token_client(cluster, OLD, mode), {}),
        ("certificate + `Impersonate-User: demo-viewer`",
         admin_client(cluster, OLD, mode),
         {"Impersonate-User": "demo-viewer", "Impersonate-Group": "viewer"}),
    ]
    for index, (label, client, headers) in enumerate(people):
        for how in ("plain", "spdy", "websocket"):
            if headers and how != "plain":
                continue
            marker = f"probe%3D{tag}-{index}-{how}"
            path = f"{new_only.collection}?labelSelector={marker}"
            seen = (client.call("GET", path, headers=headers) if how == "plain"
                    else client.upgrade(path, how))
            what = {"plain": "GET", "spdy": "GET + `Upgrade: SPDY/3.1`",
                    "websocket": "GET + `Upgrade: websocket`"}[how]
            old_entry, new_entry = wait_audits(cluster, marker)
            steps.append(Step(f"{what}, {label}", seen, audit_new=new_entry,
                              audit_old=old_entry))

    viewer = token_client(cluster, OLD, mode, "viewer-token")
    marker = f"probe-{tag}-viewer"
    seen = viewer.call("POST", f"{new_only.collection}?fieldManager={marker}",
                       body=new_only.make("cmp-viewer"))
    old_entry, new_entry = wait_audits(cluster, marker)
    steps.append(Step("POST, bearer token of demo-viewer (may only read)", seen,
                      audit_new=new_entry, audit_old=old_entry))

    host, port = entry(cluster, OLD, mode)
    anonymous = Client(host, port, client_context(cluster.ca))
    marker = f"probe%3D{tag}-anonymous"
    seen = anonymous.call("GET", f"{new_only.collection}?labelSelector={marker}")
    old_entry, new_entry = wait_audits(cluster, marker)
    steps.append(Step("GET, no credentials at all", seen, audit_new=new_entry,
                      audit_old=old_entry))

    admin = admin_client(cluster, OLD, mode)
    admin.call("POST", new_only.collection, body=new_only.make("cmp-ident"))
    sent = f"{new_only.collection}/cmp%2Dident?z=1&pretty=true&marker={tag}-uri"
    seen = admin.call("GET", sent)
    old_entry, new_entry = wait_audits(cluster, f"marker={tag}-uri")
    received = new_entry.get("requestURI", "") if new_entry else "(not received)"
    note = ("received as sent" if received == sent else
            f"received as `{received.replace(new_only.collection, '…')}`")
    steps.append(Step("GET `…/cmp%2Dident?z=1&pretty=true&marker=…` (escaped name, "
                      "query keys out of order)", seen, audit_new=new_entry,
                      audit_old=old_entry, note=note))
    admin.call("DELETE", f"{new_only.collection}/cmp-ident")
    return steps


# --------------------------------------------------------------------------- discovery


RESOURCE_FIELDS = ("scope", "singularResource", "responseKind", "verbs", "shortNames",
                   "categories", "subresources")


@dataclass
class Difference:
    where: str  # "group g", "g/v", "g/v resource r"
    what: str
    builtin: str
    mvproxy: str
    why: str = ""


def _groups(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [((g.get("metadata") or {}).get("name", ""), g) for g in doc.get("items") or ()]


def _fmt(value: Any) -> str:
    if value is None:
        return "absent"
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return ", ".join(s.get("subresource", "?") + "(" + ",".join(s.get("verbs") or ()) + ")"
                         for s in value)
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def compare_discovery(builtin: dict[str, Any], mvproxy: dict[str, Any]) -> list[Difference]:
    """Group by group, version by version, resource by resource: what differs between
    two aggregated discovery documents (order included)."""
    diffs: list[Difference] = []
    bg, mg = dict(_groups(builtin)), dict(_groups(mvproxy))
    border = [n for n, _ in _groups(builtin)]
    morder = [n for n, _ in _groups(mvproxy)]
    for name in sorted(set(bg) | set(mg)):
        if name not in bg or name not in mg:
            diffs.append(Difference(f"group `{name or 'core'}`", "present",
                                    str(name in bg), str(name in mg)))
    common = [n for n in border if n in mg]
    if common != [n for n in morder if n in bg]:
        diffs.append(Difference("groups", "order", ", ".join(border), ", ".join(morder)))
    for name in [n for n in border if n in mg]:
        diffs += _compare_group(name, bg[name], mg[name])
    return diffs


def _compare_group(name: str, b: dict[str, Any], m: dict[str, Any]) -> list[Difference]:
    diffs = []
    bv = {v["version"]: v for v in b.get("versions") or ()}
    mv = {v["version"]: v for v in m.get("versions") or ()}
    label = name or "core"
    for version in sorted(set(bv) | set(mv)):
        if version not in bv or version not in mv:
            diffs.append(Difference(f"`{label}/{version}`", "present", str(version in bv),
                                    str(version in mv)))
    if [v for v in bv if v in mv] != [v for v in mv if v in bv]:
        diffs.append(Difference(f"group `{label}`", "version order", ", ".join(bv),
                                ", ".join(mv)))
    if (b.get("metadata") or {}) != (m.get("metadata") or {}):
        diffs.append(Difference(f"group `{label}`", "metadata", _fmt(b.get("metadata")),
                                _fmt(m.get("metadata"))))
    for version in [v for v in bv if v in mv]:
        where = f"`{label}/{version}`"
        bver, mver = bv[version], mv[version]
        if bver.get("freshness") != mver.get("freshness"):
            diffs.append(Difference(where, "freshness", _fmt(bver.get("freshness")),
                                    _fmt(mver.get("freshness"))))
        br = {r["resource"]: r for r in bver.get("resources") or ()}
        mr = {r["resource"]: r for r in mver.get("resources") or ()}
        for resource in sorted(set(br) | set(mr)):
            if resource not in br or resource not in mr:
                diffs.append(Difference(f"{where} `{resource}`", "present",
                                        str(resource in br), str(resource in mr)))
        if [r for r in br if r in mr] != [r for r in mr if r in br]:
            diffs.append(Difference(where, "resource order", ", ".join(br), ", ".join(mr)))
        for resource in [r for r in br if r in mr]:
            for key in RESOURCE_FIELDS:
                one, other = br[resource].get(key), mr[resource].get(key)
                if key == "subresources":
                    one = sorted(one or [], key=lambda s: s.get("subresource", ""))
                    other = sorted(other or [], key=lambda s: s.get("subresource", ""))
                if (one or None) != (other or None):
                    diffs.append(Difference(f"{where} `{resource}`", key, _fmt(one),
                                            _fmt(other)))
    return diffs


def explain(diff: Difference, views: dict[str, dict[str, Any]]) -> str:
    """Why ``diff`` exists, from each server's own (``profile=nopeer``) documents in
    ``views`` ("old", "new"); "" when no rule explains it."""
    if diff.what == "order" and diff.where == "groups":
        return ("group order: upstream keeps the local server's order when every server "
                "lists the same groups, else a topological merge breaking ties by name; "
                "mvproxy merges every server's order, its own first")
    return ""


def discovery_scenarios(cluster: Any, mode: str) -> dict[str, Any]:
    """The merged /apis (and /api) through each server's entry point, and each server's
    own view, asked directly with profile=nopeer."""
    out: dict[str, Any] = {}
    for sid in (OLD, NEW):
        client = admin_client(cluster, sid, mode)
        direct = admin_client(cluster, sid, mode, direct=True)
        out[sid] = {"apis": client.json("/apis", AGGREGATED_V2),
                    "api": client.json("/api", AGGREGATED_V2),
                    "own_apis": direct.json("/apis", NOPEER_V2),
                    "own_api": direct.json("/api", NOPEER_V2)}
    return out


# --------------------------------------------------------------------------- cost


CLK_TCK = os.sysconf("SC_CLK_TCK")


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in process group ``pgid``."""
    total = 0
    for entry_ in os.listdir("/proc"):
        if not entry_.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry_}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5, pgrp (after pid and comm)
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


@dataclass
class Cost:
    label: str
    requests: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)  # seconds
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds, net

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies) * 1e3 if self.latencies else 0.0

    @property
    def p99_ms(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3 \
            if ordered else 0.0

    @property
    def cpu_us(self) -> dict[str, float]:
        """Process -> CPU µs per request."""
        return {name: max(0.0, value) / max(1, self.requests) * 1e6
                for name, value in self.cpu.items()}

    @property
    def total_us(self) -> float:
        return sum(self.cpu_us.values())


@dataclass
class CostPath:
    """One path to measure: a client, the GET it makes, the processes it involves."""

    cost: Cost
    client: Client
    path: str
    processes: dict[str, Any]  # name -> ManagedProcess


def idle_rates(paths: Sequence[CostPath], idle: float) -> dict[int, float]:
    """CPU seconds per second each involved process (by process group) burns with no
    request at all: mvproxy's discovery polls, kube-apiserver's Lease renewals, etcd."""
    pgids = {p.pid for path in paths for p in path.processes.values()}
    before = {pgid: group_cpu(pgid) for pgid in pgids}
    time.sleep(idle)
    return {pgid: (group_cpu(pgid) - before[pgid]) / idle for pgid in pgids}


def measure(path: CostPath, requests: int, rates: dict[int, float]) -> None:
    """``requests`` GETs on one keep-alive connection, one after another, added to
    ``path.cost``: each latency, and each process's CPU less its idle rate."""
    conn = path.client.connect()
    headers = path.client.headers()
    pgids = {name: p.pid for name, p in path.processes.items()}
    cost = path.cost
    try:
        before = {name: group_cpu(pgid) for name, pgid in pgids.items()}
        started = time.monotonic()
        for _ in range(requests):
            began = time.perf_counter()
            conn.request("GET", path.path, headers=headers)
            response = conn.getresponse()
            response.read()
            cost.latencies.append(time.perf_counter() - began)
            cost.requests += 1
            if response.status != 200:
                cost.errors += 1
        elapsed = time.monotonic() - started
        for name, pgid in pgids.items():
            used = group_cpu(pgid) - before[name] - rates.get(pgid, 0.0) * elapsed
            cost.cpu[name] = cost.cpu.get(name, 0.0) + used
    finally:
        conn.close()


def endpoint_lists(cluster: Any) -> float:
    """How often the old kube-apiserver has listed its peers' endpoint records from
    storage (``apiserver_storage_list_total{resource="apiServerPeerIPInfo"}``)."""
    text = admin_client(cluster, OLD, BUILTIN).call("GET", "/metrics").body.decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_storage_list_total{") and \
                'resource="apiServerPeerIPInfo"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def cost_paths(cluster: Any, mode: str, new_only: NewOnly) -> list[CostPath]:
    """The rerouted GET through the old server, and the same GET straight at the
    kube-apiserver that holds it (the floor: no proxy at all)."""
    name = "cmp-cost"
    admin_client(cluster, NEW, mode, direct=True).call("POST", new_only.collection,
                                                       body=new_only.make(name))
    path = f"{new_only.collection}/{name}"
    old, new = cluster.server(OLD), cluster.server(NEW)
    involved = {"old kube-apiserver": old.backend, "new kube-apiserver": new.backend,
                "etcd": cluster.etcd}
    if mode == MVPROXY:
        involved = {"old mvproxy": old.proxy, "new mvproxy": new.proxy, **involved}
    return [CostPath(Cost(f"{mode}: rerouted through the old server"),
                     admin_client(cluster, OLD, mode), path, involved),
            CostPath(Cost(f"{mode}: straight to the new kube-apiserver"),
                     admin_client(cluster, NEW, mode, direct=True), path,
                     {"new kube-apiserver": new.backend, "etcd": cluster.etcd})]


def cost_scenarios(paths: dict[str, list[CostPath]], requests: int, *, rounds: int = 4,
                   idle: float = 2.0, warmup: int = 50) -> dict[str, list[Cost]]:
    """Every path measured in ``rounds`` rounds of ``requests / rounds`` GETs, the
    order of the modes alternating from round to round, so that a change in the load
    of this (shared) machine falls on both alike."""
    flat = [p for mode in paths for p in paths[mode]]
    for path in flat:  # warm up connections, caches, TLS sessions
        measure(path, warmup, {})
        path.cost.requests = path.cost.errors = 0
        path.cost.latencies.clear()
        path.cost.cpu.clear()
    rates = idle_rates(flat, idle)
    order = list(paths)
    per_round = max(1, requests // rounds)
    for index in range(rounds):
        for mode in order if index % 2 == 0 else order[::-1]:
            for path in paths[mode]:
                measure(path, per_round, rates)
    return {mode: [p.cost for p in group] for mode, group in paths.items()}


# --------------------------------------------------------------------------- metrics


PROXY_METRIC = re.compile(r"^(apiserver_rerouted_request_total|apiserver_peer_|"
                          r"aggregator_discovery_(peer|nopeer)|mvproxy_)")


def metric_families(text: str) -> dict[str, list[str]]:
    """Family name -> its sample lines, for the proxying families in a /metrics text."""
    families: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            if PROXY_METRIC.match(name):
                families.setdefault(name, [])
        elif line and not line.startswith("#"):
            for name in families:
                if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ", "_"):
                    families[name].append(line)
                    break
    return families


def proxy_metrics(cluster: Any, mode: str, sid: str = OLD) -> dict[str, list[str]]:
    """The proxying metrics server ``sid``'s proxy exports: its kube-apiserver's
    /metrics (built-in) or its mvproxy's."""
    server = cluster.server(sid)
    if mode == BUILTIN:
        text = admin_client(cluster, sid, mode).call("GET", "/metrics").body.decode()
    else:
        import urllib.request

        with urllib.request.urlopen(f"{server.admin_url}/metrics", timeout=HTTP_TIMEOUT) as r:
            text = r.read().decode()
    return metric_families(text)


# --------------------------------------------------------------------------- a peer dies


@dataclass
class Sample:
    at: float  # seconds after the kill
    get: Seen
    listed: bool  # the old entry point's /apis still lists the new-only resource
    versions: dict[str, str]  # each new-only group/version there: freshness, or "absent"

    def key(self) -> tuple[Any, ...]:
        return (self.get.describe(), self.listed, sorted(self.versions.items()))


def sample_old(cluster: Any, mode: str, new_only: NewOnly, versions: list[tuple[str, str]],
               at: float) -> Sample:
    client = admin_client(cluster, OLD, mode)
    seen = client.call("GET", new_only.collection, timeout=5.0)
    doc = client.call("GET", "/apis", headers={"Accept": AGGREGATED_V2}, timeout=5.0)
    present = False
    fresh = {f"{g}/{v}": "absent" for g, v in versions}
    if doc.status == 200:
        for name, group in _groups(json.loads(doc.body)):
            for version in group.get("versions") or ():
                gv = f"{name}/{version['version']}"
                if gv in fresh:
                    fresh[gv] = version.get("freshness") or "Current"
                if (name, version["version"]) == (new_only.group, new_only.version):
                    present = present or any(r["resource"] == new_only.resource
                                             for r in version.get("resources") or ())
    else:
        fresh = {gv: f"/apis {doc.status}" for gv in fresh}
    return Sample(at, seen, present, fresh)


@dataclass
class Death:
    what: str
    timeline: list[Sample]  # each change of what the client sees
    watch_end: str  # how a watch open through the old server ended
    recovered_after: float | None  # seconds from the restart to the first 200


def peer_death(cluster: Any, mode: str, new_only: NewOnly, *, window: float,
               backend_only: bool = False, recover: bool = True) -> Death:
    """SIGKILL the new member (built-in: its kube-apiserver; mvproxy: its kube-apiserver
    and mvproxy, or with ``backend_only`` the kube-apiserver alone) while a watch on
    the new-only resource is open through the old server; sample what the old server
    answers for ``window`` seconds (each change kept); restart and time the recovery."""
    new = cluster.server(NEW)
    client = admin_client(cluster, OLD, mode)
    killed = [new.backend] if mode == BUILTIN or backend_only else [new.backend, new.proxy]
    what = "kube-apiserver" if len(killed) == 1 else "kube-apiserver and mvproxy"
    timeline: list[Sample] = []
    versions = new_only_versions(cluster)
    watch_end = "not opened"
    with client.stream(f"{new_only.collection}?watch=1&allowWatchBookmarks=false",
                       timeout=window) as (head, response):
        if head.status == 200:
            watch_end = "still open"
        start = time.monotonic()
        for process in killed:
            process.kill()
        if head.status == 200:
            try:
                while True:
                    line = response.readline()
                    if not line:
                        watch_end = f"ended after {time.monotonic() - start:.1f} s"
                        break
            except (OSError, http.client.HTTPException) as e:
                watch_end = (f"broke after {time.monotonic() - start:.1f} s "
                             f"({type(e).__name__})")
    while True:
        at = time.monotonic() - start
        if at > window:
            break
        sample = sample_old(cluster, mode, new_only, versions, at)
        if not timeline or timeline[-1].key() != sample.key():
            timeline.append(sample)
        time.sleep(0.25)
    recovered = None
    if recover:
        restarted = time.monotonic()
        new.backend.start()
        new.backend.wait_ready(60)
        if new.proxy in killed:
            new.proxy.start()
            new.proxy.wait_ready(60)
        wait_until(lambda: client.call("GET", new_only.collection, timeout=5.0).status == 200,
                   "the old server serving the new-only resource again", 120, pause=0.2)
        recovered = time.monotonic() - restarted
    return Death(what, timeline, watch_end, recovered)


# --------------------------------------------------------------------------- §5: false 404s


def stub_csr() -> bytes:
    """A PKCS#10 request (Ed25519) in DER, as a PodCertificateRequest's stub carries."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    key = ed25519.Ed25519PrivateKey.generate()
    request = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "false404")])).sign(key, None)
    return request.public_bytes(serialization.Encoding.DER)


def pcr_object(name: str, namespace: str) -> dict[str, Any]:
    """A PodCertificateRequest (certificates.k8s.io/v1, 1.37): nothing checks that its
    pod, service account or node exist, so it stands for any namespaced new-only object."""
    import uuid

    return {"apiVersion": "certificates.k8s.io/v1", "kind": "PodCertificateRequest",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"signerName": "example.com/false404", "podName": "p",
                     "podUID": str(uuid.uuid4()), "serviceAccountName": "default",
                     "serviceAccountUID": str(uuid.uuid4()), "nodeName": "node-1",
                     "nodeUID": str(uuid.uuid4()), "maxExpirationSeconds": 86400,
                     "stubPKCS10Request": base64.b64encode(stub_csr()).decode()}}


#: Namespaced resources only a newer release serves, with a manifest maker.
NAMESPACED_NEW_ONLY: dict[GVR, Callable[[str, str], dict[str, Any]]] = {
    ("certificates.k8s.io", "v1", "podcertificaterequests"): pcr_object,
}

VIA_DIRECT, VIA_MVPROXY = "direct", "mvproxy"


@dataclass
class NamespaceOutcome:
    """A namespace holding a new-only object, deleted."""

    skipped: str = ""  # why the scenario does not apply to this pair
    resource: str = ""
    created: Seen | None = None  # the new-only object's creation
    gone_after: float | None = None  # seconds from the DELETE until the namespace is gone
    object_after: Seen | None = None  # the new server, asked directly, afterwards
    recreated: int | None = None  # objects listed in the namespace made again


@dataclass
class GcOutcome:
    """An owner of a new-only kind deleted: is its dependent collected?"""

    owner_kind: str
    control_after: float | None  # a ConfigMap owned by a ConfigMap: collected after
    dependent_after: float | None  # the new-only kind's dependent: collected after
    dependent_at_end: Seen | None  # its GET once the wait was over
    waited: float = 0.0  # how long it was given after the control went


@dataclass
class FalseNotFound:
    label: str
    kcm: str  # version and where it talks to
    namespace: NamespaceOutcome
    gc: GcOutcome


def wait_gone(client: Client, path: str, timeout: float) -> float | None:
    """Seconds until ``path`` answers 404, or None if it does not within ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if client.call("GET", path, timeout=5.0).status == 404:
            return time.monotonic() - started
        time.sleep(0.2)
    return None


def false404_run(cluster: Any, mode: str, via: str, tag: str, *, grace: float = 5.0,
                 timeout: float = 60.0) -> FalseNotFound:
    """The real kube-controller-manager (the oldest release, as the skew policy says)
    talking to the old server (``via``: straight to its kube-apiserver, or through its
    mvproxy) while users delete (a) a namespace holding a new-only object and (b) the
    owner, of a new-only kind, of a ConfigMap (with a ConfigMap-owned ConfigMap as the
    control). Users reach the servers without a proxy in ``direct`` runs of mode
    mvproxy (the new-only object made straight at the new server), and through the
    old server's entry point otherwise. The outcome is read straight from the servers."""
    label = {(MVPROXY, VIA_DIRECT): "no proxy", (MVPROXY, VIA_MVPROXY): "mvproxy",
             (BUILTIN, VIA_DIRECT): "built-in"}[(mode, via)]
    proxied = label != "no proxy"
    kcm = cluster.start_controller_manager(direct=via == VIA_DIRECT)
    try:
        old_direct = admin_client(cluster, OLD, mode, direct=True)
        new_direct = admin_client(cluster, NEW, mode, direct=True)
        users = admin_client(cluster, OLD, mode) if proxied else old_direct
        new_users = admin_client(cluster, OLD, mode) if proxied else new_direct
        ns_out = _namespace_case(cluster, users, new_users, new_direct, old_direct,
                                 f"f404-{tag}", timeout)
        gc_out = _gc_case(cluster, users, new_users, old_direct, tag,
                          timeout if proxied else grace, timeout)
    finally:
        kcm.stop()
    where = ("the old kube-apiserver" if via == VIA_DIRECT else "the old server's mvproxy")
    return FalseNotFound(label, f"{kcm.version}, talking to {where}", ns_out, gc_out)


def _namespace_case(cluster: Any, users: Client, new_users: Client, new_direct: Client,
                    old_direct: Client, namespace: str, timeout: float) -> NamespaceOutcome:
    only = sorted(gvr for gvr in cluster.served(NEW) - cluster.served(OLD)
                  if gvr in NAMESPACED_NEW_ONLY)
    if not only:
        new_only = sorted(f"{r}" for _, _, r in cluster.served(NEW) - cluster.served(OLD))
        return NamespaceOutcome(skipped=f"no namespaced resource only {cluster.newest.version} "
                                f"serves (its new-only ones, {', '.join(new_only)}, are "
                                "cluster-scoped)")
    group, version, resource = only[0]
    collection = f"/apis/{group}/{version}/namespaces/{namespace}/{resource}"
    ns_path = f"/api/v1/namespaces/{namespace}"
    made = users.call("POST", "/api/v1/namespaces", body={
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    if made.status != 201:
        raise AssertionError(f"namespace {namespace}: {made.describe()}")
    created = new_users.call("POST", collection, body=NAMESPACED_NEW_ONLY[only[0]](
        "held", namespace))
    users.call("DELETE", ns_path)
    gone = wait_gone(old_direct, ns_path, timeout)
    after = new_direct.call("GET", f"{collection}/held")
    recreated = None
    if after.status == 200 and gone is not None:
        # The namespace made again (say, by the next tenant) holds the old object.
        users.call("POST", "/api/v1/namespaces", body={
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        listing = new_direct.call("GET", collection)
        recreated = len(json.loads(listing.body).get("items") or ()) \
            if listing.status == 200 else None
        new_direct.call("DELETE", f"{collection}/held")
        users.call("DELETE", ns_path)
    return NamespaceOutcome(resource=f"{group}/{version} {resource}", created=created,
                            gone_after=gone, object_after=after, recreated=recreated)


def _gc_case(cluster: Any, users: Client, new_users: Client, old_direct: Client, tag: str,
             budget: float, timeout: float) -> GcOutcome:
    new_only = pick_new_only(cluster)
    owner_name = f"f404-owner-{tag}"
    owner = new_users.call("POST", new_only.collection, body=new_only.make(owner_name))
    if owner.status != 201:
        raise AssertionError(f"owner {owner_name}: {owner.describe()} {owner.body[:300]!r}")
    uid = json.loads(owner.body)["metadata"]["uid"]
    configmaps = "/api/v1/namespaces/default/configmaps"

    def configmap(name: str, api_version: str, kind: str, owner: str, owner_uid: str
                  ) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": name, "ownerReferences": [{"apiVersion": api_version, "kind": kind,
                                               "name": owner, "uid": owner_uid}]}}

    control = users.call("POST", configmaps, body={
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"f404-ctl-{tag}"}})
    control_uid = json.loads(control.body)["metadata"]["uid"]
    for body in (configmap(f"f404-dep-{tag}", f"{new_only.group}/{new_only.version}",
                           new_only.kind, owner_name, uid),
                 configmap(f"f404-ctl-dep-{tag}", "v1", "ConfigMap", f"f404-ctl-{tag}",
                           control_uid)):
        seen = users.call("POST", configmaps, body=body)
        if seen.status != 201:
            raise AssertionError(f"{body['metadata']['name']}: {seen.describe()}")
    new_users.call("DELETE", f"{new_only.collection}/{owner_name}")
    users.call("DELETE", f"{configmaps}/f404-ctl-{tag}")
    started = time.monotonic()
    control_after = wait_gone(old_direct, f"{configmaps}/f404-ctl-dep-{tag}", timeout)
    # Where the garbage collector works (the control is collected), the new-only kind's
    # dependent gets ``budget`` seconds more.
    dependent = f"{configmaps}/f404-dep-{tag}"
    gone = wait_gone(old_direct, dependent, budget if control_after is not None else 0.1)
    dependent_after = None if gone is None else time.monotonic() - started
    at_end = old_direct.call("GET", dependent)
    old_direct.call("DELETE", dependent)
    return GcOutcome(new_only.kind, control_after, dependent_after, at_end, budget)


# --------------------------------------------------------------------------- one run


@dataclass
class Run:
    """Everything one mode showed on one pair of releases."""

    versions: tuple[str, str]
    mode: str
    new_only: NewOnly
    new_only_all: list[GVR]
    flags: list[str]
    requests: list[Step] = field(default_factory=list)
    identity: list[Step] = field(default_factory=list)
    discovery: dict[str, Any] = field(default_factory=dict)
    cost: list[Cost] = field(default_factory=list)
    metrics: dict[str, list[str]] = field(default_factory=dict)
    false404: list[FalseNotFound] = field(default_factory=list)
    deaths: list[Death] = field(default_factory=list)
    metrics_after: dict[str, list[str]] = field(default_factory=dict)  # after the deaths
    peer_lists: float | None = None  # built-in: etcd lists of peer endpoints per reroute


def run_pair(directory: Path, versions: tuple[str, str], *, requests: int,
             death_window: float, rounds: int = 4, grace: float = 40.0,
             false404: bool = True, recover: bool = True, idle: float = 2.0,
             binaries: Path | None = None) -> dict[str, Run]:
    """Every scenario on ``versions``, both modes, each in its own control plane; both
    run at once so the cost rounds can alternate between them; both are stopped
    before this returns. The peer deaths come last; without ``recover`` only the
    first (the whole new member) runs in each mode and nothing is restarted."""
    runs: dict[str, Run] = {}
    with contextlib.ExitStack() as stack:
        clusters = {mode: stack.enter_context(
            start_pair(Path(directory) / mode.replace("-", ""), versions, mode,
                       binaries=binaries)) for mode in MODES}
        paths = {}
        for mode, cluster in clusters.items():
            new_only = pick_new_only(cluster)
            run = Run(versions, mode, new_only,
                      sorted(cluster.served(NEW) - cluster.served(OLD)),
                      cluster.apiserver_args.get(OLD, []))
            run.requests = request_scenarios(cluster, mode, new_only)
            run.identity = identity_scenarios(cluster, mode, new_only)
            run.discovery = discovery_scenarios(cluster, mode)
            paths[mode] = cost_paths(cluster, mode, new_only)
            runs[mode] = run
        lists = endpoint_lists(clusters[BUILTIN])
        for mode, costs in cost_scenarios(paths, requests, rounds=rounds,
                                          idle=idle).items():
            runs[mode].cost = costs
        rerouted = runs[BUILTIN].cost[0].requests
        runs[BUILTIN].peer_lists = (endpoint_lists(clusters[BUILTIN]) - lists) / max(1, rerouted)
        for mode, cluster in clusters.items():
            run = runs[mode]
            run.metrics = proxy_metrics(cluster, mode)
            if false404:
                vias = [VIA_DIRECT] if mode == BUILTIN else [VIA_DIRECT, VIA_MVPROXY]
                run.false404 = [false404_run(cluster, mode, via,
                                             f"{mode.replace('-', '')}-{via}", grace=grace)
                                for via in vias]
            run.deaths = [peer_death(cluster, mode, run.new_only, window=death_window,
                                     recover=recover)]
            if mode == MVPROXY and recover:
                run.deaths.append(peer_death(cluster, mode, run.new_only,
                                             window=death_window, backend_only=True))
            run.metrics_after = proxy_metrics(cluster, mode)
    return runs


# --------------------------------------------------------------------------- both at once


@dataclass
class Both:
    """Both proxies at once: a new-only object created through the old server's mvproxy
    and read back, then created straight at the old kube-apiserver."""

    versions: tuple[str, str]
    kind: str = ""
    via_mvproxy: str = ""  # what the client saw
    new_creates: int = 0  # the new server's audit entries of that create
    old_entries: int = 0  # the old server's audit entries naming the object
    old_rerouted: float = 0.0  # the old kube-apiserver's rerouted requests meanwhile
    mvproxy_rerouted: float = 0.0  # the old mvproxy's
    audited: str = ""  # the new server's audit entry (user, groups, address)
    direct: str = ""  # straight at the old kube-apiserver
    direct_rerouted: float = 0.0


def _rerouted(text: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("apiserver_rerouted_request_total"))


def _backend_rerouted(cluster: Any) -> float:
    return _rerouted(admin_client(cluster, OLD, BUILTIN).call("GET", "/metrics").body.decode())


def _mvproxy_rerouted(cluster: Any) -> float:
    import urllib.request

    url = f"{cluster.server(OLD).admin_url}/metrics"
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as response:
        return _rerouted(response.read().decode())


def _entries_named(path: Path, name: str, verb: str | None = None) -> list[dict[str, Any]]:
    return [e for e in audit_entries(path) if (e.get("objectRef") or {}).get("name") == name
            and e.get("stage") == "ResponseComplete" and verb in (None, e.get("verb"))]


def both_proxies(cluster: Any, versions: tuple[str, str]) -> Both:
    """The ``BOTH`` scenario on a running cluster (``start_pair(..., BOTH)``)."""
    new_only = pick_new_only(cluster)
    both = Both(versions, new_only.kind)
    name, direct_name = "cmp-both", "cmp-both-direct"
    client = admin_client(cluster, OLD, MVPROXY)
    backend, ours = _backend_rerouted(cluster), _mvproxy_rerouted(cluster)
    made = client.call("POST", new_only.collection, body=new_only.make(name))
    got = client.call("GET", f"{new_only.collection}/{name}")
    both.via_mvproxy = f"create {made.describe()}, get {got.describe()}"
    entry = wait_audit(cluster.server(NEW).audit_log, f"{new_only.collection}/{name}")
    time.sleep(1.0)  # the audit log trails the answers
    both.new_creates = len(_entries_named(cluster.server(NEW).audit_log, name, "create"))
    both.old_entries = len(_entries_named(cluster.server(OLD).audit_log, name))
    both.old_rerouted = _backend_rerouted(cluster) - backend
    both.mvproxy_rerouted = _mvproxy_rerouted(cluster) - ours
    both.audited = who(entry)
    backend = _backend_rerouted(cluster)
    direct = admin_client(cluster, OLD, BUILTIN).call("POST", new_only.collection,
                                                      body=new_only.make(direct_name))
    both.direct = direct.describe()
    both.direct_rerouted = _backend_rerouted(cluster) - backend
    for gone in (name, direct_name):
        client.call("DELETE", f"{new_only.collection}/{gone}")
    return both


def run_both(directory: Path, versions: tuple[str, str], *,
             binaries: Path | None = None) -> Both:
    with start_pair(Path(directory) / BOTH, versions, BOTH, binaries=binaries) as cluster:
        return both_proxies(cluster, versions)


def render_both(boths: Sequence[Both]) -> str:
    out = ["## Both proxies at once\n",
           "The built-in proxy on (the **built-in** flags) *and* an mvproxy in front of "
           "each kube-apiserver: the old server's mvproxy reroutes a new-only request to "
           "the new server's mvproxy with `x-kubernetes-peer-proxied: true`, which hands "
           "it to its kube-apiserver; the old kube-apiserver never sees it, so its "
           "built-in proxy adds no second hop and nothing loops. A client straight at "
           "the old kube-apiserver still gets the built-in proxy.\n",
           "| pair | through the old mvproxy | the new server's creates | the old server's "
           "entries | rerouted: old mvproxy / old kube-apiserver | the new server's audit "
           "of the get | straight at the old kube-apiserver |",
           "|---|---|---|---|---|---|---|"]
    for b in boths:
        out.append(
            f"| {' + '.join(b.versions)} ({b.kind}) | {_cell(b.via_mvproxy)} | "
            f"{b.new_creates} | {b.old_entries} | {b.mvproxy_rerouted:.0f} / "
            f"{b.old_rerouted:.0f} | {_cell(b.audited)} | {_cell(b.direct)} (the old "
            f"kube-apiserver's rerouted count +{b.direct_rerouted:.0f}) |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the document


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{platform.node() or 'this machine'}: {platform.system()} "
            f"{platform.release()}, {os.cpu_count()} × {cpu}, Python "
            f"{platform.python_version()}")


def commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              check=True, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    return "unknown"


def _pairs(runs: Sequence[Run]) -> list[tuple[Run, Run]]:
    """(built-in, mvproxy) per pair of releases, in run order."""
    out = []
    for versions in dict.fromkeys(r.versions for r in runs):
        pair = {r.mode: r for r in runs if r.versions == versions}
        out.append((pair[BUILTIN], pair[MVPROXY]))
    return out


def _first(timeline: Sequence[Sample], predicate: Callable[[Sample], bool]) -> Sample | None:
    return next((s for s in timeline if predicate(s)), None)


def _schema(run: Run) -> bool:
    """Whether the old server's OpenAPI document of the scenario resource's
    group/version held its schema."""
    name = f"OpenAPI v3 `/openapi/v3/apis/{run.new_only.group}/{run.new_only.version}`"
    return any(st.name == name and st.note.endswith("schema present") for st in run.requests)


def _openapi_summary(pairs: Sequence[tuple[Run, Run]]) -> str:
    index = [(b, m) for b, m in pairs
             for sb, sm in zip(b.requests, m.requests, strict=True)
             if sb.name.startswith("OpenAPI v3 index") and sb.note != sm.note]
    text = ("The OpenAPI v3 index lists a group/version only the new server serves only "
            "through mvproxy. " if index else "")
    theirs = [b for b, _ in pairs if _schema(b)]
    ours = [m for _, m in pairs if _schema(m)]
    text += ("A new-only resource in a group/version both serve: the old server's "
             "`/openapi/v3/apis/<g>/<v>` holds its schema "
             + ("with both proxies" if len(theirs) == len(pairs) == len(ours) else
                "through mvproxy only (it adds the peer's paths and schemas to the "
                "backend's document), so `kubectl explain` of it fails through the old "
                "server with the built-in proxy" if len(ours) == len(pairs) and not theirs
                else f"built-in {len(theirs)}/{len(pairs)}, mvproxy {len(ours)}/{len(pairs)}")
             + " (`kubectl apply` works either way: validation is server-side).")
    return text


def render_summary(runs: Sequence[Run]) -> str:
    """The headline: what differs, per topic, with the numbers of this run."""
    pairs = _pairs(runs)
    names = " and ".join(f"{b.versions[0]} + {b.versions[1]}" for b, _ in pairs)
    out = [f"## Summary ({names})\n"]
    add = out.append

    crud = [sb.name for b, m in pairs for sb, sm in zip(b.requests, m.requests, strict=True)
            if not sb.name.startswith(("legacy", "`/apis`", "OpenAPI"))
            and (sb.seen.status, sb.seen.kind) != (sm.seen.status, sm.seen.kind)]
    twice = sorted({h for b, _ in pairs for st in b.requests[:8] for h in st.seen.duplicated})
    add("* **Requests.** Create, get, list, watch, patch and delete of a new-only resource "
        "through the old server give the same statuses and kinds with either proxy, and "
        "so do requests for what no server serves"
        + (f"; they differ only in {', '.join(sorted(set(crud)))}" if crud else "")
        + "." + (f" The built-in proxy's answers carry {', '.join(twice)} twice: the old "
                 "server's handler chain sets them before its peer proxy adds the peer's "
                 "own (Go's reverse proxy appends header values)." if twice else ""))

    upgrade_401 = sum(1 for b, _ in pairs for st in b.identity if "Upgrade" in st.name
                      and st.seen.status == 401 and st.audit_new is not None
                      and not st.audit_new.get("user"))
    upgrades = sum(1 for b, _ in pairs for st in b.identity if "Upgrade" in st.name)
    ours_ok = sum(1 for _, m in pairs for st in m.identity if "Upgrade" in st.name
                  and st.audit_new and st.audit_new.get("user", {}).get("username"))
    add(f"* **Identity.** Plain requests reach the new server as the user (certificate or "
        "token), with the client's address first in `sourceIPs`, through either. Upgrade "
        f"requests (how exec, attach and port-forward start): the built-in proxy sent "
        f"{upgrade_401} of {upgrades} without any user, and the new server answered 401 "
        "(its upgrade path dials the peer itself and skips the round tripper that adds "
        "`X-Remote-User`, kubernetes/kubernetes "
        f"`staging/src/k8s.io/apiserver/pkg/util/peerproxy/`); through mvproxy {ours_ok} of "
        f"{upgrades} arrived as the user. Impersonation: upstream forwards the "
        "impersonated user as the user, so the peer's audit log never names the "
        "impersonator; mvproxy forwards the `Impersonate-*` headers and the peer "
        "authorizes and records both. Authorization: kube-apiserver refuses a "
        "read-only user's write itself before proxying; through mvproxy the new server "
        "refuses it, in the same words. The built-in proxy rebuilds the URL (an escaped "
        "name arrives decoded, query keys sorted); mvproxy sends it byte for byte.")

    diffs = sum(len(compare_discovery(b.discovery[sid][path], m.discovery[sid][path]))
                for b, m in pairs for sid in (OLD, NEW) for path in ("apis", "api"))
    legacy = []
    for b, m in pairs:
        for st, sm in zip(b.requests, m.requests, strict=True):
            if not st.name.startswith("legacy discovery"):
                continue
            path = st.name.removeprefix("legacy discovery ")
            if st.seen.status != sm.seen.status:
                legacy.append(f"{path}: {st.seen.describe()} built-in, "
                              f"{sm.seen.describe()} mvproxy")
            elif st.note != sm.note and st.seen.kind == "APIResourceList":
                extra = sorted(set(sm.note.split(": ", 1)[1].split(", "))
                               - set(st.note.split(": ", 1)[1].split(", ")))
                legacy.append(f"{path} lists {', '.join(extra)} only through mvproxy")
    add(f"* **Discovery.** The merged aggregated v2 `/apis` and `/api` are "
        f"{'identical' if not diffs else f'different in {diffs} places'} group by group, "
        "version by version, resource by resource, through both servers of both pairs, "
        "and equal the union of the servers' own views. What upstream does not merge "
        "differs: aggregated v2beta1 (kube-apiserver 1.33+ no longer serves it and "
        "answers the old server's own legacy `APIGroupList`; mvproxy offers v2beta1 "
        "only where its backend does, so it answers the merged legacy `APIGroupList`), "
        "protobuf (upstream merges it; mvproxy answers JSON, the client's "
        "next choice)"
        + (", and legacy discovery (" + "; ".join(legacy) + ")" if legacy else "")
        + ". " + _openapi_summary(pairs))

    costs = []
    for b, m in pairs:
        tb, tm = b.cost[0], m.cost[0]
        costs.append(
            f"{b.versions[0]} + {b.versions[1]}: p50 {tb.p50_ms:.2f} ms built-in, "
            f"{tm.p50_ms:.2f} ms mvproxy (p99 {tb.p99_ms:.1f} / {tm.p99_ms:.1f}); CPU "
            f"{tb.total_us:.0f} µs against {tm.total_us:.0f} µs per request, of which the "
            f"old kube-apiserver {tb.cpu_us.get('old kube-apiserver', 0):.0f} µs against "
            f"{tm.cpu_us.get('old kube-apiserver', 0):.0f} µs and the two mvproxies "
            f"{tm.cpu_us.get('old mvproxy', 0) + tm.cpu_us.get('new mvproxy', 0):.0f} µs "
            f"(no proxy at all: {b.cost[1].p50_ms:.2f} ms, {b.cost[1].total_us:.0f} µs)")
    lists = [f"{b.peer_lists:.1f}" for b, _ in pairs if b.peer_lists is not None]
    add("* **Cost of a rerouted GET** (same client, same requests, rounds alternating): "
        + "; ".join(costs) + ". Upstream runs the whole request chain (authentication, "
        "authorization, audit, priority and fairness) on the old server before proxying, "
        "and looks its peer's address up in etcd on every proxied request"
        + (f" ({' and '.join(lists)} lists per request here)" if lists else "")
        + "; mvproxy passes the request to the peer's mvproxy, which hands it to its "
        "kube-apiserver.")

    deaths = []
    for b, m in pairs:
        theirs = b.deaths[0]
        plain = _first(theirs.timeline, lambda s: s.get.kind == "text")
        status = _first(theirs.timeline, lambda s: s.get.kind == "Status")
        stale = _first(m.deaths[0].timeline, lambda s: "Stale" in s.versions.values())
        text = (f"{b.versions[0]} + {b.versions[1]}: built-in "
                + (f"503 plain text (`{_short(plain.get.message, 40)}`), no Retry-After"
                   if plain else "?")
                + (f", then a 503 Status from {status.at:.0f} s (the dead peer's endpoint "
                   "record expires, 15 s after its last renewal)" if status else "")
                + (", its APIs listed as Current throughout"
                   if all(s.listed and "Stale" not in s.versions.values()
                          for s in theirs.timeline) else "")
                + "; mvproxy 503 Status with Retry-After from the first request"
                + (f", a group/version only the dead peer served marked Stale after "
                   f"{stale.at:.1f} s" if stale else ""))
        deaths.append(text)
    add("* **A peer killed.** Watches through the old server end at once with both. Then: "
        + "; ".join(deaths) + ". Back within seconds of a restart with both (times in each "
        "section).")

    add("* **Metrics.** kube-apiserver 1.35 exports only "
        "`apiserver_rerouted_request_total{code}`; 1.36 and 1.37 add the group, version "
        "and resource labels, `apiserver_peer_proxy_errors_total`, "
        "`apiserver_peer_discovery_sync_errors_total` and the peer-aggregated discovery "
        "counters (1.35 registers those only when the gate is on by default, so not "
        "here). mvproxy exports the 1.36 names and labels, and its own `mvproxy_*`. "
        "Upstream counts a proxied upgrade request as `code=\"0\"` (its answer "
        "bypasses the response writer that records the code).")

    false = [f for r in runs for f in r.false404]
    if false:
        orphaned = [f for f in false if f.namespace.object_after is not None
                    and f.namespace.object_after.status == 200]
        leaked = [f for f in false if f.gc.dependent_after is None]
        add("* **The false 404** ([below](#the-false-404-with-a-real-kube-controller-manager))."
            " With no proxy, the old kube-controller-manager "
            + (f"finalized a namespace while its new-only object stayed in etcd "
               f"({len(orphaned)} run{'s' if len(orphaned) != 1 else ''}; a namespace made "
               "again with that name holds it) and " if orphaned else "")
            + ("never collected the dependent of a deleted owner of a new-only kind"
               if leaked else "")
            + "; through the built-in proxy and through mvproxy nothing was left behind"
            + ("." if all(f.label == "no proxy" for f in orphaned + leaked)
               else ", except: " + ", ".join(sorted({f.label for f in orphaned + leaked
                                                     if f.label != "no proxy"})) + "."))
    add("")
    return "\n".join(out)


def _shown(argv: Sequence[str]) -> list[str]:
    """The command line as the document shows it: without --save/--from (development
    aids), so that it reruns the same measurement."""
    shown: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--save", "--from"):
            skip = True
        elif not arg.startswith(("--save=", "--from=")):
            shown.append(arg)
    return shown


def render(runs: list[Run], extra_sections: Sequence[str], argv: Sequence[str],
           started: datetime.datetime, took: float) -> str:
    argv = _shown(argv)
    out: list[str] = []
    add = out.append
    add("# mvproxy beside upstream's built-in Mixed Version Proxy, measured\n")
    add(f"Generated by `python3 scripts/upstream_comparison.py{' ' if argv else ''}"
        f"{' '.join(argv)}` on {started:%Y-%m-%d %H:%M} UTC, {machine()}, mvproxy at commit "
        f"`{commit()}`, in {took / 60:.0f} minutes. Rerun that command to regenerate this "
        "file (it needs the binaries `python3 scripts/dev.py kube-binaries` builds); "
        "`tests/test_real_upstream.py` and `tests/test_real_false404.py` assert the same "
        "scenarios in the suite.\n")
    add(HOW)
    add(render_summary(runs))
    for versions in dict.fromkeys(r.versions for r in runs):
        pair = {r.mode: r for r in runs if r.versions == versions}
        add(render_pair(versions, pair))
    out.extend(extra_sections)
    return "\n".join(out).rstrip() + "\n"


HOW = """\
Each pair of releases ran in two fresh control planes side by side (`mvproxy demo
--real`'s: one etcd, one kube-apiserver per release on its own 127.0.0.x, the older
started first, kubeadm's flags):

* **built-in**: kube-apiservers with their own peer proxy (`--peer-ca-file`, the
  cluster CA that signed the peers' serving certificates, `--peer-advertise-ip`,
  `--peer-advertise-port`, `--feature-gates=UnknownVersionInteroperabilityProxy=true`;
  the proxy client certificate and requestheader flags are kubeadm's) and no mvproxy.
  In the source (`pkg/features/kube_features.go`), the gate is alpha and off in 1.35
  and beta and on from 1.36; it depends on `APIServerIdentity` (beta, on), not on
  `StorageVersionAPI` (alpha, off here); `--peer-*` flags are refused while the gate is
  off (`pkg/controlplane/apiserver/options/validation.go`).
* **mvproxy**: one `mvproxy run` in front of each kube-apiserver (static peers,
  discovery polled every second), the built-in proxy off (no `--peer-ca-file`).

The machine is shared with other work, so latencies carry its noise; the cost
rounds alternate between the two control planes so that a change of load falls on
both alike, and CPU is counted per process, not from the wall clock.

Every request is made by the same client (Python `http.client`, HTTP/1.1 over TLS,
from 127.0.0.9, as the admin's client certificate unless said otherwise) to the **old**
server's entry point: its kube-apiserver (built-in) or its mvproxy (mvproxy).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_pair(versions: tuple[str, str], pair: dict[str, Run]) -> str:
    b, m = pair[BUILTIN], pair[MVPROXY]
    old, new = versions
    out = [f"## {old} + {new}\n"]
    add = out.append
    only = ", ".join(f"`{g}/{v}` `{r}`" for g, v, r in b.new_only_all)
    add(f"Only {new} serves {only}; the scenarios use `{b.new_only.resource}`.\n")

    add("### Requests through the old server\n")
    add("| request | built-in | mvproxy |")
    add("|---|---|---|")
    for sb, sm in zip(b.requests, m.requests, strict=True):
        cells = []
        for step in (sb, sm):
            text = step.seen.describe()
            if step.note:
                text += f" ({step.note})"
            if step.seen.duplicated:
                text += f"; headers twice: {', '.join(step.seen.duplicated)}"
            cells.append(_cell(text))
        add(f"| {sb.name} | {cells[0]} | {cells[1]} |")
    add("")

    add("### Who the new server sees\n")
    add("A list of the new-only resource through the old server; the right-hand cells are "
        "the **new** server's audit entry for it (user, groups, impersonation, "
        "`sourceIPs`, code).\n")
    add("| request | built-in: client gets | built-in: new server saw | "
        "mvproxy: client gets | mvproxy: new server saw |")
    add("|---|---|---|---|---|")
    for sb, sm in zip(b.identity, m.identity, strict=True):
        add(f"| {sb.name} | {_cell(sb.seen.describe())} | {_cell(saw(sb))} | "
            f"{_cell(sm.seen.describe())} | {_cell(saw(sm))} |")
    add("")
    add(render_discovery(b, m))
    add(render_cost(b, m))
    add(render_deaths(b, m))
    add(render_metrics(b, m))
    return "\n".join(out)


def render_discovery(b: Run, m: Run) -> str:
    out = ["### Discovery\n"]
    add = out.append
    add("Aggregated v2 `/apis` and `/api` as each entry point merges them, compared "
        "group by group (presence, order, metadata), version by version (presence, order, "
        "freshness) and resource by resource (presence, order, scope, singular name, "
        "kind, verbs, short names, categories, subresources).\n")
    for sid, label in ((OLD, "old"), (NEW, "new")):
        views = {"old": b.discovery[OLD], "new": b.discovery[NEW]}
        diffs = compare_discovery(b.discovery[sid]["apis"], m.discovery[sid]["apis"])
        core = compare_discovery(b.discovery[sid]["api"], m.discovery[sid]["api"])
        union = listed(b.discovery[OLD]["own_apis"]) | listed(b.discovery[NEW]["own_apis"])
        add(f"**Through the {label} server:** `/apis` lists "
            f"{len(listed(b.discovery[sid]['apis']))} resources built-in and "
            f"{len(listed(m.discovery[sid]['apis']))} with mvproxy (the union of both "
            f"servers' own `profile=nopeer` views: {len(union)}): "
            f"{'identical' if not diffs else f'{len(diffs)} differences'}; `/api`: "
            f"{'identical' if not core else f'{len(core)} differences'}.\n")
        if diffs or core:
            add("| where | what | built-in | mvproxy | why |")
            add("|---|---|---|---|---|")
            for diff in diffs + core:
                why = explain(diff, views) or "**unexplained**"
                add(f"| {_cell(diff.where)} | {diff.what} | {_cell(diff.builtin)} | "
                    f"{_cell(diff.mvproxy)} | {_cell(why)} |")
            add("")
    add(group_table(b, m))
    return "\n".join(out)


def group_table(b: Run, m: Run) -> str:
    """The old server's merged /apis, group by group and version by version."""
    own_old = listed(b.discovery[OLD]["own_apis"])
    own_new = listed(b.discovery[NEW]["own_apis"])
    mine = dict(_groups(m.discovery[OLD]["apis"]))
    rows = ["| group | version | resources, built-in / mvproxy | new-only resources |",
            "|---|---|---|---|"]
    for name, group in _groups(b.discovery[OLD]["apis"]):
        theirs_versions = {v["version"]: v for v in group.get("versions") or ()}
        ours_versions = {v["version"]: v for v in (mine.get(name) or {}).get("versions") or ()}
        for version, entry_ in theirs_versions.items():
            ours = ours_versions.get(version) or {}
            new_only = sorted(r["resource"] for r in entry_.get("resources") or ()
                              if (name, version, r["resource"]) in own_new - own_old)
            rows.append(f"| `{name}` | {version} | {len(entry_.get('resources') or ())} / "
                        f"{len(ours.get('resources') or ())} | "
                        f"{', '.join(new_only) or '–'} |")
    return "The old server's merged `/apis`, in its order:\n\n" + "\n".join(rows) + "\n"


def render_cost(b: Run, m: Run) -> str:
    out = ["### Latency and CPU of a rerouted GET\n"]
    add = out.append
    n = b.cost[0].requests
    add(f"{n} GETs of one new-only object per path, one after another on one keep-alive "
        "connection (after 50 to warm up), in 4 rounds alternating between the two "
        "control planes, which run side by side; CPU from `/proc/<pid>/stat` (user + "
        "system) of each process involved, less what it burns idle (measured over 2 s "
        "before the rounds: mvproxy's discovery polls, Lease renewals), divided by the "
        "requests.\n")
    names = sorted({k for c in b.cost + m.cost for k in c.cpu_us})
    add("| path | p50 ms | p99 ms | errors | " + " | ".join(f"{k} µs" for k in names)
        + " | total CPU µs/request |")
    add("|---|---|---|---|" + "---|" * len(names) + "---|")
    for cost in [b.cost[0], m.cost[0], b.cost[1], m.cost[1]]:
        us = cost.cpu_us
        cells = [f"{us[k]:.0f}" if k in us else "–" for k in names]
        add(f"| {cost.label} | {cost.p50_ms:.2f} | {cost.p99_ms:.2f} | {cost.errors} | "
            + " | ".join(cells) + f" | {cost.total_us:.0f} |")
    add("")
    if b.peer_lists is not None:
        add(f"Built-in: the old kube-apiserver listed its peers' endpoint records from etcd "
            f"{b.peer_lists:.2f} times per rerouted GET "
            '(`apiserver_storage_list_total{resource="apiServerPeerIPInfo"}`).\n')
    return "\n".join(out)


def render_deaths(b: Run, m: Run) -> str:
    out = ["### When the peer dies\n"]
    add = out.append
    add("The new member is SIGKILLed (no graceful shutdown: its identity Lease and, for "
        "mvproxy, nothing announce it) while a watch on the new-only resource is open "
        "through the old server; then the old server is asked every 0.25 s (each change "
        "shown, seconds after the kill) for the new-only collection and for `/apis`.\n")
    for run in (b, m):
        for death in run.deaths:
            add(f"**{run.mode}: the new member's {death.what} killed.** The open watch "
                f"{death.watch_end}.")
            add("")
            gvs = list(death.timeline[0].versions) if death.timeline else []
            add("| after | GET of the collection | `/apis` lists it | "
                + " | ".join(f"`{gv}` in `/apis`" for gv in gvs) + " |")
            add("|---|---|---|" + "---|" * len(gvs))
            for sample in death.timeline:
                add(f"| {sample.at:.1f} s | {_cell(sample.get.describe())} | "
                    f"{'yes' if sample.listed else 'no'} | "
                    + " | ".join(sample.versions[gv] for gv in gvs) + " |")
            if death.recovered_after is not None:
                add(f"\nRestarted: the old server serves it again "
                    f"{death.recovered_after:.1f} s after the restart began.\n")
    return "\n".join(out)


def render_metrics(b: Run, m: Run) -> str:
    out = ["### Metrics for proxying\n"]
    add = out.append
    for run, where in ((b, "the old kube-apiserver's `/metrics`"),
                       (m, "the old server's mvproxy's `/metrics`")):
        add(f"**{run.mode}** ({where}), after the scenarios above:\n")
        for name, samples in sorted(run.metrics.items()):
            shown = [s for s in samples if "rerouted" in name or "peer" in name][:6]
            sample_text = "; ".join(f"`{s}`" for s in shown) if shown else ""
            add(f"- `{name}`" + (f": {sample_text}" if sample_text else ""))
        changed = [line for name, samples in sorted(run.metrics_after.items())
                   for line in samples if ("rerouted" in name or "error" in name
                                           or "failover" in name)
                   and line not in run.metrics.get(name, [])]
        if changed:
            add("\nAfter the peer deaths above, these samples changed or appeared: "
                + "; ".join(f"`{line}`" for line in changed))
        add("")
    return "\n".join(out)


def _ns_cell(outcome: NamespaceOutcome) -> str:
    if outcome.skipped:
        return f"not applicable: {outcome.skipped}"
    created = outcome.created.describe() if outcome.created else "?"
    gone = (f"namespace gone after {outcome.gone_after:.1f} s" if outcome.gone_after is not None
            else "namespace **not gone** (stuck)")
    after = outcome.object_after
    if after is not None and after.status == 200:
        text = (f"{gone}; its {outcome.resource.split()[-1]} **still there** (GET on the new "
                "server: 200): orphaned")
        if outcome.recreated is not None:
            text += (f"; a namespace made again with the same name lists "
                     f"{outcome.recreated} of them")
        return f"object created: {created}; {text}"
    status = after.describe() if after is not None else "?"
    return f"object created: {created}; {gone}; the object deleted with it ({status})"


def _gc_cell(outcome: GcOutcome) -> str:
    control = (f"control collected after {outcome.control_after:.1f} s"
               if outcome.control_after is not None else "control **not** collected")
    if outcome.dependent_after is not None:
        return (f"{control}; the {outcome.owner_kind}'s dependent collected after "
                f"{outcome.dependent_after:.1f} s")
    end = outcome.dependent_at_end.describe() if outcome.dependent_at_end else "?"
    return (f"{control}; the {outcome.owner_kind}'s dependent **not collected** "
            f"{outcome.waited:.0f} s later ({end})")


def render_false404(runs: list[Run]) -> str:
    out = ["## The false 404, with a real kube-controller-manager\n", FALSE404_HOW]
    add = out.append
    for versions in dict.fromkeys(r.versions for r in runs):
        cases = [f for r in runs if r.versions == versions for f in r.false404]
        order = {"no proxy": 0, "built-in": 1, "mvproxy": 2}
        cases.sort(key=lambda f: order[f.label])
        add(f"### {versions[0]} + {versions[1]}\n")
        add("| | " + " | ".join(f"{c.label} (kube-controller-manager {c.kcm})"
                                  for c in cases) + " |")
        add("|---|" + "---|" * len(cases))
        add("| a namespace holding a new-only object, deleted | "
            + " | ".join(_cell(_ns_cell(c.namespace)) for c in cases) + " |")
        add("| the owner (of a new-only kind) of a ConfigMap, deleted | "
            + " | ".join(_cell(_gc_cell(c.gc)) for c in cases) + " |")
        add("")
    add(FALSE404_WHY)
    return "\n".join(out)


FALSE404_HOW = """\
The kube-controller-manager runs at the **oldest** release (the skew policy: never newer
than the oldest kube-apiserver) and talks to the old server: *no proxy* straight to its
kube-apiserver (mvproxy's control plane, whose kube-apiservers have no peer proxy;
users straight at the server each request needs, the new-only object made at the new
kube-apiserver), *built-in* straight to its kube-apiserver with the built-in peer proxy
on, *mvproxy* through the old server's mvproxy (users through it too). Each run starts
its own kube-controller-manager and stops it after. What happened is read straight from
the kube-apiservers.

* **Namespace deletion.** A namespace holding one object of a namespaced new-only
  resource is deleted. The namespace controller lists what to delete from *its
  server's* discovery, deletes it, and finalizes the namespace.
* **Garbage collection.** A ConfigMap whose ownerReference names an object of a
  new-only kind; the owner is deleted. The control: a ConfigMap owned by another
  ConfigMap, deleted at the same moment. The garbage collector maps an owner's kind
  through its server's discovery; a kind it cannot map is retried, never resolved
  (`pkg/controller/garbagecollector`: `attemptToDeleteItem` returns the REST-mapping
  error, the item is requeued).
"""


FALSE404_WHY = """\
What this shows. With no proxy, nothing answers a false 404 to the controllers: the
old server simply does not list the new-only resources, so the namespace controller
does not know there is anything to delete (no error, so it finalizes the namespace:
not stuck, worse: the object outlives its namespace, invisible to the old server and
handed to whoever makes a namespace of that name next), and the garbage collector
cannot map the owner's kind (it retries forever and collects nothing; not a wrong
deletion, a leak). Through a proxy (built-in or mvproxy) the controller manager's
discovery is the merged one, its deletes and lookups of new-only kinds are forwarded
to the new server, and both are cleaned up. A wrong *deletion* by the garbage collector
would need its discovery and its GET to reach different servers (a load balancer
spreading one client's connections); these runs do not do that.
"""


# --------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", metavar="OLD,NEW",
                        default=[",".join(p) for p in DEFAULT_PAIRS],
                        help="releases to pair (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS,
                        help="GETs per measured path (default: %(default)s)")
    parser.add_argument("--death-window", type=float, default=20.0,
                        help="seconds to watch the old server after the peer is killed "
                        "(default: %(default)s; upstream's endpoint record lives 15 s)")
    parser.add_argument("--output", type=Path, default=DOC,
                        help="where to write (default: docs/upstream-comparison.md)")
    parser.add_argument("--save", type=Path, metavar="FILE",
                        help="also keep the runs' results in FILE (pickle)")
    parser.add_argument("--from", dest="load", type=Path, metavar="FILE",
                        help="render from results kept with --save instead of running")
    parser.add_argument("--gc-grace", type=float, default=40.0,
                        help="seconds a dependent is given after its control was "
                        "collected, before it counts as never collected (default: "
                        "%(default)s, longer than the garbage collector's 30 s "
                        "discovery resync)")
    args = parser.parse_args(argv)
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.monotonic()
    runs: list[Run] = []
    boths: list[Both] = []
    if args.load:
        import pickle

        with open(args.load, "rb") as f:
            runs, argv, started, took, *rest = pickle.load(f)
        boths = rest[0] if rest else []
        sections = [render_false404(runs)] + ([render_both(boths)] if boths else [])
        args.output.write_text(render(runs, sections, argv, started, took), "utf-8")
        print(f"upstream_comparison: wrote {args.output} from {args.load}", flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="upstream-comparison-") as tmp:
        for text in args.pairs:
            old, new = text.split(",")
            print(f"upstream_comparison: {old} + {new}", flush=True)
            runs += run_pair(Path(tmp) / f"{old}-{new}", (old, new), requests=args.requests,
                             death_window=args.death_window, grace=args.gc_grace).values()
            boths.append(run_both(Path(tmp) / f"{old}-{new}", (old, new)))
    took = time.monotonic() - t0
    if args.save:
        import pickle

        with open(args.save, "wb") as f:
            pickle.dump((runs, argv, started, took, boths), f)
    doc = render(runs, [render_false404(runs), render_both(boths)], argv, started, took)
    args.output.write_text(doc, "utf-8")
    print(f"upstream_comparison: wrote {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    _reexec_in_venv()
    sys.exit(main(sys.argv[1:]))
