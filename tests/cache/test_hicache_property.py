"""Property-based: random workloads through the cache facade with a host tier keep every page accounted for.

A simulated owner drives KVCacheManager exactly as the scheduler does (admit, reserve, "compute", commit,
release) while eviction in both tiers, demotion, backup and load-back happen underneath. Each token's KV
is a value derived from its prefix, so a page that was lost or mixed up shows as wrong data.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.runtime.req import Req
from kvstrata.runtime.sampling_params import SamplingParams
from tests.cache.drivers import assert_next_eviction_is_policy_min, compute
from tests.cache.stack import make_cache


def make_manager(policy: str, page_size: int, device_pages: int, host_ratio: float) -> tuple:
    return make_cache(page_size, device_pages, 64, enable_hierarchical_cache=True, hicache_write_policy=policy,
                      hicache_ratio=host_ratio, max_running_requests=15)


ops = st.lists(st.tuples(st.sampled_from(["start", "start", "finish", "evict", "evict_host", "ack"]),
                         st.lists(st.integers(1, 3), min_size=1, max_size=20), st.integers(0, 10)),
               min_size=5, max_size=40)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=ops)
def test_random_workloads_keep_accounting(policy, page_size, workload):
    manager, pool = make_manager(policy, page_size, device_pages=48 // page_size + 1, host_ratio=2.5)
    device, host = manager.device, manager.host
    running: list[Req] = []
    try:
        for n, (op, tokens, k) in enumerate(workload):
            if op == "start" and len(running) < 3:
                req = Req(rid=str(n), prompt_ids=tokens + [1], sampling=SamplingParams(max_new_tokens=1))
                assert manager.admit(req)
                if manager.reserve(req, req.fill_len - req.kv_len):
                    compute(manager, pool, req)
                    manager.commit(req)
                    running.append(req)
                else:
                    manager.release(req, cache=False)
            elif op == "finish" and running:
                manager.release(running.pop(k % len(running)), cache=True)
            elif op == "evict":
                device.evict(k * page_size)
            elif op == "evict_host":
                host.evict(k)
            else:
                host.wait_idle()
            manager.begin_step()
            manager.check_integrity(running)
            assert_next_eviction_is_policy_min(manager.tree, device._is_candidate, "device")
            assert_next_eviction_is_policy_min(manager.tree, host._is_candidate, "host")
        for req in running:
            manager.release(req, cache=True)
        running.clear()
        host.wait_idle()
        manager.check_integrity([])
        if policy == "write_back":
            assert device.stats["lost_pages"] == 0 or host.stats["backup_skipped_host_full"] > 0
    finally:
        manager.close()
