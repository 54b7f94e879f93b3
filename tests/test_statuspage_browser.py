"""The status page in a real browser (headless Chromium), against a running daemon.

A backend and two peers (the first one hostile: its discovery lists a group whose name
is markup); the page must render every server, run nothing the peer sent, and show the
first peer unreachable once its discovery fails. Screenshots go to the test's tmp
directory and their paths are printed to the terminal even when pytest captures output.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

from browser import chromium, run
from daemon_support import PEER_ID, PODGROUPS, SELF, cluster, ready

HOSTILE_GROUP = "x.evil.io<script>document.title='owned'</script>"
SERVERS = (SELF, PEER_ID, f"{PEER_ID}-0")


def hostile_group() -> dict:
    return {"metadata": {"name": HOSTILE_GROUP}, "versions": [
        {"version": "v1", "freshness": "Current", "resources": [
            {"resource": "widgets", "scope": "Namespaced", "verbs": ["get"],
             "responseKind": {"group": "x", "version": "v1", "kind": "Widget"}}]}]}


class Page(HTMLParser):
    """What a test reads from a dumped DOM: the title, every tag, server rows' text."""

    def __init__(self, dom: str):
        super().__init__()
        self.tags: set[str] = set()
        self.rows: dict[str, str] = {}
        self.title = ""
        self.text = ""
        self._row: str | None = None
        self._in_title = False
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self._in_title = tag == "title"
        if tag == "tr":
            self._row = dict(attrs).get("data-server")
            if self._row is not None:
                self.rows[self._row] = ""

    def handle_endtag(self, tag):
        self._in_title = False
        if tag == "tr":
            self._row = None

    def handle_data(self, data):
        self.text += data + " "
        if self._in_title:
            self.title += data
        if self._row is not None:
            self.rows[self._row] += data + " "


async def test_status_page_in_chromium_shows_peers_and_a_peer_going_down(
        aiohttp_server, root, tmp_path, capsys):
    binary = chromium()
    async with cluster(aiohttp_server, root, extra_peers=1, peer_groups=[hostile_group()],
                       staleAfter="500ms") as c:
        await ready(c)
        status, _, _ = await c.get(PODGROUPS)  # forwarded to a peer: a reroute to show
        assert status == 200
        url = c.admin + "/"
        shots = []

        async def look(name: str) -> Page:
            shot = tmp_path / f"status-{name}.png"
            await run(binary, tmp_path / "profile", f"--screenshot={shot}",
                      "--window-size=1400,2200", url)
            assert shot.stat().st_size > 0
            shots.append(shot)
            return Page(await run(binary, tmp_path / "profile", "--dump-dom", url))

        before = await look("all-up")
        assert before.title == f"mvproxy {SELF}"  # the peer's script did not run
        assert "script" not in before.tags and "img" not in before.tags
        assert set(before.rows) == set(SERVERS)
        for server in SERVERS:
            assert re.search(r"\breachable\b", before.rows[server]), before.rows[server]
            assert "unreachable" not in before.rows[server]
        assert "x.evil.io<script>" in before.rows[PEER_ID]  # shown as text, escaped
        assert re.search(r"scheduling\.k8s\.io\s+v1alpha2\s+podgroups\s+200\s+1\b", before.text)

        c.health["discovery"] = False  # the first peer's discovery answers 500

        async def peer_down() -> bool:
            _, text = await c.admin_get("/debug/mvproxy/peers")
            servers = {s["serverID"]: s for s in json.loads(text)["servers"]}
            return not servers[PEER_ID]["reachable"]
        await c.until(peer_down, "the first peer shown unreachable")

        after = await look("peer-down")
        assert "unreachable" in after.rows[PEER_ID]
        assert "http_status" in after.rows[PEER_ID]  # its last error
        assert "unreachable" not in after.rows[f"{PEER_ID}-0"]
        assert "unreachable" not in after.rows[SELF]
        assert before.rows[PEER_ID] != after.rows[PEER_ID]
    with capsys.disabled():
        print("\nstatus page screenshots:", *map(str, shots))
