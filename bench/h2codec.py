#!/usr/bin/env python3
"""What an HTTP/2 codec costs per request on mvproxy's two legs: ``h2`` against ``jh2``.

    python3 bench/h2codec.py [--rounds 7] [--min-round 0.2] [--requests 1000]

One process, no sockets, one core: the codec's own cost, which an HTTP/2 mvproxy would
pay on top of TLS, the event loop and the request engine (issue 23). Each leg is
measured alone by replaying a recorded conversation into a fresh connection object:

- **downstream** (mvproxy is the server): kubectl's ``GET
  /api/v1/namespaces/default/configmaps/x`` (its ``user-agent``, ``accept``,
  ``kubectl-command``, ``kubectl-session``, ``accept-encoding`` and an ``authorization:
  Bearer`` of none, 40 or 900 bytes, a projected service-account JWT's size) arrives,
  and a 200 with kube-apiserver's headers and a 500-byte ConfigMap goes back. The bytes
  in are what a Go client sends: Go's HPACK encoder indexes every field, the token
  included, so from the second request on the token is one index byte;
- **upstream** (mvproxy is the client, to kube-apiserver or a peer): the same request
  with ``x-forwarded-for`` (and ``X-Remote-*`` when there is no token) goes out, the
  200 comes back as a Go server encodes it. Twice: as the library sends headers by
  default (``authorization`` never indexed, so a token is Huffman-coded again on every
  request) and with the library's outbound normalisation off (indexed, like Go);
  and, for the 40-byte token on both legs, with the library's outbound normalisation
  and validation off (mvproxy checks what it relays itself), inbound validation on;
- **watch**: one stream that carries 1,000 DATA frames of 1 KiB (a watch event each):
  the sender is mvproxy's downstream leg, the receiver its upstream leg; per event.

Requests go ``--batch`` at a time (10 streams open at once) on one connection of
``--requests`` requests, HPACK's dynamic table at its default 4 KiB as on a real
connection; a fresh connection per replay, so connection set-up is in the figure,
spread over its requests. A round replays until ``--min-round`` seconds of CPU have
passed; the figure is CPU time (``time.process_time``) per request, median of
``--rounds`` rounds (min–max); wall time (``time.perf_counter``) is kept beside it, and
a round whose wall time is well above its CPU time was descheduled. Every cell runs in
every round, the order reversed each round. Beside the two libraries, in the same rounds:
the same shapes framed as HTTP/1.1 the way mvproxy does today (llhttp through httptools,
``mvproxy.wire``), the framing part of today's request only. Then the memory an
open stream holds in each library (``tracemalloc``, 100 watches on one connection).

Installs ``h2`` and ``jh2`` from PyPI into the bench's environment (the project's
``.venv`` when there is one) if they are missing, like ``bench/run.py``'s optional
packages: neither is a runtime dependency of mvproxy nor in the lock. Prints the date,
machine and load average, and mvproxy's whole HTTP/1.1 small GET from
``bench/results/run.json`` for scale; writes ``bench/results/h2codec.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LIBRARIES = ("h2", "jh2")  # PyPI name = import name for both
PATH = b"/api/v1/namespaces/default/configmaps/x"
TOKENS = {"none": 0, "40 B": 40, "900 B": 900}
WATCH_EVENTS, EVENT_BYTES = 1000, 1024


# --------------------------------------------------------------------------- setup


def in_bench_env() -> None:
    """Run under the project's venv when there is one, so the installs below go there."""
    venv = ROOT / ".venv" / "bin" / "python"
    if venv.exists() and Path(sys.prefix) != ROOT / ".venv":
        os.execv(str(venv), [str(venv), *sys.argv])


def ensure_libraries() -> dict[str, ModuleType]:
    """Each library's package, pip-installed into this interpreter when missing."""
    found = {}
    for name in LIBRARIES:
        try:
            importlib.import_module(f"{name}.connection")
        except ImportError:
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", name],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                print(f"h2codec: pip install {name} failed: {done.stderr.strip()[-300:]}")
                continue
            importlib.invalidate_caches()
        found[name] = importlib.import_module(name)
        for part in ("connection", "config", "events"):
            importlib.import_module(f"{name}.{part}")
    return found


