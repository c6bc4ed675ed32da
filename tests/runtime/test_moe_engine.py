"""A mixture-of-experts model through the whole engine: every cache tier, batch invariance, structured output,
the L2 snapshot and the KV namespace (a tiny Qwen3-MoE with the tiny model's tokenizer)."""

from __future__ import annotations

import json
import random

import pytest

from kvstrata.cache.storage_io import model_identity
from kvstrata.model.builtin import resolve_model_path
from tests.cache.drivers import SMALL_TIERS, run_conversations
from tests.cache.snapshot_turns import L2, first_round, turn
from tests.model.hf_ckpt import write_servable_moe_checkpoint
from tests.runtime.determinism import check_alone_equals_in_batches
from tests.runtime.helpers import NUMERIC_DTYPES, assert_idle_integrity, make_engine

# A pool the conversations overflow, so turns load their history back from L2 (or L3).

@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return write_servable_moe_checkpoint(str(tmp_path_factory.mktemp("tiny-moe")))


@pytest.fixture(scope="module", params=NUMERIC_DTYPES)
def dtype(request) -> str:
    return request.param


def _conversations(moe_model: str, dtype: str, **kwargs) -> tuple[list[list[int]], list[dict], dict]:
    """(outputs, metas, idle state) of the conversations on a fresh engine."""
    engine = make_engine(model_path=moe_model, dtype=dtype, **kwargs)
    try:
        outputs, metas = run_conversations(engine)
        state = assert_idle_integrity(engine)
        return outputs, metas, state
    finally:
        engine.shutdown()


def test_greedy_identical_without_cache_and_with_l1_l2_l3(moe_model, dtype, tmp_path):
    reference, _, _ = _conversations(moe_model, dtype, disable_radix_cache=True)
    assert len({tuple(o) for o in reference}) > 1, "outputs should depend on the prompt"
    l1, _, l1_state = _conversations(moe_model, dtype)
    assert l1 == reference and l1_state["device_hit_tokens"] > 0
    l2, _, l2_state = _conversations(moe_model, dtype, **SMALL_TIERS)
    assert l2 == reference and l2_state["host_hit_tokens"] > 0
    l3 = {**SMALL_TIERS, "hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path / "l3")}
    _conversations(moe_model, dtype, **l3)            # fills L3
    again, _, l3_state = _conversations(moe_model, dtype, **l3)   # a new engine: prompts found in L3
    assert again == reference and l3_state["storage_hit_tokens"] > 0


def test_deterministic_request_alone_equals_it_in_batches_of_8_and_32(moe_model, dtype):
    engine = make_engine(model_path=moe_model, dtype=dtype, enable_deterministic_inference=True,
                         chunked_prefill_size=64, max_total_tokens=16384, page_size=16)
    try:
        check_alone_equals_in_batches(engine, random.Random(46), dtype, trials=2)
    finally:
        engine.shutdown()


def test_structured_output(moe_model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    engine = make_engine(model_path=moe_model, dtype="bfloat16")
    try:
        out = engine.generate(prompt="Person:", sampling_params={"json_schema": json.dumps(schema),
                                                                  "temperature": 0, "max_new_tokens": 64})
        assert set(json.loads(out["text"])) == {"name", "age"}
        out = engine.generate(prompt="Date:", sampling_params={"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]",
                                                                "temperature": 0, "max_new_tokens": 16})
        assert len(out["text"]) == 10 and out["text"][4] == "-"
    finally:
        engine.shutdown()


def test_l2_snapshot_restores_after_restart(moe_model, tmp_path):
    path = str(tmp_path / "l2.snapshot")
    before = make_engine(model_path=moe_model, hicache_snapshot_path=path, **L2)
    try:
        histories = first_round(before)
    finally:
        before.shutdown()
    after = make_engine(model_path=moe_model, hicache_snapshot_path=path, **L2)
    try:
        loaded = after.get_server_info()["internal_states"][0]["hicache"]["snapshot"]["last_load"]
        assert loaded["pages"] > 0 and not loaded["rejected"], loaded
        _, meta = turn(after, histories[0], "And then?")
        assert meta["cached_tokens"] >= 0.9 * len(histories[0]), meta
        assert_idle_integrity(after)
    finally:
        after.shutdown()


def test_kv_namespace_separates_moe_and_dense_weights(moe_model):
    tiny = resolve_model_path("tiny")
    assert model_identity(moe_model) != model_identity(tiny)
