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
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvstrata.cache.page_hash import page_keys, request_namespace
from kvstrata.cache.radix_tree import RadixTree, StorageCopy, TreeMatch, TreeNode, require
from kvstrata.cache.storage_io import PREFETCH, StorageIO, StorageOp
from kvstrata.cache.tier import HostPages

logger = logging.getLogger(__name__)

PREFETCH_MIN_GROUPS = 1             # fewer missing groups than this are not worth an L3 round trip
PREFETCH_MAX_INFLIGHT_FRACTION = 0.75   # prefetches in flight may hold at most this share of the host pool
# How long a step may wait for prefetches submitted just before it. Most prefetches of new prompts find
# nothing (the new turn was never stored) and answer in well under a millisecond; without this, requests
# that arrive together are ready one by one and the first starts a step the others then wait out.
PREFETCH_GRACE_S = 0.004


class PrefetchStart(NamedTuple):
    """What StorageTier.prefetch did: the read it started, or why it started none."""

    op: StorageOp | None
    skipped: str | None = None     # "nothing_to_fetch", "too_short", "rate_limited", "not_stored", "host_full"


class StorageTier:
    """L3: backup of host copies and prefetch into the host tier, reached through its HostPages verbs."""

    name = "storage"

    def __init__(self, tree: RadixTree, io: StorageIO, storage_namespace: str, host: HostPages):
        self.tree = tree
        self.io = io
        self.host = host       # L2: the tier whose pages L3 writes from and reads into
        self.group_tokens = io.group_pages * tree.page_size   # tokens per L3 object
        self.storage_namespace = storage_namespace
        self._writes: dict[int, tuple[TreeNode, list[int]]] = {}   # write op id -> (its node, pinned pages)
        self._prefetches: dict[int, StorageOp] = {}      # in-flight prefetches (they hold host pages)
        self._prefetch_inflight_pages = 0
        self.prefetch_skipped: Counter = Counter()
        self.stats = {"prefetch_requests": 0, "prefetched_tokens": 0, "prefetch_attached_tokens": 0,
                      "storage_hit_tokens": 0, "storage_backup_pages": 0}

    def reset(self) -> None:
        """L3 is shared with other processes and keeps its pages across a flush."""

    def writing(self, node: TreeNode) -> bool:
        """Whether an L3 write of `node`'s groups is in flight (it reads the node's host pages)."""
        return node.storage is not None and node.storage.op_id is not None

    # ---- keys -------------------------------------------------------------------------------------------

    def _namespace_key(self, namespace: str | None) -> str:
        return request_namespace(self.storage_namespace, namespace)

    def _record(self, node: TreeNode) -> StorageCopy:
        """node's storage record (the groups that end inside it), computed on first use."""
        if node.storage is None:
            node.storage = self._groups_ending_in(node)
        return node.storage

    def _groups_ending_in(self, node: TreeNode) -> StorageCopy:
        """Keys and end offsets of the page groups whose last token lies in `node`.

        A key chains every group before it, but the chain is not rehashed from the root: the key before
        node's first group is the last key of the ancestor that group ends in, when that ancestor's record is
        known (it usually is: ancestors are written first); otherwise the path is hashed from the root.
        """
        start, namespace = _depth(node.parent)              # tokens before node
        first = start // self.group_tokens                  # group i covers tokens [i*gt, (i+1)*gt)
        tail, holder, holder_end = _tokens_before(node.parent, start - first * self.group_tokens, start)
        prior = self._key_before(first, holder, holder_end, namespace, lambda: _path_tokens(holder)[0])
        return self._groups_after(tail, prior, node.key, namespace)[0]

    def _key_before(self, first: int, holder: TreeNode, holder_end: int, namespace: str | None,
                    path_tokens: Callable[[], Sequence[int]]) -> str | None:
        """The key of group first-1 (None before the first group): the last key of `holder`, the node that
        holds that group's last token and ends `holder_end` tokens from the root, when its record is known;
        otherwise hashed from the root over `path_tokens()` (at least first * group_tokens of them)."""
        if not first:
            return None
        gt, record = self.group_tokens, holder.storage
        if record is not None and record.keys and record.ends[-1] == first * gt - (holder_end - len(holder.key)):
            return record.keys[-1]
        return page_keys(path_tokens()[:first * gt], gt, self._namespace_key(namespace))[-1]

    def _groups_after(self, tail: tuple | list, prior: str | None, key: tuple,
                      namespace: str | None) -> tuple[StorageCopy, tuple, str | None]:
        """The groups ending in `key`, which follows `tail` (the tokens since the last group boundary, whose
        group key before them is `prior`); also the new tail and prior for the node's children."""
        gt, seq = self.group_tokens, tuple(tail) + tuple(key)
        count = len(seq) // gt
        keys = page_keys(seq[:count * gt], gt, self._namespace_key(namespace), prior)
        ends = [(i + 1) * gt - len(tail) for i in range(count)]
        return StorageCopy(keys, ends), seq[count * gt:], keys[-1] if keys else prior

    # ---- backup to L3 -------------------------------------------------------------------------------------

    def on_host_ready(self, node: TreeNode) -> None:
        """node's host copy is complete: write the groups ending in it to L3 (once), and the groups below it
        that begin in it and were waiting for its pages."""
        self._write_groups(node)
        for child in node.children.values():
            self._retry_below(child, self.group_tokens)

    def _retry_below(self, node: TreeNode, reach: int) -> None:
        """Write the waiting groups of host-ready `node` and of its descendants within `reach` tokens."""
        if not self.host.holds(node):
            return
        record = node.storage
        if record is not None and not record.backed and record.op_id is None:
            self._write_groups(node)
        if len(node.key) < reach:
            for child in node.children.values():
                self._retry_below(child, reach - len(node.key))

    def _write_groups(self, node: TreeNode) -> None:
        """Submit the L3 write of the groups ending in `node`, once all their pages are on the host; an
        ancestor whose part is only on the device is backed up to the host first (its ack retries this)."""
        record = self._record(node)
        if record.backed or record.op_id is not None or not record.keys:
            return
        pages = self._group_host_pages(node, record)
        if pages is None:
            up, reach = node.parent, self.group_tokens
            while not up.is_root and reach > 0:
                self.host.backup(up)         # a no-op if it is on the host (or on its way) already
                reach -= len(up.key)
                up = up.parent
            return
        self.host.pin(pages)
        op = self.io.submit_backup(record.keys, pages, node)
        record.op_id = op.op_id
        self.tree.touch(node)              # an L3 write in flight keeps its host pages: no host eviction
        self._writes[op.op_id] = (node, pages)
        self.stats["storage_backup_pages"] += len(pages)

    def _group_host_pages(self, node: TreeNode, record: StorageCopy) -> list[int] | None:
        """The host pages of every group in `record`, in order; None if one of them is not on the host."""
        if not record.ends:
            return []
        ps, chunks, up = self.tree.page_size, [], node
        reach = len(node.key) + max(0, self.group_tokens - record.ends[0])   # node + its first group's head
        while not up.is_root and reach > 0:
            pages = self.host.pages_of(up)
            chunks.append(pages if pages is not None else [None] * (len(up.key) // ps))
            reach -= len(up.key)
            up = up.parent
        path = [p for chunk in reversed(chunks) for p in chunk]
        start = len(path) - len(node.key) // ps
        out = []
        for end in record.ends:
            group = path[start + end // ps - self.io.group_pages: start + end // ps]
            if None in group:
                return None
            out.extend(group)
        return out

    # ---- prefetch from L3 ---------------------------------------------------------------------------------

    def prefetch(self, token_ids: list[int], namespace: str | None, match: TreeMatch) -> PrefetchStart:
        """Start reading from L3 the groups of `token_ids` that neither device nor host holds; `match` is
        the tree's match of `token_ids` now.

        Reading starts at the group the cached prefix ends in; its cached head is dropped on arrival.
        """
        self.stats["prefetch_requests"] += 1
        gt, host = self.group_tokens, self.host
        first, count = match.cached_tokens // gt, len(token_ids) // gt
        if count * gt <= match.cached_tokens:
            return self._skip("nothing_to_fetch")
        if count - first < PREFETCH_MIN_GROUPS:
            return self._skip("too_short")
        missing = (count - first) * self.io.group_pages
        limit = int(host.capacity_pages * PREFETCH_MAX_INFLIGHT_FRACTION)
        if self._prefetch_inflight_pages + missing > limit:
            return self._skip("rate_limited")
        anchor = match.host_nodes[-1] if match.host_nodes else match.last_node
        tokens = tuple(token_ids[:count * gt])
        _, holder, holder_end = _tokens_before(anchor, match.cached_tokens - first * gt, match.cached_tokens)
        prior = self._key_before(first, holder, holder_end, namespace, lambda: tokens)
        keys = page_keys(tokens[first * gt:], gt, self._namespace_key(namespace), prior)
        if self.io.backend.local_lookup and not self.io.stored_leading(keys[:1]):
            return self._skip("not_stored")     # a new turn's question: nothing in L3 to wait for
        # The cached path the pages will hang under stays locked until the ack: making room in the host
        # pool must not evict it, nor may anything else before the pages are attached.
        self.tree.inc_lock_ref(anchor)
        pages = host.alloc(missing)
        if pages is None:
            self.tree.dec_lock_ref(anchor)
            return self._skip("host_full")
        self._prefetch_inflight_pages += missing
        op = self.io.submit_prefetch(keys, pages, (tokens, namespace, first * gt, anchor))
        self._prefetches[op.op_id] = op
        return PrefetchStart(op)

    def prefetch_reach(self, op: StorageOp) -> int:
        """Prompt tokens from the start that the local tiers hold once `op`'s read groups are attached."""
        return op.tag[2] + op.done * self.group_tokens      # it read groups from token tag[2] on

    def _skip(self, reason: str) -> PrefetchStart:
        self.prefetch_skipped[reason] += 1
        return PrefetchStart(None, reason)

    def await_fresh_prefetches(self) -> None:
        """Wait (at most PREFETCH_GRACE_S after each was submitted) for prefetches submitted moments ago."""
        while self._prefetches:
            now = time.monotonic()
            newest = max(op.submitted for op in self._prefetches.values())
            if now - newest >= PREFETCH_GRACE_S:
                return
            if not self.io.wait_for_ack(newest + PREFETCH_GRACE_S - now):
                return
            self.apply_acks()

    def apply_acks(self) -> None:
        """Attach prefetched pages, mark written nodes (the facade calls it once per step)."""
        for op in self.io.poll_acks():
            op.applied = True
            if op.kind == PREFETCH:
                self._prefetches.pop(op.op_id, None)
                self._prefetch_inflight_pages -= len(op.host_pages)
                self.stats["prefetched_tokens"] += op.done * self.group_tokens
                self._attach(op)
                continue
            node, pages = self._writes.pop(op.op_id)
            self.host.unpin(pages)
            # The node and the ancestors split off it while the write was in flight share the op.
            while node is not None and not node.is_root and node.storage is not None \
                    and node.storage.op_id == op.op_id:
                node.storage.op_id = None
                node.storage.backed = op.done == len(op.keys)
                self.tree.storage_changed(node)
                self.tree.touch(node)
                node = node.parent

    def _attach(self, op: StorageOp) -> None:
        """Hand the fetched pages to the host tier under their prefix; free the ones not read."""
        tokens, namespace, start, anchor = op.tag
        self.tree.dec_lock_ref(anchor)
        host = self.host
        fetched = op.done * self.io.group_pages
        host.free(op.host_pages[fetched:])
        leaf = host.insert_host_pages(tokens, op.host_pages[:fetched], namespace, start) if fetched else None
        if leaf is None:
            return
        record = self._record(leaf)
        record.backed = record.from_prefetch = True
        self.tree.storage_changed(leaf)
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
        """The L3 objects the tree refers to are named by the keys of their tokens; writes and prefetches in
        flight are known, and every prefetch keeps the path it will hang under locked."""
        # One walk from the roots, carrying each path's group boundary: O(tokens), not O(tokens x depth).
        stack = [(child, (), None, root.namespace) for root in self.tree.roots() for child in root.children.values()]
        while stack:
            node, tail, prior, namespace = stack.pop()
            expected, tail, prior = self._groups_after(tail, prior, node.key, namespace)
            stack.extend((child, tail, prior, namespace) for child in node.children.values())
            s = node.storage
            if s is None:
                continue
            require(s.keys == expected.keys and s.ends == expected.ends,
                    f"{node}: storage keys are not the keys of its tokens' groups")
            require(s.op_id is None or s.op_id in self._writes, f"{node}: unknown L3 write")
        for op in self._prefetches.values():
            anchor = op.tag[3]
            require(anchor.is_root or anchor.lock_ref > 0, f"prefetch {op.op_id}: its anchor {anchor} is unlocked")
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


def _depth(node: TreeNode) -> tuple[int, str | None]:
    """Tokens from the root to the end of `node`, and the namespace of its root."""
    tokens, up = 0, node
    while not up.is_root:
        tokens += len(up.key)
        up = up.parent
    return tokens, up.namespace


def _tokens_before(last: TreeNode, count: int, end: int) -> tuple[list[int], TreeNode, int]:
    """The last `count` tokens of the path that ends with node `last` (`end` tokens from the root), and the
    node holding the token before them, with the offset just past that node's end."""
    chunks, up = [], last
    while count > 0:
        take = min(count, len(up.key))
        chunks.append(up.key[len(up.key) - take:])
        count -= take
        if take < len(up.key):
            break                                           # the token before them is in `up` too
        end -= len(up.key)
        up = up.parent
    return [t for chunk in reversed(chunks) for t in chunk], up, end


def _path_tokens(node: TreeNode) -> tuple[list[int], str | None]:
    """The tokens from the root to the end of `node`, and the namespace of its root."""
    path, up = [], node
    while not up.is_root:
        path.append(up.key)
        up = up.parent
    return [t for key in reversed(path) for t in key], up.namespace


def prefetch_deadline(policy: str, num_pages: int, now: float | None = None) -> float:
    """When a request stops waiting for its prefetch: never for best_effort, after a size-based timeout."""
    now = time.monotonic() if now is None else now
    if policy == "best_effort":
        return now
    if policy == "wait_complete":
        return float("inf")
    return now + 0.2 + 0.002 * num_pages
