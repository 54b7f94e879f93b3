"""Shared pytest fixtures. Keep each fixture in its own clearly marked section."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

# Fixture modules shared by several test modules (``root``, ``backend``, the simulator's
# ``client``): registered here, so modules need not import fixtures they never call.
# ``leaks``: an autouse fixture fails a test whose event loop still has pending tasks at
# teardown.
pytest_plugins = ("daemon_support", "process_support", "sim_support", "leaks")

# --------------------------------------------------------------------------- kubectl
# A real kubectl (pinned, downloaded once into <repo>/.tools; see tests/kubectl.py).

KubectlRunner = Callable[..., "subprocess.CompletedProcess[str]"]


class KubectlFailed(AssertionError):
    """kubectl exited non-zero where the test expected success; shows what it printed."""


def kubectl_env(home: Path) -> dict[str, str]:
    """The user's environment minus anything that could point kubectl elsewhere."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBECONFIG", "KUBECACHEDIR") and not k.startswith("KUBECTL_")}
    env["HOME"] = str(home)  # no ~/.kube/config or plugin of the machine leaks in
    return env


@pytest.fixture(scope="session")
def kubectl_path() -> Path:
    from kubectl import kubectl_binary  # tests/kubectl.py (tests/ is on sys.path)

    return kubectl_binary("1.36")


@pytest.fixture(scope="session")
def kubectl(kubectl_path: Path, tmp_path_factory: pytest.TempPathFactory) -> KubectlRunner:
    """``kubectl(*args, kubeconfig=..., context=None, timeout=60, check=True)``.

    Runs the real kubectl 1.36 with text output. Its discovery cache lives next to the
    kubeconfig (``<dir>/kubectl-cache``), so clusters of different test modules that
    happen to reuse a port never see each other's cached discovery.
    """
    env = kubectl_env(tmp_path_factory.mktemp("kubectl-home"))

    def argv(*args: str, kubeconfig: str | os.PathLike[str],
             context: str | None = None) -> list[str]:
        cmd = [str(kubectl_path), "--kubeconfig", str(kubeconfig),
               "--cache-dir", str(Path(kubeconfig).parent / "kubectl-cache")]
        if context is not None:
            cmd += ["--context", context]
        return cmd + [str(a) for a in args]

    def run(*args: str, kubeconfig: str | os.PathLike[str], context: str | None = None,
            timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = argv(*args, kubeconfig=kubeconfig, context=context)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=env, stdin=subprocess.DEVNULL, check=False)
        if check and done.returncode != 0:
            raise KubectlFailed(
                f"{' '.join(cmd[1:])} exited {done.returncode}\n"
                f"--- stdout\n{done.stdout}--- stderr\n{done.stderr}")
        return done

    # For tests that need a long-running kubectl (Popen), e.g. a watch:
    run.argv = argv  # type: ignore[attr-defined]
    run.env = env  # type: ignore[attr-defined]
    return run


# --------------------------------------------------------------------------- data-plane listener
# A bare ``listener.Listener`` on 127.0.0.1:0 running a test's handler, closed at teardown.


def _in_task(handler, exchange, conn) -> None:
    from mvproxy.listener import run_in_task

    run_in_task(exchange, conn, handler(exchange))


@pytest.fixture
async def listen():
    """``await listen(handler, ssl_context, limits=None, identity=None) -> port``; an
    ``async def handler(exchange)`` runs in a task per request (``run_in_task``)."""
    from mvproxy.identity import ANONYMOUS_DOWNSTREAM
    from mvproxy.listener import Limits, Listener

    started: list[Listener] = []

    async def start(handler, ssl_context, *, limits=None, identity=None) -> int:
        if asyncio.iscoroutinefunction(handler):  # a test's coroutine handler
            handler = functools.partial(_in_task, handler)
        listener = Listener(handler=handler, limits=limits or Limits(),
                            ssl_context=ssl_context,
                            resolve_identity=identity or (lambda der: ANONYMOUS_DOWNSTREAM),
                            anonymous=ANONYMOUS_DOWNSTREAM)
        started.append(listener)
        return listener.start("127.0.0.1", 0)

    yield start
    for listener in started:
        await listener.close()


# --------------------------------------------------------------------------- reliability report
# ``--reliability-report PATH`` writes what the standing suites tried (tests/reliability.py).


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--reliability-report", metavar="PATH", default=None,
                     help="write the reliability suites' report (markdown) to PATH")


def pytest_sessionstart(session: pytest.Session) -> None:
    import time
    session.config._mvproxy_started = time.monotonic()  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import time
    target = session.config.getoption("--reliability-report")
    if target and exitstatus == 0:
        from reliability import write_report
        write_report(Path(target), time.monotonic() - session.config._mvproxy_started)
