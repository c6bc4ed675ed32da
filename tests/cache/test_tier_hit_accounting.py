"""Per-tier hit counters add up to what clients are told: device + host + storage == sum of cached_tokens.

Many conversations return at once into a device pool far smaller than their histories, so admissions are
tried and put back (no pages yet), requests are retracted and re-admitted, and prefixes come back from
L1, L2 and L3. A match that is undone must not be counted.
"""

from __future__ import annotations

import pytest

from tests.runtime.helpers import assert_idle_integrity, make_engine

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
QUESTION = " Tell me more about pages, slots and prefixes, and then about the tiers below them."


@pytest.mark.parametrize("storage", [False, True], ids=["L1+L2", "L1+L2+L3"])
def test_tier_hits_sum_to_cached_tokens_under_pressure(tmp_path, storage):
    tiers = {"enable_hierarchical_cache": True, "hicache_ratio": 1.5 if storage else 4,
             "max_total_tokens": 384, "chunked_prefill_size": 64}
    if storage:
        tiers.update(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    eng = make_engine(**tiers)
    try:
        histories = [eng.tokenizer.encode(f"Conversation {i}: " + "story " * (4 + i), add_special_tokens=False)
                     for i in range(8)]
        cached = 0
        for _ in range(4):
            prompts = [h + eng.tokenizer.encode(QUESTION, add_special_tokens=False) for h in histories]
            outs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
            cached += sum(o["meta_info"]["cached_tokens"] for o in outs)
            histories = [p + o["output_ids"] for p, o in zip(prompts, outs)]
        state = assert_idle_integrity(eng)
        tiers_sum = state["device_hit_tokens"] + state["host_hit_tokens"] + state["storage_hit_tokens"]
        assert cached > 0 and state["host_hit_tokens"] > 0
        assert tiers_sum == cached, state
        if storage:
            assert state["storage_hit_tokens"] > 0, state
    finally:
        eng.shutdown()
