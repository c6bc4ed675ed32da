"""HiCache (L2) end to end through the Engine: same greedy outputs, returning conversations hit the host tier."""

from __future__ import annotations

import pytest

from tests.cache.drivers import run_conversations
from tests.runtime.helpers import NUMERIC_DTYPES, assert_idle_integrity, make_engine


@pytest.fixture(scope="module", params=NUMERIC_DTYPES)
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(dtype):
    eng = make_engine(disable_radix_cache=True, dtype=dtype)
    try:
        return run_conversations(eng)[0]
    finally:
        eng.shutdown()


# The last turn of a conversation needs ~100 tokens; four histories (~400) do not fit the 160-token pool.
SMALL_POOL = {"max_total_tokens": 160, "chunked_prefill_size": 32}


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_greedy_identical_with_hicache(reference, dtype, policy, layout):
    eng = make_engine(enable_hierarchical_cache=True, hicache_write_policy=policy, hicache_mem_layout=layout,
                      hicache_ratio=6, dtype=dtype, **SMALL_POOL)
    try:
        outputs, _ = run_conversations(eng)
        assert outputs == reference
        assert_idle_integrity(eng)
    finally:
        eng.shutdown()


def returning_hits(metas: list[dict], first_round: int = 1) -> list[float]:
    """cached_tokens / history for turns from `first_round` on."""
    return [m["cached_tokens"] / m["history"] for m in metas if m["round"] >= first_round]


def test_returning_conversations_hit_l2_not_l1_only(reference, dtype):
    l2 = make_engine(enable_hierarchical_cache=True, hicache_ratio=6, dtype=dtype, **SMALL_POOL)
    l1 = make_engine(dtype=dtype, **SMALL_POOL)
    try:
        out2, metas2 = run_conversations(l2)
        out1, metas1 = run_conversations(l1)
        assert out2 == reference and out1 == reference
        assert min(returning_hits(metas2)) >= 0.95, metas2
        # By the last round every history has been pushed out of the device pool by the others.
        assert max(returning_hits(metas1, first_round=2)) <= 0.05, metas1
        state = assert_idle_integrity(l2)
        assert state["host_hit_tokens"] > 0 and state["hicache"]["load_back_pages"] > 0
        assert state["hicache"]["load_back_bytes"] > 0
    finally:
        l2.shutdown()
        l1.shutdown()


def test_full_host_pool_costs_hits_not_requests(reference, dtype):
    eng = make_engine(enable_hierarchical_cache=True, hicache_ratio=1.05, dtype=dtype, **SMALL_POOL)
    try:
        outputs, _ = run_conversations(eng)
        assert outputs == reference
        state = assert_idle_integrity(eng)
        assert state["hicache"]["host_evicted_pages"] > 0 or state["hicache"]["backup_skipped_host_full"] > 0
    finally:
        eng.shutdown()
