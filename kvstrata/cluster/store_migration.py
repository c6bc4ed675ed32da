"""Move every object off one Mooncake store segment onto another, so that a store member can be replaced
without losing the L3 pages it holds.

    python -m kvstrata.cluster.store_migration --master H:P --metadata URL --admin-url http://H:P \
        --source SEGMENT --target SEGMENT

Keys come from the master's HTTP service (`/get_all_keys`); each one gets a Mooncake move task
(`create_move_task(key, source, target)`), which the master hands to a client to run; this process
polls the tasks until each succeeded or failed. A key with no replica on the source fails its move
and is counted as `not_moved` (it lives elsewhere, or was evicted meanwhile). Two passes: keys written
to the source during the first pass are moved by the second. Prints the counts as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from kvstrata.storage.mooncake_config import MIB, client_hostname, import_mooncake, resolve_mooncake_config

PASSES = 2
POLL_S = 0.05


@dataclass
class MigrationResult:
    """How many objects moved, failed to move, or could not be moved (not on the source)."""

    keys: int = 0
    moved: int = 0
    failed: int = 0
    not_moved: int = 0


def segment_of(ready_file: str) -> str:
    """The segment name a store service wrote on its ready file's second line."""
    lines = Path(ready_file).read_text().split()
    if len(lines) < 2:
        raise ValueError(f"{ready_file} names no segment")
    return lines[1]


def all_keys(admin_url: str) -> list[str]:
    """Every key the master knows."""
    r = requests.get(admin_url + "/get_all_keys", timeout=30)
    r.raise_for_status()
    return r.text.split()


def migrate(store, admin_url: str, source: str, target: str, timeout_s: float = 300.0) -> MigrationResult:
    """Move the objects of `source` to `target` (see the module docstring)."""
    result, done = MigrationResult(), set()
    for _ in range(PASSES):
        keys = [k for k in all_keys(admin_url) if k not in done]
        result.keys += len(keys)
        tasks = {}
        for key in keys:
            task_id, rc = store.create_move_task(key, source, target)
            if rc == 0:
                tasks[key] = task_id
            else:
                result.not_moved += 1
            done.add(key)
        _await_tasks(store, tasks, result, time.monotonic() + timeout_s)
    return result


def _await_tasks(store, tasks: dict, result: MigrationResult, deadline: float) -> None:
    status = import_mooncake().TaskStatus
    while tasks and time.monotonic() < deadline:
        for key, task_id in list(tasks.items()):
            response, rc = store.query_task(task_id)
            if rc != 0 or response is None or response.status == status.FAILED:
                result.failed += 1
            elif response.status == status.SUCCESS:
                result.moved += 1
            else:
                continue
            del tasks[key]
        time.sleep(POLL_S)
    result.failed += len(tasks)          # still pending at the deadline


def main(argv: list[str] | None = None) -> int:
    """CLI: connect as a client contributing no memory, migrate, print the counts."""
    p = argparse.ArgumentParser(prog="kvstrata.cluster.store_migration", description=__doc__.splitlines()[0])
    p.add_argument("--master", required=True)
    p.add_argument("--metadata", required=True)
    p.add_argument("--admin-url", required=True, help="the master's HTTP service (its metrics port)")
    p.add_argument("--source", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    ns = p.parse_args(argv)
    config = resolve_mooncake_config({"master_server_address": ns.master, "metadata_server": ns.metadata,
                                      "global_segment_size": 0, "local_buffer_size": 16 * MIB})
    store = import_mooncake().MooncakeDistributedStore()
    rc = store.setup(client_hostname(config), config.metadata_server, 0, config.local_buffer_size,
                     config.protocol, config.device_name, config.master_server_address)
    if rc != 0:
        print(json.dumps({"error": f"Mooncake client setup failed: rc={rc}"}), flush=True)
        return 1
    try:
        print(json.dumps(asdict(migrate(store, ns.admin_url, ns.source, ns.target, ns.timeout))), flush=True)
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
