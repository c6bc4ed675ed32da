"""GGUF tensors held in their own block format: GGUFWeight (a QuantizedWeight over the raw blocks),
GGUFStack (a fused projection whose parts have different types) and GGUFEmbedding (row gather + de-quantize).

Products run through the compiled kernels (csrc/quant_gguf.cpp) when `use_gguf_kernels` gave them: up to
GEMV_MAX_ROWS rows (GEMV_MAX_ROWS_INT8 on 8-bit activations: decode) a GEMV that reads the blocks once, in the
variant the kernel library picks per type (variant 0: integer dot products on the activation quantized to 8
bits, or blocks de-quantized in registers, whichever measured faster on the CPU kind, docs/benchmarks.md issue
47) where INT8_ACTIVATIONS is on (the default) and the model is not float32; float32 models multiply the
activation as it is (blocks de-quantized in registers), so that their products are the float products of the
de-quantized weights; more rows
(prefill) de-quantize GEMM_TILE_ROWS output rows at a time into a bf16/float32 tile for torch's GEMM. In
batch-invariant mode every row count takes the GEMV, whose rows are independent by construction. Without
kernels, the plain-torch de-quantizer (gguf_blocks) and F.linear compute the same product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.model.quant.base import QuantizedWeight
from kvstrata.model.quant.gguf_blocks import FLOAT_TYPES, BlockFormat, dequantize_rows

# Whether bf16/fp16 models' GEMVs quantize the activation to 8 bits, as llama.cpp does for every quantized
# product: 1.2-3.3x faster per product (docs/benchmarks.md, issue 47). Measured on SmolLM2-135M Q4_1 against its
# float32 de-quantized reference, 8 prompts x 64 teacher-forced tokens: 98.6% agreement as served, 95.3% with
# every product 8-bit (deterministic mode); llama.cpp on the same file 96.7-97.5%. float32 models keep exact
# float products (`--dtype float32` is the opt-out).
INT8_ACTIVATIONS = True
# Rows up to which the GEMV beats de-quantizing tiles for a GEMM (decode batches), on float activations and on
# 8-bit ones (whose kernel keeps up to 16 rows' accumulators in registers); see docs/benchmarks.md, issue 47.
GEMV_MAX_ROWS = 8
GEMV_MAX_ROWS_INT8 = 16
# Output rows de-quantized per GEMM tile: a few MB of weight, reused by every input row while in cache.
GEMM_TILE_ROWS = 512
# Batch-invariant mode without kernels: float32 GEMMs of at least this many rows sum a row in one order
# (layers.BATCH_INVARIANT_MIN_ROWS, checked by tests/model/test_batch_invariance.py).
_INVARIANT_MIN_ROWS = 16


class GGUFKernels(NamedTuple):
    """The compiled ops (paged_kernels.gguf_ops()): `gemv(x [T, K], blocks, type, variant) -> [T, N]` in x's
    dtype (f32, bf16 or fp16, computed in f32; variant 0: the build's choice for the type;
    paged_kernels.GGUF_VARIANT_NAMES), `dequantize(blocks, type, K) -> [R, K]` f32."""

    gemv: object
    dequantize: object
    # (type, K, int8_activations) -> the variant to run (paged_kernels.gguf_best_variant); None: variant 0
    best_variant: object = None


class GGUFWeight(QuantizedWeight):
    """An `[out, in]` weight as GGUF blocks: `blocks` `[out, in / block_size * type_size]` uint8, row-major."""

    def __init__(self, blocks: torch.Tensor, fmt: BlockFormat, in_features: int):
        super().__init__(in_features, blocks.shape[0])
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != fmt.row_bytes(in_features):
            raise ValueError(f"{fmt.name} blocks of {in_features} values per row must be [rows, "
                             f"{fmt.row_bytes(in_features)}] uint8, got {tuple(blocks.shape)} {blocks.dtype}")
        self.register_buffer("blocks", blocks, persistent=False)
        self.fmt = fmt
        self.kernels: Optional[GGUFKernels] = None
        self._variants: dict[bool, int] = {}   # int8 activations? -> GEMV variant (one per build)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, in_features={self.in_features}, out_features={self.out_features}"

    def _compiled(self, x: torch.Tensor) -> bool:
        return self.kernels is not None and x.device.type == "cpu" and self.fmt.type_id not in FLOAT_TYPES

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense `[out, in]` weight (plain torch)."""
        return self.dequantize_rows(0, self.out_features).to(dtype)

    def dequantize_rows(self, start: int, end: int, compiled: bool = False) -> torch.Tensor:
        """Rows [start, end) de-quantized to float32 (by the kernel when `compiled` and available)."""
        part = self.blocks[start:end]
        if compiled and self.kernels is not None and self.fmt.type_id not in FLOAT_TYPES:
            return self.kernels.dequantize(part, self.fmt.type_id, self.in_features)
        return dequantize_rows(part, self.fmt, self.in_features)

    def gather(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` de-quantized to `dtype` (an embedding lookup): only those rows are expanded."""
        part = self.blocks.index_select(0, ids.reshape(-1))
        if self._compiled(part) and self.kernels is not None:
            rows = self.kernels.dequantize(part, self.fmt.type_id, self.in_features)
        else:
            rows = dequantize_rows(part, self.fmt, self.in_features)
        return rows.to(dtype).reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in]` -> `x @ W.T` `[T, out]` in x's dtype."""
        rows = x.shape[0]
        int8 = INT8_ACTIVATIONS and x.dtype != torch.float32
        if self._compiled(x) and (self.batch_invariant or rows <= (GEMV_MAX_ROWS_INT8 if int8 else GEMV_MAX_ROWS)):
            variant = self._gemv_variant(int8_activations=int8)
            return self.kernels.gemv(x, self.blocks, self.fmt.type_id, variant)
        return self._forward_tiles(x, compiled=self._compiled(x))

    def _gemv_variant(self, int8_activations: bool) -> int:
        """The GEMV variant for this weight's type and width: the fastest, or the fastest on the float activation."""
        if int8_activations not in self._variants:
            best = self.kernels.best_variant if self.kernels is not None else None
            self._variants[int8_activations] = 0 if best is None else int(
                best(self.fmt.type_id, self.in_features, int8_activations))
        return self._variants[int8_activations]

    def _forward_tiles(self, x: torch.Tensor, compiled: bool) -> torch.Tensor:
        """The product as GEMMs over de-quantized tiles of output rows."""
        from kvstrata.model.layers import upcasts_on_cpu

        rows = x.shape[0]
        wide = self.batch_invariant or x.dtype == torch.float32 or upcasts_on_cpu(x.dtype)
        compute = torch.float32 if wide else x.dtype
        xc = x.to(compute)
        if self.batch_invariant and rows < _INVARIANT_MIN_ROWS:
            xc = F.pad(xc, (0, 0, 0, _INVARIANT_MIN_ROWS - rows))
        out = torch.empty(xc.shape[0], self.out_features, dtype=compute, device=x.device)
        for start in range(0, self.out_features, GEMM_TILE_ROWS):
            end = min(start + GEMM_TILE_ROWS, self.out_features)
            tile = self.dequantize_rows(start, end, compiled).to(device=x.device, dtype=compute)
            out[:, start:end] = F.linear(xc, tile)
        return out[:rows].to(x.dtype)


class GGUFStack(QuantizedWeight):
    """A fused projection (q|k|v, gate|up) whose parts are stored in different GGUF types: one product per
    part, outputs side by side."""

    def __init__(self, parts: Sequence[GGUFWeight]):
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts))
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in]` -> `[T, out]`: the parts' products, concatenated."""
        return torch.cat([part(x) for part in self.parts], dim=1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense `[out, in]` weight."""
        return torch.cat([part.dequantize(dtype) for part in self.parts])


class GGUFEmbedding(nn.Module):
    """An input embedding whose table stays in its GGUF type: a lookup de-quantizes only the rows it reads
    (a tied lm_head shares the same GGUFWeight)."""

    def __init__(self, weight: GGUFWeight, dtype: torch.dtype):
        super().__init__()
        self.table = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids `[T]` -> `[T, hidden]` in the model dtype."""
        return self.table.gather(ids, self.dtype)


def use_gguf_kernels(model: nn.Module, kernels: Optional[GGUFKernels]) -> None:
    """Route every GGUFWeight of `model` through the compiled `kernels` (None: the plain-torch path)."""
    for module in model.modules():
        if isinstance(module, GGUFWeight):
            module.kernels = kernels
            module._variants.clear()
