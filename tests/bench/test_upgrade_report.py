"""`kvstrata bench upgrade`'s accounting: windows by send time, phases around the upgrade, targets."""

import math

from kvstrata.bench.accounting import RequestRecord
from kvstrata.bench.upgrade_bench import format_result, summarize, window_rows


def rec(t, ok=True, prompt=100, cached=90, ttft=0.1):
    return RequestRecord(client=0, round=0, prompt_ids=[1] * prompt, send_time=t, finish_time=t + 0.5,
                         ttft=ttft if ok else None, prompt_tokens=prompt if ok else 0,
                         cached_tokens=cached if ok else 0, error=None if ok else "HTTP 503: down")


def test_windows_count_by_send_time():
    records = [rec(1), rec(2, cached=50), rec(11, ok=False), rec(25, ttft=1.0)]
    rows = window_rows(records, 10)
    assert [r["start_s"] for r in rows] == [0, 10, 20]
    assert (rows[0]["ok"], rows[0]["failed"], rows[0]["hit_rate"]) == (2, 0, 0.7)
    assert (rows[1]["ok"], rows[1]["failed"]) == (0, 1) and math.isnan(rows[1]["hit_rate"])
    assert rows[2]["p99_ttft"] == 1.0


def test_phases_and_targets():
    records = [rec(t, ttft=0.1) for t in range(0, 30)] + [rec(t, ttft=0.15) for t in range(30, 40)]
    records += [rec(t, cached=95) for t in range(40, 100)]
    res = summarize("in-place", records, {"upgrade_start": 30.0, "upgrade_end": 40.0}, 10)
    assert res["failed"] == 0 and res["targets"]["zero_failed"]
    assert res["before"]["ok"] == 30 and res["during"]["ok"] == 10 and res["after"]["ok"] == 60
    assert abs(res["targets"]["hit_rate_after_vs_before"] - 95 / 90) < 1e-9
    assert abs(res["targets"]["p99_during_vs_steady"] - 1.5) < 1e-9
    text = format_result(res)
    assert "| 30 | 10 | 0 | 90.0% |" in text and "target <= 2x" in text


def test_failures_are_reported():
    res = summarize("naive", [rec(1), rec(31, ok=False)], {"upgrade_start": 30.0, "upgrade_end": 35.0}, 10)
    assert res["failed"] == 1 and not res["targets"]["zero_failed"]
    assert res["errors"] == ["HTTP 503: down"]
