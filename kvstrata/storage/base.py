"""The storage tier (L3) interface: pages of `page_bytes` bytes addressed by page keys.

Every batch call is prefix-shaped, like the radix tree above it: a caller asks for the pages of a
sequence in order, and a backend answers *how many leading pages* it could find, read or store. A page
past the first gap is useless to the caller (its prefix is missing), so backends may stop there.

Failure policy ("degrade, never fail"): a backend that is down, slow or full answers with misses
(0 found / read / stored) and counts an error in `stats()`; it never raises out of `batch_exists`,
`batch_get` or `batch_set`. Misuse by the caller (a buffer of the wrong size, on the wrong device) is a
bug and raises `ValueError`. Construction raises `StorageError` when the backend cannot work at all.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch

from kvstrata.storage.errors import StorageError

__all__ = ["BACKENDS", "StorageBackend", "StorageError", "StorageStats", "create_backend"]


@dataclass
class StorageStats:
    """Counters of one backend instance (pages unless the name says `_bytes`)."""

    exists_queries: int = 0   # keys asked about in batch_exists
    exists_hits: int = 0      # leading keys found by batch_exists
    gets: int = 0             # pages asked for in batch_get
    hits: int = 0             # pages read successfully
    sets: int = 0             # pages offered to batch_set
    stored: int = 0           # pages stored (or already present)
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0           # backend failures (I/O errors, service down, full), not plain misses
    corrupt: int = 0          # pages found with the wrong size and dropped
    evictions: int = 0        # pages removed to respect a capacity limit
    skipped_unavailable: int = 0  # pages not attempted because the backend was known to be down


class StatsCounter:
    """Thread-safe increments of a StorageStats (batch calls may come from several copy threads)."""

    def __init__(self) -> None:
        self._stats = StorageStats()
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        """Add each named count to its counter."""
        with self._lock:
            for name, value in counts.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def snapshot(self) -> dict:
        """A copy of all counters as a plain dict."""
        with self._lock:
            return asdict(self._stats)


class StorageBackend(ABC):
    """One L3 backend: a key -> page store shared across processes (and machines, for distributed ones)."""

    name: str = "base"
    # True where batch_exists is a local check (a stat on a local disk), cheap enough to run on the
    # scheduler thread: a prefetch whose first object is not stored is then skipped at once, with no worker
    # round trip, no step waiting for its answer and no host pages taken for it.
    local_lookup: bool = False

    def __init__(self, page_bytes: int):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self._counter = StatsCounter()

    @abstractmethod
    def batch_exists(self, keys: list[str]) -> int:
        """How many leading keys exist (stops at the first missing one)."""

    @abstractmethod
    def batch_get(self, keys: list[str], buffers: list[torch.Tensor]) -> int:
        """Read page i into `buffers[i]` (CPU, contiguous, exactly page_bytes); returns leading pages read.

        Buffers after the first failed page may have been written partially and must not be used.
        """

    @abstractmethod
    def batch_set(self, keys: list[str], buffers: list[torch.Tensor]) -> int:
        """Store `buffers[i]` under `keys[i]`; returns leading pages stored. An existing key is a success."""

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Register host memory (the host pool) for zero-copy transfers; a no-op where unsupported."""
        return None

    def stats(self) -> dict:
        """Counters since creation: gets, sets, hits, bytes read/written, errors, ..."""
        return {"backend": self.name, **self._counter.snapshot()}

    def close(self) -> None:
        """Release connections and registrations; the backend is unusable afterwards."""
        return None

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers for backends
    def _check_batch(self, keys: list[str], buffers: list[torch.Tensor]) -> None:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        for buffer in buffers:
            check_page_buffer(buffer, self.page_bytes)


def check_page_buffer(buffer: torch.Tensor, page_bytes: int) -> None:
    """Raise ValueError unless `buffer` is a contiguous CPU tensor of exactly `page_bytes` bytes."""
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"page buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.device.type != "cpu":
        raise ValueError(f"page buffer must be in host memory, got device {buffer.device}")
    if not buffer.is_contiguous():
        raise ValueError("page buffer must be contiguous")
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes != page_bytes:
        raise ValueError(f"page buffer has {nbytes} bytes, the backend's pages have {page_bytes}")


def byte_view(buffer: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(buffer.reshape(-1).view(torch.uint8).numpy()).cast("B")


# ---------------------------------------------------------------------- registry
BACKENDS = ("file", "mooncake")


def create_backend(name: str, page_bytes: int, extra_config: dict | None = None,
                   storage_dir: str | None = None) -> StorageBackend:
    """Create the backend registered as `name` ("file" or "mooncake") for pages of `page_bytes` bytes.

    `extra_config` is the parsed `--hicache-storage-backend-extra-config`; `storage_dir` is
    `--hicache-storage-dir` (file backend only).
    """
    extra_config = dict(extra_config or {})
    # Imported here so that choosing one backend never imports another's dependencies.
    if name == "file":
        from kvstrata.storage.file_backend import FileBackend

        return FileBackend.from_config(page_bytes, extra_config, storage_dir)
    if name == "mooncake":
        from kvstrata.storage.mooncake_backend import MooncakeBackend

        return MooncakeBackend.from_config(page_bytes, extra_config)
    raise StorageError(f"unknown storage backend {name!r}; available: {', '.join(BACKENDS)}")
