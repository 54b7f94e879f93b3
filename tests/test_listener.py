"""The downstream HTTP/1 protocol (``listener.DownstreamConnection``) byte by byte.

A connection is driven over a fake transport: the test hands it bytes as a socket
would (``data_received``), in whatever pieces it likes, and reads exactly what it
wrote back. No socket, no TLS, no timers: deadlines are plain numbers, expired by
calling ``expired`` with a later time. The handler echoes what it was given.
"""

from __future__ import annotations

import asyncio
import json
import ssl

import pytest

from mvproxy.identity import ANONYMOUS_DOWNSTREAM
from mvproxy.listener import (
    MAX_HEADER_FIELDS,
    MAX_PIPELINED,
    TRANSITIONS,
    DownstreamConnection,
    Exchange,
    Limits,
    Listener,
    State,
    run_in_task,
)

MAX_HEAD = 2048


class FakeTransport(asyncio.Transport):
    """Records what the connection writes and whether it closed it."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = self.aborted = False
        self.reading = True

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data) -> None:
        assert not self.closed, "written after close"
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_write_buffer_size(self) -> int:
        return 0

    def take(self) -> bytes:
        out, self.out = bytes(self.out), bytearray()
        return out


async def echo(exchange: Exchange) -> None:
    """``<method> <target> <body length> <body>``, once the whole body came."""
    body = bytearray()
    done = asyncio.Event()

    def sink(data: bytes) -> None:
        body.extend(data) if data else done.set()

    exchange.attach_body(sink)
    await done.wait()
    exchange.respond(200, [("Content-Type", "text/plain")],
                     f"{exchange.method} {exchange.target} {len(body)} ".encode() + body)


def ok(text: bytes, *extra: bytes) -> bytes:
    """The exact bytes of the echo's answer."""
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n" % len(text)
            + b"".join(extra) + b"\r\n" + text)


class Client:
    def __init__(self, conn: DownstreamConnection, transport: FakeTransport,
                 refused: list[int]):
        self.conn, self.transport = conn, transport
        self.refused = refused
        """The status of every refusal the listener counted (its metric)."""

    async def send(self, *pieces: bytes) -> bytes:
        """Each piece as one read; then whatever was answered once handlers settled."""
        for piece in pieces:
            self.conn.data_received(piece)
        for _ in range(50):  # a fixed number of loop turns: handlers and their callbacks
            await asyncio.sleep(0)
        return self.transport.take()


@pytest.fixture
async def connect():
    made: list[DownstreamConnection] = []

    def open_one(handler=echo, max_header_bytes: int = MAX_HEAD) -> Client:
        refused: list[int] = []
        coroutine = handler  # the tests' handlers are ``async def``: each runs in a task

        def handle(exchange, conn) -> None:
            run_in_task(exchange, conn, coroutine(exchange))

        listener = Listener(handler=handle, limits=Limits(max_header_bytes=max_header_bytes),
                            ssl_context=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER),
                            resolve_identity=lambda der: ANONYMOUS_DOWNSTREAM,
                            anonymous=ANONYMOUS_DOWNSTREAM, on_refused=refused.append)
        conn = DownstreamConnection(listener)
        transport = FakeTransport()
        conn.connection_made(transport)
        made.append(conn)
        return Client(conn, transport, refused)

    yield open_one
    for conn in made:
        conn.connection_lost(None)
    await asyncio.sleep(0)


