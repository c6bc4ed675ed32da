"""KVIndex: the router's exact view of what every worker holds, per tier, from their KV events.

One index for all workers: block hash -> the (worker, medium) pairs holding it, and the chain
(parent hash, block tokens) -> hash that BlockStored events carry, so a request's token ids are turned into
block hashes without knowing the workers' hashing (any vLLM / SGLang / kvstrata publisher works). An L3
block is credited to every worker that reads the same store (the workers' /load `storage_id`), and it stays
the store's after the worker that wrote it forgets it: a worker announces an L3 block removed when the node
leaves its tree (host eviction, a flush, a restart), but the store keeps the object (storage_tier.py: L3 is
shared and outlives a flush) and any worker on it reads it back. The store's own capacity eviction is not
announced, so each store's set is bounded (LRU, MAX_STORE_BLOCKS); a credit the store no longer backs costs
one L3 look-up that misses.

A worker's blocks count only while its stream is in sync (no gap since its last resync): between a
detected gap or restart and the resync, the policy falls back to its approximate trees for everyone.
Subscriber threads write, the event loop reads: one lock around both.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvstrata.kv_events import wire

DEVICE_MEDIA = frozenset({"GPU", "CPU"})
HOST_MEDIA = frozenset({"CPU_PINNED", "CPU_TIER", "cpu", "cpu_pinned"})
STORAGE_MEDIA = frozenset({"DISK", "MOONCAKE"})
MAX_TOKENS_PER_EVENT = 1 << 20            # a BlockStored larger than this is refused (untrusted input)
MAX_STORE_BLOCKS = 1 << 20                # blocks remembered per shared L3 store (memory bound)


@dataclass
class WorkerBlocks:
    """What one worker announced: block hashes per medium, and whether its stream is in sync."""

    media: dict[str, set[int]] = field(default_factory=dict)
    in_sync: bool = False
    storage_id: str | None = None


@dataclass(frozen=True)
class TierMatch:
    """A request's leading blocks on one worker: on the device, then in host memory, then in its L3."""

    device: int = 0
    host: int = 0
    storage: int = 0


