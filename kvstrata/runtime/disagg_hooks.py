"""The scheduler's side of PD disaggregation: which handoff a mode gets, and what a handoff may do.

The scheduler calls its handoff (kvstrata/disagg) from a few places: on arrival of a bootstrapped request,
once per step (`poll`), after a prefill's first token (`hold`), on abort, in integrity checks. The handoff
acts on the scheduler only through a SchedulerPort, so the scheduler's internals stay its own.
"""

from __future__ import annotations

from typing import Optional

from kvstrata.runtime.messages import BootstrapInfo, ReqOutput
from kvstrata.runtime.req import Req, ReqState


class SchedulerPort:
    """The operations a handoff performs on its scheduler."""

    def __init__(self, scheduler):
        self._s = scheduler
        self.args = scheduler.args
        self.runner = scheduler.runner
        self.cache = scheduler.cache

    @property
    def waiting(self) -> list[Req]:
        """The scheduler's waiting queue."""
        return self._s.waiting

    @property
    def running(self) -> list[Req]:
        """The scheduler's running list."""
        return self._s.running

    def error_for(self, req: Req, message: str, status: int = 400) -> ReqOutput:
        """A final error output for req."""
        from kvstrata.runtime.scheduler import error_output

        return error_output(req.rid, len(req.prompt_ids), message, status)

    def output_for(self, req: Req) -> ReqOutput:
        """req's output since its last one."""
        return self._s._output(req)

    def decode_headroom_pages(self) -> int:
        """Pages the running requests are expected to need for their remaining tokens."""
        return self._s._decode_headroom_pages()

    def start_decoding(self, req: Req, token: int, logprob: Optional[float], top: list) -> list[ReqOutput]:
        """req's prompt KV is in its slots: give it its first token and let it decode (or finish)."""
        s = self._s
        s.metrics["prompt_tokens"] += len(req.prompt_ids)
        s.metrics["cached_tokens"] += req.cached_tokens
        req.admitted_at_step = s.step_count
        req.state = ReqState.RUNNING
        s.running.append(req)
        s.accept_token(req, token, logprob if req.return_logprob else None, top)
        if req.finished:
            s._finish(req)
            return [s._output(req)]
        s.cache.commit(req)            # its prompt is shareable at once, as after a local prefill
        return [s._output(req)] if req.stream else []

    def finish_held(self, req: Req) -> ReqOutput:
        """A held prefill request is done: free its side, return its final output."""
        s = self._s
        s.cache.release(req, cache=True)
        req.state = ReqState.FINISHED
        s.metrics["finished_requests"] += 1
        return s._output(req)

    def drop_queued(self, req: Req) -> None:
        """Take req out of the waiting queue or running list and free what it holds (idempotent)."""
        for queue in (self._s.waiting, self._s.running):
            if req in queue:
                queue.remove(req)
        self.cache.release(req, cache=True)


def create_handoff(scheduler):
    """The handoff --disaggregation-mode asks for (None when null)."""
    mode = scheduler.args.disaggregation_mode
    if mode == "null":
        return None
    port = SchedulerPort(scheduler)
    if mode == "prefill":
        from kvstrata.disagg.prefill import PrefillHandoff

        return PrefillHandoff(port)
    from kvstrata.disagg.decode import DecodeHandoff

    return DecodeHandoff(port)


def add_bootstrapped(scheduler, req: Req, info: BootstrapInfo) -> Optional[ReqOutput]:
    """Route a request that carries bootstrap fields to the handoff (an error when not in PD mode)."""
    if scheduler.handoff is None:
        return SchedulerPort(scheduler).error_for(
            req, "bootstrap_room was given but this server runs with --disaggregation-mode null")
    return scheduler.handoff.add(req, info)
