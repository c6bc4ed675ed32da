"""Where each worker holds a prompt's prefix, per tier, from the workers' own KV events (for router benches).

The bench keeps an index of its own (router/kv_index.py fed by router/kv_subscriber.py, one subscriber per
worker), separate from any router's: it is what the workers announced, which the KV-event tests check equals
each worker's tree. `probe(ids)` answers, just before a request is sent, the longest prefix any worker could
serve from its cache (device, L2, or an L3 store it reads) and how much of that was on the device: the
*reachable* hit of a router with perfect knowledge at that moment, and whether a prefetch hint could help.
Whole blocks only (the events' unit, --hicache-storage-page-tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvstrata.router.kv_index import KVIndex
from kvstrata.router.kv_subscriber import EventSource, EventSubscriber


@dataclass(frozen=True)
class Probe:
    """A prompt's prefix as the workers held it: the most any one worker held (tokens, any tier it can
    read), how much of that was on its device, and whether every worker's stream was in sync."""

    reachable: int
    device: int
    in_sync: bool

    @property
    def warmable(self) -> bool:
        """The best holder has part of the prefix in L2/L3 only (a prefetch hint can move it closer)."""
        return self.reachable > self.device


class Residency:
    """A KV-event index of every worker, for probes."""

    def __init__(self, sources: dict[str, EventSource], storage: Optional[dict[str, Optional[str]]] = None):
        self.index = KVIndex()
        self.workers = list(sources)
        for worker, sid in (storage or {}).items():
            self.index.set_storage(worker, sid)
        self.sources = sources
        self.subscribers = {w: EventSubscriber(w, s, self.index).start() for w, s in sources.items()}
        self.down: set[str] = set()         # workers being restarted: they serve nothing

    def probe(self, ids: list[int]) -> Probe:
        """The reachable prefix of `ids` now, on the workers that are up (see the module docstring)."""
        return probe_index(self.index, [w for w in self.workers if w not in self.down], ids)

    def restarting(self, worker: str) -> None:
        """`worker` is going down for a restart: it holds nothing reachable until it is back."""
        self.down.add(worker)

    def restarted(self, worker: str) -> None:
        """`worker` is back (a new process): its state is a fresh dump, as a router that readmits it reads."""
        self.subscribers.pop(worker).stop()
        self.subscribers[worker] = EventSubscriber(worker, self.sources[worker], self.index).start()
        self.down.discard(worker)

    def close(self) -> None:
        """Stop the subscribers."""
        for s in self.subscribers.values():
            s.stop()


def probe_index(index: KVIndex, workers: list[str], ids: list[int]) -> Probe:
    """The longest prefix of `ids` one of `workers` holds in `index` (device first among equals)."""
    hashes = index.hashes(ids)
    bs = index.block_size or 0
    matches = [index.match(w, hashes) for w in workers]
    best = max(matches, key=lambda m: (m.device + m.host + m.storage, m.device), default=None)
    if best is None:
        return Probe(0, 0, False)
    return Probe((best.device + best.host + best.storage) * bs, best.device * bs, index.covers(workers))
