"""CompileCache: a bounded LRU of compiled grammars, keyed by (kind, text), shared by concurrent callers."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

GrammarKey = tuple[str, str]


class GrammarCacheInfo(NamedTuple):
    """Counters of a compile cache (for /server_info and tests)."""

    hits: int        # lookups answered by a cached or in-flight compile
    misses: int      # lookups that started a compile
    compiles: int    # compiles that actually ran (finished or failed)
    size: int        # entries held now
    capacity: int


class CompileCache:
    """LRU of futures of compiled grammars.

    An entry is added when a compile starts, so that a second request for the same key while the first
    is still compiling waits on the same future instead of compiling twice. A failed compile is removed,
    so the error is recomputed (and reported) for the next request rather than pinned in the cache.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"grammar cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._compiles = 0

    def get_or_start(self, key: GrammarKey, start: Callable[[], Future]) -> Future:
        """The future of `key`'s compiled grammar; calls `start()` to begin compiling it on a miss."""
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return future
            self._misses += 1
            future = start()
            self._entries[key] = future
            while len(self._entries) > self.capacity:
                # An evicted in-flight compile still completes for those already waiting on it.
                self._entries.popitem(last=False)
        future.add_done_callback(lambda f: self._on_done(key, f))
        return future

    def count_compile(self) -> None:
        """Record that a compile ran (called by the compiling thread)."""
        with self._lock:
            self._compiles += 1

    def clear(self) -> None:
        """Drop every entry (in-flight compiles still complete for their waiters)."""
        with self._lock:
            self._entries.clear()

    def info(self) -> GrammarCacheInfo:
        """A snapshot of the counters."""
        with self._lock:
            return GrammarCacheInfo(self._hits, self._misses, self._compiles, len(self._entries),
                                    self.capacity)

    def _on_done(self, key: GrammarKey, future: Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._entries.get(key) is future:
                    del self._entries[key]
