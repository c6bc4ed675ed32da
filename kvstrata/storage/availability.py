"""Availability of a remote backend: stop calling a service that is down, retry it with backoff.

A call against a dead Mooncake master can block for seconds; a cache tier must instead answer "miss" at
once. After a failure the backend is *down*: calls are skipped (callers count them) until the backoff
has passed; then exactly one caller probes (a cheap reachability check, then its real call), and its
outcome either restores the backend or doubles the backoff. Transitions are logged once per burst.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Availability:
    """A thread-safe up/down state with exponential-backoff retries (a circuit breaker)."""

    def __init__(self, name: str, backoff_s: float = 0.5, backoff_max_s: float = 10.0,
                 probe: Callable[[], bool] | None = None, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._up = True
        self._probing = False
        self._down_since = 0.0
        self._next_try = 0.0
        self._backoff = backoff_s
        self.outages = 0

    @property
    def up(self) -> bool:
        """True unless the last call failed and no call has succeeded since."""
        return self._up

    def allow(self) -> bool:
        """May the caller use the backend now? When down, True for one probing caller after the backoff.

        A caller that got True must report the outcome with `succeeded()` or `failed()`.
        """
        with self._lock:
            if self._up:
                return True
            if self._probing or self._clock() < self._next_try:
                return False
            self._probing = True
        if self._probe is not None and not self._probe():
            self.failed("still unreachable")
            return False
        return True

    def succeeded(self) -> None:
        """The last call worked: the backend is up."""
        with self._lock:
            self._probing = False
            if self._up:
                return
            self._up = True
            self._backoff = self.backoff_s
            downtime = self._clock() - self._down_since
        logger.warning("%s is available again after %.1f s", self.name, downtime)

    def failed(self, reason: str) -> None:
        """The last call failed: mark down (logging once) or, if already down, back off further."""
        with self._lock:
            self._probing = False
            now = self._clock()
            if self._up:
                self._up = False
                self._down_since = now
                self._backoff = self.backoff_s
                self.outages += 1
                first = True
            else:
                self._backoff = min(self._backoff * 2, self.backoff_max_s)
                first = False
            self._next_try = now + self._backoff
        if first:
            logger.warning("%s is unavailable (%s); its pages count as misses until it recovers, "
                           "retrying with backoff up to %.0f s", self.name, reason, self.backoff_max_s)

    def retry_now(self) -> None:
        """Let the next caller probe at once (after a reconnect, say)."""
        with self._lock:
            self._next_try = 0.0
