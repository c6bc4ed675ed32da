"""RadixTree: the one prefix tree of the cache stack; its nodes record where their pages live, per tier.

Each node is one edge: `key` (token ids, a whole number of pages). A child is found by the tokens of its
first page. Residency records on every node (the tiers read and write them; the tree does no I/O):

    device_slots   L1: the KV slots of the key's tokens (None: not on the device)
    host           L2: HostCopy (host page ids, ready once the copy is acknowledged), or None
    storage        L3: StorageCopy (page keys, backed once the write is acknowledged), or None

Residency rules (checked by check_integrity and the tiers' checks):
    device residency is prefix-closed: a node on the device has all its ancestors on the device;
    a node off the device holds its pages in a lower tier (a ready host copy);
    a node whose copy is in flight is locked (lock_ref > 0) until the copy is acknowledged.

Ownership handshake of `insert` (the caller owns `slots`):
    insert(ids, slots) -> n, tokens already cached on the device: the caller frees its pages among slots[:n];
    the pages of slots[n:aligned] become the tree's (an off-device node on the path adopts them).
Lock refs: locking a node increments it and all its ancestors, so node.lock_ref >= sum of its children's.
A locked node is protected; the others count as evictable. Sizes count device tokens.
Version stamp: `version` changes whenever a match could answer differently (a node added, split or removed,
device slots set or cleared, a host copy made ready or dropped: the host tier calls `mark_changed`), so a
match may be memoised until it moves (KVHandle.match). Locks and access times do not move it.
Eviction order: each tier's candidates are kept in a heap across calls (`_EvictionIndex`); whatever may change
a node's candidacy or its policy key (locks, residency, copies in flight, children, access) `touch`es it, and
the next `eviction_order` call re-offers the touched nodes, so a call costs O(touched + evicted) x log(nodes),
not a walk of the whole tree. The tiers call `touch` when they change a node's host copy or L3 write.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstrata.cache.eviction import eviction_key

if TYPE_CHECKING:
    from kvstrata.cache.events import BlockEvents

Key = tuple[int, ...]


@dataclass
class HostCopy:
    """A node's pages in the host pool: one host page id per page of the key."""

    pages: torch.Tensor
    ready: bool = False          # the copy is complete (its backup was acknowledged, or it was loaded)
    op_id: int | None = None     # the in-flight backup that writes these pages, if any


@dataclass
class StorageCopy:
    """The L3 objects (page groups) that end inside a node: their keys and where in the node each ends.

    A group covers a fixed number of tokens from the start of the sequence, so it may begin in an
    ancestor; `ends[i]` is the offset (in tokens, within this node's key) just past group `keys[i]`.
    """

    keys: list[str]
    ends: list[int] = field(default_factory=list)
    backed: bool = False
    op_id: int | None = None       # the in-flight write, if any
    from_prefetch: bool = False    # attached by a prefetch and not yet used by a request


