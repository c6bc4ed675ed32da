"""Building blocks shared by the Llama-family layers: Linear, RMSNorm and the gated SiLU MLP."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.model.quant.base import QuantizedWeight
from kvstrata.platform import cpu_has_amx, cpu_has_fast_bf16, cpu_has_onednn_bf16_reorder

if TYPE_CHECKING:
    from kvstrata.model.paged_kernels import DecodeLinear

# On a CPU without native bf16/fp16 matmul (no AVX-512 BF16 / AMX), oneDNN emulates low-precision GEMMs
# several times slower than float32 ones once more than a row or two is multiplied; converting the
# weight to float32 (cheap while it fits in cache) and running a float32 GEMM is then faster. A single
# row (decode) is memory-bound and reads the half-size weight natively.
UPCAST_MIN_ROWS = 4
_CPU_NATIVE_LOW_PRECISION = cpu_has_fast_bf16()
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """nn.Linear that runs multi-row low-precision CPU matmuls in float32 where the CPU lacks native support.

    Same inputs and fp32 accumulation as oneDNN's bf16 GEMM, one rounding of the output. A compiled bf16
    kernel set by `use_decode_linear` takes the products it serves first.
    `upcast_min_rows`: fewest rows worth converting the weight for (higher for very large weights,
    whose conversion no longer fits in cache).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 upcast_min_rows: int = UPCAST_MIN_ROWS):
        super().__init__(in_features, out_features, bias=bias)
        self.upcast_min_rows = upcast_min_rows
        self.min_rows = 1   # inputs with fewer rows are zero-padded (batch-invariant mode)
        self.batch_invariant = False   # CPU: low-precision products in float32; GPU: fixed-size blocks
        self.decode_gemv: Optional[DecodeLinear] = None   # compiled bf16 GEMV (decode rows; AVX2: all rows)
        self.decode_weight: Optional[torch.Tensor] = None   # the weight as decode_gemv reads it (packed)
        self.onednn_weight: Optional[torch.Tensor] = None   # the weight prepacked for oneDNN (use_onednn_weights)
        self.quantized: Optional[QuantizedWeight] = None   # the weight held quantized (set_quantized)

    def set_quantized(self, weight: QuantizedWeight) -> None:
        """Hold the weight in a quantized format from now on: its one copy; the float weight is released."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight is [{weight.out_features}, {weight.in_features}], "
                             f"this Linear is [{self.out_features}, {self.in_features}]")
        self.quantized = weight
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        self.decode_gemv, self.decode_weight, self.onednn_weight = None, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in]` -> `[T, out]` (in the weight's dtype when a float32 weight serves a bf16 model)."""
        if self.quantized is not None:
            out = self.quantized(x)
            return out if self.bias is None else out + self.bias.to(out.dtype)
        if self.onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
        rows = x.shape[0]
        gemv = self.decode_gemv
        if gemv is not None and x.dtype == self.weight.dtype and (gemv.max_rows is None or rows <= gemv.max_rows):
            return gemv.run(x.contiguous(), self.decode_weight, self.bias, self.out_features)
        if self.batch_invariant and x.device.type != "cpu":
            return self._forward_in_blocks(x)
        if rows < self.min_rows:
            return self._forward(F.pad(x, (0, 0, 0, self.min_rows - rows)))[:rows]
        return self._forward(x)

    def serves_every_row(self) -> bool:
        """Whether a compiled kernel (`decode_gemv` without a row limit) takes every product of this Linear."""
        return self.decode_gemv is not None and self.decode_gemv.max_rows is None

    def _forward_in_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Batch-invariant products on a GPU: every GEMM has exactly DEVICE_INVARIANT_BLOCK_ROWS rows (the
        input zero-padded), so the library runs one kernel, one reduction order, whatever the batch."""
        rows, block = x.shape[0], DEVICE_INVARIANT_BLOCK_ROWS
        parts = [self._forward(part) for part in F.pad(x, (0, 0, 0, -rows % block)).split(block)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts))[:rows]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias)
        low_cpu = x.dtype in _LOW_PRECISION and x.device.type == "cpu"
        if low_cpu and (self.batch_invariant or (x.shape[0] >= self.upcast_min_rows and upcasts_on_cpu(x.dtype))):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


# Measured on x86 CPUs (MKL/oneDNN): float32 GEMMs of fewer than 12 rows take kernels that round a row
# differently from the same row in a larger product; from 12 rows on, each row's result is independent of
# the row count and of its position. Native bf16 GEMMs are not, on every CPU: on Zen 4 (AVX-512 BF16) they
# were, on an Intel Xeon with AMX a 512 -> 3072 row changes at 1 to 33 rows. tests/model/test_batch_invariance.py
# checks the float32 claim on every machine.
BATCH_INVARIANT_MIN_ROWS = 16
# On CUDA, cuBLAS picks a kernel (tile shape, split-K) per problem shape: on an H200 a float32 row changed
# between 1 and 300 rows at every shape of tests/model/test_batch_invariance.py. The batch-invariant mode
# runs GPU products as GEMMs of this many rows each.
DEVICE_INVARIANT_BLOCK_ROWS = 64


def make_batch_invariant(model: nn.Module) -> None:
    """Configure every Linear of `model` so that a row's output never depends on the other rows.

    Low-precision CPU products run in float32 at every row count, and inputs are padded to
    BATCH_INVARIANT_MIN_ROWS rows; GPU products run in blocks of DEVICE_INVARIANT_BLOCK_ROWS rows. A
    compiled GEMV that serves every row count (`use_decode_linear` with `decode_linear_op(every_row=True)`,
    row-invariant by construction) takes the bf16 products before that. Quantized weights are told too
    (QuantizedWeight.batch_invariant).
    """
    from kvstrata.model.quant.base import QuantizedWeight

    for module in model.modules():
        if isinstance(module, Linear):
            module.min_rows = BATCH_INVARIANT_MIN_ROWS
            module.batch_invariant = True
        elif isinstance(module, QuantizedWeight):
            module.batch_invariant = True


def use_decode_linear(model: nn.Module, gemv: Optional[DecodeLinear]) -> None:
    """Route `model`'s bf16 products of up to `gemv.max_rows` rows through `gemv` (paged_kernels.decode_linear_op()).

    Only Linears whose weight the GEMV can read (bf16, contiguous row-major, on CPU) take it, and each keeps ONE
    copy of its weight: a GEMV that reads the row-major weight itself (AVX-512 BF16) leaves it as it is; one
    that reads a packed copy (AVX2 builds, the AMX linear) serves every row count, so the row-major weight is
    released. A weight another module shares (the embedding of a tied lm_head) is never packed into a second
    copy: that Linear keeps the shared weight and its plain products. Batch-invariant mode passes a GEMV that
    serves every row count: one with a row limit sums a row in another order than oneDNN, which serves the
    same row in a larger batch.
    """
    shared = _shared_weights(model)
    for module in model.modules():
        if isinstance(module, Linear):
            w = module.weight
            if module.decode_weight is not None and w.numel() == 0:
                continue   # already served from its packed copy, its only one (moe.use_expert_linear)
            readable = (gemv is not None and module.quantized is None and w.device.type == "cpu"
                        and w.dtype == torch.bfloat16 and w.is_contiguous() and w.numel() > 0)
            packed = None
            if readable:
                with torch.no_grad():
                    packed = gemv.pack(w.detach())
                copy = packed.data_ptr() != w.data_ptr()
                if copy and (id(w) in shared or gemv.max_rows is not None):
                    packed = None     # a second copy would be kept: the plain products instead
            module.decode_gemv = gemv if packed is not None else None
            module.decode_weight = packed
            if packed is not None and packed.data_ptr() != w.data_ptr():
                w.data = torch.empty(0, dtype=w.dtype)   # the packed copy serves every product


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of the parameters a module other than a Linear holds (a tied lm_head's embedding)."""
    return {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}


