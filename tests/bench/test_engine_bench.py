"""`kvstrata bench engine` runs end to end on the tiny model and prints its numbers (not a timing test)."""

from __future__ import annotations

import json
import math

from kvstrata.bench.engine_bench import main


def test_engine_bench_smoke(capsys):
    assert main(["--model-path", "tiny", "--dtype", "float32", "--context", "64", "--decode-tokens", "4",
                 "--streams", "2", "--repeat", "1", "--threads", "1", "--enable-deterministic-inference"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[: out.rindex("}") + 1])
    ours = result["kvstrata"]
    assert ours["ttft_s"] > 0 and _rate(ours["decode_tok_s_1"]) and _rate(ours["decode_tok_s_multi"])
    assert result["transformers"]["forward_s"] > 0 and "ttft_vs_transformers_forward" in result
    assert _rate(result["kvstrata_deterministic"]["decode_tok_s_multi"])
    assert result["deterministic_cost"]["ttft_ratio"] > 0


def _rate(value: float) -> bool:
    """A positive rate, or NaN: on a loaded machine the prefill time can swamp a 4-token decode."""
    return math.isnan(value) or value > 0
