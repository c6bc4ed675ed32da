"""Property-based: random workloads through the cache facade with all three tiers keep every page accounted.

As test_hicache_property, plus a file L3 under the host tier: arrivals start prefetches, host eviction
sends pages to L3 only, and the integrity check runs after every operation *while* copies, L3 writes and
prefetches are in flight (a false report there fails the test). Fake KV values depend on the whole prefix,
so a page read back from L3 into the wrong place shows up as wrong data in `compute`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.cache.manager import KVCacheManager
from kvstrata.cache.page_hash import page_keys, request_namespace
from kvstrata.runtime.req import Req
from kvstrata.runtime.sampling_params import SamplingParams
from tests.cache.drivers import compute
from tests.cache.stack import make_cache

# Prompts share long prefixes (one of a few bases, then a short tail), so arrivals find pages in L3.
BASES = [[1 + (i * j) % 3 for j in range(20)] for i in range(1, 4)]
ops = st.lists(st.tuples(st.sampled_from(["start", "start", "arrive", "arrive", "finish", "evict", "evict_host",
                                          "forget", "settle"]),
                         st.sampled_from(range(len(BASES))), st.lists(st.integers(1, 3), max_size=4),
                         st.integers(0, 10)),
               min_size=5, max_size=40)


def make_manager(policy: str, page_size: int, storage_dir: str, group_tokens: int) -> tuple:
    return make_cache(page_size, 48 // page_size + 1, 64, model_dir=storage_dir, max_running_requests=15,
                      enable_hierarchical_cache=True, hicache_write_policy=policy, hicache_ratio=2.5,
                      hicache_storage_backend="file", hicache_storage_dir=storage_dir,
                      hicache_storage_prefetch_policy="best_effort", hicache_storage_page_tokens=group_tokens)


GROUP_TOKENS = [4, 8]   # tokens per L3 object: one or several pages (the default 64 exceeds these prompts)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("group_tokens", GROUP_TOKENS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=ops)
def test_random_workloads_with_storage_keep_accounting(tmp_path_factory, policy, page_size, group_tokens,
                                                       workload):
    storage_dir = str(tmp_path_factory.mktemp("l3"))
    manager, pool = make_manager(policy, page_size, storage_dir, group_tokens)
    running: list[Req] = []
    try:
        for n, (op, base, tail, k) in enumerate(workload):
            req = Req(rid=str(n), prompt_ids=BASES[base] + tail + [1], sampling=SamplingParams(max_new_tokens=1))
            if op == "arrive":
                manager.start_prefetch(req)
            elif op == "start" and len(running) < 3:
                plan = manager.plan_admit(req, 64)
                if plan is not None and plan.fits() and manager.admit(req, plan):
                    compute(manager, pool, req)
                    manager.commit(req)
                    running.append(req)
            elif op == "finish" and running:
                manager.release(running.pop(k % len(running)), cache=True)
            elif op == "evict":
                manager.device.evict(k * page_size)
            elif op == "evict_host":
                manager.host.evict(k)
            elif op in ("settle", "forget"):     # time passes: in-flight copies and L3 I/O land
                for tier in manager.tiers[1:]:
                    tier.wait_idle()
                if op == "forget":               # then what is not running leaves both local tiers
                    manager.device.evict(10_000)
                    manager.host.evict(10_000)
            manager.begin_step()                 # whatever has landed; the rest stays in flight
            manager.check_integrity(running)
        for req in running:
            manager.release(req, cache=True)
        running.clear()
        for tier in manager.tiers[1:]:
            tier.wait_idle()
        manager.check_integrity([])
        stats = manager.storage.stats
        assert stats["storage_hit_tokens"] <= stats["prefetch_attached_tokens"] <= stats["prefetched_tokens"]
        check_storage_keys(manager)
    finally:
        manager.close()


def check_storage_keys(manager: KVCacheManager) -> None:
    """Every node's L3 record names the keys its groups have when the whole path is hashed from the root
    (records are built from an ancestor's last key; splits cut them)."""
    storage = manager.storage
    for node in manager.tree.nodes():
        if node.is_root or node.storage is None:
            continue
        path, up = [], node
        while not up.is_root:
            path[:0] = list(up.key)
            up = up.parent
        start = len(path) - len(node.key)
        gt = storage.group_tokens
        expected = page_keys(path, gt, request_namespace(storage.storage_namespace, up.namespace))
        ends = [(i + 1) * gt - start for i in range(len(expected)) if start < (i + 1) * gt <= len(path)]
        assert node.storage.ends == ends, node
        assert node.storage.keys == expected[len(expected) - len(ends):], node


@pytest.mark.parametrize("page_size, group_tokens", [(1, 4), (1, 32), (4, 8), (4, 16)])
def test_pages_come_back_from_storage_with_their_data(tmp_path, page_size, group_tokens):
    """A prefix that left both local tiers is prefetched from L3 and loaded back with the right values."""
    manager, pool = make_manager("write_through", page_size, str(tmp_path), group_tokens)
    prompt = (BASES[0] * 2)[:40] + [1]
    try:
        first = Req(rid="a", prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=1))
        plan = manager.plan_admit(first, 128)
        assert manager.admit(first, plan)
        compute(manager, pool, first)
        manager.release(first, cache=True)
        for tier in manager.tiers[1:]:
            tier.wait_idle()
        manager.device.evict(10_000)
        manager.host.evict(10_000)
        again = Req(rid="b", prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=1))
        manager.start_prefetch(again)
        manager.check_integrity([])              # with the prefetch in flight
        manager.storage.wait_idle()
        plan = manager.plan_admit(again, 128)
        stored = (len(prompt) - 1) // group_tokens * group_tokens
        assert plan.host_tokens == stored - stored % page_size
        assert manager.admit(again, plan)
        compute(manager, pool, again)            # checks the loaded-back KV values
        assert manager.metrics["storage_hit_tokens"] == plan.host_tokens
        manager.release(again, cache=True)
        manager.host.wait_idle()
        manager.check_integrity([])
    finally:
        manager.close()


