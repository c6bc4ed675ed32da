"""ForwardMetadata: what one forward pass needs to know about its batch besides token ids and positions.

A batch is a list of sequences; sequence i contributes `extend_lens[i]` new tokens (1 for a decode step,
the uncached suffix or a chunk of it for a prefill) that follow `prefix_lens[i]` tokens already in the KV
pool. Token rows of `input_ids` / `positions` are the sequences' new tokens concatenated in batch order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class ForwardMetadata:
    """Per-forward batch layout. Built once by the ModelRunner; read by every attention layer."""

    extend_lens: list[int]            # new tokens per sequence
    prefix_lens: list[int]            # tokens already in the pool per sequence
    kv_slots: list[torch.Tensor]      # per sequence: slot of every token 0..prefix+extend-1 (long)
    out_slots: torch.Tensor           # slot of each new token, concatenated in batch order (long)
    logits_indices: torch.Tensor      # rows (into the new tokens) whose logits the caller needs (long)
    # Called with the layer id before that layer reads the pool: lets the L2 tier finish loading layer i
    # while layer i-1 computes. None when nothing is in flight.
    layer_wait: Optional[Callable[[int], None]] = None
    # Batch-invariant kernels (--enable-deterministic-inference): each row's result is independent of the
    # rest of the batch, of chunking and of cache hits.
    batch_invariant: bool = False
    # The compiled CPU paged-attention op (model/paged_kernels.py: the float32 kernel, or its bf16 variant in the
    # default mode), or None for the plain-torch path. With it, decode rows (and, when batch_invariant, every
    # row) read K/V in place; its rows are batch-invariant.
    paged_kernel: Optional[Callable] = None
    # The compiled bf16 extend-attention op (AVX-512 BF16 CPUs, default mode), or None: extend rows (prompt
    # tokens, after a cached prefix or none) then read K/V in place instead of SDPA over gathered keys.
    extend_kernel: Optional[Callable] = None
    # Derived tensors cached by the attention backend for this forward (e.g. padded decode slots).
    cache: dict = field(default_factory=dict)

    @property
    def seq_lens(self) -> list[int]:
        """Total tokens per sequence after this forward."""
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def num_tokens(self) -> int:
        """Number of new tokens in the batch."""
        return sum(self.extend_lens)
