"""Int8Weight: weight-only int8 with one scale per output channel (`--quantization int8`, quantized at load).

    scale[n] = max_k |w[n, k]| / 127        q[n, k] = round(w[n, k] / scale[n])  in -127..127
    x @ W.T  = (x @ q.T) * scale            CPU: aten._weight_int8pack_mm (row-invariant, measured), or
                                            de-quantized tiles for large products outside deterministic mode

A float checkpoint is quantized one tensor at a time as it is read (loader.py), so the float weights are
never all in memory. Other devices de-quantize tiles of output rows per product.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kvstrata.model.parallel import WHOLE, Cut
from kvstrata.model.quant.base import QuantizedWeight

TILE_ROWS = 512
KERNEL_MAX_ROWS = 32      # rows up to which the int8 kernel beats de-quantized tiles + GEMM (measured: even at 16)
QUANTIZE_ROWS = 256       # rows converted to float32 at a time while quantizing (bounds the transient copies)


def quantize(weight: torch.Tensor, cut: Optional[Cut] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q `[N, K]` int8, scales `[N]` float32) of a float weight `[N, K]`, QUANTIZE_ROWS rows at a time.

    `cut`: only a tensor-parallel rank's rows and columns are quantized, with the scales of the whole rows
    (every TP size then serves the same int8 weights)."""
    rows, cols = (weight, WHOLE) if cut is None else (weight[cut.rows], cut.cols)
    q = torch.empty(rows[:, cols].shape, dtype=torch.int8)
    scales = torch.empty(rows.shape[0], dtype=torch.float32)
    for start in range(0, rows.shape[0], QUANTIZE_ROWS):
        chunk = rows[start:start + QUANTIZE_ROWS].float()
        scale = chunk.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q[start:start + QUANTIZE_ROWS] = torch.round(chunk[:, cols] / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[start:start + QUANTIZE_ROWS] = scale
    return q, scales


class Int8Weight(QuantizedWeight):
    """`[N, K]` int8 weight with per-output-channel scales (held in the model dtype, as the kernel takes them)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, device: torch.device):
        out_features, in_features = q.shape
        super().__init__(in_features, out_features)
        self.register_buffer("weight", q.to(device))
        self.register_buffer("scales", scales.to(dtype).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, K]` -> `[T, N]` in x's dtype.

        CPU: torch's int8 kernel up to KERNEL_MAX_ROWS rows (decode: it reads each weight byte once); larger
        products (prefill) de-quantize tiles and run the library's GEMM, ~3.5x faster at 256 rows. In
        deterministic mode every product takes the kernel (row-invariant: a row's bits never depend on the
        batch), at the kernel's prefill speed.
        """
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        if x.device.type == "cpu" and (self.batch_invariant or x.shape[0] <= KERNEL_MAX_ROWS):
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, scales)
        return torch.cat([F.linear(x, self.weight[r:r + TILE_ROWS] * scales[r:r + TILE_ROWS, None])
                          for r in range(0, self.out_features, TILE_ROWS)], dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[N, K]` in `dtype`."""
        return (self.weight.float() * self.scales.float()[:, None]).to(dtype)
