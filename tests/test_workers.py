"""``mvproxy run --workers N``: processes sharing the port, supervised, adding up.

Real processes: the supervisor and its workers as ``mvproxy run`` starts them, in
front of a fake backend in the test process, with real TLS clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from process_support import WAIT, admin_get, get, start_daemon, wait_ready
from prometheus_client.parser import text_string_to_metric_families

from mvproxy import tls
from mvproxy.configfile import load_config
from mvproxy.workers import Supervisor, Worker


def samples(text: str) -> dict[str, float]:
    """Unlabelled-or-labelled sample name (labels rendered) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def metrics(admin: int) -> dict[str, float]:
    status, text = await admin_get(admin, "/metrics")
    assert status == 200
    return samples(text)


async def worker_pids(admin: int) -> list[int | None]:
    status, text = await admin_get(admin, "/debug/mvproxy")
    assert status == 200
    return [w["pid"] for w in json.loads(text)["workers"]]


async def until(probe, what: str, timeout: float = WAIT):
    async with asyncio.timeout(timeout):
        while not (result := await probe()):  # noqa: ASYNC110 - probes other processes
            await asyncio.sleep(0.1)
    assert result, what
    return result


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not serving either.
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"


async def test_workers_share_the_port_add_up_and_survive_one_dying(backend, root, tmp_path):
    """Connections spread over both workers; a killed worker is replaced, its clients
    alone lose their connections, and the summed counters never go back."""
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, args=("--workers", "2"))
    ctx = tls.client_context(root / "ca.crt", root / "admin.crt", root / "admin.key")
    try:
        await wait_ready(admin)
        status, text = await admin_get(admin, "/readyz?verbose")
        assert status == 200 and "[+]worker-0 ok" in text and "[+]worker-1 ok" in text
        for _ in range(10):
            assert await get(port, ctx) == 200
        before = await metrics(admin)
        assert before['mvproxy_request_duration_seconds_count{route=backend}'] == 10
        assert before["mvproxy_workers"] == 2

        # 24 kept-open connections: the kernel spreads them over the two workers.
        clients = [await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                 server_hostname="127.0.0.1")
                   for _ in range(24)]
        first = (await worker_pids(admin))[0]
        os.kill(first, signal.SIGKILL)
        served = lost = 0
        for reader, writer in clients:
            writer.write(b"GET /api/v1/namespaces HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                answer = await asyncio.wait_for(reader.read(12), WAIT)
            except (ConnectionError, OSError):
                answer = b""
            served, lost = (served + 1, lost) if answer.startswith(b"HTTP/1.1 200") \
                else (served, lost + 1)
            writer.close()
        assert served and lost, (served, lost)  # both workers held some

        await until(lambda: _restarted(admin), "the dead worker was started again")
        await wait_ready(admin)
        after = await metrics(admin)
        assert after['mvproxy_request_duration_seconds_count{route=backend}'] >= 10 + served
        assert after["mvproxy_worker_restarts_total"] == 1
        assert proc.poll() is None
    finally:
        log = stop()
    assert "worker died; starting it again" in log
    assert proc.returncode == 0


async def _restarted(admin: int) -> bool:
    pids = await worker_pids(admin)
    return all(pids) and (await metrics(admin)).get("mvproxy_worker_restarts_total") == 1


async def test_sigterm_drains_and_stops_every_worker(backend, root, tmp_path):
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, args=("--workers", "3"))
    try:
        await wait_ready(admin)
        pids = await worker_pids(admin)
        assert len(pids) == 3 and all(pids)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, WAIT) == 0
        assert not any(alive(pid) for pid in pids)
    finally:
        log = stop()
    assert log.count("shutting down; draining in-flight requests") == 3
    assert "Traceback" not in log


async def test_workers_stop_when_their_supervisor_is_killed(backend, root, tmp_path):
    proc, port, admin, stop = start_daemon(root, tmp_path, backend, args=("--workers", "2"))
    try:
        await wait_ready(admin)
        pids = await worker_pids(admin)
        proc.kill()
        await asyncio.to_thread(proc.wait, WAIT)

        async def gone() -> bool:
            return not any(alive(pid) for pid in pids)
        await until(gone, "workers exited after their supervisor died")
    finally:
        for pid in pids:  # never leave one behind, whatever failed above
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log = stop()
    assert log.count("the supervisor is gone; shutting down") == 2


@pytest.mark.parametrize(("reuse_port", "message"), [
    (False, "cannot listen on 127.0.0.1:{port}"),
    (True, "another process is already serving it"),
], ids=["taken by another program", "shared by another mvproxy"])
async def test_a_port_already_in_use_exits_2(backend, root, tmp_path, reuse_port,
                                             message):
    """A port another program holds cannot be bound; one another instance listens on
    with SO_REUSEPORT could be, and would quietly take half the first one's clients,
    so the supervisor refuses a port something already serves."""
    with socket.socket() as other:
        if reuse_port:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc, _, _, stop = start_daemon(root, tmp_path, backend,
                                        args=("--workers", "2", "--secure-port", str(port)))
        try:
            code = await asyncio.to_thread(proc.wait, WAIT)
        finally:
            log = stop()
    assert code == 2
    assert message.format(port=port) in log


@pytest.mark.parametrize("value", [0, 65, "2"])
def test_a_worker_count_out_of_range_is_named(tmp_path, value):
    config = tmp_path / "config.yaml"
    config.write_text(f"apiVersion: mvproxy.io/v1alpha1\nkind: MvproxyConfiguration\n"
                      f"workers: {json.dumps(value)}\n")
    done = subprocess.run([sys.executable, "-m", "mvproxy", "check-config", str(config)],
                          capture_output=True, text=True, timeout=WAIT)
    assert done.returncode == 2
    assert "workers: must be " in done.stderr, done.stderr


async def test_a_process_squatting_a_workers_socket_is_not_believed(root, tmp_path):
    """The admin sockets are abstract (no file): another local process could bind a
    worker's name first. The supervisor checks who answers (SO_PEERCRED)."""
    cfg = load_config(None, overrides={
        "serverID": "a", "tlsCertFile": str(root / "a" / "mvproxy.crt"),
        "tlsPrivateKeyFile": str(root / "a" / "mvproxy.key"),
        "backend.url": "https://127.0.0.1:1", "workers": 2})
    supervisor = Supervisor(cfg, None, {})
    worker: Worker = supervisor.workers[0]
    worker.process = await asyncio.create_subprocess_exec("sleep", "30")

    answered = asyncio.Event()

    async def forge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.0 200 OK\r\n\r\nok")
        writer.close()
        answered.set()
    squatter = await asyncio.start_unix_server(forge, sock=_abstract_listener(worker.socket_name))
    try:
        status, why = await supervisor.ask(worker, "/readyz")
        await asyncio.wait_for(answered.wait(), WAIT)  # its connection, closed too
    finally:
        squatter.close()
        await squatter.wait_closed()
        worker.process.kill()
        await worker.process.wait()
    assert (status, why) == (0, "another process holds the worker's admin socket")


def _abstract_listener(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name[1:])
    sock.listen()
    return sock
