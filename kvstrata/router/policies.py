"""Routing policies: pick one worker for a request and name the reason (counted in /metrics).

Every policy gets the routable workers (non-empty) and the request's key (token ids, text, or None),
and returns a Decision. Policies that keep prefix trees record the key on the chosen worker's tree.

- random, round_robin: as named.
- power_of_two: the less loaded of two random workers (load = in-flight requests + the worker's queue).
- cache_aware (SGLang's): if the load is imbalanced, i.e. (max - min) > abs AND max > min * rel over
  in-flight counts, the least loaded worker; else the worker with the longest recorded prefix when it
  covers more than `cache_threshold` of the key; else the least loaded one.
- tier_aware (ours): the worker with the least expected work for this request,

      cost(w) = uncached(w) + host_weight * host(w) + storage_weight * storage(w)      prefill
              + pending_prefill(w) + decode_weight * decoding(w)                       queueing

  Exact (reason "exact"), when every worker publishes KV events and is in sync (router/kv_index.py) and
  the key is token ids: device(w), host(w), storage(w) are the request's leading blocks w holds on its
  device, then in L2, then in an L3 store it reads. Approximate (reason "approximate") otherwise: the
  recorded prefix on w, split between L1 and L2 by the share of w's own cache hits served from host
  memory; storage(w) is what another worker sharing w's L3 has recorded beyond it. The weights are each
  worker's measured seconds per token (load-back, L3 read) over its seconds per computed token (its
  /load report), the flags' values until measured. Costs within SESSION_TIE_TOKENS go to the worker the
  request's conversation (X-Session-ID, session_params.id, OpenAI `user`) last went to (reason "session").
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from kvstrata.router.args import RouterArgs
from kvstrata.router.kv_index import KVIndex, TierMatch
from kvstrata.router.request_key import RouteKey
from kvstrata.router.workers import Worker


@dataclass(frozen=True)
class Decision:
    """The chosen worker and why (a metrics label)."""

    worker: Worker
    reason: str
    warm_tokens: int = 0      # tier_aware: prompt tokens to prefetch on the worker (its L2/L3 holds them)
    cached_tokens: Optional[int] = None       # tier_aware: prompt tokens the chosen worker is expected to hold
    best_cached_tokens: Optional[int] = None  # ... and the most any routable worker was expected to hold


SESSION_TIE_TOKENS = 16      # tier_aware: costs this close tie; the conversation's worker wins the tie
MAX_SESSIONS = 100_000


class Policy:
    """Base: a name, `select`, and the hook that records a key on a worker's tree."""

    name = ""
    uses_trees = False

    def select(self, workers: list[Worker], key: RouteKey, session: Optional[str] = None) -> Decision:
        """Pick one of `workers` (non-empty) for a request with `key` (of conversation `session`, if known)."""
        raise NotImplementedError

    def prefill_units(self, worker: Worker, key: RouteKey, decision: Decision) -> int:
        """Prompt units the request is expected to compute on `worker` (the queueing estimate tier_aware
        charges while it waits for its first byte): what the deciding view expected it to miss (the exact
        index's when it decided), else what its tree has not recorded."""
        if not key:
            return 0
        if decision.cached_tokens is not None:
            return max(0, len(key) - decision.cached_tokens)
        return len(key) - (worker.tree_for(key).match(key) if self.uses_trees else 0)

    def record(self, worker: Worker, key: RouteKey) -> None:
        """Remember that `key` was sent to `worker` (trees only)."""
        if self.uses_trees and key:
            worker.tree_for(key).insert(key)


class RandomPolicy(Policy):
    name = "random"

    def select(self, workers: list[Worker], key: RouteKey, session: Optional[str] = None) -> Decision:
        return Decision(random.choice(workers), "random")


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, workers: list[Worker], key: RouteKey, session: Optional[str] = None) -> Decision:
        return Decision(workers[next(self._counter) % len(workers)], "round_robin")


def queue_load(w: Worker) -> int:
    """In-flight requests plus what the worker reported queued from other clients."""
    return max(w.in_flight, w.load.running_requests + w.load.waiting_requests)


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def select(self, workers: list[Worker], key: RouteKey, session: Optional[str] = None) -> Decision:
        pair = random.sample(workers, 2) if len(workers) > 1 else workers
        return Decision(min(pair, key=queue_load), "power_of_two")


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    uses_trees = True

    def __init__(self, args: RouterArgs):
        self.args = args

    def select(self, workers: list[Worker], key: RouteKey, session: Optional[str] = None) -> Decision:
        loads = [w.in_flight for w in workers]
        least = min(workers, key=_spread_order)
        if self._imbalanced(loads):
            return Decision(least, "load_balance")
        if key:
            matches = [w.tree_for(key).match(key) for w in workers]
            best = max(matches)
            if best > self.args.cache_threshold * len(key):
                return Decision(workers[matches.index(best)], "cache_hit")
        return Decision(least, "cache_miss")

    def _imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.args.balance_abs_threshold and hi > lo * self.args.balance_rel_threshold


