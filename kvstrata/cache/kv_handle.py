"""KVHandle: a request's KV state, owned by the cache facade (the request only holds it, as `req.kv`).

Token bookkeeping (lengths in tokens), written only by KVCacheManager:

    tokens [0, tree_len)          pages owned by the radix tree, locked through `last_node`
    tokens [tree_len, slot_len)   the request's private pages (freed, or handed to the tree on commit)
    kv_len <= slot_len            tokens whose KV is computed (< slot_len while a forward is pending)

`last_slot` is the slot of token slot_len-1, kept on the host so that reserving a decode token reads
nothing back from the device. The prefetch fields, the memoised match and `hits_recorded` outlive a
retraction; the rest is cleared when the request's KV is released.

`match` memoises the tree's answer for the request's prompt: it is reused while the tree's version stamp
(bumped by every insert, split, eviction and residency change) is the one it was computed at, so the
planning, readiness check and admission of one step walk the tree once.

CacheRequest is all the cache reads of a request (the runtime's Req satisfies it): the cache imports no
runtime module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvstrata.cache.radix_tree import TreeMatch


class CacheRequest(Protocol):
    """A request as the cache facade sees it: its tokens, its namespace and the KV handle it holds."""

    rid: str
    namespace: str | None
    logprob_start_len: int
    priority: int                    # higher is more important: the tree keeps the max per node (eviction)
    kv: KVHandle | None              # created and written by the cache only

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request needs before its next decode (prompt + output)."""

    @property
    def fill_len(self) -> int:
        """len(fill_ids)."""

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether logits of prompt positions from logprob_start_len on are needed (they are computed)."""


@dataclass
class KVHandle:
    """What the cache holds for one request (see the module docstring)."""

    row: int | None = None
    kv_len: int = 0
    slot_len: int = 0
    tree_len: int = 0
    last_node: Any = None             # the deepest locked tree node of the cached prefix
    last_slot: int | None = None
    tier_hits: tuple[int, int, int] = (0, 0, 0)   # of the latest match: (device, host, storage) tokens
    hits_recorded: bool = False       # the admission was counted in the per-tier hit metrics
    prefetch_op: Any = None           # the L3 prefetch started on arrival (a StorageOp), if any
    prefetch_deadline: float = 0.0
    prefetch_retry: bool = False      # the prefetch was skipped for lack of host room: try again
    prefetch_local: int = 0           # prompt tokens L1 + L2 held when the prefetch was planned
    prefetch_refetches: int = 0       # prefetches re-issued after those pages were evicted
    match: TreeMatch | None = None    # the latest match of the prompt's first `match_len` tokens ...
    match_len: int = 0
    match_version: int = -1           # ... valid while the tree's version is this one

    def clear(self) -> None:
        """Forget the row and pages (released); prefetch state and hit accounting stay."""
        self.row = self.last_node = self.last_slot = None
        self.kv_len = self.slot_len = self.tree_len = 0
