"""The tier protocol: what every level of the cache stack (device, host, storage) answers.

The tiers form an ordered list, fastest first; each knows the tier below it (`below`, None for the last)
and is told the one above (`above`). The radix tree records residency on its nodes; a tier reads and
writes only its own record. Copies a tier starts are acknowledged in `apply_acks`, which the facade calls
once per step (begin_step) and nowhere else.

Beyond this protocol, neighbours call each other's data-path verbs: the host tier offers the storage
tier every completed host copy (`on_host_ready`), and the storage tier reserves, pins and inserts host
pages through the host tier (`alloc`, `pin` / `unpin`, `insert_host_pages`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kvstrata.cache.radix_tree import TreeNode


class Tier(Protocol):
    """One level of the cache stack."""

    name: str                     # "device", "host" or "storage": the label of its hit counter
    above: Tier | None
    below: Tier | None

    def holds(self, node: TreeNode) -> bool:
        """Whether this tier holds a complete copy of `node`'s pages."""

    def can_take(self, num_pages: int) -> bool:
        """Whether `num_pages` more pages fit now (free, or obtainable by evicting)."""

    def drop(self, node: TreeNode) -> None:
        """Give up this tier's copy of `node` (never one that is in use or in flight)."""

    def drop_subtree(self, node: TreeNode) -> None:
        """Remove `node` and its descendants, which live only in this tier and below (their ancestor on
        the tier above is being removed)."""

    def accept_demotion(self, node: TreeNode) -> None:
        """The tier above is about to drop `node`: copy it down now if this tier's policy says so."""

    def eviction_candidates(self) -> Iterator[TreeNode]:
        """Nodes whose copy in this tier may go now, in policy order."""

    def apply_acks(self) -> None:
        """Apply this tier's completed copies (the facade calls it once per step)."""

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of this tier's pages."""

    def metrics(self) -> dict:
        """Counters and usage of this tier."""

    def close(self) -> None:
        """Finish in-flight work and stop workers."""
