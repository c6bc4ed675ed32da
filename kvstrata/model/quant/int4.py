"""Int4Weight: 4-bit weights with one scale and zero point per group of input channels (AWQ, GPTQ).

    w[n, k] = (q[n, k] - zero[k // g, n]) * scale[k // g, n]          q, zero in 0..15

On CPU the weight is packed once for torch's int4 kernel (`aten._weight_int4pack_mm_for_cpu`), whose
convention is `w = (q - 8) * scale + bias` per group: bias = (8 - zero) * scale, held with the scale in one
`[K/g, N, 2]` tensor. Its products were measured row-invariant (a row's bits do not depend on the batch), so
deterministic mode needs nothing more. Other devices hold two nibbles a byte and de-quantize tiles of output
rows per product (no whole-matrix float copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstrata.model.parallel import WHOLE, Cut
from kvstrata.model.quant.base import QuantizedWeight, owned

CPU_PACK_ROWS = 16        # the CPU int4 kernel packs output rows in blocks of this many
TILE_ROWS = 512           # output rows de-quantized per tile on devices without the CPU kernel


class Int4Weight(QuantizedWeight):
    """`[N, K]` int4 weight, group scales and zero points; see the module docstring."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                 device: torch.device, cpu_kernel: bool = True):
        """q `[N, K]` (uint8, 0..15), scales and zeros `[K/g, N]` (zeros as integers 0..15, any dtype).
        `cpu_kernel=False`: the tile path even on CPU (also taken where N is not a multiple of 16)."""
        out_features, in_features = q.shape
        super().__init__(in_features, out_features)
        self.group_size = in_features // scales.shape[0]
        self.cpu_kernel = cpu_kernel and torch.device(device).type == "cpu" and out_features % CPU_PACK_ROWS == 0
        scales = scales.float()
        if self.cpu_kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            bias = (8.0 - zeros.float()) * scales
            self.register_buffer("packed", packed)
            self.register_buffer("scale_bias", torch.stack([scales, bias], dim=-1).to(dtype).contiguous())
        else:
            self.register_buffer("nibbles", (q[:, 0::2] | (q[:, 1::2] << 4)).to(device))
            self.register_buffer("scales", scales.to(dtype).to(device))
            self.register_buffer("zeros", zeros.to(torch.uint8).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, K]` -> `[T, N]` in x's dtype."""
        if self.cpu_kernel:
            scale_bias = self.scale_bias if self.scale_bias.dtype == x.dtype else self.scale_bias.to(x.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size,
                                                              scale_bias)
        return torch.cat([F.linear(x, self._tile(r, min(r + TILE_ROWS, self.out_features), x.dtype))
                          for r in range(0, self.out_features, TILE_ROWS)], dim=-1)

    def _tile(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Output rows [start, end) de-quantized to `dtype` (float32 arithmetic, one rounding)."""
        packed = self.nibbles[start:end]
        q = torch.stack([packed & 15, packed >> 4], dim=-1).view(end - start, self.in_features).float()
        scales = self.scales[:, start:end].float().t().repeat_interleave(self.group_size, dim=1)
        zeros = self.zeros[:, start:end].float().t().repeat_interleave(self.group_size, dim=1)
        return ((q - zeros) * scales).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[N, K]`; on CPU read back through the kernel (x = I gives W.T exactly in float32)."""
        if not self.cpu_kernel:
            return self._tile(0, self.out_features, dtype)
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return self(eye).t().contiguous().to(dtype)


def shard(parts: tuple[torch.Tensor, ...], cut: Cut) -> tuple[torch.Tensor, ...]:
    """A tensor-parallel rank's part of a projection's (q `[N, K]`, scales `[K/g, N]`, zeros `[K/g, N]`): its
    output rows, or its input columns with their groups (a cut on a group boundary: check_block_split)."""
    q, scales, zeros = parts
    group = q.shape[1] // scales.shape[0]
    groups = slice(cut.cols.start // group, cut.cols.stop // group) if cut.splits_input else WHOLE
    return owned(q[cut.rows, cut.cols]), owned(scales[groups, cut.rows]), owned(zeros[groups, cut.rows])


def unpack_int32(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words of eight 4-bit values along the last dim -> uint8 `[..., 8 * n]`; value j of a word is nibble
    `order[j]` (AWQ interleaves its nibbles, GPTQ stores them in sequence)."""
    shifts = torch.tensor([4 * i for i in order], dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & 15
    return values.flatten(-2).to(torch.uint8)
