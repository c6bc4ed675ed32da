"""The live dashboard against a real server with two tiers (a small device pool, so that host hits happen).

The browser test drives Debian's chromium (tests/server/browser.py) and saves its screenshot to
out/test-artifacts/dashboard.png.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import requests

from kvstrata.bench import multiturn
from tests.capabilities import requires_chromium
from tests.server.browser import chromium_page, screenshot
from tests.server.conftest import API_KEY, launch_server, stop_server

TIER_FLAGS = ["--max-total-tokens", "384", "--page-size", "16", "--enable-hierarchical-cache",
              "--hicache-ratio", "4"]


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory):
    """A server with the device and host tiers, and an API key."""
    handle = launch_server(tmp_path_factory.mktemp("dashboard"), *TIER_FLAGS, api_key=API_KEY)
    try:
        yield handle
    finally:
        stop_server(handle)


def run_workload(url: str, clients: int = 6, rounds: int = 3) -> dict:
    """A short `kvstrata bench multiturn` run (in a thread of its own: Playwright's loop owns this one)."""
    args, _ = multiturn.parse_args(["--num-clients", str(clients), "--num-rounds", str(rounds),
                                    "--request-length", "96", "--output-length", "4", "--max-parallel", "3",
                                    "--request-rate", "inf", "--no-progress", "--api-key", API_KEY])
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(multiturn.run(args, url)))
    thread.start()
    thread.join(300)
    assert out and out["summary"]["completed"] == clients * rounds, out.get("errors")
    return out


def dashboard_data(server, since: float = 0.0) -> dict:
    r = server.get(f"/dashboard/data?since={since}")
    assert r.status_code == 200, r.text
    return r.json()