class TierAwarePolicy(Policy):
    name = "tier_aware"
    uses_trees = True

    def __init__(self, args: RouterArgs, index: Optional[KVIndex] = None):
        self.args = args
        self.index = index                     # exact, from KV events (None: --no-kv-events)
        self._sessions: OrderedDict[str, str] = OrderedDict()   # session -> worker URL (LRU)

    def select(self, workers: list[Worker], key: RouteKey, session: Optional[str] = None) -> Decision:
        exact = self.index is not None and isinstance(key, tuple) and self.index.covers([w.url for w in workers])
        recorded = [w.tree_for(key).match(key) if key else 0 for w in workers]
        if exact:
            costs, matches = self._exact_costs(workers, key)
            bs = self.index.block_size or 0
            cached = [(m.device + m.host + m.storage) * bs for m in matches]
        else:
            costs, matches = self._approximate_costs(workers, key, recorded), None
            cached = [max(m, self._shared_match(w, workers, recorded)) for w, m in zip(workers, recorded)]
        # Equal costs (the exact index sees whole blocks only): the longer recorded prefix, then the spread.
        i = min(range(len(workers)), key=lambda j: (costs[j], -recorded[j], *_spread_order(workers[j])))
        reason = "exact" if exact else "approximate"
        sticky = self._sessions.get(session) if session else None
        for j, w in enumerate(workers):        # a tie goes to the conversation's worker
            if w.url == sticky and j != i and costs[j] <= costs[i] + SESSION_TIE_TOKENS:
                i, reason = j, "session"
        if session:
            self._sessions[session] = workers[i].url
            self._sessions.move_to_end(session)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        warm = 0
        if self.args.prefetch_hints and matches is not None and (matches[i].host or matches[i].storage):
            warm = cached[i]
        return Decision(workers[i], reason, warm, cached_tokens=cached[i], best_cached_tokens=max(cached))

    def _exact_costs(self, workers: list[Worker], key: tuple) -> tuple[list[float], list[TierMatch]]:
        hashes = self.index.hashes(key)
        bs = self.index.block_size or 0
        matches = [self.index.match(w.url, hashes) for w in workers]
        costs = [self.cost(w, len(key), m.device * bs, m.host * bs, m.storage * bs) for w, m in zip(workers, matches)]
        return costs, matches

    def _approximate_costs(self, workers: list[Worker], key: RouteKey, matches: list[int]) -> list[float]:
        costs = []
        for w, m in zip(workers, matches):
            host = m * w.load.host_hit_share
            storage = max(0, self._shared_match(w, workers, matches) - m)
            costs.append(self.cost(w, len(key or ()), m - host, host, storage))
        return costs

    def cost(self, w: Worker, units: int, device: float, host: float, storage: float) -> float:
        """Expected prefill work of a request of `units` on `w` (its prefix cached `device` units on the
        device, then `host` in L2, then `storage` in L3) plus the queueing ahead of it."""
        host_w, storage_w = w.tier_weights(self.args.tier_host_weight, self.args.tier_storage_weight)
        uncached = units - device - host - storage
        prefill = uncached + host_w * host + storage_w * storage
        return prefill + w.pending_prefill + self.args.tier_decode_weight * w.decoding

    @staticmethod
    def _shared_match(w: Worker, workers: list[Worker], matches: list[int]) -> int:
        """Longest prefix recorded on any worker sharing w's L3 (it was backed up there)."""
        sid = w.load.storage_id
        if not sid:
            return 0
        return max((m for o, m in zip(workers, matches) if o.load.storage_id == sid), default=0)


def _spread_order(w: Worker) -> tuple[int, int]:
    """Least loaded first; among equals, the one that has seen the least (new prefixes spread out)."""
    return w.in_flight, w.token_tree.size + w.text_tree.size


def make_policy(args: RouterArgs, index: Optional[KVIndex] = None) -> Policy:
    """The policy named by --policy (tier_aware routes on `index` where it covers the workers)."""
    if args.policy == "random":
        return RandomPolicy()
    if args.policy == "round_robin":
        return RoundRobinPolicy()
    if args.policy == "power_of_two":
        return PowerOfTwoPolicy()
    if args.policy == "cache_aware":
        return CacheAwarePolicy(args)
    return TierAwarePolicy(args, index)
