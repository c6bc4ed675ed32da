"""DeviceTier (L1): the device pages the radix tree holds, their eviction and their allocator.

The tree OWNS the pages of every slot it records and this tier frees them (allocator.free) when a node
leaves the device. Leaving the device *demotes* a node that has a ready host copy (the node stays, on the
host only); without one the node is removed, and with it the host-only nodes below it (they cannot be
loaded back without it). The write policy may first give the node a host copy (write_back).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstrata.cache.radix_tree import RadixTree, TreeMatch, TreeNode, require
from kvstrata.memory.allocator import PageAllocator

if TYPE_CHECKING:
    from kvstrata.cache.cache_controller import LayerLoadHandle
    from kvstrata.cache.host_tier import HostTier


class DeviceTier:
    """L1: the tree's device pages, allocated from the model's KV pool."""

    name = "device"

    def __init__(self, tree: RadixTree, allocator: PageAllocator, host: HostTier | None = None):
        if tree.page_size != allocator.page_size:
            raise ValueError(f"page_size {tree.page_size} != allocator page size {allocator.page_size}")
        self.tree = tree
        self.allocator = allocator
        self.host = host                  # L2, where a node leaving the device is demoted to (None: lost)
        self.page_size = allocator.page_size
        self.stats = {"demoted_pages": 0, "lost_pages": 0}

    def available_pages(self) -> int:
        """Pages obtainable now: free plus evictable from the tree."""
        return self.allocator.free_pages + self.tree.evictable_size() // self.page_size

    def eviction_candidates(self) -> Iterator[TreeNode]:
        """Unlocked device nodes with no device-resident child, in policy order."""
        return self.tree.eviction_order(self._is_candidate, "device")

    def _is_candidate(self, node: TreeNode) -> bool:
        return (not node.is_root and node.lock_ref == 0 and node.device_slots is not None
                and all(c.device_slots is None for c in node.children.values()))

    def drop(self, node: TreeNode) -> None:
        """Free node's device pages: demote it if a lower tier holds it, else remove it (and its subtree)."""
        pages = len(node.key) // self.page_size
        host = self.host
        if host is not None:
            host.accept_demotion(node)           # write_back: copied down now, so nothing is lost
            if host.holds(node):
                self._free(node)
                self.stats["demoted_pages"] += pages
                return
        self.stats["lost_pages"] += pages
        if host is not None:
            for child in list(node.children.values()):
                host.drop_subtree(child)
            host.drop(node)
        self._free(node)
        self.tree.remove_leaf(node)

    def apply_acks(self) -> None:
        """The device tier starts no copies of its own."""

    def wait_idle(self) -> None:
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

    def on_insert(self, leaf: TreeNode) -> None:
        """A new device leaf: the host tier's write policy may back it up."""
        if self.host is not None:
            self.host.on_insert(leaf)

    def on_hit(self, node: TreeNode) -> None:
        """A request matched up to device node `node`: the host tier's write policy may back the path up."""
        if self.host is not None:
            self.host.on_hit(node)

    def load_back(self, match: TreeMatch) -> tuple[TreeMatch, LayerLoadHandle] | None:
        """Take device pages for the host continuation of `match` and have the host tier fill them (whole
        chain or nothing): the extended match and the per-layer wait handle (HostTier.load_back), or None
        when the device has no room (or there is no host tier)."""
        nodes = match.host_nodes
        if self.host is None or not nodes:
            return None
        self.tree.inc_lock_ref(nodes[-1])       # keep the whole chain while we make room (write_back copies)
        try:
            pages = self.alloc(match.host_tokens // self.page_size)
        finally:
            self.tree.dec_lock_ref(nodes[-1])
        if pages is None:
            return None
        return self.host.load_back(match, pages)

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
