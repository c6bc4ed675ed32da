"""The file backend against a real directory: round trips, prefix semantics, restarts, LRU capacity,
several processes writing at once, and damaged or vanishing files."""

import multiprocessing
import os
import time

import pytest
import torch

from kvstrata.storage.base import StorageError, create_backend
from kvstrata.storage.file_backend import FileBackend
from kvstrata.storage.page_checksum import TRAILER_BYTES

PAGE_BYTES = 4096
STORED_BYTES = PAGE_BYTES + TRAILER_BYTES   # a page file: the page, then its checksum


def pages(n: int, seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    numel = PAGE_BYTES // torch.tensor([], dtype=dtype).element_size()
    return [torch.randn(numel, generator=gen).to(dtype) for _ in range(n)]


def empty(n: int, dtype=torch.float32) -> list[torch.Tensor]:
    numel = PAGE_BYTES // torch.tensor([], dtype=dtype).element_size()
    return [torch.full((numel,), -1.0, dtype=dtype) for _ in range(n)]


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_round_trip(tmp_path, dtype):
    backend = FileBackend(PAGE_BYTES, tmp_path)
    data = pages(5, dtype=dtype) if dtype != torch.uint8 else [torch.randint(0, 256, (PAGE_BYTES,),
                                                                             dtype=torch.uint8) for _ in range(5)]
    ks = keys("rt", 5)
    assert backend.batch_exists(ks) == 0
    assert backend.batch_set(ks, data) == 5
    assert backend.batch_exists(ks) == 5
    out = empty(5, dtype) if dtype != torch.uint8 else [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in range(5)]
    assert backend.batch_get(ks, out) == 5
    for a, b in zip(data, out, strict=True):
        assert torch.equal(a, b)
    stats = backend.stats()
    assert stats["hits"] == 5 and stats["bytes_read"] == 5 * PAGE_BYTES
    assert stats["bytes_written"] == 5 * PAGE_BYTES and stats["errors"] == 0


def test_leading_semantics_stop_at_first_missing(tmp_path):
    backend = FileBackend(PAGE_BYTES, tmp_path)
    ks = keys("lead", 6)
    data = pages(6)
    backend.batch_set(ks[:3] + ks[4:], data[:3] + data[4:])  # page 3 missing
    assert backend.batch_exists(ks) == 3
    out = empty(6)
    assert backend.batch_get(ks, out) == 3
    assert all(torch.equal(data[i], out[i]) for i in range(3))
    assert torch.all(out[4] == -1)  # nothing read past the gap
    assert backend.batch_exists([]) == 0 and backend.batch_get([], []) == 0


def test_set_existing_key_is_a_noop_success(tmp_path):
    backend = FileBackend(PAGE_BYTES, tmp_path)
    first, second = pages(1, seed=1), pages(1, seed=2)
    assert backend.batch_set(["same"], first) == 1
    assert backend.batch_set(["same"], second) == 1
    out = empty(1)
    backend.batch_get(["same"], out)
    assert torch.equal(out[0], first[0])
    assert backend.stats()["bytes_written"] == PAGE_BYTES


def test_restart_sees_old_pages(tmp_path):
    ks, data = keys("restart", 4), pages(4, seed=3)
    FileBackend(PAGE_BYTES, tmp_path).batch_set(ks, data)
    again = create_backend("file", PAGE_BYTES, {}, storage_dir=str(tmp_path))
    out = empty(4)
    assert again.batch_get(ks, out) == 4
    assert all(torch.equal(a, b) for a, b in zip(data, out, strict=True))


def test_capacity_evicts_least_recently_used(tmp_path):
    backend = FileBackend(PAGE_BYTES, tmp_path, capacity_bytes=10 * STORED_BYTES, low_watermark=0.9)
    ks = keys("lru", 10)
    backend.batch_set(ks, pages(10))
    assert backend.stats()["evictions"] == 0
    backend.batch_get(ks[:2], empty(2))  # pages 0 and 1 become the most recently used
    backend.batch_set(["lru-new"], pages(1, seed=9))  # 11 pages > 10: evict down to 9
    present = {k for k in ks + ["lru-new"] if backend.batch_exists([k]) == 1}
    assert present == set(ks) - {ks[2], ks[3]} | {"lru-new"}
    assert backend.stats()["evictions"] == 2


def test_capacity_from_extra_config_and_scan_at_start(tmp_path):
    FileBackend(PAGE_BYTES, tmp_path).batch_set(keys("old", 8), pages(8))
    backend = create_backend("file", PAGE_BYTES, {"capacity_bytes": 4 * STORED_BYTES}, storage_dir=str(tmp_path))
    assert backend.stats()["evictions"] >= 4  # the first scan trims what an earlier run left
    assert sum(backend.batch_exists([k]) for k in keys("old", 8)) <= 4
    gb = create_backend("file", PAGE_BYTES, {"capacity_gb": 0.5}, storage_dir=str(tmp_path / "gb"))
    assert gb.capacity_bytes == 500_000_000


def test_corrupt_file_is_a_miss_and_is_deleted(tmp_path):
    backend = FileBackend(PAGE_BYTES, tmp_path)
    ks = keys("bad", 3)
    backend.batch_set(ks, pages(3))
    path = backend.page_path(ks[1])
    with open(path, "r+b") as f:
        f.truncate(PAGE_BYTES // 2)
    assert backend.batch_exists(ks) == 1
    assert not path.exists()
    backend.batch_set(ks[1:2], pages(1))
    with open(path, "ab") as f:
        f.write(b"extra")
    assert backend.batch_get(ks, empty(3)) == 1
    assert not path.exists()
    assert backend.stats()["corrupt"] == 2 and backend.stats()["errors"] == 0


@pytest.mark.parametrize("damage", ["flip", "zero", "swap", "trailer"])
def test_damaged_page_fails_its_checksum_and_is_dropped(tmp_path, damage):
    backend = FileBackend(PAGE_BYTES, tmp_path)
    ks = keys("sum", 3)
    data = pages(3)
    backend.batch_set(ks, data)
    path = backend.page_path(ks[1])
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[100:116] = bytes(b ^ 0xFF for b in raw[100:116])
    elif damage == "zero":
        raw = bytearray(len(raw))
    elif damage == "swap":        # a whole valid page of another key, checksum included
        raw = bytearray(backend.page_path(ks[2]).read_bytes())
    else:
        raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert backend.batch_exists(ks) == 3            # same size: only reading can tell
    out = empty(3)
    assert backend.batch_get(ks, out) == 1
    assert torch.equal(out[0], data[0])
    assert not path.exists() and backend.stats()["corrupt"] == 1
    assert backend.batch_set(ks, data) == 3         # the next backup writes it again
    assert backend.batch_get(ks, empty(3)) == 3


def test_file_vanishing_between_exists_and_get_is_a_miss(tmp_path):
    backend = FileBackend(PAGE_BYTES, tmp_path)
    ks = keys("gone", 2)
    backend.batch_set(ks, pages(2))
    assert backend.batch_exists(ks) == 2
    os.unlink(backend.page_path(ks[1]))  # another process evicted it
    assert backend.batch_get(ks, empty(2)) == 1
    assert backend.stats()["errors"] == 0


def test_stale_temp_files_are_removed_by_a_scan(tmp_path):
    backend = FileBackend(PAGE_BYTES, tmp_path, capacity_bytes=100 * STORED_BYTES)
    backend.batch_set(["abc"], pages(1))
    stale = backend.page_path("abc").parent / ".abc.1.2.3.tmp"
    stale.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    backend._scan_and_evict()
    assert not stale.exists() and backend.batch_exists(["abc"]) == 1


def test_default_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_STORAGE_DIR", str(tmp_path / "from-env"))
    backend = create_backend("file", PAGE_BYTES, {})
    assert backend.root == tmp_path / "from-env"
    backend.batch_set(["k"], pages(1))
    assert (tmp_path / "from-env").is_dir()


def test_misuse_raises(tmp_path):
    backend = FileBackend(PAGE_BYTES, tmp_path)
    with pytest.raises(ValueError):
        backend.batch_set(["k"], [torch.zeros(10)])
    with pytest.raises(ValueError):
        backend.batch_get(["k", "j"], empty(1))
    with pytest.raises(StorageError, match="unknown storage backend 'nfs'"):
        create_backend("nfs", PAGE_BYTES, {})


# ---------------------------------------------------------------------- several processes
def _writer(root: str, ks: list[str], fill: int, rounds: int, stop) -> None:
    """Write every key, round after round, until `stop` is set (at most `rounds` rounds); the odd writer
    deletes first, so pages really get rewritten."""
    backend = FileBackend(PAGE_BYTES, root)
    page = torch.full((PAGE_BYTES,), fill, dtype=torch.uint8)
    for _ in range(rounds):
        if stop.is_set():
            return
        for k in ks:
            if fill % 2:
                backend.page_path(k).unlink(missing_ok=True)
            backend.batch_set([k], [page])


def test_concurrent_writers_leave_only_whole_pages(tmp_path):
    ks = keys("race", 16)
    # fork: children inherit the imported modules (no torch import per child); they only do file I/O.
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()   # set once the reader has read enough pages while both writers were writing
    writers = [ctx.Process(target=_writer, args=(str(tmp_path), ks, fill, 100_000, stop)) for fill in (1, 2)]
    reader = FileBackend(PAGE_BYTES, tmp_path)
    try:
        for w in writers:
            w.start()
        out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8)]
        reads = 0
        deadline = time.monotonic() + 60
        while reads < 200 and time.monotonic() < deadline:
            assert all(w.is_alive() for w in writers), "a writer ended before the reader was done"
            for k in ks:
                if reader.batch_get([k], out) == 1:
                    reads += 1
                    assert out[0].min() == out[0].max() and int(out[0][0]) in (1, 2)  # never torn
        stop.set()
        assert reads >= 200, f"only {reads} reads overlapped the writers"
        for w in writers:
            w.join(timeout=60)
            assert w.exitcode == 0
    finally:
        for w in writers:
            if w.is_alive():
                w.kill()
                w.join()
    assert reader.batch_exists(ks) == len(ks)
    for k in ks:
        assert reader.batch_get([k], out) == 1 and int(out[0][0]) in (1, 2)
        assert out[0].min() == out[0].max()
    assert reader.stats()["corrupt"] == 0
    assert list(tmp_path.rglob(".*.tmp")) == []


