"""SchedulerLoop: drives a Scheduler from an inbox of messages, in a thread (Engine) or a process (server).

Transport-agnostic: `recv(block)` returns a list of incoming messages, `send(obj)` delivers outputs.
The model loop never waits on the frontend: it only blocks for input when it has nothing to compute.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvstrata.runtime.messages import (
    AbortReq,
    BatchOutput,
    ControlOut,
    ControlReq,
    ExpertDistributionReq,
    FlushCacheReq,
    GetLoadReq,
    GetStateReq,
    PrefetchReq,
    TokenizedGenerateReq,
)
from kvstrata.runtime.scheduler import Scheduler, error_output

logger = logging.getLogger(__name__)


class SchedulerLoop:
    """recv → handle → step → send, until `stop()` is called."""

    def __init__(self, scheduler: Scheduler, recv: Callable[[bool], list], send: Callable[[object], None],
                 beat: Callable[[], None] = lambda: None):
        self.scheduler = scheduler
        self.recv = recv
        self.send = send
        self.beat = beat          # called once per iteration (runtime/heartbeat.py: what /health reads)
        self.running = True

    def stop(self) -> None:
        """Ask the loop to exit after the current step."""
        self.running = False

    def run(self) -> None:
        """Run until stopped."""
        while self.running:
            self.run_once()

    def run_once(self) -> None:
        """Handle pending messages, then one scheduler step."""
        s = self.scheduler
        self.beat()
        messages = self.recv(not s.has_work())
        outputs = []
        for msg in messages:
            if isinstance(msg, TokenizedGenerateReq):
                try:
                    err = s.add_request(msg)
                except Exception as e:  # a request the checks missed must not take the server down
                    logger.exception("rejected request %s", msg.rid)
                    err = error_output(msg.rid, len(msg.input_ids), f"internal error: {e}", status=500)
                if err is not None:
                    outputs.append(err)
            elif isinstance(msg, AbortReq):
                outputs.extend(s.abort(msg.rid))
            elif isinstance(msg, PrefetchReq):
                s.prefetch(msg)
            elif isinstance(msg, ControlReq):
                reply = self._control(msg)
                reply.control_id = msg.control_id       # the asker matches its answer by this id
                self.send(reply)
            elif msg is None:
                self.running = False
                return
            else:
                logger.error("scheduler got an unknown message %r", type(msg).__name__)
        if s.has_work():
            outputs.extend(s.step())
        else:
            s.idle()
        if outputs:
            self.send(BatchOutput(outputs))

    def _control(self, msg: ControlReq) -> ControlOut:
        s = self.scheduler
        if isinstance(msg, FlushCacheReq):
            return s.flush_cache()
        if isinstance(msg, GetStateReq):
            return ControlOut("state", True, "", s.get_state(msg.full))
        if isinstance(msg, GetLoadReq):
            return ControlOut("load", True, "", s.get_load())
        if isinstance(msg, ExpertDistributionReq):
            return s.expert_distribution(msg.action)
        return ControlOut(type(msg).__name__, False, f"unknown control request {type(msg).__name__}")
