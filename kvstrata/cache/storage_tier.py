"""StorageTier (L3): tree nodes' pages in a storage backend, written on host copy, prefetched on arrival.

Two flows, both through StorageIO's background worker:

    backup:   a node whose host copy completes is written to L3 under its page keys (once: storage.backed)
    prefetch: when a request arrives, the pages of its prompt beyond what L1+L2 hold are looked up in L3
              and read into reserved host pages; on the ack the host tier hangs them under their prefix
              as a host-only node, so the request's match (and load-back) finds them like any L2 hit

A page's key chains the hash of its tokens with the previous page's key, in a namespace naming the model,
dtype and page size (and the request's cache namespace), so every process serving the same model finds
the same pages. L3 is shared and outlives the process: this tier never drops or evicts anything there.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator

from kvstrata.cache.page_hash import page_keys
from kvstrata.cache.radix_tree import RadixTree, StorageCopy, TreeNode, require
from kvstrata.cache.storage_io import PREFETCH, StorageIO, StorageOp

logger = logging.getLogger(__name__)

PREFETCH_MIN_PAGES = 1              # fewer missing pages than this are not worth an L3 round trip
PREFETCH_MAX_INFLIGHT_FRACTION = 0.75   # prefetches in flight may hold at most this share of the host pool


class StorageTier:
    """L3: backup of host copies and prefetch into the host tier (`above`, a HostTier)."""

    name = "storage"

    def __init__(self, tree: RadixTree, io: StorageIO, storage_namespace: str):
        self.tree = tree
        self.io = io
        self.storage_namespace = storage_namespace
        self.above = None      # the HostTier, set by the facade
        self.below = None
        self._writes: dict[int, TreeNode] = {}     # backup op id -> the node it was submitted for
        self._prefetches: dict[int, StorageOp] = {}      # in-flight prefetches (they hold host pages)
        self._prefetch_inflight_pages = 0
        self.last_skip_reason: str | None = None   # why the latest prefetch() returned None
        self.prefetch_skipped: Counter = Counter()
        self.stats = {"prefetch_requests": 0, "prefetched_tokens": 0, "prefetch_attached_tokens": 0,
                      "storage_hit_tokens": 0, "storage_backup_pages": 0}

    # ---- protocol -------------------------------------------------------------------------------------

    def holds(self, node: TreeNode) -> bool:
        """Whether node's pages are written to L3."""
        return node.storage is not None and node.storage.backed

    def can_take(self, num_pages: int) -> bool:
        """The backend evicts on its own: a write is always worth trying."""
        return True

    def drop(self, node: TreeNode) -> None:
        """L3 is shared with other processes: a node leaving the tree leaves its pages there."""

    def drop_subtree(self, node: TreeNode) -> None:
        """Nothing to remove: see drop."""

    def accept_demotion(self, node: TreeNode) -> None:
        """Pages reach L3 through the host tier, never straight from the device."""

    def eviction_candidates(self) -> Iterator[TreeNode]:
        """None: the backend does its own eviction."""
        return iter(())

    def reset(self) -> None:
        """L3 keeps its pages across a flush."""

    # ---- keys -------------------------------------------------------------------------------------------

    def _namespace_key(self, namespace: str | None) -> str:
        return self.storage_namespace if namespace is None else f"{self.storage_namespace}|{namespace}"

    def _record(self, node: TreeNode) -> StorageCopy:
        """node's storage record, its page keys chained from its parent's last key."""
        if node.storage is None:
            parent = node.parent
            prior = None if parent.is_root else self._record(parent).keys[-1]
            keys = page_keys(node.key, self.tree.page_size, self._namespace_key(node.root().namespace), prior)
            node.storage = StorageCopy(keys)
        return node.storage

    # ---- backup to L3 -------------------------------------------------------------------------------------

    def on_host_ready(self, node: TreeNode) -> None:
        """node's host copy is complete: write it to L3 (once)."""
        record = self._record(node)
        if record.backed or record.op_id is not None:
            return
        op = self.io.submit_backup(record.keys, node.host.pages.tolist(), node)
        record.op_id = op.op_id
        self._writes[op.op_id] = node
        self.stats["storage_backup_pages"] += len(op.keys)

    # ---- prefetch from L3 ---------------------------------------------------------------------------------

    def prefetch(self, token_ids: list[int], namespace: str | None = None) -> StorageOp | None:
        """Start reading from L3 the pages of `token_ids` that neither device nor host holds (None: skipped)."""
        self.stats["prefetch_requests"] += 1
        ps, host = self.tree.page_size, self.above
        match = self.tree.match_prefix(token_ids, namespace, record=False)
        have = match.cached_tokens
        aligned = len(token_ids) - len(token_ids) % ps
        missing = (aligned - have) // ps
        if missing < max(1, PREFETCH_MIN_PAGES):
            return self._skip("nothing_to_fetch" if missing <= 0 else "too_short")
        limit = int(host.allocator.capacity_pages * PREFETCH_MAX_INFLIGHT_FRACTION)
        if self._prefetch_inflight_pages + missing > limit:
            return self._skip("rate_limited")
        # The cached path the pages will hang under stays locked until the ack: making room in the host
        # pool must not evict it, nor may anything else before the pages are attached.
        anchor = match.host_nodes[-1] if match.host_nodes else match.last_node
        self.tree.inc_lock_ref(anchor)
        pages = host.alloc(missing)
        if pages is None:
            self.tree.dec_lock_ref(anchor)
            return self._skip("host_full")
        keys = page_keys(token_ids[:aligned], ps, self._namespace_key(namespace))[have // ps:]
        self._prefetch_inflight_pages += missing
        self.last_skip_reason = None
        op = self.io.submit_prefetch(keys, pages, (tuple(token_ids[:aligned]), namespace, have, anchor))
        self._prefetches[op.op_id] = op
        return op

    def _skip(self, reason: str) -> None:
        self.prefetch_skipped[reason] += 1
        self.last_skip_reason = reason
        return None

    def apply_acks(self) -> None:
        """Attach prefetched pages, mark written nodes (the facade calls it once per step)."""
        for op in self.io.poll_acks():
            op.applied = True
            if op.kind == PREFETCH:
                self._prefetches.pop(op.op_id, None)
                self._prefetch_inflight_pages -= len(op.host_pages)
                self.stats["prefetched_tokens"] += op.done * self.tree.page_size
                self._attach(op)
                continue
            node = self._writes.pop(op.op_id, None)
            # The node and the ancestors split off it while the write was in flight share the op.
            while node is not None and not node.is_root and node.storage is not None \
                    and node.storage.op_id == op.op_id:
                node.storage.op_id = None
                node.storage.backed = op.done == len(op.keys)
                node = node.parent
            self.above.unpin(op.op_id)

    def _attach(self, op: StorageOp) -> None:
        """Hand the fetched pages to the host tier under their prefix; free the ones not read."""
        tokens, namespace, start, anchor = op.tag
        self.tree.dec_lock_ref(anchor)
        host = self.above
        host.allocator.free(op.host_pages[op.done:])
        leaf = host.insert_host_pages(tokens, op.host_pages[:op.done], namespace, start) if op.done else None
        if leaf is None:
            return
        record = self._record(leaf)
        record.backed = record.from_prefetch = True
        self.stats["prefetch_attached_tokens"] += len(leaf.key)

    def count_hits(self, nodes: list[TreeNode]) -> int:
        """Tokens of `nodes` (a loaded-back chain) that came from L3; each prefetch counts once."""
        hits = 0
        for node in nodes:
            if node.storage is not None and node.storage.from_prefetch:
                hits += len(node.key)
                node.storage.from_prefetch = False
        self.stats["storage_hit_tokens"] += hits
        return hits

    # ---- lifecycle and inspection -------------------------------------------------------------------------

    def wait_idle(self) -> None:
        """Wait for in-flight L3 I/O and apply its acks (shutdown and flush only, never within a step)."""
        self.io.wait_idle()
        self.apply_acks()

    def close(self) -> None:
        """Finish queued L3 writes and stop the worker."""
        self.io.shutdown()

    def host_pages_in_flight(self) -> list[int]:
        """Host pages reserved by prefetches whose ack is not applied yet."""
        return [p for op in self._prefetches.values() for p in op.host_pages]

    def check_integrity(self) -> None:
        """Every node being written is known to an in-flight write, and every write covers live records."""
        for node in self.tree.nodes():
            s = node.storage
            if s is None:
                continue
            require(len(s.keys) * self.tree.page_size == len(node.key), f"{node}: storage keys for key")
            require(s.op_id is None or s.op_id in self._writes, f"{node}: unknown L3 write")
        pages = self.host_pages_in_flight()
        require(sum(len(op.host_pages) for op in self._prefetches.values()) == self._prefetch_inflight_pages,
                "prefetch page count drifted")
        require(len(pages) == len(set(pages)), "a host page is reserved by two prefetches")

    def metrics(self) -> dict:
        """L3 counters and skipped prefetches by reason."""
        m = dict(self.stats)
        m["prefetch_skipped"] = dict(self.prefetch_skipped)
        m["storage"] = self.io.stats()
        return m


def prefetch_deadline(policy: str, num_pages: int, now: float | None = None) -> float:
    """When a request stops waiting for its prefetch: never for best_effort, after a size-based timeout."""
    now = time.monotonic() if now is None else now
    if policy == "best_effort":
        return now
    if policy == "wait_complete":
        return float("inf")
    return now + 0.2 + 0.002 * num_pages
