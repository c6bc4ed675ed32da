"""Admission in two steps through the cache facade: a pure plan, then an admit that takes what it planned.

The request's KV state is a handle owned by the cache: the scheduler reads kv_len but never writes it, and
the host-side last slot (which spares a decode step a device read) always equals the slot table's.
"""

from __future__ import annotations

import pytest

from kvstrata.cache.manager import KVCacheManager
from tests.cache.drivers import cache_on_host_only, make_manager, new_req, run_prefill


def snapshot(manager: KVCacheManager) -> tuple:
    tree = manager.tree
    host_ops = manager.host.controller.stats()["load_back_ops"] if manager.host is not None else 0
    return (dict(manager.metrics), tree.protected_size(), tree.evictable_size(), manager.slot_table.free_rows,
            manager.allocator.free_pages, tree.metrics()["tokens_requested"], host_ops)


@pytest.mark.parametrize("page_size", [1, 4])
def test_plan_is_pure_and_admit_counts_the_hit_once(page_size):
    manager = make_manager(page_size, 64)
    shared = list(range(1, 25))
    first = new_req("a", shared + [30, 31])
    run_prefill(manager, first)
    manager.release(first)
    second = new_req("b", shared + [40, 41])
    before = snapshot(manager)
    plans = [manager.plan_admit(second, 64) for _ in range(3)]
    assert snapshot(manager) == before and plans[0] == plans[1] == plans[2]
    assert plans[0].device_tokens == 24 and plans[0].host_tokens == 0
    assert manager.admit(second, plans[0])
    assert second.kv_len == 24 and manager.metrics["device_hit_tokens"] == 24
    manager.check_integrity([second])
    manager.release(second, cache=False)
    assert manager.admit(second, manager.plan_admit(second, 64))      # a re-admission is not counted again
    assert manager.metrics["device_hit_tokens"] == 24
    manager.release(second, cache=False)
    manager.check_integrity([])


def test_plan_with_a_host_hit_starts_no_load_back_until_admitted():
    manager = make_manager(1, 48, enable_hierarchical_cache=True, hicache_ratio=4)
    try:
        history = list(range(1, 33))
        cache_on_host_only(manager, history)
        again = new_req("b", history + [98])
        before = snapshot(manager)
        plan = manager.plan_admit(again, 64)
        assert snapshot(manager) == before
        assert plan.device_tokens == 0 and plan.host_tokens == 32
        assert manager.admit(again, plan)
        assert manager.host.controller.stats()["ops_in_flight"] + manager.host.controller.stats()["load_back_ops"] >= 1
        assert manager.metrics["host_hit_tokens"] == 32 and again.kv_len == 32
        manager.take_layer_wait()(0)
        manager.host.wait_idle()
        manager.check_integrity([again])
        manager.release(again, cache=False)
        manager.check_integrity([])
    finally:
        manager.close()


def test_kv_len_has_one_writer_and_the_last_slot_stays_on_the_host():
    manager = make_manager(4, 32)
    req = new_req("a", list(range(1, 11)))
    with pytest.raises(AttributeError):
        req.kv_len = 3                                # the scheduler reports progress through the facade
    run_prefill(manager, req, budget=6)               # a first chunk of 6 tokens
    manager.check_integrity([req])
    for _ in range(5):                                # more tokens, one at a time, as decode steps are
        assert manager.reserve(req, 1)
        manager.check_integrity([req])                # host-side last slot == slot table's
        manager.advance(req, req.slot_len)
        manager.commit(req)
        manager.check_integrity([req])
    with pytest.raises(ValueError):
        manager.advance(req, req.slot_len + 1)        # no KV without slots
    manager.release(req)
    assert req.row is None and req.kv_len == 0
    manager.check_integrity([])
