"""An L3 prefetch never makes a new request wait longer than it has to (issue 19).

A request waits for its prefetch before it is admitted (--hicache-storage-prefetch-policy timeout). Two
things kept requests that arrived together from starting together:
- prefetches shared one worker with backups, so a lookup queued behind every page write of the prompts
  before it;
- a step started as soon as the first request was ready, and the others, whose lookups answered a moment
  later, waited that whole step out.
Prefetches now have their own worker, and a step waits (briefly, PREFETCH_GRACE_S) for prefetches
submitted just before it.
"""

from __future__ import annotations

import threading
import time

import torch

from kvstrata.cache import storage_tier
from kvstrata.cache.storage_io import StorageIO
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.host_pool import HostKVPool
from kvstrata.runtime.req import Req
from kvstrata.runtime.sampling_params import SamplingParams
from kvstrata.storage.file_backend import FileBackend
from tests.cache.drivers import follow_up_after_history, make_file_l3_manager, serve_history, settle


class GatedFileBackend(FileBackend):
    """A real file backend whose writes hold until the test opens the gate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def batch_set(self, keys, buffers):
        assert self.gate.wait(30)
        return super().batch_set(keys, buffers)


def _host_pool() -> HostKVPool:
    device = DeviceKVPool(16, 4, 2, 1, 8, torch.float32, "cpu")
    return HostKVPool(device, 32, layout="layer_first", pin_memory=False)


def _wait_ack(io: StorageIO, op_id: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(op.op_id == op_id for op in io.poll_acks()):
            return True
        io.wait_for_ack(0.05)
    return False


def test_a_prefetch_does_not_wait_behind_backups(tmp_path):
    host = _host_pool()
    backend = GatedFileBackend(host.page_bytes, root=tmp_path)
    io = StorageIO(backend, host)
    try:
        io.submit_backup(["a", "b"], [1, 2])             # its write holds until the gate opens
        lookup = io.submit_prefetch(["c", "d"], [3, 4])  # nothing stored under these keys
        assert _wait_ack(io, lookup.op_id, 10), "the prefetch waited for the backup in front of it"
        assert lookup.done == 0
        backend.gate.set()
        io.wait_idle(timeout=30)
        assert io.stats()["backed_up_pages"] == 2
    finally:
        backend.gate.set()
        io.shutdown()


def _remote_lookups(manager, monkeypatch) -> None:
    """Make the file backend answer lookups on the prefetch worker, as a remote store (Mooncake) does."""
    monkeypatch.setattr(manager.storage.io.backend, "local_lookup", False)


def test_a_step_waits_for_a_fresh_prefetch(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_tier, "PREFETCH_GRACE_S", 30.0)   # a slow machine must not change the outcome
    manager = make_file_l3_manager(tmp_path)
    _remote_lookups(manager, monkeypatch)
    try:
        nxt = follow_up_after_history(manager)
        assert not manager.prefetch_settled(nxt)         # a lookup is in flight
        started = time.monotonic()
        manager.begin_step()                             # the step that follows the arrival ...
        assert manager.prefetch_settled(nxt)             # ... starts only once the lookup has answered
        assert time.monotonic() - started < 10           # and not a grace period later
        assert manager.prefetch_ready(nxt)
    finally:
        manager.close()


def test_a_slow_prefetch_holds_a_step_only_for_the_grace_period(tmp_path, monkeypatch):
    monkeypatch.setattr(storage_tier, "PREFETCH_GRACE_S", 0.2)
    manager = make_file_l3_manager(tmp_path)
    _remote_lookups(manager, monkeypatch)
    backend = manager.storage.io.backend
    gate = threading.Event()
    real_exists = backend.batch_exists
    monkeypatch.setattr(backend, "batch_exists", lambda keys: gate.wait(30) and real_exists(keys))
    try:
        req = Req(rid="r0", prompt_ids=list(range(1, 41)), sampling=SamplingParams(max_new_tokens=1))
        manager.start_prefetch(req)
        started = time.monotonic()
        manager.begin_step()
        waited = time.monotonic() - started
        assert 0.1 <= waited < 5, f"the step waited {waited:.3f} s for a lookup that does not answer"
        assert not manager.prefetch_settled(req) and not manager.prefetch_ready(req)   # still waiting, per policy
        gate.set()
        settle(manager)
        manager.begin_step()
        assert manager.prefetch_settled(req) and manager.prefetch_ready(req)
    finally:
        gate.set()
        manager.close()


def test_a_local_miss_is_skipped_without_a_lookup_or_host_pages(tmp_path):
    manager = make_file_l3_manager(tmp_path)
    try:
        nxt = serve_history(manager)
        host = manager.host
        free, evicted = host.allocator.free_pages, host.stats["host_evicted_pages"]
        manager.start_prefetch(nxt)                     # the question is not in L3: a stat says so at once
        assert manager.prefetch_settled(nxt)            # no read started, none to retry ...
        assert manager.stats()["hicache"]["prefetch_skipped"] == {"not_stored": 1}   # ... because of the stat
        assert manager.prefetch_ready(nxt)              # nothing to wait for, not even a step
        # No host pages taken (so none evicted) for a read that could only miss, and no worker round trip.
        assert (host.allocator.free_pages, host.stats["host_evicted_pages"]) == (free, evicted)
        settle(manager)
        assert manager.storage.io.stats()["prefetch_ops"] == 0
    finally:
        manager.close()


def test_a_stored_prefix_is_still_read_from_l3(tmp_path):
    manager = make_file_l3_manager(tmp_path)
    try:
        nxt = serve_history(manager)                     # on the host, then in L3
        manager.device.evict(manager.tree.total_size())
        manager.host.evict(manager.host.allocator.capacity_pages)   # now only L3 has the history
        manager.start_prefetch(nxt)
        assert not manager.prefetch_settled(nxt)         # its first object is stored: read on the worker
        settle(manager)
        manager.begin_step()
        assert manager.prefetch_settled(nxt) and manager.prefetch_ready(nxt)
        assert manager.stats()["hicache"]["prefetched_tokens"] > 0
    finally:
        manager.close()
