"""transport.UpstreamConnection, byte by byte over a fake transport (no sockets).

The upstream HTTP/1 protocol is driven the way h11 tests itself: each response is fed
one byte at a time (and whole, which must give the same events), and after every
step the test checks the connection's ``State`` and what its response handler was
told. The fake transport records what was written and whether it was closed or
aborted; nothing here runs an event loop.
"""

from __future__ import annotations

import ssl

import pytest

from mvproxy.errors import UpstreamError
from mvproxy.transport import TRANSITIONS, Pool, State, Upstream, UpstreamConnection

CONTEXT = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class FakeTransport:
    """Just what the protocol calls on its transport."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = self.aborted = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written += data

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

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def get_write_buffer_size(self) -> int:
        return 0


class Recorder:
    """A ResponseHandler that writes down what it is told, merging body pieces."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def _body(self) -> bytes:
        return b"".join(e[1] for e in self.events if e[0] == "body")

    def summary(self) -> list[tuple]:
        """The events with body pieces joined into one (feeding byte by byte splits
        them; what the client would receive must not depend on it)."""
        out: list[tuple] = []
        for event in self.events:
            if event[0] == "body":
                if out and out[-1][0] == "body":
                    out[-1] = ("body", out[-1][1] + event[1])
                else:
                    out.append(event)
            elif event[0] != "flush":
                out.append(event)
        return out

    def on_interim(self, status, reason, raw, lowered) -> None:
        self.events.append(("interim", status))

    def on_head(self, status, reason, raw, lowered) -> None:
        self.events.append(("head", status, reason, tuple(raw)))

    def on_body(self, data: bytes) -> None:
        self.events.append(("body", bytes(data)))

    def on_end(self, trailers) -> None:
        self.events.append(("end", tuple(trailers)))

    def on_upgrade(self, early: bytes) -> None:
        self.events.append(("upgrade", early))

    def on_error(self, error: UpstreamError) -> None:
        self.events.append(("error", type(error).__name__, str(error)))

    def flush(self) -> None:
        self.events.append(("flush",))


def connection() -> tuple[UpstreamConnection, FakeTransport, Pool]:
    upstream = Upstream("backend", "https://127.0.0.1:6443", CONTEXT)
    pool = Pool(upstream, connect_timeout=1.0, max_idle=4, idle_expiry=30.0)
    conn = UpstreamConnection(pool)
    conn.context = CONTEXT
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    pool.busy.add(conn)
    return conn, transport, pool


def send(conn: UpstreamConnection, method: str = "GET") -> Recorder:
    recorder = Recorder()
    conn.send(f"{method} /api HTTP/1.1\r\nHost: b\r\n\r\n".encode(), recorder, method=method)
    return recorder


def feed_bytes(conn: UpstreamConnection, data: bytes) -> list[State]:
    """Feed ``data`` one byte at a time; the state after each byte. Every change must
    be one or two moves the transition table allows (a HEAD's final byte is its head
    and its end)."""
    states = []
    for index in range(len(data)):
        before = conn.state
        conn.data_received(data[index:index + 1])
        after = conn.state
        assert after is before or after in TRANSITIONS[before] or any(
            after in TRANSITIONS[middle] for middle in TRANSITIONS[before]), (before, after)
        states.append(after)
    return states


OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n\r\n"
           b"3\r\nabc\r\n2\r\nde\r\n0\r\nX-Sum: 9\r\n\r\n")


# --------------------------------------------------------------------------- the cycle


@pytest.mark.parametrize("whole", [False, True], ids=["byte by byte", "whole"])
def test_a_response_with_a_length_goes_idle_at_its_last_byte(whole):
    conn, transport, _ = connection()
    assert conn.state is State.IDLE
    recorder = send(conn)
    assert conn.state is State.AWAITING_HEAD
    assert bytes(transport.written).startswith(b"GET /api HTTP/1.1\r\n")
    if whole:
        conn.data_received(OK)
    else:
        states = feed_bytes(conn, OK)
        head_end = OK.index(b"\r\n\r\n") + 4
        assert set(states[:head_end - 1]) == {State.AWAITING_HEAD}
        assert set(states[head_end - 1:-1]) == {State.BODY}
    assert conn.state is State.IDLE
    assert recorder.summary() == [
        ("head", 200, b"OK", ((b"Content-Type", b"text/plain"), (b"Content-Length", b"5"))),
        ("body", b"hello"), ("end", ())]
    assert conn.reusable and not transport.closed


@pytest.mark.parametrize("whole", [False, True], ids=["byte by byte", "whole"])
def test_a_chunked_response_ends_after_its_trailers(whole):
    conn, _, _ = connection()
    recorder = send(conn)
    if whole:
        conn.data_received(CHUNKED)
    else:
        states = feed_bytes(conn, CHUNKED)
        assert states[-2] is State.BODY  # the last CRLF ends it
    assert conn.state is State.IDLE and conn.reusable
    summary = recorder.summary()
    assert summary[1] == ("body", b"abcde")
    assert summary[2] == ("end", ((b"X-Sum", b"9"),))


