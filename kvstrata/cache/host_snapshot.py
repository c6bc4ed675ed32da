"""L2 snapshot: the host tier saved to a local file when the server stops, reloaded and verified at start.

A restart (an in-place upgrade, a new version) loses the device tier but need not lose the host tier: on
shutdown every node the host tier alone can serve (`HostTier.host_chain`) is written out with its
pages; the next process on the same weights and page shape reads it back into its host pool before it
reports ready, so returning sessions hit L2 instead of re-prefilling.

    file    = MAGIC || frame(header) || record*            frame(x) = 4-byte little-endian length || JSON x
    header  = {"namespace", "page_size", "page_bytes"}     the engine's KV namespace (weights, KV format, page)
    record  = frame({"parent", "ns", "key"}) || page*      parent: an earlier record's index, or -1 (a root)
    page    = page bytes (canonical order) || checksum trailer bound to the page's key (storage/page_checksum)

Nothing in the file is trusted: each page's key is recomputed on load from the tokens of its whole path
(cache/page_hash's chain, in the engine's own namespace), and its trailer must match it. A record that
fails, or whose parent was not restored, is skipped with its subtree; a file of another model, dtype or
page size is ignored whole. A loaded snapshot is deleted: it describes a process that no longer exists,
and the next clean stop writes a new one.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import struct
import time
from dataclasses import asdict, dataclass
from typing import BinaryIO, Optional

from kvstrata.cache.host_tier import HostTier
from kvstrata.cache.page_hash import page_keys, request_namespace
from kvstrata.cache.radix_tree import TreeNode
from kvstrata.storage.page_checksum import TRAILER_BYTES, page_digest, page_is_intact

logger = logging.getLogger(__name__)

MAGIC = b"kvstrata-l2-snapshot-v2\n"   # v2: 16-byte XXH3 page trailers (v1: SHA-256)
_LEN = struct.Struct("<I")
MAX_FRAME_BYTES = 64 << 20      # a record's JSON (its tokens) is far below this; more means a broken file


@dataclass
class SnapshotStats:
    """What one save or load did."""

    records: int = 0
    pages: int = 0
    tokens: int = 0
    skipped_records: int = 0     # failed verification, or their parent was not restored
    rejected: str = ""           # why the whole file was ignored (another model, a broken header, ...)
    host_full: bool = False      # the host pool ran out of pages before the file did
    seconds: float = 0.0

    def as_dict(self) -> dict:
        """Plain dict (for /server_info and logs)."""
        return asdict(self)


class HostSnapshot:
    """Saves and restores one tree's host tier at `path`, in the engine's KV `namespace`."""

    def __init__(self, path: str, namespace: str):
        self.path = path
        self.namespace = namespace
        self.last_load: Optional[SnapshotStats] = None
        self.last_save: Optional[SnapshotStats] = None

    @classmethod
    def for_engine(cls, path: str, model_path: str, dtype: str, page_size: int, extra: str = "") -> HostSnapshot:
        """A snapshot in the namespace of an engine serving `model_path` in `dtype` with `page_size` (`extra`:
        more that tells its weights apart)."""
        from kvstrata.cache.storage_io import kv_namespace

        return cls(path, kv_namespace(model_path, dtype, page_size, extra))

    def stats(self) -> dict:
        """The last load and save (for /server_info)."""
        return {"path": self.path, "last_load": self.last_load and self.last_load.as_dict(),
                "last_save": self.last_save and self.last_save.as_dict()}

    # ---- save ---------------------------------------------------------------------------------------------

    def save(self, host: HostTier) -> SnapshotStats:
        """Write every host-servable node of the tree (atomically: a crash mid-write leaves the old file)."""
        start = time.monotonic()
        host.back_up_device_only()
        stats = SnapshotStats()
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            self._write(tmp, host, stats)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):     # a partial file on a full disk holds its space until removed
                os.unlink(tmp)
            raise
        stats.seconds = time.monotonic() - start
        self.last_save = stats
        logger.info("L2 snapshot saved to %s: %d pages (%d tokens) in %.2f s", self.path, stats.pages,
                    stats.tokens, stats.seconds)
        return stats

    def _write(self, tmp: str, host: HostTier, stats: SnapshotStats) -> None:
        """The snapshot file's bytes into `tmp`, flushed to disk; counts into `stats`."""
        page_size = host.page_size
        index: dict[TreeNode, int] = {}
        last_key: dict[TreeNode, str] = {}
        pool = host.host_pool
        with open(tmp, "wb") as fh:
            fh.write(MAGIC)
            _write_frame(fh, {"namespace": self.namespace, "page_size": page_size,
                              "page_bytes": pool.page_bytes})
            for ns, node in host.host_chain():
                keys = page_keys(node.key, page_size, request_namespace(self.namespace, ns),
                                 last_key.get(node.parent))
                _write_frame(fh, {"parent": index.get(node.parent, -1), "ns": ns, "key": list(node.key)})
                for key, page in zip(keys, node.host.pages.tolist()):
                    data = pool.page_tensor_copy(page).numpy().tobytes()
                    fh.write(data)
                    fh.write(page_digest(key, data))
                index[node], last_key[node] = stats.records, keys[-1]
                stats.records += 1
                stats.pages += len(keys)
                stats.tokens += len(node.key)
            fh.flush()
            os.fsync(fh.fileno())

    # ---- load ---------------------------------------------------------------------------------------------

    def load(self, host: HostTier) -> SnapshotStats:
        """Restore what the file at `path` holds into the (empty) host tier, then delete the file."""
        start = time.monotonic()
        stats = SnapshotStats()
        for stale in glob.glob(glob.escape(self.path) + ".*.tmp"):   # a save killed mid-write
            with contextlib.suppress(OSError):
                os.unlink(stale)
        if not os.path.exists(self.path):
            return stats
        try:
            with open(self.path, "rb") as fh:
                self._load_from(fh, host, stats)
        except (OSError, ValueError) as e:      # a truncated or garbled file: keep what verified so far
            stats.rejected = stats.rejected or f"unreadable after {stats.records} records: {e}"
        try:
            os.unlink(self.path)
        except OSError:
            pass
        stats.seconds = time.monotonic() - start
        self.last_load = stats
        if stats.rejected and not stats.records:
            logger.warning("L2 snapshot %s ignored: %s", self.path, stats.rejected)
        else:
            logger.info("L2 snapshot %s restored: %d pages (%d tokens), %d records skipped%s, in %.2f s",
                        self.path, stats.pages, stats.tokens, stats.skipped_records,
                        " (host pool full)" if stats.host_full else "", stats.seconds)
        return stats

    def _load_from(self, fh: BinaryIO, host: HostTier, stats: SnapshotStats) -> None:
        pool, page_size = host.host_pool, host.page_size
        if fh.read(len(MAGIC)) != MAGIC:
            stats.rejected = "not a kvstrata L2 snapshot"
            return
        header = _read_frame(fh)
        expected = {"namespace": self.namespace, "page_size": page_size, "page_bytes": pool.page_bytes}
        if header != expected:
            stats.rejected = "written by an engine with other weights, dtype or page shape"
            return
        restored: dict[int, tuple[tuple[int, ...], str]] = {}   # record index -> (its token path, last key)
        record_id = -1
        while (record := _read_frame(fh, allow_eof=True)) is not None:
            record_id += 1
            key, ns, parent_id = _record_fields(record)
            num_pages = len(key) // page_size
            pages = [_read_exact(fh, pool.page_bytes + TRAILER_BYTES) for _ in range(num_pages)]
            if stats.host_full:
                continue
            parent = restored.get(parent_id) if parent_id >= 0 else ((), None)
            if parent is None or not key or len(key) % page_size:
                stats.skipped_records += 1
                continue
            prefix, prior = parent
            keys = page_keys(key, page_size, request_namespace(self.namespace, ns), prior)
            if not all(page_is_intact(k, p[:pool.page_bytes], p[pool.page_bytes:]) for k, p in zip(keys, pages)):
                stats.skipped_records += 1
                continue
            host_pages = host.allocator.alloc(num_pages)
            if host_pages is None:
                stats.host_full = True
                continue
            for page, data in zip(host_pages, pages):
                pool.write_page_bytes(page, memoryview(data)[:pool.page_bytes])
            path = prefix + tuple(key)
            # The same call the L3 prefetch lands its pages with: the tree keeps what it lacks.
            if host.insert_host_pages(list(path), host_pages, ns, start=len(prefix)) is None:
                stats.skipped_records += 1
                continue
            restored[record_id] = (path, keys[-1])
            stats.records += 1
            stats.pages += num_pages
            stats.tokens += len(key)


def _record_fields(record: dict) -> tuple[tuple[int, ...], Optional[str], int]:
    """(key, cache namespace, parent index) of a record, or ValueError if it has not got that shape."""
    key, ns, parent = record.get("key"), record.get("ns"), record.get("parent")
    if not (isinstance(key, list) and all(type(t) is int and 0 <= t < 2**31 for t in key)
            and (ns is None or isinstance(ns, str)) and type(parent) is int):
        raise ValueError("a record without a valid key, ns and parent")
    return tuple(key), ns, parent


def _write_frame(fh: BinaryIO, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    fh.write(_LEN.pack(len(data)))
    fh.write(data)


def _read_frame(fh: BinaryIO, allow_eof: bool = False) -> Optional[dict]:
    head = fh.read(_LEN.size)
    if not head and allow_eof:
        return None
    if len(head) != _LEN.size:
        raise ValueError("truncated frame length")
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes")
    obj = json.loads(_read_exact(fh, size))
    if not isinstance(obj, dict):
        raise ValueError("frame is not a JSON object")
    return obj


def _read_exact(fh: BinaryIO, size: int) -> bytes:
    data = fh.read(size)
    if len(data) != size:
        raise ValueError(f"truncated: wanted {size} bytes, got {len(data)}")
    return data
