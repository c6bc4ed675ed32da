"""A waiting request whose L2 pages are evicted before it is admitted gets them again from L3 (issue 15).

On arrival a request's prefetch reads from L3 only what L1 + L2 miss. If L2 then evicts pages of its
prefix while it waits for room (host LRU picks the prefixes of waiting conversations first: they were
used longest ago), those pages are still in L3; the readiness check must fetch them again instead of
admitting the request with a shorter hit.
"""

from __future__ import annotations

from tests.cache.drivers import (
    HISTORY_TOKENS,
    follow_up_after_history,
    make_file_l3_manager,
    serve_history,
    settle,
)


def test_pages_evicted_from_l2_while_waiting_come_back_from_l3(tmp_path):
    manager = make_file_l3_manager(tmp_path)
    try:
        nxt = serve_history(manager)                     # on the host, then in L3
        manager.device.evict(manager.tree.total_size())  # demoted: L2 only
        manager.start_prefetch(nxt)                      # L2 has the history: only the question is looked up
        settle(manager)
        assert manager.prefetch_ready(nxt)
        manager.host.evict(manager.host.allocator.capacity_pages)   # others' backups need the host room
        assert not manager.prefetch_ready(nxt)           # the history is re-read from L3 ...
        settle(manager)
        assert manager.prefetch_ready(nxt)
        plan = manager.plan_admit(nxt, budget=64)
        assert plan is not None and manager.admit(nxt, plan)
        assert nxt.kv_len == HISTORY_TOKENS                                                  # ... and hit in full
        assert manager.metrics == {"device_hit_tokens": 0, "host_hit_tokens": 0, "storage_hit_tokens": HISTORY_TOKENS}
        assert manager.stats()["l3_refetches"] == 1
        manager.release(nxt, cache=False)
        manager.check_integrity([])
    finally:
        manager.close()


def test_nothing_is_refetched_while_l2_keeps_the_pages(tmp_path):
    manager = make_file_l3_manager(tmp_path)
    try:
        nxt = follow_up_after_history(manager)
        settle(manager)
        for _ in range(3):
            assert manager.prefetch_ready(nxt)
        assert manager.stats()["l3_refetches"] == 0
    finally:
        manager.close()
