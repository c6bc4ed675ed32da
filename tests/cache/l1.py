"""The radix tree with its device tier, built by build_kv_cache (device tier only), for tree-level tests."""

from __future__ import annotations

from tests.cache.stack import make_cache


class L1:
    """Tree verbs (match, insert, lock, sizes) plus the device tier's eviction, reset and page listing.

    `allocator` is the cache's own: tests take slots from it by hand, as a running request would."""

    def __init__(self, num_pages: int, page_size: int, policy: str = "lru"):
        manager = make_cache(page_size, num_pages, radix_eviction_policy=policy)[0]
        self.allocator = manager.allocator
        self.tree = manager.tree
        self.device = manager.device

    def __getattr__(self, name: str):
        return getattr(self.tree, name)

    def insert(self, *args, **kwargs) -> int:
        return self.tree.insert(*args, **kwargs)[0]

    def evict(self, num_tokens: int) -> int:
        return self.device.evict(num_tokens)

    def reset(self) -> None:
        self.device.reset()
        self.tree.clear()

    def owned_pages(self) -> set[int]:
        return self.device.owned_pages()

    def check_integrity(self) -> None:
        self.tree.check_integrity()
        self.device.check_integrity()
