"""KVCacheManager: the one cache facade the scheduler sees.

It owns the L1 page allocator, the request-to-slot table and (unless disabled) the radix tree, and
keeps the page ownership rule: every allocatable device page belongs to exactly one of
{free list, radix tree, one running request}. A request's pages split at `req.tree_len`:

    tokens [0, tree_len)        pages owned by the tree, locked through req.last_node
    tokens [tree_len, slot_len) the request's private pages (freed or handed to the tree on commit)

Verbs: `match` (look up and lock the cached prefix), `reserve` (slots for new tokens, evicting if needed),
`commit` (hand computed full pages to the tree), `release` (request done: commit, unlock, free),
`check_integrity`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional

import torch

from kvstrata.cache.integrity import check_slot_accounting
from kvstrata.memory.allocator import PageAllocator, pages_needed, pages_of_slots, slots_for_extend
from kvstrata.memory.req_slots import ReqSlotTable
from kvstrata.runtime.req import Req

if TYPE_CHECKING:
    from kvstrata.cache.host_snapshot import HostSnapshot

logger = logging.getLogger(__name__)

LOAD_BACK_MIN_TOKENS = 16   # a shorter host hit is cheaper to recompute than to copy back
PREFETCH_RETRY_REASONS = ("host_full", "rate_limited")
MAX_REFETCHES = 2           # re-prefetches per request after its local pages were evicted while it waited


class KVCacheManager:
    """Allocation, prefix reuse and accounting of the device KV pool."""

    def __init__(self, allocator: PageAllocator, slot_table: ReqSlotTable, tree=None,
                 prefetch_policy: str = "best_effort", host_snapshot: Optional[HostSnapshot] = None):
        self.allocator = allocator
        self.slot_table = slot_table
        self.tree = tree
        self.page_size = allocator.page_size
        self.hierarchical = hasattr(tree, "apply_acks")
        self.storage = hasattr(tree, "prefetch")
        self.prefetch_policy = prefetch_policy
        self._loads: list = []          # load-backs submitted for the coming forward
        self.metrics = {"device_hit_tokens": 0, "host_hit_tokens": 0, "storage_hit_tokens": 0}
        self.refetches = 0              # prefetches re-issued because L1/L2 lost pages a request waited on
        self.host_snapshot = host_snapshot if self.hierarchical else None
        if self.host_snapshot is not None:
            self.host_snapshot.load(tree)

    # ------------------------------------------------------------------ L3 prefetch
    def start_prefetch(self, req: Req) -> None:
        """On arrival: start reading from L3 what the local tiers miss of req's prompt."""
        if not self.storage:
            return
        from kvstrata.cache.storage_radix_cache import prefetch_deadline

        self.begin_step()            # completed copies release their locks: more host room
        op = self.tree.prefetch(req.fill_ids[: req.fill_len - 1], namespace=req.namespace)
        req.prefetch_op = op
        req.prefetch_local = self._local_tokens(req)
        first_try = not req.prefetch_retry
        if op is not None:
            req.prefetch_retry = False
            if first_try:
                req.prefetch_deadline = prefetch_deadline(self.prefetch_policy, len(op.keys))
        elif self.tree.last_skip_reason in PREFETCH_RETRY_REASONS and self.prefetch_policy != "best_effort":
            # Host room is often short only while copies are in flight: try again until the deadline.
            req.prefetch_retry = True
            if first_try:
                req.prefetch_deadline = prefetch_deadline(self.prefetch_policy, req.fill_len // self.page_size)

    def prefetch_ready(self, req: Req) -> bool:
        """Whether req may be scheduled now, per --hicache-storage-prefetch-policy."""
        expired = time.monotonic() >= req.prefetch_deadline
        if req.prefetch_retry and not expired:
            self.start_prefetch(req)
        elif self._lost_local_pages(req):
            # While req waited for room, L1/L2 evicted pages its prefetch had counted on (host LRU picks
            # the prefixes of waiting conversations first): they are in L3, so fetch them again.
            self.refetches += 1
            req.prefetch_refetches += 1
            req.prefetch_retry = False         # a first try again: with a deadline of its own
            self.start_prefetch(req)
            expired = time.monotonic() >= req.prefetch_deadline
        op = req.prefetch_op
        if op is None:
            return not req.prefetch_retry or expired
        return op.applied or self.prefetch_policy == "best_effort" or expired

    def _local_tokens(self, req: Req) -> int:
        """Tokens of req's prompt that L1 + L2 hold now (what a prefetch does not have to read)."""
        match = self.tree.match_prefix(req.fill_ids[: req.fill_len - 1], namespace=req.namespace, record=False)
        return match.length + match.host_tokens

    def _lost_local_pages(self, req: Req) -> bool:
        """Whether L1 + L2 now hold less of req's prompt than when its prefetch was planned (plus what the
        prefetch attached): pages evicted while req waited, that a new prefetch can bring back from L3."""
        op = req.prefetch_op
        if not self.storage or req.prefetch_refetches >= MAX_REFETCHES or (op is not None and not op.applied):
            return False
        attached = op.done * self.page_size if op is not None else 0
        return self._local_tokens(req) < req.prefetch_local + attached

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        """Apply finished host copies to the tree (once per step, before the tree is used)."""
        if self.hierarchical:
            self.tree.apply_acks()

    def take_layer_wait(self):
        """The per-layer wait hook for the coming forward (None when nothing is loading)."""
        if not self._loads:
            return None
        from kvstrata.cache.cache_controller import layer_wait_for

        handles, self._loads = self._loads, []
        return layer_wait_for(handles)

    def close(self) -> None:
        """Finish in-flight copies (so the last pages still reach L2/L3), then stop the workers."""
        if self.hierarchical:
            self.tree.wait_idle()       # applying the last host acks queues their L3 backups
        if self.host_snapshot is not None:
            try:
                self.host_snapshot.save(self.tree)
            except OSError as e:        # a full or read-only disk costs the next start its L2, nothing else
                logger.error("L2 snapshot to %s failed: %s", self.host_snapshot.path, e)
        if self.storage:
            self.tree.close()
        if self.hierarchical:
            self.tree.controller.shutdown()

    # ------------------------------------------------------------------ capacity
    def available_pages(self) -> int:
        """Pages obtainable now: free plus evictable from the tree."""
        evictable = self.tree.evictable_size() // self.page_size if self.tree is not None else 0
        return self.allocator.free_pages + evictable

    def pages_for(self, req: Req, num_new: int) -> int:
        """New pages `req` needs to get slots for `num_new` more tokens."""
        return pages_needed(req.slot_len, req.slot_len + num_new, self.page_size)

    # ------------------------------------------------------------------ admission
    def admit(self, req: Req) -> bool:
        """Give `req` a slot-table row and match its cached prefix. False when no row is free."""
        row = self.slot_table.alloc()
        if row is None:
            return False
        req.row = row
        req.kv_len = req.slot_len = req.tree_len = 0
        self.match(req)
        return True

    def match(self, req: Req) -> int:
        """Look up the longest cached prefix of req's tokens, lock it, use its slots. Returns its length."""
        if self.tree is None:
            return 0
        limit = req.fill_len - 1          # at least one token is computed, to get logits
        if req.wants_prompt_logprobs:
            limit = min(limit, req.logprob_start_len)   # logits of those positions are needed
        if limit <= 0:
            return 0
        result = self.tree.match_prefix(req.fill_ids[:limit], namespace=req.namespace)
        device_hit = result.length
        storage_hit = 0
        host_tokens = getattr(result, "host_tokens", 0)
        if host_tokens >= LOAD_BACK_MIN_TOKENS:
            host_nodes = result.host_nodes
            loaded = self.tree.load_back(result)
            if loaded is not None:
                result, handle = loaded
                self._loads.append(handle)
                if self.storage:
                    storage_hit = self.tree.count_storage_hits(host_nodes)
        n = result.length
        req.tier_hits = (device_hit, n - device_hit - storage_hit, storage_hit)
        self.tree.inc_lock_ref(result.last_node)
        req.last_node = result.last_node
        if n:
            self.slot_table.write(req.row, 0, result.slots)
        req.kv_len = req.slot_len = req.tree_len = n
        return n

    def record_hits(self, req: Req) -> None:
        """Count req's match in the per-tier hit metrics: once, when its admission is final.

        A match that is undone (no pages, retried next step) or repeated after a retraction is not counted,
        so device + host + storage hits add up to the cached_tokens reported to clients.
        """
        for key, tokens in zip(("device_hit_tokens", "host_hit_tokens", "storage_hit_tokens"), req.tier_hits):
            self.metrics[key] += tokens

    def reserve(self, req: Req, num_new: int) -> bool:
        """Assign slots to req's next `num_new` tokens, evicting from the tree if needed. All or nothing."""
        need = self.pages_for(req, num_new)
        if need and not self.ensure_free_pages(need):
            return False
        pages = self.allocator.alloc(need) if need else []
        last_slot = int(self.slot_table.table[req.row, req.slot_len - 1]) if req.slot_len else None
        slots = slots_for_extend(last_slot, req.slot_len, num_new, pages, self.page_size)
        self.slot_table.write(req.row, req.slot_len, slots.to(self.slot_table.table.device))
        req.slot_len += num_new
        return True

    def ensure_free_pages(self, num_pages: int) -> bool:
        """Evict from the tree until `num_pages` are free. False if impossible."""
        short = num_pages - self.allocator.free_pages
        if short > 0 and self.tree is not None:
            self.tree.evict(short * self.page_size)
        return self.allocator.free_pages >= num_pages

    # ------------------------------------------------------------------ commit / release
    def commit(self, req: Req) -> None:
        """Hand req's computed full pages to the tree, so that other requests can share them now."""
        if self.tree is None:
            return
        upto = req.kv_len - req.kv_len % self.page_size
        if upto <= req.tree_len:
            return
        tokens = req.fill_ids[:upto]
        slots = self.slot_table.read(req.row, upto)
        already = self.tree.insert(tokens, slots.clone(), namespace=req.namespace)
        if already > req.tree_len:
            # Another request cached [tree_len, already) first: our copies of those pages are duplicates.
            self.allocator.free(pages_of_slots(slots[req.tree_len:already], self.page_size))
        result = self.tree.match_prefix(tokens, namespace=req.namespace, record=False)
        assert result.length == upto, f"commit: matched {result.length} of {upto} inserted tokens"
        self.slot_table.write(req.row, 0, result.slots)
        self.tree.inc_lock_ref(result.last_node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = result.last_node
        req.tree_len = upto

    def release(self, req: Req, cache: bool = True) -> None:
        """Request done (finished, aborted or retracted): optionally commit, then free everything it holds."""
        if req.row is None:
            return
        if cache:
            self.commit(req)
        self.allocator.free(self.private_pages(req))
        if self.tree is not None and req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        self.slot_table.free(req.row)
        req.row = req.last_node = None
        req.kv_len = req.slot_len = req.tree_len = 0

    def private_pages(self, req: Req) -> list[int]:
        """Pages of req that are neither free nor the tree's."""
        if req.row is None or req.slot_len <= req.tree_len:
            return []
        slots = self.slot_table.read(req.row, req.slot_len)[req.tree_len:]
        return pages_of_slots(slots, self.page_size).tolist()

    def slots_of(self, req: Req, start: int, end: int) -> torch.Tensor:
        """Slots of req's tokens [start, end)."""
        return self.slot_table.table[req.row, start:end]

    # ------------------------------------------------------------------ maintenance
    def flush(self) -> None:
        """Empty the tree (the caller makes sure no request is running)."""
        if self.tree is not None:
            self.tree.reset()

    def check_integrity(self, running: Iterable[Req]) -> None:
        """Assert that every device page has exactly one owner and every row one request."""
        running = list(running)
        if self.tree is not None:
            self.tree.check_integrity()       # its own structure, and host pages for the tiered trees
        check_slot_accounting(self.allocator, self.tree, [p for r in running for p in self.private_pages(r)])
        rows_in_use = self.slot_table.max_requests - self.slot_table.free_rows
        if rows_in_use != len(running):
            raise AssertionError(f"{rows_in_use} slot-table rows in use for {len(running)} running requests")

    def stats(self) -> dict:
        """Pool occupancy numbers for /server_info."""
        out = {
            "free_pages": self.allocator.free_pages,
            "capacity_pages": self.allocator.capacity_pages,
            "page_size": self.page_size,
        }
        if self.tree is not None:
            out["cache_pages"] = self.tree.total_size() // self.page_size
            out["evictable_tokens"] = self.tree.evictable_size()
            out["protected_tokens"] = self.tree.protected_size()
        else:
            out["cache_pages"] = 0
        out.update(self.metrics)
        if self.storage:
            out["l3_refetches"] = self.refetches
        if self.hierarchical:
            out["hicache"] = self.tree.metrics()
            out["hicache"].update(self.tree.controller.stats())
            if self.host_snapshot is not None:
                out["hicache"]["snapshot"] = self.host_snapshot.stats()
        return out


def build_tree(args, allocator: PageAllocator, device_pool, model_path: str = "") -> Optional[object]:
    """The prefix tree the settings ask for: None, a RadixCache, or a HiRadixCache with a host pool."""
    if args.disable_radix_cache:
        return None
    if not args.enable_hierarchical_cache:
        from kvstrata.cache.radix_cache import RadixCache

        return RadixCache(allocator, allocator.page_size, eviction_policy=args.radix_eviction_policy)
    from kvstrata.cache.cache_controller import CacheController
    from kvstrata.cache.hiradix_cache import HiRadixCache
    from kvstrata.memory.host_pool import HostKVPool

    host_pages = HostKVPool.size_pages(device_pool, args.hicache_ratio, args.hicache_size)
    host_pool = HostKVPool(device_pool, host_pages, layout=args.hicache_mem_layout)
    controller = CacheController(device_pool, host_pool)
    tiers = (allocator, allocator.page_size, host_pool, controller)
    policies = {"write_policy": args.hicache_write_policy, "eviction_policy": args.radix_eviction_policy}
    if not args.hicache_storage_backend:
        return HiRadixCache(*tiers, **policies)
    from kvstrata.cache.storage_radix_cache import StorageRadixCache
    from kvstrata.cache.storage_tier import StorageTier, kv_namespace
    from kvstrata.storage.base import create_backend

    backend = create_backend(args.hicache_storage_backend, host_pool.page_bytes, args.storage_extra_config(),
                             storage_dir=args.hicache_storage_dir)
    return StorageRadixCache(*tiers, **policies, storage=StorageTier(backend, host_pool),
                             storage_namespace=kv_namespace(model_path, str(device_pool.dtype),
                                                            allocator.page_size))


def build_host_snapshot(args, device_pool, model_path: str) -> Optional[HostSnapshot]:
    """The L2 snapshot --hicache-snapshot-path asks for (None: off)."""
    if not args.hicache_snapshot_path:
        return None
    from kvstrata.cache.host_snapshot import HostSnapshot

    return HostSnapshot.for_engine(args.hicache_snapshot_path, model_path, str(device_pool.dtype), args.page_size)
