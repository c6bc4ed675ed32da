"""The comparison table, the targets and the chart, from hand-made summaries."""

from __future__ import annotations

import argparse
import math

from kvstrata.bench import accounting, compare, report


def summary(hit, ideal, mean_ttft, p90_ttft, tput, failed=0, util=float("nan")):
    return {"cache_hit_rate": hit, "ideal_hit_rate": ideal, "hit_rate_vs_ideal": hit / ideal,
            "mean_ttft": mean_ttft, "p90_ttft": p90_ttft, "input_throughput": tput, "failed": failed,
            "engine_busy": util}


ROWS = [
    {"key": "l1", "name": "L1 only (device)", "summary": summary(0.12, 0.80, 6.0, 12.0, 1000.0)},
    {"key": "l2", "name": "L1+L2 (host DRAM)", "summary": summary(0.40, 0.80, 3.0, 9.0, 1500.0, util=0.654)},
    {"key": "l3", "name": "L1+L2+L3 (file)", "summary": summary(0.78, 0.80, 2.0, 6.0, 2500.0)},
    {"key": "mooncake", "name": "L1+L2+L3 (Mooncake)", "error": "Mooncake not available: no module"},
]


def test_compare_table_has_the_seed_shape_and_changes_against_l1():
    table = report.compare_table(ROWS).splitlines()
    assert table[0] == ("| Config | KV cache hit rate | Hit rate / ideal | Mean TTFT (s) | P90 TTFT (s) | "
                        "Input tok/s | Failed | Engine busy |")
    assert table[2] == "| L1 only (device) | 12.0% | 15.0% | 6.000 | 12.000 | 1,000.0 | 0 | n/a |"
    assert table[3] == ("| L1+L2 (host DRAM) | 40.0% | 50.0% | 3.000 (-50.0%) | 9.000 (-25.0%) | "
                        "1,500.0 (+50.0%) | 0 | 65.4% |")
    assert "did not complete: Mooncake not available" in table[5]


def test_targets_are_judged_on_the_deepest_tier_that_ran():
    lines = compare.targets(ROWS)
    assert lines[0] == "Targets (L1+L2+L3 (file) vs L1 only):"
    assert "97.5% (target >= 95%): met" in lines[1]
    assert "0.33x L1 only (target <= 0.40x): met" in lines[2]
    assert "2.50x L1 only (target >= 2.00x): met" in lines[3]
    assert "not evaluated" in compare.targets(ROWS[1:])[0]


def test_markdown_and_chart_are_written(tmp_path):
    args = argparse.Namespace(model_path="bench", device_tokens=2048, page_size=16, hicache_ratio=2.0,
                              num_clients=16, num_rounds=8, request_length=48, sub_question_input_length=0,
                              output_length=1, max_parallel=4, request_rate=16.0, enable_round_barrier=True,
                              seed=1, repeat=1)
    md = compare.render_markdown(ROWS, "kvstrata bench compare", "2026-01-01T00:00:00", "2 cores", args)
    assert "Ideal hit rate of the workload (infinite cache): 80.0%" in md
    path = tmp_path / "chart.png"
    report.plot_compare(ROWS, str(path), title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeated_runs_merge_into_medians():
    def run(ttft, tput, r0):
        return {"key": "l1", "name": "L1", "summary": summary(0.1, 0.5, ttft, 2 * ttft, tput),
                "rounds": [{"round": 0, "mean_ttft": r0}], "tiers": {"device_hit_tokens": int(tput)}}

    merged = compare.merge_runs([run(1.0, 100.0, 0.5), {"key": "l1", "name": "L1", "error": "crashed"},
                                 run(3.0, 300.0, 0.7), run(2.0, 150.0, 0.9)])
    assert (merged["runs"], merged["runs_failed"]) == (3, 1)
    assert merged["summary"]["mean_ttft"] == 2.0 and merged["summary"]["input_throughput"] == 150.0
    assert merged["rounds"][0]["mean_ttft"] == 0.7 and merged["tiers"]["device_hit_tokens"] == 150
    failed = [{"key": "l2", "name": "L2", "error": "did not start"}]
    assert compare.merge_runs(failed) is failed[0]


def test_engine_busy_is_forward_seconds_over_wall_seconds():
    def info(busy):
        return {"internal_states": [{"forward_busy_s": busy}]}

    assert accounting.engine_busy(info(1.5), info(4.0), 5.0) == 0.5
    assert math.isnan(accounting.engine_busy({"internal_states": [{}]}, info(4.0), 5.0))
    assert math.isnan(accounting.engine_busy(None, None, 5.0))
