"""/metrics: Prometheus exposition parsed by prometheus_client, SGLang's families, counts that add up."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import launch_server, stop_server
from tests.server.helpers import bench_multiturn_body, parse_sse

POOL_TOKENS = 256
PAGE = 4


@pytest.fixture(scope="module")
def tiered_server(tmp_path_factory):
    """A fresh server with L1+L2+L3 (file) and a small device pool, so the cache can fill it."""
    tmp = tmp_path_factory.mktemp("metrics")
    handle = launch_server(tmp, "--max-total-tokens", str(POOL_TOKENS), "--page-size", str(PAGE),
                           "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
                           "--hicache-storage-dir", str(tmp / "kv"))
    try:
        yield handle
    finally:
        stop_server(handle)


def scrape(server) -> dict:
    """name -> family, asserting each family appears once and has HELP text."""
    text = requests.get(server.url + "/metrics", timeout=30).text
    families: dict = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in families, f"duplicated family {family.name}"
        assert family.documentation, f"{family.name} has no HELP"
        families[family.name] = family
    return families


def value(families: dict, name: str, suffix: str = "", **labels: str) -> float:
    """The sample `name + suffix` of a family (matching labels)."""
    family = families[name]
    for sample in family.samples:
        if sample.name == name + suffix and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    raise AssertionError(f"no sample {name}{suffix} {labels}")


def test_histograms_count_the_requests_served_and_cached_tokens_match_responses(tiered_server):
    before = scrape(tiered_server)
    base = value(before, "sglang:e2e_request_latency_seconds", "_count")
    cached_before = value(before, "sglang:cached_tokens", "_total")
    tiers_before = sum(value(before, "kvstrata:cached_tokens", "_total", tier=t) for t in ("device", "host", "storage"))
    history = "The first turn of a conversation that every later turn repeats in full. "
    cached, served = 0, 0
    for turn in range(4):
        history += f"Question {turn}? "
        body = bench_multiturn_body(history, 4)
        body["stream"] = turn % 2 == 0        # streamed and plain responses are both counted
        r = tiered_server.post("/generate", json=body)
        assert r.status_code == 200, r.text
        if body["stream"]:
            meta = [e for e in parse_sse(r.text.splitlines()) if e != "[DONE]"][-1]["meta_info"]
        else:
            meta = r.json()["meta_info"]
        cached += meta["cached_tokens"]
        served += 1
    after = scrape(tiered_server)
    for name in ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds",
                 "sglang:time_per_output_token_seconds"):
        assert after[name].type == "histogram"
        assert value(after, name, "_count") - base == served, name
    assert value(after, "sglang:cached_tokens", "_total") - cached_before == cached > 0
    tiers = sum(value(after, "kvstrata:cached_tokens", "_total", tier=t) for t in ("device", "host", "storage"))
    assert tiers - tiers_before == cached      # each admission's hit counted once, in exactly one tier
    for name, kind in (("sglang:num_requests", "counter"), ("sglang:num_aborted_requests", "counter"),
                       ("sglang:prompt_tokens", "counter"), ("sglang:generation_tokens", "counter"),
                       ("sglang:inter_token_latency_seconds", "histogram"), ("sglang:gen_throughput", "gauge"),
                       ("sglang:num_used_tokens", "gauge"), ("sglang:num_running_reqs", "gauge"),
                       ("sglang:num_queue_reqs", "gauge"), ("sglang:cache_hit_rate", "gauge"),
                       ("kvstrata:host_used_pages", "gauge"), ("kvstrata:storage_backup_pages", "counter")):
        assert after[name].type == kind, name


def test_token_usage_is_zero_on_an_idle_server_with_a_full_cache(tiered_server):
    for i in range(12):      # distinct prompts: together far more than the device pool holds
        prompt = f"Conversation {i}: " + " ".join(f"w{i}x{j}" for j in range(20))
        r = tiered_server.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
    tiered_server.wait_idle()
    families = scrape(tiered_server)
    capacity = value(families, "kvstrata:device_capacity_tokens")
    assert value(families, "kvstrata:device_evictable_tokens") > 0.5 * capacity
    assert value(families, "sglang:token_usage") == 0.0
    assert value(families, "sglang:num_used_tokens") == 0.0
