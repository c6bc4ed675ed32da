"""HiRadixCache: the radix tree with a host tier (L2) under it.

Each node records where its pages live: `device_slots` (L1) and/or `host_pages` (L2). Residency rules:

    device residency is prefix-closed: a node on the device has all its ancestors on the device;
    a host-only node (device_slots None) has its host copy ready (host_ready) — it is reachable for load-back;
    a node whose backup is in flight is locked (lock_ref > 0) until the controller acknowledges the copy.

Device eviction *demotes* a node that has a host copy (its device pages are freed, the node stays);
without one the node is removed (write_back first copies it synchronously, so nothing is lost).
Host eviction removes host-only leaves, or drops the host copy of device-resident leaves.
The tree does no I/O itself: copies go through the CacheController, whose acks `apply_acks` applies
once per scheduler step.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvstrata.cache.cache_controller import BACKUP, CacheController, LayerLoadHandle
from kvstrata.cache.radix_cache import MatchResult, RadixCache, TreeNode, _require
from kvstrata.memory.allocator import PageAllocator
from kvstrata.memory.host_pool import HostKVPool

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiTreeNode(TreeNode):
    """A tree node with a host copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.host_pages: torch.Tensor | None = None   # one host page id per page of the key
        self.host_ready = False                      # the host copy is complete (its backup was acked)
        self.backup_op: int | None = None            # id of the in-flight backup, if any


@dataclass
class HiMatchResult(MatchResult):
    """A match with its device part (slots, last_node) and the host-only continuation after it."""

    host_nodes: list[HiTreeNode] = field(default_factory=list)

    @property
    def host_tokens(self) -> int:
        """Tokens of the host-only continuation."""
        return sum(len(n.key) for n in self.host_nodes)


