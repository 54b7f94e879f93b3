"""pods/exec and pods/attach of the simulated API server, over the channel.k8s.io
WebSocket subprotocols that kubectl (v5) and the Python client (v4) speak."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from mvproxy.devcluster.simexec import handle_exec
from mvproxy.requestinfo import parse_request_info

POD = {"metadata": {"name": "web", "namespace": "default"},
       "spec": {"containers": [{"name": "app"}, {"name": "sidecar"}],
                "initContainers": [{"name": "init"}]}}
EXEC = "/api/v1/namespaces/default/pods/web/exec"
ATTACH = "/api/v1/namespaces/default/pods/web/attach"
SUCCESS = {"metadata": {}, "status": "Success"}


async def _handler(request: web.Request) -> web.StreamResponse:
    info = parse_request_info(request.method, request.path, request.query_string)
    return await handle_exec(request, info, POD)


@pytest.fixture
async def client(aiohttp_client: Any) -> Any:
    app = web.Application()
    app.router.add_get(EXEC, _handler)
    app.router.add_post(EXEC, _handler)
    app.router.add_get(ATTACH, _handler)
    return await aiohttp_client(app)


async def session(client: Any, path: str, query: list[tuple[str, str]],
                  protocols: tuple[str, ...]) -> tuple[str | None, dict[int, bytes], int | None]:
    """(negotiated subprotocol, bytes per channel, close code) of one whole session."""
    channels: dict[int, bytes] = {}
    async with client.ws_connect(path, params=query, protocols=protocols) as ws:
        async for msg in ws:
            assert msg.type is WSMsgType.BINARY
            channels[msg.data[0]] = channels.get(msg.data[0], b"") + msg.data[1:]
        return ws.protocol, channels, ws.close_code


def _exec_query(*command: str, container: str = "app") -> list[tuple[str, str]]:
    return [("container", container), ("stdout", "true"), ("stderr", "true"),
            *(("command", c) for c in command)]


@pytest.mark.parametrize("protocol", ["v5.channel.k8s.io", "v4.channel.k8s.io"])
async def test_exec_echo_prints_args_on_stdout_then_success(client: Any, protocol: str) -> None:
    negotiated, channels, code = await session(client, EXEC, _exec_query("echo", "hi"),
                                               (protocol,))
    assert negotiated == protocol
    assert channels[1] == b"hi\n"
    assert json.loads(channels[3]) == SUCCESS
    assert 2 not in channels
    assert code == aiohttp.WSCloseCode.OK


async def test_first_offered_supported_protocol_wins(client: Any) -> None:
    offered = ("base64.channel.k8s.io", "v4.channel.k8s.io", "v5.channel.k8s.io")
    negotiated, _, _ = await session(client, EXEC, _exec_query("echo"), offered)
    assert negotiated == "v4.channel.k8s.io"


async def test_other_commands_are_echoed_as_a_command_line(client: Any) -> None:
    _, channels, _ = await session(client, EXEC, _exec_query("ls", "-l", "/"),
                                   ("v5.channel.k8s.io",))
    assert channels[1] == b"ls -l /\n"


async def test_output_goes_only_to_requested_streams(client: Any) -> None:
    query = [("container", "app"), ("stderr", "1"), ("stdout", "false"),
             ("command", "echo"), ("command", "x")]
    _, channels, _ = await session(client, EXEC, query, ("v5.channel.k8s.io",))
    assert set(channels) == {2, 3}  # stderr only carries kube's empty "ready" message
    assert channels[2] == b""


async def test_attach_writes_a_line_and_succeeds(client: Any) -> None:
    query = [("container", "sidecar"), ("stdout", "true")]
    _, channels, _ = await session(client, ATTACH, query, ("v5.channel.k8s.io",))
    assert channels[1] == b"attached to web/sidecar\n"
    assert json.loads(channels[3]) == SUCCESS


async def test_client_data_and_stream_close_are_tolerated(client: Any) -> None:
    query = [("container", "app"), ("stdin", "true"), ("stdout", "true"), ("command", "cat")]
    async with client.ws_connect(EXEC, params=query, protocols=("v5.channel.k8s.io",)) as ws:
        await ws.send_bytes(b"\x00hello")
        await ws.send_bytes(b"\xff\x00")  # v5: close stdin
        received = [msg.data async for msg in ws]
    assert received[-1][0] == 3


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_non_upgrade_request_is_400_upgrade_request_required(
        client: Any, method: str) -> None:
    resp = await client.request(method, EXEC, params=_exec_query("echo", "hi"))
    assert resp.status == 400
    body = await resp.json()
    assert (body["kind"], body["reason"]) == ("Status", "BadRequest")
    assert body["message"] == "Upgrade request required"


async def test_unsupported_subprotocol_is_400(client: Any) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await client.ws_connect(EXEC, params=_exec_query("echo"),
                                protocols=("channel.k8s.io",))
    assert err.value.status == 400


@pytest.mark.parametrize(("container", "message"), [
    ("nope", "container nope is not valid for pod web"),
    ("", "a container name must be specified for pod web, choose one of: [app sidecar]"),
])
async def test_bad_container_is_400(client: Any, container: str, message: str) -> None:
    resp = await client.get(EXEC, params=_exec_query("echo", container=container),
                            headers={"Connection": "Upgrade", "Upgrade": "websocket"})
    assert resp.status == 400
    assert (await resp.json())["message"] == message


async def test_init_container_is_a_valid_target(client: Any) -> None:
    _, channels, _ = await session(client, EXEC, _exec_query("echo", "ok", container="init"),
                                   ("v5.channel.k8s.io",))
    assert channels[1] == b"ok\n"
