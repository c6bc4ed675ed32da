"""Tensor parallelism inside the model: the rank's communicator, its shard of every weight, the parallel layers.

Which rows or columns of each checkpoint tensor a rank holds (`ShardLayout`, `ShardLayout.shard`):

| tensor                          | split                    | after the product                           |
|---------------------------------|--------------------------|---------------------------------------------|
| q_proj / k_proj / v_proj (qkv)  | output rows, by head     | none: attention runs on the rank's heads    |
| gate_proj / up_proj (gate_up)   | output rows              | none                                        |
| o_proj / down_proj              | input columns (default)  | all-reduce of the partial sums              |
|                                 | output rows (determ.)    | all-gather of the inputs, then the outputs  |
| embed_tokens / lm_head          | vocabulary rows (padded) | embedding: all-reduce; logits: all-gather   |
| norms                           | replicated               |                                             |
| MoE routed experts (default)    | inside each expert: its  | all-reduce of the block's combined output   |
|                                 | gate/up rows and down    | (determ.: down by output rows, between an   |
|                                 | columns, like an MLP     | all-gather of the activations and one of    |
|                                 |                          | the outputs; then one rank's combine)       |
| MoE routed experts (--ep-size)  | whole experts (placement | all-reduce of the ranks' combined outputs   |
|                                 | expert_location.py)      |                                             |
|                                 |                          | (determ.: of each (token, k) output row)    |
| MoE shared expert (Qwen2-MoE)   | like the routed experts  | added before the block's all-reduce         |
|                                 | (--ep-size: replicated)  | (determ.: gathered like a dense MLP)        |
| MoE router                      | replicated               | rank 0's expert ids and weights broadcast   |
| MoE shared expert gate          | replicated               |                                             |

KV heads are split like q heads when there are at least as many as ranks; with fewer, each rank holds the
one KV head its q heads read (replicated across the ranks that share it).

Deterministic mode (`--enable-deterministic-inference`): an all-reduce of partial sums adds a row's products
in another order than one rank's GEMM does, so o_proj and down_proj are split by output features instead:
every rank gathers the full input row, multiplies it by its output rows of the weight (each output feature
summed over the whole input in one GEMM, as at TP=1: the batch-invariant Linear's products are
column-invariant, tests/model/test_tensor_parallel.py checks it) and the outputs are gathered in rank
order. Weight memory stays sharded; the communication is two all-gathers per layer instead of one
all-reduce. The MoE experts split inside each expert follow the same rule over all of a layer's grouped rows
at once (moe.FusedExperts): two all-gathers per MoE layer, and the same products and combine as one rank.

Quantized weights are cut the same way (`ShardLayout.cut`), in their format, with their scales and zero
points: output rows split anywhere (every format's blocks run along the input); an input split must fall on
a block boundary (`check_block_split`: GGUF blocks of 32 or 256 values, AWQ/GPTQ groups, FP8 blocks), and a
checkpoint whose blocks would straddle it is refused at load, naming the tensor, the block and the TP size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple, Optional, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvstrata.model.config import ModelConfig
from kvstrata.model.expert_location import TRIVIAL, ExpertLocationError, ExpertPlacement
from kvstrata.model.layers import Linear
from kvstrata.model.shm_collectives import ShmCollectives

T = TypeVar("T")

# How long a rank waits for the others to join, and ranks > 0 for rank 0's next plan: rank 0 may spend long
# between two plans while starting (tokenizer, grammar tables, cache). A hung rank 0 is the HTTP process's
# watchdog's to kill (the ranks die with it); a hung rank > 0 fails rank 0's next collective.
JOIN_TIMEOUT_S = 180.0


class RankFailure(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or its socket closed. Fatal to the server."""


