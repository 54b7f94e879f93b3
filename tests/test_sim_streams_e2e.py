"""Real kubectl and kr8s exec and port-forward against the demo cluster, through an
mvproxy and straight at the simulated kube-apiserver (``-direct``).

kubectl 1.20 only speaks SPDY/3.1 (exec and port-forward); 1.36 speaks WebSocket (v5
exec, SPDY tunnelled in WebSocket for port-forward) and SPDY when told to
(``KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false``, ``KUBECTL_PORT_FORWARD_WEBSOCKETS=false``).
The module's cluster and every kubectl it starts are stopped at teardown.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import kubectl_env
from e2e_support import LineReader, request, stop_popen
from kubectl import kubectl_binary

from mvproxy.devcluster.demo import DemoCluster, start_cluster

CONTEXTS = ["apiserver-0", "apiserver-0-direct"]
CLIENTS = {  # id -> (kubectl minor, extra environment)
    "1.20-spdy": ("1.20", {}),
    "1.36-websocket": ("1.36", {}),
    "1.36-spdy": ("1.36", {"KUBECTL_REMOTE_COMMAND_WEBSOCKETS": "false",
                           "KUBECTL_PORT_FORWARD_WEBSOCKETS": "false"}),
}
RUN_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoCluster]:
    with start_cluster(tmp_path_factory.mktemp("streams-e2e"), ["1.36"],
                       base_port=0) as running:
        made = request(running, "apiserver-0", "POST", "/api/v1/namespaces/default/pods",
                       direct=True, body={"apiVersion": "v1", "kind": "Pod",
                                          "metadata": {"name": "web"},
                                          "spec": {"containers": [{"name": "app",
                                                                   "image": "nginx"}]}})
        assert made.status == 201, made
        yield running


@pytest.fixture(scope="module", params=list(CLIENTS))
def client(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    version, extra = CLIENTS[request.param]
    env = kubectl_env(tmp_path_factory.mktemp("kubectl-home")) | extra
    return kubectl_binary(version), env


def argv(cluster: DemoCluster, binary: Path, context: str, *args: str) -> list[str]:
    return [str(binary), "--kubeconfig", str(cluster.kubeconfig), "--cache-dir",
            str(Path(cluster.kubeconfig).parent / "kubectl-cache"), "--context", context,
            *args]


def run(cluster: DemoCluster, client: tuple[Path, dict[str, str]], context: str,
        *args: str) -> subprocess.CompletedProcess[str]:
    binary, env = client
    return subprocess.run(argv(cluster, binary, context, *args), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, env=env, stdin=subprocess.DEVNULL,
                          check=False)


@pytest.mark.parametrize("context", CONTEXTS)
def test_exec_prints_and_succeeds(cluster: DemoCluster, client, context: str) -> None:
    done = run(cluster, client, context, "exec", "web", "--", "echo", "hi")
    assert (done.returncode, done.stdout) == (0, "hi\n"), done.stderr


@pytest.mark.parametrize("context", CONTEXTS)
def test_exec_exit_code_propagates(cluster: DemoCluster, client, context: str) -> None:
    done = run(cluster, client, context, "exec", "web", "--", "sh", "-c", "exit 3")
    assert done.returncode == 3, done.stderr
    assert "command terminated with exit code 3" in done.stderr


@pytest.mark.parametrize("context", CONTEXTS)
def test_attach_prints_and_ends(cluster: DemoCluster, client, context: str) -> None:
    done = run(cluster, client, context, "attach", "web")
    assert (done.returncode, done.stdout) == (0, "attached to web/app\n"), done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("context", CONTEXTS)
def test_port_forward_reaches_the_pods_http_answer(cluster: DemoCluster, client,
                                                   context: str) -> None:
    binary, env = client
    port = _free_port()
    proc = subprocess.Popen(
        argv(cluster, binary, context, "port-forward", "--address", "127.0.0.1",
             "pod/web", f"{port}:80"),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        stdin=subprocess.DEVNULL)
    reader = LineReader(proc)
    try:
        reader.wait_for(lambda line: line.startswith("Forwarding from"))
        for _ in range(2):  # two connections over the one session
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=20) as answer:
                page = answer.read().decode()
            assert answer.status == 200
            assert "default/web" in page and "port 80" in page
    finally:
        stop_popen(proc, reader)


@pytest.mark.filterwarnings("ignore:Kubernetes version .* is not supported:UserWarning")
@pytest.mark.parametrize("context", CONTEXTS)
def test_kr8s_exec_completes(cluster: DemoCluster, context: str) -> None:
    import kr8s  # noqa: PLC0415 - test extra

    async def go() -> tuple[bytes, int, int]:
        api = await kr8s.asyncio.api(kubeconfig=str(cluster.kubeconfig), context=context)
        pod = await kr8s.asyncio.objects.Pod.get("web", namespace="default", api=api)
        ok = await asyncio.wait_for(pod.exec(["echo", "hi"]), 30)
        failed = await asyncio.wait_for(pod.exec(["false"], check=False), 30)
        return ok.stdout, ok.returncode, failed.returncode

    assert asyncio.run(go()) == (b"hi\n", 0, 1)



@pytest.mark.parametrize("direct", [False, True], ids=["mvproxy", "direct"])
def test_python_client_port_forward_over_the_channel_protocol(cluster: DemoCluster,
                                                              direct: bool) -> None:
    """The ``kubernetes`` client's port-forward: WebSocket ``v4.channel.k8s.io``."""
    from kubernetes import client as k8s  # noqa: PLC0415 - test extra
    from kubernetes.stream import portforward  # noqa: PLC0415

    server = cluster.server("apiserver-0")
    config = k8s.Configuration()
    config.host = server.backend_url if direct else server.proxy_url
    config.ssl_ca_cert = str(cluster.ca)
    config.cert_file = str(cluster.pki / "admin.crt")
    config.key_file = str(cluster.pki / "admin.key")
    with k8s.ApiClient(config) as api:
        forward = portforward(k8s.CoreV1Api(api).connect_get_namespaced_pod_portforward,
                              "web", "default", ports="80", _request_timeout=30)
        try:
            sock = forward.socket(80)
            sock.settimeout(20)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: web\r\n\r\n")
            answer = b""
            while b"</p>" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 OK") and b"port 80" in answer
            sock.close()
        finally:
            forward.close()
