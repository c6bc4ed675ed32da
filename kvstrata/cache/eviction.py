"""Eviction policies of the radix tree: each maps a node to a sort key, and the smallest key goes first.

Times are ticks of the tree's monotonic clock (not wall time), so orderings are deterministic.
The node id, appended by the tree, breaks any remaining tie in creation order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.cache.radix_tree import TreeNode

EvictionKey = Callable[["TreeNode"], tuple]
SLRU_PROTECT_HITS = 1    # prefix hits that move a node into the protected segment


def lru_key(node: TreeNode) -> tuple:
    """Least recently used first."""
    return (node.last_access,)


def lfu_key(node: TreeNode) -> tuple:
    """Fewest hits first; among equals, least recently used."""
    return (node.hit_count, node.last_access)


def slru_key(node: TreeNode) -> tuple:
    """Segmented LRU: nodes never reused since insertion (probation) go before reused ones (protected);
    least recently used first in each segment."""
    return (node.hit_count >= SLRU_PROTECT_HITS, node.last_access)


def fifo_key(node: TreeNode) -> tuple:
    """Oldest first."""
    return (node.created_at,)


def priority_key(node: TreeNode) -> tuple:
    """Lowest priority first; among equals, least recently used. A node's priority is the highest of the
    requests that inserted or extended a path through it (`RadixTree.insert`), so a high-priority prefix
    outlives low-priority ones of the same age."""
    return (node.priority, node.last_access)


EVICTION_POLICIES: dict[str, EvictionKey] = {
    "lru": lru_key,
    "lfu": lfu_key,
    "slru": slru_key,
    "fifo": fifo_key,
    "priority": priority_key,
}


def eviction_key(policy: str) -> EvictionKey:
    """The sort key of `policy` (one of EVICTION_POLICIES); raises ValueError for an unknown name."""
    try:
        return EVICTION_POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown radix eviction policy {policy!r}; choose one of "
                         f"{sorted(EVICTION_POLICIES)}") from None
