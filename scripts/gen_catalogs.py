#!/usr/bin/env python3
"""Derive mvproxy's compact discovery catalogs from real kube-apiserver documents.

Why: the simulated control plane (``mvproxy.devcluster``) must serve exactly what real
kube-apiservers serve, but the upstream documents are test data, not package data, so
the facts ship compacted (``mvproxy/devcluster/catalogs/1.NN.json``). The source is the
repository's copy in ``tests/data/k8s-discovery`` (see its README for provenance); a
document may be stored gzipped (``NAME.gz``): index.json's sha256 is of the plain bytes.

* One catalog per minor release 1.31 .. 1.37, from the newest snapshot of its dev
  cycle (``index.json`` lists each cycle's snapshots oldest first, so the last wins).
* The ``/apis`` groups come from that snapshot's ``aggregated_v2.json``, in order.
* The core group (``""``, ``v1``) comes from ``legacy-core-*/api__v1.json``: the only
  stored ``/api/v1`` document, from one recent release, plus what real servers of the
  release list that it lacks (``CORE_ADDITIONS``: ``pods/resize`` from 1.33, listed by
  real kube-apiserver 1.35.4 and 1.36.3); each catalog says so in ``coreSource.note``.

Nothing is dropped silently: an unexpected field, a non-empty top-level responseKind
group/version or a non-Current freshness stops the run. Output is deterministic
(byte-identical on rerun); ``tests/test_catalog.py`` checks the committed catalogs.

Usage: scripts/gen_catalogs.py [SOURCE_DIR] [--out DIR]   (stdlib only)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO / "tests" / "data" / "k8s-discovery"
DEFAULT_OUT = REPO / "mvproxy" / "devcluster" / "catalogs"
RELEASES = tuple(f"1.{minor}" for minor in range(31, 38))
CORE_FILE = "api__v1.json"
CORE_NOTE = (
    "core group from the single stored /api/v1 document (a recent release), "
    "plus pods/resize from 1.33 (listed by real kube-apiserver 1.35.4 and 1.36.3)"
)
#: Core entries real servers list that the stored /api/v1 lacks: (first release,
#: legacy APIResource entry), as real kube-apiserver 1.35.4 and 1.36.3 list them
#: (InPlacePodVerticalScaling, beta and on by default from 1.33, adds pods/resize).
CORE_ADDITIONS = (
    ((1, 33), {"name": "pods/resize", "singularName": "", "namespaced": True, "kind": "Pod",
               "verbs": ["get", "patch", "update"]}),
)

_CYCLE_DIR = re.compile(r"(1\.\d+)-cycle-[0-9a-f]+")
_RESOURCE_KEYS = {"resource", "responseKind", "scope", "singularResource", "verbs",
                  "shortNames", "categories", "subresources"}
_SUBRESOURCE_KEYS = {"subresource", "responseKind", "verbs"}
_LEGACY_KEYS = {"name", "singularName", "namespaced", "group", "version", "kind",
                "verbs", "shortNames", "categories", "storageVersionHash"}


class SourceError(Exception):
    """The source documents hold something the catalog format cannot carry."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SourceError(message)


def _check_keys(obj: dict, allowed: set[str], where: str) -> None:
    extra = set(obj) - allowed
    _require(not extra, f"{where}: unexpected fields {sorted(extra)}")


def newest_per_cycle(index: list[dict]) -> dict[str, dict]:
    """Map "1.NN" to its newest aggregated snapshot entry (last in index order)."""
    newest: dict[str, dict] = {}
    for entry in index:
        match = _CYCLE_DIR.fullmatch(entry["dir"])
        if match:
            newest[match[1]] = entry
    missing = [r for r in RELEASES if r not in newest]
    _require(not missing, f"index.json has no snapshot for {missing}")
    return {release: newest[release] for release in RELEASES}


def core_entry(index: list[dict]) -> dict:
    """The legacy /api/v1 document's index entry (the last one if several)."""
    entries = [e for e in index if e["file"] == CORE_FILE]
    _require(bool(entries), f"index.json lists no {CORE_FILE}")
    return entries[-1]


def read_bytes(path: Path) -> bytes:
    """``path``'s bytes, or the gunzipped bytes of ``path.gz`` when only that exists."""
    if path.exists():
        return path.read_bytes()
    return gzip.decompress(path.with_name(path.name + ".gz").read_bytes())


def read_source(source: Path, entry: dict) -> tuple[dict, dict]:
    """Load one document, verifying index.json's sha256; return (doc, provenance)."""
    raw = read_bytes(source / entry["dir"] / entry["file"])
    digest = hashlib.sha256(raw).hexdigest()
    _require(digest == entry["sha256"], f"{entry['dir']}: sha256 differs from index.json")
    provenance = {"repo": entry["source_repo"], "path": entry["source_path"],
                  "commit": entry["commit"], "dir": entry["dir"],
                  "file": entry["file"], "sha256": digest}
    return json.loads(raw), provenance


def _optional_lists(src: dict, out: dict) -> None:
    # Empty lists are omitted on both sides, so presence is all that matters.
    for key in ("shortNames", "categories"):
        if src.get(key):
            out[key] = list(src[key])


def compact_subresource(sub: dict, where: str) -> dict:
    _check_keys(sub, _SUBRESOURCE_KEYS, where)
    kind = sub["responseKind"]
    out = {"subresource": sub["subresource"], "kind": kind["kind"]}
    for key in ("group", "version"):
        if kind.get(key):
            out[key] = kind[key]
    out["verbs"] = list(sub["verbs"])
    return out


