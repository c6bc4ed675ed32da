"""The wire format of KV events, as vLLM (vllm/distributed/kv_events.py) and SGLang publish them.

Every message on the PUB socket is three frames:

    [topic (UTF-8), seq (8 bytes, big-endian, from 0), payload (msgpack)]

and the payload is a KVEventBatch, a msgspec struct encoded as an array:

    [ts (float, seconds since the epoch), [event, ...], data_parallel_rank (int)]

each event an array whose first element names its type (msgspec's tag, the class name):

    ["BlockStored", block_hashes, parent_block_hash | None, token_ids, block_size, lora_id | None, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Replay (the ROUTER socket at `replay_endpoint`): a client (DEALER or REQ) sends [b"", start_seq as 8 bytes
big-endian]; the publisher answers [b"", seq, payload] for every buffered batch from start_seq on, then
[b"", END_SEQ, b""]. Ours adds one request: start_seq -1 (signed) asks for the current state instead, as one
batch [AllBlocksCleared, BlockStored...] under the sequence number of the last batch published, then
END_SEQ. Our publisher's batch 0 is [AllBlocksCleared] (the state at start: a restart shows at once). Anything else on that socket is dropped and counted.
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DUMP_SEQ = -1                          # our replay request for the full state
REPLAY_REQUEST_BYTES = 8


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def seq_bytes(seq: int) -> bytes:
    """A sequence number as its frame (signed, so that END_SEQ and the dump's -1 fit)."""
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """The sequence number of a frame; ValueError unless it is 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload as a typed batch; msgspec.DecodeError (a ValueError) when it is not one."""
    return _decoder.decode(payload)
