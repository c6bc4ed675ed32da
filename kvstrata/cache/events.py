"""BlockEvents: the cache's residency changes as exact, tier-tagged block events (--kv-events-config).

A *block* is an L3 page group (`group_tokens` tokens, storage_tier.py): group i of a sequence covers its
tokens [i*G, (i+1)*G) and its hash is the low 64 bits of its page-group key (page_hash.py: a SHA-256 chain
over the groups, in the engine's namespace), so two workers serving the same model report the same hash for
the same tokens, and the hash of an L3 object is the one its L3 event carries. A trailing partial group is
no block. Residency is per page and node in the tree; a block is resident in a tier when the tree says all
of its pages are, by the rules check_integrity enforces:

    L1 device   the node its last token lies in has device slots (device residency is prefix-closed, so
                the block's earlier pages are on the device too); a load-back counts from its submit, as
                for the tree (the forward waits for its layers)
    L2 host     every node the block overlaps has a *ready* host copy (a backup in flight is not announced)
    L3 storage  the node its last token lies in has a StorageCopy that is `backed` (the write was
                acknowledged, or a prefetch read it)

The tree calls this sink where residency changes (radix_tree.py: `events`; None when off, so an engine
without events pays one `is None` test per change). Those calls only mark nodes dirty; `collect()`, once
per step, recomputes the blocks of the dirty nodes, diffs them with what was announced, and returns the
events. A node's group keys are hashed once and cached until the node is split or removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from kvstrata.cache.page_hash import page_keys, request_namespace
from kvstrata.cache.radix_tree import TreeNode

HASH_MASK = (1 << 64) - 1
STORAGE_MEDIA = {"file": "DISK", "mooncake": "MOONCAKE"}    # --hicache-storage-backend -> L3 medium


def block_hash(key: str) -> int:
    """The 64-bit block hash of a page-group key (hex SHA-256): its low 64 bits, as vLLM shortens its own."""
    return int(key, 16) & HASH_MASK


@dataclass(frozen=True)
class Media:
    """The medium names the three tiers are announced under (None: the tier is not there)."""

    device: str                 # "GPU", or "CPU" for a CPU device pool
    host: str | None = None     # "CPU_PINNED"
    storage: str | None = None  # "DISK" (file L3) or "MOONCAKE"

    def all(self) -> tuple[str, ...]:
        """The media present, device first."""
        return tuple(m for m in (self.device, self.host, self.storage) if m is not None)


@dataclass(frozen=True)
class BlocksStored:
    """Blocks that became resident in `medium`: a chain, `parent` the hash before the first (None: root)."""

    medium: str
    hashes: list[int]
    parent: int | None
    token_ids: list[int]


@dataclass(frozen=True)
class BlocksRemoved:
    """Blocks that left `medium`."""

    medium: str
    hashes: list[int]


@dataclass(frozen=True)
class AllCleared:
    """Every block left every medium (a cache flush)."""


BlockEvent = Union[BlocksStored, BlocksRemoved, AllCleared]


@dataclass
class _Record:
    """The groups ending in one node, and the chain state around it."""

    keys: list[int]          # block hashes of the groups ending in the node
    ends: list[int]          # offset (tokens, within the node's key) just past each group
    tail: tuple              # tokens after the last group boundary at the node's end
    prior: str | None        # key of the last group ending at or before the node's end
    tail_before: tuple       # the same two at the node's start (its parent's end)
    prior_before: str | None
    depth: int               # tokens from the root to the node's end


@dataclass
class _Block:
    media: frozenset
    parent: int | None
    tokens: tuple


class BlockEvents:
    """Dirty-node tracking and per-step diffing of block residency; the radix tree's `events` sink."""

    def __init__(self, group_tokens: int, namespace: str, page_size: int, media: Media):
        self.group_tokens = group_tokens
        self.namespace = namespace        # the engine's page-group namespace (storage_io.kv_namespace)
        self.page_size = page_size
        self.media = media
        self._records: dict[int, _Record] = {}     # node id -> its groups (cached hashing)
        self._dirty: dict[int, tuple[TreeNode, bool]] = {}   # node id -> (node, L2 span: its children too)
        self._removed: list[_Record] = []          # records of nodes that left the tree since collect()
        self._state: dict[int, _Block] = {}        # block hash -> what was announced
        self._cleared = False

    # ---- what the tree calls ------------------------------------------------------------------------------

    def touched(self, node: TreeNode, span: bool = False) -> None:
        """node's residency changed (span: its host copy, which blocks ending in its children overlap)."""
        if node.is_root:
            return
        old = self._dirty.get(node.id)
        self._dirty[node.id] = (node, span or (old is not None and old[1]))

    def removed(self, node: TreeNode) -> None:
        """node is leaving the tree (still attached): its blocks leave every tier."""
        self._removed.append(self._record(node))
        self._records.pop(node.id, None)
        self._dirty.pop(node.id, None)

    def split(self, head: TreeNode, child: TreeNode) -> None:
        """child was cut after `head`: its groups are recomputed (their hashes and residency do not change)."""
        self._records.pop(child.id, None)
        self.touched(head)
        self.touched(child)

    def cleared(self) -> None:
        """The tree forgot every node."""
        self._records.clear()
        self._dirty.clear()
        self._removed.clear()
        self._state.clear()
        self._cleared = True

    # ---- once per step ------------------------------------------------------------------------------------

    def collect(self) -> list[BlockEvent]:
        """The events since the last call: what changed, diffed against what was announced."""
        if not self._dirty and not self._removed and not self._cleared:
            return []
        events: list[BlockEvent] = [AllCleared()] if self._cleared else []
        self._cleared = False
        desired: dict[int, _Block] = {}
        for record in self._removed:
            for h in record.keys:
                desired[h] = _Block(frozenset(), None, ())
        self._removed = []
        nodes = self._expand(self._dirty.values())
        self._dirty = {}
        for node in sorted(nodes, key=lambda n: self._record(n).depth):
            self._blocks_of(node, desired)
        stored: dict[str, list[tuple[int, int | None, tuple]]] = {m: [] for m in self.media.all()}
        removed: dict[str, list[int]] = {m: [] for m in self.media.all()}
        for h, block in desired.items():
            old = self._state.get(h)
            old_media = old.media if old is not None else frozenset()
            for m in block.media - old_media:
                stored[m].append((h, block.parent, block.tokens))
            for m in old_media - block.media:
                removed[m].append(h)
            if block.media:
                self._state[h] = block
            else:
                self._state.pop(h, None)
        for m, hashes in removed.items():
            if hashes:
                events.append(BlocksRemoved(m, hashes))
        for m, blocks in stored.items():
            events.extend(_chains(m, blocks))
        return events

    def snapshot(self) -> list[BlockEvent]:
        """The announced state as events: AllCleared, then every block per medium (a publisher's resync)."""
        events: list[BlockEvent] = [AllCleared()]
        for m in self.media.all():
            blocks = [(h, b.parent, b.tokens) for h, b in self._state.items() if m in b.media]
            events.extend(_chains(m, blocks))
        return events

    # ---- internals ----------------------------------------------------------------------------------------

    def _expand(self, dirty) -> list[TreeNode]:
        """The dirty nodes still in the tree, plus, for a host change, the descendants whose first group
        may begin in it (within one group of its end)."""
        out: dict[int, TreeNode] = {}
        for node, span in dirty:
            if not self._attached(node):
                continue
            out[node.id] = node
            if not span:
                continue
            stack = [(c, 0) for c in node.children.values()]
            while stack:
                child, offset = stack.pop()
                if offset >= self.group_tokens:
                    continue
                out[child.id] = child
                stack.extend((c, offset + len(child.key)) for c in child.children.values())
        return list(out.values())

    def _attached(self, node: TreeNode) -> bool:
        """Whether node is still in the tree (a removed node is unhung from its parent)."""
        return node.parent is not None and node.parent.children.get(node.key[:self.page_size]) is node

    def _blocks_of(self, node: TreeNode, desired: dict[int, _Block]) -> None:
        """Residency of the blocks ending in `node`, into `desired`."""
        r = self._record(node)
        if not r.keys:
            return
        gt, media = self.group_tokens, self.media
        on_device = node.device_slots is not None
        storage = node.storage
        backed = media.storage is not None and storage is not None and storage.backed
        seq = r.tail_before + node.key
        offset = len(r.tail_before)
        parent = block_hash(r.prior_before) if r.prior_before is not None else None
        for h, end in zip(r.keys, r.ends):
            tiers = []
            if on_device:
                tiers.append(media.device)
            if media.host is not None and _host_ready_span(node, end, gt):
                tiers.append(media.host)
            if backed:
                tiers.append(media.storage)
            desired[h] = _Block(frozenset(tiers), parent, seq[offset + end - gt: offset + end])
            parent = h

    def _record(self, node: TreeNode) -> _Record:
        """node's groups, computed from its parent's chain state (cached)."""
        record = self._records.get(node.id)
        if record is not None:
            return record
        path = []
        up = node
        while not up.is_root and up.id not in self._records:
            path.append(up)
            up = up.parent
        if up.is_root:
            tail, prior, depth, namespace = (), None, 0, up.namespace
        else:
            above = self._records[up.id]
            tail, prior, depth, namespace = above.tail, above.prior, above.depth, _namespace(up)
        ns = request_namespace(self.namespace, namespace)
        gt = self.group_tokens
        for n in reversed(path):
            seq = tail + n.key
            count = len(seq) // gt
            keys = page_keys(seq[:count * gt], gt, ns, prior)
            ends = [(i + 1) * gt - len(tail) for i in range(count)]
            rec = _Record([block_hash(k) for k in keys], ends, seq[count * gt:], keys[-1] if keys else prior,
                          tail, prior, depth + len(n.key))
            self._records[n.id] = rec
            tail, prior, depth = rec.tail, rec.prior, rec.depth
        return self._records[node.id]


def _namespace(node: TreeNode) -> str | None:
    return node.root().namespace


def _host_ready_span(node: TreeNode, end: int, group_tokens: int) -> bool:
    """Whether the group ending `end` tokens into node has every page in a ready host copy."""
    if not node.host_ready:
        return False
    need, up = group_tokens - end, node.parent
    while need > 0 and not up.is_root:
        if not up.host_ready:
            return False
        need -= len(up.key)
        up = up.parent
    return True


def _chains(medium: str, blocks: list[tuple[int, int | None, tuple]]) -> list[BlocksStored]:
    """Stored blocks as BlockStored events, one per run of consecutive blocks of one chain."""
    out: list[BlocksStored] = []
    for h, parent, tokens in blocks:
        last = out[-1] if out else None
        if last is not None and last.hashes[-1] == parent:
            last.hashes.append(h)
            last.token_ids.extend(tokens)
        else:
            out.append(BlocksStored(medium, [h], parent, list(tokens)))
    return out
