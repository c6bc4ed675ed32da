"""Typed messages of the PD handshake, between a decode scheduler and a prefill scheduler (msgspec structs,
msgpack on the wire, signed by `wire.FrameCodec`; never pickle).

    decode                                   prefill (bootstrap service on --disaggregation-bootstrap-port)
    ------                                   -------
    request arrives with bootstrap_room R    request arrives with bootstrap_room R
    admit, match own prefix, reserve slots
    KVTransferRequest(R, where) ──────────►  (held until its prompt is prefilled)
                                             prefill with its own tiers, sample the first token,
                                             write the KV of tokens [start_token, n) into decode's slots
                                             (under --tp-size N: prefill rank r into decode rank r, all
                                             N writes finished before the answer; shard.py)
                       ◄──────────────────── KVTransferDone(R, first token, logprobs)
    continue decoding, stream                answer its client (1 token), free its side

Either side sends its failure (KVTransferFailed / KVTransferAbort) when it gives up, so the other frees
its KV at once instead of at its own timeout.

Every field is typed and bounded here (msgspec checks types and `Meta` bounds while it decodes);
`message_problem` adds the checks that span fields. A message that fails either never reaches a handoff.
"""

from __future__ import annotations

import math
from typing import Annotated, Optional, Union

from msgspec import Meta, Struct

MAX_ROOM = 2 ** 63 - 1
MAX_PROMPT_TOKENS = 1 << 22          # 4 Mi tokens: far above any context length served here
MAX_LAYERS = 1024
MAX_TOP_LOGPROBS = 1024
MAX_TEXT = 2048                      # reasons, session ids, addresses
MAX_TP = 512                         # tensor-parallel ranks of one server

Room = Annotated[int, Meta(ge=0, le=MAX_ROOM)]
Count = Annotated[int, Meta(ge=0, le=MAX_PROMPT_TOKENS)]
Pointer = Annotated[int, Meta(ge=0)]          # msgpack carries at most uint64
Pointers = Annotated[list[Pointer], Meta(max_length=MAX_LAYERS)]
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
# A ZMQ tcp address "tcp://host:port"; the host part is checked no further (a name or an IP literal).
Address = Annotated[str, Meta(pattern=r"^tcp://[A-Za-z0-9.\-_:\[\]]{1,255}:[0-9]{1,5}$")]
SessionId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9.\-_:\[\]]{1,255}:[0-9]{1,5}$|^loopback$")]
Digest = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
HttpStatus = Annotated[int, Meta(ge=400, le=599)]
TokenId = Annotated[int, Meta(ge=0, le=2 ** 31 - 1)]


class KVLayout(Struct, frozen=True):
    """What the bytes of one slot of one rank's pool mean, and how the KV heads are split over the ranks;
    prefill and decode must agree on all of it (mismatched --tp-size is refused, never re-sharded)."""

    num_layers: Annotated[int, Meta(ge=1, le=MAX_LAYERS)]
    num_kv_heads: Annotated[int, Meta(ge=1, le=4096)]          # per rank
    head_dim: Annotated[int, Meta(ge=1, le=65536)]
    dtype: Annotated[str, Meta(pattern=r"^(float32|float16|bfloat16|float8_e4m3fn|float8_e5m2)$")]
    scales_digest: Annotated[str, Meta(pattern=r"^([0-9a-f]{16})?$")] = ""   # FP8 K/V scales (kv_format.py)
    page_size: Annotated[int, Meta(ge=1, le=65536)] = 1
    tp_size: Annotated[int, Meta(ge=1, le=MAX_TP)] = 1

    @property
    def kv_name(self) -> str:
        """The stored KV format in words: the dtype, and the scales' digest for FP8."""
        return self.dtype + (f" (scales {self.scales_digest})" if self.scales_digest else "")

    def describe(self) -> str:
        """The layout in words, for the error that names both sides' layouts."""
        return (f"TP={self.tp_size} with {self.num_kv_heads} KV head(s) of dim {self.head_dim} per rank, "
                f"{self.num_layers} layers, {self.kv_name}, page size {self.page_size}")

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        import torch

        return self.num_kv_heads * self.head_dim * getattr(torch, self.dtype).itemsize