class HiRadixCache(RadixCache):
    """Radix tree over the device pool with demotion to, and load-back from, a host pool."""

    node_cls = HiTreeNode

    def __init__(self, allocator: PageAllocator, page_size: int, host_pool: HostKVPool,
                 controller: CacheController, write_policy: str = "write_through",
                 eviction_policy: str = "lru", write_threshold: int = 2):
        super().__init__(allocator, page_size, eviction_policy)
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown hicache write policy {write_policy!r}; choose one of {WRITE_POLICIES}")
        self.host_pool = host_pool
        self.host_allocator = host_pool.allocator
        self.controller = controller
        self.write_policy = write_policy
        self.write_threshold = write_threshold
        self._inflight: dict[int, list[HiTreeNode]] = {}   # backup op id -> nodes sharing its host pages
        self.stats = {"backup_pages": 0, "backup_skipped_host_full": 0, "load_back_pages": 0,
                      "demoted_pages": 0, "host_evicted_pages": 0, "lost_pages": 0}

    # ---- match / insert -------------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], namespace: str | None = None,
                     record: bool = True) -> HiMatchResult:
        """Device-resident prefix (slots, last_node) plus the host-only continuation (host_nodes)."""
        if record:
            self._tokens_requested += len(token_ids)
        key = self._aligned_key(token_ids)
        root = self._roots.get(namespace)
        if root is None:
            return HiMatchResult(self._empty_slots(), self._new_node(None, (), None, namespace=namespace))
        node, device_node, pos, parts, host_nodes = root, root, 0, [], []
        tick = next(self._clock)
        while pos < len(key):
            child = self._descend(node, key, pos)
            if child is None:
                break
            if child.device_slots is not None and not host_nodes:
                parts.append(child.device_slots)
                device_node = child
            elif child.device_slots is None and child.host_ready:
                host_nodes.append(child)
            else:
                break
            if record:
                child.last_access = tick
                child.hit_count += 1
            pos += len(child.key)
            node = child
        if not record:
            return HiMatchResult(torch.cat(parts) if parts else self._empty_slots(), device_node, host_nodes)
        self._tokens_hit += pos
        if self.write_policy == "write_through_selective":
            self._backup_hot_path(device_node)
        slots = torch.cat(parts) if parts else self._empty_slots()
        return HiMatchResult(slots, device_node, host_nodes)

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: str | None = None,
               priority: int = 0) -> int:
        """As RadixCache.insert; a host-only node on the path adopts the caller's device slots.

        The returned count stops at the first host-only node: the caller keeps (hands over) its pages from
        there on, and frees only its duplicates of the device-resident part before it.
        """
        key = self._aligned_key(token_ids)
        slots = slots[:len(key)].to(dtype=torch.long)
        if not key:
            return 0
        node, pos, tick = self._root(namespace), 0, next(self._clock)
        already = None
        while pos < len(key):
            child = self._descend(node, key, pos)
            if child is None:
                self._add_leaf(node, key[pos:], slots[pos:], priority)
                break
            if child.device_slots is None:
                already = pos if already is None else already
                self._set_device_slots(child, slots[pos:pos + len(child.key)])
            child.last_access = tick
            child.priority = max(child.priority, priority)
            pos += len(child.key)
            node = child
        return pos if already is None else already

    # ---- load-back --------------------------------------------------------------------------------------

    def load_back(self, match: HiMatchResult) -> tuple[HiMatchResult, LayerLoadHandle] | None:
        """Copy the host continuation of `match` into new device pages (whole chain or nothing).

        Returns the extended match (its last_node is the deepest loaded node: lock it before the next
        eviction) and the handle the forward waits on per layer; None if the device has no room.
        """
        nodes = match.host_nodes
        num_pages = match.host_tokens // self.page_size
        self.inc_lock_ref(match.last_node)       # keep the device prefix while we make room
        try:
            self._make_device_room(num_pages)
            pages = self.allocator.alloc(num_pages)
        finally:
            self.dec_lock_ref(match.last_node)
        if pages is None:
            return None
        device_pages = torch.tensor(pages, dtype=torch.long)
        host_pages = torch.cat([n.host_pages for n in nodes])
        handle = self.controller.submit_load_back(host_pages, device_pages, nodes[-1])
        slots = _page_slots(device_pages, self.page_size)
        start = 0
        for n in nodes:
            self._set_device_slots(n, slots[start:start + len(n.key)])
            start += len(n.key)
        self.inc_lock_ref(nodes[-1])             # the pages are being written until the ack
        self.stats["load_back_pages"] += num_pages
        full = torch.cat([match.slots, slots.to(match.slots.device)])
        return HiMatchResult(full, nodes[-1], []), handle

    def _make_device_room(self, num_pages: int) -> None:
        """Evict until `num_pages` device pages are free; nodes locked only by an in-flight backup become
        evictable once it lands, so wait for those copies (host memcpy, short) before giving up."""
        for attempt in range(2):
            short = num_pages - self.allocator.free_pages
            if short <= 0:
                return
            self.evict(short * self.page_size)
            if attempt == 0 and self.allocator.free_pages < num_pages and self._inflight:
                self.wait_idle()

    # ---- backup -----------------------------------------------------------------------------------------

    def _add_leaf(self, parent: TreeNode, key, slots: torch.Tensor, priority: int) -> TreeNode:
        leaf = super()._add_leaf(parent, key, slots, priority)
        if self.write_policy == "write_through":
            self._backup(leaf)
        return leaf

    def _backup_hot_path(self, node: HiTreeNode) -> None:
        while not node.is_root:
            if node.hit_count >= self.write_threshold:
                self._backup(node)
            node = node.parent

    def _backup(self, node: HiTreeNode) -> bool:
        """Start copying a device node to host pages (locks it until acked). False if the host is full."""
        if node.host_pages is not None or node.device_slots is None:
            return True
        num_pages = node.device_tokens // self.page_size
        pages = self._alloc_host(num_pages)
        if pages is None:
            self.stats["backup_skipped_host_full"] += num_pages
            return False
        self.inc_lock_ref(node)
        node.host_pages = torch.tensor(pages, dtype=torch.long)
        device_pages = node.device_slots[::self.page_size] // self.page_size
        op_id = self.controller.submit_backup(device_pages, node.host_pages, node)
        node.backup_op = op_id
        self._inflight[op_id] = [node]
        self.stats["backup_pages"] += num_pages
        return True

    def apply_acks(self) -> None:
        """Apply the controller's completed copies (once per step, before the tree is used)."""
        for op in self.controller.poll_acks():
            if op.kind != BACKUP:
                if op.error is not None:
                    logger.error("load-back failed: %s", op.error)
                self.dec_lock_ref(op.node)
                continue
            nodes = self._inflight.pop(op.op_id, [])
            for node in nodes:
                node.backup_op = None
                if op.error is None:
                    node.host_ready = True
                    self._on_host_ready(node)
                else:
                    logger.warning("backup to host failed (%s); the pages stay device-only", op.error)
                    self.host_allocator.free(node.host_pages)
                    node.host_pages = None
            if nodes:
                self.dec_lock_ref(op.node)

    def _on_host_ready(self, node: HiTreeNode) -> None:
        """Hook: node's host copy just completed (the storage tier backs it up from here)."""

    def wait_idle(self) -> None:
        """Wait for every in-flight copy and apply the acks."""
        self.controller.wait_idle()
        self.apply_acks()

    # ---- whole-tier views (the L2 snapshot) -------------------------------------------------------------

    def back_up_device_only(self) -> None:
        """Copy every device node that has no host copy yet to the host (where room allows), and wait."""
        for node in list(self.nodes()):
            if node.device_slots is not None and node.host_pages is None:
                self._backup(node)
        self.wait_idle()

    def host_chain(self) -> Iterator[tuple[str | None, HiTreeNode]]:
        """(namespace, node) for every node whose host copy, and every ancestor's, is complete; parents first.

        These are the nodes the host tier alone can serve: what survives when the device tier is gone.
        """
        namespace_of = {root: ns for ns, root in self._roots.items()}
        for node in self.nodes():
            parent = node.parent
            if node.host_ready and parent in namespace_of:
                namespace_of[node] = namespace_of[parent]
                yield namespace_of[node], node

    def has_child(self, parent: TreeNode | None, key: tuple, namespace: str | None = None) -> bool:
        """Whether `parent` (the namespace's root when None) already has a child that `key` would enter."""
        node = self._roots.get(namespace) if parent is None else parent
        return node is not None and key[:self.page_size] in node.children

    def attach_host_pages(self, parent: TreeNode | None, key: tuple, host_pages: list[int],
                          namespace: str | None = None) -> HiTreeNode:
        """Hang complete host pages under `parent` (the namespace's root when None) as a host-only node."""
        if parent is None:
            parent = self._root(namespace)
        _require(len(key) == len(host_pages) * self.page_size and len(key) > 0,
                 f"attach_host_pages: {len(key)} tokens for {len(host_pages)} pages of {self.page_size}")
        _require(key[:self.page_size] not in parent.children, "attach_host_pages: the parent has that child")
        node = self._new_node(parent, tuple(key), None)
        node.host_pages = torch.tensor(host_pages, dtype=torch.long)
        node.host_ready = True
        parent.children[node.key[:self.page_size]] = node
        return node

    # ---- eviction ---------------------------------------------------------------------------------------

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        """Device eviction candidates: unlocked device nodes with no device-resident child."""
        return (not node.is_root and node.lock_ref == 0 and node.device_slots is not None
                and all(c.device_slots is None for c in node.children.values()))

    def _evict_leaf(self, node: HiTreeNode) -> int:
        tokens = node.device_tokens
        if not node.host_ready and self.write_policy == "write_back" and self._backup(node):
            self.wait_idle()                      # synchronous: the page must reach the host before it goes
        if node.host_ready:
            self._free_device_pages(node)        # demote: the node stays, on the host only
            self.stats["demoted_pages"] += tokens // self.page_size
            return tokens
        self.stats["lost_pages"] += tokens // self.page_size
        self._drop_subtree_host(node)
        return super()._evict_leaf(node)

    def _drop_subtree_host(self, node: HiTreeNode) -> None:
        """Remove node's (host-only) descendants: without node they cannot be loaded back."""
        for child in list(node.children.values()):
            self._drop_subtree_host(child)
            self._free_host(child)
            del node.children[child.key[:self.page_size]]
        self._free_host(node)

    def _alloc_host(self, num_pages: int) -> list[int] | None:
        short = num_pages - self.host_allocator.free_pages
        if short > 0:
            self.evict_host(short)
        return self.host_allocator.alloc(num_pages)

    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages from unlocked leaves, in policy order; returns pages freed."""
        heap = [self._heap_entry(n) for n in self.nodes() if self._is_host_evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            freed += node.host_pages.numel()
            self._free_host(node)
            parent = node.parent
            if node.device_slots is None:        # host-only (so childless): the node goes
                del parent.children[node.key[:self.page_size]]
            if self._is_host_evictable(parent):
                heapq.heappush(heap, self._heap_entry(parent))
        self.stats["host_evicted_pages"] += freed
        return freed

    def _is_host_evictable(self, node: TreeNode) -> bool:
        """Unlocked, host copy complete, and no child needs it (host copies hang below host copies)."""
        return (not node.is_root and node.lock_ref == 0 and node.host_ready and node.backup_op is None
                and all(c.host_pages is None for c in node.children.values()))

    def _free_host(self, node: HiTreeNode) -> None:
        if node.host_pages is not None and node.backup_op is None:
            self.host_allocator.free(node.host_pages)
            node.host_pages = None
            node.host_ready = False

    # ---- bookkeeping hooks --------------------------------------------------------------------------------

    def _set_device_slots(self, node: HiTreeNode, slots: torch.Tensor) -> None:
        node.device_slots = slots.to(self.device)
        if node.lock_ref > 0:
            self._protected_tokens += node.device_tokens
        else:
            self._evictable_tokens += node.device_tokens

    def _on_split(self, head: HiTreeNode, tail: HiTreeNode, n: int) -> None:
        if tail.host_pages is None:
            return
        k = n // self.page_size
        head.host_pages, tail.host_pages = tail.host_pages[:k], tail.host_pages[k:]
        head.host_ready, head.backup_op = tail.host_ready, tail.backup_op
        if tail.backup_op is not None:
            self._inflight[tail.backup_op].append(head)

    def reset(self) -> None:
        """Drop everything in both tiers (no request may be running)."""
        self.wait_idle()
        for node in list(self.nodes()):
            self._free_host(node)
        super().reset()

    def host_owned_pages(self) -> list[int]:
        """Every host page held by a node (in-flight backups included), with repeats if double-owned."""
        return [p for n in self.nodes() if n.host_pages is not None for p in n.host_pages.tolist()]

    def check_integrity(self) -> None:
        """Base checks plus: host pages owned once and not free, device residency prefix-closed."""
        super().check_integrity()
        owned = self.host_owned_pages()
        if len(owned) != len(set(owned)):
            raise AssertionError("a host page is held by two nodes")
        free = set(owned) & self.host_allocator.free_page_ids()
        if free:
            raise AssertionError(f"host pages both owned and free: {sorted(free)[:16]}")
        leaked = set(range(self.host_allocator.reserved_pages, self.host_allocator.num_pages)) \
            - set(owned) - self.host_allocator.free_page_ids()
        if leaked:
            raise AssertionError(f"{len(leaked)} leaked host pages: {sorted(leaked)[:16]}")
        for node in self.nodes():
            if node.device_slots is not None and not node.parent.is_root and node.parent.device_slots is None:
                raise AssertionError(f"{node} is on the device but its parent is not")
            if node.device_slots is None and not (node.host_ready or node.backup_op is not None):
                raise AssertionError(f"{node} holds its pages in no tier")
            if node.backup_op is not None and node.lock_ref == 0:
                raise AssertionError(f"{node} is being copied but not locked")

    def metrics(self) -> dict:
        """Base metrics plus host-tier counters and usage."""
        m = super().metrics()
        cap = self.host_allocator.capacity_pages
        m.update(self.stats)
        m["host_capacity_pages"] = cap
        m["host_used_pages"] = cap - self.host_allocator.free_pages
        m["host_usage"] = m["host_used_pages"] / cap if cap else 0.0
        return m


def _page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """All slots of `pages`, in order."""
    return (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)
