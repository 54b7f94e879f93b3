"""The shared object store of the simulated control plane: our stand-in for etcd.

Several simulated kube-apiservers, each in its own process, open the same SQLite file
(WAL mode) so that, as with real servers sharing etcd, an object written through one
is read through another, there is ONE resourceVersion sequence, and a watch sees
writes made by any process.

Schema:
- ``meta``: one row; ``rv`` is the global resourceVersion counter, ``pruned_through``
  the newest resourceVersion whose event has been discarded (watch below it → 410).
- ``objects``: the current state, one JSON document per key.
- ``events``: one row per write (rv, key, type, object, previous object), the
  window that watches replay; pruned to the newest ``event_retention`` rows.

Every write is one ``BEGIN IMMEDIATE`` transaction that bumps the counter, writes the
object and appends its event, so two processes never interleave.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins  # Store.list shadows list inside the class body
import json
import os
import re
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone

from . import fieldselectors

__all__ = [
    "AlreadyExists",
    "Conflict",
    "Expired",
    "Key",
    "NotFound",
    "Store",
    "StoreError",
    "WatchEvent",
    "parse_field_selector",
    "parse_label_selector",
]

Predicate = Callable[[dict], bool]


class StoreError(Exception):
    """Base of every error the store raises on purpose."""


class NotFound(StoreError):
    """The key does not exist (kube: 404 NotFound)."""


class AlreadyExists(StoreError):
    """Create of an existing key (kube: 409 AlreadyExists)."""


class Conflict(StoreError):
    """A resourceVersion precondition did not hold (kube: 409 Conflict); ``actual`` is
    the stored object's resourceVersion when known."""

    def __init__(self, message: str, actual: str = "") -> None:
        super().__init__(message)
        self.actual = actual


class Expired(StoreError):
    """The requested resourceVersion is older than the retained events (kube: 410 Gone)."""


@dataclass(frozen=True)
class Key:
    """Address of one object; ``namespace`` is "" for cluster-scoped resources."""

    group: str
    resource: str
    namespace: str
    name: str


@dataclass(frozen=True)
class WatchEvent:
    """One change as a watch delivers it."""

    type: str  # "ADDED" | "MODIFIED" | "DELETED"
    object: dict
    resource_version: int


# ---------------------------------------------------------------------------
# Selectors: pure functions, text -> predicate over an object.
# ---------------------------------------------------------------------------