def version(name: str) -> str:
    from importlib.metadata import version as dist_version
    return dist_version(name)


def compiled_hpack(lib: ModuleType) -> bool:
    """Whether the library's connection encodes with compiled HPACK (jh2's _hazmat)."""
    return "_hazmat" in (lib.connection.Encoder.__module__ or "")


# --------------------------------------------------------------------------- shapes


def token(length: int) -> bytes:
    """A bearer token of that many bytes in a JWT's alphabet (fixed seed: the same bytes
    every run, so Huffman lengths do not move between runs)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    rng = random.Random(length)
    body = "".join(rng.choice(alphabet) for _ in range(length))
    if length >= 100:  # header.payload.signature, as a projected token has
        body = "eyJhbGciOiJSUzI1NiIsImtpZCI6I" + body[29:length // 2] + "." \
            + body[length // 2 + 1:length - 343] + "." + body[length - 342:]
    return body[:length].encode()


def kubectl_headers(bearer: int) -> list[tuple[bytes, bytes]]:
    headers = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"10.0.0.10:6443"),
               (b":path", PATH),
               (b"accept", b"application/json;as=Table;v=v1;g=meta.k8s.io,application/json;"
                           b"as=Table;v=v1beta1;g=meta.k8s.io,application/json"),
               (b"user-agent", b"kubectl/v1.36.3 (linux/amd64) kubernetes/0c7e6f2"),
               (b"kubectl-command", b"kubectl get"),
               (b"kubectl-session", b"6a1c2e04-9d2f-4b7e-8f3a-2c5d9e1b7a40"),
               (b"accept-encoding", b"gzip")]
    if bearer:
        headers.append((b"authorization", b"Bearer " + token(bearer)))
    return headers


def upstream_headers(bearer: int) -> list[tuple[bytes, bytes]]:
    """What mvproxy sends on: the client's request, its address appended; a certificate
    user's identity as request headers (a token goes on as it came)."""
    headers = kubectl_headers(bearer) + [(b"x-forwarded-for", b"10.0.0.31")]
    if not bearer:
        headers += [(b"x-remote-user", b"kubernetes-admin"),
                    (b"x-remote-group", b"kubeadm:cluster-admins"),
                    (b"x-remote-group", b"system:authenticated")]
    return headers


def response_body() -> bytes:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "x", "namespace": "default", "uid": "6f2c1b9e-3c1d-4a8e-9d1e-1f2b3c4d5e6f",
        "resourceVersion": "123456", "creationTimestamp": "2026-01-01T00:00:00Z",
        "managedFields": [{"manager": "kubectl-create", "operation": "Update",
                           "apiVersion": "v1", "time": "2026-01-01T00:00:00Z"}]},
        "data": {"config.yaml": "x" * 150}}
    raw = json.dumps(body, separators=(",", ":")).encode()
    return raw + b" " * max(0, 500 - len(raw))


def response_headers(n: int, body: bytes) -> list[tuple[bytes, bytes]]:
    """kube-apiserver's headers on a GET; the Audit-Id is new on every response."""
    return [(b":status", b"200"),
            (b"audit-id", f"1b8f3c2a-7d4e-4f1a-9c6b-{n:012x}".encode()),
            (b"cache-control", b"no-cache, private"),
            (b"content-type", b"application/json"),
            (b"x-kubernetes-pf-flowschema-uid", b"0d2b5a3e-8c1f-4e7a-b6d9-3f4e5a6b7c8d"),
            (b"x-kubernetes-pf-prioritylevel-uid", b"7e6d5c4b-3a29-4180-9f8e-7d6c5b4a3928"),
            (b"date", b"Wed, 02 Dec 2026 10:45:00 GMT"),
            (b"content-length", str(len(body)).encode())]


def watch_events() -> list[bytes]:
    """The events a watch carries, made once: a proxy relays them, it does not make them."""
    if not _EVENTS:
        _EVENTS.extend(watch_event(n) for n in range(1, WATCH_EVENTS + 1))
    return _EVENTS


