"""bench/run.py's verdicts on issue 22's targets, from made-up rounds: a ratio is taken
inside each round and the verdict on its median, so a slow round of the whole machine
moves no target, and each target points the right way (p99 must stay below its bar)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def run():
    sys.path.insert(0, str(BENCH))
    try:
        import run as module  # bench/run.py; bench/ is not a package
    finally:
        sys.path.remove(str(BENCH))
    return module


def _rounds(run, scenario: str, cpu_us: dict[str, tuple[float, ...]],
            p99_ms: dict[str, tuple[float, ...]] | None = None) -> list:
    """Runs of each target in each round; round r's req/s all scale by 1/r (a machine
    that gets busier), which must not change a same-round ratio."""
    out = []
    for target, costs in cpu_us.items():
        for index, cpu in enumerate(costs):
            p99 = (p99_ms or {}).get(target, (1.0,) * len(costs))[index]
            out.append(run.Run(scenario, target, index + 1, 1e6 / cpu / (index + 1), cpu,
                               0.5, p99, 0, 700))
    return out


def _verdicts(run, runs: list) -> dict[str, tuple[float, bool]]:
    result = run.summarize(runs, {}, [], [])
    return {goal["target"]: (round(goal["value"][0], 2), goal["met"])
            for goal in result["targets"]}


def test_small_get_is_judged_against_envoy_and_nginx_of_the_same_round(run):
    runs = _rounds(run, "small", {"nginx": (18, 36, 18), "Envoy": (45, 90, 45),
                                  "mvproxy": (40, 80, 95)})
    verdicts = _verdicts(run, runs)
    assert verdicts["small GET: CPU efficiency × Envoy ≥ 1 (same run)"] == (1.12, True)
    assert verdicts["small GET: CPU efficiency × nginx ≥ 0.60"] == (0.45, False)


def test_p99_passes_below_twice_nginx_and_fails_above(run):
    runs = _rounds(run, "small", {"nginx": (18, 18, 18), "mvproxy": (30, 30, 30)},
                   {"nginx": (2.0, 2.0, 2.0), "mvproxy": (3.0, 3.8, 9.0)})
    assert _verdicts(run, runs)["small GET p99 at 32 connections ≤ 2 × nginx's"] \
        == (1.9, True)
    runs = _rounds(run, "small", {"nginx": (18, 18, 18), "mvproxy": (30, 30, 30)},
                   {"nginx": (2.0, 2.0, 2.0), "mvproxy": (4.2, 4.4, 3.0)})
    assert _verdicts(run, runs)["small GET p99 at 32 connections ≤ 2 × nginx's"] \
        == (2.1, False)


def test_the_peer_route_is_judged_on_req_s_against_the_local_route(run):
    runs = _rounds(run, "peer", {"mvproxy local": (90, 90, 90), "mvproxy peer": (200, 170, 180)})
    verdict = _verdicts(run, runs)["peer route: req/s × local route ≥ 0.5"]
    assert verdict == (0.5, True)


def test_the_table_says_which_targets_hold_and_names_the_machine(run):
    runs = _rounds(run, "large", {"nginx": (74, 74, 74), "HAProxy": (88, 88, 88),
                                  "mvproxy": (200, 200, 200)})
    result = run.summarize(runs, {}, [], [])
    table = run.render(result)
    assert "| large | HAProxy |" in table and "0.84 (0.84–0.84)" in table
    assert "| 64 KiB LIST: CPU efficiency × nginx ≥ 0.95 | 0.37 (0.37–0.37) | no |" in table
    assert result["machine"]["cpus"] and "medians of 3 rounds" in table
