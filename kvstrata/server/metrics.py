"""Prometheus metrics (`prometheus-client`): SGLang's families under SGLang's names, plus kvstrata's tiers.

Two sources, one registry:
- the HTTP process observes every output sequence when it ends (`observe`): latency histograms and the
  request/token counters, so that `sglang:cached_tokens_total / sglang:prompt_tokens_total` is exactly the
  hit rate clients saw in their responses' `cached_tokens`;
- the scheduler's state dict, fetched at each scrape (`render`), gives the gauges (queue, pool usage) and
  the per-tier families (`kvstrata:*`), which are counters wherever the scheduler's number only grows.

Histograms count sequences that finished normally (stop or length); aborted and failed ones are counted
in `sglang:num_aborted_requests_total` / `kvstrata:failed_requests_total` instead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
THROUGHPUT_WINDOW_S = 10.0

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5)

# Scheduler counters exposed as kvstrata:<name>_total: (name, help, path in the state dict).
_TIER_COUNTERS = (
    ("evicted_tokens", "Tokens evicted from the device radix cache (L1).", ("tree", "evicted_tokens")),
    ("host_backup_pages", "Pages copied from the device pool to the host pool (L1 -> L2).",
     ("tree", "backup_pages")),
    ("host_backup_bytes", "Bytes copied from the device pool to the host pool (L1 -> L2).",
     ("tree", "backup_bytes")),
    ("load_back_pages", "Pages loaded back from the host pool into the device pool (L2 -> L1).",
     ("tree", "load_back_pages")),
    ("load_back_bytes", "Bytes loaded back from the host pool into the device pool (L2 -> L1).",
     ("tree", "load_back_bytes")),
    ("demoted_pages", "Device pages evicted to host-only residency (L1 -> L2).", ("tree", "demoted_pages")),
    ("host_evicted_pages", "Pages evicted from the host pool (L2).", ("tree", "host_evicted_pages")),
    ("host_backup_skipped_pages", "Backups to the host pool skipped because it was full.",
     ("tree", "backup_skipped_host_full")),
    ("storage_backup_pages", "Pages written to the storage tier (L3).", ("tree", "storage", "backed_up_pages")),
    ("kv_events_published", "KV events published (--kv-events-config).", ("kv_events", "published_events")),
    ("kv_events_dropped", "KV events dropped because the publisher's queue was full (a snapshot follows).",
     ("kv_events", "dropped_events")),
    ("kv_event_batches_published", "KV event batches published.", ("kv_events", "published_batches")),
    ("kv_event_replay_requests", "Requests answered on the KV event replay endpoint.",
     ("kv_events", "replay_requests")),
    ("kv_event_bad_replay_requests", "Malformed requests dropped on the KV event replay endpoint.",
     ("kv_events", "bad_replay_requests")),
    ("storage_backup_bytes", "Bytes written to the storage tier (L3).", ("tree", "storage", "backup_bytes")),
    ("storage_prefetch_requests", "Requests that started an L3 prefetch.", ("tree", "prefetch_requests")),
    ("storage_prefetched_tokens", "Tokens prefetched from the storage tier into the host pool (L3 -> L2).",
     ("tree", "prefetched_tokens")),
    ("storage_prefetch_bytes", "Bytes read from the storage tier by prefetches (L3 -> L2).",
     ("tree", "storage", "prefetch_bytes")),
    ("storage_errors", "Storage backend operations that failed (the tier degrades to misses).",
     ("tree", "storage", "backend", "errors")),
    ("storage_corrupt_pages", "Pages read from the storage tier that failed their integrity check.",
     ("tree", "storage", "backend", "corrupt")),
    ("storage_evicted_pages", "Pages the storage backend evicted for capacity.",
     ("tree", "storage", "backend", "evictions")),
    ("copy_failed_ops", "Host copy operations (backup or load-back) that failed.", ("tree", "failed_ops")),
    ("retractions", "Running requests retracted (and recomputed later) because the device pool was full.",
     ("retractions",)),
    ("preemptions", "Decoding requests paused so that a waiting request could start (--preempt-for-first-token).",
     ("preemptions",)),
)
# Scheduler gauges exposed as kvstrata:<name>.
_TIER_GAUGES = (
    ("device_capacity_tokens", "Token slots in the device KV pool (L1).", ("capacity_tokens",)),
    ("device_free_tokens", "Free token slots in the device KV pool.", ("free_tokens",)),
    ("device_cached_tokens", "Tokens held by the device radix cache (evictable or locked).",
     ("tree_tokens",)),
    ("device_evictable_tokens", "Radix-cache tokens no running request uses (free on demand).",
     ("evictable_tokens",)),
    ("host_capacity_pages", "Pages of the host pool (L2).", ("tree", "host_capacity_pages")),
    ("host_used_pages", "Pages of the host pool in use.", ("tree", "host_used_pages")),
    ("host_usage", "Fraction of the host pool in use.", ("tree", "host_usage")),
    ("copy_ops_in_flight", "Host copy operations submitted and not yet acknowledged.",
     ("tree", "ops_in_flight")),
    ("integrity_ok", "1 if the last idle-time page accounting check passed, 0 if it failed.",
     ("integrity_ok",)),
    ("engine_utilization", "Share of wall-clock time the model spent in forward passes (recent window).",
     ("engine_utilization",)),
)


class ServerMetrics:
    """The registry behind /metrics; one per HTTP process."""

    def __init__(self, model_name: str):
        disable_created_metrics()   # no `*_created` samples: SGLang's dashboards do not expect them
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = histogram("sglang:time_to_first_token_seconds",
                              "Time from arrival to the first output token (non-streaming requests: to the "
                              "whole output).", _TTFT_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             _E2E_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Gap between streamed outputs, per token they carried.", _TOKEN_BUCKETS)
        self.tpot = histogram("sglang:time_per_output_token_seconds",
                              "(e2e latency - time to first token) / (output tokens - 1), per request.",
                              _TOKEN_BUCKETS)
        self.requests = counter("sglang:num_requests", "Output sequences that ended (any reason).")
        self.aborted = counter("sglang:num_aborted_requests", "Output sequences aborted before they finished.")
        self.failed = counter("kvstrata:failed_requests", "Output sequences that ended with an error.")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of ended sequences.")
        self.generation_tokens = counter("sglang:generation_tokens", "Tokens generated by ended sequences.")
        self.cached_tokens = counter("sglang:cached_tokens",
                                     "Prompt tokens served from the prefix cache (any tier), as reported in "
                                     "the responses' cached_tokens.")
        self.scheduler = SchedulerCollector(model_name)
        self.registry.register(self.scheduler)

    def observe(self, s: Any) -> None:
        """Count one output sequence (a SeqState) that is being released; call before it is failed."""
        self.requests.inc()
        if not s.finished:
            self.aborted.inc()
        elif s.error is not None:
            self.failed.inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(s.completion_tokens)
        self.cached_tokens.inc(s.cached_tokens)
        if not s.finished or s.error is not None or s.finished_at is None:
            return
        e2e = s.finished_at - s.created_at
        first = s.first_token_at if s.first_token_at is not None else s.finished_at
        self.e2e.observe(e2e)
        self.ttft.observe(first - s.created_at)
        for gap in s.inter_token_s:
            self.itl.observe(gap)
        if s.completion_tokens > 1:
            self.tpot.observe((s.finished_at - first) / (s.completion_tokens - 1))

    def render(self, scheduler_state: Optional[dict]) -> bytes:
        """The exposition text, with the scheduler's gauges taken from `scheduler_state`."""
        self.scheduler.update(scheduler_state or {})
        return generate_latest(self.registry)


