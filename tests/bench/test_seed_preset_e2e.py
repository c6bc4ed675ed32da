"""`kvstrata bench compare --preset seed` at a small --scale: the seed's shape (10 rounds, round barrier, random
ready queue, 16 requests/s, 4 in parallel) on all four configurations, with real servers and a real Mooncake
master and store on 127.0.0.1. The one expensive bench test: four server starts and ~50 requests each."""

from __future__ import annotations

import json

from kvstrata.bench import compare

SCALE = "0.03"      # 5 conversations x 10 rounds of 61-token questions: 619-token last prompts


def test_seed_preset_small_scale_three_tiers_beat_l1_only(mooncake_env, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    rc = compare.main(["--preset", "seed", "--scale", SCALE, "--model-path", "tiny", "--out-dir", str(out),
                       "--no-progress", "--log-level", "warning"])
    assert rc == 0
    rows = {r["key"]: r for r in map(json.loads, (out / "compare.jsonl").read_text().splitlines())}
    assert set(rows) == {"l1", "l2", "l3", "mooncake"}
    for key, row in rows.items():
        assert "error" not in row, (key, row.get("error"))
        w, s = row["workload"], row["summary"]
        assert (w["num_rounds"], w["max_parallel"], w["request_rate"]) == (10, 4, 16.0)
        assert w["enable_round_barrier"] and w["ready_queue_policy"] == "random"
        assert (s["completed"], s["failed"]) == (w["num_clients"] * 10, 0)
        assert row["cache"]["integrity_ok"] is True
        assert row["cache"]["steps"] > 0 and row["cache"]["empty_steps"] >= 0
    l1, top = rows["l1"]["summary"], rows["mooncake"]["summary"]
    assert top["cache_hit_rate"] > l1["cache_hit_rate"]
    assert top["hit_rate_vs_ideal"] >= 0.95
    # No TTFT comparison: at this scale the tiers' TTFT gain (~20% on `bench`, none on `tiny`) is inside a
    # loaded machine's noise; the hit rate above is the compute saved, and timings are the benchmark's job
    # (docs/benchmarks.md, Issue 51).
    file_l3 = rows["l3"]["cache"]
    assert file_l3["l3_objects"] > 0 and file_l3["l3_bytes"] > 0
    assert rows["l1"]["cache"]["l1_hit_tokens"] == l1["cached_tokens"]
    md = (out / "compare.md").read_text()
    assert "What the seed's table cannot show" in md and "Preset `seed` at scale 0.03" in md
