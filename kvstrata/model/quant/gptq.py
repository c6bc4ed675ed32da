"""GPTQ checkpoints (`quant_method: gptq`, 4 bits, desc_act false, sym or not), per projection `P`:

    P.qweight  int32 [K/8, N]   eight consecutive input channels a word, in nibble order
    P.qzeros   int32 [K/g, N/8] zero points, eight output channels a word in nibble order, stored as
                                zero - 1 in the v1 format (`checkpoint_format: gptq`), as zero in gptq_v2
    P.scales   fp16  [K/g, N]
    P.g_idx    int32 [K]        the group of each input channel: k // g without act-order (checked)

    w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]      symmetric checkpoints: zero = 8
"""

from __future__ import annotations

import torch

from kvstrata.model.config import ModelLoadError
from kvstrata.model.quant.int4 import unpack_int32

TENSORS = ("qweight", "qzeros", "scales")
OPTIONAL = ("g_idx",)


def decode(tensors: dict[str, torch.Tensor], name: str, group_size: int,
           zero_offset: int) -> tuple[torch.Tensor, ...]:
    """(q `[N, K]` uint8, scales `[K/g, N]`, zeros `[K/g, N]`) of one projection's GPTQ tensors."""
    qweight, qzeros, scales = (tensors[t] for t in TENSORS)
    in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
    groups = in_features // group_size
    expected = {"qweight": (in_features // 8, out_features), "qzeros": (groups, out_features // 8),
                "scales": (groups, out_features)}
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape or in_features % group_size:
            raise ModelLoadError(f"GPTQ tensor {name}.{key} has shape {tuple(tensors[key].shape)}, expected "
                                 f"{shape} (group size {group_size})")
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_features) // group_size):
        raise ModelLoadError(f"GPTQ tensor {name}.g_idx is not k // {group_size}: act-order (desc_act) "
                             f"checkpoints are not supported")
    q = unpack_int32(qweight.t().contiguous()).contiguous()            # [N, K]
    zeros = (unpack_int32(qzeros).to(torch.int16) + zero_offset) & 15   # v1 stores zero - 1 in 4 bits
    return q, scales, zeros
