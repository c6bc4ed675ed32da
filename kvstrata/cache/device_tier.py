"""DeviceTier (L1): the device pages the radix tree holds, their eviction and their allocator.

The tree OWNS the pages of every slot it records and this tier frees them (allocator.free) when a node
leaves the device. Leaving the device *demotes* a node that has a ready host copy (the node stays, on the
host only); without one the node is removed, and with it the host-only nodes below it (they cannot be
loaded back without it). The write policy may first give the node a host copy (write_back).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvstrata.cache.radix_tree import RadixTree, TreeNode, require
from kvstrata.cache.tier import Tier
from kvstrata.memory.allocator import PageAllocator


class DeviceTier:
    """L1: the tree's device pages, allocated from the model's KV pool."""

    name = "device"

    def __init__(self, tree: RadixTree, allocator: PageAllocator):
        if tree.page_size != allocator.page_size:
            raise ValueError(f"page_size {tree.page_size} != allocator page size {allocator.page_size}")
        self.tree = tree
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.above: Tier | None = None
        self.below: Tier | None = None
        self.stats = {"demoted_pages": 0, "lost_pages": 0}

    # ---- protocol -------------------------------------------------------------------------------------

    def holds(self, node: TreeNode) -> bool:
        """Whether node's tokens are in device slots."""
        return node.device_slots is not None

    def can_take(self, num_pages: int) -> bool:
        """Whether `num_pages` are free or evictable from the tree now."""
        return self.available_pages() >= num_pages

    def available_pages(self) -> int:
        """Pages obtainable now: free plus evictable from the tree."""
        return self.allocator.free_pages + self.tree.evictable_size() // self.page_size

    def eviction_candidates(self) -> Iterator[TreeNode]:
        """Unlocked device nodes with no device-resident child, in policy order."""
        return self.tree.eviction_order(self._is_candidate)

    def _is_candidate(self, node: TreeNode) -> bool:
        return (not node.is_root and node.lock_ref == 0 and node.device_slots is not None
                and all(c.device_slots is None for c in node.children.values()))

    def drop(self, node: TreeNode) -> None:
        """Free node's device pages: demote it if a lower tier holds it, else remove it (and its subtree)."""
        pages = len(node.key) // self.page_size
        if self.below is not None:
            self.below.accept_demotion(node)     # write_back: copied down now, so nothing is lost
        if self.below is not None and self.below.holds(node):
            self._free(node)
            self.stats["demoted_pages"] += pages
            return
        self.stats["lost_pages"] += pages
        if self.below is not None:
            for child in list(node.children.values()):
                self.below.drop_subtree(child)
            self.below.drop(node)
        self._free(node)
        self.tree.remove_leaf(node)

    def drop_subtree(self, node: TreeNode) -> None:
        """The device is the top tier: no tier above removes nodes through it."""

    def accept_demotion(self, node: TreeNode) -> None:
        """The device is the top tier: nothing is demoted into it."""

    def apply_acks(self) -> None:
        """The device tier starts no copies of its own."""

    def close(self) -> None:
        """Nothing runs in the background here."""

    # ---- allocation and eviction --------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` of unlocked leaves (or all there are) in policy order; returns tokens freed."""
        freed = 0
        for node in self.eviction_candidates():
            if freed >= num_tokens:
                break
            freed += node.device_tokens
            self.drop(node)
        self.tree.evicted_tokens += freed
        return freed

    def ensure_free_pages(self, num_pages: int) -> bool:
        """Evict until `num_pages` are free. False if impossible."""
        short = num_pages - self.allocator.free_pages
        if short > 0:
            self.evict(short * self.page_size)
        return self.allocator.free_pages >= num_pages

    def alloc(self, num_pages: int) -> list[int] | None:
        """`num_pages` free pages, evicting for them, in one run where a free run is that long (a load-back's
        prefix is then read in order, see PageAllocator.extend); None if the tree cannot give enough back."""
        if not self.ensure_free_pages(num_pages):
            return None
        return self.allocator.extend(None, num_pages)

    def _free(self, node: TreeNode) -> None:
        """The one place where a node's device pages go back to the allocator."""
        pages = self.tree.device_pages_of(node)
        self.tree.clear_device_slots(node)
        self.allocator.free(pages)

    def reset(self) -> None:
        """Free every device page of the tree (no request may be running)."""
        for node in self.tree.nodes():
            if node.lock_ref > 0:
                raise RuntimeError("reset: nodes are locked by running requests")
        for node in self.tree.nodes():
            self.allocator.free(self.tree.device_pages_of(node))

    # ---- inspection -------------------------------------------------------------------------------------

    def owned_pages(self) -> set[int]:
        """Every device page the tree holds."""
        return {p for n in self.tree.nodes() for p in self.tree.device_pages_of(n)}

    def total_size(self) -> int:
        """Device tokens the tree holds."""
        return self.tree.total_size()

    def check_integrity(self) -> None:
        """Tree pages in range, owned once, not on the free list (the facade checks the full partition)."""
        seen: set[int] = set()
        for node in self.tree.nodes():
            for page in self.tree.device_pages_of(node):
                require(page not in seen, f"page {page} held twice by the tree")
                require(self.allocator.reserved_pages <= page < self.allocator.num_pages,
                        f"{node}: page {page} out of the allocatable range")
                seen.add(page)
        free = seen & self.allocator.free_page_ids()
        require(not free, f"tree pages also on the free list: {sorted(free)[:16]}")

    def metrics(self) -> dict:
        """Demotions and losses."""
        return dict(self.stats)
