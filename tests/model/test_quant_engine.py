"""A quantized checkpoint through the whole engine in deterministic mode: greedy output identical with no
cache, L1, L2 and L2 + file L3 (the tiny model's shape as GPTQ, asymmetric, int4 on torch's CPU kernel)."""

from __future__ import annotations

import pytest

from tests.cache.drivers import SMALL_TIERS, run_conversations
from tests.model.quant_ckpt import write_quantized
from tests.runtime.helpers import assert_idle_integrity, make_engine


@pytest.fixture(scope="module")
def gptq_model(tmp_path_factory) -> str:
    quant_dir, _ = write_quantized("gptq-asym", tmp_path_factory.mktemp("quant-engine"))
    return str(quant_dir)


def _conversations(model: str, **kwargs) -> tuple[list[list[int]], dict]:
    engine = make_engine(model_path=model, dtype="bfloat16", **kwargs)   # deterministic mode (make_engine)
    try:
        assert engine.server_args.quantization == "gptq"   # from the checkpoint's config, no flag
        outputs, _ = run_conversations(engine, rounds=2)
        return outputs, assert_idle_integrity(engine)
    finally:
        engine.shutdown()


def test_greedy_identical_without_cache_and_with_l1_l2_l3(gptq_model, tmp_path):
    reference, _ = _conversations(gptq_model, disable_radix_cache=True)
    assert len({tuple(o) for o in reference}) > 1, "outputs should depend on the prompt"
    l1, l1_state = _conversations(gptq_model)
    assert l1 == reference and l1_state["device_hit_tokens"] > 0
    l2, l2_state = _conversations(gptq_model, **SMALL_TIERS)
    assert l2 == reference and l2_state["host_hit_tokens"] > 0
    l3 = {**SMALL_TIERS, "hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path / "l3")}
    _conversations(gptq_model, **l3)                     # fills L3
    again, l3_state = _conversations(gptq_model, **l3)   # a new engine: prompts found in L3
    assert again == reference and l3_state["storage_hit_tokens"] > 0
