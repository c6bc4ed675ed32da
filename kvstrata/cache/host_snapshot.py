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

Tensor parallelism (cache/shards.py): each rank has its own file (`Shard.path`: `<path>.tp<N>-rank<r>`,
its header and namespace name the TP size and rank). Rank 0 writes the records above; every other rank
writes a ShardSnapshot: its share of the same pages under the same keys, in rank 0's order, each page's
trailer bound to its shard's name. A restore is kept only if every rank restored its share of every page
rank 0 restored; otherwise every rank starts cold.
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
from kvstrata.cache.shards import RankLink, Shard
from kvstrata.memory.host_pool import HostKVPool
from kvstrata.storage.page_checksum import TRAILER_BYTES, page_digest, page_is_intact

logger = logging.getLogger(__name__)

MAGIC = b"kvstrata-l2-snapshot-v2\n"   # v2: 16-byte XXH3 page trailers (v1: SHA-256)
SHARD_MAGIC = b"kvstrata-l2-snapshot-shard-v1\n"
KEY_BYTES = 64                  # a page key: SHA-256 as hex (page_hash.py)
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
    other_ranks_failed: bool = False   # tensor parallelism: another rank could not save / restore its share
    seconds: float = 0.0

    def as_dict(self) -> dict:
        """Plain dict (for /server_info and logs)."""
        return asdict(self)


