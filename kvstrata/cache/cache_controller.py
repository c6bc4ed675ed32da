"""CacheController: runs device<->host page copies in the background and reports their completion.

It applies no policy and never touches the radix tree. The protocol, for both directions:

    caller (scheduler)                           controller (worker threads, CUDA copy streams)
    ------------------                           ----------------------------------------------
    lock the node; reserve destination pages
    submit_backup / submit_load_back  ------->   copy (a load-back layer by layer)
    ... keeps running steps ...                  LayerLoadHandle: layer i is on the device
    poll_acks() once per step          <-------  CopyOp acknowledged (op.error set if it failed)
    apply: mark residency, unlock node, free what the op made redundant

Who locks and who frees: the caller. Source pages must stay locked (not freed, not overwritten) and
destination pages reserved from submit until the op is acknowledged; the controller never frees a page.
A page written by a copy is read only after its acknowledgement (or, for a load-back, after
`LayerLoadHandle.wait_layer` for that layer).

On CUDA each worker has its own copy stream; an op first waits for everything the submitting thread's
stream had queued at submit time (so a backup reads what the forward wrote, and a load-back never
overwrites pages an earlier forward still reads). Load-backs have a dedicated worker, so a long backup
never delays a load-back the forward is waiting for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.host_pool import HostKVPool
from kvstrata.threads import run_ops_on_this_thread_only

logger = logging.getLogger(__name__)

BACKUP, LOAD_BACK = "backup", "load_back"
# Called with (kind, device pages, host pages) as each copy is submitted, on the submitting thread: how other
# tensor-parallel ranks learn the copies rank 0's cache decided, in decision order (runtime/forward_plan.py).
CopyJournal = Callable[[str, torch.Tensor, torch.Tensor], None]


class CopyError(RuntimeError):
    """A load-back failed or was cancelled: its device pages hold nothing usable."""


@dataclass(eq=False)
class CopyOp:
    """One submitted copy of `device_pages[i]` <-> `host_pages[i]`; `error` is set if it failed."""

    op_id: int
    kind: str                       # "backup" (device -> host) or "load_back" (host -> device)
    device_pages: torch.Tensor
    host_pages: torch.Tensor
    node: Any = None                # the caller's tag (a tree node), returned untouched in the ack
    error: str | None = None        # None on success; else why (the destination pages are garbage)

    @property
    def num_pages(self) -> int:
        """Pages copied by this op."""
        return self.host_pages.numel()


class LayerLoadHandle:
    """What the forward waits on, per layer, while a load-back is in flight."""

    def __init__(self, op: CopyOp, num_layers: int, device: torch.device | None):
        self.op = op
        self._copied = [threading.Event() for _ in range(num_layers)]
        # On CUDA a layer is "copied" once its event is recorded; the GPU wait goes on the caller's stream.
        self._cuda_events = [torch.cuda.Event() for _ in range(num_layers)] if device is not None else None
        self._layers_ok = 0
        self._error: str | None = None

    @property
    def op_id(self) -> int:
        """The id of the load-back op (as acknowledged by poll_acks)."""
        return self.op.op_id

    def wait_layer(self, layer_id: int, timeout: float | None = None) -> None:
        """Block until layer `layer_id` of this load is in device memory (on CUDA: for the current stream).

        On CUDA the thread waits until every layer's copy is queued, and the stream waits for this layer's
        copy: the GPU still overlaps layer i+1's copy with layer i's compute. The worker queues with Python
        between torch calls; interleaved with the forward's own Python, each of its steps can wait up to the
        interpreter's switch interval (5 ms) for the GIL. (Not yet measured against per-layer CPU waits.)

        Raises CopyError if that layer could not be copied, TimeoutError after `timeout` seconds.
        """
        queued = self._copied[-1 if self._cuda_events is not None else layer_id]
        if not queued.wait(timeout):
            raise TimeoutError(f"load-back op {self.op_id}: layer {layer_id} not copied after {timeout} s")
        if layer_id >= self._layers_ok:
            raise CopyError(f"load-back op {self.op_id} failed before layer {layer_id}: {self._error}")
        if self._cuda_events is not None:
            torch.cuda.current_stream().wait_event(self._cuda_events[layer_id])

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every layer of this load is in device memory."""
        for layer_id in range(len(self._copied)):
            self.wait_layer(layer_id, timeout)

    def _layer_copied(self, layer_id: int, stream: torch.cuda.Stream | None) -> None:
        if self._cuda_events is not None:
            self._cuda_events[layer_id].record(stream)
        self._layers_ok = layer_id + 1
        self._copied[layer_id].set()

    def _fail(self, error: str) -> None:
        self._error = error
        for event in self._copied[self._layers_ok:]:
            event.set()


