"""ScheduledBatch: the plain batch the scheduler hands to the model runner for one forward step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.runtime.req import Req


@dataclass
class BatchEntry:
    """One sequence of a batch: `extend_len` new tokens of `req` starting at token `start`."""

    req: Req
    start: int                  # == req.kv_len before the forward
    extend_len: int
    sample: bool                # whether this step ends the sequence's fill and samples a next token
    logprob_lo: int = 0         # prompt positions [logprob_lo, logprob_hi) need logits for prompt logprobs
    logprob_hi: int = 0

    @property
    def end(self) -> int:
        """Token index after the last new token."""
        return self.start + self.extend_len


@dataclass
class ScheduledBatch:
    """Sequences to run in one forward; decode entries have extend_len 1."""

    entries: list[BatchEntry]
    layer_wait: object = None   # optional per-layer wait hook for in-flight load-backs

    @property
    def num_tokens(self) -> int:
        """New tokens in the batch."""
        return sum(e.extend_len for e in self.entries)

    def is_empty(self) -> bool:
        """No sequence to run."""
        return not self.entries


@dataclass
class StepResult:
    """What the runner returns for a batch: next tokens and logprob data, aligned with the sampling entries."""

    next_token_ids: list[int]                     # one per entry with sample=True, in entry order
    next_logprobs: list[float] | None             # chosen-token logprob, when any entry asked
    next_top_logprobs: list[list[tuple[float, int]]] | None
    prompt_logprob_rows: dict[int, torch.Tensor]  # entry index -> log_softmax rows for its prompt positions
