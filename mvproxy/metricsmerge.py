"""The workers' metrics added up into one exposition, as if one process had served all.

Counters and histograms add up. So do the gauges that count things (requests in
flight, open watches, open connections). The gauges that describe a shared view do
not: ``mvproxy_peer_up`` is the lowest of the workers' (a peer counts as up only if
every worker can reach it), a discovery age the highest, a certificate expiry the
earliest.

A worker that died leaves its last counters behind (``retire``), so the sums never go
back when a worker is replaced: Prometheus would read a drop as a counter reset and
rate() would spike.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

LOWEST = frozenset({"mvproxy_peer_up", "mvproxy_certificate_expiry_timestamp_seconds"})
HIGHEST = frozenset({"mvproxy_peer_discovery_age_seconds"})
CUMULATIVE = frozenset({"counter", "histogram", "summary"})

SampleKey = tuple[str, str, tuple[tuple[str, str], ...]]
"""(family name, sample name, sorted labels)."""


class MetricsMerger:
    """Adds up exposition texts; keeps the cumulative samples of retired workers."""

    def __init__(self) -> None:
        self._retired: dict[SampleKey, float] = {}
        self._families: dict[str, tuple[str, str]] = {}
        """Family name -> (type, help), of every family seen (retired ones render too)."""

    def retire(self, text: str) -> None:
        """A worker is gone: its counters and histograms stay in every later sum."""
        for family in _parse(text):
            if family.type not in CUMULATIVE:
                continue
            self._families.setdefault(family.name, (family.type, family.documentation))
            for key, value in _samples(family):
                self._retired[key] = self._retired.get(key, 0.0) + value

    def merge(self, texts: Iterable[str]) -> bytes:
        """One exposition (Prometheus text format) of the live workers' ``texts``."""
        values: dict[SampleKey, float] = dict(self._retired)
        for text in texts:
            for family in _parse(text):
                self._families.setdefault(family.name, (family.type, family.documentation))
                for key, value in _samples(family):
                    values[key] = _combine(family.name, family.type, values.get(key), value)
        families: dict[str, Metric] = {}
        for (name, sample, labels), value in values.items():
            metric = families.get(name)
            if metric is None:
                kind, documentation = self._families[name]
                metric = families[name] = Metric(name, documentation, kind)
            metric.add_sample(sample, dict(labels), value)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed(list(families.values())))
        return generate_latest(registry)


def _parse(text: str) -> list[Metric]:
    """The families of one worker's exposition; a text that does not parse counts as
    empty (the worker is restarting or broken: its absence is reported elsewhere)."""
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:
        return []


def _samples(family: Metric) -> Iterable[tuple[SampleKey, float]]:
    for sample in family.samples:
        if sample.name.endswith("_created"):
            continue  # a timestamp: never added up (mvproxy disables them anyway)
        yield (family.name, sample.name, tuple(sorted(sample.labels.items()))), sample.value


def _combine(name: str, kind: str, old: float | None, new: float) -> float:
    if old is None:
        return new
    if kind == "gauge" and name in LOWEST:
        return min(old, new)
    if kind == "gauge" and name in HIGHEST:
        return max(old, new)
    return old + new


class _Fixed(Collector):
    """Already-built families, for ``generate_latest``."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
