"""Tensor parallelism as the cache sees it: rank 0's cache decides, every rank holds its share of each page.

Under --tp-size N each rank holds its KV heads' share of every page, in L1 and L2 pools of the same shape,
and only rank 0 runs the cache stack (tree, allocators, tiers). What rank 0's cache decides reaches the
other ranks through a RankLink (runtime/ranks.py implements it, runtime/rank_cache.py repeats it):

    device <-> host copies     CopyJournal (cache_controller.py): repeated on every rank before the next forward
    L3 backup / prefetch       RankLink.storage_op: every rank writes / reads its own shard's objects
    L3 prefetch landed         RankLink.agree_prefetches: the groups EVERY rank read and verified (min), so
                               one rank's missing or corrupt object is a miss (a recompute) on all ranks
    L2 snapshot saved          RankLink.snapshot_saved: every rank writes its own snapshot file
    L2 snapshot restored       RankLink.snapshot_restored: kept only if every rank restored its share

A Shard names a rank's share in L3 object names and snapshot files, so a TP=2 store is never read by a
TP=1 server, nor rank 0's object by rank 1 (each object's checksum is bound to its shard's name).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Shard:
    """Which share of every page this process holds: rank `rank` of `tp_size` (1: the whole page)."""

    tp_size: int = 1
    rank: int = 0

    def object_key(self, key: str) -> str:
        """The name of `key`'s share on this rank (an L3 object, a snapshot page): the key itself on one rank,
        else SHA-256(key | tp size | rank), as safe a file or Mooncake key as the key itself."""
        if self.tp_size == 1:
            return key
        return hashlib.sha256(f"{key}|tp={self.tp_size}|rank={self.rank}".encode("ascii")).hexdigest()

    def namespace(self) -> str:
        """What this shard adds to a namespace (empty on one rank: single-rank names stay as they were)."""
        return "" if self.tp_size == 1 else f"|tp={self.tp_size}|rank={self.rank}"

    def path(self, path: str) -> str:
        """This rank's file of a per-rank file at `path` (the L2 snapshot): `path` itself on one rank."""
        return path if self.tp_size == 1 else f"{path}.tp{self.tp_size}-rank{self.rank}"


class RankLink(Protocol):
    """What rank 0's cache tells the other tensor-parallel ranks, on the scheduler thread, in decision order.

    The agreements are collectives: every rank answers, rank 0 gets the minimum."""

    def storage_op(self, kind: str, op_id: int, keys: list[str], host_pages: list[int]) -> None:
        """An L3 backup or prefetch rank 0 submitted (StorageIO): each rank submits it on its own shard."""

    def agree_prefetches(self, done: list[tuple[int, int]]) -> list[int]:
        """Per finished prefetch (op id, leading groups rank 0 read and verified): the leading groups every
        rank read and verified."""

    def snapshot_saved(self, keys: list[str], host_pages: list[int]) -> bool:
        """Rank 0 saved its L2 snapshot of these host pages (its page keys, in file order): each rank saves
        its share; whether all did."""

    def snapshot_restored(self, keys: list[str], host_pages: list[int]) -> bool:
        """Rank 0 restored these host pages from its L2 snapshot (nothing: it restored none): each rank
        restores its share into the same pages; whether all did (else rank 0 drops what it restored)."""