# Row count oneDNN chooses the prepacked layout for: with it, products of 1 to 2048 rows ran as fast as or
# faster than on the plain weight, with the same bits (an Intel Xeon with AMX; a hint of 1 was slower at 300).
ONEDNN_PACK_ROWS = 16


def onednn_weights_apply(dtype: torch.dtype, deterministic: bool) -> bool:
    """Whether the runner prepacks `dtype` weights for oneDNN (`use_onednn_weights`): bf16 on AMX CPUs whose
    torch has oneDNN and whose ISA oneDNN can reorder bf16 with, outside batch-invariant mode."""
    return (dtype == torch.bfloat16 and not deterministic and cpu_has_amx() and cpu_has_onednn_bf16_reorder()
            and torch.backends.mkldnn.is_available())


def use_onednn_weights(model: nn.Module) -> None:
    """Prepack every bf16 CPU Linear's weight once in oneDNN's blocked layout and run all its products on it.

    `F.linear` reorders a plain weight into that layout on every call: on an AMX CPU ~30% of a 16-stream
    decode step's products (bench model: 6.5 -> 4.5 ms); at one row it is ~7% slower per token than the
    compiled GEMV, which would need a second copy of every weight. The row-major copy is released. A weight
    another module shares (the embedding of a tied lm_head) is not prepacked, which would make a second copy:
    that Linear keeps the shared weight (and the row-major GEMV a runner set on it for decode rows). Not for
    batch-invariant mode: oneDNN's AMX kernels are not row-invariant. Linears that a compiled kernel already
    serves at every row count (moe.use_expert_linear) keep it.
    """
    shared = _shared_weights(model)
    for module in model.modules():
        if isinstance(module, Linear):
            w = module.weight
            if (module.quantized is not None or w.device.type != "cpu" or w.dtype != torch.bfloat16
                    or module.serves_every_row() or id(w) in shared):
                continue
            with torch.no_grad():
                module.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), ONEDNN_PACK_ROWS)
                w.data = torch.empty(0, dtype=w.dtype)
            module.decode_gemv, module.decode_weight = None, None


