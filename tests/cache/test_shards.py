"""Per-rank shares of the cache under tensor parallelism (cache/shards.py), without processes: L3 objects named
for their shard, prefetches agreed with the other ranks, and the L2 snapshot kept only if every rank has
its share. The engines over real ranks are in tests/runtime/test_tp_cache.py."""

from __future__ import annotations

import os

import torch

from kvstrata.args import ServerArgs
from kvstrata.cache.build import build_kv_cache, storage_io
from kvstrata.cache.host_snapshot import ShardSnapshot
from kvstrata.cache.page_hash import page_keys
from kvstrata.cache.shards import Shard
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.host_pool import HostKVPool
from tests.cache.drivers import cache_on_host_only
from tests.cache.stack import LAYERS

PAGE = 2


class FakeRanks:
    """A RankLink whose other ranks read `prefetched` groups of every prefetch and restore as told."""

    def __init__(self, prefetched: int = 10**6, restores: bool = True):
        self.prefetched, self.restores = prefetched, restores
        self.ops: list[tuple[str, int, list[str], list[int]]] = []
        self.saved: tuple[list[str], list[int]] | None = None
        self.restored: tuple[list[str], list[int]] | None = None

    def storage_op(self, kind, op_id, keys, host_pages):
        self.ops.append((kind, op_id, list(keys), list(host_pages)))

    def agree_prefetches(self, done):
        return [min(n, self.prefetched) for _, n in done]

    def snapshot_saved(self, keys, host_pages):
        self.saved = (list(keys), list(host_pages))
        return True

    def snapshot_restored(self, keys, host_pages):
        self.restored = (list(keys), list(host_pages))
        return self.restores


def _pool() -> DeviceKVPool:
    return DeviceKVPool(33, PAGE, LAYERS, 1, 2, torch.float32, "cpu")


def _cache(tmp_path, ranks: FakeRanks, **fields):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    args = ServerArgs(page_size=PAGE, tp_size=2, enable_hierarchical_cache=True, hicache_ratio=4, **fields)
    return build_kv_cache(args.cache_config(), _pool(), str(model), 64, ranks=ranks)


def test_shard_names_differ_per_tp_size_and_rank_and_keep_one_rank_as_it_was():
    key = page_keys([1, 2, 3, 4], 4, "ns")[0]
    names = {Shard(1, 0).object_key(key), Shard(2, 0).object_key(key), Shard(2, 1).object_key(key),
             Shard(4, 1).object_key(key)}
    assert len(names) == 4 and Shard().object_key(key) == key
    assert Shard(2, 1).path("/x/l2.snapshot") == "/x/l2.snapshot.tp2-rank1" and Shard().path("/p") == "/p"


def test_objects_are_written_under_the_shards_name_and_read_only_by_that_shard(tmp_path):
    args = ServerArgs(page_size=PAGE, enable_hierarchical_cache=True, hicache_storage_backend="file",
                      hicache_storage_dir=str(tmp_path), hicache_storage_page_tokens=PAGE, tp_size=2)
    config = args.cache_config()
    host_pool = HostKVPool(_pool(), 8)
    host_pool.write_page_bytes(1, torch.full((host_pool.page_bytes,), 7, dtype=torch.uint8))
    keys = page_keys([5, 6], PAGE, "ns")
    ios = {rank: storage_io(config, host_pool, Shard(2, rank)) for rank in (0, 1)}
    whole = storage_io(config, host_pool, Shard())
    try:
        ios[1].submit_backup(keys, [1])
        ios[1].wait_idle()
        name = Shard(2, 1).object_key(keys[0])
        assert os.path.exists(tmp_path / name[:2] / name)
        assert ios[1].stored_leading(keys) == 1
        assert ios[0].stored_leading(keys) == 0 and whole.stored_leading(keys) == 0   # rank 0 and TP=1 see none
    finally:
        for io in (*ios.values(), whole):
            io.shutdown()


def test_rank_zero_tells_every_l3_op_and_a_prefetch_lands_only_what_every_rank_read(tmp_path):
    ranks = FakeRanks(prefetched=1)          # another rank reads only the first group of each prefetch
    cache = _cache(tmp_path, ranks, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"),
                   hicache_storage_page_tokens=PAGE, hicache_storage_prefetch_policy="wait_complete")
    try:
        history = list(range(1, 21))
        cache_on_host_only(cache, history)
        cache.host.wait_idle()
        cache.storage.wait_idle()
        assert ranks.ops and {kind for kind, *_ in ranks.ops} == {"storage_backup"}
        cache.flush()
        match = cache.tree.match_prefix(history, record=False)
        start = cache.storage.prefetch(history, None, match)
        assert start.op is not None and ranks.ops[-1][:2] == ("prefetch", start.op.op_id)
        cache.storage.wait_idle()
        assert start.op.done == 1                 # the minimum over the ranks
        assert cache.tree.match_prefix(history, record=False).cached_tokens == PAGE
        assert cache.storage.io.stats()["prefetch_groups_missing_on_other_ranks"] > 0
        cache.check_integrity([])
    finally:
        cache.close()


def test_the_l2_snapshot_is_restored_only_if_every_rank_restores_its_share(tmp_path):
    path = str(tmp_path / "l2.snapshot")
    saving = FakeRanks()
    cache = _cache(tmp_path, saving, hicache_snapshot_path=path)
    cache_on_host_only(cache, list(range(1, 13)))
    cache.close()
    assert saving.saved is not None and len(saving.saved[0]) == 12 // PAGE
    assert os.path.exists(Shard(2, 0).path(path)) and not os.path.exists(path)

    refusing = FakeRanks(restores=False)
    cache = _cache(tmp_path, refusing, hicache_snapshot_path=path)
    try:
        assert refusing.restored is not None and refusing.restored[0] == saving.saved[0]   # the same keys, in order
        assert cache.tree.total_size() == 0 and cache.host.metrics()["host_used_pages"] == 0   # everyone cold
        assert cache.host_snapshot.last_load.other_ranks_failed
        cache.check_integrity([])
    finally:
        cache.close()


def test_a_rank_restores_its_snapshot_share_only_whole_and_its_own(tmp_path):
    pool = HostKVPool(_pool(), 8)
    for page in (1, 2, 3):
        pool.write_page_bytes(page, torch.full((pool.page_bytes,), page, dtype=torch.uint8))
    keys = page_keys(list(range(6)), PAGE, "ns")
    path = str(tmp_path / "l2.snapshot")

    def share(rank: int) -> ShardSnapshot:
        return ShardSnapshot.for_engine(path, str(tmp_path), "torch.float32", PAGE, "", Shard(2, rank))

    assert share(1).save(pool, keys, [1, 2, 3])
    restored = HostKVPool(_pool(), 8)
    assert share(1).load(restored, keys[:1] + keys[2:], [4, 5])       # rank 0 kept a subset, in order
    assert restored.page_tensor_copy(5).equal(pool.page_tensor_copy(3))
    assert not os.path.exists(share(1).path)                          # consumed
    assert share(1).save(pool, keys, [1, 2, 3])
    os.rename(share(1).path, share(0).path)
    assert not share(0).load(restored, keys, [4, 5, 6])               # another rank's file: its header and trailers
    assert share(1).save(pool, keys, [1, 2, 3])
    with open(share(1).path, "r+b") as fh:
        fh.seek(-20, os.SEEK_END)
        fh.write(b"\xff")
    assert not share(1).load(restored, keys, [4, 5, 6])               # a flipped byte
