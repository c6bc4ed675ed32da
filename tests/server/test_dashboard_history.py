"""DashboardHistory from hand-made scheduler states: rates over the window, `since`, absent tiers."""

from __future__ import annotations

import pytest

from kvstrata.server.dashboard import COLUMNS, DashboardHistory, LatencyRecorder


def state(prompt: int, device: int, host: int, storage: int = 0, busy: float = 0.0, **extra) -> dict:
    """A scheduler state of a server with a host tier; each hit counted once, in its tier."""
    return {"running_requests": 1, "waiting_requests": 2, "capacity_pages": 10, "free_pages": 4, "page_size": 16,
            "evictable_tokens": 32, "prompt_tokens": prompt, "cached_tokens": device + host + storage,
            "device_hit_tokens": device, "host_hit_tokens": host, "storage_hit_tokens": storage,
            "generated_tokens": 0, "engine_utilization": busy,
            "hicache": {"host_capacity_pages": 20, "host_used_pages": 5, "load_back_bytes": 0, "backup_bytes": 0,
                        "failed_ops": 0}, **extra}


def rows(history: DashboardHistory, since: float = 0.0) -> list[dict]:
    return [dict(zip(COLUMNS, row)) for row in history.payload(since)["rows"]]


def test_rates_are_over_the_window_and_pool_splits_add_up():
    h = DashboardHistory(None, LatencyRecorder())
    h.add(state(0, 0, 0), 1000.0)
    h.add(state(100, 30, 15, storage=5), 1002.0)
    h.add(state(300, 130, 65, storage=5, busy=0.5), 1006.0)
    last = rows(h)[-1]
    # 1006 - 5 s window: the newest sample at or before 1001 is the one at 1000.
    assert last["hit_device"] == pytest.approx(130 / 300, rel=1e-3)
    assert last["hit_host"] == pytest.approx(65 / 300, rel=1e-3)
    assert last["hit_storage"] == pytest.approx(5 / 300, rel=1e-3)
    assert last["hit_overall"] == pytest.approx(200 / 300, rel=1e-3)
    assert last["prompt_tps"] == pytest.approx(50.0, rel=1e-3)
    assert (last["device_running_tokens"], last["device_evictable_tokens"], last["device_free_tokens"]) == (64, 32, 64)
    assert (last["host_used_pages"], last["host_free_pages"], last["engine_util"]) == (5, 15, 0.5)
    assert last["storage_backup_Bps"] is None and last["storage_corrupt_pages"] is None   # no L3 tier
    payload = h.payload(0)
    assert payload["tiers"] == ["device", "host"]
    assert payload["minute"] == {"device": 130, "host": 65, "storage": 5, "computed": 100, "span_s": 6.0}


def test_since_returns_only_newer_rows_exactly():
    h = DashboardHistory(None, LatencyRecorder())
    for t in (1000.0004, 1001.0006, 1002.0001):
        h.add(state(0, 0, 0), t)
    stamps = [r["t"] for r in rows(h)]
    assert stamps == [1000.0, 1001.001, 1002.0]
    assert rows(h, stamps[1]) == rows(h)[2:]
    assert rows(h, stamps[-1]) == []


def test_no_prompt_tokens_means_no_hit_rate_and_first_sample_has_no_rates():
    h = DashboardHistory(None, LatencyRecorder())
    h.add(state(50, 10, 0), 1000.0)
    h.add(state(50, 10, 0), 1001.0)
    first, second = rows(h)
    assert first["prompt_tps"] is None and first["hit_device"] is None
    assert second["prompt_tps"] == 0 and second["hit_device"] is None