def layer_wait_for(handles: Sequence[LayerLoadHandle]) -> Callable[[int], None] | None:
    """A `ForwardMetadata.layer_wait` that waits for layer i of every handle; None when there are none."""
    if not handles:
        return None

    def wait(layer_id: int) -> None:
        for handle in handles:
            handle.wait_layer(layer_id)
    return wait


@dataclass
class _Traffic:
    ops: int = 0
    bytes: int = 0
    busy_s: float = 0.0


class CacheController:
    """Runs device<->host copies asynchronously and reports completions; applies no policy."""

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, num_workers: int = 1,
                 journal: CopyJournal | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._journal = journal
        self._cuda_device = device_pool.device if device_pool.device.type == "cuda" else None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._acks: list[CopyOp] = []
        self._in_flight = 0
        self._next_op_id = 0
        self._stopping = False
        self._traffic = {BACKUP: _Traffic(), LOAD_BACK: _Traffic()}
        self._failed_ops = 0
        self._queues = {BACKUP: queue.SimpleQueue(), LOAD_BACK: queue.SimpleQueue()}
        # `num_workers` backup workers share one queue; load-backs have their own worker.
        self._workers = [(LOAD_BACK, threading.Thread(target=self._work, args=(LOAD_BACK,), daemon=True,
                                                      name="kvstrata-load-back"))]
        self._workers += [(BACKUP, threading.Thread(target=self._work, args=(BACKUP,), daemon=True,
                                                    name=f"kvstrata-backup-{i}")) for i in range(num_workers)]
        for _, thread in self._workers:
            thread.start()

    # ----- submit -----

    def submit_backup(self, device_pages: torch.Tensor, host_pages: torch.Tensor, node: Any = None) -> int:
        """Queue a device->host copy; returns the op id.

        The caller has reserved `host_pages` and locked the node: `device_pages` must not be freed or
        overwritten, and `host_pages` not read, until the op is acknowledged by poll_acks.
        """
        op = CopyOp(-1, BACKUP, *self._check_pages(device_pages, host_pages), node=node)
        self._submit(op, None)
        return op.op_id

    def copy_now(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> None:
        """Copy device pages to reserved host pages synchronously, on the caller's thread (write_back, as a
        node leaves the device); told to the journal like a submitted backup, so every rank copies it."""
        device_pages, host_pages = self._check_pages(device_pages, host_pages)
        if self._journal is not None:
            self._journal(BACKUP, device_pages, host_pages)
        self.host_pool.backup_from_device(device_pages, host_pages)

    def submit_load_back(self, host_pages: torch.Tensor, device_pages: torch.Tensor,
                         node: Any = None) -> LayerLoadHandle:
        """Queue a host->device copy, layer by layer; the forward waits per layer on the returned handle.

        The caller has reserved `device_pages` and locked the node: `host_pages` must not be freed or
        overwritten until the op is acknowledged; `device_pages` are read only after `wait_layer` (per
        layer) or the acknowledgement.
        """
        op = CopyOp(-1, LOAD_BACK, *self._check_pages(device_pages, host_pages), node=node)
        handle = LayerLoadHandle(op, self.device_pool.num_layers, self._cuda_device)
        self._submit(op, handle)
        return handle

    def _submit(self, op: CopyOp, handle: LayerLoadHandle | None) -> None:
        if self._journal is not None:
            self._journal(op.kind, op.device_pages, op.host_pages)
        ready = None
        if self._cuda_device is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._cuda_device))
        with self._lock:
            # Under the lock so that no op is queued behind shutdown's stop markers.
            if self._stopping:
                raise RuntimeError("CacheController is shut down")
            op.op_id = self._next_op_id
            self._next_op_id += 1
            self._in_flight += 1
            self._queues[op.kind].put((op, handle, ready))

    def _check_pages(self, device_pages: Any, host_pages: Any) -> tuple[torch.Tensor, torch.Tensor]:
        device_pages = _page_ids(device_pages, self.device_pool.num_pages, "device")
        host_pages = _page_ids(host_pages, self.host_pool.num_pages, "host")
        if device_pages.numel() != host_pages.numel():
            raise ValueError(f"{device_pages.numel()} device pages vs {host_pages.numel()} host pages")
        return device_pages, host_pages

    # ----- completions -----

    def poll_acks(self) -> list[CopyOp]:
        """Ops completed (or failed) since the last poll, in completion order; never blocks."""
        with self._lock:
            acks, self._acks = self._acks, []
        return acks

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every submitted op has completed (their acks stay queued for poll_acks)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._in_flight == 0, timeout):
                raise TimeoutError(f"{self._in_flight} copy ops still in flight after {timeout} s")

    def stats(self) -> dict:
        """Bytes and ops per direction, bytes/s over the time workers were busy, ops in flight, failures."""
        with self._lock:
            out: dict = {"ops_in_flight": self._in_flight, "failed_ops": self._failed_ops}
            for kind, t in self._traffic.items():
                out[f"{kind}_ops"] = t.ops
                out[f"{kind}_bytes"] = t.bytes
                out[f"{kind}_busy_s"] = t.busy_s
                out[f"{kind}_bytes_per_s"] = t.bytes / t.busy_s if t.busy_s > 0 else 0.0
        return out

    # ----- lifecycle -----

    def shutdown(self) -> None:
        """Stop and join the workers: the op being copied finishes, queued ops are acked as cancelled."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                for kind, _ in self._workers:
                    self._queues[kind].put(None)
        for _, thread in self._workers:
            thread.join()

    def __enter__(self) -> CacheController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----- workers -----

    def _work(self, kind: str) -> None:
        run_ops_on_this_thread_only()   # no second OpenMP pool next to the scheduler's (see kvstrata/threads.py)
        stream = torch.cuda.Stream(self._cuda_device) if self._cuda_device is not None else None
        while (item := self._queues[kind].get()) is not None:
            op, handle, ready = item
            if self._stopping:
                self._finish(op, handle, "cancelled: the cache controller shut down", 0.0)
                continue
            start = time.perf_counter()
            try:
                self._copy(op, handle, stream, ready)
                error = None
            except Exception as e:  # a failed copy is reported in its ack, never kills the worker
                logger.exception("%s op %d (%d pages) failed", op.kind, op.op_id, op.num_pages)
                error = f"{type(e).__name__}: {e}"
            self._finish(op, handle, error, time.perf_counter() - start)

    def _copy(self, op: CopyOp, handle: LayerLoadHandle | None, stream: torch.cuda.Stream | None,
              ready: torch.cuda.Event | None) -> None:
        if stream is None:
            self._copy_on_current_stream(op, handle, None)
            return
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            if op.device_pages.is_cuda:
                op.device_pages.record_stream(stream)
            self._copy_on_current_stream(op, handle, stream)
            stream.synchronize()  # the ack promises the data is in place

    def _copy_on_current_stream(self, op: CopyOp, handle: LayerLoadHandle | None,
                                stream: torch.cuda.Stream | None) -> None:
        if op.kind == BACKUP:
            self.host_pool.backup_from_device(op.device_pages, op.host_pages)
            return
        assert handle is not None
        for layer_id in range(self.device_pool.num_layers):
            self.host_pool.load_to_device(op.host_pages, op.device_pages, layer_id)
            handle._layer_copied(layer_id, stream)

    def _finish(self, op: CopyOp, handle: LayerLoadHandle | None, error: str | None, busy_s: float) -> None:
        op.error = error
        if handle is not None and error is not None:
            handle._fail(error)
        with self._lock:
            if error is None:
                traffic = self._traffic[op.kind]
                traffic.ops += 1
                traffic.bytes += op.num_pages * self.host_pool.page_bytes
                traffic.busy_s += busy_s
            else:
                self._failed_ops += 1
            self._acks.append(op)
            self._in_flight -= 1
            self._changed.notify_all()


def _page_ids(pages: Any, num_pages: int, tier: str) -> torch.Tensor:
    """Pages as a flat long tensor; ids on the CPU are range-checked (page 0 is reserved in both tiers)."""
    ids = torch.as_tensor(pages, dtype=torch.long).reshape(-1)
    if tier == "host" and ids.is_cuda:
        ids = ids.cpu()
    if not ids.is_cuda and ids.numel() and (int(ids.min()) < 1 or int(ids.max()) >= num_pages):
        raise ValueError(f"{tier} page ids must be in 1..{num_pages - 1}, got {ids.tolist()[:16]}")
    return ids
