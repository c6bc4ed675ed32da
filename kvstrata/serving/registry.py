"""SequenceRegistry: the running output sequences of one transport, by rid — the bookkeeping every transport
to the scheduler shares (the HTTP process's ZMQ link, Engine's queue into its scheduler thread).

    register(states)     a request's sequences start; a rid already running is refused (400)
    dispatch(batch)      each ReqOutput of a scheduler step goes to its sequence (outputs of released
                         sequences are dropped: their caller is gone)
    release(states)      the caller is done with them: forgotten, and the scheduler side of those not
                         finished is aborted (the caller went away); idempotent
    abort(rid)           abort by the user's rid (every sequence of its n) or by one sequence's rid
    end_all / fail_all   shutdown (a clean end after what is pending) / the scheduler is gone (an error)

Thread-safe: Engine registers and releases on its callers' threads and dispatches on the scheduler thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Optional

from kvstrata.runtime.messages import BatchOutput, ReqOutput
from kvstrata.serving.errors import ApiError
from kvstrata.serving.seq_state import SeqState

# Hands one scheduler output to its sequence on its consumer's side (called where dispatch runs).
Deliver = Callable[[SeqState, ReqOutput], None]
ABORTED_MESSAGE = "aborted: the client went away"


def push(state: SeqState, out: ReqOutput) -> None:
    """The default delivery: the consumer shares the dispatcher's thread (or event loop)."""
    state.push(out)


class SequenceRegistry:
    """rid → (SeqState, how to deliver to it), and user rid → its sequences' rids."""

    def __init__(self, send_abort: Callable[[str], None]):
        self._send_abort = send_abort              # asks the scheduler to stop one sequence (never raises)
        self._states: dict[str, tuple[SeqState, Deliver]] = {}
        self._groups: dict[str, list[str]] = {}    # user rid → the rids of its output sequences
        self._lock = threading.Lock()
        # Each sees every sequence once, at its release, before an unfinished one is failed.
        self.release_hooks: list[Callable[[SeqState], None]] = []

    def __len__(self) -> int:
        """How many sequences are registered (running, or finished and not yet released)."""
        return len(self._states)

    def register(self, states: list[SeqState], deliver: Deliver = push) -> None:
        """Start tracking the sequences of one request; raises ApiError if one of its rids is running."""
        with self._lock:
            for s in states:
                if s.group_rid in self._groups or s.group_rid in self._states:
                    raise ApiError(f"a request with rid '{s.group_rid}' is already running", param="rid")
            for s in states:
                self._states[s.rid] = (s, deliver)
                self._groups.setdefault(s.group_rid, []).append(s.rid)

    def dispatch(self, batch: BatchOutput) -> None:
        """Deliver each output of one scheduler step to its sequence."""
        for out in batch.outputs:
            entry = self._states.get(out.rid)
            if entry is not None:
                state, deliver = entry
                deliver(state, out)

    def release(self, states: Iterable[SeqState]) -> None:
        """Forget `states`; abort the scheduler side of those not finished (idempotent)."""
        for s in states:
            with self._lock:
                if self._states.pop(s.rid, None) is None:
                    continue
                members = self._groups.get(s.group_rid)
                if members is not None and not any(m in self._states for m in members):
                    del self._groups[s.group_rid]
            for hook in self.release_hooks:
                hook(s)
            if not s.finished:
                self._send_abort(s.rid)
                s.fail(ABORTED_MESSAGE, 499)

    def abort(self, rid: Optional[str] = None, abort_all: bool = False) -> int:
        """Abort a request by its user rid (all its sequences) or a sequence rid; returns how many were running."""
        with self._lock:
            if abort_all:
                rids = list(self._states)
            elif rid in self._groups:
                rids = [r for r in self._groups[rid] if r in self._states]
            else:
                rids = [rid] if rid in self._states else []
        for r in rids:
            self._send_abort(r)
        return len(rids)

    def end_all(self, message: str, status: int = 503) -> int:
        """End every unfinished sequence now (shutdown): the scheduler frees them, their consumers get a clean
        end after what is pending (see SeqState.end_now); returns how many."""
        states = self._unfinished()
        for state in states:
            self._send_abort(state.rid)
            state.end_now(message, status)
        return len(states)

    def fail_all(self, message: str, status: int) -> None:
        """Fail every unfinished sequence (the scheduler is gone: nothing more will arrive)."""
        for state in self._unfinished():
            state.fail(message, status)

    def _unfinished(self) -> list[SeqState]:
        with self._lock:
            return [s for s, _ in self._states.values() if not s.finished]
