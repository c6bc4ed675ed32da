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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from kvstrata.model.config import MoeConfig
from kvstrata.model.layers import GatedMLP, Linear, SiluAndMul, use_decode_linear

if TYPE_CHECKING:
    from kvstrata.model.paged_kernels import DecodeLinear
    from kvstrata.model.parallel import ShardLayout, TensorParallel
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


def combine_ranks(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_r weights[:, r] * expert_out[:, r] `[T, k, H]` -> `[T, H]`, accumulated in float32 rank by rank."""
    acc = expert_out[:, 0].float() * weights[:, :1]
    for rank in range(1, expert_out.shape[1]):
        acc += expert_out[:, rank].float() * weights[:, rank:rank + 1]
    return acc.to(expert_out.dtype)


class FusedExperts(nn.Module):
    """E routed SiLU-gated experts over stacked weights; `forward(x, weights, ids)` runs only the active ones.

    Expert parallelism (`tp` given, --ep-size): this rank holds experts [first_expert, first_expert +
    num_experts) of `total_experts`, computes the (token, k) rows routed to them exactly as one rank holding
    every expert would, leaves the others zero, and an all-reduce fills each row from the one rank that
    computed it (adding zeros: exact); every rank then combines the full rows as one rank would.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 first_expert: int = 0, total_experts: Optional[int] = None, tp: Optional[TensorParallel] = None):
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.total_experts = total_experts or num_experts
        self.tp = tp
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
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
        self.down = linears(self.down_proj.data, down, hidden, inter)
        del self.gate_up_proj, self.down_proj

    def expert_mlp(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(rows)) * up(rows)) of one expert, `[n, H]` -> `[n, H]`."""
        return self.down[expert](self.act(self.gate_up[expert](rows)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`x` `[T, H]` through each row's experts `ids` `[T, k]`, weighted by `weights` `[T, k]` -> `[T, H]`."""
        tokens, top_k = ids.shape
        kernel = self.combine if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) else None
        if self.tp is not None:
            ranked = self._ranked_rows(x, ids)
            if kernel is not None:
                return kernel(ranked, torch.arange(tokens * top_k).view(tokens, top_k), weights)
            return combine_ranks(ranked.view(tokens, top_k, -1), weights)
        if tokens == 1:   # a lone decode row: its k experts in rank order, no grouping to do
            rows = torch.stack([self.expert_mlp(e, x)[0] for e in ids[0].tolist()])
            if kernel is not None:
                return kernel(rows, torch.arange(top_k).view(1, top_k), weights)
            return combine_ranks(rows.unsqueeze(0), weights)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)            # (token, rank) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        active = counts.nonzero().flatten()
        rows = x.index_select(0, order // top_k)
        out = torch.empty_like(rows)
        start = 0
        for expert, count in zip(active.tolist(), counts[active].tolist(), strict=True):
            out[start:start + count] = self.expert_mlp(expert, rows[start:start + count])
            start += count
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


    def _ranked_rows(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: every (token, k) pair's expert output `[T * k, H]`, in (token, k) order, after
        the all-reduce. The same groups and products as one rank with every expert (the lone-row path too:
        each of its experts gets one row)."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.total_experts).tolist()
        rows = x.index_select(0, order // top_k)
        out = torch.zeros_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            local = expert - self.first_expert
            if count and 0 <= local < self.num_experts:
                out[start:start + count] = self.expert_mlp(local, rows[start:start + count])
            start += count
        ranked = torch.empty_like(out).index_copy_(0, order, out)
        return self.tp.all_reduce(ranked)


class SparseMoeBlock(nn.Module):
    """Router + fused experts (+ Qwen2-MoE's shared expert behind a sigmoid gate); replaces a layer's MLP."""

    def __init__(self, hidden_size: int, moe: MoeConfig, layout: Optional[ShardLayout] = None,
                 tp: Optional[TensorParallel] = None):
        """`layout`, `tp`: this rank's experts under expert parallelism (model/parallel.py); all of them without."""
        super().__init__()
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)   # the router
        if layout is not None and layout.size > 1:
            self.experts = FusedExperts(layout.experts, hidden_size, moe.expert_intermediate_size,
                                        layout.first_expert, moe.num_experts, tp)
        else:
            self.experts = FusedExperts(moe.num_experts, hidden_size, moe.expert_intermediate_size)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden_size, shared) if shared else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to `x` `[T, H]`."""
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def checkpoint_targets(self, ours: str, theirs: str, mixtral: bool) -> dict[str, tuple]:
        """HF tensor name -> (parameter, first row, end row[, expert]) for this block at `ours` (our module
        path) read from `theirs` (the checkpoint's: `...mlp` or Mixtral's `...block_sparse_moe`)."""
        inter = self.experts.intermediate_size
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        gate_up, down = f"{ours}.experts.gate_up_proj", f"{ours}.experts.down_proj"
        hidden = self.experts.hidden_size
        targets: dict[str, tuple] = {f"{theirs}.gate.weight": (f"{ours}.gate.weight", 0, self.gate.out_features)}
        for e in range(self.experts.num_experts):    # this rank's experts (all without expert parallelism)
            expert = f"{theirs}.experts.{self.experts.first_expert + e}"
            targets[f"{expert}.{names[0]}.weight"] = (gate_up, 0, inter, e)
            targets[f"{expert}.{names[1]}.weight"] = (gate_up, inter, 2 * inter, e)
            targets[f"{expert}.{names[2]}.weight"] = (down, 0, hidden, e)
        if self.shared_expert is not None:
            shared, fused = self.shared_expert.intermediate_size, f"{ours}.shared_expert.gate_up_proj.weight"
            targets[f"{theirs}.shared_expert.gate_proj.weight"] = (fused, 0, shared)
            targets[f"{theirs}.shared_expert.up_proj.weight"] = (fused, shared, 2 * shared)
            targets[f"{theirs}.shared_expert.down_proj.weight"] = (f"{ours}.shared_expert.down_proj.weight", 0, hidden)
            targets[f"{theirs}.shared_expert_gate.weight"] = (f"{ours}.shared_expert_gate.weight", 0, 1)
        return targets


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


def use_moe_combine(model: nn.Module, op: Optional[Callable]) -> None:
    """Sum every FusedExperts' outputs of `model` with the compiled `op` (paged_kernels.moe_combine_op()), or
    with torch ops (None)."""
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.combine = op
