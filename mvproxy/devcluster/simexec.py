"""``pods/exec`` and ``pods/attach`` for the simulated API server, over WebSocket or SPDY.

kubectl ≤ 1.30 (and newer ones told so) upgrade to SPDY/3.1 instead, offering
``v4``/``v3``/``v2.channel.k8s.io`` in ``X-Stream-Protocol-Version``; the client opens
one SPDY stream per channel (``streamType`` error/stdin/stdout/stderr/resize) and the
server answers as kubelet does (``_spdy_exec``).

kubectl ≥ 1.31 speaks the ``v5.channel.k8s.io`` WebSocket subprotocol to the API
server (client-go's WebSocket executor); older clients and the Python client use
``v4.channel.k8s.io``. Every binary message starts with a stream id: 0 stdin,
1 stdout, 2 stderr, 3 error (a ``metav1.Status`` JSON that ends the session),
4 resize; v5 adds 255, "close stream <id>", which only the client sends.

There is no container runtime: exec "runs" by echoing (``echo ARGS`` prints ARGS,
``false`` and ``sh -c 'exit N'`` fail with that code, any other command prints its own
command line) and attach prints one line. Then,
as kube-apiserver's stream translator does, the server sends the Success status and
a normal WebSocket close and waits for the client to close. client-go needs that
normal closure (1000) to see EOF on stdout and on the error stream, and it logs
an error for every message on a stream it did not open, so output only goes to
streams the request asked for.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Any

from aiohttp import WSCloseCode, web

from mvproxy.devcluster.apistatus import status_response
from mvproxy.requestinfo import RequestInfo

from .spdysession import Session, Stream, serve_upgrade

__all__ = ["PROTOCOLS", "handle_exec"]

#: Supported subprotocols; the client's order decides (first offered that we know).
PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
#: Stream protocols over SPDY (kubectl < 1.31 offers v4, v3, v2, then channel.k8s.io).
SPDY_PROTOCOLS = ("v4.channel.k8s.io", "v3.channel.k8s.io", "v2.channel.k8s.io")
STREAM_TIMEOUT = 10.0  # seconds for a SPDY client to open the streams it asked for
STDIN, STDOUT, STDERR, ERROR, RESIZE = 0, 1, 2, 3, 4
SUCCESS = {"metadata": {}, "status": "Success"}
CLOSE_TIMEOUT = 10.0  # seconds to wait for the client's close frame
_EXIT = re.compile(r"exit\s+([0-9]{1,3})")


def _flag(request: web.Request, name: str) -> bool:
    """kube's query bool: absent, "false" or "0" is false, anything else true."""
    values = request.query.getall(name, [])
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


def is_spdy(request: web.Request) -> bool:
    connection = [t.strip().lower() for t in request.headers.get("Connection", "").split(",")]
    return request.headers.get("Upgrade", "").lower() == "spdy/3.1" and "upgrade" in connection


def spdy_protocol(request: web.Request, supported: tuple[str, ...]) -> str | None:
    """The first ``X-Stream-Protocol-Version`` the client offers that we support."""
    offered = [p.strip() for value in request.headers.getall("X-Stream-Protocol-Version", ())
               for p in value.split(",")]
    return next((p for p in offered if p in supported), None)


def _precheck(request: web.Request, info: RequestInfo) -> str | None:
    """Why the request cannot start a session (a 400 message), or None."""
    if "upgrade" not in request.headers.get("Connection", "").lower():
        return "Upgrade request required"
    if is_spdy(request):
        if spdy_protocol(request, SPDY_PROTOCOLS) is None:
            return ("unable to upgrade: no supported stream protocol "
                    f"(supports {list(SPDY_PROTOCOLS)})")
    elif not _is_websocket(request):
        return ("only WebSocket and SPDY/3.1 upgrades are supported (subprotocols: "
                + ", ".join(PROTOCOLS) + ")")
    elif not set(_offered(request)) & set(PROTOCOLS):
        return (f"requested protocol(s) are not supported: {_offered(request)}; "
                f"supports {list(PROTOCOLS)}")
    if not any(_flag(request, s) for s in ("stdin", "stdout", "stderr")):
        return "you must specify at least 1 of stdin, stdout, stderr"
    if info.subresource == "exec" and not request.query.getall("command", ()):
        return "you must specify at least 1 command"
    return None