def tier_hits_from_metrics(text: str) -> dict[str, int]:
    """Hit tokens per tier from /metrics: `kvstrata:cached_tokens_total{tier=...}` where the server has it,
    else the flattened scheduler gauges."""
    labelled = re.findall(r'^kvstrata:cached_tokens_total\{[^}]*tier="(\w+)"[^}]*\} (\S+)$', text, re.M)
    if labelled:
        return {tier: int(float(value)) for tier, value in labelled}

    def gauge(name: str) -> int:
        match = re.search(rf"^kvstrata_scheduler_{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        assert match, f"{name} not in /metrics"
        return int(float(match.group(1)))

    return {tier: gauge(f"{tier}_hit_tokens") for tier in ("device", "host", "storage")}


# ---------------------------------------------------------------------- the JSON endpoint
def test_page_is_open_and_its_data_needs_the_api_key(tiered):
    page = requests.get(tiered.url + "/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script>" in page.text and "<style>" in page.text
    # (the SVG namespace is a name, not an address: nothing is fetched from it)
    assert not re.search(r'https?://(?!www\.w3\.org/2000/svg")|\bsrc=|@import', page.text), \
        "the page must load nothing from elsewhere"
    assert requests.get(tiered.url + "/dashboard/data", timeout=30).status_code == 401
    bad = tiered.get("/dashboard/data?since=yesterday")
    assert bad.status_code == 400 and "since" in bad.json()["error"]["message"]


def test_polling_fast_asks_the_scheduler_at_most_once_per_interval(tiered):
    first = dashboard_data(tiered)
    start = time.monotonic()
    rows = [dashboard_data(tiered, first["rows"][-1][0])["rows"] for _ in range(10)]
    elapsed = time.monotonic() - start
    new = sum(len(r) for r in rows)
    assert new <= elapsed / 0.95 + 1, (new, elapsed)


def test_totals_equal_the_scheduler_counters_and_minute_adds_up(tiered):
    since = dashboard_data(tiered)["rows"][-1][0]
    run_workload(tiered.url, clients=3, rounds=2)
    state = tiered.wait_idle()
    time.sleep(1.0)                  # let the next poll take a fresh sample
    data = dashboard_data(tiered, since)
    totals, columns = data["totals"], data["columns"]
    assert data["tiers"] == ["device", "host"]
    assert totals["prompt_tokens"] == state["prompt_tokens"] > 0
    assert totals["device_hit_tokens"] == state["device_hit_tokens"] > 0
    assert totals["host_hit_tokens"] == state["host_hit_tokens"]
    assert totals["storage_hit_tokens"] == state["storage_hit_tokens"]
    tiers = totals["device_hit_tokens"] + totals["host_hit_tokens"] + totals["storage_hit_tokens"]
    assert tiers == totals["cached_tokens"] == state["cached_tokens"]
    minute = data["minute"]
    assert minute["device"] > 0 and minute["computed"] > 0 and 0 < minute["span_s"] <= 60.5, minute
    last = dict(zip(columns, data["rows"][-1]))
    capacity = state["capacity_pages"] * state["page_size"]
    pool = last["device_running_tokens"] + last["device_evictable_tokens"] + last["device_free_tokens"]
    assert pool == capacity and last["running"] == 0 and last["queued"] == 0
    assert any(dict(zip(columns, row))["hit_device"] for row in data["rows"]), "no hit rate sampled"


def test_engine_utilization_in_state_and_metrics(tiered):
    before = tiered.scheduler_state()["forward_busy_s"]
    body = {"input_ids": list(range(10, 40)), "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    done = threading.Event()
    worker = threading.Thread(target=lambda: (tiered.post("/generate", json=body), done.set()))
    worker.start()
    seen = 0.0
    while not done.is_set() and seen <= 0.05:
        seen = max(seen, tiered.scheduler_state()["engine_utilization"])
        time.sleep(0.2)
    worker.join(120)
    assert 0.05 < seen <= 1.0
    assert tiered.scheduler_state()["forward_busy_s"] > before
    text = tiered.get("/metrics").text
    assert re.search(r"^kvstrata:engine_utilization\{[^}]*\} [0-9.e-]+$", text, re.M), text[-2000:]


# ---------------------------------------------------------------------- in a browser
@requires_chromium
def test_browser_shows_device_and_host_hits_equal_to_metrics(tiered, tmp_path):
    with chromium_page(tmp_path / "profile") as (page, errors):
        page.goto(f"{tiered.url}/dashboard?key={API_KEY}")
        page.wait_for_function("document.getElementById('status').dataset.updates >= 1", timeout=30_000)
        assert "key=" not in page.url, "the API key stays in the address bar"
        run_workload(tiered.url)
        tiered.wait_idle()
        hits = tier_hits_from_metrics(tiered.get("/metrics").text)
        assert hits["device"] > 0 and hits["host"] > 0, hits
        shown = "({device: document.getElementById('stat-device').dataset.value," \
                " host: document.getElementById('stat-host').dataset.value})"
        expected = {"device": str(hits["device"]), "host": str(hits["host"])}
        try:
            page.wait_for_function(f"JSON.stringify({shown}) === '{_js_json(expected)}'", timeout=30_000)
        finally:
            screenshot(page, "dashboard.png")
        assert page.inner_text("#stat-device") == f"{hits['device']:,}"
        assert page.inner_text("#stat-host") == f"{hits['host']:,}"
        assert page.locator("#chart-hit path").count() >= 2, "the hit-rate chart drew no lines"
        assert page.locator("#chart-minute rect").count() >= 2, "the minute bar has no device and host parts"
        assert page.locator("#card-host").is_visible()
        assert not errors, errors


def _js_json(d: dict) -> str:
    return "{" + ",".join(f'"{k}":"{v}"' for k, v in d.items()) + "}"


def test_bench_dashboard_runs_both_modes(tiered):
    from kvstrata.bench import dashboard_overhead

    args = dashboard_overhead.build_parser().parse_args(
        ["--streams", "2", "--output-len", "8", "--repeat", "1", "--idle-s", "1.5", "--api-key", API_KEY])
    result = dashboard_overhead.run(args, tiered.url)
    for mode in ("none", "poll"):
        assert result["tok_s"][mode][0] > 0 and result["cpu_ms_per_token"][mode][0] > 0
    # Idle, a polled scheduler answers the dashboard's samples (one a second, whoever polls): time that the
    # per-thread nanosecond counters see. An unpolled one may sleep the whole interval, but never uses more
    # than every core.
    assert 0 < result["idle_cpu_ms_per_s"]["poll"][0] <= 1000 * os.cpu_count()
    assert 0 <= result["idle_cpu_ms_per_s"]["none"][0] <= 1000 * os.cpu_count()
    assert result["polls"] >= 10 and result["rows"] > 0 and result["poll_errors"] == 0
    assert "poller at 10 Hz" in dashboard_overhead.report(result, args)
