"""Stopping the process groups kvstrata starts (Mooncake services, role-group members): TERM, then KILL."""

from __future__ import annotations

import os
import signal
import time


def stop_group(pid: int, sig: int = signal.SIGTERM, grace_s: float = 5.0) -> None:
    """Signal the process group led by `pid`; SIGKILL it if the leader is still alive after `grace_s`."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    """Whether `pid` runs (a finished child of ours is reaped, so it does not linger as a zombie)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reap our own child so it does not linger as a zombie
        if done:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