class SchedulerCollector(Collector):
    """Families computed from the latest scheduler state dict."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.state: dict = {}
        self._generated: deque[tuple[float, float]] = deque()

    def update(self, state: dict) -> None:
        """Use `state` for the next collect(); also feeds the generation-throughput window."""
        self.state = state
        if "generated_tokens" in state:
            now = time.monotonic()
            self._generated.append((now, float(state["generated_tokens"])))
            while len(self._generated) > 2 and now - self._generated[1][0] >= THROUGHPUT_WINDOW_S:
                self._generated.popleft()

    def describe(self) -> list:
        """No fixed description: the registry must not call collect() at registration time."""
        return []

    def collect(self) -> Iterator[Metric]:
        """SGLang's scheduler gauges and kvstrata's per-tier families."""
        state = _derived(self.state)
        if not state:
            return
        yield from self._sglang_gauges(state)
        yield self._cached_by_tier(state)
        for name, doc, path in _TIER_COUNTERS:
            value = _lookup(state, path)
            if value is not None:
                yield self._one(CounterMetricFamily, f"kvstrata:{name}", doc, value)
        for name, doc, path in _TIER_GAUGES:
            value = _lookup(state, path)
            if value is not None:
                yield self._one(GaugeMetricFamily, f"kvstrata:{name}", doc, value)
        skipped = (state.get("tree") or {}).get("prefetch_skipped")
        if isinstance(skipped, dict):
            family = CounterMetricFamily("kvstrata:storage_prefetch_skipped",
                                         "L3 prefetches not started, by reason.", labels=["model_name", "reason"])
            for reason, count in sorted(skipped.items()):
                family.add_metric([self.model_name, str(reason)], float(count))
            yield family

    def _sglang_gauges(self, state: dict) -> Iterator[Metric]:
        capacity = state["capacity_tokens"] or 1
        gauges = (
            ("sglang:num_running_reqs", "Requests running (prefilling or decoding).", state.get("running_requests")),
            ("sglang:num_queue_reqs", "Requests waiting to be scheduled.", state.get("waiting_requests")),
            ("sglang:num_used_tokens", "Device KV slots neither free nor evictable: held by running requests "
             "and, for a moment after they finish, by pages still being copied to the host.",
             state["used_tokens"]),
            ("sglang:token_usage", "Fraction of the device KV pool neither free nor evictable.",
             state["used_tokens"] / capacity),
            ("sglang:cache_hit_rate", "Cached prompt tokens / prompt tokens of admitted requests since start.",
             state.get("cache_hit_rate")),
            ("sglang:gen_throughput", f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:.0f} s of "
             "scrapes (0 until two scrapes were made).", self._throughput()),
        )
        for name, doc, value in gauges:
            yield self._one(GaugeMetricFamily, name, doc, value or 0.0)

    def _cached_by_tier(self, state: dict) -> Metric:
        family = CounterMetricFamily(
            "kvstrata:cached_tokens", "Prompt tokens served from the cache at admission, by the tier that held "
            "them (L3 pages reach the device through the host but count as storage); the tiers add up to "
            "sglang:cached_tokens_total.",
            labels=["model_name", "tier"])
        device = float(state.get("device_hit_tokens", 0))
        storage = float(state.get("storage_hit_tokens", 0))
        host = float(state.get("host_hit_tokens", 0))     # the scheduler's host count excludes L3 hits
        for tier, value in (("device", device), ("host", host), ("storage", storage)):
            family.add_metric([self.model_name, tier], value)
        return family

    def _throughput(self) -> float:
        if len(self._generated) < 2:
            return 0.0
        (t0, g0), (t1, g1) = self._generated[0], self._generated[-1]
        return (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0

    def _one(self, kind: type, name: str, doc: str, value: Any) -> Metric:
        family = kind(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], float(value))
        return family


def _derived(state: dict) -> dict:
    """The state with token-level pool numbers and one `tree` entry (radix, host and storage metrics)."""
    if not state or "capacity_pages" not in state:
        return {}
    page = state.get("page_size", 1)
    out = dict(state)
    tree = state.get("hicache") or state.get("radix_cache") or {}
    out["tree"] = tree
    out["capacity_tokens"] = state["capacity_pages"] * page
    out["free_tokens"] = state["free_pages"] * page
    out["tree_tokens"] = tree.get("tree_tokens", 0)
    evictable = state.get("evictable_tokens", 0)
    # SGLang: used = total - available - evictable; locked cache pages belong to running requests.
    out["used_tokens"] = max(0, out["capacity_tokens"] - out["free_tokens"] - evictable)
    if "integrity_ok" in out:
        out["integrity_ok"] = 1.0 if out["integrity_ok"] else 0.0
    return out


def _lookup(state: dict, path: tuple) -> Optional[float]:
    value: Any = state
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None
