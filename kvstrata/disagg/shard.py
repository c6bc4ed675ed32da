"""The KV shards of a PD server: each tensor-parallel rank's transfer endpoint, and its writes.

Each rank holds its own shard of the KV pool (its KV heads), in its own process, so each rank runs its own
transfer engine over its own pool (a ShardEndpoint) and writes its own shard: prefill rank r into decode
rank r (the same --tp-size on both sides; the handshake refuses others, prefill.py). Rank 0's handoff reaches
every rank through HandoffHost.call_ranks, with typed calls (msgspec, validated when decoded):

    call             answer          when
    EndpointQuery    ShardTarget     decode, at start: where each rank's pool is (sent with every request)
    ShardWrite       ShardWritten    prefill, per room: every rank writes its shard; the room succeeds only
                                     if every rank's write did (one failed rank fails it for all)

Slots are the same on every rank (rank 0 allocates for all of them), so a ShardWrite carries them once and
each rank picks its own target. At --tp-size 1 rank 0's endpoint is the only one and nothing is gathered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Optional, Union

import msgspec
from msgspec import Meta, Struct

from kvstrata.disagg.messages import MAX_TEXT, MAX_TP, Count, KVLayout, ShardTarget, Text, target_problem
from kvstrata.disagg.transfer import (
    TransferBackend,
    TransferError,
    create_transfer,
    plan_writes,
    pool_layout,
    pool_pointers,
    register_pool,
)
from kvstrata.platform import env

if TYPE_CHECKING:
    from kvstrata.args import ServerArgs
    from kvstrata.memory.device_pool import DeviceKVPool
    from kvstrata.runtime.handoff import HandoffHost

# Fault injection for tests and demos: seconds each rank's write sleeps before it starts.
FAULT_DELAY_ENV = "KVSTRATA_DISAGG_TRANSFER_DELAY_S"
# Fault injection for tests: the tensor-parallel rank whose every write fails.
FAULT_RANK_ENV = "KVSTRATA_DISAGG_FAIL_RANK"

Slots = Annotated[list[Count], Meta(max_length=1 << 22)]


class EndpointQuery(Struct, tag="endpoint"):
    """rank 0 → every rank: where is your KV shard (answered with a ShardTarget)?"""


class ShardWrite(Struct, tag="write"):
    """rank 0 → every rank: write your shard of src_slots into your peer rank's dst_slots."""

    shards: Annotated[list[ShardTarget], Meta(min_length=1, max_length=MAX_TP)]   # the peer's, rank order
    src_slots: Slots
    dst_slots: Slots


class ShardWritten(Struct, tag="written"):
    """A rank's write: done (bytes, seconds), or why not."""

    ok: bool
    nbytes: Annotated[int, Meta(ge=0)] = 0
    seconds: Annotated[float, Meta(ge=0)] = 0.0
    error: Text = ""


ShardCall = Union[EndpointQuery, ShardWrite]

_encoder = msgspec.msgpack.Encoder()
_calls = msgspec.msgpack.Decoder(ShardCall)
_targets = msgspec.msgpack.Decoder(ShardTarget)
_written = msgspec.msgpack.Decoder(ShardWritten)


def encode(msg: Union[ShardCall, ShardTarget, ShardWritten]) -> bytes:
    """The bytes of a call or an answer (msgpack)."""
    return _encoder.encode(msg)