def test_interim_answers_keep_it_waiting_for_the_final_head():
    conn, _, _ = connection()
    recorder = send(conn)
    states = feed_bytes(conn, b"HTTP/1.1 100 Continue\r\n\r\n")
    assert set(states) == {State.AWAITING_HEAD}
    feed_bytes(conn, OK)
    assert conn.state is State.IDLE
    assert [e[0] for e in recorder.summary()] == ["interim", "head", "body", "end"]


def test_a_head_request_ends_at_its_head_and_the_next_one_parses_afresh():
    conn, _, _ = connection()
    recorder = send(conn, "HEAD")
    feed_bytes(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
    assert conn.state is State.IDLE and conn.reusable
    assert [e[0] for e in recorder.summary()] == ["head", "end"]
    second = send(conn)
    feed_bytes(conn, OK)
    assert second.summary()[1] == ("body", b"hello")


def test_a_second_request_on_the_same_connection_counts_as_reused():
    conn, _, _ = connection()
    send(conn)
    conn.data_received(OK)
    send(conn)
    assert conn.requests == 2 and not conn.received
    conn.data_received(OK[:1])
    assert conn.received


def test_connection_close_answers_are_not_reused():
    conn, _, _ = connection()
    send(conn)
    conn.data_received(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert conn.state is State.IDLE and not conn.reusable


# --------------------------------------------------------------------------- switching


def test_a_101_switches_and_hands_over_the_bytes_after_its_head():
    conn, _, pool = connection()
    recorder = send(conn)
    states = feed_bytes(conn, b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: SPDY/3.1\r\n"
                              b"Connection: Upgrade\r\n\r")
    assert set(states) == {State.AWAITING_HEAD}
    conn.data_received(b"\nearly")
    assert conn.state is State.SWITCHED and not conn.reusable
    assert recorder.events[-1] == ("upgrade", b"early")
    tunnelled: list[bytes] = []
    ended: list[bool] = []
    conn.switch(tunnelled.append, lambda: ended.append(True))
    conn.data_received(b"\x80\x03raw, never parsed")
    assert tunnelled == [b"\x80\x03raw, never parsed"]
    assert conn not in pool.busy
    conn.connection_lost(None)
    assert conn.state is State.CLOSED and ended == [True]


# --------------------------------------------------------------------------- endings


def test_a_close_delimited_body_ends_with_the_connection():
    conn, _, _ = connection()
    recorder = send(conn)
    feed_bytes(conn, b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
    assert conn.state is State.BODY
    conn.connection_lost(None)
    assert conn.state is State.CLOSED and conn.closed and not conn.reusable
    assert recorder.summary()[1:] == [("body", b"until the end"), ("end", ())]


def test_closed_before_any_response_byte():
    conn, _, pool = connection()
    recorder = send(conn)
    conn.connection_lost(None)
    assert conn.state is State.CLOSED and conn not in pool.busy
    assert recorder.events == [("error", "UpstreamProtocolError",
                                "backend: connection closed before any response")]
    assert not conn.received


def test_closed_in_the_middle_of_a_body():
    conn, _, _ = connection()
    recorder = send(conn)
    feed_bytes(conn, OK[:-2])
    conn.connection_lost(None)
    assert recorder.events[-1] == (
        "error", "UpstreamProtocolError",
        "backend: connection closed before the response was complete")


def test_a_broken_response_aborts_the_connection():
    conn, transport, _ = connection()
    recorder = send(conn)
    feed_bytes(conn, b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n")
    assert transport.aborted and conn.closed
    [error] = [e for e in recorder.events if e[0] == "error"]
    assert error[1] == "UpstreamProtocolError" and "broken response" in error[2]
    conn.connection_lost(None)
    assert conn.state is State.CLOSED
    assert [e for e in recorder.events if e[0] == "error"] == [error]  # told once


def test_bytes_nobody_asked_for_end_the_connection():
    conn, transport, _ = connection()
    conn.data_received(b"HTTP/1.1 200 OK\r\n")
    assert transport.aborted and conn.closed and not conn.reusable


def test_a_reset_while_waiting_tells_the_handler_once():
    conn, transport, pool = connection()
    recorder = send(conn)
    assert pool.reset() == 1
    assert transport.aborted and conn.reset
    conn.connection_lost(None)
    assert [e[0] for e in recorder.events] == ["error"]


# --------------------------------------------------------------------------- the rules


def test_sending_while_a_request_is_in_flight_is_a_bug():
    conn, _, _ = connection()
    send(conn)
    with pytest.raises(RuntimeError, match="awaiting head -> awaiting head"):
        send(conn)


def test_a_second_head_after_a_switch_is_refused():
    conn, _, _ = connection()
    send(conn)
    conn.data_received(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n"
                       b"Connection: Upgrade\r\n\r\n")
    with pytest.raises(RuntimeError, match="switched -> awaiting head"):
        send(conn)


def test_the_transition_table_covers_every_state_and_closed_is_final():
    assert set(TRANSITIONS) == set(State)
    assert TRANSITIONS[State.CLOSED] == frozenset()
    assert all(State.CLOSED in moves for state, moves in TRANSITIONS.items()
               if state is not State.CLOSED)
    assert State.AWAITING_HEAD in TRANSITIONS[State.IDLE]
    assert TRANSITIONS[State.SWITCHED] == {State.CLOSED}
