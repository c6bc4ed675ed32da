"""docs/grafana/kvstrata.json: valid dashboard JSON, and every metric it queries is served at /metrics.

The /metrics check skips only while a queried `sglang:` family is missing from /metrics altogether (before
the Prometheus rewrite that adds the histograms is merged); once they are all there, any missing metric
fails, `kvstrata:` ones included.
"""

from __future__ import annotations

import json
import re

from tests.server.conftest import REPO_ROOT

DASHBOARD = REPO_ROOT / "docs" / "grafana" / "kvstrata.json"
HISTOGRAMS = {"sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds",
              "sglang:inter_token_latency_seconds"}
SAMPLES = {"sglang:num_requests_total", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
           "sglang:cached_tokens_total", "kvstrata:cached_tokens_total", "sglang:num_running_reqs",
           "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate", "sglang:gen_throughput",
           "kvstrata:engine_utilization"}
METRIC = re.compile(r"\b(?:sglang|kvstrata):[A-Za-z0-9_:]+")


def load() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def queried(dashboard: dict) -> set[str]:
    """Metric names in the panels' expressions, histogram samples folded into their family."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name in METRIC.findall(target["expr"]):
                family = re.sub(r"_(bucket|sum|count)$", "", name)
                names.add(family if family in HISTOGRAMS else name)
    return names


def test_dashboard_json_is_a_grafana_dashboard():
    d = load()
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"instance", "model_name"} <= set(variables)          # SGLang's example filters by both
    graphs = [p for p in d["panels"] if p["type"] != "row"]
    assert len(graphs) >= 10 and len({p["id"] for p in d["panels"]}) == len(d["panels"])
    for p in graphs:
        assert p["type"] in ("timeseries", "stat", "bargauge", "heatmap"), p["title"]
        assert p["datasource"]["type"] == "prometheus" and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["type"] == "prometheus" and t["expr"].count("(") == t["expr"].count(")")
            assert '$model_name' in t["expr"] and '$instance' in t["expr"], t["expr"]


def test_it_queries_exactly_the_listed_metrics():
    assert queried(load()) == HISTOGRAMS | SAMPLES


def test_every_queried_metric_is_in_metrics(server):
    lines = [ln for ln in server.get("/metrics").text.splitlines() if ln]
    samples = {ln.split("{")[0].split(" ")[0] for ln in lines if not ln.startswith("#")}

    def exists(name: str) -> bool:
        return f"{name}_bucket" in samples if name in HISTOGRAMS else name in samples

    wanted = queried(load())
    missing = sorted(n for n in wanted if not exists(n))
    assert not missing, f"queried by docs/grafana/kvstrata.json but not in /metrics: {missing}"