class HostSnapshot:
    """Saves and restores one tree's host tier at `path`, in the engine's KV `namespace`; under tensor
    parallelism (rank 0's `shard`) the other ranks save and restore their shares through `ranks`."""

    def __init__(self, path: str, namespace: str, shard: Shard = Shard(), ranks: RankLink | None = None):
        self.path = path
        self.namespace = namespace
        self.shard = shard
        self.ranks = ranks
        self.last_load: Optional[SnapshotStats] = None
        self.last_save: Optional[SnapshotStats] = None

    @classmethod
    def for_engine(cls, path: str, model_path: str, dtype: str, page_size: int, extra: str = "",
                   shard: Shard = Shard(), ranks: RankLink | None = None) -> HostSnapshot:
        """A snapshot in the namespace of an engine serving `model_path` in `dtype` with `page_size` (`extra`:
        more that tells its weights apart), in rank 0's file of `shard`'s TP size."""
        return cls(shard.path(path), snapshot_namespace(model_path, dtype, page_size, extra, shard), shard, ranks)

    def _header(self, page_bytes: int, page_size: int) -> dict:
        header = {"namespace": self.namespace, "page_size": page_size, "page_bytes": page_bytes}
        if self.shard.tp_size > 1:
            header.update(tp_size=self.shard.tp_size, rank=self.shard.rank)
        return header

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
        written: list[tuple[str, int]] = []
        try:
            self._write(tmp, host, stats, written)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):     # a partial file on a full disk holds its space until removed
                os.unlink(tmp)
            raise
        if self.ranks is not None and not self.ranks.snapshot_saved(*_unzip(written)):
            stats.other_ranks_failed = True        # the next start finds a rank without its share: all cold
            logger.error("L2 snapshot: another rank could not save its share; the next start will be cold")
        stats.seconds = time.monotonic() - start
        self.last_save = stats
        logger.info("L2 snapshot saved to %s: %d pages (%d tokens) in %.2f s", self.path, stats.pages,
                    stats.tokens, stats.seconds)
        return stats

    def _write(self, tmp: str, host: HostTier, stats: SnapshotStats, written: list[tuple[str, int]]) -> None:
        """The snapshot file's bytes into `tmp`, flushed to disk; counts into `stats`, each page's (key, host
        page) into `written`."""
        page_size = host.page_size
        index: dict[TreeNode, int] = {}
        last_key: dict[TreeNode, str] = {}
        pool = host.host_pool
        with open(tmp, "wb") as fh:
            fh.write(MAGIC)
            _write_frame(fh, self._header(pool.page_bytes, page_size))
            for ns, node in host.host_chain():
                keys = page_keys(node.key, page_size, request_namespace(self.namespace, ns),
                                 last_key.get(node.parent))
                _write_frame(fh, {"parent": index.get(node.parent, -1), "ns": ns, "key": list(node.key)})
                for key, page in zip(keys, node.host.pages.tolist()):
                    data = pool.page_tensor_copy(page).numpy().tobytes()
                    fh.write(data)
                    fh.write(page_digest(key, data))
                    written.append((key, page))
                index[node], last_key[node] = stats.records, keys[-1]
                stats.records += 1
                stats.pages += len(keys)
                stats.tokens += len(node.key)
            fh.flush()
            os.fsync(fh.fileno())

    # ---- load ---------------------------------------------------------------------------------------------

    def load(self, host: HostTier) -> SnapshotStats:
        """Restore what the file at `path` holds into the (empty) host tier, then delete the file. Under tensor
        parallelism the restore stands only if every rank restored its share (`other_ranks_failed`: the
        caller then empties the host tier)."""
        start = time.monotonic()
        stats = SnapshotStats()
        restored: list[tuple[str, int]] = []
        for stale in glob.glob(glob.escape(self.path) + ".*.tmp"):   # a save killed mid-write
            with contextlib.suppress(OSError):
                os.unlink(stale)
        if not os.path.exists(self.path):
            self._agree_restore(stats, restored)
            return stats
        try:
            with open(self.path, "rb") as fh:
                self._load_from(fh, host, stats, restored)
        except (OSError, ValueError) as e:      # a truncated or garbled file: keep what verified so far
            stats.rejected = stats.rejected or f"unreadable after {stats.records} records: {e}"
        try:
            os.unlink(self.path)
        except OSError:
            pass
        stats.seconds = time.monotonic() - start
        self._agree_restore(stats, restored)
        self.last_load = stats
        if stats.rejected and not stats.records:
            logger.warning("L2 snapshot %s ignored: %s", self.path, stats.rejected)
        else:
            logger.info("L2 snapshot %s restored: %d pages (%d tokens), %d records skipped%s, in %.2f s",
                        self.path, stats.pages, stats.tokens, stats.skipped_records,
                        " (host pool full)" if stats.host_full else "", stats.seconds)
        return stats

    def _agree_restore(self, stats: SnapshotStats, restored: list[tuple[str, int]]) -> None:
        """Tensor parallelism: the other ranks restore their shares of `restored` (every rank is asked, even
        for nothing, so that each deletes its file); one that cannot makes the restore void."""
        if self.ranks is None or self.ranks.snapshot_restored(*_unzip(restored)):
            return
        stats.other_ranks_failed = True
        stats.rejected = "another tensor-parallel rank could not restore its share: every rank starts cold"
        stats.records = stats.pages = stats.tokens = 0
        logger.warning("L2 snapshot %s not restored: %s", self.path, stats.rejected)

    def _load_from(self, fh: BinaryIO, host: HostTier, stats: SnapshotStats,
                   restored_pages: list[tuple[str, int]]) -> None:
        pool, page_size = host.host_pool, host.page_size
        if fh.read(len(MAGIC)) != MAGIC:
            stats.rejected = "not a kvstrata L2 snapshot"
            return
        header = _read_frame(fh)
        if header != self._header(pool.page_bytes, page_size):
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
            restored_pages.extend(zip(keys, host_pages))
            stats.records += 1
            stats.pages += num_pages
            stats.tokens += len(key)


