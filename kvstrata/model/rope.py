"""Rotary position embedding (HF "rotate_half" layout) with default, linear and llama3 frequency scaling."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Per-pair rotation frequencies `[head_dim // 2]` (float32, CPU) after `rope_scaling` is applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    original_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < original_context / high_freq_factor) & ~(wavelen > original_context / low_freq_factor)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables for positions 0..n-1, one per device, grown on demand."""

    def __init__(self, head_dim: int, theta: float, scaling: Optional[dict], max_positions: int):
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self.initial_positions = max_positions
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # The compiled one-pass rotation (paged_kernels.rope_op(), CPU), or None: torch ops.
        self.kernel: Optional[Callable] = None

    def _table(self, device: torch.device, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < needed:
            size = max(needed, self.initial_positions, 2 * table[0].shape[0] if table is not None else 0)
            # Same float32 arithmetic as transformers (position * inv_freq, then cos/sin), so tables match.
            freqs = torch.outer(torch.arange(size, dtype=torch.float32), self.inv_freq)
            angles = torch.cat((freqs, freqs), dim=-1)
            table = (angles.cos().to(device), angles.sin().to(device))
            self._tables[device] = table
        return table

    def cos_sin(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, head_dim]` in `dtype` for `positions`; `max_position` bounds them (host int)."""
        cos, sin = self._table(positions.device, max_position + 1)
        return cos[positions].to(dtype), sin[positions].to(dtype)

    def rotation(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> Rotation:
        """The per-token rotation for one forward, shaped to broadcast over heads (built once, used by all layers)."""
        cos, sin = self.cos_sin(positions, max_position, dtype)
        half = self.head_dim // 2
        # rotate_half(x) * sin == swap_halves(x) * [-sin_lo, sin_hi]: fold the sign into the table.
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        kernel = self.kernel if positions.device.type == "cpu" else None
        return Rotation(cos.unsqueeze(1), signed_sin.unsqueeze(1), kernel)


class Rotation(NamedTuple):
    """cos and sign-folded sin `[T, 1, head_dim]` of one forward's tokens, and the kernel that applies them."""

    cos: torch.Tensor
    signed_sin: torch.Tensor
    kernel: Optional[Callable] = None   # rope_rotate(x, cos, signed_sin): the same bits as the torch ops


_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def apply_rotary(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Rotate `x` `[T, heads, head_dim]` (HF rotate_half layout: the two halves form the pairs)."""
    if (rotation.kernel is not None and x.dtype == rotation.cos.dtype and x.dtype in _KERNEL_DTYPES
            and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]):
        return rotation.kernel(x, rotation.cos, rotation.signed_sin)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * rotation.cos, swapped, rotation.signed_sin)


def use_rope_kernel(model: torch.nn.Module, kernel: Optional[Callable]) -> None:
    """Make every rotary embedding of `model` rotate through the compiled `kernel` on CPU (None: torch ops)."""
    for module in model.modules():
        rotary = getattr(module, "rotary", None)
        if isinstance(rotary, RotaryEmbedding):
            rotary.kernel = kernel
