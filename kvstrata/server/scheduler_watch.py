"""SchedulerWatch: the HTTP process's view of its scheduler process — alive, making progress, or stuck.

Two bounds on the scheduler loop's heartbeat (runtime/heartbeat.py):
- `--scheduler-heartbeat-timeout`: older than this, /health answers 503 (the process may still recover);
- `--watchdog-timeout` (SGLang's flag): older than this, the scheduler is stuck in one iteration; the
  watch kills it (SIGKILL also ends a stopped process), and the server exits non-zero, as it does when the
  scheduler dies, so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Optional

from kvstrata.runtime.heartbeat import Heartbeat
from kvstrata.server.scheduler_client import SchedulerClient

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.25


class SchedulerWatch:
    """Liveness and progress of one scheduler process (a multiprocessing.Process) and its heartbeat."""

    def __init__(self, proc: Any, heartbeat: Heartbeat, heartbeat_timeout_s: float,
                 watchdog_timeout_s: Optional[float]):
        self.proc = proc
        self.heartbeat = heartbeat
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.watchdog_timeout_s = watchdog_timeout_s
        self.killed_reason: Optional[str] = None

    @property
    def pid(self) -> int:
        """The scheduler process's pid."""
        return self.proc.pid

    def is_alive(self) -> bool:
        """Whether the scheduler process still runs (stopped or stuck counts as alive)."""
        return self.proc.is_alive()

    def problem(self) -> Optional[str]:
        """Why the scheduler is not healthy now, or None when it runs and made progress recently."""
        if not self.is_alive():
            return self.killed_reason or "the scheduler process is not running"
        age = self.heartbeat.age_s()
        if age > self.heartbeat_timeout_s:
            return (f"the scheduler has made no progress for {age:.1f} s (--scheduler-heartbeat-timeout "
                    f"{self.heartbeat_timeout_s:g})")
        return None

    def kill_if_stuck(self) -> bool:
        """Kill the scheduler if its heartbeat is older than the watchdog timeout; returns whether it did."""
        age = self.heartbeat.age_s()
        if self.watchdog_timeout_s is None or self.killed_reason or age <= self.watchdog_timeout_s:
            return False
        self.killed_reason = (f"the scheduler was stuck for {age:.1f} s (--watchdog-timeout "
                              f"{self.watchdog_timeout_s:g}) and was killed")
        logger.error("%s (pid %d)", self.killed_reason, self.pid)
        self.proc.kill()
        return True

    async def watch(self, client: SchedulerClient, on_death: Callable[[], None]) -> None:
        """Until the scheduler is gone: kill it when stuck; then fail pending requests and call `on_death`."""
        while self.is_alive():
            self.kill_if_stuck()
            await asyncio.sleep(WATCH_INTERVAL_S)
        reason = self.killed_reason or "the scheduler process is not running"
        logger.error("%s; failing pending requests", reason)
        client.mark_dead(reason)
        on_death()
