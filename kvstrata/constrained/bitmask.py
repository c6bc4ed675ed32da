"""Token bitmasks: one int32 row per request, bit j of the row set when token j is allowed.

The layout is the one xgrammar and llguidance both use (token j is bit j % 32 of word j // 32),
so every backend shares these helpers; a backend may override `apply` with a faster kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words that cover `vocab_size` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask of `batch_size` rows, all tokens allowed."""
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool tensor `[rows, vocab_size]`: True where the token is allowed."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def allow_only(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """Write a row that allows exactly `token_ids`."""
    words = torch.zeros(bitmask.shape[-1], dtype=torch.int64)
    for token_id in token_ids:
        words[token_id // BITS_PER_WORD] |= 1 << (token_id % BITS_PER_WORD)
    # Bit 31 makes a word negative in int32: wrap the int64 value into the int32 range.
    words = torch.where(words >= 2**31, words - 2**32, words)
    bitmask[row] = words.to(torch.int32)


def keep_mask(vocab_size: int, banned_token_ids: list[int]) -> torch.Tensor:
    """One bitmask row allowing every token but `banned_token_ids` (to AND into filled rows)."""
    row = allocate_bitmask(1, vocab_size)
    disallow(row, 0, banned_token_ids)
    return row[0]


def disallow(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """Clear the bits of `token_ids` in one row."""
    for token_id in token_ids:
        word, bit = divmod(token_id, BITS_PER_WORD)
        if word < bitmask.shape[-1]:
            bitmask[row, word] &= _as_int32(~(1 << bit))


def _as_int32(value: int) -> int:
    """The int32 with the same low 32 bits as `value` (two's complement)."""
    return (value + 2**31) % 2**32 - 2**31


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: Optional[torch.Tensor] = None) -> None:
    """In place: logits of disallowed tokens -> -inf, for `rows` only (all rows when None). Any device."""
    if rows is not None and rows.numel() == 0:
        return
    bitmask = bitmask.to(logits.device)
    vocab_size = min(logits.shape[-1], bitmask.shape[-1] * BITS_PER_WORD)
    if rows is None:
        rows = torch.arange(logits.shape[0], device=logits.device)
    rows = rows.to(device=logits.device, dtype=torch.long)
    allowed = unpack_bitmask(bitmask[rows], vocab_size)
    view = logits[rows, :vocab_size]
    logits[rows, :vocab_size] = view.masked_fill(~allowed, float("-inf"))
