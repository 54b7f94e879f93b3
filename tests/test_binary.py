"""The standalone binary (``dev.py binary``): one file with its own interpreter.

Built once per test session (PyInstaller onefile, cached outside the clone by the
digest of its inputs, so an unchanged tree is copied, not rebuilt). Then:

- on this host, under ``env -i``: what the file is, the glibc it needs, where it
  unpacks itself, and that it refuses a place another user could change;
- in a Debian root file system **without Python** (``dev.py rootfs``: ``debootstrap
  --variant=minbase bookworm``, cached), chrooted, under ``env -i``: ``--version``,
  ``check-config`` (exit 0 and 2), ``run`` alone and with ``--workers 2`` in front of
  the fake backend on the host's loopback (a chroot shares the network namespace),
  serving a request with the client's identity, SIGHUP reload, certificate reload,
  draining on SIGTERM; a read-only root with ``TMPDIR`` on a writable directory; and
  in front of a real kube-apiserver when the real-cluster suite's binaries are there.

The chroot is an overlay on the cached tree (nothing is written into the cache) with
/proc mounted; both are unmounted at teardown. Chroot needs root: without it these
tests skip, and under CI (``CI`` set) they fail, as does a build that fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import ssl
import stat
import struct
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from cryptography import x509
from cryptography.x509.oid import NameOID
from pki_support import issue
from process_support import WAIT, admin_get, daemon_config, wait_ready
from scripts_support import script

import mvproxy
from mvproxy import compiled, tls
from mvproxy.devcluster.launcher import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CLEAN_PATH = "PATH=/usr/bin:/bin"
IN_CHROOT = "/usr/local/bin/mvproxy"
PKI = Path("/etc/mvproxy/pki")  # inside the chroot
GLIBC_PROMISED = (2, 36)  # docs/image-and-binary.md: Debian 12's glibc
SIZE_LIMIT = 25_000_000


def _dev():
    return script("dev")


COMPILED_VERSION = f"mvproxy {mvproxy.__version__} (compiled: {', '.join(compiled.MODULES)})"
"""What the binary's ``--version`` says: it carries the compiled core (mypyc, built in its
build venv from the lock's [binary] mypy)."""


def require(condition: bool, why: str) -> None:
    """Skip when ``condition`` fails, except in CI, where it fails the test."""
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI must run these tests)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def binary(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("binary") / "mvproxy"
    try:
        return _dev().build_binary(out)
    except SystemExit as exc:  # no CPython 3.11 with a shared libpython here
        require(False, f"cannot build the binary: {exc}")
        raise


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", **extra}


def run_binary(binary: Path, *args: str, cwd: Path, **env: str):
    return subprocess.run([str(binary), *args], env=_env(**env), cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True)
    path.chmod(0o700)
    return path


# --------------------------------------------------------------------------- the file


def dynamic_strings(elf: bytes) -> tuple[set[str], bytes]:
    """(DT_NEEDED names, the dynamic string table) of a 64-bit little-endian ELF file,
    from its program headers; for the binary, that is the launcher alone, not the
    archive it carries."""
    assert elf[:6] == b"\x7fELF\x02\x01"
    (phoff,) = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        kind, _, offset, vaddr, _, filesz, _, _ = struct.unpack_from(
            "<IIQQQQQQ", elf, phoff + i * phentsize)
        if kind == 1:  # PT_LOAD
            loads.append((vaddr, offset, filesz))
        elif kind == 2:  # PT_DYNAMIC
            dynamic = (offset, filesz)
    assert dynamic is not None, "not dynamically linked"
    entries = [struct.unpack_from("<qQ", elf, dynamic[0] + i)
               for i in range(0, dynamic[1], 16)]
    table = dict((tag, value) for tag, value in entries if tag in (5, 10))  # STRTAB, STRSZ

    def at(vaddr: int) -> int:
        return next(o + vaddr - v for v, o, size in loads if v <= vaddr < v + size)

    strings = elf[at(table[5]):at(table[5]) + table[10]]
    needed = {strings[value:strings.index(b"\0", value)].decode()
              for tag, value in entries if tag == 1}  # DT_NEEDED
    return needed, strings


def glibc_versions(strings: bytes) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in re.findall(rb"GLIBC_(\d+)\.(\d+)", strings)}


