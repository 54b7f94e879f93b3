"""Start, probe and stop the processes of a development control plane.

``ManagedProcess`` runs one command in its own process group with its output in a log
file, waits until a readiness URL (HTTPS or plain HTTP) answers 200, and stops it
(SIGTERM, then SIGKILL) — including every child it spawned. ``SimProcess`` is a ``mvproxy sim``
(a simulated kube-apiserver); the demo and the end-to-end tests build on both, and
``mvproxy run`` processes can use ``ManagedProcess`` directly.
"""

from __future__ import annotations

import csv
import http.client
import io
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

from mvproxy.errors import MvproxyError

StrPath = str | os.PathLike[str]

READY_PROBE_TIMEOUT = 2.0  # one HTTP attempt
READY_POLL_INTERVAL = 0.1  # first pause between attempts; grows to READY_POLL_MAX
READY_POLL_MAX = 0.5
LOG_TAIL_LINES = 40


class ProcessError(MvproxyError):
    """A managed process failed to start, exited early or never became ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_token_file(path: StrPath, tokens: Mapping[str, tuple[str, str, Sequence[str]]]) -> Path:
    """Write a kube-apiserver static token file: ``token,user,uid,"g1,g2"`` per line.

    ``tokens``: token -> (user, uid, groups). Written with mode 0600.
    """
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for token, (user, uid, groups) in tokens.items():
        for what, value in (("token", token), ("user", user), ("uid", uid)):
            if not value or any(c in value for c in "\r\n"):
                raise ValueError(f"{what} must be a non-empty single line, got {value!r}")
        if isinstance(groups, str):
            raise ValueError(f"groups of {user!r} must be a list, not the string {groups!r}")
        row = [token, user, uid]
        if groups:
            row.append(",".join(groups))
        writer.writerow(row)
    target = Path(path)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(buf.getvalue())
    os.chmod(target, 0o600)
    return target


class ManagedProcess:
    """One child process: own process group, output to ``<log_dir>/<name>.log``."""

    def __init__(
        self,
        argv: Sequence[str],
        name: str,
        log_dir: StrPath,
        *,
        ready_url: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        env: Mapping[str, str] | None = None,
        cwd: StrPath | None = None,
    ) -> None:
        self.argv = [str(a) for a in argv]
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.ready_url = ready_url
        self.ssl_context = ssl_context
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONUNBUFFERED", "1")  # so the log tail is current
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> ManagedProcess:
        """Start the command; a process that has exited may be started again."""
        if self.running:
            raise ProcessError(f"{self.name} is already running (pid {self.pid})")
        if self._proc is not None:
            self.stop()  # reap it and anything left in its process group
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen(
                    self.argv, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                    start_new_session=True,  # own process group: stop() reaches children
                )
            except OSError as e:
                raise ProcessError(f"cannot start {self.name} ({self.argv[0]}): {e}") from e
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        try:
            # Valid while the leader is unreaped (poll() returned None just before).
            os.killpg(self._proc.pid, sig)
            if sig == signal.SIGTERM:
                os.killpg(self._proc.pid, signal.SIGCONT)  # a stopped process must see it
        except ProcessLookupError:
            pass
        except PermissionError:
            self._proc.send_signal(sig)

    def terminate(self) -> None:
        """Send SIGTERM to the process group without waiting (see ``stop_all``)."""
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the process group, wait up to ``timeout``, then SIGKILL it."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                proc.wait(timeout)
        # The leader is gone; take down anything it left behind in its group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.returncode

    def kill(self, timeout: float = 10.0) -> int | None:
        """SIGKILL the process group at once (no graceful shutdown), then reap it."""
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGKILL)
        return self.stop(timeout)

    def freeze(self) -> None:
        """SIGSTOP the process group: it keeps its sockets open but answers nothing
        (``resume`` continues it; ``stop`` and ``kill`` work on a frozen process)."""
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the process group after ``freeze``."""
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGCONT)

    def __enter__(self) -> ManagedProcess:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------ readiness

    def probe(self) -> bool:
        """One readiness attempt: does ``ready_url`` answer 200?"""
        if self.ready_url is None:
            return self.running
        url = urlsplit(self.ready_url)
        host = url.hostname or "127.0.0.1"
        port = url.port or (443 if url.scheme == "https" else 80)
        if url.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=READY_PROBE_TIMEOUT,
                context=self.ssl_context or ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(host, port, timeout=READY_PROBE_TIMEOUT)
        path = url.path or "/"
        if url.query:
            path += "?" + url.query
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            return response.status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Return once ready; ProcessError (with the log tail) if it exits or times out."""
        if self._proc is None:
            raise ProcessError(f"{self.name} was not started")
        deadline = time.monotonic() + timeout
        pause = READY_POLL_INTERVAL
        max_attempts = int(timeout / READY_POLL_INTERVAL) + 2
        for _ in range(max_attempts):
            code = self._proc.poll()
            if code is not None:
                raise ProcessError(
                    f"{self.name} exited with code {code} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}")
            if self.probe():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(pause, remaining))
            pause = min(pause * 1.5, READY_POLL_MAX)
        raise ProcessError(
            f"{self.name} not ready at {self.ready_url} after {timeout:g}s; "
            f"log {self.log_path}:\n{self.log_tail()}")


class SimProcess(ManagedProcess):
    """A ``mvproxy sim`` process: a simulated kube-apiserver over TLS.

    Readiness is probed on ``/readyz`` with the cluster CA and the admin certificate
    of the ``mvproxy certs init`` directory ``pki_dir``.
    """

    def __init__(
        self,
        *,
        kubernetes_version: str,
        server_id: str,
        pki_dir: StrPath,
        port: int,
        store: StrPath,
        log_dir: StrPath,
        bind_address: str = "127.0.0.1",
        advertise_address: str | None = None,
        token_auth_file: StrPath | None = None,
        audit_log_path: StrPath | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        pki = Path(pki_dir).absolute()
        argv = [
            sys.executable, "-m", "mvproxy", "sim",
            "--kubernetes-version", kubernetes_version,
            "--server-id", server_id,
            "--pki", str(pki),
            "--secure-port", str(port),
            "--bind-address", bind_address,
            "--store", str(Path(store).absolute()),
        ]
        if advertise_address is not None:
            argv += ["--advertise-address", advertise_address]
        if token_auth_file is not None:
            argv += ["--token-auth-file", str(Path(token_auth_file).absolute())]
        if audit_log_path is not None:
            argv += ["--audit-log-path", str(Path(audit_log_path).absolute())]
        argv += list(extra_args)
        self.kubernetes_version = kubernetes_version
        self.server_id = server_id
        self.port = port
        self.pki_dir = pki
        self.audit_log_path = Path(audit_log_path).absolute() if audit_log_path else None
        self.url = f"https://{_connect_host(bind_address)}:{port}"
        super().__init__(argv, server_id, log_dir, ready_url=f"{self.url}/readyz",
                         ssl_context=None, env=env)

    def admin_context(self) -> ssl.SSLContext:
        from mvproxy.tls import client_context

        return client_context(self.pki_dir / "ca.crt", self.pki_dir / "admin.crt",
                              self.pki_dir / "admin.key")

    def probe(self) -> bool:
        if self.ssl_context is None:
            self.ssl_context = self.admin_context()
        return super().probe()


def stop_all(processes: Sequence[ManagedProcess], timeout: float = 10.0) -> None:
    """Stop several processes at once: SIGTERM to all first, then wait for each.

    Shutdown takes about as long as the slowest process, not the sum. Every process is
    stopped even if stopping one of them raises; the first error is re-raised.
    """
    for process in processes:
        try:
            process.terminate()
        except OSError:
            pass
    first: BaseException | None = None
    for process in processes:
        try:
            process.stop(timeout)
        except BaseException as exc:  # noqa: BLE001 - keep stopping the others
            first = first or exc
    if first is not None:
        raise first


def _connect_host(bind_address: str) -> str:
    """Where to connect for a listener bound to ``bind_address`` (wildcards → loopback)."""
    if bind_address in ("", "0.0.0.0"):
        return "127.0.0.1"
    if bind_address == "::":
        return "[::1]"
    return f"[{bind_address}]" if ":" in bind_address else bind_address


__all__ = [
    "ManagedProcess",
    "ProcessError",
    "SimProcess",
    "free_port",
    "stop_all",
    "write_token_file",
]
