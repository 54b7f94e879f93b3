"""The shared SQLite store: CRUD, selectors, paging, the global resourceVersion, and
watches that see writes from other processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mvproxy.devcluster.store import (
    AlreadyExists,
    Conflict,
    Expired,
    Key,
    NotFound,
    Store,
    WatchEvent,
    parse_field_selector,
    parse_label_selector,
)

REPO = Path(__file__).resolve().parents[1]
CM = ("", "configmaps")


def cm(ns: str, name: str) -> Key:
    return Key(*CM, ns, name)


def obj(labels: dict | None = None, data: dict | None = None, **extra) -> dict:
    o = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"labels": labels or {}}}
    if data is not None:
        o["data"] = data
    o.update(extra)
    return o


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store.db")
    yield s
    s.close()


def run_child(db: Path, code: str) -> subprocess.Popen:
    """Start another Python process that opens the same store file and runs ``code``."""
    prelude = (
        "import sys; from mvproxy.devcluster.store import Store, Key\n"
        f"s = Store({str(db)!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 10) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    return out


async def collect(agen, n: int, timeout: float = 5.0) -> list[WatchEvent]:
    """Take ``n`` events from a watch within ``timeout`` seconds, then close it."""
    got: list[WatchEvent] = []
    try:
        async with asyncio.timeout(timeout):
            async for ev in agen:
                got.append(ev)
                if len(got) == n:
                    break
    finally:
        await agen.aclose()
    return got


# -- CRUD -------------------------------------------------------------------


def test_create_sets_server_metadata(store):
    created = store.create(cm("default", "a"), obj({"x": "1"}, {"k": "v"}))
    meta = created["metadata"]
    assert meta["name"] == "a" and meta["namespace"] == "default"
    assert re.fullmatch(r"[0-9a-f-]{36}", meta["uid"])
    assert meta["resourceVersion"] == str(store.current_resource_version())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["creationTimestamp"])
    assert meta["generation"] == 1
    assert store.get(cm("default", "a")) == created


def test_create_does_not_mutate_input_and_cluster_scoped_has_no_namespace(store):
    given = obj()
    given["metadata"]["namespace"] = "stray"
    created = store.create(Key("", "namespaces", "", "ns1"), given)
    assert "namespace" not in created["metadata"]
    assert given["metadata"] == {"labels": {}, "namespace": "stray"}


def test_already_exists_and_not_found(store):
    store.create(cm("d", "a"), obj())
    with pytest.raises(AlreadyExists):
        store.create(cm("d", "a"), obj())
    with pytest.raises(NotFound):
        store.get(cm("d", "missing"))
    with pytest.raises(NotFound):
        store.update(cm("d", "missing"), obj())
    with pytest.raises(NotFound):
        store.delete(cm("d", "missing"))
    # Same name, other namespace or resource: distinct keys.
    store.create(cm("e", "a"), obj())
    store.create(Key("", "secrets", "d", "a"), obj())


def test_update_keeps_identity_and_bumps_generation_on_spec_change(store):
    created = store.create(cm("d", "a"), obj(spec={"n": 1}))
    changed = dict(created, spec={"n": 2})
    updated = store.update(cm("d", "a"), changed)
    m0, m1 = created["metadata"], updated["metadata"]
    assert m1["uid"] == m0["uid"] and m1["creationTimestamp"] == m0["creationTimestamp"]
    assert int(m1["resourceVersion"]) > int(m0["resourceVersion"])
    assert m1["generation"] == 2
    # Same spec: no bump. Status write: no bump even if spec differs.
    again = store.update(cm("d", "a"), dict(updated, data={"z": "1"}))
    assert again["metadata"]["generation"] == 2
    status = store.update(cm("d", "a"), dict(again, spec={"n": 9}), bump_generation=False)
    assert status["metadata"]["generation"] == 2
    assert store.get(cm("d", "a")) == status


def test_update_without_resource_version_is_unconditional(store):
    store.create(cm("d", "a"), obj())
    updated = store.update(cm("d", "a"), {"metadata": {}, "data": {"k": "v"}})
    assert updated["data"] == {"k": "v"}


def test_update_conflict_on_stale_resource_version(store):
    created = store.create(cm("d", "a"), obj())
    store.update(cm("d", "a"), created)
    with pytest.raises(Conflict):
        store.update(cm("d", "a"), created)


def test_delete_returns_object_with_new_rv_and_checks_precondition(store):
    created = store.create(cm("d", "a"), obj())
    rv = created["metadata"]["resourceVersion"]
    with pytest.raises(Conflict):
        store.delete(cm("d", "a"), expected_resource_version="999")
    deleted = store.delete(cm("d", "a"), expected_resource_version=rv)
    assert deleted["metadata"]["uid"] == created["metadata"]["uid"]
    assert int(deleted["metadata"]["resourceVersion"]) > int(rv)
    assert deleted["metadata"]["resourceVersion"] == str(store.current_resource_version())
    with pytest.raises(NotFound):
        store.get(cm("d", "a"))


# -- list -------------------------------------------------------------------


def test_list_orders_by_namespace_then_name_and_scopes(store):
    for ns, name in [("b", "x"), ("a", "z"), ("a", "y"), ("c", "w")]:
        store.create(cm(ns, name), obj())
    store.create(Key("", "secrets", "a", "s"), obj())
    items, rv, token = store.list(*CM, None)
    assert [(i["metadata"]["namespace"], i["metadata"]["name"]) for i in items] == [
        ("a", "y"), ("a", "z"), ("b", "x"), ("c", "w")]
    assert rv == str(store.current_resource_version()) and token == ""
    items, _, _ = store.list(*CM, "a")
    assert [i["metadata"]["name"] for i in items] == ["y", "z"]


def test_list_pages_with_limit_and_continue(store):
    for i in range(7):
        store.create(cm("d", f"o{i}"), obj())
    first_rv = str(store.current_resource_version())
    page1, rv1, tok = store.list(*CM, "d", limit=3)
    assert rv1 == first_rv and tok
    store.create(cm("e", "later"), obj())  # lands after the pages' keys
    page2, rv2, tok = store.list(*CM, "d", limit=3, continue_token=tok)
    page3, rv3, tok3 = store.list(*CM, "d", limit=3, continue_token=tok)
    names = [o["metadata"]["name"] for o in page1 + page2 + page3]
    assert names == [f"o{i}" for i in range(7)]
    assert (len(page1), len(page2), len(page3)) == (3, 3, 1)
    assert rv2 == rv3 == first_rv  # later pages report the first page's rv
    assert tok3 == ""


def test_list_exact_multiple_of_limit_has_no_trailing_token(store):
    for i in range(4):
        store.create(cm("d", f"o{i}"), obj())
    _, _, tok = store.list(*CM, None, limit=2)
    page2, _, tok2 = store.list(*CM, None, limit=2, continue_token=tok)
    assert len(page2) == 2 and tok2 == ""


def test_limit_counts_only_matching_items(store):
    for i in range(6):
        store.create(cm("d", f"o{i}"), obj({"even": str(i % 2 == 0).lower()}))
    page, _, tok = store.list(*CM, None, label_selector="even=true", limit=2)
    assert [o["metadata"]["name"] for o in page] == ["o0", "o2"]
    page, _, tok = store.list(*CM, None, label_selector="even=true", limit=2, continue_token=tok)
    assert [o["metadata"]["name"] for o in page] == ["o4"] and tok == ""


@pytest.mark.parametrize(
    "token", ["!!!", "bm90IGpzb24=", "e30=", "eyJucyI6MSwibmFtZSI6IngiLCJydiI6MX0="]
)
def test_bad_continue_token(store, token):
    with pytest.raises(ValueError):
        store.list(*CM, None, continue_token=token)


LABELS = {"app": "web", "tier": "front", "env": "prod", "example.com/team": "a", "n": "5"}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("", True),
        ("app=web", True),
        ("app==web", True),
        ("app=db", False),
        ("app!=db", True),
        ("missing!=x", True),
        ("app in (web,db)", True),
        ("app in (db)", False),
        ("app notin (db, cache)", True),
        ("app notin (web)", False),
        ("missing notin (x)", True),
        ("app", True),
        ("missing", False),
        ("!missing", True),
        ("!app", False),
        ("app=web,tier=front", True),
        ("app=web,tier=back", False),
        ("app in (web,db),!missing,env", True),
        ("example.com/team=a", True),
        (" app = web , env in ( prod ) ", True),
        ("n>4", True),
        ("n<5", False),
    ],
)
def test_label_selector(selector, expected):
    assert parse_label_selector(selector)({"metadata": {"labels": LABELS}}) is expected


@pytest.mark.parametrize(
    "selector",
    ["=web", "app in (web", "app in web)", "a,,b", "app=we b", "bad key!=x y",
     "-app", "app=web,", "n>x", "app=(web)", "UPPER/x=y"],
)
def test_label_selector_bad_syntax(selector):
    with pytest.raises(ValueError):
        parse_label_selector(selector)


def test_label_selector_empty_value_and_missing_labels():
    assert parse_label_selector("app=")({"metadata": {"labels": {"app": ""}}})
    assert parse_label_selector("!a")({"metadata": {}})
    assert not parse_label_selector("a")({})


def test_selectors_treat_badly_typed_metadata_as_absent():
    """An object stored with bad labels must not break selectors for everyone else."""
    for bad in ({"metadata": {"labels": "oops"}}, {"metadata": {"labels": ["a"]}},
                {"metadata": "x"}):
        assert not parse_label_selector("app=z")(bad)
        assert parse_label_selector("!app")(bad)
        assert parse_label_selector("app!=z")(bad)
        assert not parse_field_selector("metadata.name=x")(bad)


def test_list_and_watch_survive_a_stored_bad_labels_value(store):
    store.create(cm("d", "bad"), {"metadata": {"labels": "oops"}})
    store.create(cm("d", "good"), obj({"app": "z"}))
    start = store.current_resource_version()
    assert [o["metadata"]["name"] for o in store.list(*CM, None, label_selector="app=z")[0]] \
        == ["good"]

    async def go():
        agen = store.watch(*CM, None, start, label_selector="app=z", poll_interval=0.01)
        store.update(cm("d", "bad"), obj({"app": "z"}))  # prev has the bad labels
        return await collect(agen, 1)

    assert [(e.type, e.object["metadata"]["name"]) for e in asyncio.run(go())] == [
        ("ADDED", "bad")]


def test_field_selector():
    o = {"metadata": {"name": "x", "namespace": "d"}}
    assert parse_field_selector("metadata.name=x")(o)
    assert parse_field_selector("metadata.name==x,metadata.namespace=d")(o)
    assert not parse_field_selector("metadata.name!=x")(o)
    assert not parse_field_selector("metadata.namespace=e")(o)
    with pytest.raises(ValueError, match='"spec.nodeName" is not a known field selector'):
        parse_field_selector("spec.nodeName=n1")
    with pytest.raises(ValueError, match="field label not supported: spec.x"):
        parse_field_selector("spec.x=n1", "", "pods")
    with pytest.raises(ValueError):
        parse_field_selector("metadata.name")


def test_list_with_selectors(store):
    store.create(cm("d", "a"), obj({"app": "web"}))
    store.create(cm("d", "b"), obj({"app": "db"}))
    store.create(cm("e", "a"), obj({"app": "web"}))
    def names(items):
        return [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in items]

    assert names(store.list(*CM, None, label_selector="app=web")[0]) == [("d", "a"), ("e", "a")]
    assert names(store.list(*CM, None, field_selector="metadata.name=b")[0]) == [("d", "b")]
    assert names(store.list(*CM, None, field_selector="metadata.name!=a")[0]) == [("d", "b")]
    with pytest.raises(ValueError, match='"status.phase" is not a known field selector'):
        store.list(*CM, None, field_selector="status.phase=Running")
    with pytest.raises(ValueError):
        store.list(*CM, None, label_selector="app in (web")


def test_delete_collection(store):
    store.create(cm("d", "a"), obj({"app": "web"}))
    store.create(cm("d", "b"), obj({"app": "db"}))
    store.create(cm("d", "c"), obj({"app": "web"}))
    store.create(cm("e", "a"), obj({"app": "web"}))
    before = store.current_resource_version()
    deleted = store.delete_collection(*CM, "d", label_selector="app=web")
    assert [o["metadata"]["name"] for o in deleted] == ["a", "c"]
    assert [int(o["metadata"]["resourceVersion"]) for o in deleted] == [before + 1, before + 2]
    remaining = store.list(*CM, None)[0]
    assert [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in remaining] == [
        ("d", "b"), ("e", "a")]
    assert [e.type for e in store.events_since(*CM, None, before)] == ["DELETED", "DELETED"]
    assert len(store.delete_collection(*CM, None)) == 2
    assert store.list(*CM, None)[0] == []


def test_delete_namespace_contents_removes_every_resource_in_one_namespace(store):
    store.create(cm("d", "a"), obj())
    store.create(Key("scheduling.k8s.io", "podgroups", "d", "pg"), obj())  # any resource
    store.create(Key("apps", "deployments", "d", "web"), obj())
    store.create(cm("e", "a"), obj())
    store.create(Key("", "namespaces", "", "d"), obj())  # cluster-scoped: kept
    before = store.current_resource_version()
    deleted = store.delete_namespace_contents("d")
    assert sorted(o["metadata"]["name"] for o in deleted) == ["a", "pg", "web"]
    assert sorted(int(o["metadata"]["resourceVersion"]) for o in deleted) == [
        before + 1, before + 2, before + 3]
    assert store.list("scheduling.k8s.io", "podgroups", "d")[0] == []
    assert store.list("apps", "deployments", None)[0] == []
    assert [o["metadata"]["namespace"] for o in store.list(*CM, None)[0]] == ["e"]
    assert store.get(Key("", "namespaces", "", "d"))
    # Watchers of any resource (also on other servers) see the deletions.
    events = store.events_since("scheduling.k8s.io", "podgroups", "d", before)
    assert [(e.type, e.object["metadata"]["name"]) for e in events] == [("DELETED", "pg")]
    assert store.delete_namespace_contents("d") == []
    with pytest.raises(ValueError):
        store.delete_namespace_contents("")


# -- resourceVersion and events ---------------------------------------------


def test_rv_sequence_shared_between_store_objects(tmp_path):
    with Store(tmp_path / "s.db") as a, Store(tmp_path / "s.db") as b:
        rvs = []
        for i in range(10):
            s = a if i % 2 else b
            rvs.append(int(s.create(cm("d", f"o{i}"), obj())["metadata"]["resourceVersion"]))
        rvs.append(int(a.update(cm("d", "o0"), obj())["metadata"]["resourceVersion"]))
        deployment = b.create(Key("apps", "deployments", "d", "x"), obj())
        rvs.append(int(deployment["metadata"]["resourceVersion"]))
        rvs.append(int(b.delete(cm("d", "o1"))["metadata"]["resourceVersion"]))
        assert rvs == sorted(set(rvs)) and rvs == list(range(1, 14))
        assert a.current_resource_version() == b.current_resource_version() == 13
        assert b.get(cm("d", "o3"))["metadata"]["name"] == "o3"


def test_events_since_filters_and_orders(store):
    store.create(cm("d", "a"), obj())
    store.create(Key("", "secrets", "d", "s"), obj())
    store.create(cm("e", "b"), obj())
    store.update(cm("d", "a"), obj(data={"k": "v"}))
    store.delete(cm("d", "a"))
    evs = store.events_since(*CM, None, 0)
    assert [(e.type, e.object["metadata"]["name"], e.resource_version) for e in evs] == [
        ("ADDED", "a", 1), ("ADDED", "b", 3), ("MODIFIED", "a", 4), ("DELETED", "a", 5)]
    assert [e.resource_version for e in store.events_since(*CM, "d", 3)] == [4, 5]
    assert store.events_since(*CM, None, 5) == []


def test_expired_after_pruning(tmp_path):
    with Store(tmp_path / "s.db", event_retention=3) as s:
        for i in range(6):
            s.create(cm("d", f"o{i}"), obj())
        # Events 4..6 are retained: from rv 3 is fine, from 2 is too old.
        assert [e.resource_version for e in s.events_since(*CM, None, 3)] == [4, 5, 6]
        with pytest.raises(Expired):
            s.events_since(*CM, None, 2)

        async def go():
            agen = s.watch(*CM, None, 1, poll_interval=0.01)
            with pytest.raises(Expired):
                await agen.__anext__()
            await agen.aclose()

        asyncio.run(go())


def test_watch_from_zero_synthesizes_added_then_streams(store):
    store.create(cm("d", "a"), obj({"app": "web"}))
    store.create(cm("d", "b"), obj({"app": "db"}))

    async def go():
        agen = store.watch(*CM, None, 0, label_selector="app=web", poll_interval=0.01)
        first = await asyncio.wait_for(agen.__anext__(), 2)
        store.create(cm("d", "c"), obj({"app": "web"}))
        rest = await collect(agen, 1)
        return [first, *rest]

    evs = asyncio.run(go())
    assert [(e.type, e.object["metadata"]["name"]) for e in evs] == [("ADDED", "a"), ("ADDED", "c")]


def test_watch_selector_transitions_become_added_and_deleted(store):
    store.create(cm("d", "a"), obj({"app": "db"}))
    start = store.current_resource_version()

    async def go():
        agen = store.watch(*CM, "d", start, label_selector="app=web", poll_interval=0.01)
        store.update(cm("d", "a"), obj({"app": "web"}))   # enters: ADDED
        store.update(cm("d", "a"), obj({"app": "web"}, {"k": "v"}))  # stays: MODIFIED
        store.update(cm("d", "a"), obj({"app": "db"}))    # leaves: DELETED
        store.update(cm("d", "a"), obj({"app": "db"}, {"k": "v"}))   # outside: nothing
        store.create(cm("d", "b"), obj({"app": "web"}))
        return await collect(agen, 4)

    assert [(e.type, e.object["metadata"]["name"]) for e in asyncio.run(go())] == [
        ("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a"), ("ADDED", "b")]


def test_watch_cursor_advances_past_other_resources(tmp_path):
    """A quiet watch must not expire just because other resources are busy."""
    with Store(tmp_path / "s.db", event_retention=5) as s:
        start = s.current_resource_version()

        async def go():
            agen = s.watch(*CM, None, start, poll_interval=0.01)
            task = asyncio.ensure_future(collect(agen, 1))
            for i in range(20):
                s.create(Key("", "secrets", "d", f"s{i}"), obj())
                await asyncio.sleep(0.02)
            s.create(cm("d", "a"), obj())
            return await task

        evs = asyncio.run(go())
        assert [(e.type, e.object["metadata"]["name"]) for e in evs] == [("ADDED", "a")]


def test_watch_progress_reports_the_cursor_after_events_are_taken(store):
    """``progress`` moves past events the selector drops, never past one not yet taken."""
    start = store.current_resource_version()
    taken: list[int] = []
    reports: list[tuple[int, list[int]]] = []  # (cursor, events taken by then)

    async def until(condition):
        async with asyncio.timeout(5):
            while not condition():  # noqa: ASYNC110 - reads the watch task's progress
                await asyncio.sleep(0.01)

    async def go():
        agen = store.watch(*CM, None, start, label_selector="app=web", poll_interval=0.01,
                           progress=lambda rv: reports.append((rv, list(taken))))

        async def consume():
            async for event in agen:
                taken.append(event.resource_version)

        task = asyncio.ensure_future(consume())
        try:
            unmatched = int(store.create(cm("d", "other"), obj({"app": "db"}))
                            ["metadata"]["resourceVersion"])
            await until(lambda: reports and reports[-1][0] >= unmatched)
            assert taken == []  # nothing delivered, yet the cursor moved past it
            wanted = int(store.create(cm("d", "w"), obj({"app": "web"}))
                         ["metadata"]["resourceVersion"])
            await until(lambda: reports[-1][0] >= wanted)
            assert taken == [wanted]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for cursor, seen in reports:
            assert wanted > cursor or wanted in seen

    asyncio.run(go())


# -- several processes --------------------------------------------------------


def test_watch_sees_writes_from_another_process(tmp_path):
    db = tmp_path / "s.db"
    with Store(db) as s:
        start = s.current_resource_version()

        async def go():
            agen = s.watch(*CM, "d", start, poll_interval=0.02)
            child = run_child(db, """
                k = Key("", "configmaps", "d", "x")
                o = s.create(k, {"metadata": {}, "data": {"v": "1"}})
                o["data"] = {"v": "2"}
                s.update(k, o)
                s.delete(k)
                s.close()
            """)
            try:
                evs = await collect(agen, 3, timeout=5)
                finish(child)
            finally:
                if child.poll() is None:
                    child.kill()
                child.communicate()
            return evs

        evs = asyncio.run(go())
    assert [e.type for e in evs] == ["ADDED", "MODIFIED", "DELETED"]
    assert evs[1].object["data"] == {"v": "2"}
    assert [e.resource_version for e in evs] == sorted({e.resource_version for e in evs})


def test_concurrent_writers_from_two_processes(tmp_path):
    db = tmp_path / "s.db"
    Store(db).close()  # create the schema; children also race on (idempotent) init
    code = """
        import os
        me = os.getpid()
        rvs = []
        for i in range(100):
            o = s.create(Key("", "configmaps", "d", f"p{me}-{i}"), {"metadata": {}})
            rvs.append(int(o["metadata"]["resourceVersion"]))
        s.close()
        print(",".join(map(str, rvs)))
    """
    children = [run_child(db, code) for _ in range(2)]
    try:
        outputs = [finish(c, timeout=15) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.communicate()
    per_proc = [[int(x) for x in out.strip().split(",")] for out in outputs]
    for rvs in per_proc:
        assert rvs == sorted(rvs) and len(set(rvs)) == 100
    all_rvs = per_proc[0] + per_proc[1]
    assert sorted(all_rvs) == list(range(1, 201))
    with Store(db) as s:
        items, rv, _ = s.list(*CM, None)
        assert len(items) == 200 and rv == "200"
        assert len({o["metadata"]["uid"] for o in items}) == 200


def test_two_processes_opening_a_fresh_file_at_once(tmp_path):
    db = tmp_path / "fresh.db"
    children = [run_child(db, "print(s.current_resource_version()); s.close()") for _ in range(3)]
    try:
        outputs = [finish(c) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.communicate()
    assert [o.strip() for o in outputs] == ["0", "0", "0"]


def test_objects_are_plain_json(store, tmp_path):
    created = store.create(cm("d", "a"), obj(data={"k": "ü"}))
    assert json.loads(json.dumps(created)) == created
    with pytest.raises(TypeError):
        store.create(cm("d", "b"), {"metadata": {}, "bad": object()})
    with pytest.raises(NotFound):
        store.get(cm("d", "b"))
