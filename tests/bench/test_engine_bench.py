"""`kvstrata bench engine` runs end to end on the tiny model and prints its numbers (not a timing test)."""

from __future__ import annotations

import json

from kvstrata.bench.engine_bench import main


def test_engine_bench_smoke(capsys):
    assert main(["--model-path", "tiny", "--dtype", "float32", "--context", "64", "--decode-tokens", "4",
                 "--streams", "2", "--repeat", "1", "--threads", "1", "--enable-deterministic-inference"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    ours = result["kvstrata"]
    assert ours["ttft_s"] > 0 and ours["decode_tok_s_1"] > 0 and ours["decode_tok_s_multi"] > 0
    assert result["transformers"]["forward_s"] > 0 and "ttft_vs_transformers_forward" in result
    assert result["kvstrata_deterministic"]["decode_tok_s_multi"] > 0
    assert result["deterministic_cost"]["ttft_ratio"] > 0