class ShardSnapshot:
    """A rank > 0's L2 snapshot: its share of the pages of rank 0's snapshot, by rank 0's keys, in its order.

        file  = SHARD_MAGIC || frame(header) || page*       header = {"namespace", "page_size", "page_bytes",
        page  = key (64 ASCII bytes) || page bytes || trailer          "tp_size", "rank", "pages"}

    The trailer is bound to the key's shard name (Shard.object_key): another rank's page does not verify.
    The file is only ever read as rank 0 asks, page by page, so it needs no tree of its own."""

    def __init__(self, path: str, namespace: str, shard: Shard):
        self.path = path
        self.namespace = namespace
        self.shard = shard

    @classmethod
    def for_engine(cls, path: str, model_path: str, dtype: str, page_size: int, extra: str,
                   shard: Shard) -> ShardSnapshot:
        """Rank `shard.rank`'s snapshot file of the engine HostSnapshot.for_engine describes."""
        return cls(shard.path(path), snapshot_namespace(model_path, dtype, page_size, extra, shard), shard)

    def _header(self, pool: HostKVPool, pages: object) -> dict:
        return {"namespace": self.namespace, "page_size": pool.page_size, "page_bytes": pool.page_bytes,
                "tp_size": self.shard.tp_size, "rank": self.shard.rank, "pages": pages}

    def save(self, pool: HostKVPool, keys: list[str], host_pages: list[int]) -> bool:
        """Write this rank's share of `host_pages` (rank 0's keys) atomically; False if it could not."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(SHARD_MAGIC)
                _write_frame(fh, self._header(pool, len(keys)))
                for key, page in zip(keys, host_pages):
                    data = pool.page_tensor_copy(page).numpy().tobytes()
                    fh.write(_key_bytes(key))
                    fh.write(data)
                    fh.write(page_digest(self.shard.object_key(key), data))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except (OSError, ValueError) as e:
            logger.error("L2 snapshot shard %s not saved: %s", self.path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        logger.info("L2 snapshot shard saved to %s: %d pages", self.path, len(keys))
        return True

    def load(self, pool: HostKVPool, keys: list[str], host_pages: list[int]) -> bool:
        """Read this rank's share of every page rank 0 restored (`keys[i]` into `host_pages[i]`), each checked;
        all or nothing (False: a page is missing, another engine's, or corrupt). Deletes the file."""
        try:
            ok = self._load_pages(pool, keys, host_pages)
        except (OSError, ValueError) as e:
            logger.warning("L2 snapshot shard %s unreadable: %s", self.path, e)
            ok = False
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        return ok

    def _load_pages(self, pool: HostKVPool, keys: list[str], host_pages: list[int]) -> bool:
        if not keys:
            return True
        with open(self.path, "rb") as fh:
            if fh.read(len(SHARD_MAGIC)) != SHARD_MAGIC:
                return False
            header = _read_frame(fh)
            if header != self._header(pool, header.get("pages")):
                return False
            for key, page in zip(keys, host_pages):     # rank 0 restores a prefix-closed subset, in file order
                while True:
                    stored = _read_exact(fh, KEY_BYTES).decode("ascii", errors="replace")
                    data = _read_exact(fh, pool.page_bytes + TRAILER_BYTES)
                    if stored == key:
                        break
                if not page_is_intact(self.shard.object_key(key), data[:pool.page_bytes], data[pool.page_bytes:]):
                    return False
                pool.write_page_bytes(page, memoryview(data)[:pool.page_bytes])
        return True


def snapshot_namespace(model_path: str, dtype: str, page_size: int, extra: str, shard: Shard) -> str:
    """The namespace of an engine's L2 snapshot: its KV namespace, and the rank's shard under TP."""
    from kvstrata.cache.storage_io import kv_namespace

    return kv_namespace(model_path, dtype, page_size, extra + shard.namespace())


def _key_bytes(key: str) -> bytes:
    data = key.encode("ascii")
    if len(data) != KEY_BYTES:
        raise ValueError(f"a page key of {len(data)} bytes (expected {KEY_BYTES})")
    return data


def _unzip(pairs: list[tuple[str, int]]) -> tuple[list[str], list[int]]:
    return [k for k, _ in pairs], [p for _, p in pairs]


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
