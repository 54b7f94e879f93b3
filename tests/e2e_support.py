"""Helpers shared by the end-to-end tests that run real ``mvproxy run`` processes
(``test_discovery_e2e.py``, ``test_proxy_e2e.py``): plain HTTPS requests with bounded
timeouts, audit-log and metrics reading, bounded waiting, and a line reader for
long-running kubectl processes.

Everything here waits a bounded time and then fails with what it saw; nothing sleeps
unboundedly and no assertion depends on how fast something happened.
"""

from __future__ import annotations

import http.client
import json
import queue
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mvproxy.devcluster.catalog import Catalog
from mvproxy.devcluster.demo import DemoCluster

T = TypeVar("T")

WAIT_TIMEOUT = 15.0
"""For things that happen asynchronously (an audit line, a watch event, a poll)."""
HTTP_TIMEOUT = 15.0
"""Per plain HTTPS request: mvproxy's connect timeout (5 s) plus a wide margin."""

AGGREGATED_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
AGGREGATED_V2BETA1 = "application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList"
NOPEER_V2 = AGGREGATED_V2 + ";profile=nopeer"
KUBECTL_DISCOVERY_ACCEPT = f"{AGGREGATED_V2},{AGGREGATED_V2BETA1},application/json"
LEGACY_ACCEPT = "application/json, */*"  # kubectl 1.20


# --------------------------------------------------------------------------- HTTPS


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:  # what a failed assertion shows
        return f"Answer({self.status}, {dict(self.headers)}, {self.body[:400]!r})"


def tls_context(cluster: DemoCluster, *, cert: str | None = "admin") -> ssl.SSLContext:
    """The cluster CA, plus the client certificate ``pki/<cert>.crt`` unless None."""
    ctx = ssl.create_default_context(cafile=str(cluster.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cluster.pki / f"{cert}.crt"), str(cluster.pki / f"{cert}.key"))
    return ctx


def request(cluster: DemoCluster, sid: str, method: str, path: str, *,
            headers: dict[str, str] | None = None, body: Any = None,
            cert: str | None = "admin", token: str | None = None, direct: bool = False,
            timeout: float = HTTP_TIMEOUT, source: str | None = None) -> Answer:
    """One request to server ``sid``'s mvproxy (``direct``: its backend), bounded in time,
    from the loopback address ``source`` if given.

    A request that gets no answer within ``timeout`` fails the test with that fact
    (never hangs it).
    """
    server = cluster.server(sid)
    port = server.backend_port if direct else server.proxy_port
    sent = dict(headers or {})
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        sent.setdefault("Content-Type", "application/json")
    conn = http.client.HTTPSConnection(server.host, port, timeout=timeout,
                                       context=tls_context(cluster, cert=cert),
                                       source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return Answer(response.status, response.headers, response.read())
    except TimeoutError:
        raise AssertionError(f"{method} {path} via {sid}{' (direct)' if direct else ''}: "
                             f"no answer within {timeout:g}s") from None
    finally:
        conn.close()


# --------------------------------------------------------------------------- waiting


def wait_until(probe: Callable[[], T], what: str, timeout: float = WAIT_TIMEOUT,
               pause: float = 0.1) -> T:
    """``probe()`` until it returns something truthy; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    for _ in range(int(timeout / pause) + 2):
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            break
        time.sleep(pause)
    raise AssertionError(f"{what}: not within {timeout:g}s (last: {last!r})")


def peer_reachable(cluster: DemoCluster, sid: str, peer: str) -> bool | None:
    """What ``sid``'s mvproxy says about ``peer`` (None if it does not answer)."""
    state = cluster.debug_state(sid)
    if state is None:
        return None
    return bool((state.get("peers") or {}).get(peer, {}).get("reachable"))


def wait_peer_unreachable(cluster: DemoCluster, sid: str, peer: str,
                          timeout: float = WAIT_TIMEOUT) -> None:
    wait_until(lambda: peer_reachable(cluster, sid, peer) is False,
               f"{sid} to see {peer} unreachable", timeout)


# --------------------------------------------------------------------------- audit


def audit_entries(path: Path) -> list[dict]:
    text = path.read_text("utf-8") if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def wait_for_audit(path: Path, predicate: Callable[[dict], bool], what: str = "",
                   timeout: float = WAIT_TIMEOUT) -> dict:
    """The first audit entry matching ``predicate`` (the log may trail the response;
    a watch or exec is audited when it ends)."""
    found: list[dict] = []

    def probe() -> bool:
        found[:] = [e for e in audit_entries(path) if predicate(e)]
        return bool(found)

    try:
        wait_until(probe, f"a matching audit entry in {path}", timeout)
    except AssertionError:
        tail = [(e.get("verb"), e.get("requestURI")) for e in audit_entries(path)[-8:]]
        raise AssertionError(f"{what or 'no matching audit entry'}: nothing matching in "
                             f"{path} within {timeout:g}s; last entries: {tail!r}") from None
    return found[0]


def wait_for_audit_in_any(paths: Iterable[Path], predicate: Callable[[dict], bool],
                          timeout: float = WAIT_TIMEOUT) -> list[dict]:
    """Every entry matching ``predicate`` across ``paths``, once there is at least one."""
    paths = list(paths)

    def probe() -> list[dict]:
        return [e for path in paths for e in audit_entries(path) if predicate(e)]

    return wait_until(probe, f"a matching audit entry in any of {[str(p) for p in paths]}",
                      timeout)


def uri_startswith(prefix: str, verb: str | None = None) -> Callable[[dict], bool]:
    return lambda e: (e.get("requestURI", "").startswith(prefix)
                      and (verb is None or e.get("verb") == verb))


# --------------------------------------------------------------------------- metrics


def metrics(cluster: DemoCluster, sid: str) -> dict[str, float]:
    """``sid``'s mvproxy metrics as ``{'name{labels}': value}`` (Prometheus text)."""
    url = f"{cluster.server(sid).admin_url}/metrics"
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


# --------------------------------------------------------------------------- catalogs


def resource_names(catalog: Catalog) -> set[str]:
    """``resource.group`` (core: bare) of every resource, as ``kubectl api-resources -o name``."""
    return {f"{r.resource}.{g.name}" if g.name else r.resource
            for g in catalog.groups for v in g.versions for r in v.resources}


def group_versions(catalog: Catalog) -> set[tuple[str, str]]:
    return {(g.name, v.version) for g in catalog.groups for v in g.versions}


def aggregated_group_versions(doc: dict) -> dict[tuple[str, str], dict]:
    """``(group, version) -> version entry`` of an APIGroupDiscoveryList."""
    return {(g["metadata"].get("name", ""), v["version"]): v
            for g in doc["items"] for v in g["versions"]}


# --------------------------------------------------------------------------- processes


class LineReader:
    """Lines of a subprocess's stdout, read by a thread so waiting can be bounded."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                self.lines.put(line)
        except ValueError:  # closed by the test's cleanup
            pass
        self.lines.put(None)
        self.ended.set()

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = WAIT_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"output ended; printed so far: {self.seen!r}")
            self.seen.append(line)
            if predicate(line):
                return line
        raise AssertionError(f"not printed within {timeout:g}s; printed: {self.seen!r}")

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def stop_popen(proc: subprocess.Popen[str], reader: LineReader | None = None) -> None:
    """Kill a helper process the test started and release its pipes (for ``finally``)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    if reader is not None:
        reader.join(5)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def first_word_is(word: str) -> Callable[[str], bool]:
    return lambda line: line.split()[:1] == [word]

