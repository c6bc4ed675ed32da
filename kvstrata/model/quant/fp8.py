"""FP8 checkpoints (`quant_method: fp8`): e4m3 weights with block or per-tensor scales, per projection `P`:

    block scales (Qwen3-FP8, DeepSeek):  P.weight float8_e4m3fn [N, K], P.weight_scale_inv float32
                                         [ceil(N/bn), ceil(K/bk)] (`weight_block_size: [bn, bk]`)
    per-tensor scale:                    P.weight float8_e4m3fn [N, K], P.weight_scale float32 (one value)
                                         (P.input_scale, a static activation scale, is not needed: see below)

    w[n, k] = weight[n, k] * scale[n // bn, k // bk]

Fp8Weight keeps the e4m3 weight and one float32 scale per output row and input block (`[N, ceil(K/bk)]`:
per-tensor scales are one block as wide as K). Row scales let fused projections (q|k|v, gate|up) be
concatenated whatever their block alignment, at 4/bk bytes a weight. Products:

- CPU (and CUDA without `_scaled_mm`): tiles of TILE_ROWS output rows are scaled into the activation dtype
  and multiplied; the whole matrix is never held in float. In deterministic mode the tiles are float32 and
  inputs are padded to layers.BATCH_INVARIANT_MIN_ROWS rows, as the float Linears do.
- CUDA (compute capability 8.9 or newer) with per-tensor scales: `torch._scaled_mm` on the e4m3 weight, the
  activations quantized to e4m3 per row at run time (dynamic; the checkpoint's input_scale is not used).
  Block scales on CUDA take the tile path. Not exercised by the test suite (no CUDA machine here).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kvstrata.model.config import ModelLoadError
from kvstrata.model.layers import (
    BATCH_INVARIANT_MIN_ROWS,
    DEVICE_INVARIANT_BLOCK_ROWS,
    UPCAST_MIN_ROWS,
    upcasts_on_cpu,
)
from kvstrata.model.parallel import WHOLE, Cut
from kvstrata.model.quant.base import QuantizedWeight, owned

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TILE_ROWS = 256          # output rows scaled per tile (256 x 4096 bf16 = 2 MiB: stays in cache)
SCALE_NAMES = ("weight_scale_inv", "weight_scale")
OPTIONAL = ("input_scale",)


def decode(tensors: dict[str, torch.Tensor], name: str, block: Optional[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """(weight `[N, K]` e4m3, row scales `[N, ceil(K/bk)]` float32) of one projection's FP8 tensors."""
    weight = tensors["weight"]
    if weight.dtype != E4M3 or weight.dim() != 2:
        raise ModelLoadError(f"FP8 tensor {name}.weight is {weight.dtype} {tuple(weight.shape)}, expected a 2-D "
                             f"float8_e4m3fn matrix")
    out_features, in_features = weight.shape
    if block is not None:
        scale = tensors.get("weight_scale_inv")
        expected = (-(-out_features // block[0]), -(-in_features // block[1]))
        if scale is None or tuple(scale.shape) != expected:
            shown = "missing" if scale is None else f"of shape {tuple(scale.shape)}"
            raise ModelLoadError(f"FP8 tensor {name}.weight_scale_inv is {shown}, expected {expected} "
                                 f"(weight_block_size {list(block)})")
        return weight, scale.float().repeat_interleave(block[0], dim=0)[:out_features].contiguous()
    scale = tensors.get("weight_scale")
    if scale is None or scale.numel() != 1:
        shown = "missing" if scale is None else f"of shape {tuple(scale.shape)}"
        raise ModelLoadError(f"FP8 tensor {name}.weight_scale is {shown}, expected one per-tensor scale "
                             f"(or weight_block_size in quantization_config for block scales)")
    return weight, scale.float().reshape(1, 1).expand(out_features, 1).contiguous()


def shard(parts: tuple[torch.Tensor, ...], cut: Cut) -> tuple[torch.Tensor, ...]:
    """A tensor-parallel rank's part of a projection's (weight `[N, K]`, row scales `[N, ceil(K/bk)]`): its output
    rows, or its input columns with their blocks' scales (a cut on a block boundary: check_block_split; one
    scale per row serves any columns)."""
    weight, scales = parts
    block_in = -(-weight.shape[1] // scales.shape[1])
    blocks = WHOLE
    if cut.splits_input and scales.shape[1] > 1:
        blocks = slice(cut.cols.start // block_in, -(-cut.cols.stop // block_in))
    return owned(weight[cut.rows, cut.cols]), owned(scales[cut.rows, blocks])


class Fp8Weight(QuantizedWeight):
    """`[N, K]` e4m3 weight with float32 scales per output row and input block; see the module docstring."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, device: torch.device):
        """weight `[N, K]` float8_e4m3fn, scales `[N, ceil(K/bk)]` float32 (bk = K: one scale per row)."""
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features)
        self.block_in = -(-in_features // scales.shape[1])
        self.register_buffer("weight", weight.to(device))
        self.register_buffer("scales", scales.float().to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, K]` -> `[T, N]` in x's dtype."""
        if self._scaled_mm_applies(x):
            return self._scaled_mm(x)
        if self.batch_invariant:
            return self._forward_invariant(x)
        # Where bf16 products are emulated (no AVX-512 BF16 / AMX), several rows run faster in float32.
        upcast = x.device.type == "cpu" and x.shape[0] >= UPCAST_MIN_ROWS and upcasts_on_cpu(x.dtype)
        return self._forward_tiles(x, torch.float32 if upcast else x.dtype)

    def _forward_tiles(self, x: torch.Tensor, compute: torch.dtype, whole_tiles: bool = False) -> torch.Tensor:
        """`whole_tiles`: a last tile of fewer rows is zero-padded to TILE_ROWS, so every GEMM has one shape and an
        output feature's bits do not depend on how many features the weight has (a tensor-parallel shard)."""
        xc = x.to(compute)
        parts = []
        for r in range(0, self.out_features, TILE_ROWS):
            tile = self._tile(r, min(r + TILE_ROWS, self.out_features), compute)
            if whole_tiles and tile.shape[0] < TILE_ROWS:
                parts.append(F.linear(xc, F.pad(tile, (0, 0, 0, TILE_ROWS - tile.shape[0])))[:, :tile.shape[0]])
            else:
                parts.append(F.linear(xc, tile))
        return torch.cat(parts, dim=-1).to(x.dtype)

    def _forward_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 tiles over a fixed number of rows per GEMM, so a row's bits never depend on the batch (nor an
        output feature's on the shard it is in: whole tiles)."""
        rows = x.shape[0]
        if x.device.type == "cpu":
            padded = F.pad(x, (0, 0, 0, max(0, BATCH_INVARIANT_MIN_ROWS - rows)))
            return self._forward_tiles(padded, torch.float32, whole_tiles=True)[:rows]
        block = DEVICE_INVARIANT_BLOCK_ROWS
        parts = [self._forward_tiles(part, torch.float32, whole_tiles=True)
                 for part in F.pad(x, (0, 0, 0, -rows % block)).split(block)]
        return torch.cat(parts)[:rows]

    def _tile(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Output rows [start, end) scaled into `dtype` (float32 arithmetic, one rounding)."""
        w = self.weight[start:end].float()
        scales = self.scales[start:end]
        if self.in_features % self.block_in == 0:
            w = (w.view(end - start, scales.shape[1], self.block_in) * scales.unsqueeze(-1)).view(end - start, -1)
        else:
            w = w * scales.repeat_interleave(self.block_in, dim=1)[:, :self.in_features]
        return w.to(dtype)

    def _scaled_mm_applies(self, x: torch.Tensor) -> bool:
        """CUDA with FP8 tensor cores (8.9+), one scale per row, shapes _scaled_mm takes, not deterministic mode."""
        return (x.device.type == "cuda" and not self.batch_invariant and self.scales.shape[1] == 1
                and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(x.device) >= (8, 9)
                and self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x quantized to e4m3 per row, then one FP8 GEMM with row-wise scales on both sides (bf16 out)."""
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
        x_scale = amax / E4M3_MAX
        xq = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.scales.view(1, -1),
                               out_dtype=torch.bfloat16)
        return out.to(x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[N, K]` in `dtype`."""
        return self._tile(0, self.out_features, dtype)