@pytest.mark.parametrize("page_size, group_tokens", [(1, 4), (1, 8), (4, 8)])
@pytest.mark.parametrize("records_known", [True, False])
def test_prefetch_keys_continue_the_cached_chain(tmp_path, page_size, group_tokens, records_known):
    """A prefetch after a cached prefix asks L3 for the keys the whole prompt has when hashed from the root,
    whether the key before its first group comes from a node's record or is hashed again."""
    manager, _ = make_manager("write_through", page_size, str(tmp_path), group_tokens)
    tree, storage = manager.tree, manager.storage
    try:
        seq: list[int] = []
        for turn in range(4):                       # a conversation of uneven turns: nodes end mid-group
            seq += [(turn * 5 + j) % 7 + 1 for j in range(4 + 3 * turn * page_size)]
            whole = len(seq) // page_size * page_size
            tree.insert(seq[:whole], torch.arange(page_size, page_size + whole))
        if records_known:
            for node in tree.nodes():
                if not node.is_root:
                    storage._record(node)
        prompt = seq[:len(seq) // page_size * page_size] + [9] * (3 * group_tokens)
        asked, looked_up = [], []
        submit, backend = storage.io.submit_prefetch, storage.io.backend
        storage.io.submit_prefetch = lambda keys, pages, tag: (asked.append(keys), submit(keys, pages, tag))[1]
        exists = backend.batch_exists
        backend.batch_exists = lambda keys: (looked_up.append(list(keys)), exists(keys))[1]
        match = tree.match_prefix(prompt, record=False)
        namespace = request_namespace(storage.storage_namespace, None)
        expected = page_keys(prompt, group_tokens, namespace)[match.cached_tokens // group_tokens:]
        # The file backend checks the first key on the spot: it is not stored, so nothing is submitted.
        assert storage.prefetch(prompt, None, match) == (None, "not_stored")
        assert looked_up == [expected[:1]] and asked == []
        backend.local_lookup = False                # as a remote store: every key goes to the worker
        assert storage.prefetch(prompt, None, match).op is not None
        assert asked == [expected]
        storage.wait_idle()
    finally:
        manager.close()
