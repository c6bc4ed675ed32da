"""`kvstrata bench engine` runs end to end on the tiny model and prints its numbers (not a timing test)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvstrata.bench.engine_bench import main


def test_engine_bench_smoke(capsys):
    assert main(["--model-path", "tiny", "--dtype", "float32", "--context", "64", "--decode-tokens", "4",
                 "--streams", "2", "--repeat", "1", "--threads", "1", "--enable-deterministic-inference"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    ours = result["kvstrata"]
    assert ours["ttft_s"] > 0 and _rate(ours["decode_tok_s_1"]) and _rate(ours["decode_tok_s_multi"])
    assert _rate(result["multi_over_single_decode"]) and "2 / 1" in out
    assert result["transformers"]["forward_s"] > 0 and "ttft_vs_transformers_forward" in result
    assert _rate(result["kvstrata_deterministic"]["decode_tok_s_multi"])
    assert result["deterministic_cost"]["ttft_ratio"] > 0
    assert "host_tier" not in ours


def test_engine_bench_with_the_host_tier_backs_up_while_decoding(capsys):
    assert main(["--model-path", "tiny", "--dtype", "float32", "--context", "64", "--decode-tokens", "4",
                 "--streams", "2", "--repeat", "1", "--threads", "1", "--skip-transformers",
                 "--enable-hierarchical-cache"]) == 0
    out = capsys.readouterr().out
    ours = json.loads(out[: out.rindex("}") + 1])["kvstrata"]
    assert _rate(ours["decode_tok_s_1"]) and _rate(ours["decode_tok_s_multi"])
    # write-through: at least the three 64-token prompts of the rates were copied to the host pool
    assert ours["host_tier"]["backup_pages"] >= 3 * 64 and ours["host_tier"]["backup_ops"] > 0


def _rate(value: float) -> bool:
    """A measured rate: finite and positive (tokens over a wall-clock interval, never a difference of two)."""
    return math.isfinite(value) and value > 0


def test_engine_bench_compares_slot_runs_with_slot_by_slot_and_the_outputs_match(capsys):
    assert main(["--model-path", "tiny", "--dtype", "float32", "--context", "16", "--decode-tokens", "24",
                 "--streams", "3", "--repeat", "2", "--threads", "1", "--compare-kv-runs"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    assert result["kv_run_spare_tokens"] == {"runs": 128, "slot_by_slot": 0}
    assert all(_rate(r) for r in result["decode_tok_s"].values()) and len(result["slot_by_slot_over_runs_time"]) == 2
    assert result["same_outputs"] is True and "same outputs: True" in out


def test_load_back_bench_hits_the_host_tier_for_the_whole_prefix(capsys):
    assert main(["--model-path", "tiny", "--dtype", "float32", "--context", "96", "--suffix", "16",
                 "--repeat", "1", "--threads", "1", "--load-back", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    (row,) = result["rounds"]
    # The filler pushed the prefix out of the device pool; the timed prompt found all of it in L2.
    assert row["host_hit_tokens"] == 96 and row["load_back_bytes"] > 0 and row["load_back_busy_s"] > 0
    assert min(row["l1_s"], row["l2_s"], row["cold_s"]) > 0 and "L2 - L1" in out


def test_load_back_is_a_measurement_of_its_own(capsys):
    with pytest.raises(SystemExit):
        main(["--load-back", "--profile"])
    assert "--load-back is a measurement of its own" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["bench", "bench-moe"])
def test_engine_bench_runs_on_dummy_weights_from_a_config_only_folder(shape, tmp_path, capsys):
    """`--load-format dummy`: a built-in's shape (dense, and the peers' Qwen3-MoE) from its config.json alone
    (no weights, no tokenizer)."""
    from kvstrata.model.builtin import resolve_model_path

    (tmp_path / "config.json").write_text((Path(resolve_model_path(shape)) / "config.json").read_text())
    assert main(["--model-path", str(tmp_path), "--load-format", "dummy", "--dtype", "float32", "--context", "32",
                 "--decode-tokens", "4", "--streams", "2", "--repeat", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    assert result["kvstrata"]["ttft_s"] > 0 and _rate(result["kvstrata"]["decode_tok_s_1"])
    assert "transformers" not in result          # it needs the weights: skipped
