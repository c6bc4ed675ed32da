"""KVCacheManager: the one cache facade the scheduler sees.

It owns the L1 page allocator, the request-to-slot table and the radix tree with its chain of tiers
(device -> host -> storage, each holding the next: tier.py), and keeps the page ownership rule: every
allocatable device page belongs to exactly one of {free list, radix tree, one running request}. Without
the prefix cache (--disable-radix-cache) the tree stays empty: commit hands it nothing, so every match is
empty. build_kv_cache (build.py) is its one constructor. It reads requests through the CacheRequest
protocol; a request's KV state is a KVHandle (kv_handle.py) that this facade creates and alone writes; the
request holds it as `req.kv`. Its pages split at the handle's `tree_len`:

    tokens [0, tree_len)        pages owned by the tree, locked through the handle's last_node
    tokens [tree_len, slot_len) the request's private pages (freed or handed to the tree on commit)

Verbs: `plan_admit` (what an admission would take; pure) and `admit` (take it, count the hit once),
`reserve` (slots for new tokens, evicting if needed), `advance` (the forward computed more KV),
`commit` (hand computed full pages to the tree), `release` (request done: commit, unlock, free),
`begin_step` (apply every tier's completed copies: the one place per step), `check_integrity`.
A request's prompt is matched against the tree once per step however many of these ask (`_match`: the
match is memoised on its handle until the tree's version stamp moves).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.device_tier import DeviceTier
from kvstrata.cache.integrity import check_slot_accounting
from kvstrata.cache.kv_handle import CacheRequest, KVHandle
from kvstrata.cache.radix_tree import TreeMatch, TreeNode
from kvstrata.cache.tier import Tier
from kvstrata.memory.allocator import PageAllocator, pages_needed, pages_of_slots, slots_for_extend
from kvstrata.memory.req_slots import ReqSlotTable

if TYPE_CHECKING:
    from kvstrata.cache.host_snapshot import HostSnapshot

logger = logging.getLogger(__name__)

LOAD_BACK_MIN_TOKENS = 16   # a shorter host hit is cheaper to recompute than to copy back
PREFETCH_RETRY_REASONS = ("host_full", "rate_limited")
MAX_REFETCHES = 2           # re-prefetches per request after its local pages were evicted while it waited


@dataclass(frozen=True)
class AdmitPlan:
    """What an admission would take (see KVCacheManager.plan_admit); tokens of the request's prompt."""

    device_tokens: int     # cached on the device: used in place
    host_tokens: int       # cached on the host only: loaded back (L3 hits arrive through the host)
    new_tokens: int        # computed by the first chunk
    pages: int             # device pages taken: load-back plus the first chunk
    available_pages: int   # device pages obtainable once the prefix is locked

    @property
    def cached_tokens(self) -> int:
        """Tokens the request will not compute."""
        return self.device_tokens + self.host_tokens

    def fits(self, headroom_pages: int = 0) -> bool:
        """Whether the pages it takes, plus `headroom_pages` kept for others, are obtainable now."""
        return self.pages + headroom_pages <= self.available_pages