_EVENTS: list[bytes] = []


def watch_event(n: int) -> bytes:
    raw = json.dumps({"type": "MODIFIED", "object": {"kind": "ConfigMap", "apiVersion": "v1",
                      "metadata": {"name": "x", "namespace": "default",
                                   "resourceVersion": str(200000 + n)}}}).encode()
    return raw + b" " * (EVENT_BYTES - 1 - len(raw)) + b"\n"


# --------------------------------------------------------------------------- the two sides


def _connection(lib: ModuleType, *, client_side: bool, go_like: bool, lean: bool):
    """One side's ``H2Connection``: ``go_like`` indexes headers as Go does (no
    normalisation), ``lean`` also turns the library's outbound checks off."""
    config = lib.config.H2Configuration(client_side=client_side,
                                        normalize_outbound_headers=not (go_like or lean),
                                        validate_outbound_headers=not lean)
    return lib.connection.H2Connection(config=config)


class Server:
    """mvproxy's downstream leg (or, recording, kube-apiserver): answers each request."""

    def __init__(self, lib: ModuleType, go_like: bool, body: bytes, lean: bool = False) -> None:
        self.conn = _connection(lib, client_side=False, go_like=go_like, lean=lean)
        self.events = lib.events
        self.body = body
        self.answered = 0
        self.conn.initiate_connection()

    def step(self, data: bytes) -> bytes:
        for event in self.conn.receive_data(data):
            if isinstance(event, self.events.RequestReceived):
                self.answered += 1
                self.conn.send_headers(event.stream_id,
                                       response_headers(self.answered, self.body))
                self.conn.send_data(event.stream_id, self.body, end_stream=True)
        return self.conn.data_to_send()


class Client:
    """mvproxy's upstream leg (or, recording, kubectl): sends requests a batch at a time."""

    def __init__(self, lib: ModuleType, go_like: bool, headers: list, lean: bool = False
                 ) -> None:
        self.conn = _connection(lib, client_side=True, go_like=go_like, lean=lean)
        self.events = lib.events
        self.headers = headers
        self.completed = 0
        self.conn.initiate_connection()

    def send(self, n: int) -> bytes:
        for _ in range(n):
            self.conn.send_headers(self.conn.get_next_available_stream_id(), self.headers,
                                   end_stream=True)
        return self.conn.data_to_send()

    def step(self, data: bytes) -> bytes:
        for event in self.conn.receive_data(data):
            if isinstance(event, self.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                    event.stream_id)
            elif isinstance(event, self.events.StreamEnded):
                self.completed += 1
        return self.conn.data_to_send()


@dataclass
class Transcript:
    """What one side received, chunk by chunk, on one connection; replayed into a fresh
    connection the side does exactly the work it did while recording."""
    to_server: list[bytes]
    to_client: list[bytes]
    units: int  # requests or watch events


def record_requests(lib: ModuleType, client_go_like: bool, server_go_like: bool,
                    headers: list, requests: int, batch: int) -> Transcript:
    body = response_body()
    client, server = Client(lib, client_go_like, headers), Server(lib, server_go_like, body)
    to_server, to_client = [], []
    pending = client.send(0)  # the preface
    for n in range(-1, requests, batch):
        if n >= 0:
            pending += client.send(batch)
        to_server.append(pending)
        to_client.append(server.step(pending))
        pending = client.step(to_client[-1])  # WINDOW_UPDATEs, SETTINGS ack
    to_server.append(pending)
    server.step(pending)
    if client.completed != requests or server.answered != requests:
        raise SystemExit(f"h2codec: {lib.__name__} completed {client.completed} of {requests}")
    return Transcript(to_server, to_client, requests)


def replay_server(lib: ModuleType, transcript: Transcript, lean: bool = False) -> None:
    server = Server(lib, False, response_body(), lean)
    for chunk in transcript.to_server:
        server.step(chunk)


def replay_client(lib: ModuleType, transcript: Transcript, headers: list, go_like: bool,
                  batch: int, lean: bool = False) -> None:
    """The client's part: its sends are the batches it made while recording, in order."""
    client = Client(lib, go_like, headers, lean)
    client.send(0)
    client.step(transcript.to_client[0])
    for chunk in transcript.to_client[1:]:
        client.send(batch)
        client.step(chunk)


