"""The one Accept parser (mvproxy.accept), as kube-apiserver's goautoneg reads the header."""

from __future__ import annotations

import pytest

from mvproxy.accept import MediaRange, parse_accept


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
