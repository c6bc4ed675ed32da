"""The router's view of its workers: health, drain state, in-flight requests, load reports, prefix trees.

Everything here is rebuilt from what the workers report and what the router sends them, so a router
restart loses only the approximate prefix trees (they refill as requests arrive).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional

from kvstrata.router.prefix_tree import PrefixTree


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's GET /load report (see kvstrata/server/load_api.py)."""

    running_requests: int = 0
    waiting_requests: int = 0
    pool_usage: float = 0.0               # fraction of the device KV pool in use (cache included)
    host_hit_share: float = 0.0           # share of its cache hits served from host memory (L2)
    storage_id: Optional[str] = None      # identity of its L3 ("file:/dir", "mooncake:host:port"), if any
    compute_s_per_token: float = 0.0      # measured by the worker (0.0: not yet): computing a token,
    load_back_s_per_token: float = 0.0    # loading one back from L2,
    storage_s_per_token: float = 0.0      # reading one from L3

    @staticmethod
    def from_json(d: dict) -> WorkerLoad:
        """Parse a /load body; unknown fields are ignored so that workers may report more."""
        hits = d.get("device_hit_tokens", 0) + d.get("host_hit_tokens", 0)
        return WorkerLoad(running_requests=int(d.get("running_requests", 0)),
                          waiting_requests=int(d.get("waiting_requests", 0)),
                          pool_usage=float(d.get("pool_usage", 0.0)),
                          host_hit_share=d.get("host_hit_tokens", 0) / hits if hits else 0.0,
                          storage_id=d.get("storage_id"),
                          compute_s_per_token=float(d.get("compute_s_per_token", 0.0)),
                          load_back_s_per_token=float(d.get("load_back_s_per_token", 0.0)),
                          storage_s_per_token=float(d.get("storage_s_per_token", 0.0)))


@dataclass
class Worker:
    """One worker as the router sees it."""

    url: str
    id: str = ""                          # "worker-N": how clients that may not see URLs name it
    api_key: Optional[str] = field(default=None, repr=False)   # the only credential the router sends it
    healthy: bool = False
    stalled: bool = False                 # in flight yet silent for --worker-first-byte-timeout-secs
    last_progress: float = 0.0            # monotonic time of its last byte while it had requests in flight
    draining: bool = False
    in_flight: int = 0
    decoding: int = 0                     # in-flight requests whose first byte came back
    pending_prefill: int = 0              # prompt units routed here whose first byte has not come back
    load: WorkerLoad = field(default_factory=WorkerLoad)
    admitted_before: bool = False
    failure_streak: int = 0
    success_streak: int = 0
    token_tree: PrefixTree = field(default_factory=PrefixTree)
    text_tree: PrefixTree = field(default_factory=PrefixTree)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def tier_weights(self, host_default: float, storage_default: float) -> tuple[float, float]:
        """(host, storage) cost of a cached token relative to computing it, from the worker's measured
        rates; the configured default for a rate not measured yet."""
        c = self.load.compute_s_per_token
        host = self.load.load_back_s_per_token / c if c and self.load.load_back_s_per_token else host_default
        storage = self.load.storage_s_per_token / c if c and self.load.storage_s_per_token else storage_default
        return min(host, 1.0), min(storage, 1.0)    # the worker recomputes rather than copy slower

    @property
    def routable(self) -> bool:
        """May receive new requests."""
        return self.healthy and not self.draining and not self.stalled

    def progress(self) -> None:
        """The worker sent something (an answer, a stream chunk, a /load report): it is not stalled."""
        self.last_progress = time.monotonic()
        self.stalled = False

    def silent_for(self) -> float:
        """Seconds since its last byte while it had requests in flight (0 when idle)."""
        return time.monotonic() - self.last_progress if self.in_flight else 0.0

    def tree_for(self, key: object) -> PrefixTree:
        """The tree that records keys of this kind (token ids or text)."""
        return self.text_tree if isinstance(key, str) else self.token_tree

    def begin(self, prefill_units: int) -> None:
        """A request was sent here."""
        if self.in_flight == 0:
            self.last_progress = time.monotonic()   # idle time is not silence
        self.in_flight += 1
        self.pending_prefill += prefill_units
        self.idle.clear()

    def first_byte(self, prefill_units: int) -> None:
        """The request's first byte came back: its prefill is done, it now decodes."""
        self.pending_prefill -= prefill_units
        self.decoding += 1

    def end(self, prefill_units: int, got_first_byte: bool) -> None:
        """The request finished (or failed)."""
        self.in_flight -= 1
        if got_first_byte:
            self.decoding -= 1
        else:
            self.pending_prefill -= prefill_units
        if self.in_flight == 0:
            self.idle.set()

    def summary(self) -> dict:
        """JSON for /list_workers (an admin route: URLs are shown; the API key never is)."""
        return {"url": self.url, "id": self.id, "healthy": self.healthy, "stalled": self.stalled,
                "draining": self.draining, "in_flight": self.in_flight, "load": dataclasses.asdict(self.load)}


class WorkerRegistry:
    """The set of workers, by URL, in the order they were added."""

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._ids: dict[str, str] = {}        # every URL ever added keeps its id (metric series stay put)

    def add(self, url: str, api_key: Optional[str] = None) -> tuple[Worker, bool]:
        """Register `url` (unhealthy until checked) with the key to send it; returns the worker and
        whether it is new. Re-adding a listed worker cancels its drain and, if a key is given, sets it."""
        existing = self._workers.get(url)
        if existing is not None:
            existing.draining = False
            if api_key is not None:
                existing.api_key = api_key
            return existing, False
        worker = Worker(url, id=self.id_of(url), api_key=api_key)
        self._workers[url] = worker
        return worker, True

    def id_of(self, url: str) -> str:
        """The id of `url` ("worker-N", N in order of first registration)."""
        return self._ids.setdefault(url, f"worker-{len(self._ids)}")

    def remove(self, url: str) -> Optional[Worker]:
        """Forget `url`; returns its worker or None. Its in-flight requests finish on their connections."""
        return self._workers.pop(url, None)

    def get(self, url: str) -> Optional[Worker]:
        """The worker at `url`, or None."""
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        """Every registered worker."""
        return list(self._workers.values())

    def routable(self) -> list[Worker]:
        """Workers that may receive new requests."""
        return [w for w in self._workers.values() if w.routable]