class WatchSender:
    """mvproxy's downstream leg of a watch: response headers, then one DATA per event."""

    def __init__(self, lib: ModuleType) -> None:
        self.server = Server(lib, False, b"")
        self.stream = 0
        self.sent = 0
        self.events = watch_events()

    def step(self, data: bytes) -> bytes:
        conn = self.server.conn
        for event in conn.receive_data(data):
            if isinstance(event, self.server.events.RequestReceived):
                self.stream = event.stream_id
                conn.send_headers(self.stream, [(b":status", b"200"),
                                                (b"content-type", b"application/json"),
                                                (b"cache-control", b"no-cache, private")])
        if self.stream and self.sent < WATCH_EVENTS:
            self.sent += 1
            conn.send_data(self.stream, self.events[self.sent - 1],
                           end_stream=self.sent == WATCH_EVENTS)
        return conn.data_to_send()


def watch_headers() -> list[tuple[bytes, bytes]]:
    headers = kubectl_headers(0)
    headers[3] = (b":path", b"/api/v1/namespaces/default/configmaps?watch=1&"
                            b"allowWatchBookmarks=true&resourceVersion=123456")
    return headers


def record_watch(lib: ModuleType) -> Transcript:
    client, sender = Client(lib, True, watch_headers()), WatchSender(lib)
    to_server, to_client = [client.send(0)], []
    to_client.append(sender.step(to_server[-1]))
    pending = client.step(to_client[-1]) + client.send(1)
    while sender.sent < WATCH_EVENTS:
        to_server.append(pending)
        to_client.append(sender.step(pending))
        pending = client.step(to_client[-1])
    if client.completed != 1:
        raise SystemExit(f"h2codec: {lib.__name__}'s watch did not end")
    return Transcript(to_server, to_client, WATCH_EVENTS)


def replay_watch_sender(lib: ModuleType, transcript: Transcript) -> None:
    sender = WatchSender(lib)
    for chunk in transcript.to_server:
        sender.step(chunk)


def replay_watch_receiver(lib: ModuleType, transcript: Transcript) -> None:
    """mvproxy's upstream leg of a watch: receives each event and acknowledges it."""
    client = Client(lib, False, watch_headers())
    client.send(0)
    client.step(transcript.to_client[0])
    client.send(1)
    for chunk in transcript.to_client[1:]:
        client.step(chunk)


# --------------------------------------------------------------------------- HTTP/1.1


class _Sink:
    """httptools' callbacks, keeping what mvproxy's listener and transport keep: the raw
    fields as llhttp gives them."""

    def __init__(self) -> None:
        self.fields: list[tuple[bytes, bytes]] = []
        self.url = b""
        self.body = 0
        self.done = 0

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body += len(body)

    def on_message_complete(self) -> None:
        self.done += 1


def _h1_fields(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(n, v) for n, v in headers if not n.startswith(b":")]


