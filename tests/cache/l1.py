"""The radix tree with its device tier, composed as the cache facade composes them, for tree-level tests."""

from __future__ import annotations

from kvstrata.cache.device_tier import DeviceTier
from kvstrata.cache.radix_tree import RadixTree
from kvstrata.memory.allocator import PageAllocator


class L1:
    """Tree verbs (match, insert, lock, sizes) plus the device tier's eviction, reset and page listing."""

    def __init__(self, allocator: PageAllocator, page_size: int, policy: str = "lru"):
        self.tree = RadixTree(page_size, policy)
        self.device = DeviceTier(self.tree, allocator)

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