def test_the_binary_is_one_elf_executable_that_needs_only_glibc_and_zlib(binary):
    assert os.access(binary, os.X_OK)
    assert binary.stat().st_size < SIZE_LIMIT
    # The launcher's own dynamic dependencies: the C library and zlib, which every
    # Debian-like system has (kind's node image included); nothing of Python.
    needed, _ = dynamic_strings(binary.read_bytes())
    assert needed <= {"libc.so.6", "libdl.so.2", "libz.so.1", "libpthread.so.0"}, needed


def test_version_and_the_simulator_left_out(binary, tmp_path):
    tmp = private_dir(tmp_path / "tmp")
    done = run_binary(binary, "--version", cwd=tmp_path, TMPDIR=str(tmp))
    assert (done.returncode, done.stdout.strip()) == (0, COMPILED_VERSION)
    done = run_binary(binary, "demo", cwd=tmp_path, TMPDIR=str(tmp))
    assert done.returncode == 1 and "contains only the daemon" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp.iterdir()) == []  # each run removes what it unpacked


# --------------------------------------------------------------------------- where it unpacks


@pytest.mark.parametrize("case", ["group-and-world-writable", "inside-a-writable-dir",
                                  "symlink-to-a-writable-dir", "owned-by-another-user"])
def test_a_directory_another_user_could_change_is_refused(binary, tmp_path, case):
    """What an attacker would pre-create, or an operator point TMPDIR at by mistake:
    the binary exits 2 naming the problem, before mvproxy starts."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may rename what is in it
    tmpdir = shared
    if case == "inside-a-writable-dir":
        tmpdir = private_dir(shared / "mine")
    elif case == "symlink-to-a-writable-dir":
        tmpdir = tmp_path / "link"
        tmpdir.symlink_to(shared)
    elif case == "owned-by-another-user":
        if os.geteuid() != 0:
            pytest.skip("needs root to give a directory to another user")
        shared.chmod(0o755)
        os.chown(shared, 65534, 65534)  # nobody's, who may then swap its content
    done = run_binary(binary, "--version", cwd=tmp_path, TMPDIR=str(tmpdir))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "another user could change the code it runs" in done.stderr
    assert "Set TMPDIR" in done.stderr and done.stdout == ""
    why = {"owned-by-another-user": "owned by uid 65534"}.get(
        case, "writable by group or others, and not sticky")
    assert why in done.stderr
    assert not list(Path(tmpdir).resolve().glob("_MEI*"))  # and removed again


@pytest.mark.parametrize("mode", [0o700, 0o1777])
def test_a_private_or_sticky_directory_is_used(binary, tmp_path, mode):
    """0700 (the documented choice) or sticky like /tmp, where nobody else can rename
    or remove the entry the launcher made."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    tmpdir.chmod(mode)
    done = run_binary(binary, "--version", cwd=tmp_path, TMPDIR=str(tmpdir))
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- the Python-less root


@dataclass
class Chroot:
    """A root file system without Python, with the binary at ``/usr/local/bin/mvproxy``
    and the test PKI at ``/etc/mvproxy/pki``."""

    top: Path

    def host(self, inside: str | Path) -> Path:
        """The host path of ``inside`` (an absolute path in the chroot)."""
        return self.top / str(inside).lstrip("/")

    def argv(self, *args: str, env: dict[str, str] | None = None,
             wrap: tuple[str, ...] = ()) -> list[str]:
        assignments = [f"{k}={v}" for k, v in (env or {}).items()]
        return ["chroot", str(self.top), *wrap, "/usr/bin/env", "-i", CLEAN_PATH,
                *assignments, IN_CHROOT, *args]

    def run(self, *args: str, env: dict[str, str] | None = None):
        return subprocess.run(self.argv(*args, env=env), capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)

    def unpacked(self) -> list[Path]:
        return sorted(self.host("/tmp").glob("_MEI*"))


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, timeout=60, capture_output=True)