class KVIndex:
    """Block hash -> (worker, medium); chain -> hash; per-worker sync state."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.block_size: int | None = None
        self._workers: dict[str, WorkerBlocks] = {}
        self._chain: dict[tuple, int] = {}            # (parent hash | None, block tokens) -> hash
        self._key_of: dict[int, tuple] = {}           # hash -> its chain key
        self._holders: Counter = Counter()             # hash -> (worker, medium) pairs and stores holding it
        self._stores: dict[str, OrderedDict[int, None]] = {}   # storage id -> blocks written there (LRU)
        self.stats: Counter = Counter()

    # ---- writers (subscriber threads) --------------------------------------------------------------------

    def apply(self, worker: str, batch: wire.KVEventBatch) -> None:
        """Apply one batch of `worker`'s events (validated: a bad event raises ValueError, nothing half-done
        beyond the events before it)."""
        with self.lock:
            w = self._workers.setdefault(worker, WorkerBlocks())
            for event in batch.events:
                if isinstance(event, wire.AllBlocksCleared):
                    self._clear(w)
                elif isinstance(event, wire.BlockRemoved):
                    held = w.media.get(event.medium or "")
                    for h in event.block_hashes:
                        if held is not None and h in held:
                            held.discard(h)
                            self._release(h)
                else:
                    self._store(w, event)
            self.stats["events"] += len(batch.events)

    def _store(self, w: WorkerBlocks, e: wire.BlockStored) -> None:
        bs, n = e.block_size, len(e.block_hashes)
        if bs < 1 or len(e.token_ids) != n * bs or len(e.token_ids) > MAX_TOKENS_PER_EVENT:
            raise ValueError(f"BlockStored with {n} hashes, {len(e.token_ids)} tokens, block size {bs}")
        if self.block_size is None:
            self.block_size = bs
        elif bs != self.block_size:
            raise ValueError(f"block size {bs} differs from {self.block_size} (all workers must use one)")
        held = w.media.setdefault(e.medium or "", set())
        store = w.storage_id if e.medium in STORAGE_MEDIA else None
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            key = (parent, tuple(e.token_ids[i * bs:(i + 1) * bs]))
            if h not in held:
                held.add(h)
                self._holders[h] += 1
                self._chain[key] = h
                self._key_of[h] = key
            if store:
                self._remember(store, h)
            parent = h

    def _remember(self, store_id: str, h: int) -> None:
        """Block `h` is in the shared store `store_id` (until its LRU bound drops it)."""
        store = self._stores.setdefault(store_id, OrderedDict())
        if h in store:
            store.move_to_end(h)
            return
        store[h] = None
        self._holders[h] += 1
        if len(store) > MAX_STORE_BLOCKS:
            oldest, _ = store.popitem(last=False)
            self._release(oldest)

    def _release(self, h: int) -> None:
        self._holders[h] -= 1
        if self._holders[h] <= 0:
            del self._holders[h]
            key = self._key_of.pop(h, None)
            if key is not None and self._chain.get(key) == h:
                del self._chain[key]

    def _clear(self, w: WorkerBlocks) -> None:
        for held in w.media.values():
            for h in held:
                self._release(h)
        w.media = {}

    def reset(self, worker: str, in_sync: bool) -> None:
        """Forget `worker`'s blocks (a resync follows, or it is gone) and set whether it is in sync."""
        with self.lock:
            w = self._workers.setdefault(worker, WorkerBlocks())
            self._clear(w)
            w.in_sync = in_sync

    def set_in_sync(self, worker: str, in_sync: bool) -> None:
        """Mark `worker`'s stream in or out of sync (out: a gap was seen; its blocks are not used)."""
        with self.lock:
            self._workers.setdefault(worker, WorkerBlocks()).in_sync = in_sync

    def set_storage(self, worker: str, storage_id: str | None) -> None:
        """The L3 `worker` reads (from its /load report)."""
        with self.lock:
            w = self._workers.setdefault(worker, WorkerBlocks())
            if storage_id == w.storage_id:
                return
            w.storage_id = storage_id
            if storage_id:                 # what it announced before its store was known is the store's too
                for held in _held(w, STORAGE_MEDIA):
                    for h in held:
                        self._remember(storage_id, h)

    # ---- readers (the policy) ------------------------------------------------------------------------------

    def covers(self, workers: list[str]) -> bool:
        """Whether every one of `workers` publishes events and is in sync (the exact index may decide)."""
        with self.lock:
            return self.block_size is not None and all(
                w in self._workers and self._workers[w].in_sync for w in workers)

    def hashes(self, tokens) -> list[int]:
        """The block hashes of the leading full blocks of `tokens` that some worker announced."""
        with self.lock:
            bs, out, parent = self.block_size, [], None
            if bs is None:
                return out
            for i in range(0, len(tokens) - bs + 1, bs):
                h = self._chain.get((parent, tuple(tokens[i:i + bs])))
                if h is None:
                    break
                out.append(h)
                parent = h
            return out

    def match(self, worker: str, hashes: list[int]) -> TierMatch:
        """How many of `hashes` (a chain from the start) `worker` has on its device, then in host memory,
        then in any L3 store it reads (announced by any worker on that store)."""
        with self.lock:
            w = self._workers.get(worker)
            if w is None or not w.in_sync:
                return TierMatch()
            device = _held(w, DEVICE_MEDIA)
            local = device + _held(w, HOST_MEDIA)
            store = self._stores.get(w.storage_id) if w.storage_id else None
            stores = _held(w, STORAGE_MEDIA) + ([store] if store else [])
            d = _run(hashes, 0, device)
            h = _run(hashes, d, local)
            s = _run(hashes, h, local + stores)
            return TierMatch(d, h - d, s - h)

    def size(self) -> int:
        """Distinct block hashes held by any worker."""
        with self.lock:
            return len(self._holders)


def _held(w: WorkerBlocks, media: frozenset) -> list:
    return [held for m, held in w.media.items() if m in media]


def _run(hashes: list[int], start: int, held: list) -> int:
    """The end of the run of `hashes` from `start` that are each in one of `held` (no set is copied)."""
    i = start
    while i < len(hashes) and any(hashes[i] in s for s in held):
        i += 1
    return i
