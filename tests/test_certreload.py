"""Certificate rotation without a restart (``certreload``), over real TLS on loopback.

Each test runs the assembled daemon between the fake backend and peer of
``daemon_support`` on its own copy of a development PKI, replaces files in that copy
and triggers the check with ``check_now()`` (the periodic check is off), then looks
at what new and already open connections get. The end-to-end tests instead let the
daemon's own timer notice, with bounded polling. Nothing asserts on durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from daemon_support import PEER_ID, PODGROUPS, WAIT, certificate_settings, cluster, ready
from pki_support import issue, replace
from process_support import start_daemon, wait_ready

from mvproxy import devpki, tls
from mvproxy.certreload import CertificateReloader, Material, Unit
from mvproxy.identity import ANONYMOUS, USER, IdentityResolver

PODS = "/api/v1/namespaces/default/pods"  # served by the backend
MANUAL = {"certificates.reloadInterval": "0s"}  # the test calls check_now() itself
EXPIRY = "mvproxy_certificate_expiry_timestamp_seconds"
ERRORS = "mvproxy_certificate_reload_errors_total"


@pytest.fixture
def tree(root, tmp_path) -> Path:
    """A private copy of the module's PKI: tests replace files in it."""
    copy = tmp_path / "pki"
    shutil.copytree(root, copy)
    return copy


# --------------------------------------------------------------------------- helpers


def client_ssl(tree: Path, stem: str = "admin", ca: str = "ca") -> ssl.SSLContext:
    return tls.client_context(tree / f"{ca}.crt", tree / f"{stem}.crt", tree / f"{stem}.key")


