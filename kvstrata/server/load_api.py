"""GET /load: the compact report a router polls to route by load and cache tier (kvstrata/router).

One small dict per poll, answered by the scheduler between two steps from counters it already keeps
(queue lengths, free pages, prompt tokens hit per tier): no tree walk, no integrity check, no lock.
`storage_id` names the L3 this worker reads and writes, so that the router knows which workers share it
(a prefix backed up there by one can be loaded back by the others).
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI

from kvstrata.args import ServerArgs
from kvstrata.server.scheduler_client import SchedulerClient


def register_load_api(app: FastAPI, client: SchedulerClient) -> None:
    """Add GET /load to the worker's app."""
    storage_id = storage_identity(client.args)

    @app.get("/load")
    async def load() -> dict:
        report = await client.get_load()
        capacity = report.get("capacity_pages") or 1
        report["pool_usage"] = 1.0 - report.get("free_pages", capacity) / capacity
        report["storage_id"] = storage_id
        return report


def storage_identity(args: ServerArgs) -> Optional[str]:
    """"file:<dir>" or "mooncake:<master>" for the configured L3, None without one."""
    backend = args.hicache_storage_backend
    if backend == "file":
        from kvstrata.storage.file_store_dir import default_storage_dir

        return f"file:{args.hicache_storage_dir or default_storage_dir()}"
    if backend == "mooncake":
        from kvstrata.storage.errors import StorageError
        from kvstrata.storage.mooncake_config import resolve_mooncake_config

        try:
            return f"mooncake:{resolve_mooncake_config(args.storage_extra_config()).master_server_address}"
        except StorageError:
            return "mooncake:unconfigured"
    return None
