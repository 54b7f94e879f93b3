"""``pods/exec`` and ``pods/attach`` for the simulated API server, over WebSocket.

kubectl ≥ 1.31 speaks the ``v5.channel.k8s.io`` WebSocket subprotocol to the API
server (client-go's WebSocket executor); older clients and the Python client use
``v4.channel.k8s.io``. Every binary message starts with a stream id: 0 stdin,
1 stdout, 2 stderr, 3 error (a ``metav1.Status`` JSON that ends the session),
4 resize; v5 adds 255, "close stream <id>", which only the client sends.

There is no container runtime: exec "runs" by echoing (``echo ARGS`` prints ARGS,
any other command prints its own command line) and attach prints one line. Then,
as kube-apiserver's stream translator does, the server sends the Success status and
a normal WebSocket close and waits for the client to close. client-go needs that
normal closure (1000) to see EOF on stdout and on the error stream, and it logs
an error for every message on a stream it did not open, so output only goes to
streams the request asked for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import WSCloseCode, web

from mvproxy.devcluster.apistatus import status_response
from mvproxy.requestinfo import RequestInfo

__all__ = ["PROTOCOLS", "handle_exec"]

#: Supported subprotocols; the client's order decides (first offered that we know).
PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
STDIN, STDOUT, STDERR, ERROR, RESIZE = 0, 1, 2, 3, 4
SUCCESS = {"metadata": {}, "status": "Success"}
CLOSE_TIMEOUT = 10.0  # seconds to wait for the client's close frame


def _flag(request: web.Request, name: str) -> bool:
    """kube's query bool: absent, "false" or "0" is false, anything else true."""
    values = request.query.getall(name, ())
    return bool(values) and values[0].lower() not in ("false", "0")


def _names(pod: Mapping[str, Any], key: str) -> list[str]:
    return [c.get("name", "") for c in (pod.get("spec") or {}).get(key) or ()]


def _pick_container(request: web.Request, pod: Mapping[str, Any]) -> tuple[str, str | None]:
    """(container, error message): kube's rules for the ``container`` parameter."""
    wanted = request.query.get("container", "")
    pod_name = (pod.get("metadata") or {}).get("name", "")
    containers = _names(pod, "containers")
    if not containers:
        return wanted, None  # the sim's containerless pods accept anything
    if not wanted:
        if len(containers) == 1:
            return containers[0], None
        return "", (f"a container name must be specified for pod {pod_name}, "
                    f"choose one of: [{' '.join(containers)}]")
    known = containers + _names(pod, "initContainers") + _names(pod, "ephemeralContainers")
    if wanted not in known:
        return "", f"container {wanted} is not valid for pod {pod_name}"
    return wanted, None


def _is_websocket(request: web.Request) -> bool:
    connection = [t.strip().lower() for t in request.headers.get("Connection", "").split(",")]
    return request.headers.get("Upgrade", "").lower() == "websocket" and "upgrade" in connection


def _offered(request: web.Request) -> list[str]:
    header = ",".join(request.headers.getall("Sec-WebSocket-Protocol", ()))
    return [p.strip() for p in header.split(",") if p.strip()]


def _precheck(request: web.Request, info: RequestInfo) -> str | None:
    """Why the request cannot start a session (a 400 message), or None."""
    if "upgrade" not in request.headers.get("Connection", "").lower():
        return "Upgrade request required"
    if not _is_websocket(request):
        return "only WebSocket upgrades are supported (subprotocols: " + ", ".join(PROTOCOLS) + ")"
    if not set(_offered(request)) & set(PROTOCOLS):
        return (f"requested protocol(s) are not supported: {_offered(request)}; "
                f"supports {list(PROTOCOLS)}")
    if not any(_flag(request, s) for s in ("stdin", "stdout", "stderr")):
        return "you must specify at least 1 of stdin, stdout, stderr"
    if info.subresource == "exec" and not request.query.getall("command", ()):
        return "you must specify at least 1 command"
    return None


def _output(info: RequestInfo, pod_name: str, container: str, command: list[str]) -> bytes:
    if info.subresource == "attach":
        return f"attached to {pod_name}/{container}\n".encode()
    if command[0] == "echo":
        return (" ".join(command[1:]) + "\n").encode()
    return (" ".join(command) + "\n").encode()


async def _send(ws: web.WebSocketResponse, stream: int, data: bytes) -> None:
    await ws.send_bytes(bytes((stream,)) + data)


async def handle_exec(request: web.Request, info: RequestInfo,
                      pod: Mapping[str, Any]) -> web.StreamResponse:
    """Serve one ``pods/exec`` or ``pods/attach`` request for ``pod``."""
    container, problem = _pick_container(request, pod)
    problem = problem or _precheck(request, info)
    if problem:
        return status_response(400, problem)
    ws = web.WebSocketResponse(protocols=PROTOCOLS, timeout=CLOSE_TIMEOUT)
    await ws.prepare(request)
    stdout = _flag(request, "stdout")
    # kube announces the session with an empty message on the lowest writable stream.
    first = STDOUT if stdout else STDERR if _flag(request, "stderr") else ERROR
    await _send(ws, first, b"")
    if stdout:
        pod_name = (pod.get("metadata") or {}).get("name", "")
        command = request.query.getall("command", [])
        await _send(ws, STDOUT, _output(info, pod_name, container, command))
    await _send(ws, ERROR, json.dumps(SUCCESS, separators=(",", ":")).encode())
    await ws.close(code=WSCloseCode.OK)  # waits for the client's close frame
    return ws
