"""ForwardPlan: one forward as every tensor-parallel rank runs it, and its wire form (int64 tensors, no pickle).

Rank 0's scheduler decides what a step computes and where each token's KV goes (slots of the device pool,
which every rank allocates identically because only rank 0 allocates); the other ranks receive the plan
and run the same forward on their shard of the weights and of the pool:

    header  [kind, sequences, tokens, kv slots, logits rows]        one broadcast of HEADER_LEN int64
    payload [extend_lens | prefix_lens | ids | kv slots | rows]     one broadcast of their total length
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Optional

import torch

from kvstrata.model.parallel import RankFailure, TensorParallel

HEADER_LEN = 5
MAX_PLAN_VALUES = 1 << 28     # a header asking for more is corrupt: refuse it rather than allocate it


class PlanKind(IntEnum):
    """What the ranks do next."""

    FORWARD = 1   # run the plan's forward
    IDLE = 2      # nothing to run: rank 0 is alive (sent about once a second, so no rank times out idle)
    STOP = 3      # leave the loop and exit 0


@dataclass
class ForwardPlan:
    """Token ids `[T]` of the new tokens, per sequence its new and cached token counts and the pool slot of
    each of its tokens, and the rows (into the new tokens) whose logits are needed."""

    ids: torch.Tensor
    extend_lens: list[int]
    prefix_lens: list[int]
    kv_slots: list[torch.Tensor]
    logits_rows: torch.Tensor


def send_plan(tp: TensorParallel, kind: PlanKind, plan: Optional[ForwardPlan] = None) -> None:
    """Rank 0: broadcast `kind` (and the plan of a FORWARD) to the group."""
    if plan is None:
        tp.broadcast(torch.tensor([int(kind), 0, 0, 0, 0], dtype=torch.long))
        return
    kv = torch.cat(plan.kv_slots) if plan.kv_slots else torch.empty(0, dtype=torch.long)
    parts = [torch.tensor(plan.extend_lens, dtype=torch.long), torch.tensor(plan.prefix_lens, dtype=torch.long),
             plan.ids.long().cpu(), kv.long().cpu(), plan.logits_rows.long().cpu()]
    header = [int(kind), len(plan.extend_lens), parts[2].numel(), kv.numel(), parts[4].numel()]
    tp.broadcast(torch.tensor(header, dtype=torch.long))
    tp.broadcast(torch.cat(parts))


def receive_plan(tp: TensorParallel) -> tuple[PlanKind, Optional[ForwardPlan]]:
    """Ranks > 0: the next kind and, for a FORWARD, its plan (CPU tensors)."""
    header = tp.broadcast(torch.zeros(HEADER_LEN, dtype=torch.long)).tolist()
    kind, seqs, tokens, kv_total, rows = header
    if kind not in PlanKind.__members__.values() or min(header) < 0 or sum(header[1:]) > MAX_PLAN_VALUES:
        raise RankFailure(f"rank {tp.rank}: corrupt plan header {header}")
    if kind != PlanKind.FORWARD:
        return PlanKind(kind), None
    payload = tp.broadcast(torch.zeros(2 * seqs + tokens + kv_total + rows, dtype=torch.long))
    extend, prefix, ids, kv, logits_rows = payload.split([seqs, seqs, tokens, kv_total, rows])
    extend_lens, prefix_lens = extend.tolist(), prefix.tolist()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    if sum(extend_lens) != tokens or sum(seq_lens) != kv_total:
        raise RankFailure(f"rank {tp.rank}: inconsistent plan ({tokens} tokens, {kv_total} slots for "
                          f"sequences of {seq_lens})")
    return PlanKind.FORWARD, ForwardPlan(ids, extend_lens, prefix_lens, list(kv.split(seq_lens)), logits_rows)
