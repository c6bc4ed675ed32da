"""ControlCalls: control questions to the scheduler (flush the cache, its state, its load), each numbered, and
each answer handed to the caller that asked by the id the scheduler echoes (runtime/messages.ControlReq).

Matching by id, not by kind, keeps two questions of one kind apart (two /server_info calls at once), and
a late answer to a question whose caller gave up (a timeout) is dropped instead of being taken by the next
caller. The waiting is the transport's: an asyncio future (HTTP process) or a concurrent one (Engine).
"""

from __future__ import annotations

import itertools
import threading
from typing import Protocol

from kvstrata.runtime.messages import ControlOut, ControlReq


class ReplyFuture(Protocol):
    """What a caller waits on: asyncio.Future and concurrent.futures.Future both are one."""

    def done(self) -> bool:
        """Whether a result or an exception is set."""

    def set_result(self, result: ControlOut) -> None:
        """Hand the answer over."""

    def set_exception(self, exception: BaseException) -> None:
        """Hand a failure over."""


class ControlCalls:
    """The control questions in flight, by id."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._waiting: dict[int, ReplyFuture] = {}
        self._lock = threading.Lock()

    def open(self, request: ControlReq, reply: ReplyFuture) -> ControlReq:
        """Number `request` and wait for its answer on `reply`; returns the request to send."""
        with self._lock:
            request.control_id = next(self._ids)
            self._waiting[request.control_id] = reply
        return request

    def close(self, request: ControlReq) -> None:
        """The caller stopped waiting (answered, timed out or cancelled): a later answer is dropped."""
        with self._lock:
            self._waiting.pop(request.control_id, None)

    def answer(self, reply: ControlOut) -> bool:
        """Hand `reply` to the caller that asked; False when none waits for it any more."""
        with self._lock:
            fut = self._waiting.pop(reply.control_id, None)
        if fut is None or fut.done():
            return False
        fut.set_result(reply)
        return True

    def fail_all(self, error: BaseException) -> None:
        """Every waiting caller gets `error` (the scheduler is gone)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for fut in waiting:
            if not fut.done():
                fut.set_exception(error)
