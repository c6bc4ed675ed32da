"""RadixAttention through the Engine: reuse is reported, outputs never change, pressure and flush are safe."""

from __future__ import annotations

import pytest

from tests.runtime.helpers import NUMERIC_DTYPES, assert_idle_integrity, make_engine

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SYSTEM = "You are a careful assistant. Answer briefly and cite the page and slot you used. " * 2
QUESTIONS = ["What is a page?", "Why share prefixes?", "What is a slot?", "How big is the pool?",
             "Who evicts?", "When to retract?", "Is it fast?", "Why radix trees?"]


def multi_turn(engine, turns: int = 4) -> tuple[list[list[int]], list[dict]]:
    history = engine.tokenizer.encode(SYSTEM, add_special_tokens=False)
    outputs, metas = [], []
    for t in range(turns):
        prompt = history + engine.tokenizer.encode(QUESTIONS[t], add_special_tokens=False)
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        outputs.append(out["output_ids"])
        metas.append({"previous": len(history), **out["meta_info"]})
        history = prompt + out["output_ids"]
    return outputs, metas


@pytest.fixture(scope="module", params=NUMERIC_DTYPES)
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(dtype):
    eng = make_engine(disable_radix_cache=True, dtype=dtype)
    try:
        shared = [o["output_ids"] for o in eng.generate([SYSTEM + q for q in QUESTIONS], GREEDY)]
        return multi_turn(eng)[0], shared
    finally:
        eng.shutdown()


@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_on_equals_cache_off(reference, dtype, page_size):
    turns_ref, shared_ref = reference
    eng = make_engine(page_size=page_size, chunked_prefill_size=64, dtype=dtype)
    try:
        outputs, metas = multi_turn(eng)
        assert outputs == turns_ref
        for m in metas[1:]:
            # turn r finds the whole previous turn (prompt + output, up to the last page boundary)
            assert m["cached_tokens"] >= m["previous"] - 1 - page_size + 1, m
        shared = eng.generate([SYSTEM + q for q in QUESTIONS], GREEDY)
        assert [o["output_ids"] for o in shared] == shared_ref
        # the shared system prompt is computed once and then reused by the others
        assert sum(o["meta_info"]["cached_tokens"] > 0 for o in shared) >= len(QUESTIONS) - 1
        assert_idle_integrity(eng)
    finally:
        eng.shutdown()


def test_same_prompt_twice_is_cached():
    eng = make_engine(page_size=4)
    try:
        first = eng.generate(SYSTEM, GREEDY)["meta_info"]
        second = eng.generate(SYSTEM, GREEDY)["meta_info"]
        assert first["cached_tokens"] == 0
        assert second["cached_tokens"] >= second["prompt_tokens"] - 4
        state = assert_idle_integrity(eng)
        assert state["radix_cache"]["tokens_hit"] > 0 and 0 < state["cache_hit_rate"] <= 1
    finally:
        eng.shutdown()


def test_namespaces_never_share():
    eng = make_engine()
    try:
        eng.generate(SYSTEM, GREEDY, cache_salt="tenant-a")
        other = eng.generate(SYSTEM, GREEDY, cache_salt="tenant-b")["meta_info"]
        same = eng.generate(SYSTEM, GREEDY, cache_salt="tenant-a")["meta_info"]
        assert other["cached_tokens"] == 0
        assert same["cached_tokens"] >= same["prompt_tokens"] - 1
    finally:
        eng.shutdown()


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority"])
def test_pressure_then_flush_frees_everything(reference, dtype, policy):
    turns_ref, shared_ref = reference
    eng = make_engine(max_total_tokens=128, chunked_prefill_size=32, radix_eviction_policy=policy,
                      schedule_policy="lpm", dtype=dtype)
    try:
        for _ in range(2):
            assert [o["output_ids"] for o in eng.generate([SYSTEM + q for q in QUESTIONS], GREEDY)] == shared_ref
        state = assert_idle_integrity(eng)
        assert state["radix_cache"]["evicted_tokens"] > 0
        assert eng.flush_cache().success
        state = assert_idle_integrity(eng)
        assert state["free_pages"] == state["capacity_pages"] and state["cache_pages"] == 0
    finally:
        eng.shutdown()
