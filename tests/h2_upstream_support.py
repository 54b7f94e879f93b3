"""A backend that speaks HTTP/2 (and HTTP/1.1, for mvproxy's discovery polls), as a real
kube-apiserver does, on loopback over mutual TLS: for the upstream HTTP/2 suites.

It serves the 1.35 aggregated discovery on ``/api`` and ``/apis``; any path with
``watch=true`` as an endless JSON event stream (one event per ``period``, until the
client resets the stream or ``stop()``); ``/big?n=N`` as N bytes sent as the client's
window allows; everything else as an echo of what arrived (protocol, path, headers,
body length). It records every request, the TCP connections by protocol, the streams
open at once (and the most ever), and the streams the client reset. Built on the
pure-Python ``h2`` library (the test side), not on mvproxy's jh2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import httptools
import hyperframe.frame

from mvproxy import tls
from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.discoverydocs import aggregated

WAIT = 20.0


@dataclass
class Seen:
    protocol: str
    method: str
    path: str
    headers: dict[str, list[str]]
    body: int = 0


@dataclass
class Backend:
    """Handles for a test: the port, what arrived, and levers."""

    port: int = 0
    requests: list[Seen] = field(default_factory=list)
    connections: dict[str, int] = field(default_factory=lambda: {"h2": 0, "http/1.1": 0})
    open_streams: int = 0
    most_streams: int = 0
    resets: int = 0
    dropped: int = 0
    """HTTP/2 connections mvproxy closed (or aborted) while the backend kept them."""
    period: float = 0.05
    max_streams: int = 100
    sessions: list[_H2] = field(default_factory=list)
    hostile: dict[str, Callable[[_H2, int], Awaitable[None]]] = field(default_factory=dict)
    """Path fragment -> how a hostile server answers it (raw frames, ``_H2.raw``)."""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None

    def h2_requests(self, fragment: str = "") -> list[Seen]:
        return [r for r in self.requests if r.protocol == "h2" and fragment in r.path]

    def goaway(self) -> None:
        """GOAWAY on every HTTP/2 connection: open streams go on, new ones go elsewhere."""
        for session in list(self.sessions):
            session.goaway()

    def cut(self) -> None:
        """Drop every HTTP/2 connection at once (a crashed server)."""
        for session in list(self.sessions):
            session.writer.transport.abort()

    def stop(self) -> None:
        self.stopped.set()


def _documents() -> dict[str, bytes]:
    catalog = load_catalog("1.35")
    return {"/api": json.dumps(aggregated(catalog, core=True)).encode(),
            "/apis": json.dumps(aggregated(catalog, core=False)).encode()}


class _H2:
    """One HTTP/2 connection of the backend."""

    def __init__(self, backend: Backend, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, cn: str):
        self.backend, self.reader, self.writer, self.cn = backend, reader, writer, cn
        config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = h2.settings.Settings(
            client=False, initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: backend.max_streams})
        self.bodies: dict[int, int] = {}
        self.heads: dict[int, list[tuple[str, str]]] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.window_open = asyncio.Event()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    def raw(self, *frames: hyperframe.frame.Frame | bytes) -> None:
        """Frames written as they are, beside h2's state machine (a hostile server)."""
        self.flush()
        if not self.writer.is_closing():
            self.writer.write(b"".join(f if isinstance(f, bytes) else f.serialize()
                                       for f in frames))

    def head(self, stream_id: int, fields: list[tuple[bytes, bytes]], *,
             end_stream: bool = False) -> None:
        """A HEADERS frame of ``fields`` exactly as given (h2's own encoder, so the
        connection's HPACK state stays shared), no checks."""
        frame = hyperframe.frame.HeadersFrame(stream_id, self.conn.encoder.encode(fields))
        frame.flags.add("END_HEADERS")
        if end_stream:
            frame.flags.add("END_STREAM")
        self.raw(frame)

    def goaway(self) -> None:
        """A GOAWAY written beside h2, whose state machine would close every stream."""
        self.flush()
        frame = hyperframe.frame.GoAwayFrame(0)
        frame.last_stream_id = self.conn.highest_inbound_stream_id
        self.writer.write(frame.serialize())

    async def run(self) -> None:
        self.conn.initiate_connection()
        self.flush()
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    self.backend.dropped += 1
                    return
                try:
                    events = self.conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    self.flush()
                    return
                for event in events:
                    self.on(event)
                self.flush()
        except (ConnectionError, ssl.SSLError):
            self.backend.dropped += 1
            return
        finally:
            for task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def on(self, event: h2.events.Event) -> None:
        b = self.backend
        if isinstance(event, h2.events.RequestReceived):
            self.heads[event.stream_id] = list(event.headers)
            self.bodies[event.stream_id] = 0
            b.open_streams += 1
            b.most_streams = max(b.most_streams, b.open_streams)
            path = dict(event.headers).get(":path", "")
            if event.stream_ended is not None or any(f in path for f in b.hostile):
                self.answer(event.stream_id)  # a hostile answer need not wait for the body
        elif isinstance(event, h2.events.DataReceived):
            self.bodies[event.stream_id] = self.bodies.get(event.stream_id, 0) + len(event.data)
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if event.stream_ended is not None:
                self.answer(event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            if event.stream_id in self.heads and event.stream_id not in self.tasks:
                self.answer(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            b.resets += 1
            self.end(event.stream_id)
        elif isinstance(event, h2.events.WindowUpdated):
            self.window_open.set()

    def end(self, stream_id: int) -> None:
        task = self.tasks.pop(stream_id, None)
        if task is not None:
            task.cancel()
        if self.heads.pop(stream_id, None) is not None:
            self.backend.open_streams -= 1

    def answer(self, stream_id: int) -> None:
        head = self.heads.get(stream_id)
        if head is None or stream_id in self.tasks:
            return
        pseudo = dict((n, v) for n, v in head if n.startswith(":"))
        headers: dict[str, list[str]] = {}
        for n, v in head:
            if not n.startswith(":"):
                headers.setdefault(n, []).append(v)
        path = pseudo.get(":path", "")
        self.backend.requests.append(Seen("h2", pseudo.get(":method", ""), path, headers,
                                          self.bodies.get(stream_id, 0)))
        self.tasks[stream_id] = asyncio.get_running_loop().create_task(
            self.respond(stream_id, pseudo, path, headers))

    async def respond(self, stream_id: int, pseudo: dict[str, str], path: str,
                      headers: dict[str, list[str]]) -> None:
        try:
            hostile = next((f for f in self.backend.hostile if f in path), None)
            if hostile is not None:
                await asyncio.wait_for(self.backend.hostile[hostile](self, stream_id), WAIT)
            elif "watch=true" in path:
                self.conn.send_headers(stream_id, [(":status", "200"),
                                                   ("content-type", "application/json")])
                n = 0
                while not self.backend.stopped.is_set():
                    event = json.dumps({"type": "ADDED", "n": n}).encode() + b"\n"
                    await self.send(stream_id, event)
                    n += 1
                    await asyncio.sleep(self.backend.period)
                self.conn.end_stream(stream_id)
                self.flush()
            elif path.startswith("/big"):
                size = int(path.partition("n=")[2] or 0)
                self.conn.send_headers(stream_id, [(":status", "200"),
                                                   ("content-length", str(size))])
                await self.send(stream_id, b"x" * size)
                self.conn.end_stream(stream_id)
                self.flush()
            else:
                body = json.dumps({"server": "backend", "protocol": "h2", "path": path,
                                   "cn": self.cn, "method": pseudo.get(":method"),
                                   "headers": headers,
                                   "body": self.bodies.get(stream_id, 0)}).encode()
                self.conn.send_headers(stream_id, [(":status", "200"),
                                                   ("content-type", "application/json"),
                                                   ("content-length", str(len(body)))])
                await self.send(stream_id, body)
                self.conn.end_stream(stream_id)
                self.flush()
        except (h2.exceptions.ProtocolError, ConnectionError, TimeoutError):
            pass
        finally:
            if self.heads.pop(stream_id, None) is not None:
                self.backend.open_streams -= 1
            self.tasks.pop(stream_id, None)

    async def send(self, stream_id: int, data: bytes) -> None:
        """``data`` as the client's windows allow (bounded by WAIT per wait)."""
        while data:
            window = min(self.conn.local_flow_control_window(stream_id),
                         self.conn.max_outbound_frame_size)
            if window <= 0:
                self.window_open.clear()
                await asyncio.wait_for(self.window_open.wait(), WAIT)
                continue
            self.conn.send_data(stream_id, data[:window])
            data = data[window:]
            self.flush()
            await asyncio.sleep(0)


class _Request:
    """One HTTP/1.1 request head as llhttp reports it."""

    def __init__(self) -> None:
        self.url = b""
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        self.complete = True


async def _http1(backend: Backend, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, documents: dict[str, bytes]) -> None:
    """Discovery polls (and anything else) over HTTP/1.1, kept alive."""
    backend.connections["http/1.1"] += 1
    while True:
        request = _Request()
        parser = httptools.HttpRequestParser(request)
        while not request.complete:
            data = await reader.read(65536)
            if not data:
                return
            parser.feed_data(data)
        path = request.url.decode()
        backend.requests.append(Seen("http/1.1", parser.get_method().decode(), path, {}))
        body = documents.get(path.partition("?")[0]) or json.dumps(
            {"server": "backend", "protocol": "http/1.1", "path": path}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()


@contextlib.asynccontextmanager
async def h2_backend(root: Path, *, max_streams: int = 100, period: float = 0.05):
    """The backend of member ``a`` of the development PKI at ``root``, stopped on exit."""
    backend = Backend(max_streams=max_streams, period=period)
    documents = _documents()
    ctx = tls.server_context(root / "a" / "apiserver.crt", root / "a" / "apiserver.key",
                             root / "front-proxy-ca.crt", http2=True)
    handlers: set[asyncio.Task] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.add(asyncio.current_task())  # type: ignore[arg-type]
        writers.add(writer)
        ssl_object = writer.get_extra_info("ssl_object")
        cert = writer.get_extra_info("peercert") or {}
        cn = dict(x[0] for x in cert.get("subject", ())).get("commonName")
        try:
            if ssl_object is not None and ssl_object.selected_alpn_protocol() == "h2":
                backend.connections["h2"] += 1
                session = _H2(backend, reader, writer, cn)
                backend.sessions.append(session)
                try:
                    await session.run()
                finally:
                    backend.sessions.remove(session)
            else:
                await _http1(backend, reader, writer, documents)
        except (ConnectionError, ssl.SSLError, httptools.HttpParserError):
            pass
        finally:
            writer.close()
            writers.discard(writer)
            handlers.discard(asyncio.current_task())  # type: ignore[arg-type]

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    backend.server = server
    backend.port = server.sockets[0].getsockname()[1]
    try:
        yield backend
    finally:
        backend.stop()
        server.close()
        for writer in list(writers):  # each handler then ends on its own (a cancelled
            writer.transport.abort()  # one is logged by asyncio's stream callback)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*handlers, return_exceptions=True), WAIT)
        await server.wait_closed()
