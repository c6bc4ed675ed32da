"""The seams of the cache stack: the lifecycle every tier answers, and what L3 asks of L2.

A page goes down the chain device (L1) -> host (L2) -> storage (L3), and each tier holds the one below it
as a typed constructor argument:

    DeviceTier(tree, allocator, host: HostTier | None)     demotes to, and removes through, the host tier
    HostTier(..., storage: builds StorageTier | None)      offers each completed host copy to L3
    StorageTier(tree, io, namespace, host: HostPages)      reserves, pins and fills host pages through L2

L3 reaches L2 only through the small HostPages protocol below (the host tier satisfies it), so the
storage tier knows nothing else of the host tier, and reads no host record on a node. The radix tree records residency on its nodes; a tier
writes only its own record. Copies a tier starts are acknowledged in `apply_acks`, which the facade calls
once per step (begin_step) and nowhere else.
"""

from __future__ import annotations

from typing import Protocol

from kvstrata.cache.radix_tree import TreeNode


class Tier(Protocol):
    """The lifecycle of one level of the cache stack (the facade loops over the tiers with these)."""

    name: str                     # "device", "host" or "storage": the label of its hit counter

    def apply_acks(self) -> None:
        """Apply this tier's completed copies (the facade calls it once per step)."""

    def wait_idle(self) -> None:
        """Wait for this tier's in-flight copies and apply them (shutdown and flush only)."""

    def reset(self) -> None:
        """Give up every page this tier holds (flush; nothing running, nothing in flight)."""

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of this tier's pages."""

    def metrics(self) -> dict:
        """Counters and usage of this tier."""

    def close(self) -> None:
        """Finish in-flight work and stop workers."""


class HostPages(Protocol):
    """The host tier's verbs the storage tier uses: host pages for prefetches, and their pinning by writes."""

    @property
    def capacity_pages(self) -> int:
        """Allocatable host pages."""

    def alloc(self, num_pages: int) -> list[int] | None:
        """`num_pages` host pages, evicting host copies for them; None if there is not enough room."""

    def free(self, pages: list[int]) -> None:
        """Give back host pages that nothing holds (a prefetch's unread ones)."""

    def pin(self, pages: list[int]) -> None:
        """An L3 write will read `pages`: they stay allocated until it unpins them."""

    def unpin(self, pages: list[int]) -> None:
        """An L3 write that read `pages` finished."""

    def holds(self, node: TreeNode) -> bool:
        """Whether node has a complete host copy."""

    def pages_of(self, node: TreeNode) -> list[int] | None:
        """The host pages of node's complete copy (None: it has none)."""

    def backup(self, node: TreeNode) -> bool:
        """Start copying a device node to the host (an L3 group that begins in it waits for it)."""

    def insert_host_pages(self, token_ids: list[int], host_pages: list[int], namespace: str | None = None,
                          start: int = 0) -> TreeNode | None:
        """Hang host pages holding the KV of `token_ids` under their cached path, as one host-only node."""