class TensorParallel:
    """One rank's view of its tensor-parallel group: rank, size, and the collectives the model runs.

    Every collective is timed (`comm_s`, `comm_calls`: the benchmark's communication cost) and turns a
    torch.distributed error into RankFailure naming this rank and the operation. The model's all-reduce and
    all-gather, and the plans' broadcasts, go through `shm` (shared memory, ranks of one machine) when the
    group has it, else through torch.distributed; checks (all_min) always go through torch.distributed.
    """

    def __init__(self, rank: int, size: int, deterministic: bool = False,
                 group: Optional[dist.ProcessGroup] = None, expert_parallel: bool = False,
                 plan_group: Optional[dist.ProcessGroup] = None, expert_location: str = TRIVIAL,
                 redundant_experts: int = 0):
        self.rank, self.size = rank, size
        self.deterministic = deterministic
        self.expert_parallel = expert_parallel     # --ep-size = --tp-size: MoE experts split across the ranks
        self.expert_location = expert_location     # --init-expert-location (model/expert_location.py)
        self.redundant_experts = redundant_experts  # --ep-num-redundant-experts
        self.group = group                         # the model's collectives: --dist-timeout
        self.plan_group = plan_group or group      # plan broadcasts: JOIN_TIMEOUT_S
        self.comm_s = 0.0
        self.comm_calls = 0
        self.failed = False      # a collective failed: the group is unusable (no STOP plan can be sent)
        self.shm: Optional[ShmCollectives] = None

    @property
    def collectives(self) -> str:
        """Which path the model's all-reduce and all-gather take: "shm", or torch.distributed's backend ("nccl"
        where CUDA tensors go through NCCL and CPU ones through gloo)."""
        if self.shm is not None:
            return "shm"
        if self.group is None:
            return "none"
        backend = str(dist.get_backend(self.group))
        return "nccl" if "nccl" in backend else backend

    @classmethod
    def init(cls, rank: int, size: int, init_addr: str, backend: str, timeout_s: float,
             deterministic: bool, expert_parallel: bool = False, shm: bool = False,
             compiled: bool = True, expert_location: str = TRIVIAL, redundant_experts: int = 0) -> TensorParallel:
        """Join the group at `init_addr` (host:port of rank 0's TCP store) as `rank`, waiting up to
        JOIN_TIMEOUT_S for the others (a process that imports torch on a busy machine takes a while);
        collectives then time out after `timeout_s`. `shm`: all ranks are on this machine, so map a
        shared-memory segment for the model's collectives and the plans (gloo stays when any rank cannot);
        `compiled`: its rounds through the CPU kernel library where it is built."""
        try:
            dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                                    timeout=timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)))
            group = dist.new_group(list(range(size)), timeout=timedelta(seconds=timeout_s), backend=backend)
            tp = cls(rank, size, deterministic, group, expert_parallel, plan_group=dist.group.WORLD,
                     expert_location=expert_location, redundant_experts=redundant_experts)
            if shm:
                tp.shm = ShmCollectives.join(rank, size, group, timeout_s, compiled)
        except Exception as e:   # a rank that never came up: the store's wait timed out, or the address is wrong
            raise RankFailure(f"rank {rank}: joining the tensor-parallel group at {init_addr} failed: {e}") from e
        return tp

    def close(self) -> None:
        """Leave the group (this process can join no other afterwards)."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def _run(self, what: str, call: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            result = call()
        except Exception as e:   # gloo: connection closed / timed out; NCCL: an error or watchdog abort; shm
            self.failed = True
            raise RankFailure(f"rank {self.rank}: {what} failed (a peer rank died or timed out): {e}") from e
        self.comm_s += time.perf_counter() - start
        self.comm_calls += 1
        return result

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (in place); returns it."""
        shm = self.shm
        if shm is not None:
            self._run("all-reduce", lambda: shm.all_reduce(x))
        else:
            self._run("all-reduce", lambda: dist.all_reduce(x, group=self.group))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` `[T, n]` along the last dimension, in rank order -> `[T, size * n]`."""
        x = x.contiguous()
        shm = self.shm
        if shm is not None:
            return self._run("all-gather", lambda: shm.all_gather(x))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._run("all-gather", lambda: dist.all_gather(parts, x, group=self.group))
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0, plan: bool = True) -> torch.Tensor:
        """Rank `src`'s `x` on every rank (in place); returns it. A plan waits up to JOIN_TIMEOUT_S; `plan`
        False: a decision inside the forward, with the model's collectives' timeout."""
        shm = self.shm
        if shm is not None:
            timeout_s = max(shm.timeout_s, JOIN_TIMEOUT_S) if plan else shm.timeout_s
            self._run("broadcast", lambda: shm.broadcast(x, src, timeout_s))
        else:
            group = self.plan_group if plan else self.group
            self._run("broadcast", lambda: dist.broadcast(x, src, group=group))
        return x

    def all_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of `values` over the ranks (flags: 1 on every rank, else 0)."""
        t = torch.tensor(values, dtype=torch.long, device="cpu")   # gloo's, even inside a `with torch.device("meta")`
        self._run("all-reduce (min)", lambda: dist.all_reduce(t, dist.ReduceOp.MIN, group=self.group))
        return t.tolist()

    def check_agree(self, what: str, values: list[int]) -> None:
        """Raise RankFailure unless every rank passed the same `values` (settings each rank resolved itself)."""
        if self.all_min(values) != values or self.all_min([-v for v in values]) != [-v for v in values]:
            raise RankFailure(f"rank {self.rank}: the ranks disagree on {what} (this rank: {values}); set them "
                              f"explicitly and identically on every node")


VOCAB_MODULES = ("embed_tokens", "lm_head")
GATE_UP_MODULES = ("gate_proj", "up_proj", "w1", "w3")     # w1 / w3 / w2: Mixtral's expert names
DOWN_MODULES = ("down_proj", "w2")
WHOLE = slice(None)


class Cut(NamedTuple):
    """A rank's rows and columns of a `[out, in]` checkpoint weight (WHOLE: all of them)."""

    rows: slice
    cols: slice

    @property
    def splits_input(self) -> bool:
        """Whether the input columns are split (row-parallel by input: partial sums, then an all-reduce)."""
        return self.cols != WHOLE


class ShardError(ValueError):
    """The model cannot be split `size` ways (a dimension that does not divide, a quantization block cut)."""


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds of a model: head, feature and vocabulary ranges (see module docstring)."""

    rank: int
    size: int
    deterministic: bool
    q_heads: int          # q heads on this rank, starting at q_head0
    q_head0: int
    kv_heads: int         # KV heads on this rank, starting at kv_head0
    kv_head0: int
    head_dim: int
    intermediate: int     # gate/up rows (down columns) on this rank
    hidden: int           # the model's hidden size
    vocab: int            # the model's vocabulary
    vocab_rows: int       # vocabulary rows per rank (the last rank's tail is zero padding)
    experts: int = 0      # MoE: routed expert slots on this rank (all the experts but with EP)
    placement: Optional[ExpertPlacement] = None   # --ep-size: where the whole experts live (None: no EP)
    expert_intermediate: int = 0    # MoE: gate/up rows (down columns) of each routed expert on this rank
    shared_intermediate: int = 0    # Qwen2-MoE: the same of the shared expert

    @classmethod
    def of(cls, config: ModelConfig, tp: Optional[TensorParallel]) -> ShardLayout:
        """The layout of `config` on `tp`'s rank (everything on one rank when `tp` is None)."""
        rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
        c = config
        problems = []
        experts = c.moe.num_experts if c.moe is not None else 0
        expert_parallel = bool(experts) and size > 1 and tp.expert_parallel
        inside = bool(experts) and size > 1 and not expert_parallel     # a split inside each expert
        expert_inter = c.moe.expert_intermediate_size if experts else 0
        shared_inter = c.moe.shared_expert_intermediate_size if experts else 0
        placement = None
        if expert_parallel:
            try:
                placement = ExpertPlacement.of(tp.expert_location, c.num_layers, experts, size, tp.redundant_experts)
            except ExpertLocationError as e:
                problems.append(str(e))
        if inside and expert_inter % size:
            problems.append(f"MoE intermediate size {expert_inter} (each expert's; --ep-size {size} "
                            f"splits whole experts instead)")
        if inside and shared_inter % size:
            problems.append(f"shared expert intermediate size {shared_inter}")
        if c.num_heads % size:
            problems.append(f"{c.num_heads} attention heads")
        if c.num_kv_heads % size and size % c.num_kv_heads:
            problems.append(f"{c.num_kv_heads} KV heads (neither divides the other)")
        if c.intermediate_size % size:
            problems.append(f"intermediate size {c.intermediate_size}")
        if c.hidden_size % size:
            problems.append(f"hidden size {c.hidden_size}")
        if problems:
            raise ShardError(f"--tp-size {size} cannot split {c.architecture}: " + "; ".join(problems))
        # Each rank resolved the placement from its own flags (and file, on several nodes). A communicator
        # without a group (a layout computed alone) has no other rank to disagree with.
        if placement is not None and tp.group is not None:
            tp.check_agree("the expert placement (--init-expert-location)", placement.flat())
        kv_heads = max(c.num_kv_heads // size, 1)
        kv_head0 = rank * c.num_kv_heads // size   # with fewer KV heads than ranks: the one this rank's q heads read
        return cls(rank=rank, size=size, deterministic=tp is not None and tp.deterministic,
                   q_heads=c.num_heads // size, q_head0=rank * (c.num_heads // size),
                   kv_heads=kv_heads, kv_head0=kv_head0, head_dim=c.head_dim,
                   intermediate=c.intermediate_size // size, hidden=c.hidden_size, vocab=c.vocab_size,
                   vocab_rows=-(-c.vocab_size // size),
                   experts=placement.local_slots if placement is not None else experts,
                   placement=placement,
                   expert_intermediate=expert_inter // size if inside else expert_inter,
                   shared_intermediate=shared_inter // size if inside else shared_inter)

    def holds(self, name: str) -> bool:
        """Whether this rank loads checkpoint tensor `name` at all (not another rank's routed expert)."""
        parts = name.split(".")
        if self.placement is None or "experts" not in parts or "layers" not in parts:
            return True
        index = parts.index("experts") + 1
        if index >= len(parts) or not parts[index].isdigit():
            return True
        return int(parts[index]) in self.held_experts(int(parts[parts.index("layers") + 1]))

    def held_experts(self, layer: int) -> tuple[int, ...]:
        """The experts in this rank's slots of `layer`, in slot order (every expert without expert parallelism)."""
        if self.placement is None:
            return tuple(range(self.experts))
        return self.placement.held(self.rank, layer)

    @property
    def expert_parallel(self) -> bool:
        """Whether whole experts are split across the ranks (--ep-size), as `placement` says."""
        return self.placement is not None

    @property
    def row_parallel_by_output(self) -> bool:
        """Whether o_proj / down_proj are split by output features (deterministic mode) rather than input."""
        return self.size > 1 and self.deterministic

    @property
    def slices_experts(self) -> bool:
        """Whether every rank holds every routed expert, its slice of their intermediate features (MoE under
        --tp-size without --ep-size), rather than whole experts or all of them."""
        return self.size > 1 and self.experts > 0 and not self.expert_parallel

    def cut(self, name: str) -> Optional[Cut]:
        """This rank's output rows and input columns of checkpoint tensor `name` (a `[out, in]` weight; a bias:
        its rows), or None where every rank holds it whole. Vocabulary rows may run past the vocabulary (the
        last rank's tail): `shard` pads them with zeros."""
        if self.size == 1:
            return None
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if "experts" in parts or "shared_expert" in parts:
            if not self.slices_experts:
                return None     # --ep-size: routed experts are whole on their rank, the shared expert replicated
            return self._mlp_cut(module, self.expert_intermediate if "experts" in parts else self.shared_intermediate)
        hd = self.head_dim
        if module == "q_proj":
            rows = _span(self.q_head0 * hd, self.q_heads * hd)
        elif module in ("k_proj", "v_proj"):
            rows = _span(self.kv_head0 * hd, self.kv_heads * hd)
        elif module in VOCAB_MODULES:
            rows = _span(self.rank * self.vocab_rows, self.vocab_rows)
        elif module == "o_proj":
            return self._row_parallel_cut(self.q_heads * hd)
        else:
            return self._mlp_cut(module, self.intermediate)   # the MoE router (`gate`) and norms: None
        return Cut(rows, WHOLE)

    def _mlp_cut(self, module: str, width: int) -> Optional[Cut]:
        """The cut of a gated MLP's `module` (a dense MLP or an expert) holding `width` intermediate features
        on this rank: gate/up rows, down as a row-parallel layer; None for any other module."""
        if module in GATE_UP_MODULES:
            return Cut(_span(self.rank * width, width), WHOLE)
        if module in DOWN_MODULES:
            return self._row_parallel_cut(width)
        return None

    def _row_parallel_cut(self, width: int) -> Cut:
        """o_proj / down_proj: this rank's `width` input columns, or (deterministic mode) its output rows."""
        if self.row_parallel_by_output:
            return Cut(_span(self.rank * (self.hidden // self.size), self.hidden // self.size), WHOLE)
        return Cut(WHOLE, _span(self.rank * width, width))

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a Hugging Face name), shaped as its parameter holds it."""
        cut = self.cut(name)
        if cut is None:
            return tensor
        if tensor.dim() == 1 and cut.splits_input:   # a row-parallel bias, added once after the sum: rank 0's
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        part = tensor[cut.rows] if tensor.dim() == 1 else tensor[cut.rows, cut.cols]
        if name.split(".")[-2] in VOCAB_MODULES:
            part = F.pad(part, (0, 0, 0, self.vocab_rows - part.shape[0]))
        return part

    def check_block_split(self, name: str, block: int) -> None:
        """Raise ShardError when the cut of `name`, a weight held in blocks of `block` consecutive input values
        sharing their scales (GGUF blocks, AWQ/GPTQ groups, FP8 blocks), would fall inside a block: only
        row-parallel layers split by input (o_proj, down_proj outside deterministic mode) can."""
        cut = self.cut(name)
        if cut is None or not cut.splits_input or (cut.cols.stop - cut.cols.start) % block == 0:
            return
        width = cut.cols.stop - cut.cols.start
        raise ShardError(f"--tp-size {self.size} cannot split {name}: each rank takes {width} of its input "
                         f"columns, not a multiple of its quantization block of {block} values; use another "
                         f"--tp-size, or --enable-deterministic-inference (which splits o_proj/down_proj by "
                         f"output rows, where blocks never straddle a cut)")


def _span(start: int, count: int) -> slice:
    return slice(start, start + count)


class RowParallelLinear(Linear):
    """o_proj / down_proj on one rank: input-split with an all-reduce, or (deterministic mode) output-split
    over the gathered input with the outputs gathered; the layout's docstring says why."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        if tp.deterministic:
            super().__init__(in_features, out_features // tp.size, bias=bias)
        else:
            super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in / size]` (this rank's heads or intermediate features) -> the full `[T, out]`."""
        if self.tp.deterministic:
            return self.tp.all_gather(super().forward(self.tp.all_gather(x)))
        return self.tp.all_reduce(super().forward(x))


def row_parallel_linear(in_features: int, out_features: int, bias: bool,
                        tp: Optional[TensorParallel]) -> Linear:
    """A row-parallel Linear on `tp`, or a plain one without tensor parallelism."""
    if tp is None or tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's vocabulary rows; a token outside them contributes zeros, and the all-reduce adds the
    one non-zero row to zeros (exact: the result is the row itself)."""

    def __init__(self, vocab_rows: int, hidden: int, tp: TensorParallel):
        super().__init__(vocab_rows, hidden, _weight=_embedding_table(vocab_rows, hidden))
        self.tp = tp
        self.first = tp.rank * vocab_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings `[T, hidden]` of token ids `[T]`."""
        return _vocab_parallel_lookup(ids, self.first, self.num_embeddings, super().forward, self.tp)


class VocabParallelLookup(nn.Module):
    """VocabParallelEmbedding's rule over another lookup of this rank's vocabulary rows (a table held
    quantized: quant/gguf_weight.GGUFEmbedding)."""

    def __init__(self, lookup: nn.Module, vocab_rows: int, tp: TensorParallel):
        super().__init__()
        self.lookup = lookup
        self.rows = vocab_rows
        self.first = tp.rank * vocab_rows
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings `[T, hidden]` of token ids `[T]`."""
        return _vocab_parallel_lookup(ids, self.first, self.rows, self.lookup, self.tp)


def _vocab_parallel_lookup(ids: torch.Tensor, first: int, rows: int, lookup, tp: TensorParallel) -> torch.Tensor:
    local = ids - first
    outside = (local < 0) | (local >= rows)
    out = lookup(local.masked_fill(outside, 0))
    return tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def embedding(layout: ShardLayout, tp: Optional[TensorParallel]) -> nn.Embedding:
    """The input embedding: whole, or this rank's vocabulary rows."""
    if tp is None or tp.size == 1:
        return nn.Embedding(layout.vocab, layout.hidden, _weight=_embedding_table(layout.vocab, layout.hidden))
    return VocabParallelEmbedding(layout.vocab_rows, layout.hidden, tp)


def vocab_parallel(lookup: nn.Module, layout: ShardLayout, tp: Optional[TensorParallel]) -> nn.Module:
    """`lookup` (over this rank's vocabulary rows) as the model's input embedding: itself on one rank."""
    if tp is None or tp.size == 1:
        return lookup
    return VocabParallelLookup(lookup, layout.vocab_rows, tp)


def _embedding_table(rows: int, hidden: int) -> torch.Tensor:
    """nn.Embedding's initial table (normal), except on the meta device, where loaders build models: there is
    nothing to draw, and torch runs a meta normal_ through torch._dynamo, whose import (with triton) keeps
    ~150 MB resident in the process for good."""
    table = torch.empty(rows, hidden)
    return table if table.is_meta else nn.init.normal_(table)


def gather_logits(logits: torch.Tensor, layout: ShardLayout, tp: Optional[TensorParallel]) -> torch.Tensor:
    """The full `[rows, vocab]` logits from every rank's vocabulary rows (padding dropped)."""
    if tp is None or tp.size == 1:
        return logits
    return tp.all_gather(logits)[:, :layout.vocab]
