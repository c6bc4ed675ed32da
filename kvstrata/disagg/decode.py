"""DecodeHandoff: the decode server's side of the PD handshake, driven by its scheduler once per step.

A request with bootstrap fields never enters the scheduler's waiting queue. It waits in the bootstrap
queue until the pool has room, then it is admitted (slot-table row + its own cached prefix, locked) and
gets slots for the rest of its prompt; those slots go to the prefill in a KVTransferRequest. When the
KVTransferDone arrives, the slots hold the prompt's KV: the request joins `running` with the first token
and decodes from there. On a failure, a timeout or an abort it is released like any request (its pages
go back to the free list; the locked prefix is unlocked).

Under --tp-size N each rank's pool holds its own KV shard: the request names every rank's pool (asked once
at start, shard.py), prefill rank r writes into decode rank r, and the prefill answers KVTransferDone only
once all N writes are done. Slots are rank 0's to allocate and free, for every rank at once.

Who frees: this side frees its reserved slots; it tells the prefill (KVTransferAbort) when it gives up.
A request that timed out after its KVTransferRequest went out fails at once, but its pages stay
quarantined for QUARANTINE_S more (or until the prefill answers): a write the prefill started just before
the deadline must not land in pages that another request already owns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from kvstrata.disagg.channel import BootstrapChannel
from kvstrata.disagg.common import HandoffStats, check_disagg_request, endpoint_state, prompt_digest
from kvstrata.disagg.messages import KVTransferAbort, KVTransferDone, KVTransferFailed, KVTransferRequest
from kvstrata.disagg.shard import ShardGroup, start_rank_endpoint
from kvstrata.disagg.transfer import TransferBackend, slots_list
from kvstrata.runtime.handoff import HandoffHost
from kvstrata.runtime.messages import BootstrapInfo, ReqOutput
from kvstrata.runtime.req import Req, ReqState

logger = logging.getLogger(__name__)

QUARANTINE_S = 2.0


@dataclass
class _Waiting:
    req: Req
    info: BootstrapInfo
    arrived_at: float
    deadline: float          # monotonic
    sent_at: float = 0.0     # when the KVTransferRequest went out (0: still in the bootstrap queue)


class DecodeHandoff:
    """Bootstrap queue, transfers in flight, and their completion for one decode scheduler."""

    mode = "decode"
    rank_side = staticmethod(start_rank_endpoint)     # ranks > 0: their shard's endpoint (HandoffFactory)

    def __init__(self, scheduler: HandoffHost, transfer: Optional[TransferBackend] = None):
        args = scheduler.args
        self.sched = scheduler
        self.timeout_s = args.disaggregation_bootstrap_timeout
        self.shards = ShardGroup(scheduler, transfer)
        self.targets = self.shards.targets()       # every rank's pool, rank order
        self.channel = BootstrapChannel(args.disaggregation_host(), secret=args.disaggregation_secret)
        self.queue: list[_Waiting] = []            # waiting for slots (the bootstrap queue)
        self.inflight: dict[int, _Waiting] = {}    # room → slots reserved, KVTransferRequest sent
        self.quarantine: dict[int, tuple[float, Req]] = {}   # room → (release at, request): timed out
        self.stats = HandoffStats(self.mode)

    # ------------------------------------------------------------------ scheduler hooks
    def add(self, req: Req, info: BootstrapInfo) -> Optional[ReqOutput]:
        """Take a bootstrapped request; an error output if it cannot be served."""
        problem = check_disagg_request(req)
        if problem is None and self._known(info.room):
            problem = f"bootstrap_room {info.room} is already in use on this decode server"
        if problem is not None:
            return self.sched.error_for(req, problem)
        now = time.monotonic()
        self.queue.append(_Waiting(req, info, now, now + self.timeout_s))
        return None

    def poll(self) -> list[ReqOutput]:
        """Apply the prefill's answers, fail what timed out, start what fits. Outputs to send."""
        outputs: list[ReqOutput] = []
        for msg in self.channel.receive():
            if not isinstance(msg, (KVTransferDone, KVTransferFailed)):
                continue                 # a decode-to-prefill message: not for this side
            room = msg.room
            if room in self.quarantine:          # the prefill is done with those pages
                self._unquarantine(room)
            w = self.inflight.pop(room, None)
            if w is None:
                continue                 # a late answer for a request already given up
            problem = self._bad_tokens(msg) if isinstance(msg, KVTransferDone) else None
            if problem is not None:
                outputs.append(self._fail(w, problem, 502))
            elif isinstance(msg, KVTransferDone):
                outputs.extend(self._activate(w, msg))
            else:
                outputs.append(self._fail(w, f"prefill failed: {msg.reason}", msg.status))
        outputs.extend(self._expire())
        now = time.monotonic()
        for room in [r for r, (until, _) in self.quarantine.items() if now >= until]:
            self._unquarantine(room)
        self._start_transfers()
        return outputs

    def abort(self, rid: str) -> list[ReqOutput]:
        """Client abort: free the request if it is still waiting for its KV."""
        outs = []
        for w in [w for w in self.queue + list(self.inflight.values()) if w.req.rid == rid]:
            self._drop(w, "aborted by client")
            w.req.finish_reason = {"type": "abort", "message": "aborted by client"}
            outs.append(self.sched.output_for(w.req))
        return outs

    def hold(self, req: Req) -> bool:
        """Decode requests finish like any other."""
        return False

    def held(self) -> list[Req]:
        """Requests that hold a slot-table row and pages but are not running (integrity checks)."""
        return [w.req for w in self.inflight.values()] + [req for _, req in self.quarantine.values()]

    def has_work(self) -> bool:
        """Whether anything waits on this side."""
        return bool(self.queue or self.inflight or self.quarantine) or self.channel.pending()

    def state(self) -> dict:
        """Counters and queue lengths for /server_info."""
        return {**self.stats.state(bootstrap_queue=len(self.queue), transfers_in_flight=len(self.inflight),
                                   quarantined=len(self.quarantine)),
                **endpoint_state(self.channel, self.shards.session_id)}

    def close(self) -> None:
        """Close the sockets."""
        self.channel.close()

    # ------------------------------------------------------------------ internals
    def _known(self, room: int) -> bool:
        return room in self.inflight or room in self.quarantine or any(w.info.room == room for w in self.queue)

    def _start_transfers(self) -> None:
        cache = self.sched.cache
        while self.queue:
            w = self.queue[0]
            req = w.req
            n = len(req.prompt_ids)
            if not cache.admit(req):
                return
            need = cache.pages_for(req, n - req.kv_len) + self.sched.decode_headroom_pages()
            if need > cache.available_pages() or not cache.reserve(req, n - req.kv_len):
                cache.release(req, cache=False)
                return                  # FCFS: the head waits for room, the rest behind it
            self.queue.pop(0)
            w.sent_at = time.monotonic()
            self.inflight[w.info.room] = w
            self.channel.send(w.info.address, KVTransferRequest(
                room=w.info.room, reply_to=self.channel.address, layout=self.shards.layout, shards=self.targets,
                prompt_len=n,
                prompt_digest=prompt_digest(req.prompt_ids), start_token=req.kv_len,
                dst_slots=slots_list(cache.slots_of(req, req.kv_len, n)),
                deadline=time.time() + (w.deadline - w.sent_at)))

    def _bad_tokens(self, done: KVTransferDone) -> Optional[str]:
        vocab = self.sched.runner.vocab_size
        ids = [done.first_token, *(tid for _, tid in done.first_top_logprobs)]
        if any(tid >= vocab for tid in ids):
            return f"the prefill sent a token id outside this model's vocabulary ({vocab})"
        return None

    def _activate(self, w: _Waiting, done: KVTransferDone) -> list[ReqOutput]:
        req, sched = w.req, self.sched
        self.stats.ok(req.rid, w.info.room, done.transferred_bytes, done.transfer_seconds,
                      w.sent_at - w.arrived_at, decode_reused_tokens=req.kv_len)
        req.cached_tokens = done.prefill_cached_tokens     # the prompt tokens nobody had to compute
        sched.cache.advance(req, len(req.prompt_ids))
        return sched.start_decoding(req, done.first_token, done.first_logprob, done.first_top_logprobs)

    def _expire(self) -> list[ReqOutput]:
        now = time.monotonic()
        outs = []
        for w in [w for w in self.queue + list(self.inflight.values()) if now >= w.deadline]:
            where = "slots on this decode server" if w.sent_at == 0 else f"the prefill at {w.info.address}"
            outs.append(self._fail(w, f"timed out after {self.timeout_s:g} s waiting for {where}", 504,
                                   timeout=True))
        return outs

    def _fail(self, w: _Waiting, reason: str, status: int, timeout: bool = False) -> ReqOutput:
        self.stats.failed(w.req.rid, w.info.room, reason, timeout)
        self._drop(w, reason, quarantine=timeout)
        return self.sched.error_for(w.req, reason, status)

    def _drop(self, w: _Waiting, reason: str, quarantine: bool = False) -> None:
        """Forget a request and free what it holds; tell the prefill if it was asked for KV."""
        if w in self.queue:
            self.queue.remove(w)
        w.req.state = ReqState.FINISHED
        if self.inflight.pop(w.info.room, None) is not None:
            self.channel.send(w.info.address, KVTransferAbort(w.info.room, reason))
            if quarantine:
                self.quarantine[w.info.room] = (time.monotonic() + QUARANTINE_S, w.req)
                return
        self.sched.cache.release(w.req, cache=False)

    def _unquarantine(self, room: int) -> None:
        _, req = self.quarantine.pop(room)
        self.sched.cache.release(req, cache=False)
