"""StorageIO: background I/O between the host pool (L2) and a storage backend (L3).

Like the CacheController it applies no policy and never touches the tree: the tree submits prefetches
(L3 -> host pages it reserved) and backups (host pages it pinned -> L3), and applies the acknowledgements
once per scheduler step. Backend failures arrive as short reads/writes: they cost hits, never requests.

Prefetches and backups run on two threads, each with its own queue: a new request waits for its prefetch
(--hicache-storage-prefetch-policy), and behind a burst of backups (every new prompt writes its pages) it
would wait a whole forward step or more. They never touch the same object: a page being backed up is
pinned in L2, so no prefetch looks for it.

An L3 object is a page group: `group_pages` consecutive host pages of one sequence, stored as the
concatenation of their bytes under one key, so object counts follow the data, not --page-size. An op's
`keys[i]` names host_pages[i*group_pages : (i+1)*group_pages].

Tensor parallelism (cache/shards.py): each rank's objects are named for its shard (`Shard.object_key`, at the
backend boundary: the tree's keys stay the engine's). On rank 0 a RankLink is told every op as it is
submitted (the other ranks repeat it on their shards), and a prefetch's `done` becomes, at its ack, the
groups every rank read and verified.

Zero copy: with the page_first host layout and one page per object, every object is one contiguous
byte range, registered with the backend once and read/written in place; otherwise objects are gathered
into (and scattered from) staging copies.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.cache.page_hash import storage_namespace
from kvstrata.cache.shards import RankLink, Shard
from kvstrata.memory.host_pool import HostKVPool
from kvstrata.storage.base import StorageBackend
from kvstrata.threads import run_ops_on_this_thread_only

logger = logging.getLogger(__name__)

PREFETCH, STORAGE_BACKUP = "prefetch", "storage_backup"


@dataclass(eq=False)
class StorageOp:
    """One batch: `keys[i]` <-> the i-th group of `host_pages`; `done` leading objects succeeded (set by
    the worker)."""

    op_id: int
    kind: str
    keys: list[str]
    host_pages: list[int]
    tag: Any = None
    submitted: float = 0.0    # time.monotonic() at submit
    done: int = 0
    seconds: float = 0.0
    applied: bool = False     # set by the tree once it has applied the ack


class StorageIO:
    """Two worker threads, one for prefetches and one for backups, against one backend."""

    def __init__(self, backend: StorageBackend, host_pool: HostKVPool, group_pages: int = 1,
                 shard: Shard = Shard(), ranks: RankLink | None = None):
        """`shard`: this rank's share (its objects' names); `ranks`: rank 0's link to the other ranks."""
        if backend.page_bytes != group_pages * host_pool.page_bytes:
            raise ValueError(f"backend objects of {backend.page_bytes} bytes for groups of {group_pages} pages "
                             f"of {host_pool.page_bytes} bytes")
        self.backend = backend
        self.host_pool = host_pool
        self.group_pages = group_pages
        self.shard = shard
        self._ranks = ranks
        self.zero_copy = host_pool.layout == "page_first" and group_pages == 1
        if self.zero_copy:
            backend.register_buffer(host_pool.whole_buffer())
        self._todo: dict[str, queue.Queue] = {PREFETCH: queue.Queue(), STORAGE_BACKUP: queue.Queue()}
        self._acks: queue.Queue = queue.Queue()
        self._next_id = 0
        self._inflight = 0
        self._idle = threading.Condition()     # also guards `counters` (both workers count)
        self.counters = {"prefetch_ops": 0, "prefetched_pages": 0, "prefetch_bytes": 0, "prefetch_s": 0.0,
                         "backup_ops": 0, "backed_up_pages": 0, "backed_up_objects": 0, "backup_bytes": 0,
                         "backup_s": 0.0, "prefetch_groups_missing_on_other_ranks": 0}
        self._threads = [threading.Thread(target=self._work, args=(kind,), name=f"kvstrata-storage-{name}",
                                          daemon=True)
                         for kind, name in ((PREFETCH, "prefetch"), (STORAGE_BACKUP, "backup"))]
        for thread in self._threads:
            thread.start()

    # ---- submit / ack ---------------------------------------------------------------------------------

    def submit_prefetch(self, keys: list[str], host_pages: list[int], tag: Any = None) -> StorageOp:
        """Read the leading existing objects of `keys` into `host_pages` (reserved by the caller)."""
        return self._submit(PREFETCH, keys, host_pages, tag)

    def submit_backup(self, keys: list[str], host_pages: list[int], tag: Any = None) -> StorageOp:
        """Write `host_pages` under `keys`; the caller keeps the pages unchanged until the ack."""
        return self._submit(STORAGE_BACKUP, keys, host_pages, tag)

    def _submit(self, kind: str, keys: list[str], host_pages: list[int], tag: Any) -> StorageOp:
        if len(host_pages) != len(keys) * self.group_pages:
            raise ValueError(f"{len(host_pages)} host pages for {len(keys)} objects of {self.group_pages} pages")
        op = StorageOp(self._next_id, kind, list(keys), list(host_pages), tag, time.monotonic())
        self._next_id += 1
        if self._ranks is not None:     # before the worker may finish it: the other ranks learn it first
            self._ranks.storage_op(kind, op.op_id, op.keys, op.host_pages)
        with self._idle:
            self._inflight += 1
        self._todo[kind].put(op)
        return op

    def poll_acks(self) -> list[StorageOp]:
        """Completed ops since the last call (non-blocking on one rank; under tensor parallelism a finished
        prefetch's `done` is agreed with the other ranks first, a collective)."""
        acks = []
        while True:
            try:
                acks.append(self._acks.get_nowait())
            except queue.Empty:
                break
        prefetches = [op for op in acks if op.kind == PREFETCH]
        if self._ranks is not None and prefetches:
            agreed = self._ranks.agree_prefetches([(op.op_id, op.done) for op in prefetches])
            for op, done in zip(prefetches, agreed):
                with self._idle:
                    self.counters["prefetch_groups_missing_on_other_ranks"] += op.done - done
                op.done = done
        return acks

    def stored_leading(self, keys: list[str]) -> int:
        """How many leading objects of `keys` this rank's shard has (a backend lookup, on the caller's thread)."""
        return self.backend.batch_exists(self._object_keys(keys))

    def _object_keys(self, keys: list[str]) -> list[str]:
        return [self.shard.object_key(k) for k in keys] if self.shard.tp_size > 1 else keys

    def wait_for_ack(self, timeout: float) -> bool:
        """Block until an acknowledgement is waiting to be polled, at most `timeout` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._acks.empty(), timeout=max(timeout, 0.0))

    def wait_idle(self, timeout: float = 120.0) -> None:
        """Block until every submitted op has been acknowledged by the worker."""
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout)

    def stats(self) -> dict:
        """I/O counters plus the backend's own (errors, hits, ...)."""
        with self._idle:
            c = dict(self.counters)
        c["prefetch_bytes_per_s"] = c["prefetch_bytes"] / c["prefetch_s"] if c["prefetch_s"] else 0.0
        c["backup_bytes_per_s"] = c["backup_bytes"] / c["backup_s"] if c["backup_s"] else 0.0
        c["backend"] = self.backend.stats()
        c["corrupt_pages"] = c["backend"].get("corrupt", 0)   # failed their checksum: dropped and recomputed
        return c

    def shutdown(self) -> None:
        """Finish queued work, stop the workers, close the backend."""
        for todo in self._todo.values():
            todo.put(None)
        for thread in self._threads:
            thread.join(timeout=60)
        self.backend.close()

    # ---- worker -----------------------------------------------------------------------------------------

    def _work(self, kind: str) -> None:
        run_ops_on_this_thread_only()   # its page gathers must not start a second OpenMP pool
        todo = self._todo[kind]
        while True:
            op = todo.get()
            if op is None:
                return
            start = time.perf_counter()
            try:
                op.done = self._prefetch(op) if op.kind == PREFETCH else self._backup(op)
            except Exception:  # a bug or an unexpected backend failure: the op just did nothing
                logger.exception("storage %s failed", op.kind)
                op.done = 0
            op.seconds = time.perf_counter() - start
            with self._idle:
                self._count(op)
                self._acks.put(op)
                self._inflight -= 1
                self._idle.notify_all()

    def _prefetch(self, op: StorageOp) -> int:
        keys = self._object_keys(op.keys)
        n = self.backend.batch_exists(keys)
        if n == 0:
            return 0
        if self.zero_copy:
            return self.backend.batch_get(keys[:n], [self.host_pool.page_buffer(p) for p in op.host_pages[:n]])
        staging = [torch.empty(self.backend.page_bytes, dtype=torch.uint8) for _ in range(n)]
        got = self.backend.batch_get(keys[:n], staging)
        for i, buf in enumerate(staging[:got]):
            self.host_pool.write_pages_bytes(self._group(op, i), buf)
        return got

    def _backup(self, op: StorageOp) -> int:
        keys = self._object_keys(op.keys)
        if self.zero_copy:
            return self.backend.batch_set(keys, [self.host_pool.page_buffer(p) for p in op.host_pages])
        objects = [self.host_pool.pages_bytes(self._group(op, i)) for i in range(len(op.keys))]
        return self.backend.batch_set(keys, objects)

    def _group(self, op: StorageOp, i: int) -> list[int]:
        """The host pages of object i of `op`."""
        return op.host_pages[i * self.group_pages:(i + 1) * self.group_pages]

    def _count(self, op: StorageOp) -> None:
        nbytes = op.done * self.backend.page_bytes
        if op.kind == PREFETCH:
            self.counters["prefetch_ops"] += 1
            self.counters["prefetched_pages"] += op.done * self.group_pages
            self.counters["prefetch_bytes"] += nbytes
            self.counters["prefetch_s"] += op.seconds
        else:
            self.counters["backup_ops"] += 1
            self.counters["backed_up_pages"] += op.done * self.group_pages
            self.counters["backed_up_objects"] += op.done
            self.counters["backup_bytes"] += nbytes
            self.counters["backup_s"] += op.seconds


def kv_namespace(model_path: str, dtype: str, page_size: int, extra: str = "") -> str:
    """The namespace of this engine's pages, shared by every process serving the same weights and shape.

    Pages are stored in one canonical byte order whatever --hicache-mem-layout is, so the layout is not
    part of it: servers with different layouts share pages.
    """
    return storage_namespace(model_identity(model_path), dtype, "canonical", page_size, extra)


def model_identity(model_path: str) -> str:
    """A stable name for a checkpoint's weights: folder name plus a digest of its config and weight files."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(model_path)):
        path = os.path.join(model_path, name)
        if name == "config.json":
            with open(path, "rb") as fh:
                h.update(fh.read())
        elif name.endswith(".safetensors"):
            size = os.path.getsize(path)
            h.update(f"{name}:{size}".encode())
            with open(path, "rb") as fh:   # head (header) and tail of the file: cheap and weight-sensitive
                h.update(fh.read(1 << 16))
                fh.seek(max(0, size - (1 << 16)))
                h.update(fh.read())
    return f"{os.path.basename(os.path.normpath(model_path))}-{h.hexdigest()[:16]}"
