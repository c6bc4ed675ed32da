"""ForwardPlan: one step as every tensor-parallel rank runs it, and its wire form (int64 tensors, no pickle).

Rank 0's scheduler decides what a step computes, where each token's KV goes (slots of the device pool,
which every rank has alike because only rank 0 allocates) and which pages its cache copies between the
device and host pools; the other ranks receive the plan and do the same on their shard of the weights
and of the pools:

    header  [kind, sequences, tokens, kv slots, logits rows, copies, copy values]    HEADER_LEN int64
    payload [extend_lens | prefix_lens | ids | kv slots | rows |                      one broadcast of their
             per copy: kind, len(a), len(b) | per copy: a, b]                         total length (if any)

    a copy      a: device pages                  b: host pages    (PageCopy: BACKUP, LOAD_BACK)
    a shard op  a: op id, its keys (4 words each) b: host pages   (ShardOp: L3 and L2-snapshot steps)

Copies travel in the order rank 0's cache submitted them (cache_controller.CopyJournal, shards.RankLink),
and a rank applies them before the plan's forward. That order is enough: rank 0 frees or overwrites a
copy's source only after its acknowledgement, which comes after the submit and so after the plan that
carries it, and a load-back is submitted while its step is scheduled, so it travels with that step's
forward. (A rank's own L3 writes run in the background: it lets none of its pages be overwritten before
its write of them is done, runtime/rank_cache.py.) The ops that need an answer (ANSWERED) travel only in
an AGREE plan, which ends with an all-reduce (min) of the answers, in op order.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple, Union

import numpy as np
import torch

from kvstrata.model.parallel import RankFailure, TensorParallel

HEADER_LEN = 7
MAX_PLAN_VALUES = 1 << 28     # a header asking for more is corrupt: refuse it rather than allocate it
KEY_WORDS = 4                 # a page key (SHA-256, 64 hex digits) as int64 words


class PlanKind(IntEnum):
    """What the ranks do next."""

    FORWARD = 1   # apply the copies, run the plan's forward
    IDLE = 2      # apply the copies, then a round trip (about once a second: a dead or hung rank shows)
    STOP = 3      # leave the loop and exit 0
    REPORT = 4    # all-gather every rank's PlanLedger (rank 0's /server_info)
    HANDOFF = 5   # a PD handoff's call: its request, every rank's answer gathered (rank_call.py)
    AGREE = 6     # apply the copies, then all-reduce (min) the answers of the ANSWERED ones


class CopyKind(IntEnum):
    """A page copy between a rank's device and host pools, or a step of its L3 or L2 snapshot shard."""

    BACKUP = 1             # device -> host
    LOAD_BACK = 2          # host -> device
    STORAGE_BACKUP = 3     # host pages -> this rank's L3 objects of the keys (in the background)
    STORAGE_PREFETCH = 4   # this rank's L3 objects -> host pages (in the background)
    PREFETCH_DONE = 5      # answer: the leading groups that prefetch read and verified
    SNAPSHOT_SAVE = 6      # write this rank's L2 snapshot of the host pages; answer 1 if it did
    SNAPSHOT_LOAD = 7      # restore this rank's share of the host pages; answer 1 if every page verified


ANSWERED = frozenset({CopyKind.PREFETCH_DONE, CopyKind.SNAPSHOT_SAVE, CopyKind.SNAPSHOT_LOAD})


class PageCopy(NamedTuple):
    """`device_pages[i]` <-> `host_pages[i]` (long tensors of page ids)."""

    kind: CopyKind
    device_pages: torch.Tensor
    host_pages: torch.Tensor


class ShardOp(NamedTuple):
    """A step of every rank's own L3 objects or L2 snapshot: rank 0's StorageIO `op_id` (-1: a snapshot step),
    the page keys, the host pages (a long tensor) they are written from or read into."""

    kind: CopyKind
    op_id: int
    keys: list[str]
    host_pages: torch.Tensor

    def head(self) -> torch.Tensor:
        """op id and keys as the int64 words of the wire."""
        words = torch.from_numpy(np.frombuffer(b"".join(bytes.fromhex(k) for k in self.keys), dtype="<i8").copy())
        return torch.cat([torch.tensor([self.op_id], dtype=torch.long), words.long()])

    @classmethod
    def from_wire(cls, kind: CopyKind, head: torch.Tensor, host_pages: torch.Tensor) -> ShardOp:
        """The op a head (op id, key words) and its host pages describe."""
        raw = head[1:].numpy().astype("<i8").tobytes()
        keys = [raw[i:i + 8 * KEY_WORDS].hex() for i in range(0, len(raw), 8 * KEY_WORDS)]
        return cls(kind, int(head[0]), keys, host_pages)


Copy = Union[PageCopy, ShardOp]


@dataclass
class ForwardPlan:
    """Token ids `[T]` of the new tokens, per sequence its new and cached token counts and the pool slot of
    each of its tokens, and the rows (into the new tokens) whose logits are needed; `copies` to apply first."""

    ids: torch.Tensor
    extend_lens: list[int]
    prefix_lens: list[int]
    kv_slots: list[torch.Tensor]
    logits_rows: torch.Tensor
    copies: list[Copy] = field(default_factory=list)


@dataclass
class PlanLedger:
    """What a rank has executed: plans, copies (and shard ops), their page and key values, and a CRC-32 of
    every plan's bytes in order. Equal on every rank when none diverged (rank 0 counts what it sends, the
    others what they receive)."""

    plans: int = 0
    copies: int = 0
    pages: int = 0      # the copies' values: page ids (and shard ops' key words)
    digest: int = 0

    def add(self, header: torch.Tensor, payload: torch.Tensor | None) -> None:
        """Count one plan (its header and payload as they went over the wire)."""
        self.plans += 1
        self.copies += int(header[5])
        self.pages += int(header[6])
        self.digest = zlib.crc32(header.numpy().tobytes(), self.digest)
        if payload is not None:
            self.digest = zlib.crc32(payload.numpy().tobytes(), self.digest)

    def as_list(self) -> list[int]:
        """[plans, copies, pages, digest]."""
        return [self.plans, self.copies, self.pages, self.digest]