def http1_works(requests: int) -> list[tuple[str, str, str, Any, int]]:
    """The same shapes framed as HTTP/1.1 with what mvproxy uses (llhttp through
    httptools to parse, ``mvproxy.wire`` to write relayed heads and chunks): the codec
    part of today's request only, for a like-for-like column in the same rounds."""
    import httptools

    sys.path.insert(0, str(ROOT))
    from mvproxy import wire
    dropped = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
    body = response_body()
    works = []

    def head(headers: list[tuple[bytes, bytes]], extra: bytes = b"") -> bytes:
        lines = b"".join(n + b": " + v + b"\r\n" for n, v in _h1_fields(headers))
        return b"GET " + PATH + b" HTTP/1.1\r\nhost: 10.0.0.10:6443\r\n" + lines + extra \
            + b"\r\n"

    def response(n: int) -> bytes:
        fields = _h1_fields(response_headers(n, body))
        return wire.status_line(200, b"OK") + b"".join(k + b": " + v + b"\r\n"
                                                      for k, v in fields) + b"\r\n" + body

    responses = [response(n) for n in range(requests)]
    for case, length in TOKENS.items():
        incoming = head(kubectl_headers(length))

        def downstream(incoming: bytes = incoming) -> None:
            sink = _Sink()
            parser = httptools.HttpRequestParser(sink)
            for n in range(requests):
                sink.fields = []
                parser.feed_data(incoming)
                fields = _h1_fields(response_headers(n, body))  # as the upstream leg parsed it
                lowered = [k.lower() for k, _ in fields]
                wire.status_line(200, b"OK") + wire.raw_lines(fields, lowered, dropped) \
                    + b"\r\n" + body
        works.append(("downstream (server)", f"token {case}", "HTTP/1.1", downstream))
        fields = _h1_fields(upstream_headers(length))

        def upstream(fields: list = fields) -> None:
            sink = _Sink()
            parser = httptools.HttpResponseParser(sink)
            for n in range(requests):
                lowered = [k.lower() for k, _ in fields]
                b"GET " + PATH + b" HTTP/1.1\r\nHost: 10.0.0.10:6443\r\n" \
                    + wire.raw_lines(fields, lowered, dropped) + b"\r\n"
                sink.fields = []
                parser.feed_data(responses[n])
                [k.lower() for k, _ in sink.fields]
        works.append(("upstream (client), library default", f"token {case}", "HTTP/1.1",
                      upstream))
    raw_events = watch_events()
    events = [wire.chunk(event) for event in raw_events]

    def send_events() -> None:
        for event in raw_events:
            wire.chunk(event)

    def receive_events() -> None:
        sink = _Sink()
        parser = httptools.HttpResponseParser(sink)
        parser.feed_data(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
        for event in events:
            parser.feed_data(event)
    works.append(("downstream (sends events)", "watch", "HTTP/1.1", send_events))
    works.append(("upstream (receives events)", "watch", "HTTP/1.1", receive_events))
    return [(leg, case, lib, work, WATCH_EVENTS if case == "watch" else requests)
            for leg, case, lib, work in works]


# --------------------------------------------------------------------------- measuring


def one_round(work, units: int, min_round: float) -> tuple[float, float]:
    """(CPU µs, wall µs) per unit over at least ``min_round`` s of this process's CPU."""
    gc.collect()
    done = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while time.process_time() - cpu0 < min_round:
        work()
        done += units
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return cpu / done * 1e6, wall / done * 1e6


def _span(values: list[float]) -> list[float]:
    return [statistics.median(values), min(values), max(values)]


def measure(libs: dict[str, ModuleType], args: argparse.Namespace) -> list[dict]:
    """Every case of every library in every round, the order reversed each round, so a
    change in the machine's load reaches both libraries alike."""
    cells = []

    def add(case: str, leg: str, lib: str, unit: str, work, units: int) -> None:
        work()  # warm: the first connection's allocations, lazy imports
        cells.append({"case": case, "leg": leg, "library": lib, "unit": unit,
                      "work": work, "units": units, "cpu": [], "wall": []})

    for name, lib in libs.items():
        for case, length in TOKENS.items():
            down = record_requests(lib, True, False, kubectl_headers(length), args.requests,
                                   args.batch)
            add(f"token {case}", "downstream (server)", name, "req",
                lambda lib=lib, t=down: replay_server(lib, t), down.units)
            if case == "40 B":  # what the library's own outbound checks cost
                add(f"token {case}", "downstream (server), outbound checks off", name, "req",
                    lambda lib=lib, t=down: replay_server(lib, t, True), down.units)
            up_headers = upstream_headers(length)
            for go_like, how in ((False, "library default"), (True, "all fields indexed")):
                if length == 0 and go_like:
                    continue  # no authorization field: both ways encode alike
                up = record_requests(lib, go_like, True, up_headers, args.requests, args.batch)
                add(f"token {case}", f"upstream (client), {how}", name, "req",
                    lambda lib=lib, t=up, h=up_headers, g=go_like:
                    replay_client(lib, t, h, g, args.batch), up.units)
                if case == "40 B" and go_like:
                    add(f"token {case}", "upstream (client), outbound checks off", name, "req",
                        lambda lib=lib, t=up, h=up_headers:
                        replay_client(lib, t, h, True, args.batch, True), up.units)
        watch = record_watch(lib)
        add("watch", "downstream (sends events)", name, "event",
            lambda lib=lib, t=watch: replay_watch_sender(lib, t), watch.units)
        add("watch", "upstream (receives events)", name, "event",
            lambda lib=lib, t=watch: replay_watch_receiver(lib, t), watch.units)
    for leg, case, lib_name, work, units in http1_works(args.requests):
        add(case, leg, lib_name, "event" if case == "watch" else "req", work, units)
    for round_ in range(args.rounds):
        for cell in cells if round_ % 2 == 0 else reversed(cells):
            cpu, wall = one_round(cell["work"], cell["units"], args.min_round)
            cell["cpu"].append(cpu)
            cell["wall"].append(wall)
        print(f"  round {round_ + 1} of {args.rounds} done, load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    legs = ["downstream (server)", "downstream (server), outbound checks off",
            "upstream (client), library default", "upstream (client), all fields indexed",
            "upstream (client), outbound checks off", "downstream (sends events)",
            "upstream (receives events)"]
    cases = list(dict.fromkeys(c["case"] for c in cells))
    for cell in sorted(cells, key=lambda c: (legs.index(c["leg"]), cases.index(c["case"]))):
        rows.append({"case": cell["case"], "leg": cell["leg"], "library": cell["library"],
                     "unit": cell["unit"], "rounds": args.rounds,
                     "cpu_us": _span(cell["cpu"]), "wall_us": _span(cell["wall"]),
                     "per_round_cpu_us": [round(v, 2) for v in cell["cpu"]]})
        cpu = rows[-1]["cpu_us"]
        print(f"  {cell['library']:4} {cell['leg']:38} {cell['case']:12} {cpu[0]:7.1f} "
              f"µs/{cell['unit']} ({cpu[1]:.1f}–{cpu[2]:.1f}), wall "
              f"{rows[-1]['wall_us'][0]:.1f}", flush=True)
    return rows


def stream_memory(lib: ModuleType, streams: int = 100) -> dict:
    """Bytes a connection object and each open watch stream hold, on each side: the
    server after answering with headers and a 300-byte event (100 of 1 KiB would not fit
    the connection's initial 64 KiB window), the client after reading them.
    The peer's bytes are made first, untraced; only the side measured is traced."""
    headers = kubectl_headers(900)
    out = {}
    for side in ("server", "client"):
        sizes = []
        for n in (0, streams):
            if side == "server":
                peer = Client(lib, True, headers)
                incoming = peer.send(0) + peer.send(n)
            else:
                probe, peer_server = Client(lib, False, headers), Server(lib, True, b"")
                opening = peer_server.step(probe.send(0))
                ids = [probe.conn.get_next_available_stream_id() + 2 * i for i in range(n)]
                peer_server.conn.receive_data(probe.send(n))
                for stream_id in ids:
                    peer_server.conn.send_headers(stream_id, [(b":status", b"200")])
                    peer_server.conn.send_data(stream_id, watch_event(0)[-300:])
                incoming = opening + peer_server.conn.data_to_send()
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            mine: Server | Client
            if side == "server":
                mine = Server(lib, False, b"")
                opened = [event.stream_id for event in mine.conn.receive_data(incoming)
                          if isinstance(event, lib.events.RequestReceived)]
                for stream_id in opened:
                    mine.conn.send_headers(stream_id, [(b":status", b"200")])
                    mine.conn.send_data(stream_id, watch_event(0)[-300:])
                del opened
                mine.conn.data_to_send()
            else:
                mine = Client(lib, False, headers)
                mine.send(0)
                mine.send(n)
                mine.step(incoming)
            gc.collect()
            sizes.append(tracemalloc.get_traced_memory()[0] - base)
            tracemalloc.stop()
            del mine
        out[side] = {"connection_kib": round(sizes[0] / 1024, 1),
                     "per_stream_kib": round((sizes[1] - sizes[0]) / streams / 1024, 2)}
    return out


# --------------------------------------------------------------------------- reporting


def http1_reference() -> dict:
    """mvproxy's whole small GET over HTTP/1.1 (TLS, both legs) from the last full run of
    bench/run.py, for scale."""
    path = HERE / "results" / "run.json"
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    for row in run.get("rows", []):
        if row["scenario"] == "small" and row["target"] == "mvproxy":
            return {"cpu_us": row["cpu_us"], "when": run.get("when"),
                    "source": "bench/results/run.json (bench/run.py, small GET, 32 connections)"}
    return {}


def render(result: dict) -> str:
    m, ref = result["machine"], result["http1_reference"]
    lines = [f"{result['when']}, {m.get('model', '?')}, {m['cpus']} vCPUs, "
             f"kernel {m['kernel']}, Python {m['python']}; load average "
             f"{result['load_before']} before, {result['load_after']} after; "
             f"{', '.join(f'{k} {v}' for k, v in result['versions'].items())}; CPU µs per "
             f"request or event, median of {result['rounds']} rounds of ≥ "
             f"{result['min_round']} s (min–max); {result['requests']} requests per "
             f"connection, {result['batch']} streams open at once.", "",
             "| leg | case | h2 | jh2 | HTTP/1.1 framing (llhttp + mvproxy.wire) |",
             "|---|---|---|---|---|"]
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for row in result["rows"]:
        cpu = row["cpu_us"]
        cells.setdefault((row["leg"], row["case"]), {})[row["library"]] = \
            f"{cpu[0]:.1f} ({cpu[1]:.1f}–{cpu[2]:.1f})"
    for (leg, case), by_lib in cells.items():
        lines.append(f"| {leg} | {case} | {by_lib.get('h2', '–')} | {by_lib.get('jh2', '–')} "
                     f"| {by_lib.get('HTTP/1.1', '–')} |")
    lines += ["", "| memory (tracemalloc) | h2 | jh2 |", "|---|---|---|"]
    mem = result["memory"]
    for side, what in (("server", "downstream"), ("client", "upstream")):
        for key, label in (("connection_kib", "KiB per connection object"),
                           ("per_stream_kib", "KiB per open watch stream")):
            lines.append(f"| {what} ({side}): {label} | "
                         + " | ".join(str(mem.get(lib, {}).get(side, {}).get(key, "–"))
                                      for lib in ("h2", "jh2")) + " |")
    if ref:
        c = ref["cpu_us"]
        lines += ["", f"For scale: mvproxy's whole small GET over HTTP/1.1 (TLS, llhttp, "
                      f"engine, both legs) {c[0]:.0f} µs ({c[1]:.0f}–{c[2]:.0f}), "
                      f"{ref['when']}, {ref['source']}."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-round", type=float, default=0.2, help="seconds of CPU")
    parser.add_argument("--requests", type=int, default=1000, help="per connection")
    parser.add_argument("--batch", type=int, default=10, help="streams open at once")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.05 s: a smoke test")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "h2codec.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.min_round, args.requests = 3, 0.05, 200
    in_bench_env()
    sys.path.insert(0, str(HERE))
    import run  # noqa: E402 - the machine and load lines are bench/run.py's
    libs = ensure_libraries()
    if not libs:
        raise SystemExit("h2codec: neither h2 nor jh2 could be had")
    for name, lib in libs.items():
        print(f"{name} {version(name)}: HPACK {'compiled' if compiled_hpack(lib) else 'Python'}")
    load_before = run.load_average()
    with_affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {max(with_affinity)})  # one core, as a proxy worker has
    try:
        rows = measure(libs, args)
        memory = {name: stream_memory(lib) for name, lib in libs.items()}
    finally:
        os.sched_setaffinity(0, with_affinity)
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": run.machine(), "load_before": load_before, "load_after": run.load_average(),
        "versions": {name: version(name) for name in libs}, "rounds": args.rounds,
        "min_round": args.min_round, "requests": args.requests, "batch": args.batch,
        "rows": rows, "memory": memory, "http1_reference": http1_reference()}
    result["table"] = render(result)
    print("\n" + result["table"])
    if not args.quick:
        args.output.parent.mkdir(exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
