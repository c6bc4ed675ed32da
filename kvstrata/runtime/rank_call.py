"""A handoff's call to every tensor-parallel rank: rank 0's request out, each rank's answer back, as bytes.

    rank 0: send_plan(HANDOFF), send_request(bytes)   --->  ranks > 0: receive_request, answer it
    rank 0: answer it too, gather_answers            <---  gather_answers (every answer, rank order)

The bytes travel as int64 tensors over the group (their length first, so nothing is unpickled or guessed);
what they mean is the caller's: the PD handoff sends its typed msgspec messages (disagg/shard.py), which the
other side validates when it decodes them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvstrata.model.parallel import RankFailure, TensorParallel

logger = logging.getLogger(__name__)

MAX_CALL_BYTES = 64 << 20     # a request or answer longer than this is corrupt: refuse it rather than allocate it
WORD = 8


def _words(data: bytes, count: int) -> torch.Tensor:
    """`data` zero-padded to `count` int64 words."""
    return torch.frombuffer(bytearray(data.ljust(count * WORD, b"\0")), dtype=torch.int64)


def _checked_length(tp: TensorParallel, n: int) -> int:
    if not 0 <= n <= MAX_CALL_BYTES:
        raise RankFailure(f"rank {tp.rank}: corrupt handoff call length {n}")
    return n


def send_request(tp: TensorParallel, request: bytes) -> None:
    """Rank 0: broadcast a call's request bytes (after the HANDOFF plan)."""
    n = _checked_length(tp, len(request))
    tp.broadcast(torch.tensor([n], dtype=torch.long))
    if n:
        tp.broadcast(_words(request, -(-n // WORD)))


def receive_request(tp: TensorParallel) -> bytes:
    """Ranks > 0: the request bytes rank 0 broadcast."""
    n = _checked_length(tp, int(tp.broadcast(torch.zeros(1, dtype=torch.long))[0]))
    if not n:
        return b""
    return tp.broadcast(torch.zeros(-(-n // WORD), dtype=torch.long)).numpy().tobytes()[:n]


def gather_answers(tp: TensorParallel, answer: bytes) -> list[bytes]:
    """Every rank's answer bytes, in rank order (a collective: every rank calls it with its own answer)."""
    lengths = tp.all_gather(torch.tensor([[len(answer)]], dtype=torch.long)).view(-1).tolist()
    for n in lengths:
        _checked_length(tp, n)
    count = max(1, -(-max(lengths) // WORD))
    parts = tp.all_gather(_words(answer, count).view(1, count)).view(tp.size, count)
    return [parts[r].numpy().tobytes()[:n] for r, n in enumerate(lengths)]


def answer_safely(answer: Callable[[bytes], bytes], request: bytes, rank: int) -> bytes:
    """`answer(request)`, or no bytes if it raised: every rank must reach the gather, whatever its handoff did
    (the caller's decoder turns an empty answer into that rank's failure)."""
    try:
        return answer(request)
    except Exception:
        logger.exception("rank %d: the handoff's answer failed", rank)
        return b""


def no_handoff(request: bytes) -> bytes:
    """A rank started without a handoff's part answers nothing (its caller sees that rank fail)."""
    return b""
