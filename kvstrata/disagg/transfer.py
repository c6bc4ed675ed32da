"""KV transfer backends: write byte ranges of this process's KV pool into a peer's registered memory.

`MooncakeTransfer` is Mooncake's transfer engine (P2P handshake, TCP here, RDMA where a device is given);
`LoopbackTransfer` copies inside one process and exists for unit tests. `plan_writes` turns a slot
mapping into as few (src, dst, length) ranges as the two sides' slot runs allow.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional, Protocol

import torch

from kvstrata.disagg.messages import KVLayout
from kvstrata.net import confined_listeners

logger = logging.getLogger(__name__)

# Slices per batch_transfer_sync_write call: this Mooncake build fails batches of 4096 slices (measured:
# 2048 pass), so a fragmented plan is written in several batches.
MAX_BATCH_SLICES = 1024


class TransferError(RuntimeError):
    """A write to the peer failed (peer gone, memory not registered, ...)."""


class TransferBackend(Protocol):
    """What the handoff needs from a transfer engine."""

    session_id: str

    def register(self, ptr: int, length: int) -> None:
        """Make [ptr, ptr + length) of this process readable/writable by peers."""

    def write(self, session_id: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Copy each local range src[i] to the peer's dst[i] (lengths[i] bytes); raises TransferError."""


class MooncakeTransfer:
    """mooncake.engine.TransferEngine with the P2P handshake (no metadata server needed)."""

    def __init__(self, hostname: str, ib_device: Optional[str] = None):
        from kvstrata.storage.mooncake_config import import_mooncake

        import_mooncake()       # a clear error when the package is missing
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        with confined_listeners(hostname):        # it listens on every interface otherwise
            started = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, ib_device or "") == 0
        if not started:
            raise TransferError(f"the Mooncake transfer engine did not start on {hostname} ({protocol})")
        self.session_id = f"{hostname}:{self.engine.get_rpc_port()}"

    def register(self, ptr: int, length: int) -> None:
        """Register one memory region with the engine."""
        if self.engine.register_memory(ptr, length) != 0:
            raise TransferError(f"registering {length} bytes at {ptr:#x} failed")

    def write(self, session_id: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Synchronous batch writes to the peer, MAX_BATCH_SLICES ranges at a time."""
        for i in range(0, len(src), MAX_BATCH_SLICES):
            part = slice(i, i + MAX_BATCH_SLICES)
            if self.engine.batch_transfer_sync_write(session_id, src[part], dst[part], lengths[part]) != 0:
                raise TransferError(f"the transfer engine failed to write {sum(lengths[part])} bytes "
                                    f"({len(lengths[part])} ranges) to {session_id}")


class LoopbackTransfer:
    """In-process copies between registered regions (unit tests only: no second process)."""

    def __init__(self, session_id: str = "loopback"):
        self.session_id = session_id
        self.regions: list[tuple[int, int]] = []

    def register(self, ptr: int, length: int) -> None:
        """Remember a region so that writes outside every region fail like a real engine's."""
        self.regions.append((ptr, length))

    def write(self, session_id: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """memmove each range after checking that the destination was registered."""
        for s, d, n in zip(src, dst, lengths):
            if not any(p <= d and d + n <= p + size for p, size in self.regions):
                raise TransferError(f"write to unregistered memory at {d:#x}")
            ctypes.memmove(d, s, n)


def create_transfer(backend: str, hostname: str, ib_device: Optional[str] = None) -> TransferBackend:
    """The backend --disaggregation-transfer-backend names."""
    if backend == "mooncake":
        return MooncakeTransfer(hostname, ib_device)
    raise ValueError(f"unknown transfer backend {backend!r}")


def pool_layout(pool, tp_size: int = 1) -> KVLayout:
    """The KVLayout of a DeviceKVPool (one rank's shard of `tp_size`)."""
    return KVLayout(pool.num_layers, pool.num_kv_heads, pool.head_dim, str(pool.dtype).removeprefix("torch."),
                    pool.kv_format.scales_digest, page_size=pool.page_size, tp_size=tp_size)


def pool_pointers(pool) -> tuple[list[int], list[int]]:
    """Per layer, the address of slot 0 of the K and V buffers."""
    return [k.data_ptr() for k in pool.k_buffer], [v.data_ptr() for v in pool.v_buffer]


def register_pool(transfer: TransferBackend, pool) -> None:
    """Register every K and V buffer of a DeviceKVPool with the transfer engine."""
    for buf in (*pool.k_buffer, *pool.v_buffer):
        transfer.register(buf.data_ptr(), buf.numel() * buf.element_size())


def slot_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both slot sequences are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def plan_writes(src_slots: list[int], dst_slots: list[int], src_ptrs: tuple[list[int], list[int]],
                dst_ptrs: tuple[list[int], list[int]], slot_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """Byte ranges that copy src_slots → dst_slots in every layer's K and V buffer."""
    if len(src_slots) != len(dst_slots):
        raise ValueError(f"{len(src_slots)} source slots for {len(dst_slots)} destination slots")
    runs = slot_runs(src_slots, dst_slots)
    src, dst, lengths = [], [], []
    for local, remote in zip((*src_ptrs[0], *src_ptrs[1]), (*dst_ptrs[0], *dst_ptrs[1])):
        for s, d, n in runs:
            src.append(local + s * slot_bytes)
            dst.append(remote + d * slot_bytes)
            lengths.append(n * slot_bytes)
    return src, dst, lengths


def slots_list(slots: torch.Tensor) -> list[int]:
    """A slot tensor as a plain list (what messages carry)."""
    return [int(s) for s in slots.tolist()]
