"""Real Go clients over HTTP/2 through mvproxy: kubectl 1.36 and client-go 1.36 (the
informer, tests/realk8s/informer), against the demo cluster of simulated
kube-apiservers 1.35 and 1.36 (``start_cluster``), on loopback.

What a user of these clients sees, and what mvproxy counts:

* kubectl negotiates ``h2`` and every command (discovery, get, create, patch,
  delete, a watch of a resource only the peer serves) works over one connection;
  with ``listener.http2: false`` the same commands work over HTTP/1.1; exec, attach
  and port-forward stay on HTTP/1.1 (client-go dials their upgrade with
  ``http/1.1`` in ALPN) beside the HTTP/2 connection of the same command.
* 100 informers of one client-go process sync over one downstream connection, one
  stream each. Upstream, mvproxy still opens one HTTP/1.1 connection per watch: the
  test of at most 2 is an expected failure until HTTP/2 upstream lands.
* SIGTERM to the mvproxy informers watch through: their watches end without an
  error and they watch again, from where they were, through the other mvproxy behind
  the same address, missing nothing. A hand-driven HTTP/2 client shows what is not
  right yet on the wire (expected failures, each naming the bug): a watch's response
  head waits for its first event, and after the shutdown ``GOAWAY`` a client's PING
  ends the connection, an event in the grace period is dropped and the watch is cut
  instead of ended.

How connections are counted: each client reaches mvproxy through a ``Front``, a TCP
relay on loopback that stands for a Service's load balancer. It counts the
connections it relays, so a count covers a whole command even after its connections
closed; mvproxy's own gauges (``mvproxy_http2_connections``,
``mvproxy_http2_streams``) are read while a long-running command holds its
connection. kubectl's ``GODEBUG=http2debug=1`` lines say which requests went as
HTTP/2 streams.

The module's cluster, every client and every front are stopped at teardown. The
informer is cached by ``scripts/dev.py kube-binaries`` (absent: skipped, failed in CI).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import ssl
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import e2e_support
import pytest
import yaml
from e2e_support import (
    WAIT_TIMEOUT,
    LineReader,
    first_word_is,
    metrics,
    request,
    stop_popen,
    uri_startswith,
    wait_for_audit,
    wait_until,
)
from informer_support import Informer, informer_binary
from real_support import require_binaries

from mvproxy.devcluster.demo import DemoCluster, ServerInfo, start_cluster
from mvproxy.devcluster.kubeconfig import write_kubeconfig
from mvproxy.devcluster.launcher import free_port
from mvproxy.devcluster.realdemo import start_real_cluster

OLD, NEW = "apiserver-0", "apiserver-1"  # 1.35 (no PodGroups), 1.36
PODGROUPS = "/apis/scheduling.k8s.io/v1alpha2"
NAMESPACES = ("h2", "h1", "streams", "informers", "wire", "drain")
INFORMER_VERSION = "1.36.3"
REAL_VERSIONS = ("1.35.4", "1.36.3")
INFORMERS = 100
"""As many as mvproxy's default ``maxConcurrentStreams``: client-go opens a second
connection only past the server's limit, so one more would need two."""
SYNC_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
NEW_CONN = re.compile(r"http2: Transport creating client conn \S+ to (\S+)")
H2_PATH = re.compile(r'http2: Transport encoding header ":path" = "([^"]*)"')
RESPONSE = re.compile(r'"Response" verb="(\w+)" url="https://[^/]+([^"?]*)[^"]*" status="(\d+)')

PODGROUP = """\
apiVersion: scheduling.k8s.io/v1alpha2
kind: PodGroup
metadata:
  name: {name}
  namespace: {ns}
spec:
  schedulingPolicy:
    gang:
      minCount: 2
"""


# --------------------------------------------------------------------------- the front


