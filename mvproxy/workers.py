"""``run --workers N``: N processes serve the secure port together; this one supervises.

Each worker is a whole mvproxy (listener, poller, cache, pools) bound to the same port
with SO_REUSEPORT: the kernel spreads new connections among them and a connection
stays with its worker. Workers share nothing. Each polls discovery itself, so their
views agree within one poll interval, as two kube-apiservers' views do; the backend
and peers see N times the polls and connections.

The supervisor serves the admin listener. ``/metrics`` adds the workers' metrics up
(``metricsmerge``), ``/readyz`` is ready when every worker is, and ``/debug/mvproxy``
lists the workers. ``/debug/mvproxy/peers``, ``/debug/mvproxy/route`` and the status
page ``/`` show the view of the lowest-numbered worker that answers (each worker polls
on its own; their views agree within a poll interval), with reroutes summed over all
workers as ``/metrics`` sums them. It asks each worker over a Unix socket in the
abstract namespace (no file: the root filesystem may be read-only) and checks that the process
answering is that worker. A worker that dies is started again after a back-off (1 s,
doubling to 30 s). A worker that exits with status 2 (bad input, such as a port it
cannot bind) ends the whole process with status 2: a restart cannot fix that.
SIGTERM and SIGHUP are passed on to the workers, which drain or reload as a single
process does; after SIGTERM any still running after the shutdown delay, the grace
period and a margin is killed. A worker whose supervisor dies sees its stdin pipe
close and shuts down too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlencode

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families

from mvproxy.admin import (
    admin_app,
    health_response,
    json_response,
    metrics_app,
    page_response,
)
from mvproxy.config import Config
from mvproxy.errors import UsageError
from mvproxy.logs import kv
from mvproxy.metricsmerge import MetricsMerger
from mvproxy.status import BadQuery, connections, reroutes, route_query

log = logging.getLogger(__name__)

RESTART_FIRST, RESTART_MAX = 1.0, 30.0
"""Seconds before a dead worker is started again: the first time, and at most."""
STEADY = 60.0
"""A worker that ran this long before dying is restarted after RESTART_FIRST again."""
STOP_MARGIN = 5.0
"""Seconds past the grace period a worker may take to exit before it is killed."""
ASK_TIMEOUT = 5.0
"""Seconds to wait for a worker's admin answer."""
EXIT_USAGE = 2


@dataclass
class Worker:
    index: int
    socket_name: str
    """Abstract Unix socket name, ``@``-prefixed as ``ss`` shows it."""
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started: float = 0.0
    last_metrics: str = ""
    """Its last good /metrics text: used while it does not answer, retired when it dies."""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process and self.process.returncode is None else None


