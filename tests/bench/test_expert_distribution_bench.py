"""`kvstrata bench expert-distribution` records a MoE model's rows per expert and writes what
--init-expert-location reads (not a timing test)."""

from __future__ import annotations

import json

from kvstrata.bench.expert_distribution import balances, main
from kvstrata.model.expert_location import ExpertPlacement


def test_balances_compare_placements_prompt_by_prompt():
    # one layer, 4 experts; prompt 1 loads experts 0-1 (rank 0's), prompt 2 experts 2-3 (rank 1's)
    counts = [[[30, 30, 2, 2]], [[2, 2, 30, 30]]]
    got = balances(counts, ep_size=2, redundant=2)
    assert abs(got["trivial"] - 60 / 32) < 1e-9                  # the busy rank: 60 of 64 rows, twice
    assert got["trivial + 2 copies"] < got["trivial"]            # experts 0-1 copied: prompt 1 evens out
    assert abs(got["balanced + 2 copies"] - 1.0) < 1e-9          # the summed counts put one busy expert per rank


def test_expert_distribution_bench_records_and_writes_a_placement_file(tmp_path, capsys):
    out = tmp_path / "loads.json"
    assert main(["--model-path", "bench-moe", "--context", "32", "--prompts", "2", "--threads", "1",
                 "--ep-num-redundant-experts", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed[: printed.rindex("}") + 1])
    assert set(result["busiest_rank_over_mean"]) == {"trivial", "trivial + 4 copies", "balanced + 4 copies"}
    assert all(v >= 1.0 for v in result["busiest_rank_over_mean"].values())
    counts = json.loads(out.read_text())["logical_count"]
    assert len(counts) == 8 and all(sum(layer) == 2 * 32 * 4 for layer in counts)   # 2 prefills x 32 tokens x top 4
    placement = ExpertPlacement.of(str(out), layers=8, experts=32, ep_size=2, redundant=4)
    assert placement.local_slots == 18
