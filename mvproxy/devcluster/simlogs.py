"""``pods/log`` for the simulated API server: a few deterministic lines, and ``follow``.

There is no container runtime, so every container "logged" LINES lines, one a second
from the pod's creation; they name the pod and container so a reader can tell whose
log it is. The query options kubectl uses are honoured: ``container`` (with kube's
400s when it is missing on a multi-container pod or names no container of the pod),
``tailLines``, ``timestamps``, ``limitBytes``, ``sinceSeconds`` and ``follow``.

``follow=true`` keeps the chunked response open and writes one new line every
FOLLOW_INTERVAL seconds until the client goes away, the server shuts down
(``on_shutdown``) or FOLLOW_LIMIT seconds have passed: each stream is one bounded loop
in its own request handler, with no task left behind.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web

from . import apistatus

__all__ = ["FOLLOWS", "handle_log", "log_lines", "on_shutdown"]

LINES = 5
FOLLOW_INTERVAL = 1.0  # seconds between two followed lines
FOLLOW_LIMIT = 900.0  # seconds a followed stream stays open at most
FOLLOWS = web.AppKey("sim_log_follows", set)


def _names(pod: dict, key: str) -> list[str]:
    spec = pod.get("spec")
    items = spec.get(key) if isinstance(spec, dict) else None
    if not isinstance(items, list):
        return []
    return [c["name"] for c in items if isinstance(c, dict) and isinstance(c.get("name"), str)]


def pick_container(pod: dict, wanted: str) -> str:
    """kube's rules for ``container``; raises ValueError with its 400 message."""
    name = (pod.get("metadata") or {}).get("name", "")
    containers = _names(pod, "containers")
    if not wanted:
        if len(containers) == 1:
            return containers[0]
        if not containers:
            raise ValueError(f"a container name must be specified for pod {name}")
        message = (f"a container name must be specified for pod {name}, "
                   f"choose one of: [{' '.join(containers)}]")
        init = _names(pod, "initContainers")
        if init:
            message += f" or one of the init containers: [{' '.join(init)}]"
        raise ValueError(message)
    known = containers + _names(pod, "initContainers") + _names(pod, "ephemeralContainers")
    if wanted not in known:
        raise ValueError(f"container {wanted} is not valid for pod {name}")
    return wanted


def _created(pod: dict) -> datetime:
    stamp = (pod.get("metadata") or {}).get("creationTimestamp")
    try:
        return datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return datetime(1970, 1, 1, tzinfo=UTC)


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond * 1000:09d}Z"


def _line(pod: dict, container: str, n: int, at: datetime, timestamps: bool) -> str:
    meta = pod.get("metadata") or {}
    text = (f"[{meta.get('namespace', '')}/{meta.get('name', '')}/{container}] "
            f"simulated log line {n} at {at.strftime('%Y-%m-%dT%H:%M:%SZ')}\n")
    return f"{_stamp(at)} {text}" if timestamps else text


def log_lines(pod: dict, container: str, *, timestamps: bool = False,
              tail: int | None = None, since: datetime | None = None) -> list[str]:
    """The stored part of the log: LINES lines, one a second from the pod's creation."""
    base = _created(pod)
    lines = [(base + timedelta(seconds=i), i) for i in range(1, LINES + 1)]
    if since is not None:
        lines = [(at, i) for at, i in lines if at >= since]
    if tail is not None:
        lines = lines[len(lines) - tail:] if tail else []
    return [_line(pod, container, i, at, timestamps) for at, i in lines]


def _flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name)
    return value is not None and value.lower() not in ("false", "0")


def _non_negative(request: web.Request, name: str) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: Invalid value: {raw!r}: must be an integer") from None
    if value < 0 or (name != "tailLines" and value == 0):
        raise ValueError(f"{name}: Invalid value: {value}: must be greater than "
                         f"{'or equal to ' if name == 'tailLines' else ''}0")
    return value


class _Budget:
    """``limitBytes``: what is left to send (None: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.left = limit

    def take(self, data: bytes) -> bytes:
        if self.left is None:
            return data
        data = data[:self.left]
        self.left -= len(data)
        return data

    @property
    def spent(self) -> bool:
        return self.left is not None and self.left <= 0


async def handle_log(request: web.Request, pod: dict) -> web.StreamResponse:
    try:
        container = pick_container(pod, request.query.get("container", ""))
        tail = _non_negative(request, "tailLines")
        limit = _non_negative(request, "limitBytes")
        since_seconds = _non_negative(request, "sinceSeconds")
    except ValueError as exc:
        return apistatus.bad_request(str(exc))
    if _flag(request, "previous"):
        name = (pod.get("metadata") or {}).get("name", "")
        return apistatus.bad_request(
            f'previous terminated container "{container}" in pod "{name}" not found')
    timestamps = _flag(request, "timestamps")
    since = (datetime.now(UTC) - timedelta(seconds=since_seconds)
             if since_seconds else None)
    budget = _Budget(limit)
    body = budget.take("".join(log_lines(pod, container, timestamps=timestamps, tail=tail,
                                         since=since)).encode())
    if not _flag(request, "follow"):
        return web.Response(body=body, content_type="text/plain")
    response = web.StreamResponse(headers={"Content-Type": "text/plain"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    stop = asyncio.Event()
    follows = request.app.get(FOLLOWS)
    if follows is not None:
        follows.add(stop)
    try:
        if body:
            await response.write(body)
        await _follow(request, response, pod, container, timestamps, budget, stop)
        await response.write_eof()
    except ConnectionError:
        pass  # the client went away
    finally:
        if follows is not None:
            follows.discard(stop)
    return response


async def _follow(request: web.Request, response: web.StreamResponse, pod: dict,
                  container: str, timestamps: bool, budget: _Budget,
                  stop: asyncio.Event) -> None:
    """One line per FOLLOW_INTERVAL until the client leaves, shutdown, limit or budget."""
    n = LINES
    for _ in range(int(FOLLOW_LIMIT / FOLLOW_INTERVAL)):
        if budget.spent or _client_gone(request):
            return
        try:
            await asyncio.wait_for(stop.wait(), FOLLOW_INTERVAL)
            return  # the server is shutting down
        except TimeoutError:
            pass
        if _client_gone(request):
            return
        n += 1
        line = _line(pod, container, n, datetime.now(UTC), timestamps)
        await response.write(budget.take(line.encode()))


def _client_gone(request: web.Request) -> bool:
    transport: Any = request.transport
    return transport is None or transport.is_closing()


async def on_shutdown(app: web.Application) -> None:
    """End every followed log so the server can stop without waiting for clients."""
    for stop in list(app.get(FOLLOWS, ())):
        stop.set()
