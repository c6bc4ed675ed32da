"""PrefillHandoff: the prefill server's side of the PD handshake, driven by its scheduler once per step.

A bootstrapped request is prefilled like any other (its own radix cache and tiers serve what they hold)
but generates one token. Then it leaves `running` and is held here, its KV locked, until the decode
server's KVTransferRequest for its room is there (it may come first: it is kept until the request
arrives). A worker thread writes the KV of tokens [start_token, n) into the decode's slots through the
transfer engine; when it is done the decode gets KVTransferDone (the first token), this side's client
gets its one-token answer, and the request is released (its pages stay in the radix tree).

Under --tp-size N every rank writes its own KV shard into the decode's rank of the same index (shard.py),
and the room is done only when all N writes are; one failed rank fails the room (KVTransferFailed to the
decode, an error to the client, the pages freed once on rank 0, which allocates for every rank). Those
writes are one call to every rank, a collective: it runs on the scheduler thread between two steps (the
step waits for it), not on the worker thread, which must never run a collective beside the plans.

Who frees: this side frees its own pages, after the write finished or failed, never while it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from kvstrata.disagg.channel import BootstrapChannel
from kvstrata.disagg.common import HandoffStats, check_disagg_request, endpoint_state, prompt_digest
from kvstrata.disagg.messages import (
    MAX_TEXT,
    KVTransferAbort,
    KVTransferDone,
    KVTransferFailed,
    KVTransferRequest,
)
from kvstrata.disagg.shard import ShardGroup, ShardsWritten, start_rank_endpoint
from kvstrata.disagg.transfer import TransferBackend, TransferError, slots_list
from kvstrata.model.parallel import RankFailure
from kvstrata.runtime.handoff import HandoffHost
from kvstrata.runtime.messages import BootstrapInfo, ReqOutput
from kvstrata.runtime.req import Req, ReqState

logger = logging.getLogger(__name__)

# A router sends both halves of a request at once: a decode's room whose request has not arrived after this
# share of the timeout is unknown here, and the decode hears so before its own timeout fires.
UNKNOWN_ROOM_SHARE = 0.5


@dataclass
class _Room:
    room: int
    created_at: float                        # monotonic
    req: Optional[Req] = None                # None while only the decode's request has arrived
    dst: Optional[KVTransferRequest] = None  # None while only the client's request has arrived
    prefilled: bool = False                  # the request is held here (out of `running`)
    future: Optional[Future] = None          # the write in flight
    aborted: Optional[str] = None            # given up while the write ran: free once it ends


class PrefillHandoff:
    """Rooms, held requests and KV writes for one prefill scheduler."""

    mode = "prefill"
    rank_side = staticmethod(start_rank_endpoint)     # ranks > 0: their shard's endpoint (HandoffFactory)

    def __init__(self, scheduler: HandoffHost, transfer: Optional[TransferBackend] = None):
        args = scheduler.args
        self.sched = scheduler
        self.timeout_s = args.disaggregation_bootstrap_timeout
        self.shards = ShardGroup(scheduler, transfer)
        self.layout = self.shards.layout
        self.channel = BootstrapChannel(args.disaggregation_host(), args.disaggregation_bootstrap_port,
                                        args.disaggregation_secret)
        self.rooms: dict[int, _Room] = {}
        self.by_rid: dict[str, _Room] = {}
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        self.stats = HandoffStats(self.mode)

    # ------------------------------------------------------------------ scheduler hooks
    def add(self, req: Req, info: BootstrapInfo) -> Optional[ReqOutput]:
        """Queue a bootstrapped request for prefill (one token); an error output if it cannot be served."""
        problem = check_disagg_request(req)
        room = self.rooms.get(info.room)
        if problem is None and room is not None and room.req is not None:
            problem = f"bootstrap_room {info.room} is already in use on this prefill server"
        if problem is not None:
            return self.sched.error_for(req, problem)
        s = req.sampling
        req.sampling = dataclasses.replace(s, max_new_tokens=1, min_new_tokens=min(s.min_new_tokens, 1))
        room = room or _Room(info.room, time.monotonic())
        room.req = req
        self.rooms[info.room] = room
        self.by_rid[req.rid] = room
        self.sched.queue(req)
        return None

    def hold(self, req: Req) -> bool:
        """After the first token: keep req (and its KV) here instead of finishing it. False: not ours."""
        room = self.by_rid.get(req.rid)
        if room is None:
            return False
        self.sched.park(req)               # its prompt is shareable at once, as after any prefill
        room.prefilled = True
        return True

    def poll(self) -> list[ReqOutput]:
        """Take decode requests, start writes, finish the written, fail the expired. Outputs to send."""
        outputs: list[ReqOutput] = []
        for msg in self.channel.receive():
            if isinstance(msg, KVTransferRequest):
                outputs.extend(self._on_request(msg))
            elif isinstance(msg, KVTransferAbort) and msg.room in self.rooms:
                outputs.extend(self._give_up(self.rooms[msg.room], f"decode gave up: {msg.reason}", 503,
                                             notify=False))
        for room in list(self.rooms.values()):
            if room.future is not None and room.future.done():
                outputs.extend(self._written(room))
            elif room.future is None and room.prefilled and room.dst is not None:
                self._start_write(room)
        outputs.extend(self._expire())
        return outputs

    def abort(self, rid: str) -> list[ReqOutput]:
        """Client abort: free the request wherever it is (after the write in flight, if one is)."""
        room = self.by_rid.get(rid)
        if room is None:
            return []
        return self._give_up(room, "aborted by client", 499)

    def held(self) -> list[Req]:
        """Requests that hold KV here out of `running` (integrity checks)."""
        return [r.req for r in self.rooms.values() if r.prefilled]

    def has_work(self) -> bool:
        """Whether any room is open or a message waits."""
        return bool(self.rooms) or self.channel.pending()

    def state(self) -> dict:
        """Counters and queue lengths for /server_info."""
        rooms = list(self.rooms.values())
        return {**self.stats.state(
            rooms_open=len(rooms), waiting_for_decode=sum(r.prefilled and r.dst is None for r in rooms),
            waiting_for_client_request=sum(r.req is None for r in rooms),
            transfers_in_flight=sum(r.future is not None for r in rooms)),
            **endpoint_state(self.channel, self.shards.session_id)}

    def close(self) -> None:
        """Wait for the write in flight, then close the sockets."""
        self.writer.shutdown(wait=True)
        self.channel.close()

    # ------------------------------------------------------------------ internals
    def _on_request(self, msg: KVTransferRequest) -> list[ReqOutput]:
        room = self.rooms.get(msg.room)
        if room is not None and room.dst is not None:
            self.channel.send(msg.reply_to, KVTransferFailed(msg.room, f"bootstrap_room {msg.room} was already "
                                                             f"claimed by another decode request", 400))
            return []
        room = room or self.rooms.setdefault(msg.room, _Room(msg.room, time.monotonic()))
        room.dst = msg
        problem = self._mismatch(room)
        return self._give_up(room, problem, 400) if problem else []

    def _mismatch(self, room: _Room) -> Optional[str]:
        dst, req = room.dst, room.req
        mine, theirs = self.layout, dst.layout
        if (theirs.tp_size, theirs.num_kv_heads) != (mine.tp_size, mine.num_kv_heads):
            return (f"tensor-parallel KV layouts differ (--tp-size): prefill {mine.describe()}; decode "
                    f"{theirs.describe()}; start both with the same --tp-size (shards are not re-sharded)")
        if (theirs.dtype, theirs.scales_digest) != (mine.dtype, mine.scales_digest):
            return (f"KV cache dtypes differ (--kv-cache-dtype): prefill stores {mine.kv_name}, decode "
                    f"{theirs.kv_name}; start both with the same --kv-cache-dtype and checkpoint")
        if theirs != mine:
            return f"KV layouts differ: prefill {mine.describe()}; decode {theirs.describe()}"
        if req is not None and (dst.prompt_len != len(req.prompt_ids)
                                or dst.prompt_digest != prompt_digest(req.prompt_ids)):
            return "the prefill and decode servers tokenized the prompt differently"
        return None

    def _start_write(self, room: _Room) -> None:
        req, dst = room.req, room.dst
        problem = self._mismatch(room)
        if problem is None and time.time() >= dst.deadline:
            problem = "the decode server's deadline passed before the KV was ready"
        if problem is not None:
            self._give_up(room, problem, 400 if "differ" in problem else 504)
            return
        src = slots_list(self.sched.cache.slots_of(req, dst.start_token, dst.prompt_len))
        write = functools.partial(self.shards.write, dst.shards, src, dst.dst_slots)
        # One rank: in the background. Several: a collective, so here on the scheduler thread (module docstring).
        room.future = self.writer.submit(write) if self.layout.tp_size == 1 else _run_now(write)

    def _written(self, room: _Room) -> list[ReqOutput]:
        req, dst = room.req, room.dst
        room.future, fut = None, room.future
        try:
            written: ShardsWritten = fut.result()
        except Exception as e:  # TransferError, or a bad plan: either way this room is lost, not the server
            level = logging.WARNING if isinstance(e, TransferError) else logging.ERROR
            logger.log(level, "KV transfer of room %d failed: %s", room.room, e)
            return self._give_up(room, f"KV transfer failed: {e}", 503)
        if room.aborted:
            return self._give_up(room, room.aborted, 499)
        nbytes, seconds = written.nbytes, written.seconds
        self.stats.ok(req.rid, room.room, nbytes, seconds, time.monotonic() - room.created_at,
                      rank_bytes=written.rank_bytes)
        logprob = req.output_logprobs[0][0] if req.output_logprobs else None
        top = req.output_top_logprobs[0] if req.output_top_logprobs else []
        self.channel.send(dst.reply_to, KVTransferDone(
            room.room, req.output_ids[0], logprob, top, nbytes, seconds, prefill_cached_tokens=req.cached_tokens))
        if req.finish_reason is None:
            req.finish_reason = {"type": "length", "length": 1}
        self._forget(room)
        return [self.sched.finish_held(req)]

    def _expire(self) -> list[ReqOutput]:
        now = time.monotonic()
        outs = []
        for room in [r for r in self.rooms.values() if r.future is None]:
            waited = now - room.created_at
            if room.req is None and waited >= self.timeout_s * UNKNOWN_ROOM_SHARE:
                reason = f"bootstrap_room {room.room} is unknown to this prefill server"
                outs.extend(self._give_up(room, reason, 400))
            elif room.req is not None and waited >= self.timeout_s:
                what = "the decode server" if room.dst is None else "the prefill to finish"
                outs.extend(self._give_up(room, f"timed out after {self.timeout_s:g} s waiting for {what}",
                                          504, timeout=True))
        return outs

    def _give_up(self, room: _Room, reason: str, status: int, notify: bool = True,
                 timeout: bool = False) -> list[ReqOutput]:
        """End a room: tell the decode (if it asked), free the request; deferred while a write runs."""
        if room.future is not None:
            room.aborted = room.aborted or reason
            return []
        req = room.req
        self.stats.failed(req.rid if req else "", room.room, reason, timeout)
        if notify and room.dst is not None:
            self.channel.send(room.dst.reply_to, KVTransferFailed(room.room, reason[:MAX_TEXT], status))
        self._forget(room)
        if req is None:
            return []
        if room.prefilled:
            self.sched.cache.release(req, cache=True)
        else:
            self.sched.drop_queued(req)
        req.state = ReqState.FINISHED
        return [self.sched.error_for(req, reason, status)]

    def _forget(self, room: _Room) -> None:
        self.rooms.pop(room.room, None)
        if room.req is not None:
            self.by_rid.pop(room.req.rid, None)


def _run_now(work: Callable[[], ShardsWritten]) -> Future:
    """`work()` run here, as a finished Future (its result or its exception), like the worker thread's."""
    fut: Future = Future()
    try:
        fut.set_result(work())
    except RankFailure:     # the group broke: fatal to the server (ranks.py), not one room's failure
        raise
    except Exception as e:  # what the worker thread's Future would hold: _written reports it
        fut.set_exception(e)
    return fut
