"""build_kv_cache: the one constructor of the cache stack (the scheduler and the tests call it).

From a CacheConfig, the device KV pool and the model's identity it builds, bottom of the chain last:

    RadixTree --- DeviceTier(tree, allocator, host) --- HostTier(tree, host pool, controller, policy, storage)
                                                        --- StorageTier(tree, io, namespace, host pages)

and hands them, with the page allocator, the slot table and the L2 snapshot, to the KVCacheManager facade.
With the prefix cache off the tree is still there, empty: the facade never commits into it. Under tensor
parallelism this is rank 0's cache: its copies, L3 ops and snapshots reach the other ranks through the
copy journal and the RankLink (shards.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from kvstrata.cache.config import CacheConfig
from kvstrata.cache.device_tier import DeviceTier
from kvstrata.cache.manager import KVCacheManager
from kvstrata.cache.radix_tree import RadixTree
from kvstrata.cache.shards import Shard
from kvstrata.memory.allocator import PageAllocator
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.req_slots import ReqSlotTable

if TYPE_CHECKING:
    from kvstrata.cache.cache_controller import CopyJournal
    from kvstrata.cache.shards import RankLink


def build_kv_cache(config: CacheConfig, pool: DeviceKVPool, model_id: str, context_len: int,
                   copy_journal: CopyJournal | None = None, ranks: RankLink | None = None) -> KVCacheManager:
    """The cache facade over `pool` that `config` asks for; `model_id` (the model path) names its L3 and
    snapshot namespaces; requests hold up to `context_len` tokens. `copy_journal`: told every device <-> host
    copy as it is submitted, and `ranks` every L3 op and snapshot (tensor parallelism: the other ranks repeat
    them on their shards)."""
    allocator = PageAllocator(pool.num_pages, config.page_size)
    slot_table = ReqSlotTable(config.request_rows, context_len + config.page_size, device=pool.device)
    tree = RadixTree(config.page_size, eviction_policy=config.eviction_policy)
    host = _host_tier(config, tree, pool, model_id, copy_journal, ranks) if config.host_tier else None
    snapshot = None
    if host is not None and config.snapshot_path:
        from kvstrata.cache.host_snapshot import HostSnapshot

        snapshot = HostSnapshot.for_engine(config.snapshot_path, model_id, pool.kv_format.name, config.page_size,
                                           config.weights_namespace(), config.shard(), ranks)
    if config.block_events:
        tree.events = _block_events(config, pool, model_id, host is not None)
    return KVCacheManager(allocator, slot_table, DeviceTier(tree, allocator, host), config, snapshot)


def _page_group_namespace(config: CacheConfig, pool: DeviceKVPool, model_id: str) -> str:
    """The namespace of the L3 page-group keys (the block hashes of the events are the same keys)."""
    from kvstrata.cache.storage_io import kv_namespace

    # An object's bytes are its pages' in order, so the group size is part of the namespace.
    return kv_namespace(model_id, pool.kv_format.name, config.page_size,
                        f"group_pages={config.storage_group_pages}" + config.weights_namespace())


def _block_events(config: CacheConfig, pool: DeviceKVPool, model_id: str, host: bool):
    """The residency sink of the tree: block events under the tiers' medium names (events.py)."""
    from kvstrata.cache.events import STORAGE_MEDIA, BlockEvents, Media

    media = Media(device="GPU" if pool.device.type == "cuda" else "CPU", host="CPU_PINNED" if host else None,
                  storage=STORAGE_MEDIA.get(config.storage_backend or ""))
    return BlockEvents(config.storage_group_pages * config.page_size, _page_group_namespace(config, pool, model_id),
                       config.page_size, media)


def _host_tier(config: CacheConfig, tree: RadixTree, pool: DeviceKVPool, model_id: str,
               copy_journal: CopyJournal | None, ranks: RankLink | None):
    from kvstrata.cache.cache_controller import CacheController
    from kvstrata.cache.host_tier import HostTier
    from kvstrata.cache.write_policy import write_policy
    from kvstrata.memory.host_pool import HostKVPool

    host_pages = HostKVPool.size_pages(pool, config.host_ratio, config.host_size_gb)
    host_pool = HostKVPool(pool, host_pages, layout=config.host_layout)
    storage = _storage_builder(config, tree, host_pool, pool, model_id, ranks) if config.storage_backend else None
    controller = CacheController(pool, host_pool, journal=copy_journal)
    return HostTier(tree, host_pool, controller, write_policy(config.write_policy), storage)


def _storage_builder(config: CacheConfig, tree: RadixTree, host_pool, pool: DeviceKVPool, model_id: str,
                     ranks: RankLink | None):
    """How the host tier builds its L3: a StorageTier over the backend, given the host tier's page verbs."""
    from kvstrata.cache.storage_tier import StorageTier

    # The KV format (dtype, FP8 scales' digest) is in the namespace: a server storing another format never
    # reads these objects.
    namespace = _page_group_namespace(config, pool, model_id)
    return functools.partial(StorageTier, tree, storage_io(config, host_pool, config.shard(), ranks), namespace)


def storage_io(config: CacheConfig, host_pool, shard: Shard, ranks: RankLink | None = None):
    """The L3 I/O of one rank's host pool: `config`'s backend, objects named for `shard` (rank 0 passes the
    link to the other ranks; they build theirs with this too, runtime/rank_cache.py)."""
    from kvstrata.cache.storage_io import StorageIO
    from kvstrata.storage.base import create_backend

    group_pages = config.storage_group_pages
    backend = create_backend(config.storage_backend, group_pages * host_pool.page_bytes,
                             config.storage_extra_config, storage_dir=config.storage_dir)
    return StorageIO(backend, host_pool, group_pages, shard, ranks)
