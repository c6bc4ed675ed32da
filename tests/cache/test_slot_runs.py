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
from tests.cache.drivers import cache_on_host_only, make_manager, new_req, run_prefill


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


@pytest.mark.parametrize("page_size", [1, 4])
def test_reserving_a_decode_step_at_once_gives_the_slots_one_by_one_reservation_gives(page_size):
    """reserve_decodes (the scheduler's decode step: one slot table write) = reserve(req, 1) for each in turn."""
    managers = [make_manager(page_size, 4096 // page_size, context=256) for _ in range(2)]
    batches = [[prefill(m, f"r{i}", [i * 100 + t for t in range(1, 22 + i)]) for i in range(5)] for m in managers]
    for step in range(3 * ServerArgs.kv_run_spare_tokens // 2):
        for req in batches[0]:
            assert managers[0].reserve(req, 1)
        assert managers[1].reserve_decodes(batches[1]) == len(batches[1])
        for manager, reqs in zip(managers, batches):
            for req in reqs:
                manager.advance(req, req.slot_len)
                req.output_ids.append(1000 + step)
            manager.check_integrity(reqs)
    for one, batched in zip(*batches):
        assert one.slot_len == batched.slot_len
        assert managers[0].slots_of(one, 0, one.slot_len).tolist() == managers[1].slots_of(batched, 0, batched.slot_len).tolist()


def test_reserving_a_decode_step_stops_at_the_first_request_the_pool_cannot_serve():
    manager = make_manager(1, 64)                  # 63 slots
    reqs = [prefill(manager, f"r{i}", [i * 100 + t for t in range(1, 21)]) for i in range(3)]
    manager.release(reqs[2], cache=False)          # 20 slots free again, 40 held
    reqs = reqs[:2] + [prefill(manager, "r3", [900 + t for t in range(1, 21)])]   # now 3 tokens free (+ the tree's)
    manager.device.evict(10**6)
    free = manager.allocator.free_pages
    got = manager.reserve_decodes(reqs * 2)        # asks for more slots than the pool has
    assert got == min(free, 6)
    manager.check_integrity(reqs)
    assert manager.allocator.free_pages == free - got
