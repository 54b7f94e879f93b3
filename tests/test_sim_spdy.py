"""SPDY exec and the three port-forward carriers of the simulated API server, spoken by
hand over loopback sockets, plus what a hostile SPDY client can and cannot do."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from aiohttp import WSMsgType, web

from mvproxy.devcluster import spdy, spdysession
from mvproxy.devcluster.simexec import handle_exec
from mvproxy.devcluster.simportforward import handle_portforward
from mvproxy.devcluster.spdy import Frame, Framer
from mvproxy.requestinfo import parse_request_info

POD = {"metadata": {"name": "web", "namespace": "default"},
       "spec": {"containers": [{"name": "app"}]}}
EXEC = "/api/v1/namespaces/default/pods/web/exec"
PORTFORWARD = "/api/v1/namespaces/default/pods/web/portforward"
WAIT = 10.0  # seconds: every read below is bounded by this


async def _exec(request: web.Request) -> web.StreamResponse:
    info = parse_request_info(request.method, request.path, request.query_string)
    return await handle_exec(request, info, POD)


async def _portforward(request: web.Request) -> web.StreamResponse:
    return await handle_portforward(request, POD)


@pytest.fixture
async def server(aiohttp_server: Any) -> Any:
    app = web.Application()
    app.router.add_route("*", EXEC, _exec)
    app.router.add_route("*", PORTFORWARD, _portforward)
    return await aiohttp_server(app)


class Client:
    """A hand-made SPDY client on one upgraded connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.framer = reader, writer, Framer()
        self.pending: list[Frame] = []

    def send(self, *frames: Frame) -> None:
        self.writer.write(b"".join(self.framer.encode(f) for f in frames))

    async def frame(self) -> Frame | None:
        """The next frame from the server; None at EOF."""
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(65536), WAIT)
            if not data:
                return None
            self.pending += self.framer.feed(data)
        return self.pending.pop(0)

    async def until_fin(self, *stream_ids: int) -> dict[int, bytes]:
        """Data per stream until every one of ``stream_ids`` got its FIN."""
        data: dict[int, bytes] = {}
        open_ids = set(stream_ids)
        while open_ids:
            frame = await self.frame()
            assert frame is not None, f"EOF with streams {open_ids} open"
            if frame.type == spdy.DATA:
                data[frame.stream_id] = data.get(frame.stream_id, b"") + frame.data
                if frame.fin:
                    open_ids.discard(frame.stream_id)
        return data

    def close(self) -> None:
        self.writer.close()


async def upgrade(server: Any, path: str, protocol: str) -> tuple[int, Client]:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                  f"Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: {protocol}\r\n"
                  "X-Stream-Protocol-Version: channel.k8s.io\r\nContent-Length: 0\r\n\r\n"
                  ).encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    status = int(head.split(b" ", 2)[1])
    if status == 101:
        assert f"X-Stream-Protocol-Version: {protocol}".encode() in head
    return status, Client(reader, writer)


def syn(sid: int, **headers: str) -> Frame:
    return Frame(spdy.SYN_STREAM, sid, headers=tuple(headers.items()))


async def exec_session(server: Any, protocol: str, *command: str) -> dict[int, bytes]:
    query = "&".join(["stdout=1", "stderr=1", *(f"command={c}" for c in command)])
    status, c = await upgrade(server, f"{EXEC}?{query}", protocol)
    assert status == 101
    try:
        c.send(syn(1, streamtype="error"), syn(3, streamtype="stdout"),
               syn(5, streamtype="stderr"))
        return await c.until_fin(1, 3, 5)
    finally:
        c.close()


async def test_spdy_v4_exec_echoes_then_success(server: Any) -> None:
    data = await exec_session(server, "v4.channel.k8s.io", "echo", "hi")
    assert data[3] == b"hi\n"
    assert json.loads(data[1]) == {"metadata": {}, "status": "Success"}
    assert data.get(5, b"") == b""


async def test_spdy_v4_exec_reports_the_exit_code(server: Any) -> None:
    status = json.loads((await exec_session(server, "v4.channel.k8s.io", "false"))[1])
    assert status["reason"] == "NonZeroExitCode"
    assert status["details"]["causes"] == [{"reason": "ExitCode", "message": "1"}]


async def test_spdy_v2_exec_error_stream_is_a_message_only_on_failure(server: Any) -> None:
    assert (await exec_session(server, "v2.channel.k8s.io", "echo", "x")).get(1, b"") == b""
    failed = await exec_session(server, "v2.channel.k8s.io", "sh", "-c", "exit%204")
    assert b"exit code 4" in failed[1]


