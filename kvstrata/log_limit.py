"""IntervalLog: a condition that can repeat thousands of times a second is logged once per interval.

The first occurrence is logged at once; later ones within the interval are counted, and the next line
says how many there were. The log grows by at most one line per interval per condition, however hard a
client or a full disk pushes.
"""

from __future__ import annotations

import logging
import threading
import time


class IntervalLog:
    """One condition's rate-limited log line; thread-safe."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, level: int = logging.WARNING):
        self.logger = logger
        self.interval_s = interval_s
        self.level = level
        self.total = 0               # occurrences since start
        self._suppressed = 0
        self._next_at = 0.0
        self._lock = threading.Lock()

    def hit(self, message: str, *args: object) -> None:
        """Count one occurrence; log `message % args` if the interval has passed since the last line."""
        with self._lock:
            self.total += 1
            now = time.monotonic()
            if now < self._next_at:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._next_at = now + self.interval_s
        suffix = f" (and {suppressed} more in the last {self.interval_s:g} s)" if suppressed else ""
        self.logger.log(self.level, message + suffix, *args)
