"""Concurrent decodes keep each request's new slots in one ascending run (the allocator's set-aside runs).

With page size 1, requests decoding side by side used to take the next free slot in turn, so each one's
keys ended up `requests` slots apart, which the CPU attention kernels read ~1.8x slower than a run. The
runs change only where KV lives: the accounting must come back to its start however the pool is used.
"""

from __future__ import annotations

import pytest

from kvstrata.args import ServerArgs
from kvstrata.cache.manager import KVCacheManager
from kvstrata.runtime.req import Req
from tests.cache.test_admission import cache_on_host_only, make_manager, new_req, run_prefill


def prefill(manager: KVCacheManager, rid: str, prompt: list[int]) -> Req:
    req = new_req(rid, prompt)
    run_prefill(manager, req, budget=len(prompt))
    return req


def decode_in_turns(manager: KVCacheManager, reqs: list[Req], steps: int) -> None:
    """Each step every request reserves, 'computes' and appends one token, as the scheduler's decode does."""
    for step in range(steps):
        for req in reqs:
            assert manager.reserve(req, 1)
            manager.advance(req, req.slot_len)
            req.output_ids.append(1000 + step)
        manager.check_integrity(reqs)


@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_decoding_side_by_side_each_write_one_run(page_size):
    manager = make_manager(page_size, 4096 // page_size, context=512)
    reqs = [prefill(manager, f"r{i}", [i * 100 + t for t in range(1, 21)]) for i in range(4)]
    steps = 2 * ServerArgs.kv_run_spare_tokens + 8     # past the end of the first set-aside run
    decode_in_turns(manager, reqs, steps)
    for req in reqs:
        slots = manager.slots_of(req, 0, req.slot_len)
        jumps = int((slots[1:] - slots[:-1] != 1).sum())
        assert jumps <= 2, f"{req.rid}: {jumps} breaks in its run of slots"   # a new run where one ran out
    for req in reqs:
        manager.release(req)
    manager.check_integrity([])
    manager.device.evict(10**6)                    # the tree held the finished requests' pages
    assert manager.allocator.free_pages == manager.allocator.capacity_pages


def test_a_pool_too_small_for_the_runs_still_serves_every_request_and_frees_every_page():
    manager = make_manager(1, 256)                 # 255 slots: 4 x (20 + 40) tokens leave little to set aside
    reqs = [prefill(manager, f"r{i}", [i * 100 + t for t in range(1, 21)]) for i in range(4)]
    decode_in_turns(manager, reqs, 40)
    assert all(req.slot_len == 60 for req in reqs)
    for req in reqs:
        manager.release(req, cache=False)
    manager.check_integrity([])
    manager.device.evict(10**6)
    assert manager.allocator.free_pages == manager.allocator.capacity_pages


def test_without_spare_runs_the_requests_interleave_slot_by_slot():
    manager = make_manager(1, 1024, context=512, kv_run_spare_tokens=0)
    reqs = [prefill(manager, f"r{i}", [i * 100 + t for t in range(1, 21)]) for i in range(4)]
    decode_in_turns(manager, reqs, 30)
    slots = manager.slots_of(reqs[0], 20, 50)
    assert (slots[1:] - slots[:-1] == 4).all()        # each request's tokens 4 slots apart
    for req in reqs:
        manager.release(req, cache=False)
    manager.check_integrity([])


def test_a_load_back_lands_in_one_run_however_the_free_list_is_ordered():
    manager = make_manager(1, 256, enable_hierarchical_cache=True, hicache_ratio=2)
    try:
        history = list(range(1, 65))
        cache_on_host_only(manager, history)
        allocator = manager.allocator
        pages = allocator.alloc(allocator.free_pages)
        allocator.free(pages[::2])                    # a free list that pops every other page first
        allocator.free(pages[1::2])
        again = new_req("b", history + [98])
        plan = manager.plan_admit(again, 512)
        assert plan.host_tokens == 64 and manager.admit(again, plan)
        manager.take_layer_wait()(0)
        manager.host.wait_idle()
        slots = manager.slots_of(again, 0, 64)
        assert (slots[1:] - slots[:-1] == 1).all(), slots.tolist()
        manager.check_integrity([again])
        manager.release(again, cache=False)
        manager.check_integrity([])
    finally:
        manager.close()
