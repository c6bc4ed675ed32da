"""Heartbeat: the scheduler loop's progress, seen by the HTTP process without asking the scheduler.

One double in shared memory: the scheduler process writes `time.monotonic()` at every loop iteration
(CLOCK_MONOTONIC is one clock for all processes of the machine), the HTTP process reads its age. An idle
loop iterates too (it polls its inbox every 100 ms), so the age stays small while the scheduler is healthy,
busy or not; it grows only when one iteration (a step, a control request) does not end — a hung forward,
a deadlock, a SIGSTOP — and a stopped process cannot hide that, since nothing needs to be sent.
"""

from __future__ import annotations

import time
from typing import Any


class Heartbeat:
    """Create it before spawning the scheduler process and pass it as a Process argument."""

    def __init__(self, mp_context: Any):
        self._last = mp_context.RawValue("d", time.monotonic())   # one aligned 8-byte write: no lock needed

    def beat(self) -> None:
        """Record progress now (the scheduler loop, once per iteration)."""
        self._last.value = time.monotonic()

    def age_s(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self._last.value
