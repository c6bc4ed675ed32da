"""The reference the attention kernel tests compare against: float32 causal SDPA in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """float32 SDPA of queries at positions first_pos.. over keys 0..L-1 (causal), `[n, H, D]`."""
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= torch.arange(first_pos, first_pos + n)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], attn_mask=allowed, enable_gqa=True)
    return out[0].transpose(0, 1)