async def test_spdy_exec_without_a_known_stream_protocol_is_400(server: Any) -> None:
    status, c = await upgrade(server, f"{EXEC}?stdout=1&command=ls", "v9.channel.k8s.io")
    c.close()
    assert status == 400


async def test_spdy_port_forward_answers_http(server: Any) -> None:
    status, c = await upgrade(server, PORTFORWARD, "portforward.k8s.io")
    assert status == 101
    try:
        c.send(syn(1, streamtype="error", port="80", requestid="0"),
               syn(3, streamtype="data", port="80", requestid="0"),
               Frame(spdy.DATA, 3, data=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
        data = await c.until_fin(1, 3)
        assert data[3].startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"default/web" in data[3] and b"port 80" in data[3]
        assert data.get(1, b"") == b""
        # a second connection on the same session (kubectl: one per local connection)
        c.send(syn(5, streamtype="error", port="8080", requestid="1"),
               syn(7, streamtype="data", port="8080", requestid="1"),
               Frame(spdy.DATA, 7, data=b"HEAD / HTTP/1.1\r\n\r\n"))
        data = await c.until_fin(5, 7)
        assert data[7].startswith(b"HTTP/1.1 200 OK\r\n") and data[7].endswith(b"\r\n\r\n")
    finally:
        c.close()


async def test_spdy_port_forward_bad_port_is_reported_on_the_error_stream(server: Any) -> None:
    _, c = await upgrade(server, PORTFORWARD, "portforward.k8s.io")
    try:
        c.send(syn(1, streamtype="error", port="99999", requestid="0"),
               syn(3, streamtype="data", port="99999", requestid="0"))
        data = await c.until_fin(1, 3)
        assert b"invalid port" in data[1] and data.get(3, b"") == b""
    finally:
        c.close()


# --- hostile clients -------------------------------------------------------------------


async def test_garbage_after_the_upgrade_gets_goaway_and_the_server_lives(server: Any) -> None:
    _, c = await upgrade(server, PORTFORWARD, "portforward.k8s.io")
    c.writer.write(b"\x80\x03\x00\x01\xff\xff\xff\xff" + b"\xde\xad" * 100)
    frame = await c.frame()
    assert frame is not None and frame.type == spdy.GOAWAY
    assert frame.value == spdy.PROTOCOL_ERROR
    c.close()
    data = await exec_session(server, "v4.channel.k8s.io", "echo", "still", "here")
    assert data[3] == b"still here\n"


async def test_streams_beyond_the_limit_are_refused(server: Any) -> None:
    _, c = await upgrade(server, PORTFORWARD, "portforward.k8s.io")
    try:
        limit = spdysession.MAX_STREAMS
        c.send(*(syn(2 * i + 1, streamtype="error", port="80", requestid=str(i))
                 for i in range(limit + 1)), syn(2, streamtype="error"))
        frames = [await c.frame() for _ in range(limit + 2)]
        replies = [f for f in frames if f is not None and f.type == spdy.SYN_REPLY]
        refused = [f for f in frames if f is not None and f.type == spdy.RST_STREAM]
        assert len(replies) == limit
        # one over the limit, and an even (server-side) id
        assert {f.stream_id for f in refused} == {2 * limit + 1, 2}
        c.send(Frame(spdy.PING, value=1))  # the session still answers
        assert await c.frame() == Frame(spdy.PING, value=1)
    finally:
        c.close()


async def test_a_client_that_never_reads_is_dropped(server: Any, monkeypatch: Any) -> None:
    """A PING flood from a client that reads nothing cannot grow the server's memory:
    once its write buffer passes the bound, the server drops the connection."""
    monkeypatch.setattr(spdysession, "MAX_WRITE_BUFFER", 64 << 10)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((server.host, server.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write((f"POST {PORTFORWARD} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
                  "Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: portforward.k8s.io\r\n"
                  "Content-Length: 0\r\n\r\n").encode())
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    pings = Framer().encode(Frame(spdy.PING, value=1)) * 10000
    dropped = False
    try:
        for _ in range(300):  # 36 MB of pings; the bound trips within ~3 MB (+ socket buffers)
            writer.write(pings)
            await asyncio.wait_for(writer.drain(), WAIT)
    except (ConnectionError, OSError):
        dropped = True
    finally:
        writer.close()
    assert dropped


def test_a_stream_nobody_reads_is_reset_not_buffered() -> None:
    sent: list[bytes] = []
    client = Framer()
    session = spdysession.Session(sent.append)
    session.receive(client.encode(syn(1, streamtype="data", port="80")))
    chunk = Frame(spdy.DATA, 1, data=b"x" * 32768)
    for _ in range(spdysession.MAX_STREAM_BUFFER // 32768 + 1):
        session.receive(client.encode(chunk))
    frames = Framer().feed(b"".join(sent))
    assert frames[-1] == Frame(spdy.RST_STREAM, 1, value=spdy.PROTOCOL_ERROR)
    assert 1 not in session.streams


# --- WebSocket carriers ------------------------------------------------------------------


async def test_channel_port_forward_over_websocket(aiohttp_client: Any, server: Any) -> None:
    client = await aiohttp_client(server)
    async with client.ws_connect(PORTFORWARD, params=[("ports", "80"), ("ports", "9000")],
                                 protocols=("v4.channel.k8s.io",)) as ws:
        firsts = [await ws.receive_bytes(timeout=WAIT) for _ in range(4)]
        assert firsts == [b"\x00\x50\x00", b"\x01\x50\x00", b"\x02\x28\x23", b"\x03\x28\x23"]
        await ws.send_bytes(b"\x02GET /x HTTP/1.1\r\nHost: y\r\n\r\n")
        answer = await ws.receive_bytes(timeout=WAIT)
        assert answer[0] == 2 and b"port 9000" in answer
        await ws.send_bytes(b"\x00GET / HTTP/1.1\r\n\r\n")
        answer = await ws.receive_bytes(timeout=WAIT)
        assert answer[0] == 0 and b"port 80" in answer
        await ws.send_bytes(b"\x00GET /again HTTP/1.1\r\n\r\n")  # one request per connection
        await ws.close()
        assert ws.close_code == 1000


@pytest.mark.parametrize("ports", [[], ["0"], ["http"], [str(p) for p in range(1, 40)]])
async def test_channel_port_forward_refuses_bad_port_lists(aiohttp_client: Any, server: Any,
                                                           ports: list[str]) -> None:
    client = await aiohttp_client(server)
    answer = await client.get(PORTFORWARD, params=[("ports", p) for p in ports], headers={
        "Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Protocol": "v4.channel.k8s.io"})
    assert answer.status == 400


async def test_spdy_tunnelled_in_websocket(aiohttp_client: Any, server: Any) -> None:
    client = await aiohttp_client(server)
    framer = Framer()
    async with client.ws_connect(PORTFORWARD,
                                 protocols=("SPDY/3.1+portforward.k8s.io",)) as ws:
        for frame in (syn(1, streamtype="error", port="80", requestid="0"),
                      syn(3, streamtype="data", port="80", requestid="0"),
                      Frame(spdy.DATA, 3, data=b"GET / HTTP/1.1\r\n\r\n")):
            await ws.send_bytes(framer.encode(frame))
        got: list[Frame] = []
        while not any(f.type == spdy.DATA and f.stream_id == 3 and f.fin for f in got):
            got += framer.feed(await ws.receive_bytes(timeout=WAIT))
        body = b"".join(f.data for f in got if f.type == spdy.DATA and f.stream_id == 3)
        assert body.startswith(b"HTTP/1.1 200 OK") and b"default/web" in body
        assert [f.stream_id for f in got if f.type == spdy.SYN_REPLY] == [1, 3]
        await ws.send_bytes(b"\xff" * 16)  # garbage: GOAWAY, then the server closes
        later: list[Frame] = []
        while not any(f.type == spdy.GOAWAY for f in later):
            later += framer.feed(await ws.receive_bytes(timeout=WAIT))
        assert later[-1] == Frame(spdy.GOAWAY, 0, value=spdy.PROTOCOL_ERROR)
        assert (await ws.receive(timeout=WAIT)).type in (WSMsgType.CLOSE, WSMsgType.CLOSED)


def test_http_answer_refuses_what_is_not_http() -> None:
    from mvproxy.devcluster.simportforward import http_answer

    assert http_answer(b"\x16\x03\x01garbage", POD, 80).startswith(b"HTTP/1.1 400 ")
    assert http_answer(b"GET / HTTP/1.1\r\n" + b"a" * 20000, POD, 80).startswith(
        b"HTTP/1.1 431 ")
    page = http_answer(b"GET / HTTP/1.1\r\n\r\n",
                       {"metadata": {"name": "<script>", "namespace": "n"}}, 80)
    assert b"<script>" not in page  # a hostile pod name is escaped