class Front:
    """A TCP relay on 127.0.0.1 in front of mvproxies, as a Service's load balancer:
    each connection goes to the first of ``targets`` (ServerInfo: host and proxy port)
    that accepts it, so a stopped mvproxy's clients land on the next; bytes pass
    untouched (TLS and ALPN are the client's and mvproxy's). ``relayed`` counts
    connections by target port."""

    def __init__(self, targets: Sequence[ServerInfo]) -> None:
        self.targets = [(t.host, t.proxy_port) for t in targets]
        self.relayed: dict[int, int] = {}
        self.refused = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Front:
        self._thread.start()
        assert self._ready.wait(10), "the front did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the front did not stop"

    @property
    def connections(self) -> int:
        return sum(self.relayed.values())

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        writers: set[asyncio.StreamWriter] = set()
        relays: set[asyncio.Task[None]] = set()

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            relays.add(task)
            writers.add(writer)
            try:
                await self._relay(reader, writer, writers)
            finally:
                relays.discard(task)

        server = await asyncio.start_server(accepted, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stopped.wait()
            server.close()
            for writer in list(writers):  # every relay's reads end: the relays return
                writer.close()
            if relays:
                await asyncio.wait(list(relays), timeout=5)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     writers: set[asyncio.StreamWriter]) -> None:
        upstream = None
        for host, port in self.targets:
            try:
                upstream = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
            except (OSError, TimeoutError):
                continue
            self.relayed[port] = self.relayed.get(port, 0) + 1
            break
        if upstream is None:
            self.refused += 1
            writer.close()
            return
        up_reader, up_writer = upstream
        writers.add(up_writer)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                if not dst.is_closing() and dst.can_write_eof():
                    dst.write_eof()  # a half-close passes on, as a load balancer's does
            except (OSError, RuntimeError):
                writer.close()  # one side broke: the whole relay ends
                up_writer.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                writers.discard(w)


def front_kubeconfig(cluster: DemoCluster, front: Front, name: str) -> Path:
    """A kubeconfig of its own (and so a discovery cache of its own: kubectl's lives
    beside it) whose one context, ``front``, reaches mvproxy through ``front``."""
    directory = cluster.directory / "fronts" / name
    directory.mkdir(parents=True, exist_ok=True)
    pki = cluster.pki
    return write_kubeconfig(
        directory / "kubeconfig", ca_file=cluster.ca,
        clusters=[("front", f"https://127.0.0.1:{front.port}")],
        users={"admin": {"client-certificate": pki / "admin.crt",
                         "client-key": pki / "admin.key"}},
        contexts=[("front", "front", "admin")], current_context="front")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    with start_cluster(tmp_path_factory.mktemp("http2-clients"), ["1.35", "1.36"],
                       base_port=0) as running:
        for ns in NAMESPACES:
            made = request(running, OLD, "POST", "/api/v1/namespaces", direct=True,
                           body={"apiVersion": "v1", "kind": "Namespace",
                                 "metadata": {"name": ns}})
            assert made.status == 201, made
        yield running


@dataclass
class Run:
    """What one kubectl command printed, and what its HTTP/2 transport logged."""

    done: subprocess.CompletedProcess[str]

    @property
    def stdout(self) -> str:
        return self.done.stdout

    @property
    def h2_connections(self) -> list[str]:
        """Where each HTTP/2 connection it opened went."""
        return NEW_CONN.findall(self.done.stderr)

    @property
    def h2_paths(self) -> list[str]:
        """The ``:path`` of every request it sent as an HTTP/2 stream."""
        return H2_PATH.findall(self.done.stderr)

    @property
    def responses(self) -> list[tuple[str, str, str]]:
        """(verb, path, status) of every response, from ``-v=6``."""
        return RESPONSE.findall(self.done.stderr)


@pytest.fixture(scope="module")
def k(kubectl) -> Callable[..., Run]:
    """``k(kubeconfig, *args)``: kubectl with ``-v=6`` and the HTTP/2 transport's log."""
    env = {**kubectl.env, "GODEBUG": "http2debug=1"}

    def run(kubeconfig: Path, *args: str, check: bool = True) -> Run:
        argv = kubectl.argv("-v=6", *args, kubeconfig=kubeconfig, context="front")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env,
                              stdin=subprocess.DEVNULL, check=False)
        if check:
            assert done.returncode == 0, (argv, done.stdout, done.stderr[-3000:])
        return Run(done)

    def popen(stderr: Path, kubeconfig: Path, *args: str) -> subprocess.Popen[str]:
        """A long-running kubectl (a watch, port-forward); its stderr into ``stderr``."""
        with open(stderr, "w") as err:
            return subprocess.Popen(
                kubectl.argv("-v=6", *args, kubeconfig=kubeconfig, context="front"),
                stdout=subprocess.PIPE, stderr=err, text=True, stdin=subprocess.DEVNULL,
                env=env)

    run.popen = popen  # type: ignore[attr-defined]
    return run


