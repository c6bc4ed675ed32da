"""The Mooncake backend: pages in a Mooncake distributed store, shared by every server of a cluster.

Transfers are zero-copy where they can be: `register_buffer(host_pool_tensor)` registers the host pool
with the Mooncake client once, and pages that live inside registered memory move with
`batch_put_from` / `batch_get_into` straight from / into their addresses. A page buffer outside any
registered region goes through a small registered staging buffer owned by the backend (one extra
memcpy), so the same zero-copy calls serve both cases and nothing depends on the copy APIs' buffer.
Each object is a page followed by its checksum trailer (page_checksum.py), moved as two buffers of one
object (`batch_*_multi_buffers`); a page that fails its checksum on load is removed and counted `corrupt`.

Faults never reach the caller: an exception or an RPC failure marks the backend down (see
Availability), later calls answer 0 at once and count `skipped_unavailable`, and the backend probes the
master's TCP port with backoff. So do ERRORS_BEFORE_DOWN calls in a row whose pages failed (not missed)
with no page served in between: a dead store service leaves the master answering while every transfer
fails (TRANSFER_FAIL), then every put finds no room (NO_AVAILABLE_HANDLE). While down, one call per
backoff probes; it brings the backend back only if it serves a page (found, read or stored). The Mooncake client reconnects to a restarted master by itself (observed
with mooncake-transfer-engine 0.3.x); if a probe finds the master reachable but calls keep failing, the
backend replaces the client with a new one and registers its buffers again.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import torch

from kvstrata.net import confined_listeners
from kvstrata.storage.availability import Availability
from kvstrata.storage.base import StorageBackend, StorageError, byte_view
from kvstrata.storage.mooncake_config import (
    MooncakeConfig,
    client_hostname,
    import_mooncake,
    resolve_mooncake_config,
)
from kvstrata.storage.page_checksum import TRAILER_BYTES, page_digest, page_is_intact

logger = logging.getLogger(__name__)

# Mooncake store error codes (mooncake-store types.h) that matter here.
NO_AVAILABLE_HANDLE = -200   # the cluster has no room for the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_ERRORS = range(-999, -899)  # RPC_FAIL and friends: the master is unreachable
CALL_FAILED = -999  # our code: the client call raised or answered nonsense
SKIPPED = -(1 << 30)  # our code: not attempted, the backend is down or closed
CORRUPT = -(1 << 29)  # our code: read, but the page failed its checksum (or had another size); removed
TRANSFER_ERRORS = (-800,)  # TRANSFER_FAIL: also what reading an object of another size answers
TRAILER_SLOTS = 1024  # pages per call: one registered checksum trailer each
STAGING_BYTES = 16 << 20
# Failed calls after a successful reachability probe before the client is rebuilt.
RECREATE_AFTER_FAILED_PROBES = 2
# Calls in a row with failed pages (and none served) before the store counts as unavailable.
ERRORS_BEFORE_DOWN = 3
WARN_INTERVAL_S = 60.0


class MooncakeBackend(StorageBackend):
    """L3 pages in a Mooncake store; one client per process, zero-copy on registered host memory."""

    name = "mooncake"

    def __init__(self, page_bytes: int, config: MooncakeConfig):
        super().__init__(page_bytes)
        self._mc = import_mooncake()
        self.config = config
        self._replicate = self._mc.ReplicateConfig()
        self._replicate.replica_num = config.replica_num
        self._regions: list[tuple[int, int, torch.Tensor]] = []  # (ptr, size, tensor kept alive)
        self._client_lock = threading.Lock()
        self._staging_lock = threading.Lock()
        self._staging: torch.Tensor | None = None
        self._trailers: torch.Tensor | None = None
        # Pages moved in place from/to registered memory, and pages copied through the staging buffer.
        self.zero_copy_pages = self.staged_pages = 0
        self.stored_bytes = page_bytes + TRAILER_BYTES
        self._retired: list = []  # replaced clients, closed at close() (another thread may still use one)
        self._failed_probes = 0
        self._error_calls = 0      # calls in a row with failed pages and none served
        self.client_recreations = 0
        self._closed = False
        self._last_warning: dict[str, float] = {}
        self.availability = Availability(f"Mooncake store (master {config.master_server_address})",
                                         config.retry_backoff_s, config.retry_backoff_max_s,
                                         probe=self._master_reachable)
        if not self._master_reachable():
            raise StorageError(f"cannot reach the Mooncake master at {config.master_server_address} "
                               f"(set MOONCAKE_MASTER or master_server_address to a running mooncake_master)")
        self._store = self._new_client()

    @classmethod
    def from_config(cls, page_bytes: int, extra_config: dict) -> MooncakeBackend:
        """Build from the extra config, $MOONCAKE_CONFIG_PATH and MOONCAKE_* environment variables."""
        import_mooncake()  # a missing package is the clearer error than a missing setting
        return cls(page_bytes, resolve_mooncake_config(extra_config))

    # ------------------------------------------------------------------ interface
    def batch_exists(self, keys: list[str]) -> int:
        """How many leading keys the cluster holds."""
        codes = self._call("exists", len(keys), lambda store: store.batch_is_exist(keys)) if keys else []
        found = _leading(codes, lambda c: c == 1)
        errors = sum(1 for c in codes if c < 0 and c != SKIPPED)
        self._counter.add(exists_queries=len(keys), exists_hits=found, errors=errors)
        return found

    def batch_get(self, keys: list[str], buffers: list[torch.Tensor]) -> int:
        """Read leading pages into `buffers`, zero-copy into registered memory."""
        self._check_batch(keys, buffers)
        codes = self._transfer("get", keys, buffers)
        read = _leading(codes, self._succeeded("get"))
        # Misses are not errors; corrupt pages are counted on their own.
        corrupt = codes.count(CORRUPT)
        errors = sum(1 for c in codes if c not in (self.stored_bytes, OBJECT_NOT_FOUND, SKIPPED, CORRUPT))
        self._counter.add(gets=len(keys), hits=read, bytes_read=read * self.page_bytes, errors=errors,
                          corrupt=corrupt)
        if errors:
            self._warn_burst("get", f"{errors} of {len(keys)} pages failed (codes {sorted(set(codes))})")
        return read

    def batch_set(self, keys: list[str], buffers: list[torch.Tensor]) -> int:
        """Store leading pages (an existing key counts as stored), zero-copy from registered memory."""
        self._check_batch(keys, buffers)
        codes = self._transfer("set", keys, buffers)
        stored = _leading(codes, self._succeeded("set"))
        errors = sum(1 for c in codes if c not in (0, OBJECT_ALREADY_EXISTS, SKIPPED))
        if errors:
            full = " (the store is full)" if NO_AVAILABLE_HANDLE in codes else ""
            self._warn_burst("set", f"{errors} of {len(keys)} pages not stored{full}, codes {sorted(set(codes))}")
        self._counter.add(sets=len(keys), stored=stored, errors=errors,
                          bytes_written=sum(1 for c in codes if c == 0) * self.page_bytes)
        return stored

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Register host memory (the host pool) so pages inside it transfer without copies."""
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("only contiguous host tensors can be registered")
        ptr, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        with self._client_lock:
            if any(p == ptr and s == size for p, s, _ in self._regions):
                return
            rc = self._store.register_buffer(ptr, size)
            if rc != 0:
                logger.warning("Mooncake could not register %d bytes of host memory (rc=%s); pages there "
                               "will be staged through a copy", size, rc)
                self._counter.add(errors=1)
                return
            self._regions.append((ptr, size, buffer))

    def stats(self) -> dict:
        """Counters plus availability and client recreations."""
        return {**super().stats(), "available": self.availability.up, "outages": self.availability.outages,
                "client_recreations": self.client_recreations, "zero_copy_pages": self.zero_copy_pages,
                "staged_pages": self.staged_pages}

    def close(self) -> None:
        """Close the client(s); later calls answer 0."""
        with self._client_lock:
            if self._closed:
                return
            self._closed = True
            for store in [self._store, *self._retired]:
                try:
                    store.close()
                except Exception as e:  # closing a client whose master is gone may complain
                    logger.debug("closing a Mooncake client failed: %s", e)
            self._retired.clear()
            self._regions.clear()

    # ------------------------------------------------------------------ transfers
    def _transfer(self, op: str, keys: list[str], buffers: list[torch.Tensor]) -> list[int]:
        """Run a put/get of pages + checksum trailers, in chunks; unregistered pages go through staging."""
        if not keys:
            return []
        with self._staging_lock:
            trailers = self._registered_scratch("_trailers", TRAILER_SLOTS, TRAILER_BYTES)
            chunk = TRAILER_SLOTS
            staging = None
            if not all(self._registered(b) for b in buffers):
                staging = self._registered_scratch("_staging", max(1, STAGING_BYTES // self.page_bytes),
                                                   self.page_bytes)
                chunk = min(chunk, staging.shape[0]) if staging is not None else 0
            if trailers is None or chunk == 0:
                return [CALL_FAILED] * len(keys)
            codes: list[int] = []
            for start in range(0, len(keys), chunk):
                part = slice(start, start + chunk)
                chunk_codes = self._staged(op, keys[part], buffers[part], staging, trailers)
                codes.extend(chunk_codes)
                if _leading(chunk_codes, self._succeeded(op)) < len(chunk_codes):
                    codes.extend([SKIPPED] * (len(keys) - len(codes)))  # no use going past a gap
                    break
            return codes

    def _staged(self, op: str, keys: list[str], buffers: list[torch.Tensor], staging: torch.Tensor | None,
                trailers: torch.Tensor) -> list[int]:
        ptrs, copies = [], []
        for buffer in buffers:
            if self._registered(buffer):
                ptrs.append(buffer.data_ptr())
            else:
                slot = staging[len(copies)]
                copies.append((slot, buffer.reshape(-1).view(torch.uint8)))
                ptrs.append(slot.data_ptr())
        if op == "set":
            for i, (key, buffer) in enumerate(zip(keys, buffers)):
                byte_view(trailers[i])[:] = page_digest(key, byte_view(buffer))
            for slot, page in copies:
                slot.copy_(page)
        self.zero_copy_pages += len(keys) - len(copies)   # under _staging_lock, as every transfer is
        self.staged_pages += len(copies)
        codes = self._multi_buffer(op, keys, ptrs, [trailers[i].data_ptr() for i in range(len(keys))])
        if op == "get":
            for slot, page in copies:
                page.copy_(slot)
            codes = self._verified(keys, buffers, codes, trailers)
        return codes

    def _multi_buffer(self, op: str, keys: list[str], ptrs: list[int], trailer_ptrs: list[int]) -> list[int]:
        """One object per key: its page bytes, then its trailer, moved in place."""
        all_ptrs = [[p, t] for p, t in zip(ptrs, trailer_ptrs)]
        sizes = [[self.page_bytes, TRAILER_BYTES]] * len(keys)
        if op == "get":
            return self._call(op, len(keys), lambda store: store.batch_get_into_multi_buffers(keys, all_ptrs, sizes))
        return self._call(op, len(keys),
                          lambda store: store.batch_put_from_multi_buffers(keys, all_ptrs, sizes, self._replicate))

    def _verified(self, keys: list[str], buffers: list[torch.Tensor], codes: list[int],
                  trailers: torch.Tensor) -> list[int]:
        """Codes of a get with every read page checked against its trailer; bad pages are CORRUPT, removed."""
        out = list(codes)
        for i, (key, code) in enumerate(zip(keys, codes)):
            if code == self.stored_bytes:
                intact = page_is_intact(key, byte_view(buffers[i]), byte_view(trailers[i]))
            elif code in TRANSFER_ERRORS:
                intact = self._object_size(key) in (None, self.stored_bytes)   # another size: an old or alien object
            else:
                continue
            if not intact:
                out[i] = CORRUPT
                self._drop_corrupt(key)
        return out

    def _object_size(self, key: str) -> int | None:
        try:
            size = int(self._store.get_size(key))
        except Exception:  # the store is failing: not evidence of corruption
            return None
        return size if size >= 0 else None

    def _drop_corrupt(self, key: str) -> None:
        self._warn_burst("corrupt", f"page {key} failed its checksum; removed it from the store")
        try:
            self._store.remove(key, True)
        except Exception as e:  # another process may have removed it already
            logger.debug("removing corrupt Mooncake object %s failed: %s", key, e)

    def _registered_scratch(self, name: str, rows: int, row_bytes: int) -> torch.Tensor | None:
        """A lazily created registered buffer of `rows` x `row_bytes` (None if it cannot be registered)."""
        scratch = getattr(self, name)
        if scratch is None:
            scratch = torch.zeros(rows, row_bytes, dtype=torch.uint8)
            self.register_buffer(scratch)
            if not self._registered(scratch[0], row_bytes):
                return None
            setattr(self, name, scratch)
        return scratch

    def _succeeded(self, op: str):
        if op == "get":
            return lambda code: code == self.stored_bytes
        return lambda code: code in (0, OBJECT_ALREADY_EXISTS)

    def _registered(self, buffer: torch.Tensor, nbytes: int | None = None) -> bool:
        ptr = buffer.data_ptr()
        end = ptr + (self.page_bytes if nbytes is None else nbytes)
        return any(p <= ptr and end <= p + s for p, s, _ in self._regions)

    # ------------------------------------------------------------------ faults
    def _warn_burst(self, kind: str, message: str) -> None:
        """Log a failure at most once per WARN_INTERVAL_S for each kind (errors are counted regardless)."""
        now = time.monotonic()
        if now - self._last_warning.get(kind, -WARN_INTERVAL_S) >= WARN_INTERVAL_S:
            self._last_warning[kind] = now
            logger.warning("Mooncake %s: %s", kind, message)

    def _call(self, op: str, n: int, fn) -> list[int]:
        """Run `fn(client)` unless the backend is down; any failure becomes error codes, never a raise."""
        probing = not self.availability.up  # allowed while down: this call is the one probe
        if self._closed or not self.availability.allow():
            self._counter.add(skipped_unavailable=n)
            return [SKIPPED] * n
        try:
            codes = [int(c) for c in fn(self._store)]
        except Exception as e:
            self._on_failure(op, repr(e), probing)
            return [CALL_FAILED] * n
        if len(codes) != n:
            self._on_failure(op, f"{len(codes)} results for {n} keys", probing)
            return [CALL_FAILED] * n
        if any(c in RPC_ERRORS for c in codes):
            self._on_failure(op, f"RPC failure (code {min(codes)})", probing)
            return codes
        self._failed_probes = 0
        served, failed = self._served(op, codes)
        if served:
            self._error_calls = 0
            self.availability.succeeded()
        elif failed:
            self._error_calls += 1
            if probing or self._error_calls >= ERRORS_BEFORE_DOWN:
                self.availability.failed(f"{op}: {self._error_calls} calls in a row with failed pages "
                                         f"(codes {sorted(set(codes))})")
        elif probing:       # only misses: no evidence that the store serves again; probe later
            self.availability.failed(f"{op}: the probe found no page")
        return codes

    def _served(self, op: str, codes: list[int]) -> tuple[bool, bool]:
        """Whether a call's raw codes served any page, and whether any page failed (rather than missed)."""
        if op == "exists":
            return any(c == 1 for c in codes), any(c < 0 for c in codes)
        ok = self._succeeded(op)
        miss = OBJECT_NOT_FOUND if op == "get" else None
        return any(ok(c) for c in codes), any(not ok(c) and c != miss for c in codes)

    def _on_failure(self, op: str, reason: str, probing: bool) -> None:
        self.availability.failed(f"{op}: {reason}")
        if not probing:
            return
        # The probe found the master reachable, yet the call failed: the client may be stuck.
        self._failed_probes += 1
        if self._failed_probes >= RECREATE_AFTER_FAILED_PROBES:
            self._failed_probes = 0
            self._recreate_client()

    def _recreate_client(self) -> None:
        """Replace the Mooncake client by a new one with the same registrations (master must be reachable)."""
        if not self._master_reachable():
            return  # setting up a client against a dead master blocks for its whole retry budget
        with self._client_lock:
            if self._closed:
                return
            try:
                store = self._new_client()
            except StorageError as e:
                logger.warning("recreating the Mooncake client failed: %s", e)
                return
            for ptr, size, _ in self._regions:
                store.register_buffer(ptr, size)
            self._retired.append(self._store)
            self._store = store
            self.client_recreations += 1
        logger.warning("recreated the Mooncake client (#%d)", self.client_recreations)
        self.availability.retry_now()

    def _new_client(self):
        c = self.config
        store = self._mc.MooncakeDistributedStore()
        hostname = client_hostname(c)
        try:
            with confined_listeners(hostname.rsplit(":", 1)[0] if hostname.count(":") == 1 else hostname):
                rc = store.setup(hostname, c.metadata_server, c.global_segment_size, c.local_buffer_size,
                                 c.protocol, c.device_name, c.master_server_address)
        except Exception as e:
            raise StorageError(f"Mooncake client setup raised: {e}") from e
        if rc != 0:
            raise StorageError(f"Mooncake client setup failed (rc={rc}) with master {c.master_server_address}, "
                               f"metadata {c.metadata_server}, protocol {c.protocol}")
        return store

    def _master_reachable(self) -> bool:
        address = self.config.master_host_port()
        if address is None:
            return True  # an HA address (etcd://...) cannot be probed with a plain connect
        try:
            with socket.create_connection(address, timeout=self.config.connect_timeout_s):
                return True
        except OSError:
            return False


def _leading(codes: list[int], ok) -> int:
    """How many leading codes satisfy `ok`."""
    n = 0
    for code in codes:
        if not ok(code):
            break
        n += 1
    return n