def use_fused_norms(model: nn.Module, ops: Optional[NormOps]) -> None:
    """Make every RMSNorm of `model` run through the compiled `ops` (paged_kernels.norm_ops()), or stop."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.ops = ops


def upcasts_on_cpu(dtype: torch.dtype) -> bool:
    """Whether CPU matmuls in `dtype` are emulated (bf16/fp16 without AVX-512 BF16 / AMX)."""
    return dtype in _LOW_PRECISION and not _CPU_NATIVE_LOW_PRECISION


class NormOps(NamedTuple):
    """The compiled norms: `rms_norm(x, w, eps)` and `add_rms_norm(x, residual, w, eps) -> (out, x + residual)`."""

    rms_norm: Callable
    add_rms_norm: Callable


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: Optional[NormOps] = None   # compiled one-pass norms (CPU), else F.rms_norm

    def _compiled(self, x: torch.Tensor) -> bool:
        return self.ops is not None and x.dim() == 2 and x.is_contiguous() and x.dtype == self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize `x` `[..., dim]`."""
        if self._compiled(x):
            return self.ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm of `x + residual`, `x + residual`) `[T, dim]`; a None residual counts as zero."""
        if residual is None:
            return self(x), x
        if self._compiled(x) and residual.is_contiguous():
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = residual + x
        return self(residual), residual


# torch's vectorized CPU loops run two vectors at a time (32 float32 values with AVX-512) and a row's remaining
# values on a scalar path whose silu rounds differently. A tensor-parallel rank's slice of the intermediate
# features would put other values on that path than one rank's whole row, so silu runs on rows padded to a
# multiple of this: every value then takes the vector path, whatever the slice (deterministic TP's bits).
SILU_VECTOR_VALUES = 32


class SiluAndMul(nn.Module):
    """silu(gate) * up of a fused `[T, 2 * inter]` gate|up product -> `[T, inter]`."""

    def __init__(self, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        # The compiled one-pass op for bf16 on CPU (see use_fused_activation), or None: torch ops.
        self.op: Optional[Callable] = None

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Apply the activation to `gate_up`."""
        if self.op is not None and gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu":
            return self.op(gate_up)   # same bits as the two torch ops below
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        pad = -self.intermediate_size % SILU_VECTOR_VALUES
        if pad and gate.device.type == "cpu":
            return F.silu(F.pad(gate, (0, pad)))[..., :self.intermediate_size] * up
        return F.silu(gate) * up


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused in one `[2 * inter, hidden]` matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, down_proj: Optional[Linear] = None):
        """`down_proj`: a row-parallel one under tensor parallelism (`intermediate_size` is then this rank's)."""
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = down_proj or Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul(intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` `[T, hidden]`."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


def use_fused_activation(model: nn.Module, silu_and_mul: Optional[Callable]) -> None:
    """Route every SiluAndMul of `model` (dense MLPs and experts) through the compiled op (None: torch ops)."""
    for module in model.modules():
        if isinstance(module, SiluAndMul):
            module.op = silu_and_mul