def _gauges(cluster: DemoCluster, sid: str) -> dict[str, float | None]:
    found = metrics(cluster, sid)
    return {name: found.get(name) for name in
            ("mvproxy_http2_connections", "mvproxy_http2_streams")}


def _one_connection_each(run: Run) -> None:
    """Every request of the command went as a stream of its one HTTP/2 connection."""
    assert len(run.h2_connections) == 1, run.h2_connections
    assert run.responses, "kubectl logged no response (-v=6)"
    assert len(run.h2_paths) == len(run.responses), (run.h2_paths, run.responses)


# --------------------------------------------------------------------------- kubectl


def test_kubectl_over_http2_one_connection_per_command(cluster: DemoCluster, k) -> None:
    """Discovery, create, get, a watch of a resource only the peer serves, patch and
    delete through the 1.35 server's mvproxy: each command one HTTP/2 connection,
    every request a stream of it, the watch one open stream."""
    with Front([cluster.server(OLD)]) as front:
        kc = front_kubeconfig(cluster, front, "h2")
        found = k(kc, "api-resources", "-o", "name")  # its cache is empty: full discovery
        assert "podgroups.scheduling.k8s.io" in found.stdout.split()
        _one_connection_each(found)
        assert {path.split("?")[0] for path in found.h2_paths} >= {"/api", "/apis"}

        manifest = kc.parent / "podgroup.yaml"
        manifest.write_text(PODGROUP.format(name="pg", ns="h2"))
        made = k(kc, "create", "-f", manifest)  # OpenAPI v3 for validation, then POST
        assert made.stdout.strip() == "podgroup.scheduling.k8s.io/pg created"
        _one_connection_each(made)
        assert ("POST", f"{PODGROUPS}/namespaces/h2/podgroups", "201") in made.responses
        assert len(made.responses) >= 2, made.responses

        got = k(kc, "get", "podgroups", "-n", "h2", "-o", "name")
        assert got.stdout.split() == ["podgroup.scheduling.k8s.io/pg"]
        _one_connection_each(got)

        watch = k.popen(kc.parent / "watch.stderr", kc, "get", "podgroup", "pg", "-n", "h2",
                        "-w", "-o",
                        "custom-columns=NAME:.metadata.name,COLOR:.metadata.labels.color")
        reader = None
        try:
            reader = LineReader(watch)
            assert reader.wait_for(first_word_is("pg")).split() == ["pg", "<none>"]
            # The watch holds its connection: mvproxy sees it as HTTP/2, one stream open.
            assert wait_until(lambda: _gauges(cluster, OLD)["mvproxy_http2_streams"] == 1,
                              "the watch as one open HTTP/2 stream")
            assert _gauges(cluster, OLD) == {"mvproxy_http2_connections": 1,
                                             "mvproxy_http2_streams": 1}
            patched = k(kc, "patch", "podgroup", "pg", "-n", "h2", "--type", "merge",
                        "-p", '{"metadata":{"labels":{"color":"blue"}}}')
            assert patched.stdout.strip() == "podgroup.scheduling.k8s.io/pg patched"
            _one_connection_each(patched)
            assert reader.wait_for(first_word_is("pg")).split() == ["pg", "blue"]
        finally:
            stop_popen(watch, reader)
        _one_connection_each(Run(subprocess.CompletedProcess(
            watch.args, watch.returncode, "", (kc.parent / "watch.stderr").read_text())))
        # The peer served it (1.35 has no PodGroups), as the admin: audited at its end.
        watched = wait_for_audit(cluster.server(NEW).audit_log,
                                 uri_startswith(f"{PODGROUPS}/namespaces/h2/podgroups", "watch"),
                                 "the watch through the peer, audited by the 1.36 backend")
        assert watched["peerProxied"] == "true", watched

        gone = k(kc, "delete", "podgroup", "pg", "-n", "h2")
        assert gone.stdout.strip() == 'podgroup.scheduling.k8s.io "pg" deleted from h2 namespace'
        _one_connection_each(gone)
        # Six commands, six connections: nothing reconnected, nothing went beside them.
        assert front.relayed == {cluster.server(OLD).proxy_port: 6}
    assert wait_until(lambda: _gauges(cluster, OLD)["mvproxy_http2_connections"] == 0,
                      "every HTTP/2 connection closed once kubectl exited")


