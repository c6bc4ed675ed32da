"""`kvstrata bench gguf-kernels --model-path FILE`: a decode step's products against the read bandwidth."""

from __future__ import annotations

import pytest

from tests.capabilities import requires_cpu_kernels
from tests.model.gguf_files import write_tiny_gguf


@requires_cpu_kernels
def test_stream_rounds_time_every_quantized_weight_of_the_file(tmp_path):
    from kvstrata.bench.gguf_kernels import stream_rounds
    from kvstrata.model.builtin import resolve_model_path
    from kvstrata.model.config import ModelConfig
    from kvstrata.model.quant.gguf_blocks import FORMATS

    path, folder = write_tiny_gguf(str(tmp_path), "Q8_0")
    config = ModelConfig.from_path(resolve_model_path(folder))
    q8_0 = next(f for f in FORMATS.values() if f.name == "Q8_0")
    # every matrix of the tiny model is Q8_0; a decode step multiplies attention's, the MLP's and the lm_head's
    # (tied or not), not the input embedding's
    per_layer = (config.hidden_size * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
                 + 3 * config.hidden_size * config.intermediate_size)
    values = config.num_layers * per_layer + config.vocab_size * config.hidden_size
    rounds = stream_rounds(path, threads=1, rounds=2, repeat=1, read_mb=8)
    assert len(rounds) == 2
    for r in rounds:
        assert r["step_mb"] == pytest.approx(values // q8_0.block_size * q8_0.type_size / 1e6)
        assert r["read_gb_s"] > 0 and r["products_gb_s"] > 0
        assert r["short"] == pytest.approx(r["read_gb_s"] / r["products_gb_s"])
