"""RankCache: a rank > 0's share of rank 0's cache tiers, driven by rank 0's plans.

Rank 0's cache decides everything (cache/shards.py). This rank holds its KV heads' share of every page: in
its host pool (L2, shaped as rank 0's, the same page ids), in its own L3 objects (named for its shard) and
in its own L2 snapshot file; it repeats a plan's copies and ops in order, before the plan's forward:

    BACKUP / LOAD_BACK    a copy between its device and host pools, at once
    STORAGE_BACKUP        its share of the host pages written to L3 in the background; until that write is
                          done no later op overwrites those pages (a BACKUP, prefetch or restore into them
                          waits): rank 0 may reuse them as soon as its own write is done
    STORAGE_PREFETCH      its share read from L3 into the host pages in the background (rank 0 keeps the
                          pages reserved until the ranks agree on what was read)
    PREFETCH_DONE         answer: the leading groups that prefetch read and verified (after waiting for it)
    SNAPSHOT_SAVE / LOAD  its snapshot shard of the host pages written / restored; answer 1 if done
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import torch

from kvstrata.args import ServerArgs
from kvstrata.cache.build import storage_io
from kvstrata.cache.host_snapshot import ShardSnapshot
from kvstrata.cache.storage_io import PREFETCH, StorageOp
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.host_pool import HostKVPool
from kvstrata.runtime.forward_plan import ANSWERED, Copy, CopyKind, PageCopy, ShardOp

logger = logging.getLogger(__name__)

ACK_WAIT_S = 1.0
# What a rank reports of its cache share (/server_info's tp_rank_caches): idle, the first three are 0.
STATE_KEYS = ("l3_ops_in_flight", "l3_pinned_host_pages", "l3_prefetches_unanswered", "l3_prefetched_pages",
              "l3_backed_up_objects", "l3_corrupt_objects")


class RankCache:
    """A rank > 0's host pool, L3 objects and snapshot shard, doing what rank 0's plans say."""

    def __init__(self, args: ServerArgs, pool: DeviceKVPool, model_path: str, rank: int):
        config = args.cache_config()
        self.shard = config.shard(rank)
        self.device = pool.device
        self.host_pool = None
        self.io = None
        self.snapshot = None
        if config.host_tier:
            self.host_pool = HostKVPool(pool, HostKVPool.size_pages(pool, config.host_ratio, config.host_size_gb),
                                        layout=config.host_layout)
            if config.storage_backend:
                self.io = storage_io(config, self.host_pool, self.shard)
            if config.snapshot_path:
                self.snapshot = ShardSnapshot.for_engine(config.snapshot_path, model_path, pool.kv_format.name,
                                                         config.page_size, config.weights_namespace(), self.shard)
        self._pinned: Counter = Counter()             # host page -> this rank's L3 writes in flight reading it
        self._writes: dict[int, StorageOp] = {}       # this rank's op id -> an L3 write in flight
        self._prefetches: dict[int, StorageOp] = {}   # rank 0's op id -> this rank's read, until answered

    def apply(self, copies: Iterable[Copy]) -> list[int]:
        """Repeat a plan's copies and ops in order; returns the answers of the ANSWERED ones, in order."""
        answers = []
        for copy in copies:
            if isinstance(copy, PageCopy):
                self._copy(copy)
                continue
            answer = self._shard_op(copy)
            if copy.kind in ANSWERED:
                answers.append(answer)
        return answers

    def _copy(self, copy: PageCopy) -> None:
        host_pool = self._host_pool()
        device_pages = copy.device_pages.to(self.device)
        if copy.kind == CopyKind.BACKUP:
            self._wait_unpinned(copy.host_pages)
            host_pool.backup_from_device(device_pages, copy.host_pages)
        else:
            host_pool.load_to_device(copy.host_pages, device_pages)

    def _shard_op(self, op: ShardOp) -> int:
        kind, pages = op.kind, op.host_pages.tolist()
        if kind == CopyKind.PREFETCH_DONE:
            return self._prefetched(op.op_id)
        if kind in (CopyKind.STORAGE_BACKUP, CopyKind.STORAGE_PREFETCH):
            io = self._io()
            if kind == CopyKind.STORAGE_BACKUP:
                mine = io.submit_backup(op.keys, pages)
                self._pinned.update(pages)
                self._writes[mine.op_id] = mine
            else:
                self._wait_unpinned(pages)
                self._prefetches[op.op_id] = io.submit_prefetch(op.keys, pages)
            return 0
        if self.snapshot is None:
            raise RuntimeError("rank 0 sent an L2 snapshot step but this rank has no snapshot path")
        if kind == CopyKind.SNAPSHOT_SAVE:
            return int(self.snapshot.save(self._host_pool(), op.keys, pages))
        self._wait_unpinned(pages)
        return int(self.snapshot.load(self._host_pool(), op.keys, pages))

    def _prefetched(self, op_id: int) -> int:
        """The leading groups this rank's read of rank 0's prefetch `op_id` got (verified), once it is done."""
        op = self._prefetches.pop(op_id, None)
        if op is None:
            logger.error("rank %d: asked about prefetch %d it never started", self.shard.rank, op_id)
            return 0
        while not op.applied:
            self._poll(wait=True)
        return op.done

    def _wait_unpinned(self, pages: Iterable[int] | torch.Tensor) -> None:
        """Wait until none of `pages` is read by an L3 write of this rank in flight."""
        pages = pages.tolist() if isinstance(pages, torch.Tensor) else pages
        self._poll()
        while self._pinned and any(self._pinned[p] for p in pages):
            self._poll(wait=True)

    def _poll(self, wait: bool = False) -> None:
        """Take this rank's finished L3 ops: unpin what writes read, mark reads done."""
        if self.io is None:
            return
        if wait:
            self.io.wait_for_ack(ACK_WAIT_S)
        for op in self.io.poll_acks():
            op.applied = True
            if op.kind != PREFETCH:
                self._writes.pop(op.op_id, None)
                self._pinned.subtract(op.host_pages)
                self._pinned = +self._pinned      # drop the zeros

    def _host_pool(self) -> HostKVPool:
        if self.host_pool is None:
            raise RuntimeError("rank 0 sent a host-pool copy but this rank has no host pool")
        return self.host_pool

    def _io(self):
        if self.io is None:
            raise RuntimeError("rank 0 sent an L3 op but this rank has no storage backend")
        return self.io

    def state(self) -> list[int]:
        """STATE_KEYS' values now."""
        self._poll()
        stats = self.io.stats() if self.io is not None else {}
        return [len(self._writes) + sum(not op.applied for op in self._prefetches.values()),
                sum(self._pinned.values()), len(self._prefetches), stats.get("prefetched_pages", 0),
                stats.get("backed_up_objects", 0), stats.get("corrupt_pages", 0)]

    def close(self) -> None:
        """Finish this rank's queued L3 writes and stop its workers (a clean STOP)."""
        if self.io is not None:
            self.io.shutdown()