@contextlib.contextmanager
def http2_off(cluster: DemoCluster, sid: str) -> Iterator[None]:
    """``sid``'s mvproxy restarted with ``listener.http2: false``, then as it was."""
    config = cluster.server(sid).config
    original = config.read_text()
    doc = yaml.safe_load(original)
    doc["listener"] = {**doc.get("listener", {}), "http2": False}
    cluster.stop_server(sid)
    try:
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
        cluster.start_server(sid)
        yield
    finally:
        cluster.stop_server(sid)
        config.write_text(original)
        cluster.start_server(sid)


def test_kubectl_with_http2_off_falls_back_to_http1(cluster: DemoCluster, k) -> None:
    """``listener.http2: false``: mvproxy offers only ``http/1.1`` and kubectl, which
    offered ``h2`` first, works as before without a word."""
    with http2_off(cluster, NEW), Front([cluster.server(NEW)]) as front:
        kc = front_kubeconfig(cluster, front, "h1")
        manifest = kc.parent / "podgroup.yaml"
        manifest.write_text(PODGROUP.format(name="pg", ns="h1"))
        runs = [k(kc, "api-resources", "-o", "name"), k(kc, "create", "-f", manifest)]
        assert "podgroups.scheduling.k8s.io" in runs[0].stdout.split()
        assert runs[1].stdout.strip() == "podgroup.scheduling.k8s.io/pg created"
        watch = k.popen(kc.parent / "watch.stderr", kc, "get", "podgroup", "pg", "-n", "h1",
                        "-w", "-o", "custom-columns=NAME:.metadata.name,N:.spec."
                        "schedulingPolicy.gang.minCount")
        reader = None
        try:
            reader = LineReader(watch)
            assert reader.wait_for(first_word_is("pg")).split() == ["pg", "2"]
            # No HTTP/2 gauges at all: the listener does not speak it.
            assert _gauges(cluster, NEW) == {"mvproxy_http2_connections": None,
                                             "mvproxy_http2_streams": None}
            runs.append(k(kc, "patch", "podgroup", "pg", "-n", "h1", "--type", "merge",
                          "-p", '{"spec":{"schedulingPolicy":{"gang":{"minCount":3}}}}'))
            assert reader.wait_for(first_word_is("pg")).split() == ["pg", "3"]
        finally:
            stop_popen(watch, reader)
        runs.append(k(kc, "delete", "podgroup", "pg", "-n", "h1"))
        assert runs[-1].stdout.strip() == \
            'podgroup.scheduling.k8s.io "pg" deleted from h1 namespace'
        for run in runs:
            assert run.responses and run.h2_connections == [] and run.h2_paths == [], run
        assert front.connections >= len(runs) + 1


def test_exec_attach_and_port_forward_stay_on_http1(cluster: DemoCluster, k) -> None:
    """kubectl's exec, attach and port-forward through mvproxy with HTTP/2 on: the
    command's plain requests go over HTTP/2, the upgrade over a second connection
    that client-go dialled with ``http/1.1`` only, and both work."""
    made = request(cluster, OLD, "POST", "/api/v1/namespaces/streams/pods", direct=True,
                   body={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
                         "spec": {"containers": [{"name": "app", "image": "nginx"}]}})
    assert made.status == 201, made
    port = cluster.server(OLD).proxy_port
    with Front([cluster.server(OLD)]) as front:
        kc = front_kubeconfig(cluster, front, "streams")
        ran = k(kc, "exec", "web", "-n", "streams", "--", "echo", "hi")
        assert ran.stdout == "hi\n"
        attached = k(kc, "attach", "web", "-n", "streams")
        assert attached.stdout == "attached to web/app\n"
        for run in (ran, attached):
            # One HTTP/2 connection for the GET of the pod, whose stream the upgrade is not.
            assert len(run.h2_connections) == 1, run.h2_connections
            assert not [p for p in run.h2_paths if "/exec" in p or "/attach" in p], run.h2_paths
        assert front.relayed == {port: 4}  # two commands, two connections each

        local = free_port()
        forward = k.popen(kc.parent / "forward.stderr", kc, "port-forward", "-n", "streams",
                          "--address", "127.0.0.1", "pod/web", f"{local}:80")
        reader = None
        try:
            reader = LineReader(forward)
            reader.wait_for(lambda line: line.startswith("Forwarding from"))
            for _ in range(2):  # two connections over the one tunnel
                with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=20) as page:
                    assert page.status == 200
                    assert "default/web" not in (text := page.read().decode()), text
                    assert "streams/web" in text
            # Two connections: the HTTP/2 one (idle now) and the tunnel's.
            assert front.relayed == {port: 6}
            assert _gauges(cluster, OLD) == {"mvproxy_http2_connections": 1,
                                             "mvproxy_http2_streams": 0}
        finally:
            stop_popen(forward, reader)
        tunnel = Run(subprocess.CompletedProcess(forward.args, 0, "",
                                                 (kc.parent / "forward.stderr").read_text()))
        assert not [p for p in tunnel.h2_paths if "portforward" in p], tunnel.h2_paths


