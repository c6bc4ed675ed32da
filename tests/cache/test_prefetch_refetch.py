"""A waiting request whose L2 pages are evicted before it is admitted gets them again from L3 (issue 15).

On arrival a request's prefetch reads from L3 only what L1 + L2 miss. If L2 then evicts pages of its
prefix while it waits for room (host LRU picks the prefixes of waiting conversations first: they were
used longest ago), those pages are still in L3; the readiness check must fetch them again instead of
admitting the request with a shorter hit.
"""

from __future__ import annotations

from kvstrata.cache.manager import KVCacheManager
from kvstrata.runtime.req import Req
from kvstrata.runtime.sampling_params import SamplingParams
from tests.cache.stack import make_cache

PAGE = 4
DEVICE_PAGES = 33


def make_manager(storage_dir) -> KVCacheManager:
    model_dir = storage_dir / "model"              # names the L3 namespace; no weights are needed
    model_dir.mkdir(exist_ok=True)
    return make_cache(PAGE, DEVICE_PAGES, model_dir=str(model_dir), enable_hierarchical_cache=True, hicache_ratio=2.0,
                      hicache_storage_backend="file", hicache_storage_dir=str(storage_dir),
                      hicache_storage_page_tokens=PAGE, hicache_storage_prefetch_policy="timeout")[0]


def serve(manager: KVCacheManager, req: Req) -> None:
    """Admit, 'compute' and release `req`, caching its prompt (KV values do not matter here)."""
    assert manager.admit(req) and manager.reserve(req, req.fill_len - req.kv_len)
    manager.take_layer_wait()
    manager.advance(req, req.slot_len)
    manager.release(req)


def settle(manager: KVCacheManager) -> None:
    """Let every host copy and L3 write/read land and be applied."""
    manager.host.wait_idle()
    manager.storage.wait_idle()


HISTORY_TOKENS = 40


def serve_history(manager: KVCacheManager) -> Req:
    """Serve a 40-token history (L1, L2 and L3 then hold it); returns its follow-up, not yet started."""
    history = list(range(1, HISTORY_TOKENS + 1))
    serve(manager, Req(rid="r0", prompt_ids=history, sampling=SamplingParams(max_new_tokens=1)))
    settle(manager)
    return Req(rid="r1", prompt_ids=history + list(range(100, 120)), sampling=SamplingParams(max_new_tokens=1))


def follow_up_after_history(manager: KVCacheManager) -> Req:
    """Serve a 40-token history, then start the prefetch of a follow-up."""
    nxt = serve_history(manager)
    manager.start_prefetch(nxt)        # only the new question is looked up in L3: it is not there
    return nxt


def test_pages_evicted_from_l2_while_waiting_come_back_from_l3(tmp_path):
    manager = make_manager(tmp_path)
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
    manager = make_manager(tmp_path)
    try:
        nxt = follow_up_after_history(manager)
        settle(manager)
        for _ in range(3):
            assert manager.prefetch_ready(nxt)
        assert manager.stats()["l3_refetches"] == 0
    finally:
        manager.close()
