"""Property-based test of the radix tree: random request lifecycles checked against a reference model.

A simulated scheduler owns a real PageAllocator: it matches a prompt, locks the prefix, allocates pages for
the uncached part (evicting when short), and later caches the request (finish or chunked-prefill insert)
or aborts it. The reference is a dict {(namespace, page-aligned prefix): page id of its last page}: the
cached prefixes and where their KV lives. After every step: the tree holds exactly the reference,
evictable + protected == total, locked prefixes are intact, and every page has exactly one owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.cache.eviction import EVICTION_POLICIES
from kvstrata.cache.integrity import check_slot_accounting
from kvstrata.cache.radix_tree import TreeMatch as MatchResult
from kvstrata.cache.radix_tree import TreeNode
from tests.cache.drivers import assert_next_eviction_is_policy_min
from tests.cache.l1 import L1 as RadixCache

MAX_TOKENS = 16
MAX_RUNNING = 3
NAMESPACES = st.sampled_from([None, "salt"])


@dataclass
class Running:
    tokens: list[int]
    namespace: str | None
    slots: torch.Tensor  # slots of every token: [:cached_len] the tree's, the rest private
    cached_len: int  # length of the locked prefix
    node: TreeNode


def page_slots(page_ids: list[int], page_size: int) -> list[int]:
    return [p * page_size + o for p in page_ids for o in range(page_size)]


class RadixMachine(RuleBasedStateMachine):
    """Drives a RadixCache like a scheduler would and compares it with the reference after every step."""

    @initialize(page_size=st.sampled_from([1, 4]), policy=st.sampled_from(sorted(EVICTION_POLICIES)))
    def setup(self, page_size: int, policy: str) -> None:
        self.ps = page_size
        self.cache = RadixCache(32 if page_size == 1 else 12, page_size, policy)  # small: forces eviction
        self.allocator = self.cache.allocator
        self.ref: dict[tuple, int] = {}
        self.running: list[Running] = []
        self.known: list[list[int]] = [[]]

    # ---- helpers --------------------------------------------------------------------------------------

    def draw_tokens(self, data) -> list[int]:
        """A prompt that often shares a prefix with an earlier one (tiny alphabet, reused bases)."""
        base = data.draw(st.sampled_from(self.known))
        cut = data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(st.integers(0, 1), max_size=MAX_TOKENS))
        tokens = (base[:cut] + tail)[:MAX_TOKENS]
        self.known.append(tokens)
        return tokens

    def ref_prefix_len(self, tokens: list[int], ns: str | None) -> int:
        k = 0
        while (k + 1) * self.ps <= len(tokens) and (ns, tuple(tokens[:(k + 1) * self.ps])) in self.ref:
            k += 1
        return k * self.ps

    def ref_slots(self, tokens: list[int], ns: str | None, length: int) -> list[int]:
        pages = [self.ref[(ns, tuple(tokens[:end]))] for end in range(self.ps, length + 1, self.ps)]
        return page_slots(pages, self.ps)

    def tree_map(self) -> dict[tuple, int]:
        """The tree's content in the reference's shape, read without touching access times."""
        out = {}
        for node in self.cache.nodes():
            chain, up = [], node.parent
            while not up.is_root:
                chain.append(up.key)
                up = up.parent
            prefix = tuple(t for key in reversed(chain) for t in key)
            slots = node.device_slots
            for i in range(0, len(node.key), self.ps):
                out[(up.namespace, prefix + node.key[:i + self.ps])] = int(slots[i]) // self.ps
        return out

    def check_match(self, tokens: list[int], ns: str | None, m: MatchResult) -> None:
        expected = self.ref_prefix_len(tokens, ns)
        assert m.length == expected, (tokens, ns, m.length, expected, self.cache.pretty_print())
        assert m.slots.tolist() == self.ref_slots(tokens, ns, expected)
        path, node = [], m.last_node
        while not node.is_root:
            path = list(node.key) + path
            node = node.parent
        assert path == tokens[:expected]  # last_node covers exactly the match

    def evict(self, num_tokens: int) -> None:
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(num_tokens)
        assert min(num_tokens, evictable) <= freed <= evictable
        after = self.tree_map()
        assert after.items() <= self.ref.items()  # eviction only removes entries
        assert freed == (len(self.ref) - len(after)) * self.ps
        self.ref = after

    def record_insert(self, r: Running, priority: int) -> int:
        """Insert r's tokens; check and apply insert's answer like a scheduler. Returns the aligned length."""
        expected = self.ref_prefix_len(r.tokens, r.namespace)
        cached = self.cache.insert(r.tokens, r.slots, r.namespace, priority)
        assert cached == expected >= r.cached_len
        aligned = len(r.tokens) - len(r.tokens) % self.ps
        for end in range(cached + self.ps, aligned + 1, self.ps):
            self.ref[(r.namespace, tuple(r.tokens[:end]))] = int(r.slots[end - self.ps]) // self.ps
        duplicates = r.slots[r.cached_len:cached:self.ps] // self.ps  # ours, but the tree had them
        self.allocator.free(duplicates)
        return aligned

    # ---- rules ----------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.running) < MAX_RUNNING)
    @rule(data=st.data(), ns=NAMESPACES)
    def start_request(self, data, ns) -> None:
        tokens = self.draw_tokens(data)
        m = self.cache.match_prefix(tokens, ns)
        self.check_match(tokens, ns, m)
        self.cache.inc_lock_ref(m.last_node)
        need = -(-len(tokens) // self.ps) - m.length // self.ps
        if not self.allocator.can_alloc(need):
            self.evict((need - self.allocator.free_pages) * self.ps)
        pages = self.allocator.alloc(need)
        if pages is None:  # not admitted: give the prefix back
            self.cache.dec_lock_ref(m.last_node)
            return
        slots = torch.cat([m.slots, torch.tensor(page_slots(pages, self.ps), dtype=torch.long)])
        self.running.append(Running(tokens, ns, slots[:len(tokens)], m.length, m.last_node))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), priority=st.integers(0, 2))
    def finish_request(self, data, priority) -> None:
        r = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        aligned = self.record_insert(r, priority)
        self.allocator.free((r.slots[aligned::self.ps] // self.ps).unique())  # the partial last page
        self.cache.dec_lock_ref(r.node)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache_unfinished_request(self, data) -> None:
        """Chunked prefill: cache what is computed, then re-lock the now longer prefix."""
        r = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        aligned = self.record_insert(r, 0)
        m = self.cache.match_prefix(r.tokens, r.namespace)
        self.check_match(r.tokens, r.namespace, m)
        assert m.length == aligned
        self.cache.inc_lock_ref(m.last_node)
        self.cache.dec_lock_ref(r.node)
        r.slots = torch.cat([m.slots, r.slots[aligned:]])
        r.cached_len, r.node = aligned, m.last_node

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort_request(self, data) -> None:
        r = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.allocator.free((r.slots[r.cached_len::self.ps] // self.ps).unique())
        self.cache.dec_lock_ref(r.node)

    @rule(data=st.data(), ns=NAMESPACES)
    def match_only(self, data, ns) -> None:
        tokens = self.draw_tokens(data)
        self.check_match(tokens, ns, self.cache.match_prefix(tokens, ns))

    @rule(num_tokens=st.integers(0, 24))
    def evict_tokens(self, num_tokens) -> None:
        self.evict(num_tokens)

    @precondition(lambda self: not self.running)
    @rule()
    def flush(self) -> None:
        self.cache.reset()
        self.ref.clear()
        assert self.allocator.free_pages == self.allocator.capacity_pages

    # ---- invariants -----------------------------------------------------------------------------------

    @invariant()
    def tree_is_consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        cache = self.cache
        cache.check_integrity()
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        assert self.tree_map() == self.ref
        private = [p for r in self.running for p in (r.slots[r.cached_len::self.ps] // self.ps).tolist()]
        check_slot_accounting(self.allocator, cache, private)
        for r in self.running:  # a locked prefix is never evicted: it still maps to the request's slots
            assert r.slots[:r.cached_len].tolist() == self.ref_slots(r.tokens, r.namespace, r.cached_len)
        assert cache.protected_size() >= max((r.cached_len for r in self.running), default=0)
        # The order kept across calls is the one a fresh walk of the whole tree gives.
        assert_next_eviction_is_policy_min(cache.tree, cache.device._is_candidate, "device")


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestRadixProperty = RadixMachine.TestCase
