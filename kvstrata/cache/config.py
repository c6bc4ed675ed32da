"""CacheConfig: the settings of the cache stack, resolved once (ServerArgs.cache_config() derives them).

The cache reads nothing else: `build_kv_cache` (build.py) turns a CacheConfig, the device KV pool and the
model's identity into the facade. Field names are the cache's own; the flag each comes from is noted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.cache.shards import Shard


@dataclass(frozen=True)
class CacheConfig:
    """What the tree and its tiers are, and how large (defaults: device tier only, no L2, no L3)."""

    page_size: int = 1
    request_rows: int = 8                  # slot-table rows: requests that may hold KV at once
    prefix_cache: bool = True              # not --disable-radix-cache: the radix tree shares prefixes
    eviction_policy: str = "lru"           # --radix-eviction-policy
    spare_tokens: int = 128                # --kv-run-spare-tokens
    # L2 (--enable-hierarchical-cache)
    host_tier: bool = False
    host_ratio: float = 2.0                # --hicache-ratio
    host_size_gb: int = 0                  # --hicache-size (overrides the ratio)
    write_policy: str = "write_through"    # --hicache-write-policy
    host_layout: str = "layer_first"       # --hicache-mem-layout
    snapshot_path: str | None = None       # --hicache-snapshot-path
    # Weights computed from the checkpoint's files (--quantization int8): part of the L2 snapshot's and L3's
    # namespace, so servers of the same folder with other weights never share KV pages.
    weights_variant: str = ""
    # L3 (--hicache-storage-backend)
    storage_backend: str | None = None
    storage_dir: str | None = None         # --hicache-storage-dir
    storage_group_pages: int = 1           # --hicache-storage-page-tokens, in pages
    storage_extra_config: dict = field(default_factory=dict, hash=False)   # parsed extra-config JSON
    prefetch_policy: str = "best_effort"   # --hicache-storage-prefetch-policy
    block_events: bool = False             # --kv-events-config: residency changes as block events (events.py)
    tp_size: int = 1                       # --tp-size: every rank holds a share of each page (shards.py)

    def __post_init__(self) -> None:
        if self.host_tier and not self.prefix_cache:
            raise ValueError("a host tier needs the prefix cache")
        if self.storage_backend and not self.host_tier:
            raise ValueError("a storage tier needs the host tier")

    def shard(self, rank: int = 0) -> Shard:
        """Rank `rank`'s share of every page (rank 0: the one whose cache decides)."""
        return Shard(self.tp_size, rank)

    def weights_namespace(self) -> str:
        """What the L2 snapshot's and L3's namespace add for weights the files do not name (empty: the files')."""
        return f"|weights={self.weights_variant}" if self.weights_variant else ""