async def connect(port: int, ctx: ssl.SSLContext):
    return await asyncio.wait_for(asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1"), WAIT)


def served_serial(writer: asyncio.StreamWriter) -> int:
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


async def new_connection_serial(port: int, ctx: ssl.SSLContext) -> int:
    """Serial number of the certificate a new connection is served."""
    _, writer = await connect(port, ctx)
    try:
        return served_serial(writer)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def exchange(reader, writer, path: str) -> tuple[int, dict]:
    """One GET on an open connection: (status, JSON body)."""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
        body = await reader.readexactly(length)
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def get_once(port: int, ctx: ssl.SSLContext, path: str = PODS) -> tuple[int, dict]:
    """A GET over a new connection; (0, {}) if the server refused the handshake."""
    try:
        reader, writer = await connect(port, ctx)
    except (ssl.SSLError, ConnectionError):
        return 0, {}
    try:
        return await exchange(reader, writer, path)
    except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
        return 0, {}
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def serial_route(path: str):
    """An upstream route answering with the serial of the client certificate presented."""
    from aiohttp import web

    async def serial(request: web.Request) -> web.Response:
        der = request.transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return web.json_response({"serial": x509.load_der_x509_certificate(der).serial_number})

    return lambda app: app.router.add_get(path, serial)


async def presented(c, path: str) -> int:
    """The serial of the client certificate the upstream serving ``path`` was shown."""
    status, _, body = await c.get(path)
    assert status == 200, body
    return json.loads(body)["serial"]


def header(echoed: dict, name: str) -> list[str]:
    return [v for k, v in echoed["headers"] if k.lower() == name.lower()]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "mvproxy.certreload" and r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- serving


async def test_a_replaced_serving_certificate_serves_new_connections_while_open_ones_go_on(
        aiohttp_server, tree):
    async with cluster(aiohttp_server, tree, extra=MANUAL) as c:
        before = x509.load_pem_x509_certificate((tree / "a" / "mvproxy.crt").read_bytes())
        ctx = c.contexts["admin"]
        reader, writer = await connect(c.port, ctx)
        assert served_serial(writer) == before.serial_number
        assert (await exchange(reader, writer, PODS))[0] == 200

        after = issue(tree, "a/mvproxy", days=30)
        assert c.daemon.certificates.check_now() == ["listener"]
        assert await new_connection_serial(c.port, ctx) == after.serial_number
        assert (await get_once(c.port, ctx))[0] == 200

        # The keep-alive connection made before goes on, with the certificate it had.
        status, echoed = await exchange(reader, writer, PODS)
        assert status == 200 and echoed["server"] == "backend"
        assert served_serial(writer) == before.serial_number
        writer.close()

        assert await c.metric(EXPIRY, role="serving") == after.not_valid_after_utc.timestamp()
        assert c.daemon.certificates.check_now() == []  # unchanged files: nothing to do
        assert await c.metric(ERRORS, role="serving") is None


async def test_a_replaced_client_ca_admits_its_clients_and_drops_the_old_ones(
        aiohttp_server, tree, tmp_path):
    """The new CA both verifies the handshake and identifies the user (the identity
    resolver follows); a CA taken out of the file is no longer trusted at all."""
    shutil.copy(tree / "ca.crt", tree / "client-ca.crt")
    other = tmp_path / "other"
    devpki.init_pki(other, ["x"], days=2)  # a second cluster CA, same names, other keys
    async with cluster(aiohttp_server, tree,
                       extra={**MANUAL, "clientCAFile": str(tree / "client-ca.crt")}) as c:
        newcomer = tls.client_context(tree / "ca.crt", other / "admin.crt", other / "admin.key")
        assert (await get_once(c.port, newcomer))[0] == 0
        assert (await get_once(c.port, c.contexts["admin"]))[0] == 200

        replace(tree / "client-ca.crt", (other / "ca.crt").read_bytes())
        assert c.daemon.certificates.check_now() == ["listener"]

        status, echoed = await get_once(c.port, newcomer)
        assert status == 200 and header(echoed, "X-Remote-User") == [devpki.ADMIN_CN]
        assert (await get_once(c.port, c.contexts["admin"]))[0] == 0
        new_ca = x509.load_pem_x509_certificate((other / "ca.crt").read_bytes())
        assert await c.metric(EXPIRY, role="client-ca", index="0") == \
            new_ca.not_valid_after_utc.timestamp()


def test_the_identity_resolver_forgets_what_a_removed_ca_vouched_for(root):
    der = x509.load_pem_x509_certificate((root / "admin.crt").read_bytes()).public_bytes(
        serialization.Encoding.DER)
    resolver = IdentityResolver(client_ca_file=str(root / "ca.crt"),
                                peer_client_ca_file=str(root / "front-proxy-ca.crt"),
                                peer_allowed_names=["front-proxy-client"])
    assert resolver.resolve(der).kind == USER  # memoised now
    resolver.use_cas((), tls.load_ca_bundle(root / "front-proxy-ca.crt", "CA"))
    assert resolver.resolve(der).kind == ANONYMOUS


# --------------------------------------------------------------------------- upstreams


async def test_replaced_client_certificates_are_presented_on_new_upstream_connections(
        aiohttp_server, tree):
    """Backend and peer: after the reload no request goes out on a pooled connection
    made with the old certificate (kube-apiserver checks a client certificate on every
    request: once the old one expires, such a connection would get 401); every request
    presents the new one. A watch opened before the reload keeps streaming."""
    async with cluster(aiohttp_server, tree, extra=MANUAL, backend_routes=serial_route("/serial"),
                       peer_routes=serial_route(PODGROUPS)) as c:
        await ready(c)
        old = x509.load_pem_x509_certificate(
            (tree / "a" / "front-proxy-client.crt").read_bytes()).serial_number
        assert await presented(c, "/serial") == old
        assert await presented(c, PODGROUPS) == old
        watch = await c.sessions["admin"].get(c.base + "/api/v1/configmaps?watch=true")
        try:
            assert (await watch.content.readline()).startswith(b'{"type":"ADDED"')

            new = issue(tree, "a/front-proxy-client", ca="front-proxy-ca",
                        cn="front-proxy-client",
                        usage=ExtendedKeyUsageOID.CLIENT_AUTH).serial_number
            assert sorted(c.daemon.certificates.check_now()) == ["backend", "peer"]

            # The idle pooled connections still present the old certificate: not reused.
            for _ in range(3):
                assert await presented(c, "/serial") == new
                assert await presented(c, PODGROUPS) == new
            # The watch, open on a connection with the old certificate, goes on.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(watch.content.read(1), 0.5)
            assert not watch.content.at_eof()
        finally:
            watch.close()
        for role in ("backend-client", "peer-client"):
            assert await c.metric(EXPIRY, role=role) > await c.metric(EXPIRY, role="serving")


# --------------------------------------------------------------------------- refused


BROKEN = {
    "serving key mismatch": ("a/mvproxy", "serving"),
    "serving garbage": ("a/mvproxy", "serving"),
    "serving expired": ("a/mvproxy", "serving"),
    "serving half-written": ("a/mvproxy", "serving"),
    "backend key mismatch": ("a/front-proxy-client", "backend-client"),
    "client CA garbage": ("client-ca", "client-ca"),
    "peer certificate from the wrong CA": ("a/peer-client", "peer-client"),
    "peer client CA shared with the client CA": ("front-proxy-ca", "peer-client-ca"),
}


def break_files(tree: Path, case: str) -> None:
    stem, _ = BROKEN[case]
    crt = tree / f"{stem}.crt"
    if "key mismatch" in case:
        issue(tree, stem, key_of="b/mvproxy")  # a good certificate for someone else's key
    elif "garbage" in case:
        replace(crt, b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n"
                     b"-----END CERTIFICATE-----\n")
    elif "expired" in case:
        issue(tree, stem, days=-1)
    elif "half-written" in case:
        replace(crt, crt.read_bytes()[: len(crt.read_bytes()) // 2])
    elif "wrong CA" in case:  # peers verify it with the front-proxy CA
        issue(tree, stem, ca="ca", cn="front-proxy-client", usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    elif "shared" in case:  # would let a cluster-CA user named like a peer be one
        replace(crt, (tree / "ca.crt").read_bytes())


@pytest.mark.parametrize("case", list(BROKEN))
async def test_a_broken_replacement_is_refused_logged_once_counted_and_the_old_one_kept(
        aiohttp_server, tree, case, caplog):
    _, role = BROKEN[case]
    caplog.set_level(logging.INFO, logger="mvproxy.certreload")
    # Files of their own for the client CA and the peer client pair (the daemon_support
    # cluster shares them with the backend's), so one broken file breaks one thing.
    shutil.copy(tree / "ca.crt", tree / "client-ca.crt")
    for ext in ("crt", "key"):
        shutil.copy(tree / "a" / f"front-proxy-client.{ext}", tree / "a" / f"peer-client.{ext}")
    extra = {**MANUAL, "clientCAFile": str(tree / "client-ca.crt"),
             "peer.certFile": str(tree / "a" / "peer-client.crt"),
             "peer.keyFile": str(tree / "a" / "peer-client.key")}
    async with cluster(aiohttp_server, tree, extra=extra) as c:
        await ready(c)
        ctx = c.contexts["admin"]
        serial = await new_connection_serial(c.port, ctx)
        expiries = {r: await c.metric(EXPIRY, role=r) for r in
                    ("serving", "backend-client", "peer-client", "client-ca", "peer-client-ca")}

        break_files(tree, case)
        assert c.daemon.certificates.check_now() == []
        assert await c.metric(ERRORS, role=role) == 1
        # One warning per unit refused; the peer client CA is read by the peer unit
        # too (its certificate must chain to it), which it no longer does.
        warned = 2 if "shared" in case else 1
        assert len(warnings_of(caplog)) == warned
        assert all("keeping the ones loaded" in w for w in warnings_of(caplog))
        assert "PRIVATE KEY" not in caplog.text

        # Checked again: the same broken files are neither retried, logged nor counted.
        assert c.daemon.certificates.check_now() == []
        assert await c.metric(ERRORS, role=role) == 1
        assert len(warnings_of(caplog)) == warned

        # The old material still serves and identifies everyone as before.
        assert await new_connection_serial(c.port, ctx) == serial
        status, echoed = await get_once(c.port, ctx)
        assert status == 200 and header(echoed, "X-Remote-User") == [devpki.ADMIN_CN]
        c.daemon.transport.drop_idle("backend")
        c.daemon.transport.drop_idle(PEER_ID)
        assert (await c.get(PODS))[0] == 200
        assert (await c.get(PODGROUPS))[0] == 200
        assert {r: await c.metric(EXPIRY, role=r) for r in expiries} == expiries


async def test_a_good_file_after_a_broken_one_is_loaded(aiohttp_server, tree):
    async with cluster(aiohttp_server, tree, extra=MANUAL) as c:
        issue(tree, "a/mvproxy", days=-1)
        assert c.daemon.certificates.check_now() == []
        fixed = issue(tree, "a/mvproxy", days=40)
        assert c.daemon.certificates.check_now() == ["listener"]
        assert await new_connection_serial(c.port, c.contexts["admin"]) == fixed.serial_number
        assert await c.metric(EXPIRY, role="serving") == fixed.not_valid_after_utc.timestamp()
        assert await c.metric(ERRORS, role="serving") == 1


def test_a_file_still_being_written_is_looked_at_again_not_refused(tmp_path):
    """Files that change while they are read are neither used nor counted as broken."""
    watched = tmp_path / "tls.crt"
    watched.write_bytes(b"v1")
    applied, refused = [], []
    writes = iter([b"v3", None])

    def build() -> Material:
        more = next(writes)
        if more is not None:
            watched.write_bytes(more)  # the writer is not done yet
        return Material(lambda: applied.append(watched.read_bytes()), ())

    unit = Unit("listener", files=[str(watched)], settings=(), role="serving",
                build=lambda: Material(lambda: None, ()))
    reloader = CertificateReloader([unit], problems=lambda settings: [],
                                   on_refused=refused.append)
    reloader.load()
    unit._build = build
    watched.write_bytes(b"v2")
    assert reloader.check_now() == [] and unit.refused is None
    assert reloader.check_now() == ["listener"] and applied == [b"v3"]
    assert refused == []


def test_every_loaded_certificate_has_an_expiry_each_ca_of_a_bundle_its_own(root, tmp_path):
    import dataclasses

    from mvproxy.app import build_daemon

    other = tmp_path / "other"
    devpki.init_pki(other, ["x"], days=9)
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes((root / "ca.crt").read_bytes() + (other / "ca.crt").read_bytes())
    cfg = dataclasses.replace(standalone(root), client_ca_file=str(bundle))
    daemon = build_daemon(cfg)
    loaded = {(role, index) for role, index, _ in daemon.certificates.expiries()}
    assert loaded == {("serving", 0), ("client-ca", 0), ("client-ca", 1), ("peer-client-ca", 0),
                      ("backend-client", 0), ("backend-ca", 0), ("peer-client", 0),
                      ("peer-ca", 0)}


@pytest.mark.parametrize("kind", ["fifo", "oversized"])
async def test_a_fifo_or_a_huge_file_in_place_of_a_certificate_is_refused_unread(
        root, tmp_path, kind):
    """Whoever can write the mounted directory cannot stall the event loop on a FIFO
    (an open for reading would wait for a writer) or make every check read gigabytes."""
    from mvproxy.app import build_daemon

    tree = tmp_path / "pki"
    shutil.copytree(root, tree)
    daemon = build_daemon(standalone(tree))
    serving = daemon.listener_ssl.context
    crt = tree / "a" / "mvproxy.crt"
    crt.unlink()
    if kind == "fifo":
        os.mkfifo(crt)
    else:
        with open(crt, "wb") as handle:  # sparse: nothing is written to the disk
            handle.truncate(64 * 1024 * 1024)
    try:
        for _ in range(2):
            done = await asyncio.wait_for(asyncio.to_thread(daemon.certificates.check_now), WAIT)
            assert done == []
        assert daemon.metrics.certificate_reload_errors.labels("serving")._value.get() == 1
        assert daemon.listener_ssl.context is serving
    finally:
        if kind == "fifo":  # a check stuck on it (the bug this guards against) ends
            with contextlib.suppress(OSError):
                os.close(os.open(crt, os.O_WRONLY | os.O_NONBLOCK))


def standalone(tree: Path):
    """A configuration of every certificate setting, for a daemon that is built only."""
    from mvproxy.configfile import load_config

    return load_config(None, overrides={
        "serverID": "a", **certificate_settings(tree), "backend.url": "https://127.0.0.1:1",
        "peers.static": [{"serverID": "b", "url": "https://127.0.0.1:2"}]})


# --------------------------------------------------------------------------- end to end


def secret_volume(directory: Path, files: dict[str, Path]) -> None:
    """Kubernetes' layout of a mounted Secret: ``name -> ..data/name``, ``..data`` a
    symlink to a timestamped directory that an update swaps atomically."""
    directory.mkdir(exist_ok=True)
    version = directory / f"..v{len(list(directory.glob('..v*')))}"
    version.mkdir()
    for name, source in files.items():
        shutil.copy(source, version / name)
    link = directory / "..data_tmp"
    link.symlink_to(version.name)
    os.replace(link, directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


async def test_a_running_daemon_notices_a_swapped_secret_by_itself(aiohttp_server, tree, tmp_path):
    secret = tmp_path / "secret"
    secret_volume(secret, {"tls.crt": tree / "a" / "mvproxy.crt",
                           "tls.key": tree / "a" / "mvproxy.key"})
    async with cluster(aiohttp_server, tree, extra={
            "certificates.reloadInterval": "100ms", "tlsCertFile": str(secret / "tls.crt"),
            "tlsPrivateKeyFile": str(secret / "tls.key")}) as c:
        ctx = c.contexts["admin"]
        renewed = tmp_path / "renewed"
        renewed.mkdir()
        (renewed / "a").mkdir()
        for name in ("ca.crt", "ca.key"):
            shutil.copy(tree / name, renewed / name)
        new = issue(renewed, "a/mvproxy", days=50)
        secret_volume(secret, {"tls.crt": renewed / "a" / "mvproxy.crt",
                               "tls.key": renewed / "a" / "mvproxy.key"})

        async def swapped() -> bool:
            return await new_connection_serial(c.port, ctx) == new.serial_number
        await c.until(swapped, "the daemon to serve the renewed certificate")
        assert (await get_once(c.port, ctx))[0] == 200


async def test_every_worker_reloads_on_its_own(backend, tree, tmp_path):
    """``--workers 2``: each worker notices the new file; nothing else changes."""
    proc, port, admin, stop = start_daemon(tree, tmp_path, backend, args=("--workers", "2"),
                                           extra={"certificates": {"reloadInterval": "100ms"}})
    ctx = client_ssl(tree)
    try:
        await wait_ready(admin)
        new = issue(tree, "a/mvproxy", days=60)
        streak = 0  # new connections in a row served the new certificate (both workers)
        async with asyncio.timeout(WAIT):
            while streak < 16:
                streak = streak + 1 if await new_connection_serial(port, ctx) == \
                    new.serial_number else 0
                await asyncio.sleep(0.02)
        assert (await get_once(port, ctx))[0] == 200
        assert proc.poll() is None
    finally:
        log = stop()
    assert "certificates reloaded" in log
    assert proc.returncode == 0
