"""RadixCache: the L1 prefix tree (RadixAttention) recording which device pages hold the KV of which prefixes.

Each node is one edge: `key` (token ids, a whole number of pages) and `device_slots` (their KV slots).
A child is found by the tokens of its first page. The tree OWNS the pages of every slot it holds and frees
them (allocator.free) when it evicts a node. Sizes are counted in tokens.

Ownership handshake with the scheduler:
  match_prefix(ids) -> slots of the cached prefix (the tree's; read them, never free them) and last_node,
                       which the request locks (inc_lock_ref) while it uses the prefix, then unlocks.
  insert(ids, slots) -> n, the tokens already cached: for those positions the tree keeps its own slots, so
                       the caller frees the pages among its slots[:n] that it allocated itself; the pages of
                       slots[n:aligned] become the tree's.
Lock refs: locking a node increments it and all its ancestors, so node.lock_ref >= sum of its children's.
A node with lock_ref > 0 counts as protected and is never evicted; the others count as evictable.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvstrata.cache.eviction import eviction_key
from kvstrata.memory.allocator import PageAllocator

Key = tuple[int, ...]


class TreeNode:
    """One edge of the tree: `key` tokens, their `device_slots`, and lock / eviction bookkeeping."""

    def __init__(self, node_id: int, parent: TreeNode | None, key: Key, device_slots: torch.Tensor | None,
                 clock: int, priority: int = 0, namespace: str | None = None):
        self.id = node_id
        self.parent = parent
        self.children: dict[Key, TreeNode] = {}
        self.key = key
        self.device_slots = device_slots
        self.lock_ref = 0
        self.created_at = clock
        self.last_access = clock
        self.hit_count = 0
        self.priority = priority
        self.namespace = namespace  # set on roots; a namespace is one root

    @property
    def is_root(self) -> bool:
        """Roots hold no tokens and are never evicted."""
        return self.parent is None

    @property
    def device_tokens(self) -> int:
        """Tokens of this node resident in device slots."""
        return 0 if self.device_slots is None else self.device_slots.numel()

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    """Longest cached prefix: its `slots` (tree-owned) and the deepest node covering it (lock it)."""

    slots: torch.Tensor
    last_node: TreeNode

    @property
    def length(self) -> int:
        """Matched tokens (a multiple of page_size)."""
        return self.slots.numel()


class RadixCache:
    """Prefix tree over token ids whose nodes own pages of the L1 device pool."""

    node_cls: type[TreeNode] = TreeNode

    def __init__(self, allocator: PageAllocator, page_size: int, eviction_policy: str = "lru",
                 device: torch.device | str = "cpu"):
        if page_size != allocator.page_size:
            raise ValueError(f"page_size {page_size} != allocator page size {allocator.page_size}")
        self.allocator = allocator
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
        self._evicted_tokens = 0

    # ---- match / insert -------------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], namespace: str | None = None, record: bool = True) -> MatchResult:
        """Longest cached whole-page prefix of `token_ids`; splits a node the match ends inside.

        Refreshes access time and hit count of every node on the path. last_node is the namespace's root
        when nothing matches (locking a root is a no-op). record=False: a look-up that is not a request's
        (scheduling order, re-match after insert): no hit counts or metrics change.
        """
        if record:
            self._tokens_requested += len(token_ids)
        key = self._aligned_key(token_ids)
        root = self._roots.get(namespace)
        if root is None:  # an unseen namespace: answer without registering a root for it
            return MatchResult(self._empty_slots(), self._new_node(None, (), None, namespace=namespace))
        node, pos, parts, tick = root, 0, [], next(self._clock)
        while pos < len(key):
            child = self._descend(node, key, pos)
            if child is None:
                break
            if record:
                child.last_access = tick
                child.hit_count += 1
            parts.append(child.device_slots)
            pos += len(child.key)
            node = child
        if record:
            self._tokens_hit += pos
        return MatchResult(torch.cat(parts) if parts else self._empty_slots(), node)

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: str | None = None,
               priority: int = 0) -> int:
        """Cache the whole-page prefix of `token_ids` whose KV is in `slots`; returns the tokens already cached.

        The caller frees the pages it owns among slots[:returned]; the pages of slots[returned:aligned] become
        the tree's. Nodes on the path get priority max(theirs, `priority`).
        """
        key = self._aligned_key(token_ids)
        if slots.numel() < len(key):
            raise ValueError(f"insert: {slots.numel()} slots for {len(key)} tokens")
        slots = slots[:len(key)].to(device=self.device, dtype=torch.long)
        self._check_whole_pages(slots)
        if not key:
            return 0
        node, pos, tick = self._root(namespace), 0, next(self._clock)
        while pos < len(key):
            child = self._descend(node, key, pos)
            if child is None:
                self._add_leaf(node, key[pos:], slots[pos:], priority)
                break
            child.last_access = tick
            child.priority = max(child.priority, priority)
            pos += len(child.key)
            node = child
        return pos

    # ---- locks ----------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (a running request uses this prefix)."""
        if not node.is_root and node.parent.children.get(node.key[:self.page_size]) is not node:
            raise RuntimeError(f"inc_lock_ref: {node} is no longer in the tree")
        while not node.is_root:
            if node.lock_ref == 0:
                self._evictable_tokens -= node.device_tokens
                self._protected_tokens += node.device_tokens
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
            node = node.parent

    # ---- eviction -------------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` of unlocked leaves (or all there are) in policy order; returns tokens freed."""
        heap = [self._heap_entry(n) for n in self.nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            freed += self._evict_leaf(node)
            if self._is_evictable_leaf(parent):  # its last child went: the parent may go next
                heapq.heappush(heap, self._heap_entry(parent))
        self._evicted_tokens += freed
        return freed

    def reset(self) -> None:
        """Drop every node and free all its pages; raises if any node is locked (a request still runs)."""
        locked = [n for n in self.nodes() if n.lock_ref > 0]
        if locked:
            raise RuntimeError(f"reset: {len(locked)} nodes are locked by running requests")
        for node in list(self.nodes()):
            self._free_device_pages(node)
        self._roots.clear()

    # ---- sizes, metrics, inspection -------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes."""
        return self._evictable_tokens

    def protected_size(self) -> int:
        """Tokens held by locked nodes."""
        return self._protected_tokens

    def total_size(self) -> int:
        """Tokens held by the tree (evictable + protected)."""
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
            "evicted_tokens": self._evicted_tokens,
            "num_nodes": sum(1 for _ in self.nodes()),
        }

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node of every namespace, parents before children."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def owned_pages(self) -> set[int]:
        """Every device page the tree holds."""
        return {p for n in self.nodes() for p in self._pages_of(n)}

    def pretty_print(self) -> str:
        """The tree as indented text, one node a line (for debugging)."""
        lines = []

        def visit(node: TreeNode, depth: int) -> None:
            head = list(node.key[:8]) + (["..."] if len(node.key) > 8 else [])
            lines.append(f"{'  ' * depth}#{node.id} {head} tokens={len(node.key)} lock={node.lock_ref} "
                         f"hits={node.hit_count} pages={self._pages_of(node)}")
            for child in node.children.values():
                visit(child, depth + 1)

        for ns, root in self._roots.items():
            lines.append(f"namespace {ns!r}")
            for child in root.children.values():
                visit(child, 1)
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of the tree's structure and accounting."""
        ps, evictable, protected, seen = self.page_size, 0, 0, set()
        for ns, root in self._roots.items():
            _require(root.is_root and root.namespace == ns and not root.key, f"bad root of namespace {ns!r}")
        for node in self.nodes():
            parent = node.parent
            _require(len(node.key) > 0 and len(node.key) % ps == 0, f"{node}: key not whole pages")
            _require(parent.children.get(node.key[:ps]) is node, f"{node}: not its parent's child by key")
            _require(node.device_slots is None or node.device_tokens == len(node.key),
                     f"{node}: {node.device_tokens} slots for key")
            _require(self._is_whole_pages(node.device_slots), f"{node}: slots are not whole pages")
            _require(node.lock_ref >= 0, f"{node}: negative lock_ref")
            _require(node.lock_ref >= sum(c.lock_ref for c in node.children.values()),
                     f"{node}: lock_ref below its children's")
            for page in self._pages_of(node):
                _require(page not in seen, f"page {page} held twice by the tree")
                _require(self.allocator.reserved_pages <= page < self.allocator.num_pages,
                         f"{node}: page {page} out of the allocatable range")
                seen.add(page)
            if node.lock_ref > 0:
                protected += node.device_tokens
            else:
                evictable += node.device_tokens
        _require(evictable == self._evictable_tokens, f"evictable {self._evictable_tokens} != {evictable}")
        _require(protected == self._protected_tokens, f"protected {self._protected_tokens} != {protected}")
        free = seen & self.allocator.free_page_ids()
        _require(not free, f"tree pages also on the free list: {sorted(free)[:16]}")

    # ---- internals and extension hooks --------------------------------------------------------------

    def _aligned_key(self, token_ids: list[int]) -> Key:
        if isinstance(token_ids, torch.Tensor):  # tuple() of a tensor gives 0-d tensors, which hash by id
            token_ids = token_ids.tolist()
        return tuple(token_ids[:len(token_ids) - len(token_ids) % self.page_size])

    def _empty_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long, device=self.device)

    def _new_node(self, parent: TreeNode | None, key: Key, slots: torch.Tensor | None, priority: int = 0,
                  namespace: str | None = None) -> TreeNode:
        """Factory hook: subclasses with richer nodes override `node_cls` (or this)."""
        return self.node_cls(next(self._ids), parent, key, slots, next(self._clock), priority, namespace)

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
        """Cut `child` after n tokens; the new upper node takes the head and child's bookkeeping. Returns it."""
        ps = self.page_size
        head_slots = None if child.device_slots is None else child.device_slots[:n]  # None: host-only (L2)
        head = self._new_node(child.parent, child.key[:n], head_slots, child.priority)
        head.lock_ref, head.hit_count = child.lock_ref, child.hit_count  # same locks: same descendants
        head.created_at, head.last_access = child.created_at, child.last_access
        self._on_split(head, child, n)
        child.key = child.key[n:]
        if child.device_slots is not None:
            child.device_slots = child.device_slots[n:]
        child.parent.children[head.key[:ps]] = head
        child.parent = head
        head.children[child.key[:ps]] = child
        return head

    def _on_split(self, head: TreeNode, tail: TreeNode, n: int) -> None:
        """Hook for subclasses to split their own per-node fields (tail still holds the whole edge)."""

    def _add_leaf(self, parent: TreeNode, key: Key, slots: torch.Tensor, priority: int) -> TreeNode:
        leaf = self._new_node(parent, key, slots, priority)
        parent.children[key[:self.page_size]] = leaf
        self._evictable_tokens += leaf.device_tokens
        return leaf

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return (not node.is_root and not node.children and node.lock_ref == 0
                and node.device_slots is not None)

    def _heap_entry(self, node: TreeNode) -> tuple:
        return (self._policy_key(node), node.id, node)

    def _evict_leaf(self, node: TreeNode) -> int:
        """Remove an unlocked leaf and free its pages; returns its tokens. Subclasses may demote instead."""
        tokens = node.device_tokens
        self._free_device_pages(node)
        parent = node.parent
        del parent.children[node.key[:self.page_size]]
        if parent.is_root and not parent.children and parent.namespace is not None:
            del self._roots[parent.namespace]  # a salt's namespace must not outlive its entries
        return tokens

    def _free_device_pages(self, node: TreeNode) -> None:
        """The one place where a node's device pages go back to the allocator (and leave the size counts)."""
        if node.device_slots is None:
            return
        if node.lock_ref > 0:
            raise RuntimeError(f"freeing device pages of locked {node}")
        self.allocator.free(self._pages_of(node))
        self._evictable_tokens -= node.device_tokens
        node.device_slots = None

    def _pages_of(self, node: TreeNode) -> list[int]:
        if node.device_slots is None:
            return []
        return (node.device_slots[::self.page_size] // self.page_size).tolist()

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


def _require(cond: bool, message: str) -> None:
    """An integrity check that survives `python -O` (unlike assert)."""
    if not cond:
        raise AssertionError(message)