@pytest.fixture(scope="module")
def rootfs_tree() -> Path:
    require(os.geteuid() == 0, "chroot and debootstrap need root")
    try:
        tree: Path = _dev().build_rootfs()
    except (SystemExit, subprocess.SubprocessError) as exc:
        require(False, f"cannot make the root file system: {exc}")
        raise
    return tree


@pytest.fixture(scope="module")
def chroot(rootfs_tree, binary, root, tmp_path_factory):
    base = tmp_path_factory.mktemp("chroot")
    upper, work, top = base / "upper", base / "work", base / "root"
    for d in (upper, work, top):
        d.mkdir()
    dev = _dev()
    _mount("-t", "overlay", "overlay", "-o",
           f"lowerdir={rootfs_tree},upperdir={upper},workdir={work}", str(top))
    try:
        _mount("-t", "proc", "proc", str(top / "proc"))
        target = top / IN_CHROOT.lstrip("/")
        shutil.copyfile(binary, target)
        target.chmod(0o755)
        shutil.copytree(root, top / str(PKI).lstrip("/"))
        yield Chroot(top)
    finally:
        dev.unmount_under(top)


def test_the_root_has_no_python(chroot, rootfs_tree):
    assert _dev().python_in(rootfs_tree) == []
    done = subprocess.run(["chroot", str(chroot.top), "/usr/bin/env", "-i", CLEAN_PATH,
                           "/bin/sh", "-c", "command -v python3 python3.11 python"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and done.stdout == ""
    assert (chroot.top / "usr/bin/env").exists() and (chroot.top / "bin/sh").exists()


def test_version_in_the_python_less_root(chroot):
    done = chroot.run("--version")
    assert (done.returncode, done.stdout.strip()) == (0, COMPILED_VERSION)
    assert chroot.unpacked() == []


def test_every_subcommand_of_the_image_in_the_python_less_root(chroot):
    """What the container image answers, the binary answers: the daemon's commands,
    a development PKI (cryptography's Rust extension and OpenSSL at work), and the
    simulator's two commands saying they are not in this build."""
    for command in (("run",), ("check-config",), ("certs", "init")):
        done = chroot.run(*command, "--help")
        assert done.returncode == 0 and "usage: mvproxy" in done.stdout, done.stderr
    done = chroot.run("certs", "init", "/root/pki", "--server-id", "a", "--host", "node-a")
    assert done.returncode == 0, done.stderr
    assert (chroot.host("/root/pki/a/mvproxy.crt")).is_file()
    key = chroot.host("/root/pki/a/mvproxy.key")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert chroot.run("sim", "--help").returncode == 0  # argparse needs no simulator
    done = chroot.run("demo")
    assert done.returncode == 1 and "contains only the daemon" in done.stderr
    assert "Traceback" not in done.stderr
    assert chroot.unpacked() == []


def _config(chroot: Chroot, name: str, backend: str, **changes) -> tuple[str, int, int]:
    """Write a configuration into the chroot; (its path there, port, admin port)."""
    port, admin = free_port(), free_port()
    doc = daemon_config(PKI, backend, port, admin)
    doc["timeouts"] = {"shutdownDelay": "0s", "shutdownGracePeriod": "5s"}
    doc.update(changes)
    inside = f"/etc/mvproxy/{name}.yaml"
    chroot.host(inside).write_text(yaml.safe_dump(doc))
    return inside, port, admin


def test_check_config_good_and_bad_in_the_python_less_root(chroot):
    good, _, _ = _config(chroot, "check-good", "https://127.0.0.1:6443")
    done = chroot.run("check-config", good)
    assert done.returncode == 0, done.stdout + done.stderr
    text = chroot.host(good).read_text().replace("pollInterval:", "pollIntervall:")
    chroot.host("/etc/mvproxy/check-bad.yaml").write_text(text)
    done = chroot.run("check-config", "/etc/mvproxy/check-bad.yaml")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "discovery.pollIntervall" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


SLOW = 1.5  # seconds the backend takes for /slow: a request in flight at SIGTERM


@pytest.fixture
async def slow_backend(aiohttp_server, root):
    from daemon_support import fake_server

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(SLOW)
        return web.json_response({"slow": True})

    def routes(app: web.Application) -> None:
        app.router.add_get("/api/v1/namespaces/default/slow", slow)

    server = await aiohttp_server(fake_server("backend", "1.35", routes=routes),
                                  ssl=tls.server_context(root / "a" / "apiserver.crt",
                                                         root / "a" / "apiserver.key",
                                                         root / "front-proxy-ca.crt"))
    return f"https://127.0.0.1:{server.port}"


def _client(root: Path) -> ssl.SSLContext:
    return tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")


def _admin_cn(root: Path) -> str:
    cert = x509.load_pem_x509_certificate((root / "admin.crt").read_bytes())
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


async def _get_json(port: int, ctx: ssl.SSLContext, path: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        async with session.get(f"https://127.0.0.1:{port}{path}",
                               timeout=aiohttp.ClientTimeout(total=WAIT)) as resp:
            return resp.status, await resp.json()


async def _served_serial(port: int, ctx: ssl.SSLContext) -> int:
    _, writer = await asyncio.wait_for(asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1"), WAIT)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return x509.load_der_x509_certificate(der).serial_number
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _until(predicate, what: str) -> None:
    try:
        async with asyncio.timeout(WAIT):
            while not await predicate():  # noqa: ASYNC110 - polls another process
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@contextlib.contextmanager
def _daemon(chroot: Chroot, log_path: Path, *args: str, wrap: tuple[str, ...] = ()):
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(chroot.argv(*args, wrap=wrap), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(WAIT)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


async def _serve_and_drain(chroot: Chroot, root: Path, backend: str, tmp_path: Path,
                           name: str, *args: str, wrap: tuple[str, ...] = ()) -> str:
    """``run`` in the chroot: one request with identity, SIGHUP, a certificate swap,
    then SIGTERM with a request in flight, which completes; exit 0. Its log."""
    config, port, admin = _config(chroot, name, backend,
                                  certificates={"reloadInterval": "200ms"})
    ctx = _client(root)
    log_path = tmp_path / f"{name}.log"
    with _daemon(chroot, log_path, "run", "--config", config, *args, wrap=wrap) as proc:
        try:
            await wait_ready(admin)
            status, echoed = await _get_json(port, ctx, "/api/v1/namespaces")
            assert status == 200 and echoed["server"] == "backend"
            headers = {k.lower(): v for k, v in echoed["headers"]}
            assert headers["x-remote-user"] == _admin_cn(root)
            assert echoed["cn"] == "front-proxy-client"  # mvproxy's own client certificate

            # SIGHUP: a live key changes.
            doc = yaml.safe_load(chroot.host(config).read_text())
            doc["logging"] = {"verbosity": 3}
            chroot.host(config).write_text(yaml.safe_dump(doc))
            proc.send_signal(signal.SIGHUP)

            async def reloaded() -> bool:
                return "reload applied" in log_path.read_text(errors="replace")
            await _until(reloaded, "the reload's log line")

            # Certificate rotation: a new serving certificate, picked up without restart.
            new = issue(chroot.host(PKI), "a/mvproxy", days=40)

            async def swapped() -> bool:
                return await _served_serial(port, ctx) == new.serial_number
            await _until(swapped, "the renewed serving certificate")

            # SIGTERM with a request in flight: it is answered, then the process exits 0.
            slow = asyncio.create_task(_get_json(port, ctx, "/api/v1/namespaces/default/slow"))
            await asyncio.sleep(SLOW / 3)
            proc.send_signal(signal.SIGTERM)
            status, body = await slow
            assert (status, body) == (200, {"slow": True})
            proc.wait(WAIT)
        except BaseException as exc:
            raise AssertionError(log_path.read_text(errors="replace")) from exc
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 0, log
    assert "Traceback" not in log
    assert chroot.unpacked() == [], "the unpacked directory outlived the process"
    return log


async def test_run_serves_reloads_and_drains_in_the_python_less_root(chroot, root,
                                                                     slow_backend, tmp_path):
    log = await _serve_and_drain(chroot, root, slow_backend, tmp_path, "single")
    assert "certificates reloaded" in log


async def test_workers_in_the_python_less_root(chroot, root, slow_backend, tmp_path):
    """``--workers 2``: the workers are the binary itself, reusing its unpacked
    directory, and everything a single process does still holds. Started as systemd
    starts the kind unit: no capabilities, no new privileges."""
    require((chroot.top / "usr/bin/setpriv").exists(), "setpriv (util-linux) in the root")
    wrap = ("/usr/bin/setpriv", "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all")
    config, port, admin = _config(chroot, "workers-probe", slow_backend)
    log_path = tmp_path / "workers-probe.log"
    with _daemon(chroot, log_path, "run", "--config", config, "--workers", "2",
                 wrap=wrap) as proc:
        try:
            await wait_ready(admin)
            status, text = await admin_get(admin, "/metrics")
            assert status == 200 and "mvproxy_workers 2.0" in text
            [launcher_child] = _children(proc.pid)  # the onefile launcher's Python
            workers = _children(launcher_child)
            assert len(workers) == 2
            exe = os.readlink(f"/proc/{proc.pid}/exe")
            assert all(os.readlink(f"/proc/{w}/exe") == exe for w in workers)
            assert len(chroot.unpacked()) == 1  # one unpacked directory for all of them
            [unpacked] = chroot.unpacked()
            assert stat.S_IMODE(unpacked.stat().st_mode) == 0o700
            proc.send_signal(signal.SIGTERM)
            proc.wait(WAIT)
        except BaseException as exc:
            raise AssertionError(log_path.read_text(errors="replace")) from exc
    assert proc.returncode == 0, log_path.read_text(errors="replace")
    log = await _serve_and_drain(chroot, root, slow_backend, tmp_path, "workers",
                                 "--workers", "2", wrap=wrap)
    assert log.count("certificates reloaded") >= 2  # each worker on its own


def test_exit_status_2_for_a_port_in_use_in_the_python_less_root(chroot):
    config, port, _ = _config(chroot, "busy", "https://127.0.0.1:6443")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        for args in ((), ("--workers", "2")):
            done = chroot.run("run", "--config", config, *args)
            assert done.returncode == 2, done.stdout + done.stderr
            assert "cannot listen on 127.0.0.1" in done.stderr
    assert chroot.unpacked() == []


def test_a_read_only_root_works_with_tmpdir_on_a_writable_directory(chroot, tmp_path):
    """As in a container with ``readOnlyRootFilesystem``: /tmp is not writable, so the
    binary needs TMPDIR on a writable private directory (docs/image-and-binary.md: /run/mvproxy)."""
    top = tmp_path / "ro-root"
    top.mkdir()
    _mount("--bind", str(chroot.top), str(top))
    try:
        _mount("-o", "remount,bind,ro", str(top))
        _mount("-t", "proc", "proc", str(top / "proc"))
        _mount("-t", "tmpfs", "-o", "mode=0700,size=128m", "tmpfs", str(top / "run"))
        readonly = Chroot(top)
        done = readonly.run("--version")
        assert done.returncode != 0 and "mvproxy 0" not in done.stdout
        (top / "run" / "mvproxy").mkdir(mode=0o700)
        done = readonly.run("--version", env={"TMPDIR": "/run/mvproxy"})
        assert (done.returncode, done.stdout.strip()) == (0, COMPILED_VERSION)
        config, _, _ = _config(chroot, "ro-check", "https://127.0.0.1:6443")
        done = readonly.run("check-config", config, env={"TMPDIR": "/run/mvproxy"})
        assert done.returncode == 0, done.stdout + done.stderr
        assert list((top / "run" / "mvproxy").iterdir()) == []
    finally:
        _dev().unmount_under(top)


def test_the_glibc_it_needs_is_at_most_the_promised_one(binary, root, tmp_path):
    """Every ELF file it unpacks (libpython, the extension modules, OpenSSL) and the
    launcher: the newest GLIBC_x.y symbol version any of them requires. Read while a
    daemon runs (in front of nothing: it waits for its backend), since each process
    removes what it unpacked when it exits."""
    tmpdir = private_dir(tmp_path / "tmp")
    config = tmp_path / "config.yaml"
    admin = free_port()
    config.write_text(yaml.safe_dump(daemon_config(root, f"https://127.0.0.1:{free_port()}",
                                                   free_port(), admin)))
    proc = subprocess.Popen([str(binary), "run", "--config", str(config)],
                            env=_env(TMPDIR=str(tmpdir)), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:  # up: its admin listener answers
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/livez", timeout=1):
                    break
            time.sleep(0.05)
        assert proc.poll() is None
        files = [p for p in tmpdir.rglob("*.so*") if p.is_file()]
        versions = set()
        for path in [binary, *files]:
            versions |= glibc_versions(dynamic_strings(path.read_bytes())[1])
    finally:
        proc.terminate()
        proc.wait(WAIT)
    assert len(files) > 20, files
    assert versions and max(versions) <= GLIBC_PROMISED, sorted(versions)[-3:]
    assert proc.returncode == 0
    assert list(tmpdir.iterdir()) == []


REAL_VERSION = "1.36.3"


async def test_run_in_front_of_a_real_kube_apiserver_in_the_python_less_root(chroot,
                                                                           tmp_path):
    """With the real-cluster suite's binaries (``dev.py kube-binaries``; a skip without
    them, a failure under CI): one etcd and a real kube-apiserver on the host, the
    binary chrooted in front of it with the member's own configuration and PKI. A
    SelfSubjectReview through it is answered by kube-apiserver with the client
    certificate's user, which only mvproxy's front-proxy headers can have told it."""
    from real_support import require_binaries

    from mvproxy.devcluster.realdemo import start_real_cluster

    binaries = require_binaries([REAL_VERSION])
    cluster = await asyncio.to_thread(start_real_cluster, tmp_path / "real", [REAL_VERSION],
                                      0, binaries=binaries)
    try:
        [server] = cluster.servers
        real = tmp_path / "real"
        inside = Path("/etc/mvproxy/real")
        shutil.copytree(real / "pki", chroot.host(inside / "pki"))
        doc = yaml.safe_load(server.config.read_text())
        port, admin = free_port(server.host), free_port(server.host)
        doc.update(securePort=port, admin={"bindAddress": server.host, "port": admin})
        config = inside / server.id / "mvproxy.yaml"  # its paths are relative to it
        chroot.host(config).parent.mkdir(parents=True)
        chroot.host(config).write_text(yaml.safe_dump(doc))
        ctx = cluster.admin_context()
        log_path = tmp_path / "real-binary.log"
        with _daemon(chroot, log_path, "run", "--config", str(config)) as proc:
            try:
                await _until(lambda: _ready(server.host, admin), "/readyz of the binary")
                review = {"apiVersion": "authentication.k8s.io/v1",
                          "kind": "SelfSubjectReview"}
                connector = aiohttp.TCPConnector(ssl=ctx)
                async with aiohttp.ClientSession(connector=connector) as session:
                    async with session.post(
                            f"https://{server.host}:{port}"
                            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                            json=review, timeout=aiohttp.ClientTimeout(total=WAIT)) as resp:
                        assert resp.status == 201, await resp.text()
                        user = (await resp.json())["status"]["userInfo"]
                    async with session.get(f"https://{server.host}:{port}/version") as resp:
                        version = (await resp.json())["gitVersion"]
                assert user["username"] == _admin_cn(cluster.pki)
                assert version == f"v{REAL_VERSION}"
                proc.send_signal(signal.SIGTERM)
                proc.wait(WAIT)
            except BaseException as exc:
                raise AssertionError(log_path.read_text(errors="replace")) from exc
        assert proc.returncode == 0, log_path.read_text(errors="replace")
    finally:
        await asyncio.to_thread(cluster.stop)


async def _ready(host: str, admin: int) -> bool:
    async with aiohttp.ClientSession() as session:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(f"http://{host}:{admin}/readyz") as resp:
                return resp.status == 200
    return False