class TreeNode:
    """One edge of the tree: `key` tokens, their residency per tier, and lock / eviction bookkeeping."""

    def __init__(self, node_id: int, parent: TreeNode | None, key: Key, device_slots: torch.Tensor | None,
                 clock: int, priority: int = 0, namespace: str | None = None):
        self.id = node_id
        self.parent = parent
        self.children: dict[Key, TreeNode] = {}
        self.key = key
        self.device_slots = device_slots
        self.host: HostCopy | None = None
        self.storage: StorageCopy | None = None
        self.lock_ref = 0
        self.created_at = clock
        self.last_access = clock
        self.hit_count = 0
        self.priority = priority
        self.namespace = namespace  # set on roots; a namespace is one root
        self.in_tree = False        # hung in the tree (and not removed since): eviction entries check it

    @property
    def is_root(self) -> bool:
        """Roots hold no tokens and are never evicted."""
        return self.parent is None

    @property
    def device_tokens(self) -> int:
        """Tokens of this node resident in device slots."""
        return 0 if self.device_slots is None else self.device_slots.numel()

    @property
    def host_ready(self) -> bool:
        """Whether a complete host copy exists (the node can be loaded back from L2)."""
        return self.host is not None and self.host.ready

    def root(self) -> TreeNode:
        """The namespace root above this node."""
        node = self
        while not node.is_root:
            node = node.parent
        return node

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class TreeMatch:
    """Longest cached prefix: the device-resident nodes, then the host-only continuation after them.

    `slots` are the device prefix's (tree-owned: read them, never free them); `last_node` is the deepest
    device node (lock it); `host_nodes` can be loaded back into the device after it.
    """

    slots: torch.Tensor
    last_node: TreeNode
    host_nodes: list[TreeNode] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Device-resident matched tokens (a multiple of page_size)."""
        return self.slots.numel()

    @property
    def host_tokens(self) -> int:
        """Tokens of the host-only continuation."""
        return sum(len(n.key) for n in self.host_nodes)

    @property
    def cached_tokens(self) -> int:
        """Tokens cached in either local tier."""
        return self.length + self.host_tokens


class _EvictionIndex:
    """One tier's eviction candidates, kept across calls: heap entries (policy key, node id, node) that may be
    stale (checked when popped: still in the tree, still a candidate, same key), and the nodes touched since
    the last call (offered again then)."""

    def __init__(self, nodes: Iterator[TreeNode]):
        self.heap: list[tuple] = []
        self.touched: set[TreeNode] = set(nodes)     # first use: every node is offered


class RadixTree:
    """Prefix tree over token ids with per-tier residency; matches, inserts, splits, locks, orders eviction."""

    def __init__(self, page_size: int, eviction_policy: str = "lru", device: torch.device | str = "cpu"):
        self.page_size = page_size
        self.device = torch.device(device)
        self.eviction_policy = eviction_policy
        self._policy_key = eviction_key(eviction_policy)
        self._ids = itertools.count()
        self._clock = itertools.count(1)  # a monotonic tick per operation, not wall time: deterministic order
        self._roots: dict[str | None, TreeNode] = {}
        self._evictable_tokens = 0
        self._protected_tokens = 0
        self._tokens_requested = 0
        self._tokens_hit = 0
        self.evicted_tokens = 0   # advanced by the device tier
        self.version = 0          # see the module docstring: bumped by every change a match could see
        self.events: BlockEvents | None = None   # told every residency change (--kv-events-config)
        self._num_nodes = 0       # non-root nodes in the tree (counted, so that metrics walk nothing)
        self._eviction_indexes: dict[str, _EvictionIndex] = {}

    # ---- match / insert -------------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], namespace: str | None = None, record: bool = True) -> TreeMatch:
        """Longest cached whole-page prefix of `token_ids` (device part + host continuation); splits a node
        the match ends inside.

        record=True counts the look-up (record_match); record=False (planning, scheduling order, re-match
        after insert) changes no counter.
        """
        key = self._aligned_key(token_ids)
        root = self._roots.get(namespace)
        if root is None:  # an unseen namespace: answer without registering a root for it
            match = TreeMatch(self._empty_slots(), self._new_node(None, (), None, namespace=namespace))
        else:
            match = self._match_walk(root, key)
        if record:
            self.record_match(match, len(token_ids))
        return match

    def _match_walk(self, root: TreeNode, key: Key) -> TreeMatch:
        """The one match walk: device nodes along key, then the host-only nodes that continue them."""
        device_node, parts, host_nodes = root, [], []
        for child in self._walk(root, key):
            if child.device_slots is not None and not host_nodes:
                parts.append(child.device_slots)
                device_node = child
            elif child.device_slots is None and child.host_ready:
                host_nodes.append(child)
            else:
                break
        return TreeMatch(torch.cat(parts) if parts else self._empty_slots(), device_node, host_nodes)

    def record_match(self, match: TreeMatch, requested_tokens: int) -> None:
        """Count a look-up of `requested_tokens` that found `match`: refresh access time and hit count of
        its nodes, and add to the hit-rate metrics."""
        self._tokens_requested += requested_tokens
        tick, node = next(self._clock), match.last_node
        path = []
        while not node.is_root:
            path.append(node)
            node = node.parent
        for node in path + match.host_nodes:
            node.last_access = tick
            node.hit_count += 1
            self._tokens_hit += len(node.key)
            self.touch(node)

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: str | None = None,
               priority: int = 0) -> tuple[int, TreeNode | None]:
        """Cache the whole-page prefix of `token_ids` whose KV is in `slots`.

        Returns (tokens already on the device, the new leaf or None). The count stops at the first node off
        the device: from there the caller's pages are adopted. Nodes on the path get max(their, `priority`).
        """
        key = self._aligned_key(token_ids)
        if slots.numel() < len(key):
            raise ValueError(f"insert: {slots.numel()} slots for {len(key)} tokens")
        slots = slots[:len(key)].to(device=self.device, dtype=torch.long)
        self._check_whole_pages(slots)
        if not key:
            return 0, None
        node, pos, already, tick = self._root(namespace), 0, None, next(self._clock)
        for child in self._walk(node, key):
            if child.device_slots is None:
                already = pos if already is None else already
                self.set_device_slots(child, slots[pos:pos + len(child.key)])
            child.last_access = tick
            child.priority = max(child.priority, priority)
            self.touch(child)
            pos += len(child.key)
            node = child
        leaf = self._add_leaf(node, key[pos:], slots[pos:], priority) if pos < len(key) else None
        return (pos if already is None else already), leaf

    def add_leaf(self, parent: TreeNode, key: Key, device_slots: torch.Tensor | None) -> TreeNode:
        """Hang a new node under `parent` (a host-only one when device_slots is None)."""
        return self._add_leaf(parent, key, device_slots, 0)

    def path_end(self, token_ids: list[int], namespace: str | None,
                 create: bool = False) -> tuple[TreeNode | None, int]:
        """(deepest node, tokens) of the tree path along `token_ids`, whatever the tiers.

        (None, 0) when the namespace has no root, unless `create` registers one.
        """
        root = self._root(namespace) if create else self._roots.get(namespace)
        node, pos = root, 0
        if root is None:
            return None, 0
        for child in self._walk(root, self._aligned_key(token_ids)):
            node, pos = child, pos + len(child.key)
        return node, pos

    def _walk(self, node: TreeNode, key: Key) -> Iterator[TreeNode]:
        """The one walk: the nodes key enters from `node`, each split so that key covers it entirely."""
        pos = 0
        while pos < len(key):
            child = self._descend(node, key, pos)
            if child is None:
                return
            yield child
            pos += len(child.key)
            node = child

    # ---- locks ----------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (a running request or an in-flight copy uses it)."""
        if not node.is_root and node.parent.children.get(node.key[:self.page_size]) is not node:
            raise RuntimeError(f"inc_lock_ref: {node} is no longer in the tree")
        while not node.is_root:
            if node.lock_ref == 0:
                self._evictable_tokens -= node.device_tokens
                self._protected_tokens += node.device_tokens
                self.touch(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one inc_lock_ref(node); raises if the node is not locked."""
        if not node.is_root and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref: {node} is not locked")
        while not node.is_root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_tokens -= node.device_tokens
                self._evictable_tokens += node.device_tokens
                self.touch(node)
            node = node.parent

    # ---- residency (called by the tiers) ----------------------------------------------------------------

    def set_device_slots(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Record that `node`'s tokens are now in device `slots`."""
        self.version += 1
        node.device_slots = slots.to(self.device)
        if self.events is not None:
            self.events.touched(node)
        self.touch(node)
        if node.lock_ref > 0:
            self._protected_tokens += node.device_tokens
        else:
            self._evictable_tokens += node.device_tokens

    def clear_device_slots(self, node: TreeNode) -> torch.Tensor | None:
        """Forget `node`'s device slots (the device tier frees their pages); returns them."""
        slots = node.device_slots
        if slots is None:
            return None
        if node.lock_ref > 0:
            raise RuntimeError(f"dropping device pages of locked {node}")
        self.version += 1
        self._evictable_tokens -= node.device_tokens
        node.device_slots = None
        if self.events is not None:
            self.events.touched(node)
        self.touch(node)
        return slots

    def mark_changed(self, node: TreeNode | None = None) -> None:
        """A tier changed residency the tree does not see (`node`'s host copy made ready or dropped)."""
        self.version += 1
        if node is not None and self.events is not None:
            self.events.touched(node, span=True)

    def storage_changed(self, node: TreeNode) -> None:
        """node's L3 record changed (a write acknowledged): no match sees it, only the residency events."""
        if self.events is not None:
            self.events.touched(node)

    def touch(self, node: TreeNode) -> None:
        """Something that decides `node`'s eviction (residency, a copy in flight, a lock, its access) changed:
        offer it, and its parent (whose candidacy depends on its children), to every tier's order again."""
        for index in self._eviction_indexes.values():
            index.touched.add(node)
            if node.parent is not None:
                index.touched.add(node.parent)

    def remove_leaf(self, node: TreeNode) -> None:
        """Unhang a childless node that holds nothing on the device any more."""
        assert not node.children and node.device_slots is None, f"remove_leaf: {node} still holds data"
        self.version += 1
        if self.events is not None:
            self.events.removed(node)
        parent = node.parent
        del parent.children[node.key[:self.page_size]]
        node.in_tree = False
        self._num_nodes -= 1
        self.touch(parent)
        if parent.is_root and not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # a salt's namespace must not outlive its entries

    # ---- eviction order ---------------------------------------------------------------------------------

    def eviction_order(self, candidate: Callable[[TreeNode], bool], tier: str) -> Iterator[TreeNode]:
        """`tier`'s candidates in policy order; after the caller evicts one, its parent is offered if it
        qualifies. The order is kept across calls (see _EvictionIndex): the cost is the nodes touched since
        the last call and those popped, each O(log n), never a walk of the tree."""
        index = self._eviction_indexes.get(tier)
        if index is None or len(index.heap) > 2 * self._num_nodes + 64:
            # First use, or stale entries outnumber the nodes: rebuild (amortised over the pushes since).
            index = self._eviction_indexes[tier] = _EvictionIndex(self.nodes())
        heap, touched = index.heap, index.touched
        index.touched = set()
        for node in touched:
            if node.in_tree and candidate(node):
                heapq.heappush(heap, self._heap_entry(node))
        offered = None                      # yielded, and not yet known to be evicted
        try:
            while heap:
                key, _, node = heapq.heappop(heap)
                if not (node.in_tree and candidate(node) and key == self._policy_key(node)):
                    continue                # stale: a touch re-offers the node if it qualifies again
                parent = node.parent
                offered = node
                yield node
                offered = None
                if node.in_tree and candidate(node):       # the caller kept it: it stays in the order
                    heapq.heappush(heap, self._heap_entry(node))
                if not parent.is_root and parent.in_tree and candidate(parent):
                    heapq.heappush(heap, self._heap_entry(parent))
        finally:
            # The caller stopped after taking `offered` without evicting it: keep its entry.
            if offered is not None and offered.in_tree and candidate(offered):
                heapq.heappush(heap, self._heap_entry(offered))

    def clear(self) -> None:
        """Forget every node (the tiers have freed their pages); raises if any node is locked."""
        locked = [n for n in self.nodes() if n.lock_ref > 0]
        if locked:
            raise RuntimeError(f"reset: {len(locked)} nodes are locked by running requests")
        for node in self.nodes():
            self.clear_device_slots(node)
            node.in_tree = False
        self._roots.clear()
        self._num_nodes = 0
        self._eviction_indexes.clear()
        self.version += 1
        if self.events is not None:
            self.events.cleared()

    # ---- sizes, metrics, inspection -------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Device tokens held by unlocked nodes."""
        return self._evictable_tokens

    def protected_size(self) -> int:
        """Device tokens held by locked nodes."""
        return self._protected_tokens

    def total_size(self) -> int:
        """Device tokens held by the tree (evictable + protected)."""
        return self._evictable_tokens + self._protected_tokens

    def metrics(self) -> dict:
        """Counters for /server_info: requested and hit tokens since start, hit rate, current sizes."""
        return {
            "tokens_requested": self._tokens_requested,
            "tokens_hit": self._tokens_hit,
            "hit_rate": self._tokens_hit / self._tokens_requested if self._tokens_requested else 0.0,
            "tree_tokens": self.total_size(),
            "evictable_tokens": self._evictable_tokens,
            "protected_tokens": self._protected_tokens,
            "evicted_tokens": self.evicted_tokens,
            "num_nodes": self._num_nodes,
        }

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node of every namespace, parents before children (a snapshot: safe to mutate)."""
        out, stack = [], [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return iter(out)

    def roots(self) -> list[TreeNode]:
        """The root of every namespace."""
        return list(self._roots.values())

    def device_pages_of(self, node: TreeNode) -> list[int]:
        """The device page ids of `node`'s slots."""
        if node.device_slots is None:
            return []
        return (node.device_slots[::self.page_size] // self.page_size).tolist()

    def pretty_print(self) -> str:
        """The tree as indented text, one node a line (for debugging)."""
        lines = []

        def visit(node: TreeNode, depth: int) -> None:
            head = list(node.key[:8]) + (["..."] if len(node.key) > 8 else [])
            host = None if node.host is None else node.host.pages.tolist()
            lines.append(f"{'  ' * depth}#{node.id} {head} tokens={len(node.key)} lock={node.lock_ref} "
                         f"hits={node.hit_count} pages={self.device_pages_of(node)} host={host}")
            for child in node.children.values():
                visit(child, depth + 1)

        for ns, root in self._roots.items():
            lines.append(f"namespace {ns!r}")
            for child in root.children.values():
                visit(child, 1)
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of the tree's structure and accounting."""
        ps, evictable, protected, count = self.page_size, 0, 0, 0
        for ns, root in self._roots.items():
            require(root.is_root and root.namespace == ns and not root.key, f"bad root of namespace {ns!r}")
        for node in self.nodes():
            parent = node.parent
            require(len(node.key) > 0 and len(node.key) % ps == 0, f"{node}: key not whole pages")
            require(parent.children.get(node.key[:ps]) is node, f"{node}: not its parent's child by key")
            require(node.device_slots is None or node.device_tokens == len(node.key),
                    f"{node}: {node.device_tokens} slots for key")
            require(self._is_whole_pages(node.device_slots), f"{node}: slots are not whole pages")
            require(node.lock_ref >= 0, f"{node}: negative lock_ref")
            require(node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
                    f"{node}: lock_ref below its children's")
            require(node.device_slots is None or parent.is_root or parent.device_slots is not None,
                    f"{node} is on the device but its parent is not")
            require(node.device_slots is not None or node.host is not None,
                    f"{node} holds its pages in no tier")
            require(node.in_tree, f"{node} is in the tree but marked removed")
            count += 1
            if node.lock_ref > 0:
                protected += node.device_tokens
            else:
                evictable += node.device_tokens
        require(count == self._num_nodes, f"node count {self._num_nodes} != {count}")
        require(evictable == self._evictable_tokens, f"evictable {self._evictable_tokens} != {evictable}")
        require(protected == self._protected_tokens, f"protected {self._protected_tokens} != {protected}")

    # ---- internals ------------------------------------------------------------------------------------

    def _aligned_key(self, token_ids: list[int]) -> Key:
        if isinstance(token_ids, torch.Tensor):  # tuple() of a tensor gives 0-d tensors, which hash by id
            token_ids = token_ids.tolist()
        return tuple(token_ids[:len(token_ids) - len(token_ids) % self.page_size])

    def _empty_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long, device=self.device)

    def _new_node(self, parent: TreeNode | None, key: Key, slots: torch.Tensor | None, priority: int = 0,
                  namespace: str | None = None) -> TreeNode:
        return TreeNode(next(self._ids), parent, key, slots, next(self._clock), priority, namespace)

    def _root(self, namespace: str | None) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_node(None, (), None, namespace=namespace)
        return root

    def _descend(self, node: TreeNode, key: Key, pos: int) -> TreeNode | None:
        """The child of `node` that key[pos:] enters, split so that key covers it entirely; None if none."""
        child = node.children.get(key[pos:pos + self.page_size])
        if child is None:
            return None
        n = self._common_length(child.key, key, pos)
        return child if n == len(child.key) else self._split(child, n)

    def _common_length(self, edge: Key, key: Key, pos: int) -> int:
        """Whole-page length of the common prefix of `edge` and key[pos:]."""
        m = min(len(edge), len(key) - pos)
        if edge[:m] == key[pos:pos + m]:
            return m
        ps = self.page_size
        return next(i for i in range(0, m, ps) if edge[i:i + ps] != key[pos + i:pos + i + ps])

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; the new upper node takes the head of every residency record."""
        ps, k = self.page_size, n // self.page_size   # k: pages in the head
        self.version += 1
        head_slots = None if child.device_slots is None else child.device_slots[:n]
        head = self._new_node(child.parent, child.key[:n], head_slots, child.priority)
        head.lock_ref, head.hit_count = child.lock_ref, child.hit_count  # same locks: same descendants
        head.created_at, head.last_access = child.created_at, child.last_access
        if child.host is not None:
            head.host = HostCopy(child.host.pages[:k], child.host.ready, child.host.op_id)
            child.host.pages = child.host.pages[k:]
        if child.storage is not None:
            s = child.storage
            g = sum(1 for end in s.ends if end <= n)        # groups ending in the head
            head.storage = StorageCopy(s.keys[:g], s.ends[:g], s.backed, s.op_id, s.from_prefetch)
            s.keys, s.ends = s.keys[g:], [end - n for end in s.ends[g:]]
        child.key = child.key[n:]
        if child.device_slots is not None:
            child.device_slots = child.device_slots[n:]
        child.parent.children[head.key[:ps]] = head
        child.parent = head
        head.children[child.key[:ps]] = child
        if self.events is not None:
            self.events.split(head, child)
        head.in_tree = True
        self._num_nodes += 1
        self.touch(head)
        self.touch(child)
        return head

    def _add_leaf(self, parent: TreeNode, key: Key, slots: torch.Tensor | None, priority: int) -> TreeNode:
        leaf = self._new_node(parent, key, slots, priority)
        parent.children[key[:self.page_size]] = leaf
        leaf.in_tree = True
        self._num_nodes += 1
        self.touch(leaf)
        self.version += 1
        self._evictable_tokens += leaf.device_tokens
        if self.events is not None:
            self.events.touched(leaf)
        return leaf

    def _heap_entry(self, node: TreeNode) -> tuple:
        return (self._policy_key(node), node.id, node)

    def _is_whole_pages(self, slots: torch.Tensor | None) -> bool:
        if slots is None or slots.numel() == 0:
            return True
        ps = self.page_size
        rows = slots.view(-1, ps)
        offsets = torch.arange(ps, device=slots.device)
        return bool((rows[:, 0] % ps == 0).all() and (rows - rows[:, :1] == offsets).all())

    def _check_whole_pages(self, slots: torch.Tensor) -> None:
        if not self._is_whole_pages(slots):
            raise ValueError("insert: slots must fill whole pages in order (slot = page*page_size + offset)")


def require(cond: bool, message: str) -> None:
    """An integrity check that survives `python -O` (unlike assert)."""
    if not cond:
        raise AssertionError(message)
