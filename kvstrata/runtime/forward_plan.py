"""ForwardPlan: one step as every tensor-parallel rank runs it, and its wire form (int64 tensors, no pickle).

Rank 0's scheduler decides what a step computes, where each token's KV goes (slots of the device pool,
which every rank has alike because only rank 0 allocates) and which pages its cache copies between the
device and host pools; the other ranks receive the plan and do the same on their shard of the weights
and of the pools:

    header  [kind, sequences, tokens, kv slots, logits rows, copies, copied pages]   HEADER_LEN int64
    payload [extend_lens | prefix_lens | ids | kv slots | rows |                      one broadcast of their
             per copy: kind, pages | device pages | host pages]                       total length (if any)

Copies travel in the order rank 0's cache submitted them (cache_controller.CopyJournal), and a rank
applies them before the plan's forward. That order is enough: rank 0 frees or overwrites a copy's source
only after its acknowledgement, which comes after the submit and so after the plan that carries it, and a
load-back is submitted while its step is scheduled, so it travels with that step's forward.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

import torch

from kvstrata.model.parallel import RankFailure, TensorParallel

HEADER_LEN = 7
MAX_PLAN_VALUES = 1 << 28     # a header asking for more is corrupt: refuse it rather than allocate it


class PlanKind(IntEnum):
    """What the ranks do next."""

    FORWARD = 1   # apply the copies, run the plan's forward
    IDLE = 2      # apply the copies, then a round trip (about once a second: a dead or hung rank shows)
    STOP = 3      # leave the loop and exit 0
    REPORT = 4    # all-gather every rank's PlanLedger (rank 0's /server_info)
    HANDOFF = 5   # a PD handoff's call: its request, every rank's answer gathered (rank_call.py)


class CopyKind(IntEnum):
    """A page copy between a rank's device and host pools."""

    BACKUP = 1      # device -> host
    LOAD_BACK = 2   # host -> device


class PageCopy(NamedTuple):
    """`device_pages[i]` <-> `host_pages[i]` (long tensors of page ids)."""

    kind: CopyKind
    device_pages: torch.Tensor
    host_pages: torch.Tensor


@dataclass
class ForwardPlan:
    """Token ids `[T]` of the new tokens, per sequence its new and cached token counts and the pool slot of
    each of its tokens, and the rows (into the new tokens) whose logits are needed; `copies` to apply first."""

    ids: torch.Tensor
    extend_lens: list[int]
    prefix_lens: list[int]
    kv_slots: list[torch.Tensor]
    logits_rows: torch.Tensor
    copies: list[PageCopy] = field(default_factory=list)


@dataclass
class PlanLedger:
    """What a rank has executed: plans, page copies, pages copied, and a CRC-32 of every plan's bytes in order.
    Equal on every rank when none diverged (rank 0 counts what it sends, the others what they receive)."""

    plans: int = 0
    copies: int = 0
    pages: int = 0
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


def gather_ledgers(tp: TensorParallel, ledger: PlanLedger) -> list[list[int]]:
    """Every rank's ledger, in rank order (a collective: rank 0 sends REPORT first)."""
    return tp.all_gather(torch.tensor([ledger.as_list()], dtype=torch.long)).view(tp.size, -1).tolist()


EMPTY_PLAN = ForwardPlan(torch.empty(0, dtype=torch.long), [], [], [], torch.empty(0, dtype=torch.long))


def send_plan(tp: TensorParallel, kind: PlanKind, plan: ForwardPlan = EMPTY_PLAN,
              ledger: PlanLedger | None = None) -> None:
    """Rank 0: broadcast `kind` and its plan (a FORWARD's step, or only copies) to the group; count it in `ledger`."""
    long = torch.long
    kv = torch.cat(plan.kv_slots) if plan.kv_slots else torch.empty(0, dtype=long)
    copy_sizes = [v for c in plan.copies for v in (int(c.kind), c.host_pages.numel())]
    parts = [torch.tensor(plan.extend_lens, dtype=long), torch.tensor(plan.prefix_lens, dtype=long),
             plan.ids.long().cpu(), kv.long().cpu(), plan.logits_rows.long().cpu(), torch.tensor(copy_sizes, dtype=long),
             *(c.device_pages.long().cpu() for c in plan.copies), *(c.host_pages.long().cpu() for c in plan.copies)]
    header = [int(kind), len(plan.extend_lens), parts[2].numel(), kv.numel(), parts[4].numel(), len(plan.copies),
              sum(c.host_pages.numel() for c in plan.copies)]
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
    sizes = [seqs, seqs, tokens, kv_total, rows, 2 * copies, copied, copied]
    payload = tp.broadcast(torch.zeros(sum(sizes), dtype=torch.long))
    if ledger is not None:
        ledger.add(header_t, payload)
    extend, prefix, ids, kv, logits_rows, copy_sizes, device_pages, host_pages = payload.split(sizes)
    extend_lens, prefix_lens = extend.tolist(), prefix.tolist()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    copy_kinds, copy_pages = copy_sizes[0::2].tolist(), copy_sizes[1::2].tolist()
    if (sum(extend_lens) != tokens or sum(seq_lens) != kv_total or sum(copy_pages) != copied
            or not set(copy_kinds) <= set(CopyKind.__members__.values())):
        raise RankFailure(f"rank {tp.rank}: inconsistent plan ({tokens} tokens, {kv_total} slots for sequences "
                          f"of {seq_lens}; copies {copy_kinds} of {copy_pages} pages, {copied} in all)")
    plan_copies = [PageCopy(CopyKind(k), d, h) for k, d, h in
                   zip(copy_kinds, device_pages.split(copy_pages), host_pages.split(copy_pages))]
    return PlanKind(kind), ForwardPlan(ids, extend_lens, prefix_lens, list(kv.split(seq_lens)), logits_rows,
                                       plan_copies)
