"""Unit tests of the L1 radix tree: matching, insertion, locks, eviction policies, namespaces, accounting."""

from __future__ import annotations

import pytest
import torch

from kvstrata.cache.integrity import check_slot_accounting
from kvstrata.cache.radix_tree import RadixTree
from kvstrata.memory.allocator import PageAllocator
from tests.cache.l1 import L1 as RadixCache


def make_cache(page_size: int = 1, num_pages: int = 64, policy: str = "lru") -> tuple[PageAllocator, RadixCache]:
    cache = RadixCache(num_pages, page_size, policy)
    return cache.allocator, cache


def new_slots(allocator: PageAllocator, num_tokens: int) -> torch.Tensor:
    """Slots of `num_tokens` tokens in freshly allocated pages (the last one may be partly used)."""
    ps = allocator.page_size
    pages = allocator.alloc(-(-num_tokens // ps))
    assert pages is not None
    return torch.tensor([p * ps + o for p in pages for o in range(ps)][:num_tokens], dtype=torch.long)


def pages(slots: torch.Tensor, page_size: int) -> list[int]:
    return sorted(set((slots // page_size).tolist()))


def cache_seq(allocator: PageAllocator, cache: RadixCache, tokens: list[int], **kw) -> torch.Tensor:
    """Insert `tokens` as a fresh request would, freeing the duplicate and partial pages it owned."""
    slots = new_slots(allocator, len(tokens))
    cached = cache.insert(tokens, slots, **kw)
    aligned = len(tokens) - len(tokens) % allocator.page_size
    allocator.free(pages(slots[:cached], allocator.page_size) + pages(slots[aligned:], allocator.page_size))
    return slots


def leaf_keys(cache: RadixCache) -> set[tuple]:
    return {n.key for n in cache.nodes()}


def test_match_on_empty_tree():
    _, cache = make_cache()
    m = cache.match_prefix([1, 2, 3])
    assert m.length == 0 and m.slots.dtype == torch.long and m.last_node.is_root
    cache.inc_lock_ref(m.last_node)  # locking a root is a no-op
    cache.dec_lock_ref(m.last_node)
    assert cache.total_size() == 0
    cache.check_integrity()


def test_exact_and_partial_match_split_the_node():
    allocator, cache = make_cache()
    slots = cache_seq(allocator, cache, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.length == 5 and torch.equal(m.slots, slots)
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.length == 3 and torch.equal(m.slots, slots[:3])
    assert m.last_node.key == (1, 2, 3)  # the split makes last_node cover exactly the match
    assert [c.key for c in m.last_node.children.values()] == [(4, 5)]
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.length == 5 and torch.equal(m.slots, slots) and m.last_node.key == (4, 5)
    assert cache.total_size() == 5 and len(list(cache.nodes())) == 2
    cache.check_integrity()
    check_slot_accounting(allocator, cache, [])


def test_insert_returns_already_cached_length():
    allocator, cache = make_cache()
    first = new_slots(allocator, 3)
    assert cache.insert([1, 2, 3], first) == 0
    second = new_slots(allocator, 5)
    assert cache.insert([1, 2, 3, 4, 5], second) == 3
    with pytest.raises(AssertionError, match="leaked"):  # the caller has not yet freed its duplicates
        check_slot_accounting(allocator, cache, [])
    allocator.free(pages(second[:3], 1))
    check_slot_accounting(allocator, cache, [])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.slots.tolist() == first.tolist() + second[3:].tolist()  # the tree keeps its own slots
    again = new_slots(allocator, 5)
    assert cache.insert([1, 2, 3, 4, 5], again) == 5
    allocator.free(pages(again, 1))
    check_slot_accounting(allocator, cache, [])
    cache.check_integrity()


def test_page_size_16_caches_and_matches_whole_pages_only():
    ps = 16
    allocator, cache = make_cache(page_size=ps, num_pages=16)
    tokens = list(range(100, 140))  # 2 whole pages + 8 tokens
    slots = new_slots(allocator, 40)
    assert cache.insert(tokens, slots) == 0
    allocator.free(pages(slots[32:], ps))  # the partial page stays the caller's
    assert cache.total_size() == 32
    check_slot_accounting(allocator, cache, [])
    assert cache.match_prefix(tokens + [1] * 7).length == 32
    assert cache.match_prefix(tokens[:15]).length == 0
    assert cache.match_prefix(tokens[:5] + [0] * 30).length == 0  # diverges inside the first page
    m = cache.match_prefix(tokens[:20] + [0] * 20)  # diverges inside the second page
    assert m.length == 16 and torch.equal(m.slots, slots[:16]) and m.last_node.key == tuple(tokens[:16])
    assert cache.match_prefix(tokens[:31]).length == 16
    cache.check_integrity()


def test_lock_protects_prefix_and_ancestors_from_evict():
    allocator, cache = make_cache()
    cache_seq(allocator, cache, [1, 2, 3, 4])
    cache_seq(allocator, cache, [1, 2, 3, 5])
    cache_seq(allocator, cache, [7, 8])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 3
    assert cache.evict(100) == 3  # [5] and [7, 8] only
    assert leaf_keys(cache) == {(1, 2, 3), (4,)}
    assert torch.equal(cache.match_prefix([1, 2, 3, 4]).slots, m.slots)
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    with pytest.raises(RuntimeError, match="not locked"):
        cache.dec_lock_ref(m.last_node)
    assert cache.evict(1) == 1 and cache.evict(100) == 3  # the parent becomes a leaf and goes next
    assert cache.total_size() == 0 and allocator.free_pages == allocator.capacity_pages
    with pytest.raises(RuntimeError, match="no longer in the tree"):
        cache.inc_lock_ref(m.last_node)
    cache.check_integrity()


def evict_order(cache: RadixCache, seqs: list[tuple]) -> list[tuple]:
    order = []
    while cache.total_size():
        before = leaf_keys(cache)
        cache.evict(1)
        order.extend(s for s in seqs if s in before - leaf_keys(cache))
    return order


A, B, C = (1, 1), (2, 2), (3, 3)


@pytest.mark.parametrize("policy, setup, expected", [
    ("lru", lambda c: c.match_prefix(list(A)), [B, C, A]),
    ("lfu", lambda c: [c.match_prefix(list(s)) for s in (A, C, B, C, A, A)], [B, C, A]),
    ("lfu", lambda c: [c.match_prefix(list(s)) for s in (C, B)], [A, C, B]),  # equal hits: least recent
    ("fifo", lambda c: [c.match_prefix(list(s)) for s in (C, B, A)], [A, B, C]),
    ("priority", lambda c: c.match_prefix(list(A)), [B, A, C]),  # C has priority 1; A, B by lru
])
def test_eviction_order_by_policy(policy, setup, expected):
    allocator, cache = make_cache(policy=policy)
    for seq in (A, B, C):
        cache_seq(allocator, cache, list(seq), priority=1 if seq == C else 0)
    setup(cache)
    assert evict_order(cache, [A, B, C]) == expected
    assert allocator.free_pages == allocator.capacity_pages


def test_priority_is_raised_by_a_later_insert():
    allocator, cache = make_cache(policy="priority")
    cache_seq(allocator, cache, list(A))
    cache_seq(allocator, cache, list(B))
    cache_seq(allocator, cache, list(A), priority=5)
    cache.match_prefix(list(B))
    assert evict_order(cache, [A, B]) == [B, A]


def test_namespaces_never_share():
    allocator, cache = make_cache()
    salted = cache_seq(allocator, cache, [1, 2, 3], namespace="a")
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], namespace="b").length == 0
    assert torch.equal(cache.match_prefix([1, 2, 3], namespace="a").slots, salted)
    plain = new_slots(allocator, 3)
    assert cache.insert([1, 2, 3], plain) == 0  # same tokens, other namespace: new KV
    assert set(pages(plain, 1)).isdisjoint(pages(salted, 1))
    assert cache.total_size() == 6
    assert "namespace 'a'" in cache.pretty_print()
    cache.check_integrity()
    check_slot_accounting(allocator, cache, [])
    cache.evict(100)
    assert "namespace 'a'" not in cache.pretty_print()  # an emptied namespace does not linger


def test_reset_frees_everything_but_refuses_while_locked():
    allocator, cache = make_cache(page_size=4, num_pages=32)
    cache_seq(allocator, cache, list(range(10)))
    cache_seq(allocator, cache, [0, 1, 2, 3, 9, 9, 9, 9], namespace="x")
    node = cache.match_prefix(list(range(8))).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert cache.total_size() == 16  # nothing was dropped
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and cache.owned_pages() == set()
    assert allocator.free_pages == allocator.capacity_pages
    assert cache.match_prefix(list(range(10))).length == 0
    cache.check_integrity()


def test_metrics():
    allocator, cache = make_cache(page_size=2)
    cache_seq(allocator, cache, [1, 2, 3, 4, 5])
    cache.match_prefix([1, 2, 3, 4, 5, 6])  # 4 of 6 hit
    cache.match_prefix([9, 9])  # 0 of 2
    node = cache.match_prefix([1, 2, 3]).last_node  # 2 of 3, splits [1,2,3,4]
    cache.inc_lock_ref(node)
    m = cache.metrics()
    assert m["tokens_requested"] == 11 and m["tokens_hit"] == 6 and m["hit_rate"] == pytest.approx(6 / 11)
    assert (m["tree_tokens"], m["protected_tokens"], m["evictable_tokens"], m["num_nodes"]) == (4, 2, 2, 2)
    cache.dec_lock_ref(node)
    cache.evict(100)
    assert cache.metrics()["evicted_tokens"] == 4


def test_insert_rejects_bad_slots():
    allocator, cache = make_cache(page_size=4)
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert([1, 2, 3, 4], torch.tensor([5, 6, 7, 8]))  # starts mid-page
    with pytest.raises(ValueError, match="slots for"):
        cache.insert([1, 2, 3, 4], torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="unknown radix eviction policy"):
        RadixTree(4, "random")
    assert cache.insert([1, 2, 3], torch.tensor([4, 5, 6])) == 0 and cache.total_size() == 0


def test_check_integrity_catches_corruption():
    # The one test that writes node fields directly: it makes states no public verb can reach (a lock the
    # size counters missed, a page held by two nodes), which is what check_integrity() is there to catch.
    allocator, cache = make_cache()
    cache_seq(allocator, cache, [1, 2, 3])
    cache_seq(allocator, cache, [5, 6])
    first, second = sorted(cache.nodes(), key=lambda n: n.key)
    first.lock_ref = 1
    with pytest.raises(AssertionError, match="evictable"):
        cache.check_integrity()
    first.lock_ref = 0
    saved, second.device_slots = second.device_slots, first.device_slots[:2].clone()
    with pytest.raises(AssertionError, match="held twice"):
        cache.check_integrity()
    second.device_slots = saved
    cache.check_integrity()
    allocator.free(pages(saved, 1))  # the tree still holds them: a double owner
    with pytest.raises(AssertionError, match="free list"):
        cache.check_integrity()


def test_check_slot_accounting_names_leaked_and_double_owned_pages():
    allocator, cache = make_cache(num_pages=8)
    tree_slots = cache_seq(allocator, cache, [1, 2])
    private = allocator.alloc(2)
    check_slot_accounting(allocator, cache, private)
    with pytest.raises(AssertionError, match=rf"leaked pages \(no owner\): \[{private[1]}\]"):
        check_slot_accounting(allocator, cache, private[:1])
    shared = int(tree_slots[0])
    with pytest.raises(AssertionError, match=rf"{shared}<-runningx1\+treex1"):
        check_slot_accounting(allocator, cache, private + [shared])
    with pytest.raises(AssertionError, match="outside the allocatable range"):
        check_slot_accounting(allocator, cache, private + [0])
    check_slot_accounting(allocator, None, private + tree_slots.tolist())


def test_unrecorded_lookup_and_tensor_keys():
    allocator, cache = make_cache(policy="lru")
    cache_seq(allocator, cache, list(A))
    cache_seq(allocator, cache, list(B))
    m = cache.match_prefix(torch.tensor([1, 1, 7]), record=False)  # scheduling look-up: no side effects
    assert m.length == 2 and cache.metrics()["tokens_requested"] == 0
    assert evict_order(cache, [A, B]) == [A, B]  # A's access time was not refreshed


def test_an_eviction_looks_at_what_changed_not_at_the_whole_tree():
    # 600 cached conversations; after the first eviction call, one more look-up and eviction must not re-check
    # every node (the order is kept across calls): per-step cost independent of the tree's size.
    allocator, cache = make_cache(num_pages=700)
    for i in range(600):
        cache_seq(allocator, cache, [i // 256 + 1, i % 256 + 1])
    checked = 0

    def counting(node):
        nonlocal checked
        checked += 1
        return cache.device._is_candidate(node)

    order = cache.tree.eviction_order(counting, "device")
    first = next(order)
    order.close()
    assert checked >= 600                       # first use: every node is looked at once
    cache.match_prefix([1, 5])                  # touches one conversation
    checked = 0
    order = cache.tree.eviction_order(counting, "device")
    assert next(order) is first                 # still the least recently used
    order.close()
    assert checked < 20, f"{checked} candidate checks for one touched path"
    assert cache.tree.metrics()["num_nodes"] == 603     # 600 leaves under 3 shared first tokens