class ShardTarget(Struct, frozen=True):
    """Where one tensor-parallel rank's KV shard lives: its transfer-engine session and buffer addresses."""

    session_id: SessionId              # the rank's transfer-engine session ("host:rpc_port")
    k_ptrs: Pointers                   # per layer, address of slot 0 of the rank's K buffer
    v_ptrs: Pointers


class KVTransferRequest(Struct, tag="request"):
    """decode → prefill: write the KV of prompt tokens [start_token, len(prompt)) of room `room` here.

    `shards[r]` is decode rank r's pool: prefill rank r writes its own shard there (same --tp-size both sides).
    """

    room: Room
    reply_to: Address                  # decode's ZMQ address for the answer
    layout: KVLayout
    shards: Annotated[list[ShardTarget], Meta(min_length=1, max_length=MAX_TP)]
    prompt_len: Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)]
    prompt_digest: Digest              # both sides must have tokenized the same prompt
    start_token: Count                 # tokens before this one decode already holds (its own cache)
    dst_slots: Annotated[list[Count], Meta(max_length=MAX_PROMPT_TOKENS)]  # slots for [start_token, prompt_len)
    deadline: float                    # wall clock: decode gives up after this; no write may start later


class KVTransferAbort(Struct, tag="abort"):
    """decode → prefill: decode gave up on room `room` (timeout, client abort); free it."""

    room: Room
    reason: Text


class KVTransferDone(Struct, tag="done"):
    """prefill → decode: the KV is in decode's slots; here is the first token."""

    room: Room
    first_token: TokenId
    first_logprob: Optional[float] = None
    first_top_logprobs: Annotated[list[tuple[float, TokenId]], Meta(max_length=MAX_TOP_LOGPROBS)] = []
    transferred_bytes: Annotated[int, Meta(ge=0)] = 0
    transfer_seconds: Annotated[float, Meta(ge=0)] = 0.0
    prefill_cached_tokens: Count = 0


class KVTransferFailed(Struct, tag="failed"):
    """prefill → decode: room `room` will not be served; the request ends with this error."""

    room: Room
    reason: Text
    status: HttpStatus = 503


PDMessage = Union[KVTransferRequest, KVTransferAbort, KVTransferDone, KVTransferFailed]


def target_problem(target: ShardTarget, num_layers: int) -> Optional[str]:
    """Why a shard target cannot address `num_layers` layers, or None."""
    if len(target.k_ptrs) != num_layers or len(target.v_ptrs) != num_layers:
        return f"{len(target.k_ptrs)}/{len(target.v_ptrs)} K/V pointers for {num_layers} layers"
    return None


def message_problem(msg: PDMessage) -> Optional[str]:
    """What is inconsistent across a decoded message's fields, or None (types and bounds are checked already)."""
    if isinstance(msg, KVTransferRequest):
        if len(msg.shards) != msg.layout.tp_size:
            return f"{len(msg.shards)} shard targets for {msg.layout.tp_size} tensor-parallel ranks"
        problem = next(filter(None, (target_problem(t, msg.layout.num_layers) for t in msg.shards)), None)
        if problem is not None:
            return problem
        if msg.start_token > msg.prompt_len:
            return f"start_token {msg.start_token} is past the prompt ({msg.prompt_len} tokens)"
        if len(msg.dst_slots) != msg.prompt_len - msg.start_token:
            return f"{len(msg.dst_slots)} destination slots for {msg.prompt_len - msg.start_token} tokens"
        if not math.isfinite(msg.deadline):
            return "the deadline is not a finite time"
    if isinstance(msg, KVTransferDone):
        values = [msg.transfer_seconds] + [lp for lp, _ in msg.first_top_logprobs]
        if msg.first_logprob is not None:
            values.append(msg.first_logprob)
        if any(math.isnan(v) for v in values) or not math.isfinite(msg.transfer_seconds):
            return "a logprob or the transfer time is not a number"
    return None