# --------------------------------------------------------------------------- client-go


def _informer_env() -> dict[str, str]:
    """The test's environment without anything that could steer client-go elsewhere
    (watch-list stays client-go 1.36's default: on)."""
    return {k: v for k, v in os.environ.items()
            if k != "KUBECONFIG" and not k.startswith("KUBE_FEATURE_")
            and k != "DISABLE_HTTP2"}


def upstream_connections(port: int) -> int:
    """Established TCP connections to 127.0.0.1:``port`` (a backend): mvproxy's upstream
    pool, the only client of a demo backend once the test's own requests are done."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    count += 1
    return count


@dataclass
class Hundred:
    cluster: DemoCluster
    informer: Informer
    front: Front
    upstream_before: int
    synced: list[dict]
    kind: str
    """``sim`` or ``real``: which kube-apiservers are behind the mvproxies."""


@pytest.fixture(scope="class")
def real_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    """Real kube-apiservers 1.35.4 and 1.36.3 (one etcd), an mvproxy before each."""
    binaries = require_binaries(REAL_VERSIONS)
    with start_real_cluster(tmp_path_factory.mktemp("http2-real"), REAL_VERSIONS, 0,
                            binaries=binaries) as running:
        made = request(running, OLD, "POST", "/api/v1/namespaces", direct=True,
                       body={"apiVersion": "v1", "kind": "Namespace",
                             "metadata": {"name": "informers"}})
        assert made.status == 201, made
        yield running


# Class scope: stopped before the drain test stops an mvproxy.
@pytest.fixture(scope="class", params=["sim", "real"])
def hundred(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Hundred]:
    binary = informer_binary(INFORMER_VERSION)
    cluster: DemoCluster = request.getfixturevalue(
        "cluster" if request.param == "sim" else "real_cluster")
    for index in (7, 42, 99):
        made = e2e_support.request(  # ``request`` is pytest's here
            cluster, OLD, "POST", "/api/v1/namespaces/informers/configmaps", direct=True,
            body={"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"cm-{index}", "labels": {"informer": str(index)}}})
        assert made.status == 201, made
    backend = cluster.server(OLD).backend_port
    before = upstream_connections(backend)
    with Front([cluster.server(OLD)]) as front:
        informer = Informer(
            binary, kubeconfig=front_kubeconfig(cluster, front, "informers"),
            context="front", resource="configmaps", namespace="informers",
            extra_args=["--informers", str(INFORMERS), "--label-selector", "informer={i}",
                        "--version-first", "--sync-timeout", f"{SYNC_TIMEOUT:g}s"],
            env=_informer_env(),
            stderr_path=tmp_path_factory.mktemp("informers") / "informer.stderr")
        try:
            informer.wait_for("SERVER_VERSION", timeout=SYNC_TIMEOUT)
            synced = [informer.wait_for("SYNCED", timeout=SYNC_TIMEOUT)
                      for _ in range(INFORMERS)]
            yield Hundred(cluster, informer, front, before, synced, request.param)
        finally:
            informer.stop()  # checked by the class's last test; a second stop() is a no-op


class TestHundredInformers:
    """One client-go process, ``INFORMERS`` informers on ConfigMaps, each its own label
    selector (``informer=<its index>``): one watch each, all through one client."""

    def test_every_informer_syncs_over_one_http2_connection(self, hundred: Hundred) -> None:
        cluster = hundred.cluster
        assert sorted(line["informer"] for line in hundred.synced) == list(range(INFORMERS))
        assert {line["informer"]: line["items"] for line in hundred.synced
                if line["items"]} == {7: 1, 42: 1, 99: 1}
        # One downstream connection, each watch one stream of it.
        assert hundred.front.relayed == {cluster.server(OLD).proxy_port: 1}
        assert wait_until(
            lambda: _gauges(cluster, OLD)["mvproxy_http2_streams"] == INFORMERS,
            f"{INFORMERS} open HTTP/2 streams")
        assert _gauges(cluster, OLD) == {"mvproxy_http2_connections": 1,
                                         "mvproxy_http2_streams": INFORMERS}
        # Each watch is live: an object for one of them reaches that one.
        made = request(cluster, NEW, "POST", "/api/v1/namespaces/informers/configmaps",
                       direct=True, body={"apiVersion": "v1", "kind": "ConfigMap",
                                          "metadata": {"name": "cm-13",
                                                       "labels": {"informer": "13"}}})
        assert made.status == 201, made
        added = hundred.informer.wait_for("ADDED", name="cm-13")
        assert (added["informer"], added["initialList"]) == (13, False)
        assert hundred.front.connections == 1

    def test_the_watches_take_at_most_two_upstream_connections(self, hundred: Hundred) -> None:
        """Upstream HTTP/2 carries the watches where the backend speaks it: a real
        kube-apiserver does; the simulator serves HTTP/1.1 only (one connection each)."""
        if hundred.kind == "sim":
            pytest.skip("the simulator's kube-apiserver speaks HTTP/1.1 only")
        cluster = hundred.cluster
        backend = cluster.server(OLD).backend_port
        wait_until(lambda: _gauges(cluster, OLD)["mvproxy_http2_streams"] == INFORMERS,
                   f"{INFORMERS} open HTTP/2 streams")
        added = upstream_connections(backend) - hundred.upstream_before
        assert added <= 2, f"{added} more upstream connections for {INFORMERS} watches"


    def test_the_informers_stop_cleanly_having_seen_no_error(self, hundred: Hundred) -> None:
        """Last in the class (its fixture's teardown asserts nothing, where an
        expected failure would hide it)."""
        informer = hundred.informer
        assert informer.stop() == 0
        informer.read_rest()
        assert informer.of_type("ERROR", "WATCH_ERROR") == []
        assert [line["reason"] for line in informer.of_type("STOPPED")] == ["stdin"]


# --------------------------------------------------------------------------- on the wire


class H2Watch:
    """A watch over HTTP/2 driven by hand (jh2 as the client): every frame it gets is
    recorded, in order, as (event name, stream or detail), so a test can say what
    came after ``GOAWAY``. httpx cannot: httpcore ends every stream at a ``GOAWAY``."""

    def __init__(self, cluster: DemoCluster, sid: str, path: str) -> None:
        from jh2.config import H2Configuration
        from jh2.connection import H2Connection

        ctx = ssl.create_default_context(cafile=str(cluster.ca))
        ctx.load_cert_chain(str(cluster.pki / "admin.crt"), str(cluster.pki / "admin.key"))
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection(("127.0.0.1", cluster.server(sid).proxy_port), 10)
        self.sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        assert self.sock.selected_alpn_protocol() == "h2"
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.h2.send_headers(1, [(":method", "GET"), (":path", path), (":scheme", "https"),
                                 (":authority", "127.0.0.1")], end_stream=True)
        self.lock = threading.Lock()
        self._send()
        self.seen: list[tuple[str, object]] = []
        self.changed = threading.Condition()
        self.ping_after_goaway = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _send(self) -> None:
        with self.lock:
            data = self.h2.data_to_send()
            if data:
                self.sock.sendall(data)

    def _read(self) -> None:
        """Frames to jh2, but GOAWAY: jh2 (like h2) closes its state machine at one and
        then refuses the frames that follow for the streams still open, where Go's
        client, like RFC 9113, keeps reading them. It is recorded here instead."""
        self.sock.settimeout(None)
        pending = b""
        try:
            while data := self.sock.recv(65536):
                pending += data
                passed = bytearray()
                while len(pending) >= 9:
                    end = 9 + int.from_bytes(pending[:3], "big")
                    if len(pending) < end:
                        break
                    frame, pending = pending[:end], pending[end:]
                    if frame[3] == 0x7:
                        self._goaway(int.from_bytes(frame[13:17], "big"))
                    else:
                        passed += frame
                if passed:
                    for event in self.h2.receive_data(bytes(passed)):
                        self._record(event)
                self._send()
        except OSError:
            pass
        with self.changed:
            self.seen.append(("closed", None))
            self.changed.notify_all()

    def _record(self, event: object) -> None:
        name = type(event).__name__
        detail: object = getattr(event, "stream_id", None)
        if name == "DataReceived":
            detail = getattr(event, "data", b"")
            self.h2.acknowledge_received_data(getattr(event, "flow_controlled_length", 0), 1)
        elif name == "PingAckReceived":
            detail = getattr(event, "ping_data", None)
        with self.changed:
            self.seen.append((name, detail))
            self.changed.notify_all()

    def _goaway(self, code: int) -> None:
        if self.ping_after_goaway and code == 0:
            # What Go's client sends on a connection after a GOAWAY: a PING (its
            # health check) or a WINDOW_UPDATE (for the DATA it read).
            self.sock.sendall(bytes.fromhex("000008060000000000") + b"mvproxy!")
        with self.changed:
            self.seen.append(("ConnectionTerminated", code))
            self.changed.notify_all()

    def wait_for(self, what: Callable[[tuple[str, object]], bool], timeout: float
                 ) -> tuple[str, object] | None:
        with self.changed:
            self.changed.wait_for(lambda: any(what(e) for e in self.seen), timeout)
            return next((e for e in self.seen if what(e)), None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


def _named(name: str) -> Callable[[tuple[str, object]], bool]:
    return lambda e: e[0] == name


@contextlib.contextmanager
def _sigterm(cluster: DemoCluster, sid: str) -> Iterator[threading.Thread]:
    """SIGTERM ``sid``'s mvproxy (it drains for ``shutdownGracePeriod``); started again
    afterwards."""
    stopping = threading.Thread(target=cluster.server(sid).proxy.stop, daemon=True)
    try:
        stopping.start()
        yield stopping
    finally:
        stopping.join(STOP_TIMEOUT + 5)
        if not cluster.server(sid).proxy.running:
            cluster.start_server(sid)


def test_a_watch_gets_its_response_head_before_any_event(cluster: DemoCluster) -> None:
    watch = H2Watch(cluster, OLD, "/api/v1/namespaces/h2-quiet/configmaps?watch=true")
    try:
        # Over HTTP/1.1 the head of this watch comes within 0.1 s (measured); 3 s is
        # only the bound of waiting for it.
        assert watch.wait_for(_named("ResponseReceived"), 3.0), watch.seen
    finally:
        watch.close()


def test_after_goaway_a_clients_ping_does_not_end_the_connection(
        cluster: DemoCluster) -> None:
    _configmap(cluster, "wire", "for-ping")
    watch = H2Watch(cluster, OLD, "/api/v1/namespaces/wire/configmaps?watch=true")
    watch.ping_after_goaway = True
    try:
        assert watch.wait_for(_named("DataReceived"), WAIT_TIMEOUT), watch.seen
        with _sigterm(cluster, OLD):
            assert watch.wait_for(_named("ConnectionTerminated"), WAIT_TIMEOUT), watch.seen
            assert watch.wait_for(lambda e: e[0] in ("PingAckReceived", "closed"),
                                  WAIT_TIMEOUT)
            after = watch.seen[watch.seen.index(("ConnectionTerminated", 0)) + 1:]
            assert after[:1] == [("PingAckReceived", b"mvproxy!")], after
    finally:
        watch.close()


def test_after_goaway_a_watch_gets_its_events_then_ends(cluster: DemoCluster) -> None:
    _configmap(cluster, "wire", "for-events")
    watch = H2Watch(cluster, OLD, "/api/v1/namespaces/wire/configmaps?watch=true")
    try:
        assert watch.wait_for(_named("DataReceived"), WAIT_TIMEOUT), watch.seen
        with _sigterm(cluster, OLD):
            assert watch.wait_for(_named("ConnectionTerminated"), WAIT_TIMEOUT), watch.seen
            _configmap(cluster, "wire", "in-the-grace-period")
            assert watch.wait_for(_named("closed"), WAIT_TIMEOUT), watch.seen
        after = watch.seen[watch.seen.index(("ConnectionTerminated", 0)) + 1:]
        events = [e for e in after if e[0] == "DataReceived"]
        assert any(b"in-the-grace-period" in e[1] for e in events), after  # type: ignore[operator]
        assert ("StreamEnded", 1) in after, after
        assert after.index(("StreamEnded", 1)) < after.index(("closed", None)), after
    finally:
        watch.close()


# --------------------------------------------------------------------------- shutdown


DRAINED = 10


def _configmap(cluster: DemoCluster, ns: str, name: str, through: str = OLD) -> str:
    """Create ConfigMap ``name`` straight at ``through``'s backend; its resourceVersion."""
    made = request(cluster, through, "POST", f"/api/v1/namespaces/{ns}/configmaps",
                   direct=True, body={"apiVersion": "v1", "kind": "ConfigMap",
                                      "metadata": {"name": name}})
    assert made.status == 201, made
    return made.json()["metadata"]["resourceVersion"]