def run(info: RequestInfo, pod_name: str, container: str,
        command: list[str]) -> tuple[bytes, int]:
    """(stdout, exit code) of the pretend command: ``false`` exits 1, ``sh -c 'exit N'``
    exits N (so clients' exit-code handling can be exercised), others are echoed."""
    if info.subresource == "attach":
        return f"attached to {pod_name}/{container}\n".encode(), 0
    if command == ["false"]:
        return b"", 1
    if len(command) == 3 and command[0] in ("sh", "bash", "/bin/sh", "/bin/bash") \
            and command[1] == "-c" and (m := _EXIT.fullmatch(command[2].strip())):
        return b"", int(m.group(1)) % 256
    if command[0] == "echo":
        return (" ".join(command[1:]) + "\n").encode(), 0
    return (" ".join(command) + "\n").encode(), 0


def exit_status(command: list[str], code: int) -> dict[str, Any]:
    """The error-stream Status: Success, or kubelet's NonZeroExitCode failure."""
    if code == 0:
        return SUCCESS
    return {"metadata": {}, "status": "Failure",
            "message": (f"command terminated with non-zero exit code: error executing "
                        f"command {command}, exit code {code}"),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}}


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


async def _send(ws: web.WebSocketResponse, stream: int, data: bytes) -> None:
    await ws.send_bytes(bytes((stream,)) + data)


async def handle_exec(request: web.Request, info: RequestInfo,
                      pod: Mapping[str, Any]) -> web.StreamResponse:
    """Serve one ``pods/exec`` or ``pods/attach`` request for ``pod``."""
    container, problem = _pick_container(request, pod)
    problem = problem or _precheck(request, info)
    if problem:
        return status_response(400, problem)
    if is_spdy(request):
        protocol = spdy_protocol(request, SPDY_PROTOCOLS) or ""
        return await serve_upgrade(request, protocol, lambda session: _spdy_exec(
            session, request, info, pod, container, protocol))
    ws = web.WebSocketResponse(protocols=PROTOCOLS, timeout=CLOSE_TIMEOUT)
    await ws.prepare(request)
    stdout = _flag(request, "stdout")
    # kube announces the session with an empty message on the lowest writable stream.
    first = STDOUT if stdout else STDERR if _flag(request, "stderr") else ERROR
    await _send(ws, first, b"")
    pod_name = (pod.get("metadata") or {}).get("name", "")
    command = request.query.getall("command", [])
    output, code = run(info, pod_name, container, command)
    if stdout and output:
        await _send(ws, STDOUT, output)
    await _send(ws, ERROR, _json(exit_status(command, code)))
    await ws.close(code=WSCloseCode.OK)  # waits for the client's close frame
    return ws


async def _spdy_exec(session: Session, request: web.Request, info: RequestInfo,
                     pod: Mapping[str, Any], container: str, protocol: str) -> None:
    """kubelet's side of SPDY exec: wait for the client's streams, write the output,
    the status (v4: a Status JSON; older: a message only on failure), FIN all."""
    wanted = {"error"} | {s for s in ("stdin", "stdout", "stderr") if _flag(request, s)}
    if _flag(request, "tty") and protocol != "v2.channel.k8s.io":
        wanted.add("resize")
    streams: dict[str, Stream] = {}
    try:
        async with asyncio.timeout(STREAM_TIMEOUT):
            while not wanted <= streams.keys():
                stream = await session.next_stream(STREAM_TIMEOUT)
                if stream is None:
                    return
                streams.setdefault(stream.type, stream)
    except TimeoutError:
        return  # the client never opened its streams: kubelet gives up the same way
    pod_name = (pod.get("metadata") or {}).get("name", "")
    command = request.query.getall("command", [])
    output, code = run(info, pod_name, container, command)
    if "stdout" in streams:
        session.write(streams["stdout"], output)
    for name in ("stdout", "stderr"):
        if name in streams:
            session.write(streams[name], fin=True)
    status = exit_status(command, code)
    if protocol == "v4.channel.k8s.io":
        session.write(streams["error"], _json(status))
    elif code:
        session.write(streams["error"], status["message"].encode())
    session.write(streams["error"], fin=True)
    try:  # client-go closes the connection once it has read the error stream
        await asyncio.wait_for(session.closed.wait(), CLOSE_TIMEOUT)
    except TimeoutError:
        pass