@dataclass
class Supervisor:
    config: Config
    config_path: str | None
    overrides: dict[str, object]
    workers: list[Worker] = field(default_factory=list)
    merger: MetricsMerger = field(default_factory=MetricsMerger)
    stopping: bool = False
    exit_code: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        disable_created_metrics()  # as in the workers (``Metrics``)
        if self.config_path:  # absolute once: every worker, restarted ones too, reads it
            self.config_path = os.path.abspath(self.config_path)
        token = secrets.token_hex(8)
        self.workers = [Worker(i, f"@mvproxy-{token}-{i}") for i in range(self.config.workers)]
        self.registry = CollectorRegistry(auto_describe=True)
        self.running_gauge = Gauge("mvproxy_workers", "Worker processes running now.",
                                   registry=self.registry)
        self.running_gauge.set_function(lambda: sum(1 for w in self.workers if w.pid))
        self.restarts = Counter("mvproxy_worker_restarts_total",
                                "Worker processes started again after they died.",
                                registry=self.registry)

    # ---------------------------------------------------------------- processes

    async def start(self, worker: Worker) -> None:
        argv = [*self_command(), "worker", "--overrides",
                json.dumps(self.overrides), "--index", str(worker.index),
                "--admin-socket", worker.socket_name]
        if self.config_path:
            argv += ["--config", self.config_path]
        # stdin: a pipe only we write to; when we die it closes and the worker stops.
        worker.process = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE)
        worker.started = time.monotonic()
        log.info("worker started", extra=kv(worker=worker.index, pid=worker.process.pid))

    async def keep_running(self, worker: Worker) -> None:
        """Start ``worker`` and start it again whenever it dies, until stopping."""
        delay = RESTART_FIRST
        while not self.stopping:
            try:
                await self.start(worker)
            except OSError as exc:  # out of processes or descriptors: try again later
                log.error("cannot start a worker", extra=kv(worker=worker.index,
                                                            error=str(exc)))
                await asyncio.sleep(delay)
                delay = min(RESTART_MAX, delay * 2)
                continue
            assert worker.process is not None
            code = await worker.process.wait()
            if self.stopping:
                return
            self.merger.retire(worker.last_metrics)
            worker.last_metrics = ""
            ran = time.monotonic() - worker.started
            if code == EXIT_USAGE:
                log.error("worker exited with status 2 (bad input); stopping",
                          extra=kv(worker=worker.index))
                self.exit_code = EXIT_USAGE
                self.stop.set()
                return
            delay = RESTART_FIRST if ran >= STEADY else delay
            log.error("worker died; starting it again", extra=kv(
                worker=worker.index, status=code, ran_seconds=round(ran, 1),
                restart_in_seconds=delay))
            await asyncio.sleep(delay)
            delay = min(RESTART_MAX, delay * 2)
            worker.restarts += 1
            self.restarts.inc()

    async def stop_all(self) -> None:
        """SIGTERM to every worker; SIGKILL to any still running after the grace period."""
        self.stopping = True
        live = [w.process for w in self.workers if w.process and w.process.returncode is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(p.wait()) for p in live]
        if not waits:
            return
        timeouts = self.config.timeouts
        _, late = await asyncio.wait(
            waits, timeout=timeouts.shutdown_delay + timeouts.shutdown_grace_period + STOP_MARGIN)
        for process in live:
            if process.returncode is None:
                log.warning("worker did not stop in time; killing it", extra=kv(pid=process.pid))
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        if late:
            await asyncio.wait(late)

    def reload(self) -> None:
        """SIGHUP: each worker re-reads the configuration file itself (``reload``); a
        worker started later reads the new file anyway."""
        for worker in self.workers:
            if worker.process and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGHUP)

    # ---------------------------------------------------------------- asking workers

    async def ask(self, worker: Worker, target: str) -> tuple[int, str]:
        """GET ``target`` from a worker's admin socket; (0, why) if it cannot answer."""
        pid = worker.pid
        if pid is None:
            return 0, "not running"
        try:
            async with asyncio.timeout(ASK_TIMEOUT):
                reader, writer = await _connect_abstract(worker.socket_name)
                try:
                    if _peer_pid(writer) != pid:
                        return 0, "another process holds the worker's admin socket"
                    writer.write(f"GET {target} HTTP/1.0\r\nHost: worker\r\n\r\n".encode())
                    answer = await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as exc:
            return 0, f"no answer: {exc.__class__.__name__}"
        head, _, body = answer.partition(b"\r\n\r\n")
        try:
            status = int(head.split(b" ", 2)[1])
        except (IndexError, ValueError):
            return 0, "an answer that is not HTTP"
        return status, body.decode("utf-8", "replace")

    async def metrics_text(self, worker: Worker) -> str:
        status, text = await self.ask(worker, "/metrics")
        if status == 200:
            worker.last_metrics = text
        return worker.last_metrics

    async def first_answer(self, target: str) -> tuple[int, str, int | None]:
        """(status, body, worker index) from the lowest-numbered worker that answers
        ``target``; (0, why, None) when none does."""
        why = "no worker"
        for worker in self.workers:
            code, text = await self.ask(worker, target)
            if code:
                return code, text, worker.index
            why = f"worker {worker.index}: {text}"
        return 0, why, None

    async def peers_document(self) -> dict | None:
        """A worker's ``/debug/mvproxy/peers`` with every worker's reroutes added up."""
        code, text, index = await self.first_answer("/debug/mvproxy/peers")
        try:
            document = json.loads(text) if code == 200 else None
        except ValueError:
            document = None
        if not isinstance(document, dict):
            return None
        document["worker"] = index
        texts = await asyncio.gather(*(self.metrics_text(w) for w in self.workers))
        merged = self.merger.merge(texts).decode("utf-8", "replace")
        families = list(text_string_to_metric_families(merged))
        document["reroutes"] = reroutes(families)
        document["connections"] = connections(families)
        return document

    # ---------------------------------------------------------------- admin listener

    async def metrics(self, request: web.Request) -> web.Response:
        """``/metrics``: the workers' added up, and the supervisor's own."""
        texts = await asyncio.gather(*(self.metrics_text(w) for w in self.workers))
        body = self.merger.merge(texts) + generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def admin_app(self) -> web.Application:
        metrics = self.metrics

        async def livez(request: web.Request) -> web.Response:
            return health_response(request, request.path.strip("/"), [("ping", True, "")])

        async def readyz(request: web.Request) -> web.Response:
            answers = await asyncio.gather(*(self.ask(w, "/readyz?verbose")
                                             for w in self.workers))
            checks = [("ping", True, "")]
            for worker, (status, text) in zip(self.workers, answers, strict=True):
                failed = [line[3:] for line in text.splitlines() if line.startswith("[-]")]
                why = "; ".join(failed) or text.strip()[:200]
                checks.append((f"worker-{worker.index}", status == 200, why))
            checks.append(("shutdown", not self.stopping, "shutting down"))
            return health_response(request, "readyz", checks)

        async def debug(request: web.Request) -> web.Response:
            answers = await asyncio.gather(*(self.ask(w, "/debug/mvproxy")
                                             for w in self.workers))
            listing = []
            for worker, (status, text) in zip(self.workers, answers, strict=True):
                entry: dict[str, object] = {"index": worker.index, "pid": worker.pid,
                                            "restarts": worker.restarts}
                if status == 200:
                    entry["state"] = json.loads(text)
                else:
                    entry["error"] = text
                listing.append(entry)
            return web.Response(text=json.dumps({"workers": listing}, indent=2) + "\n",
                                content_type="application/json")

        async def peers(request: web.Request) -> web.Response:
            document = await self.peers_document()
            if document is None:
                return json_response({"error": "no worker answered"}, 503)
            return json_response(document)

        async def route(request: web.Request) -> web.Response:
            try:
                wanted = route_query(request.query)
            except BadQuery as exc:
                return json_response({"error": str(exc)}, 400)
            code, text, index = await self.first_answer(
                "/debug/mvproxy/route?" + urlencode(wanted))
            if not code:
                return json_response({"error": "no worker answered"}, 503)
            try:
                document = json.loads(text)
            except ValueError:
                return json_response({"error": "a worker's answer is not JSON"}, 502)
            if code == 200:
                document["worker"] = index
            return json_response(document, code)

        async def page(request: web.Request) -> web.Response:
            document = await self.peers_document()
            if document is None:
                return web.Response(status=503, text="no worker answered\n",
                                    content_type="text/plain")
            return page_response(document)

        return admin_app(page=page, peers=peers, route=route, metrics=metrics,
                         livez=livez, readyz=readyz, debug=debug,
                         allowed_hosts=self.config.admin.allowed_hosts)


