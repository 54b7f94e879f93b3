"""DNS membership: addresses from a real resolution of ``localhost``, server IDs from
certificates verified in real TLS handshakes on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import pytest

from mvproxy.devpki import init_pki
from mvproxy.dnsmembership import DNSMembership, resolve, server_id_from_cert
from mvproxy.membership import Peer
from mvproxy.metrics import Metrics
from mvproxy.tls import client_context, server_context


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("dns")
    init_pki(root / "cluster", ["apiserver-b"])
    init_pki(root / "stranger", ["apiserver-evil"])  # another CA: not a peer
    return root


@contextlib.asynccontextmanager
async def tls_server(ctx: ssl.SSLContext):
    """A TLS listener on 127.0.0.1 that completes handshakes and closes."""
    async def handle(reader, writer):
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


def peer_ssl(pki) -> ssl.SSLContext:
    c = pki / "cluster"
    return client_context(c / "ca.crt", c / "apiserver-b/front-proxy-client.crt",
                          c / "apiserver-b/front-proxy-client.key")


async def loopback_v4(name: str, port: int) -> list[str]:
    """The real resolver's IPv4 answers (the test server listens on 127.0.0.1 only)."""
    return [a for a in await resolve(name, port) if ":" not in a]


def test_server_id_is_the_single_specific_dns_san():
    cert = {"subjectAltName": (("DNS", "localhost"), ("DNS", "kubernetes.default.svc"),
                               ("IP Address", "127.0.0.1"), ("DNS", "apiserver-b"),
                               ("DNS", "mvproxy.kube-system.svc"))}
    assert server_id_from_cert(cert, "mvproxy.kube-system.svc") == "apiserver-b"
    two = {"subjectAltName": (("DNS", "apiserver-b"), ("DNS", "apiserver-c"))}
    assert server_id_from_cert(two, "x") is None  # ambiguous: no guess
    assert server_id_from_cert({"subjectAltName": (("DNS", "*.svc"),)}, "x") is None
    assert server_id_from_cert({}, "x") is None


async def test_an_address_is_a_peer_named_by_its_verified_certificate(pki):
    b = pki / "cluster/apiserver-b"
    changes = []
    async with tls_server(server_context(b / "mvproxy.crt", b / "mvproxy.key")) as port:
        dns = DNSMembership(name="localhost", port=port, interval=1.0, ssl_context=peer_ssl(pki),
                            timeout=5.0, on_change=lambda: changes.append(1),
                            resolver=loopback_v4)
        await dns.refresh()
    assert dns.peers() == (Peer("apiserver-b", f"https://127.0.0.1:{port}"),)
    assert changes == [1]


async def test_a_certificate_from_another_ca_names_no_peer(pki):
    evil = pki / "stranger/apiserver-evil"
    metrics = Metrics()
    async with tls_server(server_context(evil / "mvproxy.crt", evil / "mvproxy.key")) as port:
        dns = DNSMembership(name="localhost", port=port, interval=1.0, ssl_context=peer_ssl(pki),
                            timeout=5.0, metrics=metrics, resolver=loopback_v4)
        await dns.refresh()
    assert dns.peers() == ()
    assert metrics.membership_rejected.labels("dns", "unverified")._value.get() == 1


async def test_a_failed_resolution_keeps_the_known_peers(pki):
    b = pki / "cluster/apiserver-b"
    metrics = Metrics()
    answers = [loopback_v4, None]

    async def flaky(name, port):
        if answers[0] is None:
            raise socket_error()
        return await answers[0](name, port)

    async with tls_server(server_context(b / "mvproxy.crt", b / "mvproxy.key")) as port:
        dns = DNSMembership(name="localhost", port=port, interval=1.0, ssl_context=peer_ssl(pki),
                            timeout=5.0, metrics=metrics, resolver=flaky)
        await dns.refresh()
        known = dns.peers()
        answers[0] = None
        await dns.refresh()
    assert known and dns.peers() == known
    assert metrics.membership_errors.labels("dns", "resolve")._value.get() == 1


async def test_an_address_that_stops_answering_keeps_its_id_until_dns_drops_it(pki):
    b = pki / "cluster/apiserver-b"
    answer: list[str] = ["127.0.0.1"]

    async def fixed(name, port):
        return list(answer)

    async with tls_server(server_context(b / "mvproxy.crt", b / "mvproxy.key")) as port:
        dns = DNSMembership(name="mvproxy.test", port=port, interval=1.0,
                            ssl_context=peer_ssl(pki), timeout=5.0, resolver=fixed)
        await dns.refresh()
    assert dns.peers() == (Peer("apiserver-b", f"https://127.0.0.1:{port}"),)
    await dns.refresh()  # the listener is gone: a blip, not a departure
    assert dns.peers() == (Peer("apiserver-b", f"https://127.0.0.1:{port}"),)
    answer.clear()
    await dns.refresh()  # the DNS answer dropped it
    assert dns.peers() == ()


def socket_error() -> OSError:
    import socket
    return socket.gaierror(socket.EAI_NONAME, "Name or service not known")