class ShardEndpoint:
    """One rank's KV shard, registered with its transfer engine; answers rank 0's calls (a RankHandoff)."""

    def __init__(self, transfer: TransferBackend, pool: DeviceKVPool, rank: int, tp_size: int):
        self.transfer = transfer
        self.rank = rank
        register_pool(transfer, pool)
        self.layout = pool_layout(pool, tp_size)
        self.ptrs = pool_pointers(pool)
        self.delay_s = float(env(FAULT_DELAY_ENV, "0") or 0)
        self.fails = env(FAULT_RANK_ENV) == str(rank)

    def target(self) -> ShardTarget:
        """Where this rank's pool is, for a peer that writes into it."""
        return ShardTarget(self.transfer.session_id, *self.ptrs)

    def answer(self, request: bytes) -> bytes:
        """One call of rank 0's handoff, answered (a malformed call gets no bytes: its caller sees the failure)."""
        try:
            call = _calls.decode(request)
        except msgspec.DecodeError:
            return b""
        if isinstance(call, EndpointQuery):
            return encode(self.target())
        return encode(self.write(call))

    def write(self, call: ShardWrite) -> ShardWritten:
        """Write this rank's shard of the call's slots into its peer rank's pool (never raises)."""
        if len(call.shards) <= self.rank:
            return ShardWritten(False, error=f"no shard target for rank {self.rank} ({len(call.shards)} given)")
        target = call.shards[self.rank]
        problem = target_problem(target, self.layout.num_layers)
        if problem is None and len(call.src_slots) != len(call.dst_slots):
            problem = f"{len(call.src_slots)} source slots for {len(call.dst_slots)} destination slots"
        if problem is not None:
            return ShardWritten(False, error=problem)
        if self.delay_s:
            time.sleep(self.delay_s)
        start = time.perf_counter()
        try:
            if self.fails:
                raise TransferError(f"injected failure (${FAULT_RANK_ENV}={self.rank})")
            src, dst, lengths = plan_writes(call.src_slots, call.dst_slots, self.ptrs, (target.k_ptrs, target.v_ptrs),
                                            self.layout.slot_bytes)
            self.transfer.write(target.session_id, src, dst, lengths)
        except Exception as e:  # TransferError, or an engine error: this write failed, the rank serves on
            return ShardWritten(False, error=str(e)[:MAX_TEXT])
        return ShardWritten(True, sum(lengths), time.perf_counter() - start)


def start_rank_endpoint(args: ServerArgs, pool: DeviceKVPool, rank: int) -> ShardEndpoint:
    """A rank > 0's part of the handoff (HandoffFactory.rank_side): its own engine over its own pool."""
    transfer = create_transfer(args.disaggregation_transfer_backend, args.disaggregation_host(),
                               args.disaggregation_ib_device)
    return ShardEndpoint(transfer, pool, rank, args.tp_size)


@dataclass(frozen=True)
class ShardsWritten:
    """Every rank's completed write of one room."""

    nbytes: int              # all ranks together
    seconds: float           # the slowest rank's
    rank_bytes: list[int]    # rank order


class ShardGroup:
    """Rank 0's handoff over every rank's endpoint: the layout it advertises, targets, writes on all ranks."""

    def __init__(self, host: HandoffHost, transfer: Optional[TransferBackend] = None):
        """`transfer` replaces rank 0's engine named by --disaggregation-transfer-backend (unit tests)."""
        args = host.args
        transfer = transfer or create_transfer(args.disaggregation_transfer_backend, args.disaggregation_host(),
                                               args.disaggregation_ib_device)
        self.host = host
        self.local = ShardEndpoint(transfer, host.runner.pool, 0, args.tp_size)
        self.layout: KVLayout = self.local.layout
        self.session_id = transfer.session_id

    def targets(self) -> list[ShardTarget]:
        """Every rank's pool, in rank order (a call to every rank: at start, not per request)."""
        answers = self.host.call_ranks(encode(EndpointQuery()), self.local.answer)
        targets = []
        for rank, answer in enumerate(answers):
            try:
                targets.append(_targets.decode(answer))
            except msgspec.DecodeError as e:
                raise TransferError(f"rank {rank} did not name its KV shard's transfer endpoint: {e}") from None
        return targets

    def write(self, shards: list[ShardTarget], src_slots: list[int], dst_slots: list[int]) -> ShardsWritten:
        """Every rank writes its shard into its peer rank; TransferError naming each rank that failed."""
        answers = self.host.call_ranks(encode(ShardWrite(shards, src_slots, dst_slots)), self.local.answer)
        results, failed = [], []
        for rank, answer in enumerate(answers):
            try:
                result = _written.decode(answer)
            except msgspec.DecodeError:
                result = ShardWritten(False, error="no valid answer")
            results.append(result)
            if not result.ok:
                failed.append(f"rank {rank}: {result.error}")
        if failed:
            raise TransferError("; ".join(failed))
        return ShardsWritten(sum(r.nbytes for r in results), max(r.seconds for r in results),
                             [r.nbytes for r in results])