def gather_ledgers(tp: TensorParallel, ledger: PlanLedger, state: list[int]) -> list[list[int]]:
    """Every rank's ledger followed by its cache `state` (rank_cache.STATE_KEYS; rank 0: zeros), in rank order
    (a collective: rank 0 sends REPORT first)."""
    return tp.all_gather(torch.tensor([ledger.as_list() + state], dtype=torch.long)).view(tp.size, -1).tolist()


EMPTY_PLAN = ForwardPlan(torch.empty(0, dtype=torch.long), [], [], [], torch.empty(0, dtype=torch.long))


def send_plan(tp: TensorParallel, kind: PlanKind, plan: ForwardPlan = EMPTY_PLAN,
              ledger: PlanLedger | None = None) -> None:
    """Rank 0: broadcast `kind` and its plan (a FORWARD's step, or only copies) to the group; count it in `ledger`."""
    long = torch.long
    kv = torch.cat(plan.kv_slots) if plan.kv_slots else torch.empty(0, dtype=long)
    halves = [(c.head() if isinstance(c, ShardOp) else c.device_pages.long().cpu(), c.host_pages.long().cpu())
              for c in plan.copies]
    copy_sizes = [v for c, (a, b) in zip(plan.copies, halves) for v in (int(c.kind), a.numel(), b.numel())]
    parts = [torch.tensor(plan.extend_lens, dtype=long), torch.tensor(plan.prefix_lens, dtype=long),
             plan.ids.long().cpu(), kv.long().cpu(), plan.logits_rows.long().cpu(), torch.tensor(copy_sizes, dtype=long),
             *(t for pair in halves for t in pair)]
    header = [int(kind), len(plan.extend_lens), parts[2].numel(), kv.numel(), parts[4].numel(), len(plan.copies),
              sum(a.numel() + b.numel() for a, b in halves)]
    header_t = tp.broadcast(torch.tensor(header, dtype=long))
    payload = tp.broadcast(torch.cat(parts)) if sum(header[1:]) else None
    if ledger is not None and kind != PlanKind.REPORT:
        ledger.add(header_t, payload)


def receive_plan(tp: TensorParallel, ledger: PlanLedger | None = None) -> tuple[PlanKind, ForwardPlan]:
    """Ranks > 0: the next kind and its plan (CPU tensors), counted in `ledger`."""
    header_t = tp.broadcast(torch.zeros(HEADER_LEN, dtype=torch.long))
    header = header_t.tolist()
    kind, seqs, tokens, kv_total, rows, copies, copied = header
    if kind not in PlanKind.__members__.values() or min(header) < 0 or sum(header[1:]) > MAX_PLAN_VALUES:
        raise RankFailure(f"rank {tp.rank}: corrupt plan header {header}")
    if not sum(header[1:]):
        if ledger is not None and kind != PlanKind.REPORT:
            ledger.add(header_t, None)
        return PlanKind(kind), EMPTY_PLAN
    sizes = [seqs, seqs, tokens, kv_total, rows, 3 * copies, copied]
    payload = tp.broadcast(torch.zeros(sum(sizes), dtype=torch.long))
    if ledger is not None:
        ledger.add(header_t, payload)
    extend, prefix, ids, kv, logits_rows, copy_sizes, copy_values = payload.split(sizes)
    extend_lens, prefix_lens = extend.tolist(), prefix.tolist()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    plan_copies = _copies(tp.rank, PlanKind(kind), copy_sizes.view(-1, 3).tolist(), copy_values)
    if sum(extend_lens) != tokens or sum(seq_lens) != kv_total:
        raise RankFailure(f"rank {tp.rank}: inconsistent plan ({tokens} tokens, {kv_total} slots for sequences "
                          f"of {seq_lens})")
    return PlanKind(kind), ForwardPlan(ids, extend_lens, prefix_lens, list(kv.split(seq_lens)), logits_rows,
                                       plan_copies)


def _copies(rank: int, kind: PlanKind, sizes: list[list[int]], values: torch.Tensor) -> list[Copy]:
    """The copies of a received plan from their [kind, len(a), len(b)] triples and values (RankFailure: corrupt)."""
    kinds = set(CopyKind.__members__.values())
    asks = sum(k in ANSWERED for k, _, _ in sizes)
    if (any(k not in kinds or a < 0 or b < 0 for k, a, b in sizes) or sum(a + b for _, a, b in sizes) != values.numel()
            or (kind == PlanKind.AGREE) != (asks > 0)):     # answers are asked for in AGREE plans, and only there
        raise RankFailure(f"rank {rank}: inconsistent copies {sizes} in a {kind.name} plan of {values.numel()} values")
    copies: list[Copy] = []
    parts = values.split([n for _, a, b in sizes for n in (a, b)])
    for i, (k, a, b) in enumerate(sizes):
        head, host_pages = parts[2 * i], parts[2 * i + 1]
        if k in (CopyKind.BACKUP, CopyKind.LOAD_BACK):
            if a != b:
                raise RankFailure(f"rank {rank}: a copy of {a} device pages to {b} host pages")
            copies.append(PageCopy(CopyKind(k), head, host_pages))
        elif a < 1 or (a - 1) % KEY_WORDS:
            raise RankFailure(f"rank {rank}: a shard op with a head of {a} values")
        else:
            copies.append(ShardOp.from_wire(CopyKind(k), head, host_pages))
    return copies
