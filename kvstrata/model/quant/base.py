"""The seam between a Linear and a weight held quantized.

A quantized Linear keeps exactly one copy of its weight: the format's own tensors (blocks, scales, zero
points), registered as buffers of a QuantizedWeight submodule so that `model.to(device)` moves them. The
Linear's float `weight` parameter is then empty. Each format (GGUF block types, AWQ/GPTQ int4, FP8,
int8) subclasses QuantizedWeight and runs the product with its own kernels; `dequantize()` is the
plain-torch reference the kernels are tested against.
"""

from __future__ import annotations

import torch
from torch import nn


class QuantizedWeight(nn.Module):
    """An `[out_features, in_features]` weight in a quantized format, with the product `x @ W.T`.

    `batch_invariant` is set by layers.make_batch_invariant: a format whose kernel is not row-invariant by
    construction then computes every row the same way whatever the batch (as the float Linears do).
    """

    batch_invariant: bool = False

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, in]` (float) -> `[T, out]` in x's dtype, without bias. Each row's result must not depend
        on the other rows (batch-invariant inference)."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense `[out, in]` tensor (the reference; never kept by the runtime)."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes this weight holds in memory (all of its buffers)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


def owned(part: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a slice (a shard must not keep the whole tensor it was cut from alive)."""
    return part.clone(memory_format=torch.contiguous_format)