_LABEL_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY_RE = re.compile(rf"^(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE_RE = re.compile(rf"^(?:{_LABEL_NAME})?$")
_SET_RE = re.compile(r"^(\S+)\s+(in|notin)\s*\((.*)\)$")
_BINARY_RE = re.compile(r"^([^\s=!<>]+)\s*(==|!=|=|<|>)\s*(\S*)$")


def _split_requirements(text: str) -> list[str]:
    """Split on commas that are not inside ``( )``; ``a in (x,y),b`` is two requirements."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced parentheses in selector {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced parentheses in selector {text!r}")
    parts.append(text[start:].strip())
    return parts


def _check_label_key(key: str, req: str) -> None:
    if not _LABEL_KEY_RE.match(key):
        raise ValueError(f"invalid label key {key!r} in selector requirement {req!r}")


def _check_label_value(value: str, req: str) -> None:
    if not _LABEL_VALUE_RE.match(value):
        raise ValueError(f"invalid label value {value!r} in selector requirement {req!r}")


def _label_requirement(req: str) -> Callable[[dict[str, str]], bool]:
    """Parse one requirement into a predicate over a labels mapping."""
    if m := _SET_RE.match(req):
        key, op, body = m.group(1), m.group(2), m.group(3)
        _check_label_key(key, req)
        values = frozenset(v.strip() for v in body.split(","))
        for v in values:
            _check_label_value(v, req)
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if req.startswith("!"):
        key = req[1:].strip()
        _check_label_key(key, req)
        return lambda labels: key not in labels
    if m := _BINARY_RE.match(req):
        key, op, value = m.group(1), m.group(2), m.group(3)
        _check_label_key(key, req)
        if op in ("<", ">"):
            try:
                bound = int(value)
            except ValueError:
                raise ValueError(f"{op} needs an integer value in {req!r}") from None
            return lambda labels: _int_compare(labels.get(key), op, bound)
        _check_label_value(value, req)
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    _check_label_key(req, req)
    return lambda labels: req in labels


def _int_compare(label: str | None, op: str, bound: int) -> bool:
    """``gt``/``lt`` match only labels that parse as integers, as in apimachinery."""
    if label is None:
        return False
    try:
        n = int(label)
    except ValueError:
        return False
    return n > bound if op == ">" else n < bound


def parse_label_selector(text: str) -> Predicate:
    """Parse a kube label selector (``a=b,c!=d,e in (x,y),!f``) into an object predicate.

    All requirements must hold (AND). Empty text matches everything. Bad syntax raises
    ValueError with a message fit for a 400 BadRequest.
    """
    if not text.strip():
        return lambda obj: True
    reqs = []
    for part in _split_requirements(text):
        if not part:
            raise ValueError(f"empty requirement in label selector {text!r}")
        reqs.append(_label_requirement(part))

    def match(obj: dict) -> bool:
        return all(r(_labels_of(obj)) for r in reqs)

    return match


def _metadata_of(obj: dict) -> dict:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _labels_of(obj: dict) -> dict:
    """An object's labels; a badly typed value (stored before validation) counts as none,
    so one bad object cannot break selectors for every client of its resource."""
    labels = _metadata_of(obj).get("labels")
    return labels if isinstance(labels, dict) else {}


def parse_field_selector(text: str, group: str = "", resource: str = "") -> Predicate:
    """Parse a field selector for (``group``, ``resource``) with kube's labels and errors
    (see fieldselectors); ValueError is answered with BadRequest."""
    return fieldselectors.parse(text, group, resource)


def _selector(label_selector: str, field_selector: str, group: str = "",
              resource: str = "") -> Predicate:
    """Combine both selectors; parsing happens once, up front, so errors surface early."""
    labels = parse_label_selector(label_selector)
    fields = parse_field_selector(field_selector, group, resource)
    return lambda obj: labels(obj) and fields(obj)


# ---------------------------------------------------------------------------
# Continue tokens
# ---------------------------------------------------------------------------


def _encode_continue(namespace: str, name: str, rv: int) -> str:
    raw = json.dumps({"ns": namespace, "name": name, "rv": rv}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _decode_continue(token: str) -> tuple[str, str, int]:
    """Inverse of ``_encode_continue``; anything malformed is a ValueError (kube: 400)."""
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        ns, name, rv = data["ns"], data["name"], data["rv"]
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeError) as exc:
        raise ValueError(f"invalid continue token: {exc}") from None
    if not (isinstance(ns, str) and isinstance(name, str) and isinstance(rv, int)):
        raise ValueError("invalid continue token: bad field types")
    return ns, name, rv


# ---------------------------------------------------------------------------
# The store
# ---------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    rv INTEGER NOT NULL,
    pruned_through INTEGER NOT NULL
);
INSERT OR IGNORE INTO meta (id, rv, pruned_through) VALUES (1, 0, 0);
CREATE TABLE IF NOT EXISTS objects (
    grp TEXT NOT NULL, resource TEXT NOT NULL, namespace TEXT NOT NULL, name TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (grp, resource, namespace, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    rv INTEGER PRIMARY KEY,
    grp TEXT NOT NULL, resource TEXT NOT NULL, namespace TEXT NOT NULL, name TEXT NOT NULL,
    type TEXT NOT NULL, data TEXT NOT NULL, prev TEXT
);
"""

_BUSY_TIMEOUT_MS = 5000


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _copy(obj: dict) -> dict:
    """Deep copy through JSON: also proves the object is storable before we write it."""
    return json.loads(json.dumps(obj))


def _scope(namespace: str | None) -> tuple[str, tuple]:
    """SQL fragment and args restricting to one namespace, or none for all namespaces."""
    return ("", ()) if namespace is None else (" AND namespace = ?", (namespace,))


class Store:
    """One process's handle on the shared store file. Thread-safe; cheap to open."""

    def __init__(self, path: str | os.PathLike, *, event_retention: int = 10_000) -> None:
        if event_retention < 1:
            raise ValueError("event_retention must be at least 1")
        self.path = os.fspath(path)
        self.event_retention = event_retention
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            self._init_db()
        except BaseException:
            self._db.close()
            raise

    def _init_db(self) -> None:
        """Pragmas, then the schema in one IMMEDIATE transaction: safe if two processes race."""
        self._db.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
        # Switching to WAL needs a brief exclusive lock; a racing opener can see "locked".
        deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
        while True:
            try:
                self._db.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        self._db.execute("PRAGMA synchronous = NORMAL")
        with self._write() as cur:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    cur.execute(statement)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions ---------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction; BEGIN IMMEDIATE takes the file's write lock up front."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                yield cur
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Cursor]:
        """One read transaction, so several SELECTs see the same snapshot."""
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN")
            try:
                yield cur
            finally:
                cur.execute("COMMIT")

    def _next_rv(self, cur: sqlite3.Cursor) -> int:
        return cur.execute("UPDATE meta SET rv = rv + 1 WHERE id = 1 RETURNING rv").fetchone()[0]

    def _load(self, cur: sqlite3.Cursor, key: Key) -> dict | None:
        row = cur.execute(
            "SELECT data FROM objects WHERE grp=? AND resource=? AND namespace=? AND name=?",
            (key.group, key.resource, key.namespace, key.name),
        ).fetchone()
        return None if row is None else json.loads(row[0])

    def _save(self, cur: sqlite3.Cursor, key: Key, obj: dict) -> None:
        cur.execute(
            "INSERT OR REPLACE INTO objects (grp, resource, namespace, name, data)"
            " VALUES (?, ?, ?, ?, ?)",
            (key.group, key.resource, key.namespace, key.name, json.dumps(obj)),
        )

    def _remove(self, cur: sqlite3.Cursor, key: Key) -> None:
        cur.execute(
            "DELETE FROM objects WHERE grp=? AND resource=? AND namespace=? AND name=?",
            (key.group, key.resource, key.namespace, key.name),
        )

    def _append_event(
        self, cur: sqlite3.Cursor, rv: int, key: Key, type_: str, obj: dict, prev: dict | None
    ) -> None:
        """Record the write for watchers, then drop events that fell out of the window."""
        cur.execute(
            "INSERT INTO events (rv, grp, resource, namespace, name, type, data, prev)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (rv, key.group, key.resource, key.namespace, key.name, type_, json.dumps(obj),
             None if prev is None else json.dumps(prev)),
        )
        horizon = rv - self.event_retention
        if horizon > 0:
            cur.execute("DELETE FROM events WHERE rv <= ?", (horizon,))
            cur.execute(
                "UPDATE meta SET pruned_through = MAX(pruned_through, ?) WHERE id = 1", (horizon,)
            )

    # -- CRUD -----------------------------------------------------------

    def create(self, key: Key, obj: dict) -> dict:
        """Store a new object, filling the metadata the server owns; AlreadyExists if taken."""
        obj = _copy(obj)
        meta = obj.setdefault("metadata", {})
        with self._write() as cur:
            if self._load(cur, key) is not None:
                raise AlreadyExists(f"{_describe(key)} already exists")
            rv = self._next_rv(cur)
            meta["name"] = key.name
            if key.namespace:
                meta["namespace"] = key.namespace
            else:
                meta.pop("namespace", None)
            meta["uid"] = str(uuid.uuid4())
            meta["resourceVersion"] = str(rv)
            meta["creationTimestamp"] = _now()
            meta["generation"] = 1
            self._save(cur, key, obj)
            self._append_event(cur, rv, key, "ADDED", obj, None)
        return obj

    def get(self, key: Key) -> dict:
        with self._read() as cur:
            obj = self._load(cur, key)
        if obj is None:
            raise NotFound(f"{_describe(key)} not found")
        return obj

    def update(self, key: Key, obj: dict, *, bump_generation: bool = True) -> dict:
        """Replace an object. A set resourceVersion is a precondition (optimistic locking).

        uid/creationTimestamp are kept from the stored object; generation moves only when
        ``spec`` changed and ``bump_generation`` (status writes pass False).
        """
        obj = _copy(obj)
        meta = obj.setdefault("metadata", {})
        with self._write() as cur:
            current = self._load(cur, key)
            if current is None:
                raise NotFound(f"{_describe(key)} not found")
            cur_meta = current["metadata"]
            wanted = meta.get("resourceVersion")
            if wanted and str(wanted) != cur_meta["resourceVersion"]:
                raise Conflict(
                    f"Operation cannot be fulfilled on {_describe(key)}: the object has been"
                    " modified; please apply your changes to the latest version and try again"
                )
            rv = self._next_rv(cur)
            generation = cur_meta.get("generation", 1)
            if bump_generation and obj.get("spec") != current.get("spec"):
                generation += 1
            meta["name"] = key.name
            if key.namespace:
                meta["namespace"] = key.namespace
            else:
                meta.pop("namespace", None)
            meta["uid"] = cur_meta["uid"]
            meta["creationTimestamp"] = cur_meta["creationTimestamp"]
            meta["generation"] = generation
            meta["resourceVersion"] = str(rv)
            self._save(cur, key, obj)
            self._append_event(cur, rv, key, "MODIFIED", obj, current)
        return obj

    def delete(self, key: Key, *, expected_resource_version: str = "") -> dict:
        """Remove an object; returns it stamped with the deletion's resourceVersion."""
        with self._write() as cur:
            current = self._load(cur, key)
            if current is None:
                raise NotFound(f"{_describe(key)} not found")
            actual = current["metadata"]["resourceVersion"]
            if expected_resource_version and str(expected_resource_version) != actual:
                raise Conflict(
                    f"Precondition failed for {_describe(key)}: resourceVersion is {actual},"
                    f" not {expected_resource_version}", actual=actual
                )
            return self._delete_in(cur, key, current)

    def _delete_in(self, cur: sqlite3.Cursor, key: Key, current: dict) -> dict:
        rv = self._next_rv(cur)
        current["metadata"]["resourceVersion"] = str(rv)
        self._remove(cur, key)
        self._append_event(cur, rv, key, "DELETED", current, None)
        return current

    def delete_collection(
        self,
        group: str,
        resource: str,
        namespace: str | None,
        *,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[dict]:
        """Delete every matching object in one transaction; each gets its own DELETED event."""
        match = _selector(label_selector, field_selector, group, resource)
        where, args = _scope(namespace)
        with self._write() as cur:
            rows = cur.execute(
                "SELECT namespace, name, data FROM objects WHERE grp=? AND resource=?"
                + where + " ORDER BY namespace, name",
                (group, resource, *args),
            ).fetchall()
            deleted = []
            for ns, name, data in rows:
                obj = json.loads(data)
                if match(obj):
                    deleted.append(self._delete_in(cur, Key(group, resource, ns, name), obj))
        return deleted

    def delete_namespace_contents(self, namespace: str) -> list[dict]:
        """Delete every object stored in ``namespace``, whatever its resource (also those
        only other servers' catalogs serve), in one transaction; each gets its DELETED
        event so every server's watchers see it."""
        if not namespace:
            raise ValueError("delete_namespace_contents needs a namespace")
        with self._write() as cur:
            rows = cur.execute(
                "SELECT grp, resource, name, data FROM objects WHERE namespace = ?"
                " ORDER BY grp, resource, name",
                (namespace,),
            ).fetchall()
            return [self._delete_in(cur, Key(group, resource, namespace, name), json.loads(data))
                    for group, resource, name, data in rows]

    # -- list -----------------------------------------------------------

    def current_resource_version(self) -> int:
        with self._read() as cur:
            return cur.execute("SELECT rv FROM meta WHERE id = 1").fetchone()[0]

    def list(
        self,
        group: str,
        resource: str,
        namespace: str | None,
        *,
        label_selector: str = "",
        field_selector: str = "",
        limit: int = 0,
        continue_token: str = "",
    ) -> tuple[list[dict], str, str]:
        """Matching objects ordered by (namespace, name), the list resourceVersion, and
        a continue token when ``limit`` cut the page short ("" otherwise).

        Later pages read the current state after the token's key but report the first
        page's resourceVersion, so a watch started from it may repeat a change but never
        misses one.
        """
        match = _selector(label_selector, field_selector, group, resource)
        where, args = _scope(namespace)
        list_rv: int | None = None
        if continue_token:
            after_ns, after_name, list_rv = _decode_continue(continue_token)
            where += " AND (namespace, name) > (?, ?)"
            args = (*args, after_ns, after_name)
        items: list[dict] = []
        more = False
        with self._read() as cur:
            current_rv = cur.execute("SELECT rv FROM meta WHERE id = 1").fetchone()[0]
            rows = cur.execute(
                "SELECT data FROM objects WHERE grp=? AND resource=?"
                + where + " ORDER BY namespace, name",
                (group, resource, *args),
            )
            for (data,) in rows:
                obj = json.loads(data)
                if not match(obj):
                    continue
                if limit and len(items) == limit:
                    more = True
                    break
                items.append(obj)
        rv = current_rv if list_rv is None else list_rv
        token = ""
        if more:
            last = items[-1]["metadata"]
            token = _encode_continue(last.get("namespace", ""), last["name"], rv)
        return items, str(rv), token

    # -- events and watch -----------------------------------------------

    def _events_after(
        self, group: str, resource: str, namespace: str | None, resource_version: int
    ) -> tuple[builtins.list[tuple[WatchEvent, dict | None]], int]:
        """Events newer than ``resource_version`` (with each MODIFIED's previous object),
        and the global rv they were read at: a watch's next cursor even when none matched."""
        where, args = _scope(namespace)
        with self._read() as cur:
            current_rv, pruned = cur.execute(
                "SELECT rv, pruned_through FROM meta WHERE id = 1"
            ).fetchone()
            if resource_version < pruned:
                raise Expired(
                    f"too old resource version: {resource_version} ({pruned + 1})"
                )
            rows = cur.execute(
                "SELECT rv, type, data, prev FROM events WHERE rv > ? AND grp=? AND resource=?"
                + where + " ORDER BY rv",
                (resource_version, group, resource, *args),
            ).fetchall()
        events = [
            (WatchEvent(type_, json.loads(data), rv), None if prev is None else json.loads(prev))
            for rv, type_, data, prev in rows
        ]
        return events, current_rv

    def events_since(
        self, group: str, resource: str, namespace: str | None, resource_version: int
    ) -> builtins.list[WatchEvent]:
        """Events with rv > ``resource_version``, oldest first; Expired if already pruned."""
        return [ev for ev, _ in self._events_after(group, resource, namespace, resource_version)[0]]

    async def watch(
        self,
        group: str,
        resource: str,
        namespace: str | None,
        resource_version: int,
        *,
        label_selector: str = "",
        field_selector: str = "",
        poll_interval: float = 0.05,
        progress: Callable[[int], None] | None = None,
    ) -> AsyncIterator[WatchEvent]:
        """Stream changes after ``resource_version``, across processes, by polling.

        ``resource_version`` 0 means "start now": ADDED for every current object first,
        as kube does for an unset rv. With selectors, an object that starts matching
        arrives as ADDED and one that stops matching as DELETED, as in kube. Database
        reads run in a worker thread so the event loop is never held up.

        ``progress`` is called with the cursor after each poll, once every event up to it
        has been yielded (and taken): how far the watch has seen, even where nothing
        matched the selectors, which is what a bookmark may report.
        """
        match = _selector(label_selector, field_selector, group, resource)
        cursor = resource_version
        if resource_version == 0:
            items, list_rv, _ = await asyncio.to_thread(
                self.list, group, resource, namespace,
                label_selector=label_selector, field_selector=field_selector,
            )
            cursor = int(list_rv)
            for obj in items:
                yield WatchEvent("ADDED", obj, int(obj["metadata"]["resourceVersion"]))
        while True:
            events, cursor = await asyncio.to_thread(
                self._events_after, group, resource, namespace, cursor
            )
            for event, prev in events:
                filtered = _filter_event(event, prev, match)
                if filtered is not None:
                    yield filtered
            if progress is not None:
                progress(cursor)
            await asyncio.sleep(poll_interval)


def _filter_event(event: WatchEvent, prev: dict | None, match: Predicate) -> WatchEvent | None:
    """Apply a selector to one event the way kube does for MODIFIED objects that
    enter (ADDED) or leave (DELETED) the selection."""
    now = match(event.object)
    if event.type != "MODIFIED" or prev is None:
        return event if now else None
    before = match(prev)
    if now and before:
        return event
    if now:
        return WatchEvent("ADDED", event.object, event.resource_version)
    if before:
        # As kube's watch cache: the last state the watcher was shown, at the event's rv.
        gone = json.loads(json.dumps(prev))
        _metadata_of(gone)["resourceVersion"] = str(event.resource_version)
        return WatchEvent("DELETED", gone, event.resource_version)
    return None


def _describe(key: Key) -> str:
    resource = f"{key.resource}.{key.group}" if key.group else key.resource
    where = f" in namespace {key.namespace!r}" if key.namespace else ""
    return f'{resource} "{key.name}"{where}'

