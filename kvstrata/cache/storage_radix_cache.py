"""StorageRadixCache: the tiered tree with a storage tier (L3) under the host tier.

Two flows, both through the StorageTier's background worker:

    backup:   a node whose host copy completes is written to L3 under its page keys (once: storage_backed)
    prefetch: when a request arrives, the pages of its prompt beyond what L1+L2 hold are looked up in L3
              and read into reserved host pages; on the ack they are attached to the tree as host-only
              nodes, so the request's match (and load-back) finds them like any L2 hit

A page's key chains the hash of its tokens with the previous page's key, in a namespace naming the model,
dtype and page size (and the request's cache namespace), so every process serving the same model finds
the same pages. A node being written to L3 keeps its host pages (it is not host-evictable until the ack).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from kvstrata.cache.hiradix_cache import HiRadixCache, HiTreeNode
from kvstrata.cache.page_hash import page_keys, request_namespace
from kvstrata.cache.storage_tier import PREFETCH, StorageOp, StorageTier

logger = logging.getLogger(__name__)

PREFETCH_MIN_PAGES = 1              # fewer missing pages than this are not worth an L3 round trip
PREFETCH_MAX_INFLIGHT_FRACTION = 0.75   # prefetches in flight may hold at most this share of the host pool


class StorageTreeNode(HiTreeNode):
    """A tiered node that also knows its L3 keys and whether its pages are in L3."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.page_keys: list[str] | None = None   # computed on first use (needs the whole prefix)
        self.storage_backed = False
        self.storage_op: int | None = None
        self.from_storage = False                 # attached by a prefetch, not yet used by a request


