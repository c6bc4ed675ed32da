"""Inputs that check silu(gate) * up against torch for every bf16 gate value (no kvstrata op is loaded here:
a subprocess that builds its own copy of the kernel imports it too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def every_gate_value(inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [T, 2I] whose gates hold all 65,536 bf16 bit patterns (random up values), and torch's result."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    rows = -(-every.numel() // inter)
    gate = torch.cat([every, every[:rows * inter - every.numel()]]).view(rows, inter)
    up = (torch.randn(rows, inter, generator=torch.Generator().manual_seed(inter)) * 3).to(torch.bfloat16)
    x = torch.cat([gate, up], dim=1)
    return x, F.silu(x[:, :inter]) * x[:, inter:]


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit, NaN payloads aside."""
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
