"""The one Accept parser (mvproxy.accept), as kube-apiserver's goautoneg reads the header."""

from __future__ import annotations

import pytest

from mvproxy.accept import MAX_CLAUSES, MAX_PARAMS, MediaRange, parse_accept


def types(header: str) -> list[str]:
    return [r.media_type for r in parse_accept(header)]


def test_best_first_by_q_then_concrete_types_keeping_the_client_order():
    header = "*/*;q=0.8, application/*, text/plain;q=0.9, application/json, application/yaml"
    assert types(header) == ["application/json", "application/yaml", "application/*",
                             "text/plain", "*/*"]


@pytest.mark.parametrize(("header", "expected"), [
    pytest.param("application/json;q=0", [], id="q=0 excluded"),
    pytest.param("application/json;q=nan", [], id="NaN excluded"),
    pytest.param("application/json;q=high", [], id="unparsable q excluded"),
    pytest.param("*", ["*/*"], id="bare star is */*"),
    pytest.param("json, , application/json", ["application/json"], id="no type/subtype"),
    pytest.param("Application/JSON", ["application/json"], id="lowercased"),
])
def test_clauses_left_out_or_normalised(header, expected):
    assert types(header) == expected


def test_parameters_are_lowercased_unquoted_and_lose_q():
    (clause,) = parse_accept(
        'application/json; AS=APIGroupDiscoveryList ;v="v2"; g=apidiscovery.k8s.io;q=0.5;=x')
    assert clause == MediaRange("application/json", {
        "as": "APIGroupDiscoveryList", "v": "v2", "g": "apidiscovery.k8s.io"}, 0.5)


def test_only_the_first_clauses_and_parameters_are_read():
    """A huge header is cut to ``MAX_CLAUSES`` clauses of ``MAX_PARAMS`` parts, so it
    cannot buy CPU time: the JSON clause after them is not seen."""
    filler = ",".join(f"a/b{i};q=0.5" for i in range(MAX_CLAUSES))
    assert [r.media_type for r in parse_accept(filler + ",application/json")] == [
        f"a/b{i}" for i in range(MAX_CLAUSES)]
    header = ",".join(["x/y;q=0.1"] * 100_000) + ",application/json"  # ~1 MiB
    assert len(parse_accept(header)) == MAX_CLAUSES
    params = ";".join(f"p{i}=v" for i in range(MAX_PARAMS * 100))
    (clause,) = parse_accept(f"application/json;{params};q=0.5")
    assert clause.q == 1.0 and len(clause.params) == MAX_PARAMS - 1


def test_real_clients_fit_in_the_bounds():
    """Every Accept value in the kubectl and client-library capture is read whole."""
    from test_discovery import _observed_discovery_requests

    values = {v for r in _observed_discovery_requests() for k, v in r["headers"]
              if k.lower() == "accept"}
    assert values
    for value in values:
        assert value.count(",") < MAX_CLAUSES
        assert all(part.count(";") < MAX_PARAMS - 1 for part in value.split(","))
