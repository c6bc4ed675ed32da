"""Mixture-of-experts block (Qwen3-MoE, Qwen2-MoE, Mixtral): softmax top-k routing and fused experts.

    route:    probs = softmax(router(x)) in float32; the top k by a stable descending sort (ties: the lowest
              expert id wins, in every mode; torch.topk's tie order is unspecified); renormalized to sum
              to 1 when norm_topk_prob.
    group:    the T*k (token, rank) pairs sorted by expert id (stable: by token, then rank, within one);
              one gather of the rows.
    experts:  for each ACTIVE expert only, one product over its rows: down(silu(gate_up(rows))). A decode
              step of a few tokens reads only the selected experts' weights; a lone row skips the grouping
              (its k experts in rank order: the same products and sum, so the same bits).
    combine:  each token's k outputs weighted and summed rank by rank in float32 (rank 0 first), so a
              token's output never depends on which other tokens share its experts or in which order they
              arrived. On CPU a compiled kernel (csrc/moe_combine.cpp) reads the rows where the experts wrote
              them; the torch fallback scatters them back to (token, rank) order first. Same bits.

Weights are loaded into one stacked tensor per projection (`gate_up_proj` `[E, 2I, H]`, gate rows first as
in GatedMLP, and `down_proj` `[E, H, I]`), filled expert by expert. `bind()` then gives every expert a
`Linear` over its slice, so each expert product follows the dense path's rules unchanged (batch-invariant
mode, the compiled GEMV, oneDNN prepacking: layers.make_batch_invariant / use_decode_linear /
use_onednn_weights walk these Linears like any other). A GGUF file's quantized experts are bound the same
way, each Linear holding its expert's QuantizedWeight (Linear.set_quantized) instead of a float slice.

Under tensor parallelism (model/parallel.py) the experts are split one of two ways:

    inside each expert (--tp-size alone, SGLang's default): every rank holds every expert's slice of the
              intermediate features (gate|up rows, down columns). The combine is linear, so the rank's
              combined output (plus its slice of the shared expert's) is a partial sum: one all-reduce per
              layer (SparseMoeBlock). Deterministic mode: down is split by output features instead; each rank
              computes its activation slice of every grouped row, one all-gather makes them whole, each rank
              computes its output features of every row, a second all-gather makes them whole, and the
              combine runs on the same rows as one rank's: the same bits.
    whole experts (--ep-size N): each rank computes the rows routed to its experts (where each expert
              lives, and how a replicated expert's rows are shared: expert_location.py) and combines them; one
              all-reduce per layer adds the ranks' combined outputs. Deterministic mode: an all-reduce of the
              (token, k) rows fills each from the one rank that computed it, then one rank's combine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from kvstrata.model.config import MoeConfig
from kvstrata.model.expert_location import ExpertDispatch, ExpertDistributionRecorder
from kvstrata.model.layers import GatedMLP, Linear, SiluAndMul, use_decode_linear
from kvstrata.model.parallel import ShardLayout, TensorParallel, row_parallel_linear

if TYPE_CHECKING:
    from kvstrata.model.paged_kernels import DecodeLinear
    from kvstrata.model.quant.base import QuantizedWeight


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` float32, expert ids `[T, k]` int64) of the k most probable experts per row, best first.

    A stable sort instead of torch.topk: equal probabilities are ranked by expert id (lowest first), so a
    tie at the k-th place is broken the same way on every device, thread count and batch.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids


def rank0_routing(tp: TensorParallel, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's (weights, ids) of `route` on every rank: one int64 broadcast of the ids and the weights' float32
    bits side by side (one collective per MoE layer instead of two)."""
    top_k = ids.shape[1]
    packed = tp.broadcast(torch.cat([ids, weights.view(torch.int32).long()], dim=1), plan=False)
    return packed[:, top_k:].to(torch.int32).view(torch.float32), packed[:, :top_k].contiguous()