def compact_resource(res: dict, where: str) -> dict:
    """One aggregated APIResourceDiscovery in catalog form."""
    where = f"{where}/{res['resource']}"
    _check_keys(res, _RESOURCE_KEYS, where)
    kind = res["responseKind"]
    _require(not kind.get("group") and not kind.get("version"),
             f"{where}: top-level responseKind names a group/version")
    out = {"resource": res["resource"], "kind": kind["kind"],
           "singularResource": res["singularResource"], "scope": res["scope"],
           "verbs": list(res["verbs"])}
    _optional_lists(res, out)
    if res.get("subresources"):
        out["subresources"] = [compact_subresource(s, where) for s in res["subresources"]]
    return out


def compact_version(version: dict, group: str) -> dict:
    where = f"{group or 'core'}/{version['version']}"
    _check_keys(version, {"version", "resources", "freshness"}, where)
    _require(version.get("freshness", "Current") == "Current", f"{where}: not Current")
    return {"version": version["version"],
            "resources": [compact_resource(r, where) for r in version["resources"]]}


def compact_group(item: dict) -> dict:
    """One aggregated APIGroupDiscovery; only a null creationTimestamp may be lost."""
    metadata = item["metadata"]
    _check_keys(item, {"metadata", "versions"}, metadata["name"])
    _check_keys(metadata, {"name", "creationTimestamp"}, metadata["name"])
    _require(metadata.get("creationTimestamp") is None, f"{metadata['name']}: timestamp")
    return {"name": metadata["name"],
            "versions": [compact_version(v, metadata["name"]) for v in item["versions"]]}


def aggregated_groups(doc: dict) -> list[dict]:
    _check_keys(doc, {"apiVersion", "kind", "metadata", "items"}, "document")
    _require(doc["kind"] == "APIGroupDiscoveryList" and not doc.get("metadata"),
             "not a plain APIGroupDiscoveryList")
    return [compact_group(item) for item in doc["items"]]


def _legacy_subresource(entry: dict, sub: str) -> dict:
    out = {"subresource": sub, "kind": entry["kind"]}
    for key in ("group", "version"):
        if entry.get(key):
            out[key] = entry[key]
    out["verbs"] = list(entry["verbs"])
    return out


def _legacy_resource(entry: dict) -> dict:
    out = {"resource": entry["name"], "kind": entry["kind"],
           "singularResource": entry["singularName"],
           "scope": "Namespaced" if entry["namespaced"] else "Cluster",
           "verbs": list(entry["verbs"])}
    _optional_lists(entry, out)
    return out


def core_entries(doc: dict, release: str) -> list[dict]:
    """The legacy entries of ``release``: the document's plus its ``CORE_ADDITIONS``,
    each subresource after its resource, in name order (as kube-apiserver lists them)."""
    minor = tuple(int(p) for p in release.split("."))
    entries = list(doc["resources"])
    for since, entry in CORE_ADDITIONS:
        if minor < since or entry["name"] in {e["name"] for e in entries}:
            continue
        parent = entry["name"].split("/")[0]
        family = [i for i, e in enumerate(entries) if e["name"].split("/")[0] == parent]
        _require(bool(family), f"core/v1/{entry['name']}: {parent} is not listed")
        after = [i for i in family if entries[i]["name"] < entry["name"]]
        entries.insert((after or family)[-1] + 1, entry)
    return entries


def core_group(doc: dict, release: str) -> dict:
    """Fold the legacy APIResourceList ("pods", "pods/status", ...) into catalog form."""
    _require(doc["groupVersion"] == "v1", "legacy core document is not v1")
    resources: dict[str, dict] = {}
    for entry in core_entries(doc, release):
        _check_keys(entry, _LEGACY_KEYS, f"core/v1/{entry['name']}")
        parent, _, sub = entry["name"].partition("/")
        if not sub:
            _require(not entry.get("group") and not entry.get("version"),
                     f"core/v1/{parent}: top-level kind names a group/version")
            resources[parent] = _legacy_resource(entry)
            continue
        _require(parent in resources, f"core/v1/{entry['name']}: parent not listed first")
        subs = resources[parent].setdefault("subresources", [])
        subs.append(_legacy_subresource(entry, sub))
    return {"name": "", "versions": [{"version": "v1", "resources": list(resources.values())}]}


def build_catalog(release: str, apis: tuple[dict, dict], core: tuple[dict, dict]) -> dict:
    (apis_doc, apis_source), (core_doc, core_source) = apis, core
    return {"kubernetesVersion": release, "gitVersion": f"v{release}.0",
            "source": apis_source, "coreSource": {**core_source, "note": CORE_NOTE},
            "groups": [core_group(core_doc, release), *aggregated_groups(apis_doc)]}


def render(catalog: dict) -> bytes:
    """Minified, insertion-ordered JSON: deterministic bytes for the same input."""
    return (json.dumps(catalog, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def generate(source: Path, out: Path) -> list[Path]:
    index = json.loads((source / "index.json").read_text(encoding="utf-8"))
    core = read_source(source, core_entry(index))
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for release, entry in newest_per_cycle(index).items():
        catalog = build_catalog(release, read_source(source, entry), core)
        path = out / f"{release}.json"
        path.write_bytes(render(catalog))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, default=DEFAULT_SOURCE,
                        help=f"k8s-discovery directory (default: {DEFAULT_SOURCE})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"output directory (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    try:
        written = generate(args.source, args.out)
    except (OSError, SourceError, KeyError, ValueError) as exc:
        print(f"gen_catalogs: {exc!r}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
