"""Watch streaming: JSON lines over chunked HTTP, as kube-apiserver sends them.

Semantics kept from kube: no or ``0`` resourceVersion starts with a synthetic ADDED
per current object; a too-old one (older than the retained events, or than the store
when this server started: a kube-apiserver's watch cache holds nothing from before it
started) yields a single ERROR event carrying a 410 ``Expired`` Status (HTTP 200, as
the watch cache answers), then the stream ends; ``allowWatchBookmarks``
adds BOOKMARK events (here every ``bookmark_interval`` seconds, so tests need not
wait a minute); ``sendInitialEvents=true`` ends the initial ADDED burst with the
``k8s.io/initial-events-end`` bookmark that client-go's WatchList waits for;
``timeoutSeconds`` ends the stream. With a Table Accept, each event carries a Table
of one row, column definitions only in the first (kube's NoHeaders after the first).
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from mvproxy.logs import kv

from . import apistatus, tables
from .mediatypes import WATCH_CONVERSIONS, Negotiated, negotiate
from .simobjects import RequestError, Target, check_list_options, present
from .store import Expired, Store, WatchEvent, parse_field_selector, parse_label_selector

log = logging.getLogger(__name__)

#: How often a stream with nothing to say checks that its client is still there.
_LIVENESS_CHECK = 1.0
_INITIAL_EVENTS_END = "k8s.io/initial-events-end"
#: Live watch queues of an application; shutdown wakes them with ``None``.
WATCHES = web.AppKey("sim_watches", set)


def _truthy(value: str | None) -> bool:
    return value is not None and value.lower() not in ("", "0", "false")


class Encoder:
    """Turns store events into watch lines in the negotiated representation."""

    def __init__(self, t: Target, chosen: Negotiated, include: str) -> None:
        self.t, self.chosen, self.include = t, chosen, include
        self.headers_sent = False

    def _object(self, obj: dict) -> dict:
        shown = present(self.t, obj)
        if self.chosen.kind == "Table":
            meta = {"resourceVersion": obj["metadata"].get("resourceVersion", "")}
            doc = tables.table([shown], list_meta=meta, include=self.include,
                               version=self.chosen.version, headers=not self.headers_sent,
                               group=self.t.group, resource=self.t.resource)
            self.headers_sent = True
            return doc
        if self.chosen.kind:
            return tables.partial_metadata(shown, self.chosen.version)
        return shown

    def event(self, type_: str, obj: dict) -> bytes:
        return _line(type_, self._object(obj))

    def bookmark(self, rv: int, *, initial_end: bool = False) -> bytes:
        meta: dict = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {_INITIAL_EVENTS_END: "true"}
        if self.chosen.kind == "Table":
            doc = tables.table([], list_meta=meta, version=self.chosen.version, headers=False)
            return _line("BOOKMARK", doc)
        return _line("BOOKMARK", {"kind": self.t.entry.kind, "apiVersion": self.t.api_version,
                                  "metadata": meta})


def _line(type_: str, obj: dict) -> bytes:
    return (json.dumps({"type": type_, "object": obj}, separators=(",", ":")) + "\n").encode()


def expired_line(exc: Expired) -> bytes:
    status = apistatus.status_body(410, str(exc), reason="Expired")
    return _line("ERROR", status)


def internal_error_line(t: Target) -> bytes:
    """kube's answer when a watch fails inside the server: an ERROR event carrying a 500
    ``InternalError`` Status; the stream then ends and the client re-lists."""
    message = (f"Internal error occurred: watch of "
               f"{apistatus.qualified(t.group, t.resource)} failed")
    status = apistatus.status_body(500, message, reason="InternalError",
                                   details={"causes": [{"message": "watch failed"}]})
    return _line("ERROR", status)


class WatchRequest:
    """The watch options of one request, validated up front (kube: 400 on bad input)."""

    def __init__(self, request: web.Request, t: Target) -> None:
        q = request.query
        self.labels = q.get("labelSelector", "")
        self.fields = q.get("fieldSelector", "")
        if t.path_name:  # legacy /watch/.../<name>
            by_name = f"metadata.name={t.path_name}"
            self.fields = f"{self.fields},{by_name}" if self.fields else by_name
        rv = check_list_options(request, watch=True)
        self.start = rv or None  # unset and 0 both start with the current objects
        try:
            parse_label_selector(self.labels)
            parse_field_selector(self.fields, t.group, t.resource)
            self.timeout = float(q.get("timeoutSeconds") or 0)
        except ValueError as exc:
            raise RequestError(apistatus.bad_request(str(exc))) from None
        self.bookmarks = _truthy(q.get("allowWatchBookmarks"))
        self.initial_events = _truthy(q.get("sendInitialEvents"))
        if self.initial_events:
            self.start = None
        self.include = q.get("includeObject") or "Metadata"


def too_old(start: int, horizon: int) -> Expired:
    """A watch from before this server's history begins (``horizon``: the store's
    resourceVersion when the server started, as a kube-apiserver's watch cache begins
    when it starts)."""
    return Expired(f"too old resource version: {start} ({horizon})")


async def serve(request: web.Request, t: Target, store: Store,
                bookmark_interval: float, horizon: int = 0) -> web.StreamResponse:
    chosen = negotiate(request.headers.get("Accept"), WATCH_CONVERSIONS, allow_stream=True)
    if chosen is None:
        return apistatus.not_acceptable()
    opts = WatchRequest(request, t)
    encoder = Encoder(t, chosen, opts.include)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    if opts.start is not None:
        try:
            if opts.start < horizon:
                raise too_old(opts.start, horizon)
            await asyncio.to_thread(store.events_since, t.group, t.resource, t.scope(),
                                    opts.start)
        except Expired as exc:
            await response.prepare(request)
            await response.write(expired_line(exc))
            await response.write_eof()
            return response
    await response.prepare(request)
    stream = _Stream(request, response, encoder, opts, bookmark_interval)
    try:
        await stream.run(store, t)
        await response.write_eof()
    except ConnectionError:
        pass  # the client went away: nothing left to tell it
    finally:
        stream.close()
    return response


class _Stream:
    """One open watch: a pump task fills a queue; this loop writes, bookmarks, times out."""

    def __init__(self, request: web.Request, response: web.StreamResponse, encoder: Encoder,
                 opts: WatchRequest, bookmark_interval: float) -> None:
        self.request, self.response, self.encoder, self.opts = request, response, encoder, opts
        self.bookmark_interval = bookmark_interval
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.last_rv = 0
        self.pump: asyncio.Task | None = None
        self.registry: set = request.app.get(WATCHES, set())
        self.registry.add(self.queue)

    def close(self) -> None:
        self.registry.discard(self.queue)
        if self.pump is not None:
            self.pump.cancel()

    async def run(self, store: Store, t: Target) -> None:
        start = self.opts.start
        if start is None:
            start = await self._initial(store, t)
        self.last_rv = start
        events = store.watch(t.group, t.resource, t.scope(), start,
                             label_selector=self.opts.labels, field_selector=self.opts.fields,
                             progress=self._advance)
        self.pump = asyncio.create_task(self._fill(events))
        await self._drain()

    async def _initial(self, store: Store, t: Target) -> int:
        items, rv, _ = await asyncio.to_thread(
            store.list, t.group, t.resource, t.scope(),
            label_selector=self.opts.labels, field_selector=self.opts.fields)
        for obj in items:
            await self.response.write(self.encoder.event("ADDED", obj))
        if self.opts.initial_events and self.opts.bookmarks:
            await self.response.write(self.encoder.bookmark(int(rv), initial_end=True))
        return int(rv)

    def _advance(self, resource_version: int) -> None:
        """Called by ``store.watch`` once every event up to ``resource_version`` is queued
        (matching or not): bookmarks may report it, and still never skip an event."""
        self.last_rv = max(self.last_rv, resource_version)

    async def _fill(self, events: AsyncIterator[WatchEvent]) -> None:
        try:
            async for event in events:
                await self.queue.put(self.encoder.event(event.type, event.object))
                self._advance(event.resource_version)
        except Expired as exc:
            await self.queue.put(expired_line(exc))
            await self.queue.put(None)
        except Exception as exc:  # noqa: BLE001 - a dead pump must not leave a silent stream
            t = self.encoder.t
            frames = traceback.extract_tb(exc.__traceback__)
            at = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
            # Type and place only: an exception's message may quote a stored object.
            log.error("watch stream failed", extra=kv(
                resource=apistatus.qualified(t.group, t.resource),
                namespace=t.namespace or "*", error=type(exc).__name__, at=at))
            await self.queue.put(internal_error_line(t))
            await self.queue.put(None)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.opts.timeout if self.opts.timeout > 0 else None
        next_bookmark = loop.time() + self.bookmark_interval if self.opts.bookmarks else None
        while True:
            now = loop.time()
            wake = min(x for x in (deadline, next_bookmark, now + _LIVENESS_CHECK) if x)
            try:
                line = await asyncio.wait_for(self.queue.get(), max(wake - now, 0))
            except TimeoutError:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    return
                if self._client_gone():
                    return
                if next_bookmark is not None and now >= next_bookmark:
                    # The queue is empty, so everything up to last_rv was delivered.
                    await self.response.write(self.encoder.bookmark(self.last_rv))
                    next_bookmark = now + self.bookmark_interval
                continue
            if line is None:
                return
            await self.response.write(line)

    def _client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()


async def on_shutdown(app: web.Application) -> None:
    """End every open watch so the server can stop without waiting for clients."""
    for queue in list(app.get(WATCHES, ())):
        queue.put_nowait(None)
