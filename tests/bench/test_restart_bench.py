"""`kvstrata bench restart` on the tiny model: a plain restart starts cold, the L2 snapshot brings the hits back."""

from __future__ import annotations

import argparse

from kvstrata.bench.restart_bench import build_parser, format_results, run_mode


def test_snapshot_restart_keeps_the_hits_a_cold_restart_loses(tmp_path):
    args: argparse.Namespace = build_parser().parse_args(
        ["--model-path", "tiny", "--num-clients", "2", "--request-length", "64", "--question-length", "8",
         "--output-length", "4"])
    flags = ["--max-total-tokens", "1024", "--log-level", "warning"]
    results = [run_mode(args, mode, flags, str(tmp_path / mode)) for mode in ("cold", "snapshot")]
    cold, snap = results
    assert cold["failed"] == 0 and snap["failed"] == 0
    assert cold["hit_rate"] == 0 and cold["snapshot_pages"] == 0
    assert snap["hit_rate"] > 0.8 and snap["snapshot_pages"] > 0, snap
    table = format_results(results)
    assert table.count("\n") == 3 and "| snapshot | 0 |" in table
