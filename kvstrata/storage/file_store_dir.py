"""Where the file backend keeps its pages, and how much of the disk it may take when not told.

Free of torch on purpose: the HTTP process names the file L3 (`/load`'s storage_id) through this module,
and the HTTP process never imports torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvstrata.platform import env

# Without `capacity_gb`/`capacity_bytes`: this share of what the directory could hold at start (the free
# space of its filesystem plus the pages already in it), so a server never fills its disk by default.
DEFAULT_FREE_FRACTION = 0.5


def default_storage_dir() -> Path:
    """$KVSTRATA_STORAGE_DIR, else <user cache dir>/kvstrata/kv."""
    explicit = env("KVSTRATA_STORAGE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache_home = env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "kvstrata" / "kv"


def default_capacity_bytes(root: str | os.PathLike, stored_bytes: int) -> int:
    """DEFAULT_FREE_FRACTION of (free space of `root`'s filesystem + `stored_bytes` already in `root`)."""
    return int(DEFAULT_FREE_FRACTION * (shutil.disk_usage(root).free + stored_bytes))