def status_of(answer: bytes) -> tuple[int, dict, dict]:
    """(HTTP status, header fields, JSON body) of a whole answer."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    assert int(fields["Content-Length"]) == len(body)
    return int(lines[0].split()[1]), fields, json.loads(body)


def assert_status(answer: bytes, code: int) -> dict:
    """A Kubernetes ``Status`` with ``code``, labelled JSON, and the connection ends."""
    status, fields, body = status_of(answer)
    assert (status, fields["Content-Type"], fields["Connection"]) == (
        code, "application/json", "close")
    assert (body["kind"], body["apiVersion"], body["status"], body["code"]) == (
        "Status", "v1", "Failure", code)
    return body


GET = b"GET /api HTTP/1.1\r\nHost: a\r\n\r\n"


# --------------------------------------------------------------------------- states


def test_every_state_can_end_and_closed_is_final():
    assert set(TRANSITIONS) == set(State)
    assert TRANSITIONS[State.CLOSED] == frozenset()
    for state in set(State) - {State.CLOSED}:
        assert State.CLOSED in TRANSITIONS[state]
    # The changes every request makes, assigned without ``_to`` on the hot path:
    cycle = [State.IDLE, State.HEAD, State.BODY, State.IDLE]
    assert all(b in TRANSITIONS[a] for a, b in zip(cycle, cycle[1:], strict=False))
    # After the last request nothing is read as HTTP again.
    assert State.LAST in TRANSITIONS[State.BODY]
    assert TRANSITIONS[State.LAST] == frozenset((State.REFUSED, State.CLOSING, State.CLOSED))


async def test_an_illegal_transition_is_refused(connect):
    client = connect()
    with pytest.raises(AssertionError, match="IDLE -> TUNNEL"):
        client.conn._to(State.TUNNEL)


async def test_a_request_fed_one_byte_at_a_time(connect):
    client = connect()
    seen = [client.conn.state]
    answer = b""
    for byte in GET:
        answer += await client.send(bytes([byte]))
        if client.conn.state is not seen[-1]:
            seen.append(client.conn.state)
    assert answer == ok(b"GET /api 0 ")
    assert seen == [State.IDLE, State.HEAD, State.IDLE]  # BODY passes within the last byte
    assert not client.transport.closed


async def test_a_body_split_across_reads_waits_in_the_body_state(connect):
    client = connect()
    assert await client.send(b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhe") == b""
    assert client.conn.state is State.BODY
    assert await client.send(b"llo") == ok(b"POST /x 5 hello")
    assert client.conn.state is State.IDLE


async def test_a_chunked_body_is_unframed(connect):
    client = connect()
    answer = await client.send(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                               b"3\r\nhel\r\n", b"2;ext=1\r\nlo\r\n", b"0\r\n\r\n")
    assert answer == ok(b"POST /x 5 hello")


async def test_pipelined_requests_are_answered_in_order(connect):
    client = connect()
    answer = await client.send(GET.replace(b"/api", b"/one") + GET.replace(b"/api", b"/two")
                               + b"POST /three HTTP/1.1\r\nContent-Length: 1\r\n\r\nx")
    assert answer == ok(b"GET /one 0 ") + ok(b"GET /two 0 ") + ok(b"POST /three 1 x")


async def test_keep_alive_until_connection_close(connect):
    client = connect()
    assert await client.send(GET) == ok(b"GET /api 0 ")
    assert await client.send(GET) == ok(b"GET /api 0 ")
    answer = await client.send(b"GET /last HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert answer == ok(b"GET /last 0 ", b"Connection: close\r\n")
    assert client.transport.closed and client.conn.state is State.CLOSING
    assert await client.send(GET) == b""  # what comes after is not read


def recording(handler=echo):
    """``handler``, and the targets it was run for."""
    ran: list[str] = []

    async def run(exchange: Exchange) -> None:
        ran.append(exchange.target)
        await handler(exchange)

    return run, ran


LAST_REQUESTS = {
    # the last request, sent in these reads; then the echo's answer to it
    "connection-close": ([b"GET /last HTTP/1.1\r\nConnection: close\r\n\r\n"],
                         ok(b"GET /last 0 ", b"Connection: close\r\n")),
    "http10": ([b"GET /last HTTP/1.0\r\n\r\n"],
               ok(b"GET /last 0 ", b"Connection: close\r\n")),
    "content-length": ([b"POST /last HTTP/1.1\r\nConnection: close\r\n"
                        b"Content-Length: 5\r\n\r\nhello"],
                       ok(b"POST /last 5 hello", b"Connection: close\r\n")),
    "content-length-split": ([b"POST /last HTTP/1.1\r\nConnection: close\r\n"
                              b"Content-Length: 5\r\n\r\nhe", b"llo"],
                             ok(b"POST /last 5 hello", b"Connection: close\r\n")),
    "chunked": ([b"POST /last HTTP/1.1\r\nConnection: close\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"],
                ok(b"POST /last 5 hello", b"Connection: close\r\n")),
    "http10-content-length": ([b"POST /last HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi"],
                              ok(b"POST /last 2 hi", b"Connection: close\r\n")),
}
AFTER_LAST = {
    "request": GET,
    "requests": GET * 3,
    "garbage": b"\x01\x02 not HTTP\r\n\r\n",
    "line-breaks": b"\r\n\r\n",
}


@pytest.mark.parametrize("after", list(AFTER_LAST))
@pytest.mark.parametrize("last", list(LAST_REQUESTS))
async def test_what_follows_the_last_request_in_its_read_is_ignored(connect, last, after):
    """RFC 9112 §9.6: a request with ``Connection: close`` (or HTTP/1.0 without
    keep-alive) is answered, then the connection closes; what was pipelined behind it
    is neither run nor refused (a 400 answered instead of it, before: llhttp refuses
    data after it, and the read's requests waited for that verdict)."""
    handler, ran = recording()
    client = connect(handler=handler)
    pieces, answer = LAST_REQUESTS[last]
    assert await client.send(*pieces[:-1], pieces[-1] + AFTER_LAST[after]) == answer
    assert ran == ["/last"] and client.refused == []
    assert client.transport.closed and client.conn.state is State.CLOSING


@pytest.mark.parametrize("after", list(AFTER_LAST))
async def test_what_follows_the_last_request_in_a_later_read_is_ignored(connect, after):
    """The last request is being answered when more comes: it is read and discarded
    (a client that leaves is still noticed), not counted as refused."""
    gate = asyncio.Event()

    async def slow(exchange: Exchange) -> None:
        await gate.wait()
        await echo(exchange)

    handler, ran = recording(slow)
    client = connect(handler=handler)
    assert await client.send(b"GET /last HTTP/1.1\r\nConnection: close\r\n\r\n") == b""
    assert client.conn.state is State.LAST
    assert await client.send(AFTER_LAST[after], AFTER_LAST[after]) == b""
    assert client.conn.state is State.LAST and client.transport.reading
    gate.set()
    assert await client.send() == ok(b"GET /last 0 ", b"Connection: close\r\n")
    assert ran == ["/last"] and client.refused == []
    assert client.transport.closed


async def test_a_failure_at_the_end_of_the_last_body_is_refused_as_before(connect):
    """The consumer of the last request's body fails at its end (inside llhttp's parse):
    a refusal from the last state, counted; the request still gets its own answer."""
    gate = asyncio.Event()

    async def fragile(exchange: Exchange) -> None:
        def sink(data: bytes) -> None:
            if not data:
                raise RuntimeError("the consumer failed")

        exchange.attach_body(sink)
        await gate.wait()
        exchange.respond(200, [("Content-Type", "text/plain")], b"ok")

    client = connect(handler=fragile)
    assert await client.send(b"POST /last HTTP/1.1\r\nConnection: close\r\n"
                             b"Content-Length: 5\r\n\r\nhe") == b""
    assert await client.send(b"llo") == b""
    assert client.conn.state is State.REFUSED and client.refused == [400]
    gate.set()
    answer = await client.send()
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"Connection: close\r\n" in answer
    assert client.transport.closed


async def test_requests_before_the_last_are_answered_in_order(connect):
    handler, ran = recording()
    client = connect(handler=handler)
    answer = await client.send(GET.replace(b"/api", b"/one")
                               + b"GET /two HTTP/1.1\r\nConnection: close\r\n\r\n"
                               + GET.replace(b"/api", b"/three"))
    assert answer == ok(b"GET /one 0 ") + ok(b"GET /two 0 ", b"Connection: close\r\n")
    assert ran == ["/one", "/two"] and client.refused == []
    assert client.transport.closed


async def test_a_request_behind_an_answer_that_closes_never_runs(connect):
    """mvproxy ends the connection itself (its handler failed: a 500 saying
    ``Connection: close``): the request pipelined behind it is dropped, not run."""
    async def broken(exchange: Exchange) -> None:
        if exchange.target == "/broken":
            raise RuntimeError("a bug")
        await echo(exchange)

    handler, ran = recording(broken)
    client = connect(handler=handler)
    answer = await client.send(GET.replace(b"/api", b"/broken") + GET)
    assert_status(answer, 500)
    assert ran == ["/broken"] and client.refused == []
    assert client.transport.closed


async def test_http10_closes_unless_asked_to_keep_alive(connect):
    client = connect()
    answer = await client.send(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert answer == ok(b"GET /a 0 ", b"Connection: keep-alive\r\n")
    assert not client.transport.closed
    assert await client.send(b"GET /b HTTP/1.0\r\n\r\n") == ok(b"GET /b 0 ",
                                                               b"Connection: close\r\n")
    assert client.transport.closed


# --------------------------------------------------------------------------- limits


async def test_a_head_over_the_limit_is_431_before_it_ends(connect):
    client = connect()
    answer = await client.send(b"GET / HTTP/1.1\r\nX-Big: ", b"a" * MAX_HEAD)
    body = assert_status(answer, 431)
    assert str(MAX_HEAD) in body["message"]
    assert client.transport.closed


async def test_a_head_just_under_the_limit_is_served(connect):
    client = connect()
    start = b"GET / HTTP/1.1\r\nX-Big: "
    head = start + b"a" * (MAX_HEAD - len(start) - 4) + b"\r\n\r\n"
    assert len(head) == MAX_HEAD
    assert await client.send(head) == ok(b"GET / 0 ")


async def test_too_many_header_fields_is_431(connect):
    client = connect(max_header_bytes=1 << 20)
    fields = b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_HEADER_FIELDS + 1))
    answer = await client.send(b"GET / HTTP/1.1\r\n" + fields + b"\r\n")
    assert f"more than {MAX_HEADER_FIELDS}" in assert_status(answer, 431)["message"]