def test_default_capacity_is_a_share_of_free_space(tmp_path):
    import shutil

    from kvstrata.storage.file_store_dir import DEFAULT_FREE_FRACTION

    FileBackend(PAGE_BYTES, tmp_path, capacity_bytes=100 * STORED_BYTES).batch_set(keys("old", 4), pages(4))
    backend = FileBackend(PAGE_BYTES, tmp_path)             # no capacity given
    expected = DEFAULT_FREE_FRACTION * (shutil.disk_usage(tmp_path).free + 4 * STORED_BYTES)
    assert 0 < backend.capacity_bytes and abs(backend.capacity_bytes - expected) < 0.01 * expected
    stats = backend.stats()
    assert stats["capacity_bytes"] == backend.capacity_bytes and stats["capacity_source"].startswith("default")
    assert create_backend("file", PAGE_BYTES, {"capacity_gb": 1}, str(tmp_path)).stats()["capacity_source"] == \
        "configured"


def test_a_full_disk_lowers_the_capacity_evicts_and_logs_once(tmp_path, monkeypatch, caplog):
    import errno

    from kvstrata.storage import file_backend

    backend = FileBackend(PAGE_BYTES, tmp_path, capacity_bytes=1000 * STORED_BYTES, low_watermark=0.5)
    backend.batch_set(keys("held", 10), pages(10))

    def disk_full(f, view):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_backend, "_write_fully", disk_full)
    with caplog.at_level("WARNING", logger="kvstrata.storage.file_backend"):
        for i in range(50):
            assert backend.batch_set([f"new{i}"], pages(1, seed=i)) == 0
    assert backend.capacity_bytes == 10 * STORED_BYTES           # what the directory held when the disk filled
    assert sum(backend.batch_exists([k]) for k in keys("held", 10)) == 5    # evicted to the low watermark
    assert backend.stats()["evictions"] == 5 and backend.stats()["errors"] == 50
    assert len(caplog.records) <= 2, [r.getMessage() for r in caplog.records]   # not one line per failed write
    assert not [p for p in tmp_path.rglob(".*.tmp")]
