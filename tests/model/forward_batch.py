"""Test-side batch builder: gives sequences scattered pool pages and builds ForwardMetadata for a step."""

from __future__ import annotations

import random

import torch

from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.model.forward_meta import ForwardMetadata
from tests.device import TEST_DEVICE


class PagedSequences:
    """Tracks the slots of several sequences in a DeviceKVPool; pages are handed out in random order.

    `scatter=True` hands out single slots in random order instead, breaking the page-order invariant
    (to exercise the slot-by-slot gather); `shuffle=False` hands out pages in ascending order, so a lone
    sequence's slots form one range (read in place).
    """

    def __init__(self, pool: DeviceKVPool, seed: int = 0, scatter: bool = False, shuffle: bool = True):
        self.pool = pool
        self.free_pages = list(range(pool.num_pages - 1, 0, -1))  # pop() gives ascending ids; page 0 reserved
        self.free_slots = list(range(pool.page_size, pool.num_slots))
        if shuffle:
            random.Random(seed).shuffle(self.free_pages)
        random.Random(seed).shuffle(self.free_slots)
        self.scatter = scatter
        self.slots: dict[int, list[int]] = {}
        self.paged_kernel = None        # set to the compiled op to run attention through it
        self.extend_kernel = None       # set to the compiled bf16 extend op
        self.batch_invariant = False

    def _append_slots(self, seq: int, count: int) -> list[int]:
        slots = self.slots.setdefault(seq, [])
        page_size = self.pool.page_size
        new = []
        for _ in range(count):
            if self.scatter:
                slots.append(self.free_slots.pop())
            elif len(slots) % page_size == 0:
                page = self.free_pages.pop()
                slots.append(page * page_size)
            else:
                slots.append(slots[-1] + 1)
            new.append(slots[-1])
        return new

    def batch(self, chunks: list[tuple[int, list[int]]], logits: str = "all"
              ) -> tuple[torch.Tensor, torch.Tensor, ForwardMetadata]:
        """(input_ids, positions, meta) for one forward of `chunks` = [(sequence id, new token ids)].

        `logits`: "all" rows, or "last" row of each sequence.
        """
        dev = self.pool.device
        ids, positions, out_slots, logits_rows = [], [], [], []
        prefix_lens, extend_lens, kv_slots = [], [], []
        for seq, tokens in chunks:
            prefix = len(self.slots.get(seq, []))
            out_slots += self._append_slots(seq, len(tokens))
            rows = range(len(ids), len(ids) + len(tokens))
            logits_rows += list(rows) if logits == "all" else [rows[-1]]
            ids += tokens
            positions += range(prefix, prefix + len(tokens))
            prefix_lens.append(prefix)
            extend_lens.append(len(tokens))
            kv_slots.append(torch.tensor(self.slots[seq], dtype=torch.long, device=dev))
        meta = ForwardMetadata(extend_lens=extend_lens, prefix_lens=prefix_lens, kv_slots=kv_slots,
                               out_slots=torch.tensor(out_slots, dtype=torch.long, device=dev),
                               logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
                               batch_invariant=self.batch_invariant, paged_kernel=self.paged_kernel,
                               extend_kernel=self.extend_kernel)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta)


def make_pool(model_config, num_pages: int = 64, page_size: int = 4,
              dtype: torch.dtype = torch.float32, device: torch.device = TEST_DEVICE) -> DeviceKVPool:
    """A pool shaped for `model_config` (on the test device unless told otherwise)."""
    return DeviceKVPool(num_pages, page_size, model_config.num_layers, model_config.num_kv_heads,
                        model_config.head_dim, dtype, device)