async def test_too_many_pipelined_requests_is_400(connect):
    client = connect()
    answer = await client.send(GET * (MAX_PIPELINED + 2))
    assert f"more than {MAX_PIPELINED} pipelined" in assert_status(answer, 400)["message"]
    assert client.conn.state is State.CLOSING


async def test_a_head_that_does_not_arrive_in_time_is_408(connect):
    client = connect()
    assert await client.send(b"GET / HTTP/1.1\r\n") == b""
    client.conn.expired(client.conn.deadline + 1)
    assert_status(client.transport.take(), 408)


async def test_an_idle_connection_just_closes(connect):
    client = connect()
    assert await client.send(GET) == ok(b"GET /api 0 ")
    client.conn.expired(client.conn.deadline + 1)
    assert client.transport.take() == b"" and client.transport.closed


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("request_bytes, code", [
    pytest.param(b"NOT HTTP AT ALL\r\n\r\n", 400, id="garbage"),
    pytest.param(b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400,
                 id="two-lengths"),
    pytest.param(b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
                 400, id="length-and-chunked"),
    pytest.param(b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501, id="gzip-coding"),
    pytest.param(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
                 id="bad-chunk-size"),
    pytest.param(b"CONNECT a:443 HTTP/1.1\r\n\r\n", 400, id="connect-authority"),
    pytest.param(b"CONNECT / HTTP/1.1\r\n\r\n", 405, id="connect"),
    pytest.param(b"GET / HTTP/2.0\r\n\r\n", 505, id="http2-version"),
    pytest.param(b"GET http://a/ HTTP/1.1\r\n\r\n", 400, id="absolute-form"),
    pytest.param(b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Content-Length: 2\r\n\r\nab", 400, id="upgrade-with-body"),
])
async def test_a_refused_request_is_a_kubernetes_status_and_the_end(connect, request_bytes,
                                                                   code):
    client = connect()
    assert_status(await client.send(request_bytes), code)
    assert client.transport.closed and client.conn.state is State.CLOSING
    assert await client.send(GET) == b""  # nothing more is read


async def test_a_failing_handler_is_a_500_status(connect):
    async def broken(exchange: Exchange) -> None:
        raise RuntimeError("a bug")

    client = connect(handler=broken)
    body = assert_status(await client.send(GET), 500)
    assert body["message"] == "internal error in mvproxy; see its log"


@pytest.mark.parametrize("pieces", [
    pytest.param([b"POST /x HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc"], id="body-to-come"),
    pytest.param([b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"],
                 id="chunks-to-come"),
    pytest.param([b"POST /x HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc" + GET], id="body-unread"),
])
async def test_an_answer_before_the_body_is_read_says_the_connection_ends(connect, pieces):
    """The handler answers without reading the body (as a refusal does): mvproxy closes
    the connection after it, and now the answer says so (it did not), so the client
    sends nothing more on it; nothing pipelined behind it runs."""
    async def early(exchange: Exchange) -> None:
        exchange.respond(403, [("Content-Type", "application/json")], b"{}")

    handler, ran = recording(early)
    client = connect(handler=handler)
    answer = await client.send(*pieces)
    assert answer == (b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert client.transport.closed and ran == ["/x"]


async def test_a_relayed_answer_before_the_body_is_read_says_the_connection_ends(connect):
    """The same for a relayed head (``start_raw``: an upstream that answered early)."""
    async def early(exchange: Exchange) -> None:
        exchange.start_raw(413, b"HTTP/1.1 413 Payload Too Large\r\n", length=b"0",
                           bodiless=False)
        exchange.write(b"", end=True)

    client = connect(handler=early)
    answer = await client.send(b"POST /x HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
    assert answer == (b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n"
                      b"Connection: close\r\n\r\n")
    assert client.transport.closed


async def test_garbage_behind_a_request_in_progress_gets_its_real_answer(connect):
    """The request already upstream finishes truthfully, saying Connection: close; the
    refusal of what followed it is not written."""
    gate = asyncio.Event()

    async def slow(exchange: Exchange) -> None:
        await gate.wait()
        await echo(exchange)

    client = connect(handler=slow)
    assert await client.send(GET) == b""
    assert await client.send(b"NOT HTTP\r\n\r\n") == b""
    assert client.conn.state is State.REFUSED
    gate.set()
    assert await client.send() == ok(b"GET /api 0 ", b"Connection: close\r\n")
    assert client.transport.closed


# --------------------------------------------------------------------------- upgrades


async def test_an_upgrade_hands_its_bytes_to_the_tunnel(connect):
    tunnel = bytearray()
    early: list[bytes] = []

    async def upgrade(exchange: Exchange) -> None:
        # As ``tunnel`` does: the relayed 101 is written as it came.
        exchange.conn.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                            b"Connection: Upgrade\r\n\r\n")
        exchange.started = True
        early.append(exchange.take_over(tunnel.extend))
        await asyncio.Event().wait()  # the tunnel runs until the connection ends

    client = connect(handler=upgrade)
    answer = await client.send(b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n"
                               b"Connection: Upgrade\r\n\r\nearly")
    assert answer == (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                      b"Connection: Upgrade\r\n\r\n")
    assert early == [b"early"] and client.conn.state is State.TUNNEL
    await client.send(b"GET / HTTP/1.1\r\n\r\n")  # not HTTP any more: the tunnel's bytes
    assert bytes(tunnel) == b"GET / HTTP/1.1\r\n\r\n"


async def test_an_upgrade_that_says_close_still_hands_its_bytes_to_the_tunnel(connect):
    """``Connection: Upgrade, close`` is not kept alive, but it is an upgrade: the bytes
    after its head belong to the tunnel, they are not ignored as after a last request."""
    tunnel = bytearray()
    early: list[bytes] = []

    async def upgrade(exchange: Exchange) -> None:
        exchange.conn.write(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
        exchange.started = True
        early.append(exchange.take_over(tunnel.extend))
        await asyncio.Event().wait()

    client = connect(handler=upgrade)
    assert await client.send(b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n"
                             b"Connection: Upgrade, close\r\n\r\n" + GET) == (
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    assert early == [GET] and client.conn.state is State.TUNNEL
    await client.send(GET)
    assert bytes(tunnel) == GET and client.refused == []


async def test_a_refused_upgrade_closes(connect):
    async def refuse(exchange: Exchange) -> None:
        exchange.respond(403, [("Content-Type", "application/json")], b"{}")

    handler, ran = recording(refuse)
    client = connect(handler=handler)
    answer = await client.send(b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n"
                               b"Connection: Upgrade\r\n\r\n" + GET)  # GET: the tunnel's
    assert answer.startswith(b"HTTP/1.1 403 Forbidden\r\n") and b"Connection: close\r\n" in answer
    assert client.transport.closed and client.conn.state is State.CLOSING
    assert ran == ["/ws"] and client.refused == []
