"""Every metric mvproxy exports, bound to an injected registry.

Names follow upstream kube-apiserver where upstream has the concept, so existing
dashboards carry over (``apiserver_rerouted_request_total``,
``aggregator_discovery_peer_aggregated_cache_hits_total``, ...); everything else is
``mvproxy_``. Labels are bounded sets (codes, routes, group/version/resource from
the discovery catalog, peer server IDs from configuration): never a path or a user.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

GVR = ("group", "version", "resource")

# Request latencies span sub-millisecond discovery hits to minute-long requests.
_REQUEST_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
_POLL_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)


class Metrics:
    """The metric objects; one instance per daemon, one registry per instance."""

    def __init__(self, registry: CollectorRegistry | None = None):
        # Upstream's metrics have no ``*_created`` series; without this every counter
        # would export a second, timestamp-valued series that dashboards do not expect.
        disable_created_metrics()
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rerouted_requests = Counter(
            "apiserver_rerouted_request_total",
            "Requests forwarded to a peer because the backend cannot serve them, by the "
            "status code the downstream received.",
            ("code", *GVR), registry=r)
        self.peer_proxy_errors = Counter(
            "apiserver_peer_proxy_errors_total",
            "Requests that had capable peers but could not be forwarded to any of them.",
            ("type", *GVR), registry=r)
        self.discovery_sync_errors = Counter(
            "apiserver_peer_discovery_sync_errors_total",
            "Failed discovery fetches from a peer, by upstream's type: hostport_resolution "
            "(its address did not resolve) or fetch_discovery (once per failed /api or /apis).",
            ("type",), registry=r)
        self.poll_errors = Counter(
            "mvproxy_discovery_poll_errors_total",
            "Failed /api or /apis fetches from the backend or a peer, by server and reason.",
            ("server", "reason"), registry=r)
        self.aggregated_cache_hits = Counter(
            "aggregator_discovery_peer_aggregated_cache_hits_total",
            "Merged discovery documents served from the memoised bytes.", registry=r)
        self.aggregated_cache_misses = Counter(
            "aggregator_discovery_peer_aggregated_cache_misses_total",
            "Merged discovery documents recomputed because the cache changed.", registry=r)
        self.nopeer_requests = Counter(
            "aggregator_discovery_nopeer_requests_total",
            "Aggregated discovery requests asking for the local view (profile=nopeer).",
            registry=r)
        self.poll_duration = Histogram(
            "mvproxy_discovery_poll_duration_seconds",
            "Time to poll one server's /api and /apis, successful or not.",
            ("server",), buckets=_POLL_BUCKETS, registry=r)
        self.request_duration = Histogram(
            "mvproxy_request_duration_seconds",
            "Time from a downstream request's arrival to the end of its response.",
            ("route",), buckets=_REQUEST_BUCKETS, registry=r)
        self.peer_failovers = Counter(
            "mvproxy_peer_failovers_total",
            "Times a connect failure to one capable peer moved a request to the next.",
            registry=r)
        self.backend_failovers = Counter(
            "mvproxy_backend_failovers_total",
            "Requests for what the backend serves that went to a peer serving it too, "
            "because the backend was failing (failing: its last poll, or a request, found "
            "it down), nothing reached it (unanswered) or it refused them while shutting "
            "down (shutting_down).",
            ("reason",), registry=r)
        self.inflight_requests = Gauge(
            "mvproxy_inflight_requests", "Requests being served, by route.", ("route",),
            registry=r)
        self.open_watches = Gauge(
            "mvproxy_open_watches", "Watch and other long-running streams open now.",
            registry=r)
        self.refused_requests = Counter(
            "mvproxy_refused_requests_total",
            "Requests refused before routing (malformed, not origin-form, too large, too "
            "slow), by the status code sent.", ("code",), registry=r)
        self.certificate_reload_errors = Counter(
            "mvproxy_certificate_reload_errors_total",
            "Changed certificate, key or CA files refused (unreadable, unparsable, key "
            "mismatch, expired, not signed by its CA); the loaded material stays.",
            ("role",), registry=r)
        self.open_connections = Gauge(
            "mvproxy_open_connections", "Downstream connections open now (including TLS "
            "handshakes in progress).", registry=r)
        self.membership_rejected = Counter(
            "mvproxy_membership_rejected_total",
            "Membership entries ignored (a malformed or hostile Lease, a DNS answer whose "
            "server ID could not be learned), by source and reason.",
            ("source", "reason"), registry=r)
        self.membership_errors = Counter(
            "mvproxy_membership_errors_total",
            "Failed membership operations (Lease renew/list/watch, DNS resolution), by "
            "source and reason; the last known peers stay.", ("source", "reason"), registry=r)

    def watch_connections(self, count: Callable[[], int]) -> None:
        """Read ``mvproxy_open_connections`` from the listener at scrape time."""
        self.open_connections.set_function(count)

    def watch_http2(self, stats: Http2Counts, streams: Callable[[], int]) -> None:
        """Export the HTTP/2 gauges and counters, read at scrape time from ``stats``
        (``http2.Http2Stats``) and ``streams()`` (streams open now)."""
        self.registry.register(_Http2Collector(stats, streams))

    def watch_upstream_http2(self, sessions: Callable[[], tuple[int, int]]) -> None:
        """Export the upstream HTTP/2 gauges: ``sessions()`` -> (connections, requests
        they carry), read at scrape time."""
        self.registry.register(_UpstreamHttp2Collector(sessions))

    def watch_peers(self,
                    peer_states: Callable[[], Iterable[tuple[str, bool, float | None]]]) -> None:
        """Export ``mvproxy_peer_up`` and ``mvproxy_peer_discovery_age_seconds``.

        Read at scrape time from ``peer_states()`` -> (server ID, up, age in seconds
        or None before the first success), so the age is exact and a removed peer
        disappears from the output instead of lingering as a stale label.
        """
        self.registry.register(_PeerCollector(peer_states))


    def watch_certificates(self, loaded: Callable[[], Iterable[tuple[str, int, float]]]) -> None:
        """Export ``mvproxy_certificate_expiry_timestamp_seconds{role,index}``.

        Read at scrape time from ``loaded()`` -> (role, index of the certificate in its
        file, not-after as Unix time) for the material in use, not what is on disk:
        a renewed file that was refused keeps showing the expiry that will bite.
        """
        self.registry.register(_CertificateCollector(loaded))


class Http2Counts(Protocol):
    sessions: int
    defences: dict[str, int]
    goaways: dict[str, int]


class _Http2Collector(Collector):
    def __init__(self, stats: Http2Counts, streams: Callable[[], int]):
        self._stats, self._streams = stats, streams

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        yield GaugeMetricFamily("mvproxy_http2_connections",
                                "Downstream connections speaking HTTP/2 now (the rest of "
                                "mvproxy_open_connections speak HTTP/1.1).",
                                value=stats.sessions)
        yield GaugeMetricFamily("mvproxy_http2_streams",
                                "HTTP/2 streams open now: requests on HTTP/2 connections.",
                                value=self._streams())
        for name, text, counts in (
                ("mvproxy_http2_refusals", "HTTP/2 streams refused and connections ended for "
                 "what the client did (refused_stream at the concurrency limit, stream_limit at "
                 "maxConnections requests in all, rapid_reset, "
                 "flood, protocol_error, malformed, not_served), by reason.", stats.defences),
                ("mvproxy_http2_goaways", "HTTP/2 connections asked to end after a request "
                 "(unauthenticated, goaway_chance), by reason.", stats.goaways)):
            family = CounterMetricFamily(name, text, labels=("reason",))
            for reason, count in sorted(counts.items()):
                family.add_metric((reason,), count)
            yield family


class _UpstreamHttp2Collector(Collector):
    def __init__(self, sessions: Callable[[], tuple[int, int]]):
        self._sessions = sessions

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        connections, streams = self._sessions()
        yield GaugeMetricFamily("mvproxy_upstream_http2_connections",
                                "HTTP/2 connections to the backend and peers now.",
                                value=connections)
        yield GaugeMetricFamily("mvproxy_upstream_http2_streams",
                                "Requests those HTTP/2 connections carry now.", value=streams)


class _CertificateCollector(Collector):
    def __init__(self, loaded: Callable[[], Iterable[tuple[str, int, float]]]):
        self._loaded = loaded

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "mvproxy_certificate_expiry_timestamp_seconds",
            "Unix time at which a certificate mvproxy presents or trusts expires, by role "
            "and position in its file (CA bundles have several).",
            labels=("role", "index"))
        for role, index, expiry in self._loaded():
            family.add_metric((role, str(index)), expiry)
        yield family


class _PeerCollector(Collector):
    def __init__(self, peer_states: Callable[[], Iterable[tuple[str, bool, float | None]]]):
        self._peer_states = peer_states

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("mvproxy_peer_up",
                               "1 while the peer's discovery polls succeed, else 0.",
                               labels=("peer",))
        age = GaugeMetricFamily("mvproxy_peer_discovery_age_seconds",
                                "Seconds since the peer's discovery was last fetched "
                                "successfully.", labels=("peer",))
        for peer, is_up, seconds in self._peer_states():
            up.add_metric((peer,), 1.0 if is_up else 0.0)
            if seconds is not None:
                age.add_metric((peer,), seconds)
        yield up
        yield age
