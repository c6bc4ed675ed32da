"""Req: one generation request inside the scheduler, from admission to finish.

Token bookkeeping of a request (all lengths in tokens):

    fill_ids  = prompt + output          tokens whose KV the request needs before its next decode
    kv_len    = tokens whose KV is already in the device pool (cached prefix + computed)

Its KV state (slot-table row, slots, the locked cached prefix) is a handle owned by the cache (`kv`);
`row`, `kv_len` and `slot_len` read it.

A request is in prefill while kv_len < len(fill_ids) - 1 and decodes one token per step after that.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvstrata.runtime.sampling_params import SamplingParams


class ReqState(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Req:
    """A request as the scheduler tracks it."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    namespace: Optional[str] = None
    priority: int = 0               # higher = more important (a client's value, flipped by the scheduler if
                                    # --schedule-low-priority-values-first); queue order and tree eviction

    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    finish_reason: Optional[dict] = None
    kv: Any = None                  # the KV handle (kvstrata.cache.kv_handle): created and written by the cache
    cached_tokens: int = 0          # prompt tokens served from the cache at (first) admission
    retractions: int = 0
    paused_for: Optional[Req] = None   # the waiting request this one was paused for (it resumes after it starts)
    # Sampling state
    generator: Optional[torch.Generator] = None
    token_counts: Optional[torch.Tensor] = None   # output token histogram (frequency/presence penalties)
    grammar: Any = None
    grammar_future: Any = None
    # Logprob state: lists grow as computed; `sent_*` mark what was already streamed out.
    input_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    sent_tokens: int = 0
    sent_input_logprobs: bool = False
    admitted_at_step: int = -1

    @property
    def row(self) -> Optional[int]:
        """The request's slot-table row (None unless admitted)."""
        return self.kv.row if self.kv is not None else None

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in the device pool (cached prefix + computed)."""
        return self.kv.kv_len if self.kv is not None else 0

    @property
    def slot_len(self) -> int:
        """Tokens that have slots assigned (>= kv_len; > while a forward is pending)."""
        return self.kv.slot_len if self.kv is not None else 0

    @property
    def fill_ids(self) -> list[int]:
        """Prompt plus output so far."""
        return self.prompt_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        """len(fill_ids) without building the list."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        """Whether a finish reason is set."""
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and not computed yet."""
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids) \
            and not self.output_ids

    def remaining_new_tokens(self) -> int:
        """How many more tokens this request may still generate."""
        return max(0, self.sampling.max_new_tokens - len(self.output_ids))


def finish_stop(matched: Any) -> dict:
    """finish_reason for eos / stop token / stop string (SGLang's shape)."""
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict:
    """finish_reason for max_new_tokens or the context limit."""
    return {"type": "length", "length": length}


def finish_abort(message: str = "aborted") -> dict:
    """finish_reason for an aborted request."""
    return {"type": "abort", "message": message}
