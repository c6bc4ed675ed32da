"""What both sides of the handoff share: request checks, the prompt digest, counters for /server_info."""

from __future__ import annotations

import hashlib
import time
from collections import deque
from typing import TYPE_CHECKING, Optional

from kvstrata.runtime.req import Req

if TYPE_CHECKING:
    from kvstrata.disagg.channel import BootstrapChannel

RECENT_TRANSFERS = 64        # per-request records kept for /server_info


def check_disagg_request(req: Req) -> Optional[str]:
    """Why a request cannot be served disaggregated, or None."""
    if req.sampling.max_new_tokens < 1:
        return "max_new_tokens must be >= 1 for a request with bootstrap_room (PD disaggregation)"
    if req.sampling.constraint is not None:
        return "structured output (regex/json_schema/ebnf) is not supported with PD disaggregation"
    return None


def prompt_digest(ids: list[int]) -> str:
    """A short digest of token ids: prefill and decode check they tokenized the same prompt."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]


class HandoffStats:
    """Counters and the latest per-request transfer records of one side."""

    def __init__(self, mode: str):
        self.mode = mode
        self.counters = {"transfers_ok": 0, "transfers_failed": 0, "timeouts": 0, "transfer_bytes_total": 0,
                         "transfer_seconds_total": 0.0, "bootstrap_queue_seconds_total": 0.0}
        self.recent: deque[dict] = deque(maxlen=RECENT_TRANSFERS)

    def ok(self, rid: str, room: int, nbytes: int, seconds: float, queue_s: float, **extra: object) -> None:
        """Record one completed transfer."""
        c = self.counters
        c["transfers_ok"] += 1
        c["transfer_bytes_total"] += nbytes
        c["transfer_seconds_total"] += seconds
        c["bootstrap_queue_seconds_total"] += queue_s
        self.recent.append({"rid": rid, "room": room, "bytes": nbytes, "transfer_s": round(seconds, 6),
                            "bootstrap_queue_s": round(queue_s, 6), "at": time.time(), **extra})

    def failed(self, rid: str, room: int, reason: str, timeout: bool = False) -> None:
        """Record one failed handoff."""
        self.counters["transfers_failed"] += 1
        self.counters["timeouts"] += int(timeout)
        self.recent.append({"rid": rid, "room": room, "error": reason, "timeout": timeout, "at": time.time()})

    def state(self, **queues: int) -> dict:
        """The `disaggregation` entry of /server_info internal_states."""
        c = dict(self.counters)
        ok = c["transfers_ok"]
        c["transfer_gb_per_s"] = (c["transfer_bytes_total"] / c["transfer_seconds_total"] / 1e9
                                  if c["transfer_seconds_total"] else 0.0)
        c["mean_bootstrap_queue_s"] = c["bootstrap_queue_seconds_total"] / ok if ok else 0.0
        return {"mode": self.mode, **queues, **c, "recent_transfers": list(self.recent)}


def endpoint_state(channel: BootstrapChannel, session_id: str) -> dict:
    """Where this side listens (rank 0's transfer session), and the bootstrap messages it dropped (by reason),
    for /server_info."""
    return {"bootstrap_address": channel.address, "transfer_session": session_id,
            "rejected_messages": dict(channel.rejected),
            "rejected_messages_total": sum(channel.rejected.values())}
