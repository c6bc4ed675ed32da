"""The router's Prometheus metrics: per worker requests, errors, retries, routing decisions by reason
(counters), and in-flight requests, health and drain state (gauges read from the registry at scrape time).

Series are labelled by worker URL; a caller who may not see URLs (kvstrata/router/access.py) gets the
same series labelled by worker id instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvstrata.router.workers import WorkerRegistry

PREFIX = "kvstrata_router_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    """Counters the proxy increments, plus gauges computed from the worker registry."""

    def __init__(self, workers: WorkerRegistry):
        disable_created_metrics()   # no *_created series per counter (the router is its own process)
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(PREFIX + "requests", "Requests sent to a worker (a retry counts again).",
                                ["worker"], registry=self.registry)
        self.errors = Counter(PREFIX + "errors", "Requests to a worker that failed (connection error, 5xx, "
                              "or a broken stream).", ["worker"], registry=self.registry)
        self.retries = Counter(PREFIX + "retries", "Requests retried on another worker after failing on "
                               "this one before any byte came back.", ["worker"], registry=self.registry)
        self.decisions = Counter(PREFIX + "routing_decisions", "Routing decisions by policy reason.",
                                 ["worker", "reason"], registry=self.registry)
        self.prefetch_hints = Counter(PREFIX + "prefetch_hints", "POST /prefetch hints sent (tier_aware: the "
                                      "chosen worker holds the prefix in L2/L3).", ["worker"], registry=self.registry)
        self.forgone_hits = Counter(PREFIX + "forgone_cached_tokens", "tier_aware: prompt tokens the policy "
                                    "expected some worker to hold beyond what the chosen one holds (it chose "
                                    "less cache for less load), by reason.", ["reason"], registry=self.registry)
        self.off_best = Counter(PREFIX + "decisions_off_best_cache", "tier_aware: decisions that chose a worker "
                                "expected to hold less of the prompt than another routable one, by reason.",
                                ["reason"], registry=self.registry)
        self.registry.register(_WorkerGauges(workers))
        self.workers = workers

    def watch_index(self, feeds) -> None:
        """Also report the exact KV index (kv_index.py) and its subscribers (kv_subscriber.KVFeeds)."""
        self.registry.register(_IndexGauges(feeds, self.workers))

    def render(self, reveal_urls: bool) -> bytes:
        """The text exposition format, workers labelled by URL when `reveal_urls`, else by id."""
        return generate_latest(self.registry if reveal_urls else _Relabelled(self.registry, self.workers.id_of))


class _Relabelled:
    """A registry's samples with every `worker` label passed through `rename`."""

    def __init__(self, registry: CollectorRegistry, rename: Callable[[str], str]):
        self.registry = registry
        self.rename = rename

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = {k: self.rename(v) if k == "worker" else v for k, v in s.labels.items()}
                out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
            yield out


class _WorkerGauges(Collector):
    def __init__(self, workers: WorkerRegistry):
        self.workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauges = {
            "in_flight_requests": ("Requests being proxied to the worker.", lambda w: w.in_flight),
            "worker_healthy": ("1 when the worker passes its health checks.", lambda w: w.healthy),
            "worker_draining": ("1 while the worker is being drained.", lambda w: w.draining),
            "worker_running_requests": ("Running requests the worker last reported.",
                                        lambda w: w.load.running_requests),
            "worker_waiting_requests": ("Queued requests the worker last reported.",
                                        lambda w: w.load.waiting_requests),
        }
        for name, (doc, read) in gauges.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
            for w in self.workers.all():
                family.add_metric([w.url], float(read(w)))
            yield family


class _IndexGauges(Collector):
    """The KV index's size, each worker's sync state, weights, and its subscriber's counters."""

    def __init__(self, feeds, workers: WorkerRegistry):
        self.feeds = feeds
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        size = GaugeMetricFamily(PREFIX + "kv_index_blocks", "Distinct KV blocks some worker announced "
                                 "(KV events).")
        size.add_metric([], float(self.feeds.index.size()))
        yield size
        events = CounterMetricFamily(PREFIX + "kv_event_subscriber", "KV event subscriber counters by kind "
                                     "(batches, gaps, replays, resyncs, restarts, duplicates, bad_messages).",
                                     labels=["worker", "kind"])
        for url, stats in self.feeds.stats().items():
            for kind in ("batches", "gaps", "replays", "resyncs", "restarts", "duplicates", "bad_messages"):
                events.add_metric([url, kind], float(stats.get(kind, 0)))
        yield events
        weights = GaugeMetricFamily(PREFIX + "tier_weight", "tier_aware cost of a cached token relative to "
                                    "computing it, per tier (measured by the worker; the flag's value until then).",
                                    labels=["worker", "tier"])
        for w in self.workers.all():
            host, storage = w.tier_weights(float("nan"), float("nan"))
            weights.add_metric([w.url, "host"], host)
            weights.add_metric([w.url, "storage"], storage)
        yield weights
