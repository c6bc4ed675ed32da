"""L2 snapshot (--hicache-snapshot-path): the host tier survives a restart, verified page by page."""

from __future__ import annotations

import os

import pytest

from kvstrata.args import ConfigError, ServerArgs
from kvstrata.cache.host_snapshot import MAGIC
from tests.cache.snapshot_turns import L2, QUESTIONS, first_round, turn
from tests.runtime.helpers import NUMERIC_DTYPES, assert_idle_integrity, make_engine


@pytest.fixture(params=NUMERIC_DTYPES)
def dtype(request) -> str:
    return request.param


def test_restart_restores_l2_and_outputs_match(tmp_path, dtype):
    path = str(tmp_path / "l2.snapshot")
    ref = make_engine(disable_radix_cache=True, dtype=dtype)
    try:
        expected = [turn(ref, h, QUESTIONS[1]) for h in first_round(ref)]
    finally:
        ref.shutdown()

    before = make_engine(hicache_snapshot_path=path, dtype=dtype, **L2)
    try:
        histories = first_round(before)
    finally:
        before.shutdown()
    assert os.path.getsize(path) > 0

    stale = tmp_path / "l2.snapshot.12345.tmp"      # what a save killed mid-write leaves
    stale.write_bytes(b"partial")
    after = make_engine(hicache_snapshot_path=path, dtype=dtype, **L2)
    try:
        assert not stale.exists()
        loaded = after.get_server_info()["internal_states"][0]["hicache"]["snapshot"]["last_load"]
        assert loaded["pages"] > 0 and loaded["skipped_records"] == 0 and not loaded["rejected"], loaded
        assert not os.path.exists(path)          # consumed: the next clean stop writes a new one
        for history, (want_ids, _) in zip(histories, expected):
            new_history, meta = turn(after, history, QUESTIONS[1])
            assert new_history == want_ids
            assert meta["cached_tokens"] >= 0.9 * len(history), meta
        state = assert_idle_integrity(after)
        assert state["host_hit_tokens"] > 0
    finally:
        after.shutdown()


def _corrupt_last_page(path: str) -> None:
    with open(path, "r+b") as fh:
        fh.seek(-40, os.SEEK_END)      # inside the last page's bytes, before its 32-byte trailer
        byte = fh.read(1)
        fh.seek(-40, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_page_size", "garbage", "older_format"])
def test_damaged_or_foreign_snapshot_is_never_trusted(tmp_path, damage):
    path = str(tmp_path / "l2.snapshot")
    ref = make_engine(disable_radix_cache=True)
    try:
        expected = [turn(ref, h, QUESTIONS[1])[0] for h in first_round(ref)]
    finally:
        ref.shutdown()
    before = make_engine(hicache_snapshot_path=path, **L2)
    try:
        histories = first_round(before)
    finally:
        before.shutdown()
    extra = {}
    if damage == "flip":
        _corrupt_last_page(path)
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 100)
    elif damage == "garbage":
        with open(path, "wb") as fh:
            fh.write(MAGIC + b"\xff" * 64)
    elif damage == "older_format":    # a v1 file (SHA-256 trailers): another magic, ignored whole
        with open(path, "r+b") as fh:
            fh.write(b"kvstrata-l2-snapshot-v1\n")
    else:
        extra = {"page_size": 2}

    after = make_engine(hicache_snapshot_path=path, **{**L2, **extra})
    try:
        loaded = after.get_server_info()["internal_states"][0]["hicache"]["snapshot"]["last_load"]
        if damage == "flip":
            assert loaded["skipped_records"] >= 1 and loaded["pages"] > 0, loaded
        elif damage == "truncate":
            assert loaded["rejected"] and loaded["pages"] > 0, loaded
        else:
            assert loaded["rejected"] and loaded["pages"] == 0, loaded
        # Whatever was or was not restored, every answer is the one computed without any cache.
        assert [turn(after, h, QUESTIONS[1])[0] for h in histories] == expected
        assert_idle_integrity(after)
    finally:
        after.shutdown()


def test_snapshot_needs_the_host_tier():
    with pytest.raises(ConfigError, match="--hicache-snapshot-path needs --enable-hierarchical-cache"):
        ServerArgs(model_path="tiny", hicache_snapshot_path="/tmp/x").resolve()


def test_a_failed_save_leaves_no_partial_file(tmp_path, monkeypatch):
    import errno

    from kvstrata.cache import host_snapshot

    path = str(tmp_path / "l2.snapshot")
    engine = make_engine(hicache_snapshot_path=path, **L2)
    try:
        first_round(engine)

        def disk_full(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(host_snapshot.os, "fsync", disk_full)    # the write fails after its last byte
    finally:
        engine.shutdown()
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)      # neither the snapshot nor its temp file
