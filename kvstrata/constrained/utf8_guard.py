"""SurrogateGuard: keeps UTF-8-encoded surrogates (U+D800..U+DFFF) out of constrained output.

xgrammar 0.2.9 accepts the bytes ED A0..BF 80..BF as one character (a surrogate code point) wherever
its character classes reach that range (`.`, `[^"]`, JSON string characters...). UTF-8 forbids them:
the client would get three U+FFFD characters instead of the text that matched, which breaks a
`maxLength`, a `.{n}` or a pattern. A surrogate always starts with the lead byte ED followed by
A0..BF, so: tokens holding that pair are banned outright, and after a token that ends with a bare ED
the next token must not start with A0..BF. Works on token bytes, whatever the grammar.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from kvstrata.constrained import bitmask as bitmask_ops

_SURROGATE_START = re.compile(rb"\xed[\xa0-\xbf]")
_LEAD = 0xED
_SURROGATE_SECOND = range(0xA0, 0xC0)


class SurrogateGuard:
    """Per-vocabulary tables; the per-request state is one bool: "the text ends with a bare ED byte"."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int):
        token_bytes = [bytes(b) for b in token_bytes[:vocab_size]]
        self.banned_token_ids = [i for i, b in enumerate(token_bytes) if _SURROGATE_START.search(b)]
        self._bad_after_lead = {i for i, b in enumerate(token_bytes) if b and b[0] in _SURROGATE_SECOND}
        self.after_lead_mask: torch.Tensor = bitmask_ops.keep_mask(vocab_size, sorted(self._bad_after_lead))
        self._ends_with_lead = {i for i, b in enumerate(token_bytes) if b and b[-1] == _LEAD}
        self._empty = {i for i, b in enumerate(token_bytes) if not b}

    def allows(self, after_lead: bool, token_id: int) -> bool:
        """Whether `token_id` may follow text whose state is `after_lead`."""
        return not (after_lead and token_id in self._bad_after_lead)

    def next_state(self, after_lead: bool, token_id: int) -> bool:
        """The state once `token_id` was accepted."""
        if token_id in self._empty:
            return after_lead
        return token_id in self._ends_with_lead

    def restrict(self, bitmask: torch.Tensor, row: int, after_lead: bool) -> None:
        """Clear the tokens that would complete a surrogate from a filled row."""
        if after_lead:
            bitmask[row] &= self.after_lead_mask