class StorageRadixCache(HiRadixCache):
    """HiRadixCache plus L3 backup and prefetch."""

    node_cls = StorageTreeNode

    def __init__(self, *args, storage: StorageTier, storage_namespace: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.storage = storage
        self.storage_namespace = storage_namespace
        self._prefetch_inflight_pages = 0
        self.last_skip_reason: str | None = None   # why the latest prefetch() returned None
        self._storage_inflight: dict[int, list[StorageTreeNode]] = {}   # backup op id -> nodes it covers
        self.prefetch_skipped: Counter = Counter()
        self.storage_stats = {"prefetch_requests": 0, "prefetched_tokens": 0, "prefetch_attached_tokens": 0,
                              "storage_hit_tokens": 0, "storage_backup_pages": 0}

    # ---- keys -------------------------------------------------------------------------------------------

    def _namespace_key(self, namespace: str | None) -> str:
        return request_namespace(self.storage_namespace, namespace)

    def _keys_of(self, node: StorageTreeNode) -> list[str]:
        if node.page_keys is None:
            parent = node.parent
            prior = None if parent.is_root else self._keys_of(parent)[-1]
            root = node
            while not root.is_root:
                root = root.parent
            node.page_keys = page_keys(node.key, self.page_size, self._namespace_key(root.namespace), prior)
        return node.page_keys

    # ---- backup to L3 -------------------------------------------------------------------------------------

    def _on_host_ready(self, node: StorageTreeNode) -> None:
        if node.storage_backed or node.storage_op is not None:
            return
        op = self.storage.submit_backup(self._keys_of(node), node.host_pages.tolist(), node)
        node.storage_op = op.op_id
        self._storage_inflight[op.op_id] = [node]
        self.storage_stats["storage_backup_pages"] += len(op.keys)

    # ---- prefetch from L3 ---------------------------------------------------------------------------------

    def prefetch(self, token_ids: list[int], namespace: str | None = None) -> StorageOp | None:
        """Start reading from L3 the pages of `token_ids` that neither device nor host holds (None: skipped)."""
        self.storage_stats["prefetch_requests"] += 1
        match = self.match_prefix(token_ids, namespace, record=False)
        have = match.length + match.host_tokens
        aligned = len(token_ids) - len(token_ids) % self.page_size
        missing = (aligned - have) // self.page_size
        if missing < max(1, PREFETCH_MIN_PAGES):
            return self._skip("nothing_to_fetch" if missing <= 0 else "too_short")
        limit = int(self.host_allocator.capacity_pages * PREFETCH_MAX_INFLIGHT_FRACTION)
        if self._prefetch_inflight_pages + missing > limit:
            return self._skip("rate_limited")
        # The cached path the pages will hang under stays locked until the ack: making room in the host
        # pool must not evict it, nor may anything else before the pages are attached.
        anchor = match.host_nodes[-1] if match.host_nodes else match.last_node
        self.inc_lock_ref(anchor)
        pages = self._alloc_host(missing)
        if pages is None:
            self.dec_lock_ref(anchor)
            return self._skip("host_full")
        keys = page_keys(token_ids[:aligned], self.page_size, self._namespace_key(namespace))[have // self.page_size:]
        self._prefetch_inflight_pages += missing
        self.last_skip_reason = None
        return self.storage.submit_prefetch(keys, pages, (tuple(token_ids[:aligned]), namespace, have, anchor))

    def _skip(self, reason: str) -> None:
        self.prefetch_skipped[reason] += 1
        self.last_skip_reason = reason
        return None

    def apply_acks(self) -> None:
        """Host-copy acks (HiRadixCache) plus storage acks: attach prefetched pages, mark backed-up nodes."""
        super().apply_acks()
        for op in self.storage.poll_acks():
            op.applied = True
            if op.kind == PREFETCH:
                self._prefetch_inflight_pages -= len(op.host_pages)
                self.storage_stats["prefetched_tokens"] += op.done * self.page_size
                self._attach(op)
            else:
                for node in self._storage_inflight.pop(op.op_id, []):
                    node.storage_op = None
                    node.storage_backed = op.done == len(op.keys)

    def _attach(self, op: StorageOp) -> None:
        """Hang the prefetched pages under their prefix as host-only nodes; free the ones not needed."""
        tokens, namespace, start, anchor = op.tag
        self.dec_lock_ref(anchor)
        fetched = op.host_pages[: op.done]
        found = self._host_chain_start(tokens[: start + op.done * self.page_size], start, namespace)
        if found is None:
            self.host_allocator.free(op.host_pages)
            return
        parent, pos = found
        attached = fetched[(pos - start) // self.page_size:]
        leaf = self.attach_host_pages(parent, tokens[pos: pos + len(attached) * self.page_size], attached)
        leaf.storage_backed = leaf.from_storage = True
        self.storage_stats["prefetch_attached_tokens"] += len(leaf.key)
        self.host_allocator.free(fetched[: len(fetched) - len(attached)] + op.host_pages[op.done:])

    def _host_chain_start(self, key: tuple, start: int, namespace: str | None):
        """(node, pos): where key's cached path ends, if at or past `start` and before the end; else None."""
        node = self._root(namespace) if start == 0 else self._roots.get(namespace)
        pos = 0
        while node is not None and pos < len(key):
            child = self._descend(node, key, pos)
            if child is None:
                break
            pos += len(child.key)
            node = child
        if node is None or pos < start or pos >= len(key):
            return None     # the prefix was evicted meanwhile, or everything is cached already
        return node, pos

    def count_storage_hits(self, nodes: list[StorageTreeNode]) -> int:
        """Tokens of `nodes` (a loaded-back chain) that came from L3; each prefetch counts once."""
        hits = 0
        for node in nodes:
            if node.from_storage:
                hits += len(node.key)
                node.from_storage = False
        self.storage_stats["storage_hit_tokens"] += hits
        return hits

    # ---- eviction guards and bookkeeping --------------------------------------------------------------------

    def _is_host_evictable(self, node) -> bool:
        return super()._is_host_evictable(node) and node.storage_op is None

    def _drop_subtree_host(self, node) -> None:
        if any(n.storage_op is not None for n in self._subtree(node)):
            self.wait_storage_idle()
        super()._drop_subtree_host(node)

    def _subtree(self, node):
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def wait_storage_idle(self) -> None:
        """Wait for in-flight L3 I/O and apply its acks."""
        self.storage.wait_idle()
        self.apply_acks()

    def _on_split(self, head, tail, n: int) -> None:
        super()._on_split(head, tail, n)
        k = n // self.page_size
        if tail.page_keys is not None:
            head.page_keys, tail.page_keys = tail.page_keys[:k], tail.page_keys[k:]
        head.storage_backed, head.from_storage = tail.storage_backed, tail.from_storage
        head.storage_op = tail.storage_op
        if tail.storage_op is not None:
            self._storage_inflight[tail.storage_op].append(head)

    def reset(self) -> None:
        """Drop both local tiers (L3 keeps its pages: it is shared and outlives us)."""
        self.wait_storage_idle()
        super().reset()

    def metrics(self) -> dict:
        """HiRadixCache metrics plus L3 counters and skipped prefetches by reason."""
        m = super().metrics()
        m.update(self.storage_stats)
        m["prefetch_skipped"] = dict(self.prefetch_skipped)
        m["storage"] = self.storage.stats()
        return m

    def close(self) -> None:
        """Finish queued L3 writes and stop the worker."""
        self.storage.shutdown()


def prefetch_deadline(policy: str, num_pages: int, now: float | None = None) -> float:
    """When a request stops waiting for its prefetch: never for best_effort, after a size-based timeout."""
    now = time.monotonic() if now is None else now
    if policy == "best_effort":
        return now
    if policy == "wait_complete":
        return float("inf")
    return now + 0.2 + 0.002 * num_pages
