"""The one place tests build a cache stack: build_kv_cache over a small CPU pool, as the scheduler does."""

from __future__ import annotations

import torch

from kvstrata.args import ServerArgs
from kvstrata.cache.build import build_kv_cache
from kvstrata.cache.manager import KVCacheManager
from kvstrata.memory.device_pool import DeviceKVPool

LAYERS = 2


def make_cache(page_size: int, device_pages: int, context: int = 128, model_dir: str = "",
               **fields) -> tuple[KVCacheManager, DeviceKVPool]:
    """The cache facade (and its device pool: LAYERS layers, one KV head of dim 2, float32) that the
    ServerArgs `fields` ask for; `model_dir` names the L3 and snapshot namespaces."""
    args = ServerArgs(page_size=page_size, **fields)
    pool = DeviceKVPool(device_pages, page_size, LAYERS, 1, 2, torch.float32, "cpu")
    return build_kv_cache(args.cache_config(), pool, model_dir, context), pool
