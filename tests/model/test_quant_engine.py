"""A quantized checkpoint through the whole engine in deterministic mode: greedy output identical with no
cache, L1, L2 and L2 + file L3 (the tiny model's shape as GPTQ, asymmetric, int4 on torch's CPU kernel)."""

from __future__ import annotations

import pytest

from tests.model.quant_ckpt import write_quantized
from tests.runtime.helpers import assert_greedy_identical_across_tiers


@pytest.fixture(scope="module")
def gptq_model(tmp_path_factory) -> str:
    quant_dir, _ = write_quantized("gptq-asym", tmp_path_factory.mktemp("quant-engine"))
    return str(quant_dir)


def _is_gptq(engine) -> None:
    assert engine.server_args.quantization == "gptq"   # from the checkpoint's config, no flag


def test_greedy_identical_without_cache_and_with_l1_l2_l3(gptq_model, tmp_path):
    # bf16 in deterministic mode (make_engine)
    assert_greedy_identical_across_tiers(str(tmp_path / "l3"), check=_is_gptq, model_path=gptq_model,
                                         dtype="bfloat16")
