"""HostTier (L2): host-pool copies of tree nodes, their backup, load-back and eviction.

A node's host record (node.host) is set here only. Rules:

    a backup (device -> host) locks the node until its ack: its device pages must not change meanwhile;
    a load-back (host -> device) locks the loaded node until its ack: the forward reads those pages;
    host copies hang below host copies: a node's host copy goes only when no child has one;
    host pages an L3 write reads are pinned (pin/unpin): a node being written is not evicted, and if a
    node whose pages are pinned must go anyway (its device ancestor was lost), its pages are freed at
    the write's ack, not before.

The tier submits copies to the CacheController; `apply_acks` (once per step, from the facade) applies
them. The write policy decides what is backed up when. Every completed host copy is offered to the
storage tier below (L3), which this tier builds at construction and which reaches back only through the
HostPages verbs (tier.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator

import torch

from kvstrata.cache.cache_controller import BACKUP, CacheController, LayerLoadHandle
from kvstrata.cache.radix_tree import HostCopy, Key, RadixTree, TreeMatch, TreeNode, require
from kvstrata.cache.storage_tier import StorageTier
from kvstrata.cache.tier import HostPages
from kvstrata.cache.write_policy import WritePolicy
from kvstrata.memory.host_pool import HostKVPool

StorageBuilder = Callable[[HostPages], StorageTier]   # L3, built over the host tier it reads into

logger = logging.getLogger(__name__)


class HostTier:
    """L2: host pages of tree nodes, copied through the CacheController."""

    name = "host"

    def __init__(self, tree: RadixTree, host_pool: HostKVPool, controller: CacheController, policy: WritePolicy,
                 storage: StorageBuilder | None = None):
        self.tree = tree
        self.host_pool = host_pool
        self.allocator = host_pool.allocator
        self.controller = controller
        self.policy = policy
        self.page_size = tree.page_size
        self._backups: dict[int, TreeNode] = {}   # backup op id -> the node it was submitted for
        self._readers: Counter = Counter()              # host page -> in-flight L3 writes reading it
        self._orphans: set[int] = set()                 # pinned pages whose node is gone: freed on unpin
        self._loading: dict[int, TreeNode] = {}         # load-back op id -> the deepest node it fills
        self.stats = {"backup_pages": 0, "backup_skipped_host_full": 0, "load_back_pages": 0,
                      "host_evicted_pages": 0}
        # L3 (None: none): offered every completed host copy; it reaches back through HostPages only.
        self.storage: StorageTier | None = storage(self) if storage is not None else None

    # ---- what the device tier asks of L2 ------------------------------------------------------------------

    def holds(self, node: TreeNode) -> bool:
        """Whether node has a complete host copy."""
        return node.host_ready

    def pages_of(self, node: TreeNode) -> list[int] | None:
        """The host pages of node's complete copy (None: it has none)."""
        return node.host.pages.tolist() if node.host is not None and node.host.ready else None

    def eviction_candidates(self) -> Iterator[TreeNode]:
        """Unlocked nodes with a settled host copy that no child's host copy hangs below, in policy order."""
        return self.tree.eviction_order(self._is_candidate, "host")

    def _is_candidate(self, node: TreeNode) -> bool:
        return (not node.is_root and node.lock_ref == 0 and node.host_ready and node.host.op_id is None
                and (self.storage is None or not self.storage.writing(node))
                and all(c.host is None for c in node.children.values()))

    def drop(self, node: TreeNode) -> None:
        """Free node's host copy (pages an L3 write still reads are freed when it unpins them)."""
        host = node.host
        if host is None:
            return
        assert host.op_id is None, f"dropping the host copy of {node} while its backup is in flight"
        node.host = None
        self.tree.mark_changed(node)
        self.tree.touch(node)
        pages = host.pages.tolist()
        self._orphans.update(p for p in pages if self._readers[p])
        self.allocator.free([p for p in pages if not self._readers[p]])

    def drop_subtree(self, node: TreeNode) -> None:
        """Remove `node` and its descendants, all host-only (their device ancestor is being removed)."""
        for child in list(node.children.values()):
            self.drop_subtree(child)
        self.drop(node)
        self.tree.remove_leaf(node)

    def accept_demotion(self, node: TreeNode) -> None:
        """The device is about to free node's pages: the write policy may copy them down first."""
        self.policy.on_demote(self, node)

    # ---- lifecycle (the Tier protocol) --------------------------------------------------------------------

    def apply_acks(self) -> None:
        """Apply the controller's completed copies: mark host copies ready, unlock nodes."""
        for op in self.controller.poll_acks():
            if op.kind != BACKUP:
                if op.error is not None:
                    logger.error("load-back failed: %s", op.error)
                self._loading.pop(op.op_id, None)
                self.tree.dec_lock_ref(op.node)
                continue
            for node in self._sharing(self._backups.pop(op.op_id, None), op.op_id):
                node.host.op_id = None
                self.tree.touch(node)
                if op.error is None:
                    node.host.ready = True
                    self.tree.mark_changed(node)
                    self._host_ready(node)
                else:
                    logger.warning("backup to host failed (%s); the pages stay device-only", op.error)
                    self.allocator.free(node.host.pages)
                    node.host = None
            self.tree.dec_lock_ref(op.node)

    @staticmethod
    def _sharing(node: TreeNode | None, op_id: int) -> list[TreeNode]:
        """`node` and the ancestors split off it while its copy was in flight (they share the op)."""
        out = []
        while node is not None and not node.is_root and node.host is not None and node.host.op_id == op_id:
            out.append(node)
            node = node.parent
        return out

    def close(self) -> None:
        """Finish in-flight copies (so the last pages reach L2 and queue their L3 writes), stop the workers."""
        self.wait_idle()
        self.controller.shutdown()

    def wait_idle(self) -> None:
        """Wait for every in-flight copy and apply the acks (shutdown and flush only, never within a step)."""
        self.controller.wait_idle()
        self.apply_acks()

    # ---- write policy hooks -----------------------------------------------------------------------------

    def on_insert(self, leaf: TreeNode) -> None:
        """A new device leaf: the write policy may back it up."""
        self.policy.on_insert(self, leaf)

    def on_hit(self, node: TreeNode) -> None:
        """A request matched up to device node `node`."""
        self.policy.on_hit(self, node)

    # ---- copies -----------------------------------------------------------------------------------------

    def backup(self, node: TreeNode) -> bool:
        """Start copying a device node to host pages (locks it until acked). False if the host is full."""
        if node.host is not None or node.device_slots is None:
            return True
        num_pages = node.device_tokens // self.page_size
        pages = self.alloc(num_pages)
        if pages is None:
            self.stats["backup_skipped_host_full"] += num_pages
            return False
        self.tree.inc_lock_ref(node)
        host_pages = torch.tensor(pages, dtype=torch.long)
        op_id = self.controller.submit_backup(self._device_pages(node), host_pages, node)
        node.host = HostCopy(host_pages, ready=False, op_id=op_id)
        self.tree.touch(node)
        self._backups[op_id] = node
        self.stats["backup_pages"] += num_pages
        return True

    def copy_now(self, node: TreeNode) -> None:
        """Copy a device node to the host synchronously (no ack): write_back, just before it is demoted."""
        if node.host is not None or node.device_slots is None:
            return
        num_pages = node.device_tokens // self.page_size
        pages = self.alloc(num_pages)
        if pages is None:
            self.stats["backup_skipped_host_full"] += num_pages
            return
        host_pages = torch.tensor(pages, dtype=torch.long)
        self.controller.copy_now(self._device_pages(node), host_pages)
        node.host = HostCopy(host_pages, ready=True)
        self.tree.mark_changed(node)
        self.tree.touch(node)
        self.stats["backup_pages"] += num_pages
        self._host_ready(node)

    def load_back(self, match: TreeMatch, pages: list[int]) -> tuple[TreeMatch, LayerLoadHandle]:
        """Copy the host continuation of `match` into the device pages `pages` (the device tier took them).

        Returns the extended match (its last_node, the deepest loaded node, is locked until the ack; the
        caller locks it again for the request) and the handle the forward waits on per layer.
        """
        nodes = match.host_nodes
        num_pages = len(pages)
        device_pages = torch.tensor(pages, dtype=torch.long)
        handle = self.controller.submit_load_back(torch.cat([n.host.pages for n in nodes]), device_pages, nodes[-1])
        slots = (device_pages.unsqueeze(1) * self.page_size + torch.arange(self.page_size)).reshape(-1)
        start = 0
        for n in nodes:
            self.tree.set_device_slots(n, slots[start:start + len(n.key)])
            start += len(n.key)
        self.tree.inc_lock_ref(nodes[-1])             # the pages are being written until the ack
        self._loading[handle.op_id] = nodes[-1]
        self.stats["load_back_pages"] += num_pages
        full = torch.cat([match.slots, slots.to(match.slots.device)])
        return TreeMatch(full, nodes[-1], []), handle

    def _device_pages(self, node: TreeNode) -> torch.Tensor:
        return node.device_slots[::self.page_size] // self.page_size

    def _host_ready(self, node: TreeNode) -> None:
        if self.storage is not None:
            self.storage.on_host_ready(node)

    # ---- allocation and eviction (also the HostPages verbs of the storage tier) ----------------------------

    @property
    def capacity_pages(self) -> int:
        """Allocatable host pages."""
        return self.allocator.capacity_pages

    def free(self, pages: list[int]) -> None:
        """Give back host pages that no node holds."""
        self.allocator.free(pages)

    def alloc(self, num_pages: int) -> list[int] | None:
        """`num_pages` host pages, evicting host copies for them; None if there is not enough room."""
        short = num_pages - self.allocator.free_pages
        if short > 0:
            self.evict(short)
        return self.allocator.alloc(num_pages)

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages from unlocked leaves, in policy order; returns pages freed."""
        freed = 0
        for node in self.eviction_candidates():
            if freed >= num_pages:
                break
            freed += node.host.pages.numel()
            self.drop(node)
            if node.device_slots is None:        # host-only (so childless): the node goes
                self.tree.remove_leaf(node)
        self.stats["host_evicted_pages"] += freed
        return freed

    def pin(self, pages: list[int]) -> None:
        """An L3 write will read `pages`: they stay allocated until it unpins them."""
        self._readers.update(pages)

    def unpin(self, pages: list[int]) -> None:
        """An L3 write that read `pages` finished: free those whose node went meanwhile."""
        self._readers.subtract(pages)
        done = [p for p in set(pages) if self._readers[p] <= 0]
        for p in done:
            del self._readers[p]
        self.allocator.free([p for p in done if p in self._orphans])
        self._orphans.difference_update(done)

    # ---- inserting host-resident pages ------------------------------------------------------------------

    def insert_host_pages(self, token_ids: list[int], host_pages: list[int], namespace: str | None = None,
                          start: int = 0) -> TreeNode | None:
        """Hang host pages holding the KV of `token_ids` under their cached path, as one host-only node.

        host_pages[i] holds the page of tokens [start + i*page_size, ...). The tree must already hold the
        path up to `start`; the pages of tokens it already holds are freed, the rest become the tree's.
        Returns the new node, or None (and every page is freed) when the path is not there.
        (Used by the L3 prefetch when its pages land, and by a host-pool snapshot restore.)
        """
        ps = self.page_size
        end = start + len(host_pages) * ps
        key: Key = tuple(token_ids[:end])
        parent, pos = self.tree.path_end(key, namespace, create=start == 0)
        if parent is None or pos < start or pos >= end:
            self.allocator.free(host_pages)   # the prefix was evicted meanwhile, or all of it is cached
            return None
        used = (pos - start) // ps
        self.allocator.free(host_pages[:used])
        leaf = self.tree.add_leaf(parent, key[pos:], None)
        leaf.host = HostCopy(torch.tensor(host_pages[used:], dtype=torch.long), ready=True)
        self.tree.mark_changed(leaf)
        self.tree.touch(leaf)
        return leaf

    # ---- whole-tier views (the L2 snapshot) -------------------------------------------------------------

    def back_up_device_only(self) -> None:
        """Copy every device node that has no host copy yet to the host (where room allows), and wait
        (at shutdown only: it applies acks)."""
        for node in self.tree.nodes():
            if node.device_slots is not None and node.host is None:
                self.backup(node)
        self.wait_idle()

    def host_chain(self) -> Iterator[tuple[str | None, TreeNode]]:
        """(namespace, node) for every node whose host copy, and every ancestor's, is complete; parents first.

        These are the nodes the host tier alone can serve: what survives when the device tier is gone.
        """
        servable: set[int] = set()
        for node in self.tree.nodes():
            parent = node.parent
            if node.host_ready and (parent.is_root or id(parent) in servable):
                servable.add(id(node))
                yield node.root().namespace, node

    # ---- maintenance and inspection ---------------------------------------------------------------------

    def reset(self) -> None:
        """Free every host copy (flush; no request may be running, no copy in flight)."""
        for node in self.tree.nodes():
            self.drop(node)

    def owned_pages(self) -> list[int]:
        """Host pages held by nodes (in-flight backups included) or by L3 writes only, with repeats."""
        held = [p for n in self.tree.nodes() if n.host is not None for p in n.host.pages.tolist()]
        return held + sorted(self._orphans)

    def check_integrity(self) -> None:
        """Every host page has one owner: a node, an L3 write, an in-flight prefetch, or the free list."""
        owned = self.owned_pages()
        if self.storage is not None:
            owned += self.storage.host_pages_in_flight()
        require(len(owned) == len(set(owned)), "a host page is held twice")
        free = set(owned) & self.allocator.free_page_ids()
        require(not free, f"host pages both owned and free: {sorted(free)[:16]}")
        leaked = set(range(self.allocator.reserved_pages, self.allocator.num_pages)) \
            - set(owned) - self.allocator.free_page_ids()
        require(not leaked, f"{len(leaked)} leaked host pages: {sorted(leaked)[:16]}")
        for op_id, node in self._loading.items():
            require(node.lock_ref > 0 and node.device_slots is not None,
                    f"load-back {op_id}: {node} is not locked on the device while its pages are written")
        for node in self.tree.nodes():
            host = node.host
            require(node.device_slots is not None or (host is not None and (host.ready or host.op_id is not None)),
                    f"{node} is off the device without a host copy")
            if host is not None:
                require(host.pages.numel() * self.page_size == len(node.key), f"{node}: host pages for key")
                require(host.op_id is None or node.lock_ref > 0, f"{node} is being copied but not locked")
                require(host.op_id is None or host.op_id in self._backups, f"{node}: unknown backup op")

    def metrics(self) -> dict:
        """Copy counters and host pool usage."""
        cap = self.allocator.capacity_pages
        m = dict(self.stats)
        m["host_capacity_pages"] = cap
        m["host_used_pages"] = cap - self.allocator.free_pages
        m["host_usage"] = m["host_used_pages"] / cap if cap else 0.0
        m.update(self.controller.stats())
        return m
