"""Adding up the workers' metrics (``metricsmerge``): what Prometheus reads from the
supervisor must be what one process serving everything would have exported."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mvproxy.metrics import Metrics
from mvproxy.metricsmerge import MetricsMerger


def exposition(requests: int, inflight: int, peer_up: float, age: float) -> str:
    """A worker's real /metrics text (``Metrics``), after ``requests`` requests."""
    metrics = Metrics(CollectorRegistry(auto_describe=True))
    for _ in range(requests):
        metrics.request_duration.labels("backend").observe(0.002)
        metrics.rerouted_requests.labels("200", "scheduling.k8s.io", "v1alpha2", "podgroups").inc()
        metrics.poll_errors.labels("b", "timeout").inc()
        metrics.discovery_sync_errors.labels("fetch_discovery").inc()
    metrics.inflight_requests.labels("backend").set(inflight)
    metrics.watch_peers(lambda: [("b", bool(peer_up), age)])
    return generate_latest(metrics.registry).decode()


def values(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


PODGROUPS = (("code", "200"), ("group", "scheduling.k8s.io"), ("resource", "podgroups"),
             ("version", "v1alpha2"))


def test_counters_histograms_and_counting_gauges_add_up():
    merged = values(MetricsMerger().merge([exposition(3, 1, 1, 0.5), exposition(4, 2, 1, 2.0)]))
    assert merged[("apiserver_rerouted_request_total", PODGROUPS)] == 7
    assert merged[("mvproxy_request_duration_seconds_count", (("route", "backend"),))] == 7
    assert merged[("mvproxy_request_duration_seconds_bucket",
                   (("le", "0.0025"), ("route", "backend")))] == 7
    assert merged[("mvproxy_inflight_requests", (("route", "backend"),))] == 3
    # Each worker polls discovery itself: their failed polls add up too.
    assert merged[("mvproxy_discovery_poll_errors_total",
                   (("reason", "timeout"), ("server", "b")))] == 7
    assert merged[("apiserver_peer_discovery_sync_errors_total",
                   (("type", "fetch_discovery"),))] == 7


def test_a_shared_view_is_not_added_up():
    merged = values(MetricsMerger().merge([exposition(0, 0, 1, 0.5), exposition(0, 0, 0, 9.0)]))
    assert merged[("mvproxy_peer_up", (("peer", "b"),))] == 0  # up only if up everywhere
    assert merged[("mvproxy_peer_discovery_age_seconds", (("peer", "b"),))] == 9.0


def test_a_dead_workers_counters_stay_so_sums_never_go_back():
    merger = MetricsMerger()
    old = exposition(5, 2, 1, 0.5)
    before = values(merger.merge([old, exposition(1, 0, 1, 0.5)]))
    merger.retire(old)  # it died; its replacement starts from zero
    after = values(merger.merge([exposition(0, 0, 1, 0.5), exposition(1, 0, 1, 0.5)]))
    key = ("apiserver_rerouted_request_total", PODGROUPS)
    assert before[key] == 6 and after[key] == 6
    assert after[("mvproxy_inflight_requests", (("route", "backend"),))] == 0  # gauges go


def test_a_worker_that_answers_garbage_counts_as_absent():
    merged = values(MetricsMerger().merge(["not {metrics", exposition(2, 0, 1, 0.5)]))
    assert merged[("apiserver_rerouted_request_total", PODGROUPS)] == 2
