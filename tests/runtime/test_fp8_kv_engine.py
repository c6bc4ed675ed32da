"""FP8 KV (--kv-cache-dtype) through the whole engine, tiny model: greedy output identical with no cache, L1,
L2 and L2 + file L3; batch invariance; an FP8 and a bf16 engine sharing one L3 (a directory, or one Mooncake
store; and one L2 snapshot path) never read each other's KV; /server_info reports the KV dtype and capacity; a pool of the
same byte budget holds twice the tokens."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvstrata import args as server_args
from kvstrata.memory import kv_format
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.host_pool import HostKVPool
from tests.cache.drivers import SMALL_TIERS
from tests.cache.snapshot_turns import L2, first_round, turn
from tests.runtime.determinism import check_alone_equals_in_batches
from tests.runtime.helpers import engine_conversations, make_engine

FP8 = {"kv_cache_dtype": "fp8_e4m3", "dtype": "bfloat16"}


def _shared_l3(backend: str, request, tmp_path) -> dict:
    """Engine settings for an L3 that every engine of the test shares: a file directory or one Mooncake store."""
    if backend == "file":
        return {"hicache_storage_backend": "file", "hicache_storage_dir": str(tmp_path / "l3")}
    cluster = request.getfixturevalue("own_mooncake_cluster")
    return {"hicache_storage_backend": "mooncake",
            "hicache_storage_backend_extra_config": json.dumps(cluster.client_config())}


@pytest.mark.parametrize("backend", ["file", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_greedy_identical_in_every_tier_and_l3_shared_with_bf16_never_crosses(backend, request, tmp_path):
    reference, _ = engine_conversations(disable_radix_cache=True, **FP8)
    assert len({tuple(o) for o in reference}) > 1, "outputs should depend on the prompt"
    l1, l1_state = engine_conversations(**FP8)
    assert l1 == reference and l1_state["device_hit_tokens"] > 0
    kv = l1_state["kv_cache"]
    assert kv["dtype"] == "float8_e4m3fn" and kv["device_capacity_tokens"] == 4096 and kv["host_capacity_tokens"] is None
    l3 = {**SMALL_TIERS, **_shared_l3(backend, request, tmp_path)}
    bf16, _ = engine_conversations(**l3, dtype="bfloat16")          # bf16 objects in the shared directory
    l2, l2_state = engine_conversations(**l3, **FP8)                # L2 hits; the bf16 objects are not read
    assert l2 == reference and l2_state["host_hit_tokens"] > 0 and l2_state["storage_hit_tokens"] == 0
    assert l2_state["kv_cache"]["host_capacity_tokens"] >= 6 * 160
    again, l3_state = engine_conversations(**l3, **FP8)             # a new engine: its own FP8 objects found in L3
    assert again == reference and l3_state["storage_hit_tokens"] > 0
    bf16_again, bf16_state = engine_conversations(**l3, dtype="bfloat16")   # and bf16 still reads only its own
    assert bf16_again == bf16 and bf16_state["storage_hit_tokens"] > 0


def test_l2_snapshot_of_another_kv_dtype_is_rejected(tmp_path):
    path = str(tmp_path / "l2.snapshot")
    before = make_engine(hicache_snapshot_path=path, **L2, **FP8)
    try:
        histories = first_round(before)
    finally:
        before.shutdown()
    after = make_engine(hicache_snapshot_path=path, **L2, dtype="bfloat16")
    try:
        loaded = after.get_server_info()["internal_states"][0]["hicache"]["snapshot"]["last_load"]
        assert loaded["pages"] == 0 and loaded["rejected"], loaded
        _, meta = turn(after, histories[0], "And then?")
        assert meta["cached_tokens"] == 0, meta
    finally:
        after.shutdown()


def test_deterministic_request_alone_equals_it_in_batches():
    engine = make_engine(chunked_prefill_size=64, max_total_tokens=16384, page_size=16, **FP8)
    try:
        check_alone_equals_in_batches(engine, random.Random(49), "bfloat16", trials=1)
    finally:
        engine.shutdown()


def test_the_same_bytes_hold_twice_the_tokens():
    assert server_args.KV_CACHE_DTYPES == kv_format.KV_CACHE_DTYPES   # the CLI's choices are the pool's formats
    shape = (4, 2, 64)   # layers, KV heads, head dim
    bf16 = DeviceKVPool.bytes_per_token_for(*shape, torch.bfloat16)
    for fp8 in kv_format.FP8_DTYPES.values():
        assert DeviceKVPool.bytes_per_token_for(*shape, fp8) * 2 == bf16
        pools = [DeviceKVPool(9, 16, *shape, dtype, "cpu") for dtype in (torch.bfloat16, fp8)]
        host = [HostKVPool.size_pages(pool, 2.0, 0.001) for pool in pools]   # --hicache-size: a byte budget
        assert abs(host[1] - 2 * host[0]) <= 1 and pools[1].k_buffer[0].dtype == fp8   # whole pages of a budget


def test_mem_fraction_sizes_twice_the_tokens(monkeypatch):
    import psutil

    class Memory:
        available = 64 << 20
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    tokens = {}
    for kv in ("auto", "fp8_e5m2"):
        engine = make_engine(max_total_tokens=None, mem_fraction_static=0.5, kv_cache_dtype=kv, dtype="bfloat16")
        try:
            tokens[kv] = engine.get_server_info()["internal_states"][0]["kv_cache"]["device_capacity_tokens"]
        finally:
            engine.shutdown()
    assert tokens["fp8_e5m2"] == 2 * tokens["auto"], tokens