def _collect(informer: Informer, start: int, count: int, kind: str, **fields: Any
             ) -> list[dict]:
    """The first ``count`` lines of type ``kind`` (with ``fields``) from line ``start``
    on, waiting for those not printed yet: lines of several informers interleave."""
    def found() -> list[dict]:
        return [line for line in informer.lines[start:] if line.get("type") == kind
                and all(line.get(k) == v for k, v in fields.items())]
    for _ in range(count):
        if len(found()) >= count:
            break
        informer.wait_for(kind, **fields)
    return found()[:count]


def _seen_by_all(informer: Informer, name: str) -> set[str]:
    """The resourceVersions every one of the ``DRAINED`` informers saw ``name`` ADDED at."""
    added = _collect(informer, 0, DRAINED, "ADDED", name=name)
    assert sorted(line["informer"] for line in added) == list(range(DRAINED))
    return {line["resourceVersion"] for line in added}
"""Informers whose watches share the HTTP/2 connection the drained mvproxy ends."""


def test_sigterm_ends_the_watches_cleanly_and_they_resume_through_the_other_mvproxy(
        cluster: DemoCluster, tmp_path: Path) -> None:
    """Informers watch through a front whose first target is the 1.35 server's
    mvproxy; it gets SIGTERM, sends ``GOAWAY``, stops accepting and exits 0. Each
    informer sees its watch end (not an error), watches again from the resource version
    it had through the next mvproxy behind the front, and sees what happens after.
    (How the streams end on the wire is the business of the ``after_goaway`` tests
    below: today the connection is cut rather than each stream ended.)"""
    ns = "drain"
    old, new = cluster.server(OLD).proxy_port, cluster.server(NEW).proxy_port
    _configmap(cluster, ns, "before")
    binary = informer_binary(INFORMER_VERSION)
    try:
        with Front([cluster.server(OLD), cluster.server(NEW)]) as front:
            informer = Informer(binary, kubeconfig=front_kubeconfig(cluster, front, "drain"),
                                context="front", resource="configmaps", namespace=ns,
                                extra_args=["--informers", str(DRAINED), "--version-first"],
                                env=_informer_env(), stderr_path=tmp_path / "informer.stderr")
            try:
                synced = _collect(informer, 0, DRAINED, "SYNCED")
                assert {line["items"] for line in synced} == {1}
                assert front.relayed == {old: 1}
                assert wait_until(
                    lambda: _gauges(cluster, OLD)["mvproxy_http2_streams"] == DRAINED,
                    "every watch open on the one HTTP/2 connection")
                # An event first: client-go takes a watch that ends within a second of
                # its start with no event for a failure, and lists again.
                last = _configmap(cluster, ns, "warm")
                assert _seen_by_all(informer, "warm") == {last}

                start = len(informer.lines)
                assert cluster.server(OLD).proxy.stop() == 0  # SIGTERM, drained, exit 0
                ended = _collect(informer, start, DRAINED, "WATCH_END")
                assert {line["stoppedByClient"] for line in ended} == {False}
                # Each watches again from the resource version it had: no list again.
                again = {line["informer"]: line
                         for line in _collect(informer, start, DRAINED, "WATCH")}
                assert {i: (line.get("error"), line["resourceVersion"],
                            line["sendInitialEvents"]) for i, line in again.items()} == \
                    {i: (None, last, False) for i in range(DRAINED)}
                # Through the other mvproxy: the stopped one refuses connections now.
                assert front.relayed[old] == 1 and front.relayed.get(new, 0) >= 1
                assert wait_until(
                    lambda: _gauges(cluster, NEW)["mvproxy_http2_streams"] == DRAINED,
                    "every watch open again through the other mvproxy")

                after = _configmap(cluster, ns, "after", through=NEW)
                assert _seen_by_all(informer, "after") == {after}
            finally:
                assert informer.stop() == 0
                informer.read_rest()
        assert informer.of_type("ERROR", "WATCH_ERROR", "LIST") == []
        assert len(informer.of_type("WATCH")) == 2 * DRAINED  # the first and the resumed
    finally:
        if not cluster.server(OLD).proxy.running:
            cluster.start_server(OLD)
