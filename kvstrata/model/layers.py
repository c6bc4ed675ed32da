"""Building blocks shared by the Llama-family layers: Linear, RMSNorm and the gated SiLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstrata.args import cpu_has_fast_bf16

# On a CPU without native bf16/fp16 matmul (no AVX-512 BF16 / AMX), oneDNN emulates low-precision
# GEMMs several times slower than float32 ones. Above this many rows a matmul is compute-bound, so
# converting to float32 (weights are cheap to convert next to the GEMM) is faster; fewer rows are
# memory-bound and read the half-size weights natively.
UPCAST_MIN_ROWS = 32
_CPU_NATIVE_LOW_PRECISION = cpu_has_fast_bf16()
_LOW_PRECISION = (torch.bfloat16, torch.float16)


class Linear(nn.Linear):
    """nn.Linear that runs large low-precision CPU matmuls in float32 where the CPU lacks native support.

    Same inputs, same fp32 accumulation as oneDNN's bf16 GEMM, one rounding of the output.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in]` -> `[T, out]`."""
        if (x.dtype in _LOW_PRECISION and not _CPU_NATIVE_LOW_PRECISION and x.shape[0] >= UPCAST_MIN_ROWS
                and x.device.type == "cpu"):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize `x` `[..., dim]`."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused in one `[2 * inter, hidden]` matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to `x` `[T, hidden]`."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