def combine_ranks(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_r weights[:, r] * expert_out[:, r] `[T, k, H]` -> `[T, H]`, accumulated in float32 rank by rank."""
    acc = expert_out[:, 0].float() * weights[:, :1]
    for rank in range(1, expert_out.shape[1]):
        acc += expert_out[:, rank].float() * weights[:, rank:rank + 1]
    return acc.to(expert_out.dtype)


class FusedExperts(nn.Module):
    """E routed SiLU-gated experts over stacked weights; `forward(x, weights, ids)` runs only the active ones.

    Expert parallelism (`dispatch` given, --ep-size): this rank's slots hold the experts `dispatch.held` of
    `total_experts` (model/expert_location.py: a contiguous range by default; a replicated expert's rows are
    split among its copies per batch). The rank computes the (token, k) rows `dispatch` gives it, exactly as
    one rank holding every expert would; the others count as zero. Deterministic mode: an all-reduce fills
    each row from the one rank that computed it (adding zeros: exact), and every rank then combines the full
    rows as one rank would. Default mode: each rank combines its own rows (the weighted sum of its experts'
    outputs per token) and one all-reduce of `[T, H]` adds the ranks' parts: top-k times less to move than
    the rows, in another order of additions than one rank's.

    A split inside each expert: `intermediate_size` is this rank's slice. Default mode (no `tp`): down holds
    the slice's input columns and the output is this rank's partial sum (the block all-reduces it).
    Deterministic mode (`tp` given, not expert-parallel): down holds this rank's output features over the
    whole intermediate, between two all-gathers (module docstring).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: Optional[TensorParallel] = None, dispatch: Optional[ExpertDispatch] = None):
        super().__init__()
        self.num_experts = num_experts     # expert slots on this rank
        self.dispatch = dispatch
        self.held = dispatch.held if dispatch is not None else tuple(range(num_experts))   # expert id per slot
        self.total_experts = dispatch.num_experts if dispatch is not None else num_experts
        self.tp = tp
        self.gathers = tp is not None and dispatch is None   # deterministic split inside each expert
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        # down `[E, down_features, down_in]`: this rank's output features over the whole intermediate when it
        # gathers, else every output feature over this rank's intermediate features
        self.down_in = intermediate_size * tp.size if self.gathers else intermediate_size
        self.down_features = hidden_size // tp.size if self.gathers else hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, self.down_features, self.down_in))
        self.gate_up: Optional[nn.ModuleList] = None    # per-expert Linears over the stacked slices (bind)
        self.down: Optional[nn.ModuleList] = None
        self.act = SiluAndMul(intermediate_size)
        # The compiled weighted sum (paged_kernels.moe_combine_op(), set by use_moe_combine), or None: torch ops.
        self.combine: Optional[Callable] = None

    def bind(self, gate_up: Optional[Sequence[QuantizedWeight]] = None,
             down: Optional[Sequence[QuantizedWeight]] = None) -> None:
        """Once loaded: give each expert a Linear whose weight is its slice of the stacked tensors, or its
        quantized weight from `gate_up` / `down` (one per expert: a GGUF file's expert slabs, whose stacked
        float tensor was never allocated).

        The stacked parameters are dropped from the module (the slices keep their storage), so a rule that
        re-lays a Linear's weight (oneDNN prepacking) frees the row-major copy as it does for a dense layer.
        """
        def linears(stacked: torch.Tensor, quantized: Optional[Sequence[QuantizedWeight]],
                    out_features: int, in_features: int) -> nn.ModuleList:
            experts = nn.ModuleList()
            for e in range(self.num_experts):
                with torch.device("meta"):
                    linear = Linear(in_features, out_features, bias=False)
                weight = stacked[e] if quantized is None else stacked.new_empty(0)
                linear.weight = nn.Parameter(weight, requires_grad=False)
                if quantized is not None:
                    linear.set_quantized(quantized[e])
                experts.append(linear)
            return experts

        hidden, inter = self.hidden_size, self.intermediate_size
        self.gate_up = linears(self.gate_up_proj.data, gate_up, 2 * inter, hidden)
        self.down = linears(self.down_proj.data, down, self.down_features, self.down_in)
        del self.gate_up_proj, self.down_proj

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(rows)) * up(rows)) of one expert, `[n, H]` -> `[n, H]`."""
        return self.down[expert](self.act(self.gate_up[expert](rows)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`x` `[T, H]` through each row's experts `ids` `[T, k]`, weighted by `weights` `[T, k]` -> `[T, H]`."""
        tokens, top_k = ids.shape
        kernel = self.combine if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) else None
        if self.dispatch is not None:     # expert parallelism
            return self._expert_parallel(x, weights, ids, kernel)
        if tokens == 1 and not self.gathers:   # a lone decode row: its k experts in rank order, no grouping
            rows = torch.stack([self.expert_mlp(e, x)[0] for e in ids[0].tolist()])
            if kernel is not None:
                return kernel(rows, torch.arange(top_k).view(1, top_k), weights)
            return combine_ranks(rows.unsqueeze(0), weights)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)            # (token, rank) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        active = counts.nonzero().flatten()
        groups = list(zip(active.tolist(), counts[active].cumsum(0).tolist(), strict=True))   # (expert, end row)
        rows = x.index_select(0, order // top_k)
        out = self._gathered_products(rows, groups) if self.gathers else self._products(rows, groups)
        if kernel is not None:   # each (token, rank)'s row in `out`: the inverse of `order`
            slots = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
            return kernel(out, slots.view(tokens, top_k), weights)
        # Weighted in the grouped order, then put back in (token, rank) order and summed rank by rank: the
        # same float32 products and additions as combine_ranks, in fewer passes over the rows.
        weighted = out.float() * weights.reshape(-1)[order, None]
        ranked = torch.empty_like(weighted).index_copy_(0, order, weighted).view(tokens, top_k, -1)
        acc = ranked[:, 0].clone()
        for rank in range(1, top_k):
            acc += ranked[:, rank]
        return acc.to(x.dtype)

    def _products(self, rows: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
        """Each group's expert over its rows of `rows` `[n, H]` (grouped by expert; `groups`: (expert, end
        row) in row order) -> `[n, H]` in the same order."""
        out = torch.empty_like(rows)
        start = 0
        for expert, end in groups:
            out[start:end] = self.expert_mlp(expert, rows[start:end])
            start = end
        return out

    def _gathered_products(self, rows: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
        """`_products` split inside each expert by output features (deterministic mode): every output feature
        is computed by one rank over the whole row, as one rank computes it (batch-invariant products are
        column-invariant), and gathered; two all-gathers for all the groups."""
        act = rows.new_empty(rows.shape[0], self.intermediate_size)
        start = 0
        for expert, end in groups:
            act[start:end] = self.act(self.gate_up[expert](rows[start:end]))
            start = end
        act = self.tp.all_gather(act)    # [n, I]: the ranks' slices side by side, as one rank's activations
        out = rows.new_empty(rows.shape[0], self.down_features)
        start = 0
        for expert, end in groups:
            out[start:end] = self.down[expert](act[start:end])
            start = end
        return self.tp.all_gather(out)   # [n, H]

    def _expert_parallel(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         kernel: Optional[Callable]) -> torch.Tensor:
        """Expert parallelism: this rank's rows (`dispatch.spans`: its share of the (token, k) pairs grouped by
        expert, as one rank with every expert groups them, the lone-row path too), then the ranks' parts
        added (class docstring). Only this rank's rows are gathered and computed; a pair another rank
        computes reads a zero row."""
        tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        spans = self.dispatch.spans(torch.bincount(flat, minlength=self.total_experts).tolist())
        mine = torch.cat([order[start:end] for _, start, end in spans]) if spans else order[:0]
        rows = x.index_select(0, mine // top_k)
        out = x.new_empty(mine.numel() + 1, x.shape[1])     # this rank's rows, then the zero row
        out[-1] = 0
        at = 0
        for slot, start, end in spans:
            out[at:at + end - start] = self.expert_mlp(slot, rows[at:at + end - start])
            at += end - start
        slots = torch.full((tokens * top_k,), mine.numel(), dtype=torch.long, device=x.device)
        slots[mine] = torch.arange(mine.numel(), device=x.device)
        if self.tp.deterministic:    # every row whole on every rank, combined as one rank combines them
            out = self.tp.all_reduce(out[slots])
            slots = torch.arange(tokens * top_k, device=x.device)
        slots = slots.view(tokens, top_k)
        if kernel is not None:
            combined = kernel(out, slots, weights)
        else:
            combined = combine_ranks(out[slots], weights)
        return combined if self.tp.deterministic else self.tp.all_reduce(combined)


class SparseMoeBlock(nn.Module):
    """Router + fused experts (+ Qwen2-MoE's shared expert behind a sigmoid gate); replaces a layer's MLP."""

    def __init__(self, hidden_size: int, moe: MoeConfig, layout: Optional[ShardLayout] = None,
                 tp: Optional[TensorParallel] = None, layer: int = 0):
        """`layout`, `tp`: this rank's experts, or slices of them, under tensor parallelism (module docstring);
        `layer`: the decoder layer's index (its expert placement, its row of the recorder)."""
        super().__init__()
        self.layer = layer
        self.recorder: Optional[ExpertDistributionRecorder] = None    # set by use_expert_recorder
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)   # the router
        sliced = layout is not None and layout.slices_experts
        # Split inside each expert in the default mode: the rank's output is a partial sum, all-reduced here.
        self.partial_sums = tp if sliced and not layout.row_parallel_by_output else None
        if layout is not None and layout.expert_parallel:
            self.experts = FusedExperts(layout.experts, hidden_size, moe.expert_intermediate_size, tp,
                                        ExpertDispatch(layout.placement, layer, layout.rank))
        elif sliced:
            self.experts = FusedExperts(moe.num_experts, hidden_size, layout.expert_intermediate,
                                        tp=None if self.partial_sums else tp)
        else:
            self.experts = FusedExperts(moe.num_experts, hidden_size, moe.expert_intermediate_size)
        # Rank 0 routes for every rank: each computes the same router product, but a rank whose product
        # rounded differently (another thread count, another CPU) would pick another expert at a near tie, and
        # the all-reduce would then add partial sums of different experts: a wrong answer, silently.
        self.routing_from = tp if layout is not None and layout.size > 1 else None
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = _shared_expert(hidden_size, shared, layout if sliced else None, tp) if shared else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to `x` `[T, H]`."""
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        if self.routing_from is not None:
            weights, ids = rank0_routing(self.routing_from, weights, ids)
        if self.recorder is not None and self.recorder.recording:
            self.recorder.add(self.layer, ids)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:   # a partial sum too where the experts' is: the gate is per token
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.partial_sums is None else self.partial_sums.all_reduce(out)

    def checkpoint_targets(self, ours: str, theirs: str, mixtral: bool) -> dict[str, tuple]:
        """HF tensor name -> (parameter, first row, end row[, expert]) for this block at `ours` (our module
        path) read from `theirs` (the checkpoint's: `...mlp` or Mixtral's `...block_sparse_moe`)."""
        inter = self.experts.intermediate_size      # this rank's (its slice under a split inside the experts)
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        gate_up, down = f"{ours}.experts.gate_up_proj", f"{ours}.experts.down_proj"
        targets: dict[str, tuple] = {f"{theirs}.gate.weight": (f"{ours}.gate.weight", 0, self.gate.out_features)}
        for e, held in enumerate(self.experts.held):    # this rank's experts (all without expert parallelism)
            expert = f"{theirs}.experts.{held}"
            targets[f"{expert}.{names[0]}.weight"] = (gate_up, 0, inter, e)
            targets[f"{expert}.{names[1]}.weight"] = (gate_up, inter, 2 * inter, e)
            targets[f"{expert}.{names[2]}.weight"] = (down, 0, self.experts.down_features, e)
        if self.shared_expert is not None:
            shared, fused = self.shared_expert.intermediate_size, f"{ours}.shared_expert.gate_up_proj.weight"
            targets[f"{theirs}.shared_expert.gate_proj.weight"] = (fused, 0, shared)
            targets[f"{theirs}.shared_expert.up_proj.weight"] = (fused, shared, 2 * shared)
            targets[f"{theirs}.shared_expert.down_proj.weight"] = (f"{ours}.shared_expert.down_proj.weight", 0,
                                                                   self.shared_expert.down_proj.out_features)
            targets[f"{theirs}.shared_expert_gate.weight"] = (f"{ours}.shared_expert_gate.weight", 0, 1)
        return targets


def _shared_expert(hidden_size: int, intermediate_size: int, layout: Optional[ShardLayout],
                   tp: Optional[TensorParallel]) -> GatedMLP:
    """Qwen2-MoE's shared expert: whole, or (`layout` given: a split inside the experts) this rank's slice of
    its intermediate features like a dense MLP's: in deterministic mode its down is the row-parallel Linear
    (gathered), else a plain Linear over the slice, whose partial sum the block adds to the experts' before
    its one all-reduce."""
    if layout is None:
        return GatedMLP(hidden_size, intermediate_size)
    if layout.row_parallel_by_output:
        down = row_parallel_linear(intermediate_size, hidden_size, False, tp)
    else:
        down = Linear(layout.shared_intermediate, hidden_size, bias=False)
    return GatedMLP(hidden_size, layout.shared_intermediate, down_proj=down)


def bind_experts(model: nn.Module) -> None:
    """Give every FusedExperts of a loaded `model` its per-expert Linears (FusedExperts.bind)."""
    for module in list(model.modules()):
        if isinstance(module, FusedExperts) and module.gate_up is None:
            module.bind()


def use_expert_linear(model: nn.Module, linear: DecodeLinear) -> None:
    """Run every expert product of `model` through `linear`, a compiled kernel serving every row count
    (paged_kernels.amx_linear_op()), keeping only the weight as it reads it (use_decode_linear releases the
    row-major one).

    For AMX CPUs in the default mode, where other products run on oneDNN's prepacked weights: an expert's
    products are small (a decode token's row; ~T*k/E rows in a prefill), where the AMX linear reads a bf16
    weight ~1.4x faster than oneDNN at 1-16 rows and is ~1.3x slower at 256 (measured, docs/benchmarks.md).
    """
    for module in model.modules():
        if isinstance(module, FusedExperts):
            use_decode_linear(module, linear)


def use_expert_recorder(model: nn.Module, recorder: Optional[ExpertDistributionRecorder]) -> None:
    """Count every MoE block's routed rows of `model` into `recorder` while it records (None: never)."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.recorder = recorder


def use_moe_combine(model: nn.Module, op: Optional[Callable]) -> None:
    """Sum every FusedExperts' outputs of `model` with the compiled `op` (paged_kernels.moe_combine_op()), or
    with torch ops (None)."""
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.combine = op