def self_command() -> list[str]:
    """How to start mvproxy again: the standalone binary is itself the command (its
    workers reuse the directory it unpacked into), anything else is this interpreter
    with ``-m mvproxy``."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "mvproxy"]


async def _connect_abstract(name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to ``@name`` (uvloop's open_unix_connection refuses abstract names)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, "\0" + name[1:])
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_unix_connection(sock=sock)


def _peer_pid(writer: asyncio.StreamWriter) -> int:
    """The pid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def check_port(host: str, port: int) -> None:
    """Fail early, with status 2, if the secure port is taken. A process that does not
    share it makes the bind fail; one that does (another mvproxy with workers, as the
    same user) would silently get half the clients, so a listener answering there is
    refused too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    target = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    with socket.socket(family, socket.SOCK_STREAM) as knock:
        knock.settimeout(1.0)
        if knock.connect_ex((target, port)) == 0:
            raise UsageError(f"cannot listen on {host}:{port}: another process is "
                             "already serving it")


async def supervise(cfg: Config, config_path: str | None, overrides: dict[str, object]) -> int:
    """Run ``cfg.workers`` workers and the admin listener until SIGTERM or SIGINT."""
    check_port(cfg.bind_address, cfg.secure_port)
    supervisor = Supervisor(cfg, config_path, overrides)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, supervisor.stop.set)
    loop.add_signal_handler(signal.SIGHUP, supervisor.reload)
    runner = web.AppRunner(supervisor.admin_app(), access_log=None, handle_signals=False)
    runners = [runner]
    listen = [(runner, cfg.admin.bind_address, cfg.admin.port)]
    if cfg.admin.metrics_bind_address is not None:
        metrics_only = web.AppRunner(metrics_app(supervisor.metrics,
                                                 allowed_hosts=cfg.admin.allowed_hosts),
                                     access_log=None, handle_signals=False)
        runners.append(metrics_only)
        listen.append((metrics_only, cfg.admin.metrics_bind_address, cfg.admin.metrics_port))
    for serving, host, port in listen:
        await serving.setup()
        try:
            await web.TCPSite(serving, host, port).start()
        except OSError as exc:
            for started in runners:
                await started.cleanup()
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    tasks = [asyncio.create_task(supervisor.keep_running(w), name=f"mvproxy-worker-{w.index}")
             for w in supervisor.workers]
    log.info("supervising workers", extra=kv(server_id=cfg.server_id, workers=cfg.workers,
                                             port=cfg.secure_port,
                                             admin_port=runner.addresses[-1][1]))
    try:
        await supervisor.stop.wait()
        log.info("stopping workers")
        await supervisor.stop_all()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in supervisor.workers:  # on an error above: leave no worker behind
            if worker.process and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
        for serving in runners:
            await serving.cleanup()
    return supervisor.exit_code
