"""Typed messages of the PD handshake, between a decode scheduler and a prefill scheduler (ZMQ, pickled).

    decode                                   prefill (bootstrap service on --disaggregation-bootstrap-port)
    ------                                   -------
    request arrives with bootstrap_room R    request arrives with bootstrap_room R
    admit, match own prefix, reserve slots
    KVTransferRequest(R, where) ──────────►  (held until its prompt is prefilled)
                                             prefill with its own tiers, sample the first token,
                                             write the KV of tokens [start_token, n) into decode's slots
                       ◄──────────────────── KVTransferDone(R, first token, logprobs)
    continue decoding, stream                answer its client (1 token), free its side

Either side sends its failure (KVTransferFailed / KVTransferAbort) when it gives up, so the other frees
its KV at once instead of at its own timeout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class KVLayout:
    """What the bytes of one slot mean; prefill and decode must agree on it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        import torch

        return self.num_kv_heads * self.head_dim * getattr(torch, self.dtype).itemsize


@dataclass
class KVTransferRequest:
    """decode → prefill: write the KV of prompt tokens [start_token, len(prompt)) of room `room` here."""

    room: int
    reply_to: str                      # decode's ZMQ address for the answer
    session_id: str                    # decode's transfer-engine session ("host:rpc_port")
    layout: KVLayout
    k_ptrs: list[int]                  # per layer, address of slot 0 of decode's K buffer
    v_ptrs: list[int]
    prompt_len: int
    prompt_digest: str                 # both sides must have tokenized the same prompt
    start_token: int                   # tokens before this one decode already holds (its own cache)
    dst_slots: list[int]               # decode's slots for tokens [start_token, prompt_len)
    deadline: float                    # wall clock: decode gives up after this; no write may start later


@dataclass
class KVTransferAbort:
    """decode → prefill: decode gave up on room `room` (timeout, client abort); free it."""

    room: int
    reason: str


@dataclass
class KVTransferDone:
    """prefill → decode: the KV is in decode's slots; here is the first token."""

    room: int
    first_token: int
    first_logprob: Optional[float] = None
    first_top_logprobs: list[tuple[float, int]] = field(default_factory=list)
    transferred_bytes: int = 0
    transfer_seconds: float = 0.0
    prefill_cached_tokens: int = 0


@dataclass
class KVTransferFailed:
    """prefill → decode: room `room` will not be served; the request ends with this error."""

    room: int
    reason: str
    status: int = 503
