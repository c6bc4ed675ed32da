"""The seam between the scheduler and a prefill/decode handoff (kvstrata/disagg), typed both ways.

    Scheduler ---- Handoff verbs ----> PrefillHandoff / DecodeHandoff (kvstrata/disagg)
              <--- HandoffHost verbs --

The scheduler calls its handoff on arrival of a bootstrapped request (`add`), once per step (`poll`), after a
prefill's first token (`hold`), on abort, in integrity checks and state reports. The handoff acts on the
scheduler only through the HandoffHost verbs, which the Scheduler implements with its own bookkeeping (the
same admission and finish accounting as a co-located request). runtime/ never imports disagg/: whoever starts
a scheduler in PD mode hands it a HandoffFactory (`kvstrata.disagg.handoff_for`).

Under tensor parallelism each rank holds its own KV shard, so each rank > 0 runs the factory's `rank_side`
(a RankHandoff over its pool, started with the rank); rank 0's handoff reaches them through `call_ranks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from kvstrata.args import ServerArgs
    from kvstrata.cache.manager import KVCacheManager
    from kvstrata.memory.device_pool import DeviceKVPool
    from kvstrata.runtime.messages import BootstrapInfo, ReqOutput
    from kvstrata.runtime.model_runner import ModelRunner
    from kvstrata.runtime.req import Req


class HandoffHost(Protocol):
    """What a handoff may do to its scheduler."""

    args: ServerArgs
    runner: ModelRunner
    cache: KVCacheManager

    def queue(self, req: Req) -> None:
        """Queue req for prefill, as a co-located request (its L3 prefetch starts)."""

    def park(self, req: Req) -> None:
        """Take a prefilled req out of the running list, its KV kept and its prompt shared (commit)."""

    def start_decoding(self, req: Req, token: int, logprob: Optional[float], top: list) -> list[ReqOutput]:
        """req's prompt KV is in its slots: give it its first token and let it decode (or finish)."""

    def finish_held(self, req: Req) -> ReqOutput:
        """A parked request is done: free what it holds, return its final output."""

    def drop_queued(self, req: Req) -> None:
        """Take req out of the waiting queue or running list and free what it holds (idempotent)."""

    def output_for(self, req: Req) -> ReqOutput:
        """req's output since its last one."""

    def error_for(self, req: Req, message: str, status: int = 400) -> ReqOutput:
        """A final error output for req."""

    def decode_headroom_pages(self) -> int:
        """Pages the running requests are expected to need for their remaining tokens."""

    def call_ranks(self, request: bytes, local: Callable[[bytes], bytes]) -> list[bytes]:
        """Every tensor-parallel rank's answer to `request`, in rank order: rank 0's is `local(request)`, the
        others' their RankHandoff's (just `[local(request)]` at --tp-size 1). A collective: scheduler thread only."""


class Handoff(Protocol):
    """A prefill or decode server's side of the KV handoff, polled by its scheduler."""

    mode: str

    def add(self, req: Req, info: BootstrapInfo) -> Optional[ReqOutput]:
        """Take a bootstrapped request; an error output if it cannot be served."""

    def poll(self) -> list[ReqOutput]:
        """One step's progress: messages, transfers, timeouts. Outputs to send."""

    def hold(self, req: Req) -> bool:
        """After a finished prefill: keep req for its decode server instead of finishing it (False: not ours)."""

    def abort(self, rid: str) -> list[ReqOutput]:
        """Abort the request `rid` if the handoff holds it."""

    def has_work(self) -> bool:
        """Whether anything is queued, in flight or held."""

    def held(self) -> list[Req]:
        """Requests whose KV the handoff holds (for the integrity check)."""

    def state(self) -> dict[str, Any]:
        """The handoff's part of /server_info."""

    def close(self) -> None:
        """Stop its threads and sockets."""


class RankHandoff(Protocol):
    """A handoff's part on a tensor-parallel rank > 0: its own KV shard, answering rank 0's calls."""

    def answer(self, request: bytes) -> bytes:
        """The answer to one call of rank 0's handoff (never raises: a failure is an answer)."""


RankHandoffFactory = Callable[["ServerArgs", "DeviceKVPool", int], RankHandoff]   # (args, the rank's pool, rank)


class HandoffFactory(Protocol):
    """A handoff's constructor, which the Scheduler calls with itself, and what its ranks > 0 run."""

    rank_side: RankHandoffFactory

    def __call__(self, host: HandoffHost) -> Handoff:
        """The handoff of the scheduler `host`."""
