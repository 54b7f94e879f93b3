"""The admin listener's ``/``: one HTML page a person reads during an upgrade.

Rendered on the server from ``status.peers_document`` (a dict, so the ``--workers``
supervisor renders a worker's JSON the same way). Every value goes through
``html.escape``: server IDs, group names and error messages may come from a hostile
peer. The page holds no script at all and refreshes itself with ``<meta refresh>``;
its Content-Security-Policy allows nothing but its own inline stylesheet (by hash),
so even markup that slipped past escaping could not run or load anything.
"""

from __future__ import annotations

import base64
import hashlib
from html import escape

REFRESH_SECONDS = 5

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1b1b;background:#fff}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:.2em .6em;text-align:left;
vertical-align:top}th{background:#f2f2f2}.meta{color:#555}
.up{color:#0a6b0a;font-weight:600}.down{color:#b00020;font-weight:600}
.skew td{background:#fff4d6}.yes{text-align:center}.no{text-align:center;color:#b00020}
.err{font-family:monospace;font-size:12px;max-width:40em;word-break:break-all}
"""

CSP = ("default-src 'none'; style-src 'sha256-"
       + base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()
       + "'; img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store"}


def _e(value: object) -> str:
    return escape("" if value is None else str(value), quote=True)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s ago"


def _version(server: dict) -> str:
    if server.get("kubeVersion"):
        return _e(server["kubeVersion"])
    if not server.get("hasSnapshot"):
        return "unknown (no discovery yet)"
    return f"{int(server.get('groupVersions', 0))} group/versions, " \
           f"{int(server.get('resources', 0))} resources"


def _servers(doc: dict) -> str:
    rows = []
    for s in doc.get("servers", []):
        state = ('<span class="up">reachable</span>' if s.get("reachable")
                 else '<span class="down">unreachable</span>' if s.get("polled")
                 else '<span class="down">not yet polled</span>')
        only = ", ".join(_e(gv) for gv in s.get("onlyHere", [])) or "&mdash;"
        rows.append(
            f'<tr data-server="{_e(s.get("serverID"))}"><td>{_e(s.get("serverID"))}</td>'
            f'<td>{_e(s.get("role"))}</td><td>{_e(s.get("source"))}</td><td>{state}</td>'
            f'<td>{_version(s)}</td><td>{_e(_seconds(s.get("secondsSinceLastPoll")))}</td>'
            f'<td>{_e(_seconds(s.get("snapshotAgeSeconds")))}</td>'
            f'<td class="err">{_e(s.get("lastError")) or "&mdash;"}</td><td>{only}</td></tr>')
    return ("<table id=\"servers\"><tr><th>server</th><th>role</th><th>source</th>"
            "<th>state</th><th>version</th><th>last poll</th><th>snapshot from</th>"
            "<th>last error</th><th>served only here</th></tr>" + "".join(rows) + "</table>")


def _apis(doc: dict) -> str:
    ids = [s.get("serverID") for s in doc.get("servers", [])]
    head = "".join(f"<th>{_e(i)}</th>" for i in ids)
    rows = []
    for api in doc.get("apis", []):
        by = set(api.get("servedBy", []))
        cells = "".join('<td class="yes">&#10003;</td>' if i in by
                        else '<td class="no">&mdash;</td>' for i in ids)
        skew = "" if api.get("everywhere") else ' class="skew"'
        rows.append(f"<tr{skew}><td>{_e(api.get('groupVersion'))}</td>{cells}</tr>")
    uneven = sum(1 for api in doc.get("apis", []) if not api.get("everywhere"))
    note = (f'<p class="meta">{uneven} group/versions are not served by every server '
            "(highlighted); requests for them are forwarded to a server that has them.</p>")
    return (note + '<table id="apis"><tr><th>group/version</th>' + head + "</tr>"
            + "".join(rows) + "</table>")


def _reroutes(doc: dict) -> str:
    rows = doc.get("reroutes", [])
    if not rows:
        return '<p class="meta" id="reroutes">No request has been forwarded to a peer yet.</p>'
    body = "".join(
        f"<tr><td>{_e(r.get('group')) or 'core'}</td><td>{_e(r.get('version'))}</td>"
        f"<td>{_e(r.get('resource'))}</td><td>{_e(r.get('code'))}</td>"
        f"<td>{int(r.get('count', 0))}</td></tr>" for r in rows)
    return ('<table id="reroutes"><tr><th>group</th><th>version</th><th>resource</th>'
            "<th>code</th><th>requests</th></tr>" + body + "</table>")


def _connections(doc: dict) -> str:
    c = doc.get("connections") or {}

    def n(key: str) -> int:
        value = c.get(key, 0)
        return value if isinstance(value, int) else 0
    return (f'<p class="meta" id="connections">From clients: {n("downstreamHTTP1")} '
            f'HTTP/1.1 and {n("downstreamHTTP2")} HTTP/2 connections, the HTTP/2 ones '
            f'carrying {n("downstreamHTTP2Streams")} requests. To the backend and peers '
            f'over HTTP/2: {n("upstreamHTTP2")} connections carrying '
            f'{n("upstreamHTTP2Streams")} requests (the rest use pooled HTTP/1.1).</p>')


def render(doc: dict) -> str:
    """The whole page for one ``peers_document``."""
    servers = doc.get("servers", [])
    down = [s for s in servers if not s.get("reachable")]
    summary = (f"{len(servers)} servers, all reachable" if not down else
               f"{len(servers)} servers, {len(down)} unreachable: "
               + ", ".join(_e(s.get("serverID")) for s in down))
    worker = (f", from worker {int(doc['worker'])}" if isinstance(doc.get("worker"), int)
              else "")
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta http-equiv=\"refresh\" content=\"{REFRESH_SECONDS}\">"
        f"<title>mvproxy {_e(doc.get('serverID'))}</title><style>{_STYLE}</style></head><body>"
        f"<h1>mvproxy {_e(doc.get('serverID'))}</h1>"
        f"<p class=\"meta\" id=\"summary\">{summary}. Discovery "
        f"{'synced' if doc.get('synced') else 'not yet synced'}, cache generation "
        f"{int(doc.get('generation', 0))}{worker}; as of {_e(doc.get('time'))}, refreshed "
        f"every {REFRESH_SECONDS} s. JSON: <a href=\"/debug/mvproxy/peers\">peers</a>, "
        "<a href=\"/debug/mvproxy/route?method=GET&amp;path=/apis\">route</a>, "
        "<a href=\"/metrics\">metrics</a>.</p>"
        f"<h2>Servers</h2>{_servers(doc)}"
        f"<h2>APIs by server</h2>{_apis(doc)}"
        f"<h2>Requests forwarded to peers</h2>{_reroutes(doc)}"
        f"<h2>Connections</h2>{_connections(doc)}"
        "</body></html>\n")
