#!/usr/bin/env python3
"""Discovery at scale: a CRD-heavy control plane of 6 servers × 3,000 groups.

Builds synthetic aggregated-discovery snapshots (each group one version with three
resources; each server shares most groups with the others and has some of its own,
as CRDs rolled out unevenly look), loads them into a ``DiscoveryCache`` like polling
would, then measures:

- the merge: a peer's snapshot changes, the merged view is rebuilt and rendered
  (median of ``--rounds``);
- one routing decision for a resource only a peer serves, and for one the backend
  serves (median per call over ``--decisions`` calls);
- the memory the cache holds (tracemalloc, Python allocations only).

Pure CPU, no sockets; prints a table and writes ``bench/results/discovery_scale.json``.

    .venv/bin/python bench/discovery_scale.py [--groups 3000] [--peers 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mvproxy import discovery, routing  # noqa: E402 - after the sys.path insert
from mvproxy.cache import DiscoveryCache  # noqa: E402 - after the sys.path insert
from mvproxy.discovery import Snapshot  # noqa: E402 - after the sys.path insert
from mvproxy.requestinfo import parse_request_info  # noqa: E402 - after the sys.path insert


def group(name: str, version: str = "v1") -> dict:
    def resource(kind: str) -> dict:
        return {"resource": kind.lower() + "s", "responseKind": {"group": name,
                "version": version, "kind": kind}, "scope": "Namespaced",
                "singularResource": kind.lower(), "verbs": ["create", "delete", "get", "list",
                                                            "patch", "update", "watch"],
                "subresources": [{"subresource": "status", "verbs": ["get", "patch", "update"],
                                  "responseKind": {"group": name, "version": version,
                                                   "kind": kind}}]}
    return {"metadata": {"name": name}, "versions": [{
        "version": version, "freshness": "Current",
        "resources": [resource(k) for k in ("Widget", "Gadget", "Sprocket")]}]}


def snapshot(server: int, groups: int, rng: random.Random) -> Snapshot:
    shared = [group(f"g{i}.example.com") for i in range(groups - groups // 20)]
    own = [group(f"s{server}-{i}.example.com") for i in range(groups // 20)]
    items = shared + own
    rng.shuffle(items)
    core = [{"metadata": {}, "versions": [{"version": "v1", "freshness": "Current",
                                           "resources": [{"resource": "pods", "verbs": ["get"],
                                                          "responseKind": {"kind": "Pod"}}]}]}]
    return Snapshot(core=core, groups=items)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3000)
    parser.add_argument("--peers", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decisions", type=int, default=100_000)
    args = parser.parse_args()
    rng = random.Random(7)
    peers = [f"peer-{i}" for i in range(args.peers)]
    tracemalloc.start()
    cache = DiscoveryCache("self", peers, stale_after=60, forget_after=600)
    cache.record_success("self", snapshot(0, args.groups, rng))
    for index, peer in enumerate(peers, 1):
        cache.record_success(peer, snapshot(index, args.groups, rng))
    view = cache.view()
    view.merged()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()

    merges = []
    for round_ in range(args.rounds):
        cache.record_success(peers[0], snapshot(100 + round_, args.groups, rng))
        started = time.perf_counter()
        view = cache.view()
        merged = view.merged()
        body = discovery.render_aggregated(merged.groups, api_version=discovery.API_VERSION_V2)
        merges.append(time.perf_counter() - started)

    view = cache.view()
    peer_only = parse_request_info("GET", "/apis/s2-7.example.com/v1/namespaces/x/widgets", "")
    local = parse_request_info("GET", "/apis/g5.example.com/v1/namespaces/x/widgets", "")
    timings = {}
    for name, info in (("peer-only resource", peer_only), ("backend resource", local)):
        decision = routing.decide(info, view, peer_proxied=False, credentials=True, rng=rng)
        started = time.perf_counter()
        for _ in range(args.decisions):
            routing.decide(info, view, peer_proxied=False, credentials=True, rng=rng)
        timings[name] = ((time.perf_counter() - started) / args.decisions * 1e6, decision.route)

    result = {
        "servers": args.peers + 1, "groups_per_server": args.groups,
        "merged_groups": len(merged.groups), "merged_document_bytes": len(body),
        "merge_and_render_ms": {"median": round(statistics.median(merges) * 1e3, 1),
                                "max": round(max(merges) * 1e3, 1)},
        "decision_us": {name: round(us, 2) for name, (us, _) in timings.items()},
        "routes": {name: route for name, (_, route) in timings.items()},
        "cache_python_mib": round(held / 2**20, 1),
    }
    print(f"{'measure':34} value")
    for key, value in result.items():
        print(f"{key:34} {value}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "discovery_scale.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
