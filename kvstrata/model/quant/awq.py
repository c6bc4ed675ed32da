"""AWQ checkpoints (`quant_method: awq`, GEMM layout, 4 bits), per projection `P`:

    P.qweight  int32 [K, N/8]   eight output channels a word, nibble i holding channel AWQ_ORDER[i] of the eight
    P.qzeros   int32 [K/g, N/8] zero points, packed the same way
    P.scales   fp16  [K/g, N]

    w[n, k] = (q[k, n] - zero[k // g, n]) * scale[k // g, n]
"""

from __future__ import annotations

import torch

from kvstrata.model.config import ModelLoadError
from kvstrata.model.quant.int4 import unpack_int32

TENSORS = ("qweight", "qzeros", "scales")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)            # channel j of eight sits in nibble AWQ_ORDER.index(j)
_UNPACK = tuple(AWQ_ORDER.index(j) for j in range(8))


def decode(tensors: dict[str, torch.Tensor], name: str, group_size: int) -> tuple[torch.Tensor, ...]:
    """(q `[N, K]` uint8, scales `[K/g, N]`, zeros `[K/g, N]`) of one projection's AWQ tensors."""
    qweight, qzeros, scales = (tensors[t] for t in TENSORS)
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    groups = in_features // group_size
    expected = {"qweight": (in_features, out_features // 8), "qzeros": (groups, out_features // 8),
                "scales": (groups, out_features)}
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape or in_features % group_size:
            raise ModelLoadError(f"AWQ tensor {name}.{key} has shape {tuple(tensors[key].shape)}, expected {shape} "
                                 f"(group size {group_size})")
    q = unpack_int32(qweight, _UNPACK).t().contiguous()
    return q, scales, unpack_int32(qzeros, _UNPACK)
