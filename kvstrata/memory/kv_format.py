"""The KV cache's storage format (`--kv-cache-dtype`): the model dtype, or FP8 with a K and a V scale per layer.

    stored = saturate(value / scale) as float8          value ~= float(stored) * scale

Saturating: a value beyond the format's largest finite number (448 for e4m3, 57344 for e5m2) is stored as
that number, never as inf / NaN. Attention folds the scales in where they cost nothing: the K scale into
the softmax scale (q . (k * s_k) = (q . k) * s_k), the V scale into the output (sum p (v * s_v) = s_v sum p v).
Scales come from the checkpoint where it has them (model/kv_scales.py), else 1.0.

Everything that must not mix KV of two formats (L3 keys, the L2 snapshot header, the PD handshake) names the
format by `KVFormat.name`: the dtype, plus a digest of the scales when they are FP8's.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

# --kv-cache-dtype's values (SGLang's names) -> the stored dtype; "auto" stores the model dtype.
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ["auto", *FP8_DTYPES]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of the FP8 formats the KV cache stores."""
    return dtype in FP8_DTYPES.values()


@dataclass(frozen=True)
class KVFormat:
    """How the pool stores K/V: `dtype` and, for FP8, one K and one V scale per layer (floats > 0)."""

    dtype: torch.dtype
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    @classmethod
    def of(cls, kv_cache_dtype: str, model_dtype: torch.dtype, num_layers: int,
           scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None) -> KVFormat:
        """The format `--kv-cache-dtype` names for a model; `scales` = (k, v) per layer, or None for 1.0."""
        if kv_cache_dtype == "auto":
            return cls(model_dtype)
        if kv_cache_dtype not in FP8_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        k, v = scales or ((1.0,) * num_layers, (1.0,) * num_layers)
        if len(k) != num_layers or len(v) != num_layers:
            raise ValueError(f"{len(k)} K and {len(v)} V scales for {num_layers} layers")
        return cls(FP8_DTYPES[kv_cache_dtype], tuple(map(float, k)), tuple(map(float, v)))

    @property
    def quantized(self) -> bool:
        """Whether values are stored as FP8 (scaled, saturated)."""
        return is_fp8(self.dtype)

    def k_scale(self, layer: int) -> float:
        """The K scale of `layer` (1.0 unless quantized with a checkpoint scale)."""
        return self.k_scales[layer] if self.quantized else 1.0

    def v_scale(self, layer: int) -> float:
        """The V scale of `layer`."""
        return self.v_scales[layer] if self.quantized else 1.0

    @property
    def scales_digest(self) -> str:
        """16 hex digits of SHA-256 over the scales (float64, K then V), or '' when not quantized."""
        if not self.quantized:
            return ""
        packed = struct.pack(f"<{2 * len(self.k_scales)}d", *self.k_scales, *self.v_scales)
        return hashlib.sha256(packed).hexdigest()[:16]

    @property
    def name(self) -> str:
        """What a namespace names: `torch.bfloat16` as before, `torch.float8_e4m3fn|scales=<digest>` for FP8."""
        return str(self.dtype) if not self.quantized else f"{self.dtype}|scales={self.scales_digest}"

    def store(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """`x` in the stored dtype: for FP8 x / scale, saturated to the format's range, rounded to nearest."""
        if not self.quantized:
            return x.to(self.dtype)
        if scale != 1.0:
            x = x.float() / scale
        limit = torch.finfo(self.dtype).max
        return x.clamp(-limit, limit).to(self.dtype)
