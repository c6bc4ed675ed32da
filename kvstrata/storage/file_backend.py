"""The file backend: one file per page in a local directory, shared by every process on the machine.

    <root>/<first 2 chars of key>/<key>         a page: page_bytes bytes, then its checksum trailer
    <root>/<shard>/.<key>.<pid>.<nonce>.tmp     a page being written (renamed into place when complete)

Why this is safe with several processes and no locks:
- a page appears only by `os.replace` of a complete temp file from the same directory, so a reader sees
  either no file or a whole page; two writers of one key each rename their own complete file;
- a file that vanishes between `batch_exists` and `batch_get` (evicted by another process) is a miss;
- a file of the wrong size, or whose bytes fail their checksum (page_checksum.py: flipped bits, a
  zero-filled file, a page copied under another key), is a miss: it is deleted and counted `corrupt`.

Recency for LRU is the file's mtime, set explicitly with nanosecond time on write and on every read, so
the eviction order does not depend on the filesystem's timestamp granularity or atime settings. The
capacity limit is soft: usage is estimated between scans and a scan (evicting down to a low watermark)
runs only when the estimate crosses the limit or the last scan is old, so its cost is amortized.

There is always a limit: `capacity_gb` / `capacity_bytes`, else half of what the directory could hold at
start (file_store_dir.default_capacity_bytes). A disk that fills up anyway (other writers) shrinks the
limit to what this process's directory holds now and evicts down to its low watermark; write errors are
logged once per interval, not once per page.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from hashlib import sha256
from pathlib import Path

import torch

from kvstrata.log_limit import IntervalLog
from kvstrata.storage.base import StorageBackend, StorageError, byte_view
from kvstrata.storage.file_store_dir import DEFAULT_FREE_FRACTION, default_capacity_bytes, default_storage_dir
from kvstrata.storage.local_fs import is_local_filesystem
from kvstrata.storage.page_checksum import TRAILER_BYTES, page_digest, page_is_intact

logger = logging.getLogger(__name__)

GB = 1e9
_SAFE_KEY = re.compile(r"[A-Za-z0-9_\-]{1,128}")
# A temp file this old belongs to a writer that died; scans remove it.
STALE_TEMP_S = 600.0
FILE_CONFIG_KEYS = {"capacity_gb", "capacity_bytes", "rescan_interval_s", "low_watermark"}
DISK_FULL_RESCAN_S = 1.0    # a disk that stays full: each second, another low-watermark share is evicted
__all__ = ["FileBackend", "default_storage_dir"]


class FileBackend(StorageBackend):
    """Pages as files under one directory, with a capacity limit (given, or a default) and LRU eviction."""

    name = "file"

    def __init__(self, page_bytes: int, root: str | os.PathLike | None = None,
                 capacity_bytes: int | None = None, rescan_interval_s: float = 30.0,
                 low_watermark: float = 0.9):
        super().__init__(page_bytes)
        self.root = Path(root).expanduser() if root else default_storage_dir()
        if capacity_bytes is not None and capacity_bytes < page_bytes:
            raise StorageError(f"file backend capacity {capacity_bytes} bytes is below one page ({page_bytes})")
        if not 0.0 < low_watermark <= 1.0:
            raise StorageError(f"low_watermark must be in (0, 1], got {low_watermark}")
        self.capacity_bytes = capacity_bytes or 0       # the default is set after the first scan, below
        self.capacity_source = "configured"
        self.stored_bytes = page_bytes + TRAILER_BYTES
        self.rescan_interval_s = rescan_interval_s
        self.low_watermark = low_watermark
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create storage directory {self.root}: {e}") from e
        if not os.access(self.root, os.W_OK):
            raise StorageError(f"storage directory {self.root} is not writable")
        # batch_exists is a stat per key: cheap enough for the scheduler thread on a local disk only.
        self.local_lookup = is_local_filesystem(self.root)
        self._scan_lock = threading.Lock()
        self._estimated_bytes = 0
        self._last_scan = 0.0
        self._last_disk_full = 0.0
        self._errors = {op: IntervalLog(logger) for op in ("stat", "read", "write")}
        self._disk_full = IntervalLog(logger)
        if capacity_bytes is None:
            _pages, stored = self._scan()
            self.capacity_bytes = max(self.stored_bytes, default_capacity_bytes(self.root, stored))
            self.capacity_source = f"default: {DEFAULT_FREE_FRACTION:.0%} of free space at start"
            logger.info("file storage %s: capacity %.2f GB (%s; capacity_gb sets it)", self.root,
                        self.capacity_bytes / GB, self.capacity_source)
        self._scan_and_evict()  # learn what earlier runs left behind

    @classmethod
    def from_config(cls, page_bytes: int, extra_config: dict, storage_dir: str | None) -> FileBackend:
        """Build from `--hicache-storage-dir` and the extra config (`capacity_gb` or `capacity_bytes`)."""
        unknown = sorted(set(extra_config) - FILE_CONFIG_KEYS)
        if unknown:
            logger.warning("file storage backend ignores extra config keys: %s", ", ".join(unknown))
        capacity = extra_config.get("capacity_bytes")
        if capacity is None and extra_config.get("capacity_gb") is not None:
            capacity = float(extra_config["capacity_gb"]) * GB
        return cls(page_bytes, storage_dir,
                   capacity_bytes=int(capacity) if capacity is not None else None,
                   rescan_interval_s=float(extra_config.get("rescan_interval_s", 30.0)),
                   low_watermark=float(extra_config.get("low_watermark", 0.9)))

    # ------------------------------------------------------------------ paths
    def page_path(self, key: str) -> Path:
        """The file that holds page `key` (keys that are not plain file names are hashed)."""
        name = key if _SAFE_KEY.fullmatch(key) else sha256(key.encode("utf-8")).hexdigest()
        return self.root / name[:2] / name

    # ------------------------------------------------------------------ interface
    def stats(self) -> dict:
        """The counters, with the capacity limit and where it came from."""
        return {**super().stats(), "capacity_bytes": self.capacity_bytes, "capacity_source": self.capacity_source}

    def batch_exists(self, keys: list[str]) -> int:
        """How many leading keys have a complete page file."""
        found = 0
        for key in keys:
            if not self._page_ok(self.page_path(key)):
                break
            found += 1
        self._counter.add(exists_queries=len(keys), exists_hits=found)
        return found

    def batch_get(self, keys: list[str], buffers: list[torch.Tensor]) -> int:
        """Read leading pages into `buffers`; a missing or corrupt page ends the batch."""
        self._check_batch(keys, buffers)
        read = 0
        for key, buffer in zip(keys, buffers, strict=True):
            if not self._read_page(key, buffer):
                break
            read += 1
        self._counter.add(gets=len(keys), hits=read, bytes_read=read * self.page_bytes)
        return read

    def batch_set(self, keys: list[str], buffers: list[torch.Tensor]) -> int:
        """Write leading pages atomically; a page already on disk is only marked recently used."""
        self._check_batch(keys, buffers)
        stored = written = 0
        for key, buffer in zip(keys, buffers, strict=True):
            path = self.page_path(key)
            if self._page_ok(path) and _touch(path):
                stored += 1
                continue
            if not self._write_page(key, path, buffer):
                break
            stored += 1
            written += 1
        self._counter.add(sets=len(keys), stored=stored, bytes_written=written * self.page_bytes)
        if written:
            self._after_write(written * self.stored_bytes)
        return stored

    # ------------------------------------------------------------------ page files
    def _page_ok(self, path: Path) -> bool:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return False
        except OSError as e:
            self._error("stat", path, e)
            return False
        if size != self.stored_bytes:
            self._drop_corrupt(path, f"{size} bytes, expected {self.stored_bytes}")
            return False
        return True

    def _read_page(self, key: str, buffer: torch.Tensor) -> bool:
        path = self.page_path(key)
        view = byte_view(buffer)
        trailer = bytearray(TRAILER_BYTES)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != self.stored_bytes:
                    self._drop_corrupt(path, f"{size} bytes, expected {self.stored_bytes}")
                    return False
                got = _read_fully(f, view) + _read_fully(f, memoryview(trailer))
        except FileNotFoundError:
            return False  # evicted or never written: a miss
        except OSError as e:
            self._error("read", path, e)
            return False
        if got != self.stored_bytes:
            self._drop_corrupt(path, f"read {got} bytes, expected {self.stored_bytes}")
            return False
        if not page_is_intact(key, view, trailer):
            self._drop_corrupt(path, "checksum mismatch")
            return False
        _touch(path)
        return True

    def _write_page(self, key: str, path: Path, buffer: torch.Tensor) -> bool:
        temp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp"
        try:
            try:
                f = open(temp, "wb", buffering=0)
            except FileNotFoundError:  # first page of this shard (or the directory was wiped)
                path.parent.mkdir(parents=True, exist_ok=True)
                f = open(temp, "wb", buffering=0)
            with f:
                view = byte_view(buffer)
                _write_fully(f, view)
                _write_fully(f, memoryview(page_digest(key, view)))
            _touch(temp)
            os.replace(temp, path)
            return True
        except OSError as e:
            self._error("write", path, e)
            _unlink_quietly(temp)
            if e.errno == errno.ENOSPC:
                self._on_disk_full()
            return False

    def _drop_corrupt(self, path: Path, why: str) -> None:
        logger.warning("dropping corrupt page file %s (%s)", path, why)
        self._counter.add(corrupt=1)
        try:
            path.unlink()
        except OSError:
            pass  # another process got there first

    def _error(self, op: str, path: Path, e: OSError) -> None:
        self._errors[op].hit("file storage %s failed for %s: %s", op, path, e)
        self._counter.add(errors=1)

    def _on_disk_full(self) -> None:
        """The filesystem filled before the limit did: hold no more than now, and make room."""
        now = time.monotonic()
        if now - self._last_disk_full < DISK_FULL_RESCAN_S:
            return
        self._last_disk_full = now
        self._scan_and_evict(shrink_to_fit=True)
        self._disk_full.hit("file storage: no space left on the device of %s; capacity lowered to %.3f GB, "
                            "least recently used pages evicted", self.root, self.capacity_bytes / GB)

    # ------------------------------------------------------------------ capacity
    def _after_write(self, new_bytes: int) -> None:
        self._estimated_bytes += new_bytes
        overdue = time.monotonic() - self._last_scan > self.rescan_interval_s
        if self._estimated_bytes > self.capacity_bytes or overdue:
            self._scan_and_evict()

    def _scan_and_evict(self, shrink_to_fit: bool = False) -> None:
        """Measure the directory and evict least recently used pages down to the low watermark
        (`shrink_to_fit`: first lower the limit to what the directory holds now)."""
        if not self._scan_lock.acquire(blocking=False):
            return  # another thread of this process is already scanning
        try:
            pages, total = self._scan()
            if shrink_to_fit:
                self.capacity_bytes = max(self.stored_bytes, min(self.capacity_bytes, total))
            if total > self.capacity_bytes * (self.low_watermark if shrink_to_fit else 1.0):
                target = self.capacity_bytes * self.low_watermark
                pages.sort()
                evicted = 0
                for _mtime, size, path in pages:
                    if total <= target:
                        break
                    try:
                        os.unlink(path)
                        evicted += 1
                    except FileNotFoundError:
                        pass  # evicted by another process: the space is free all the same
                    except OSError as e:
                        logger.warning("cannot evict %s: %s", path, e)
                        continue
                    total -= size
                self._counter.add(evictions=evicted)
            self._estimated_bytes = total
            self._last_scan = time.monotonic()
        finally:
            self._scan_lock.release()

    def _scan(self) -> tuple[list[tuple[int, int, str]], int]:
        pages: list[tuple[int, int, str]] = []
        total = 0
        now_ns = time.time_ns()
        for shard in _scandir(self.root):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in _scandir(shard.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith("."):
                    if (now_ns - st.st_mtime_ns) / 1e9 > STALE_TEMP_S:
                        _unlink_quietly(entry.path)
                    continue
                pages.append((st.st_mtime_ns, st.st_size, entry.path))
                total += st.st_size
        return pages, total


def _read_fully(f, view: memoryview) -> int:
    """Read into all of `view` (short only at end of file); returns the bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _write_fully(f, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += f.write(view[done:])


def _touch(path: Path) -> bool:
    """Mark `path` used now (nanosecond mtime, the LRU clock); False if it vanished."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
        return True
    except OSError:
        return False


def _scandir(path: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