class KVCacheManager:
    """Allocation, prefix reuse and accounting of the device KV pool."""

    def __init__(self, allocator: PageAllocator, slot_table: ReqSlotTable, device: DeviceTier,
                 config: CacheConfig, host_snapshot: HostSnapshot | None = None):
        """Use build_kv_cache (build.py): it builds the parts this takes."""
        self.allocator = allocator
        self.slot_table = slot_table
        self.device = device
        self.tree = device.tree
        self.host = device.host                                         # L2 (None: no host tier)
        self.storage = self.host.storage if self.host is not None else None   # L3 (None: no storage tier)
        self.tiers: list[Tier] = [t for t in (device, self.host, self.storage) if t is not None]
        self.shares_prefixes = config.prefix_cache   # False: the tree stays empty (--disable-radix-cache)
        self.page_size = allocator.page_size
        # Free pages set aside behind a request's new ones, so that its next tokens follow them in one run
        # (--kv-run-spare-tokens; PageAllocator.extend says why).
        self.spare_pages = -(-config.spare_tokens // self.page_size)
        self.prefetch_policy = config.prefetch_policy
        self._loads: list = []          # load-backs submitted for the coming forward
        self.metrics = {"device_hit_tokens": 0, "host_hit_tokens": 0, "storage_hit_tokens": 0}
        self.refetches = 0              # prefetches re-issued because L1/L2 lost pages a request waited on
        self.host_snapshot = host_snapshot if self.host is not None else None
        # --kv-events-config: the tree's residency sink, and where its per-step events go (the scheduler
        # sets the publisher's queue); both None when events are off.
        self.events = self.tree.events
        self.publish_events: Callable[[list], None] | None = None
        if self.host_snapshot is not None and self.host is not None:
            if self.host_snapshot.load(self.host).other_ranks_failed:
                self.flush()            # tensor parallelism: a rank lacks its share, so every rank starts cold

    @staticmethod
    def _handle(req: CacheRequest) -> KVHandle:
        """req's KV handle, created on first use: the cache owns it, the request holds it."""
        if req.kv is None:
            req.kv = KVHandle()
        return req.kv

    def advance(self, req: CacheRequest, kv_len: int) -> None:
        """The forward computed req's KV up to `kv_len` tokens (within the slots reserved for it)."""
        h = self._handle(req)
        if not h.kv_len <= kv_len <= h.slot_len:
            raise ValueError(f"advance to {kv_len}: kv_len {h.kv_len}, slot_len {h.slot_len}")
        h.kv_len = kv_len

    # ------------------------------------------------------------------ L3 prefetch
    def start_prefetch(self, req: CacheRequest) -> None:
        """On arrival: start reading from L3 what the local tiers miss of req's prompt."""
        h = self._handle(req)
        if self.storage is None:
            return
        from kvstrata.cache.storage_tier import prefetch_deadline

        local = req.fill_len - 1
        op, skipped = self.storage.prefetch(req.fill_ids[:local], req.namespace, self._match(req, local))
        h.prefetch_op = op
        h.prefetch_local = self._local_tokens(req)
        first_try = not h.prefetch_retry
        if op is not None:
            h.prefetch_retry = False
            if first_try:
                h.prefetch_deadline = prefetch_deadline(self.prefetch_policy, len(op.keys))
        elif skipped in PREFETCH_RETRY_REASONS and self.prefetch_policy != "best_effort":
            # Host room is often short only while copies are in flight: try again until the deadline.
            h.prefetch_retry = True
            if first_try:
                h.prefetch_deadline = prefetch_deadline(self.prefetch_policy, req.fill_len // self.page_size)

    def prefetch_ready(self, req: CacheRequest) -> bool:
        """Whether req may be scheduled now, per --hicache-storage-prefetch-policy."""
        h = self._handle(req)
        expired = time.monotonic() >= h.prefetch_deadline
        if h.prefetch_retry and not expired:
            self.start_prefetch(req)
        elif self._lost_local_pages(req):
            # While req waited for room, L1/L2 evicted pages its prefetch had counted on (host LRU picks
            # the prefixes of waiting conversations first): they are in L3, so fetch them again.
            self.refetches += 1
            h.prefetch_refetches += 1
            h.prefetch_retry = False           # a first try again: with a deadline of its own
            self.start_prefetch(req)
            expired = time.monotonic() >= h.prefetch_deadline
        op = h.prefetch_op
        if op is None:
            return not h.prefetch_retry or expired
        return op.applied or self.prefetch_policy == "best_effort" or expired

    def _local_tokens(self, req: CacheRequest) -> int:
        """Tokens of req's prompt that L1 + L2 hold now (what a prefetch does not have to read)."""
        return self._match(req, req.fill_len - 1).cached_tokens

    def _lost_local_pages(self, req: CacheRequest) -> bool:
        """Whether L1 + L2 now hold less of req's prompt than when its prefetch was planned (or than it
        attached): pages evicted while req waited, that a new prefetch can bring back from L3."""
        h = self._handle(req)
        op = h.prefetch_op
        if self.storage is None or h.prefetch_refetches >= MAX_REFETCHES or (op is not None and not op.applied):
            return False
        expected = h.prefetch_local
        if op is not None:
            expected = max(expected, self.storage.prefetch_reach(op))
        return self._local_tokens(req) < expected

    # ------------------------------------------------------------------ per step
    def begin_step(self) -> None:
        """Apply every tier's finished copies to the tree (once per step, before the tree is used)."""
        if self.storage is not None and self.prefetch_policy != "best_effort":
            self.storage.await_fresh_prefetches()   # requests that arrived together start together
        for tier in self.tiers:
            tier.apply_acks()
        self.flush_events()

    def flush_events(self) -> None:
        """Hand this step's residency events to the publisher (a no-op when events are off)."""
        if self.events is None or self.publish_events is None:
            return
        batch = self.events.collect()
        if batch:
            self.publish_events(batch)

    def warm(self, token_ids: list[int], namespace: str | None = None) -> dict:
        """A prefetch hint: start loading the cached prefix of `token_ids` closer (L2 -> L1 load-back, and
        an L3 read into L2 of what the local tiers miss). Locks nothing beyond what those copies lock until
        their acks; the next forward waits for the load-back's layers like a request's own."""
        match = self.tree.match_prefix(token_ids, namespace=namespace, record=False)
        out = {"device_tokens": match.length, "host_tokens": match.host_tokens, "loaded_back_tokens": 0,
               "storage_prefetch": None}
        if match.host_tokens >= LOAD_BACK_MIN_TOKENS:
            loaded = self.device.load_back(match)
            if loaded is not None:
                match, handle = loaded
                self._loads.append(handle)
                out["loaded_back_tokens"] = out["host_tokens"]
        if self.storage is not None:
            start = self.storage.prefetch(list(token_ids), namespace, match)
            out["storage_prefetch"] = "started" if start.op is not None else start.skipped
        return out

    def take_layer_wait(self):
        """The per-layer wait hook for the coming forward (None when nothing is loading)."""
        if not self._loads:
            return None
        from kvstrata.cache.cache_controller import layer_wait_for

        handles, self._loads = self._loads, []
        return layer_wait_for(handles)

    def close(self) -> None:
        """Finish in-flight copies (so the last pages still reach L2/L3), then stop the workers."""
        if self.host_snapshot is not None and self.host is not None:
            self.host.wait_idle()
            try:
                self.host_snapshot.save(self.host)
            except OSError as e:        # a full or read-only disk costs the next start its L2, nothing else
                logger.error("L2 snapshot to %s failed: %s", self.host_snapshot.path, e)
        for tier in self.tiers:          # host first: applying its last acks queues their L3 backups
            tier.close()

    # ------------------------------------------------------------------ capacity
    def available_pages(self) -> int:
        """Pages obtainable now: free plus evictable from the tree."""
        return self.device.available_pages()

    def pages_for(self, req: CacheRequest, num_new: int) -> int:
        """New pages `req` needs to get slots for `num_new` more tokens."""
        h = self._handle(req)
        return pages_needed(h.slot_len, h.slot_len + num_new, self.page_size)

    # ------------------------------------------------------------------ admission
    def plan_admit(self, req: CacheRequest, budget: int) -> AdmitPlan | None:
        """What admitting `req` now would use: its cached prefix per tier and the pages it takes.

        Pure: takes no lock, row or page, starts no copy, counts nothing. None when no slot-table row is free.
        """
        if self.slot_table.free_rows == 0:
            return None
        match = self._lookup(req)
        device_tokens = match.length if match is not None else 0
        host_tokens = match.host_tokens if match is not None else 0     # host_nodes only with a host tier
        if host_tokens < LOAD_BACK_MIN_TOKENS:
            host_tokens = 0
        cached = device_tokens + host_tokens
        new_tokens = min(req.fill_len - cached, budget)
        pages = host_tokens // self.page_size + pages_needed(cached, cached + new_tokens, self.page_size)
        # The prefix admission locks is evictable now but will not be then.
        locked = _unlocked_device_tokens(match.last_node) // self.page_size if match is not None else 0
        return AdmitPlan(device_tokens, host_tokens, new_tokens, pages, self.available_pages() - locked)

    def admit(self, req: CacheRequest, plan: AdmitPlan | None = None) -> bool:
        """Admit `req` as planned: take a row, lock the cached prefix, start its load-back, reserve slots for
        the plan's first chunk, and count the hit per tier (once per request). False (nothing held) if the
        plan no longer fits; without a plan, only the row and the cached prefix are taken (PD decode side).
        """
        h = self._handle(req)
        row = self.slot_table.alloc()
        if row is None:
            return False
        h.clear()
        h.row = row
        self.match(req, load_back=plan is None or plan.host_tokens > 0)
        if plan is None:
            return True
        if not self.reserve(req, plan.new_tokens):
            self.release(req, cache=False)
            return False
        if not h.hits_recorded:
            self._record_hits(req)
        return True

    @staticmethod
    def _hit_limit(req: CacheRequest) -> int:
        """How many of req's first tokens a prefix hit may cover."""
        limit = req.fill_len - 1          # at least one token is computed, to get logits
        if req.wants_prompt_logprobs:
            limit = min(limit, req.logprob_start_len)   # logits of those positions are needed
        return limit

    def _match(self, req: CacheRequest, limit: int) -> TreeMatch:
        """The tree's match of req's first `limit` tokens: the one walk per request while the tree does not
        change (memoised on its handle, keyed by the tree's version stamp). Counts nothing."""
        h = self._handle(req)
        if h.match is None or h.match_len != limit or h.match_version != self.tree.version:
            h.match = self.tree.match_prefix(req.fill_ids[:limit], namespace=req.namespace, record=False)
            h.match_len, h.match_version = limit, self.tree.version
        return h.match

    def _lookup(self, req: CacheRequest) -> TreeMatch | None:
        """The match for the part of req's tokens a prefix hit may cover (None: nothing may hit)."""
        limit = self._hit_limit(req)
        return self._match(req, limit) if limit > 0 else None

    def match(self, req: CacheRequest, load_back: bool = True) -> int:
        """Look up the longest cached prefix of req's tokens, lock it, use its slots. Returns its length."""
        h = self._handle(req)
        result = self._lookup(req)
        if result is None:
            return 0
        self.tree.record_match(result, self._hit_limit(req))
        device_hit = result.length
        storage_hit = 0
        if load_back and result.host_tokens >= LOAD_BACK_MIN_TOKENS:
            host_nodes = result.host_nodes
            loaded = self.device.load_back(result)
            if loaded is not None:
                result, handle = loaded
                self._loads.append(handle)
                if self.storage is not None:
                    storage_hit = self.storage.count_hits(host_nodes)
        self.device.on_hit(result.last_node)
        n = result.length
        h.tier_hits = (device_hit, n - device_hit - storage_hit, storage_hit)
        self.tree.inc_lock_ref(result.last_node)
        h.last_node = result.last_node
        if n:
            self.slot_table.write(h.row, 0, result.slots)
        h.kv_len = h.slot_len = h.tree_len = n
        h.last_slot = int(result.slots[-1]) if n else None
        return n

    def _record_hits(self, req: CacheRequest) -> None:
        """Count req's admission in the per-tier hit metrics: once per request, when it is admitted.

        A re-admission after a retraction is not counted again, so device + host + storage hits add up to
        the cached_tokens reported to clients.
        """
        h = self._handle(req)
        h.hits_recorded = True
        for key, tokens in zip(("device_hit_tokens", "host_hit_tokens", "storage_hit_tokens"), h.tier_hits):
            self.metrics[key] += tokens

    def reserve(self, req: CacheRequest, num_new: int) -> bool:
        """Assign slots to req's next `num_new` tokens, evicting from the tree if needed. All or nothing."""
        h = self._handle(req)
        start = h.slot_len
        slots = self._take_slots(h, num_new)
        if slots is None:
            return False
        if slots:
            self.slot_table.write(h.row, start, torch.tensor(slots, dtype=torch.long).to(self.slot_table.table.device))
        return True

    def reserve_decodes(self, reqs: list[CacheRequest]) -> int:
        """Assign a slot to the next token of each of `reqs` in order, up to the first that cannot get one
        (evicting from the tree if needed); how many got theirs. The slot table takes them in one write
        (one host-to-device copy per decode step, not one per request)."""
        rows: list[int] = []
        cols: list[int] = []
        slots: list[int] = []
        for req in reqs:
            h = self._handle(req)
            start = h.slot_len
            new = self._take_slots(h, 1)
            if new is None:
                break
            rows.append(h.row)
            cols.append(start)
            slots.append(new[0])
        if rows:
            self.slot_table.write_cells(rows, cols, slots)
        return len(rows)

    def _take_slots(self, h: KVHandle, num_new: int) -> list[int] | None:
        """Slots for the next `num_new` tokens of the request behind `h` (its pages taken, evicting if
        needed, and `h` advanced over them), or None and nothing taken."""
        need = pages_needed(h.slot_len, h.slot_len + num_new, self.page_size)
        if need and not self.ensure_free_pages(need):
            return None
        after = h.last_slot // self.page_size if h.last_slot is not None else None
        pages = self.allocator.extend(after, need, self.spare_pages) if need else []
        slots = slots_for_extend(h.last_slot, h.slot_len, num_new, pages, self.page_size)
        h.slot_len += num_new
        if num_new:
            h.last_slot = slots[-1]
        return slots

    def ensure_free_pages(self, num_pages: int) -> bool:
        """Evict from the tree until `num_pages` are free. False if impossible."""
        return self.device.ensure_free_pages(num_pages)

    # ------------------------------------------------------------------ commit / release
    def commit(self, req: CacheRequest) -> None:
        """Hand req's computed full pages to the tree, so that other requests can share them now."""
        h = self._handle(req)
        if not self.shares_prefixes:
            return                          # without the prefix cache the tree stays empty
        upto = h.kv_len - h.kv_len % self.page_size
        if upto <= h.tree_len:
            return
        tokens = req.fill_ids[:upto]
        slots = self.slot_table.read(h.row, upto)
        already, leaf = self.tree.insert(tokens, slots.clone(), namespace=req.namespace, priority=req.priority)
        if leaf is not None:
            self.device.on_insert(leaf)
        if already > h.tree_len:
            # Another request cached [tree_len, already) first: our copies of those pages are duplicates.
            self.allocator.free(pages_of_slots(slots[h.tree_len:already], self.page_size))
        result = self.tree.match_prefix(tokens, namespace=req.namespace, record=False)
        assert result.length == upto, f"commit: matched {result.length} of {upto} inserted tokens"
        self.slot_table.write(h.row, 0, result.slots)
        if h.slot_len == upto:
            last_slot = int(result.slots[-1])
            if h.last_slot is not None and last_slot != h.last_slot:   # our tail was a duplicate, now freed
                self.allocator.release_spare(h.last_slot // self.page_size)
            h.last_slot = last_slot
        self.tree.inc_lock_ref(result.last_node)
        if h.last_node is not None:
            self.tree.dec_lock_ref(h.last_node)
        h.last_node = result.last_node
        h.tree_len = upto

    def release(self, req: CacheRequest, cache: bool = True) -> None:
        """Request done (finished, aborted or retracted): optionally commit, then free everything it holds."""
        h = self._handle(req)
        if h.row is None:
            return
        if cache:
            self.commit(req)
        if h.last_slot is not None:
            self.allocator.release_spare(h.last_slot // self.page_size)
        self.allocator.free(self.private_pages(req))
        if h.last_node is not None:
            self.tree.dec_lock_ref(h.last_node)
        self.slot_table.free(h.row)
        h.clear()

    def pages_freed_by_release(self, running: list[CacheRequest], incoming: CacheRequest) -> list[int]:
        """For each request of `running`, the device pages its release alone would give back (pure).

        That is its private pages plus the part of its cached prefix that no other running request, and
        not the prefix `incoming` would match, uses. Pages whose copy to a lower tier is in flight become
        evictable when the copy is acknowledged, a step or so later. One walk per request's path.
        """
        users: dict[int, int] = {}      # node id -> requests whose path holds it
        paths = [list(_path(self._handle(r).last_node)) for r in running]
        match = self._lookup(incoming)
        for path in paths + [list(_path(match.last_node if match is not None else None))]:
            for node in path:
                users[node.id] = users.get(node.id, 0) + 1
        freed = []
        for req, path in zip(running, paths):
            h = self._handle(req)
            tokens = h.slot_len - h.tree_len
            for node in path:
                if users[node.id] > 1:
                    break
                tokens += node.device_tokens
            freed.append(tokens // self.page_size)
        return freed

    def prefetch_settled(self, req: CacheRequest) -> bool:
        """Whether req's L3 prefetch (if any) has landed in the host tier (pure, unlike prefetch_ready)."""
        h = self._handle(req)
        return not h.prefetch_retry and (h.prefetch_op is None or h.prefetch_op.applied)

    def private_pages(self, req: CacheRequest) -> list[int]:
        """Pages of req that are neither free nor the tree's."""
        h = self._handle(req)
        if h.row is None or h.slot_len <= h.tree_len:
            return []
        slots = self.slot_table.read(h.row, h.slot_len)[h.tree_len:]
        return pages_of_slots(slots, self.page_size).tolist()

    def slots_of(self, req: CacheRequest, start: int, end: int) -> torch.Tensor:
        """Slots of req's tokens [start, end)."""
        h = self._handle(req)
        return self.slot_table.table[h.row, start:end]

    # ------------------------------------------------------------------ maintenance
    def flush(self) -> None:
        """Empty the tree (the caller makes sure no request is running)."""
        for tier in self.tiers:
            tier.wait_idle()
        for tier in reversed(self.tiers):
            tier.reset()
        self.tree.clear()
        self.flush_events()

    def check_integrity(self, running: Iterable[CacheRequest]) -> None:
        """Assert that every device page has exactly one owner and every row one request."""
        running = list(running)
        self.tree.check_integrity()           # its own structure, then each tier's pages
        for tier in self.tiers:
            tier.check_integrity()
        check_slot_accounting(self.allocator, self.device, [p for r in running for p in self.private_pages(r)])
        rows_in_use = self.slot_table.max_requests - self.slot_table.free_rows
        if rows_in_use != len(running):
            raise AssertionError(f"{rows_in_use} slot-table rows in use for {len(running)} running requests")
        for req in running:
            h = self._handle(req)
            table_last = int(self.slot_table.table[h.row, h.slot_len - 1]) if h.slot_len else None
            if h.last_slot != table_last:
                raise AssertionError(f"{req.rid}: host-side last slot {h.last_slot} != slot table's {table_last}")

    def forward_slots(self) -> ReqSlotTable:
        """The request-to-slot table the model runner reads a batch's slots from (read only)."""
        return self.slot_table

    def pool_pages(self) -> dict:
        """Free and total device pages, from counters (no walk)."""
        return {"free_pages": self.allocator.free_pages, "capacity_pages": self.allocator.capacity_pages}

    def stats(self) -> dict:
        """Pool occupancy numbers for /server_info."""
        out: dict[str, Any] = {
            "free_pages": self.allocator.free_pages,
            "capacity_pages": self.allocator.capacity_pages,
            "page_size": self.page_size,
        }
        out["cache_pages"] = self.tree.total_size() // self.page_size
        if self.shares_prefixes:
            out["evictable_tokens"] = self.tree.evictable_size()
            out["protected_tokens"] = self.tree.protected_size()
        out.update(self.metrics)
        if self.storage is not None:
            out["l3_refetches"] = self.refetches
        if self.host is not None:
            out["hicache"] = self.tree.metrics()
            for tier in self.tiers:
                out["hicache"].update(tier.metrics())
            if self.host_snapshot is not None:
                out["hicache"]["snapshot"] = self.host_snapshot.stats()
        return out

    def copy_seconds_per_token(self) -> dict:
        """Measured seconds per token of an L2 -> L1 load-back and of an L3 read (0.0: not measured yet),
        from the copy workers' bytes and busy time."""
        out = {"load_back_s_per_token": 0.0, "storage_s_per_token": 0.0}
        if self.host is None:
            return out
        token_bytes = self.host.host_pool.page_bytes / self.page_size
        rate = self.host.controller.stats().get("load_back_bytes_per_s", 0.0)
        out["load_back_s_per_token"] = token_bytes / rate if rate else 0.0
        if self.storage is not None:
            rate = self.storage.io.stats().get("prefetch_bytes_per_s", 0.0)
            out["storage_s_per_token"] = token_bytes / rate if rate else 0.0
        return out

    @property
    def has_host_tier(self) -> bool:
        """Whether an L2 keeps what leaves the device (a paused request then resumes by load-back)."""
        return self.host is not None

    def cached_prefix_tokens(self, req: CacheRequest) -> int:
        """Tokens of req's prompt that admission would find cached in the local tiers now (the match it will
        use, memoised: no extra walk); changes no counter, lock or copy. The scheduler orders its queue by it."""
        match = self._lookup(req)
        return match.cached_tokens if match is not None else 0

    def peek_cached_tokens(self, req: CacheRequest) -> int:
        """Tokens of req's whole prompt cached in the local tiers now (a walk of its own, for inspection);
        changes no counter, lock or copy."""
        return self.tree.match_prefix(req.fill_ids, namespace=req.namespace, record=False).cached_tokens

    def tree_metrics(self) -> dict | None:
        """The radix tree's counters (None without the prefix cache)."""
        return self.tree.metrics() if self.shares_prefixes else None


def _path(node: TreeNode | None) -> Iterable[TreeNode]:
    """node, its parent, ... up to (not including) the root; nothing for None."""
    while node is not None and not node.is_root:
        yield node
        node = node.parent


def _unlocked_device_tokens(node: TreeNode | None) -> int:
    """Device tokens on the path root..node that no lock protects yet."""
    tokens = 0
    for n in _path(node):
        if n.lock_ref:
            break
        tokens += n.device_tokens
    return tokens

