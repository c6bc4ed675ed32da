"""UtilizationMeter: the share of wall-clock time spent inside measured blocks (the model's forwards).

    busy_s                 total seconds inside `measure()` since creation (a counter)
    utilization()          busy seconds / elapsed seconds, over the last `window_s` (at least) of wall clock

A mark (time, busy_s) is kept at the end of each measured block; `utilization()` differences the newest
state against the latest mark that is at least `window_s` old. The cost per block is two clock reads and
one deque append.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class UtilizationMeter:
    """Accumulates busy time; reads as a fraction of wall clock over the last window."""

    def __init__(self, window_s: float = 1.0, clock: Callable[[], float] = time.perf_counter):
        self.window_s = window_s
        self.clock = clock
        self.busy_s = 0.0
        self._marks: deque[tuple[float, float]] = deque([(clock(), 0.0)])

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Count the time spent in the `with` block as busy."""
        start = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            self.busy_s += end - start
            self._mark(end)

    def utilization(self) -> float:
        """Busy share of the wall clock since the latest mark at least `window_s` old (0..1)."""
        now = self.clock()
        self._mark(now)
        t0, busy0 = self._marks[0]
        elapsed = now - t0
        return min(1.0, (self.busy_s - busy0) / elapsed) if elapsed > 0 else 0.0

    def _mark(self, now: float) -> None:
        self._marks.append((now, self.busy_s))
        # Keep exactly one mark older than the window: the start of the span utilization() measures.
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.window_s:
            self._marks.popleft()
