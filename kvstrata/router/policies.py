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

  where matched(w) is the recorded prefix on w, split between L1 and L2 by the share of w's own cache
  hits served from host memory; storage(w) is what another worker sharing w's L3 has recorded beyond
  matched(w); uncached(w) is the rest of the key. All in the key's units (tokens or characters).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvstrata.router.args import RouterArgs
from kvstrata.router.request_key import RouteKey
from kvstrata.router.workers import Worker


@dataclass(frozen=True)
class Decision:
    """The chosen worker and why (a metrics label)."""

    worker: Worker
    reason: str


class Policy:
    """Base: a name, `select`, and the hook that records a key on a worker's tree."""

    name = ""
    uses_trees = False

    def select(self, workers: list[Worker], key: RouteKey) -> Decision:
        """Pick one of `workers` (non-empty) for a request with `key`."""
        raise NotImplementedError

    def record(self, worker: Worker, key: RouteKey) -> None:
        """Remember that `key` was sent to `worker` (trees only)."""
        if self.uses_trees and key:
            worker.tree_for(key).insert(key)


class RandomPolicy(Policy):
    name = "random"

    def select(self, workers: list[Worker], key: RouteKey) -> Decision:
        return Decision(random.choice(workers), "random")


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, workers: list[Worker], key: RouteKey) -> Decision:
        return Decision(workers[next(self._counter) % len(workers)], "round_robin")


def queue_load(w: Worker) -> int:
    """In-flight requests plus what the worker reported queued from other clients."""
    return max(w.in_flight, w.load.running_requests + w.load.waiting_requests)


class PowerOfTwoPolicy(Policy):
    name = "power_of_two"

    def select(self, workers: list[Worker], key: RouteKey) -> Decision:
        pair = random.sample(workers, 2) if len(workers) > 1 else workers
        return Decision(min(pair, key=queue_load), "power_of_two")


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    uses_trees = True

    def __init__(self, args: RouterArgs):
        self.args = args

    def select(self, workers: list[Worker], key: RouteKey) -> Decision:
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

    def __init__(self, args: RouterArgs):
        self.args = args

    def select(self, workers: list[Worker], key: RouteKey) -> Decision:
        matches = [w.tree_for(key).match(key) if key else 0 for w in workers]
        costs = [self.cost(w, len(key or ()), m, self._shared_match(w, workers, matches))
                 for w, m in zip(workers, matches)]
        i = min(range(len(workers)), key=lambda j: (costs[j], *_spread_order(workers[j])))
        reason = "prefix_affinity" if matches[i] and matches[i] == max(matches) else "least_work"
        return Decision(workers[i], reason)

    def cost(self, w: Worker, units: int, matched: int, shared: int) -> float:
        """Expected prefill work of a request of `units` on `w` plus the queueing ahead of it."""
        host = matched * w.load.host_hit_share
        storage = max(0, shared - matched)
        uncached = units - matched - storage
        a = self.args
        prefill = uncached + a.tier_host_weight * host + a.tier_storage_weight * storage
        return prefill + w.pending_prefill + a.tier_decode_weight * w.decoding

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


def make_policy(args: RouterArgs) -> Policy:
    """The policy named by --policy."""
    if args.policy == "random":
        return RandomPolicy()
    if args.policy == "round_robin":
        return RoundRobinPolicy()
    if args.policy == "power_of_two":
        return PowerOfTwoPolicy()
    if args.policy == "cache_aware":
        return CacheAwarePolicy(args)
    return TierAwarePolicy(args)
