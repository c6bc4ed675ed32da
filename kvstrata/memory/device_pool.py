"""DeviceKVPool: the L1 KV cache, per-layer K and V tensors addressed by slot.

Slot s of layer l holds the key and value of one token: `k_buffer[l][s]` is `[num_kv_heads, head_dim]`.
Slots are grouped in pages of `page_size` consecutive slots (page p owns slots p*P .. p*P+P-1).
Page 0 is never handed out: padded positions of a batch write there, so no real page is touched.
The pool stores its `kv_format` (memory/kv_format.py): the model dtype, or FP8 written scaled and saturated.
The pool holds memory and copies pages in and out; it has no policy (allocation is the allocator's job).
"""

from __future__ import annotations

import torch

from kvstrata.memory.kv_format import KVFormat


class DeviceKVPool:
    """Per-layer K/V storage for `num_pages` pages of `page_size` tokens (page 0 reserved)."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, kv_format: KVFormat | None = None):
        """`dtype`: the stored dtype; `kv_format` (its scales, for FP8) defaults to `dtype` unscaled."""
        self.kv_format = kv_format or KVFormat(dtype)
        if self.kv_format.dtype != dtype:
            raise ValueError(f"kv_format stores {self.kv_format.dtype}, the pool {dtype}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        """Total slots, including the reserved page 0."""
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K+V one token takes over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K+V per token for a model shape, before a pool exists (for sizing)."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V of new tokens (`[n, kv_heads, head_dim]`) into `slots` of one layer (distinct slots)."""
        # index_copy_, not `buffer[slots] = k`: the same rows written at about half the dispatch cost (CPU).
        # FP8 is copied as bytes: torch has no index_copy_ for float8 on CPU.
        fmt = self.kv_format
        k = fmt.store(k, fmt.k_scale(layer_id))
        v = fmt.store(v, fmt.v_scale(layer_id))
        if fmt.quantized:
            self.k_buffer[layer_id].view(torch.uint8).index_copy_(0, slots, k.view(torch.uint8))
            self.v_buffer[layer_id].view(torch.uint8).index_copy_(0, slots, v.view(torch.uint8))
        else:
            self.k_buffer[layer_id].index_copy_(0, slots, k)
            self.v_buffer[layer_id].index_copy_(0, slots, v)

    def get_kv(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V of `slots` of one layer (a copy)."""
        return self.k_buffer[layer_id][slots], self.v_buffer[layer_id][slots]
