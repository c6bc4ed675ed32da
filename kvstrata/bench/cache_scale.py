"""`kvstrata bench cache-scale`: the scheduler's cache work per step, with a small tree and a seed-sized one.

No model: the real cache stack (radix tree, device tier, host tier with its copy worker, file L3) over a KV
pool of real token counts and a small per-token size, driven as the scheduler drives it. Conversations of
`--rounds` rounds of `--request-length` tokens (output 1) arrive with a round barrier, in random order; pools
are the seed preset's fractions of the working set (device 0.35x, host 0.7x, L3 everything). Each request
is one "step" of cache work, timed on the scheduler thread's CPU clock (the copy workers run on theirs):

    begin_step (apply finished copies) + start_prefetch (L3 lookup) + plan_admit + admit (match, lock,
    load-back, eviction) + reserve + advance + release (insert, backups)

Reported for a small tree (`--small-clients`) and the seed-sized one (`--clients`), in the last round (the
largest tree): mean and P90 per step, the eviction calls' share, the cost of a /server_info-style
tree walk, and the metadata bytes per cached token (Python objects allocated for the tree and tier records,
measured with tracemalloc, over the tokens cached). `--file-objects N` also measures a file L3 holding N
objects: the startup scan, one capacity eviction pass and the lookup latency; `--snapshot` the L2 snapshot
of the seed-sized host tier: its write at stop and its load at the next start.

    kvstrata bench cache-scale                                  # 150 x 10 x 2048 tokens vs 4 conversations
    kvstrata bench cache-scale --clients 40 --request-length 512 --file-objects 50000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import tracemalloc
from typing import Any, Optional

import torch

from kvstrata.bench import presets
from kvstrata.bench.accounting import percentile
from kvstrata.cache.build import build_kv_cache
from kvstrata.cache.config import CacheConfig
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.runtime.req import Req
from kvstrata.runtime.sampling_params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="kvstrata bench cache-scale", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=150, help="Conversations of the large tree.")
    p.add_argument("--small-clients", type=int, default=4, help="Conversations of the small tree.")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--request-length", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--storage-page-tokens", type=int, default=64, help="Tokens per L3 object.")
    p.add_argument("--kv-dim", type=int, default=128,
                   help="KV values per token per layer of the fake pool (bf16, 1 layer, K and V): 512 bytes "
                        "per token at 128; the tree's work does not depend on it, the copies' does.")
    p.add_argument("--no-l3", action="store_true", help="Device and host tiers only.")
    p.add_argument("--file-objects", type=int, default=0, help="Also measure a file L3 holding this many objects.")
    p.add_argument("--snapshot", action="store_true",
                   help="Also write the seed-sized host tier to an L2 snapshot and time loading it (a restart).")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="Write the results as JSON here too.")
    return p


def _pool(tokens: int, page_size: int, kv_dim: int) -> DeviceKVPool:
    pages = -(-tokens // page_size) + 1
    return DeviceKVPool(pages, page_size, 1, 1, kv_dim, torch.bfloat16, "cpu")


def make_stack(working_set: int, args: argparse.Namespace, storage_dir: Optional[str],
               snapshot_path: Optional[str] = None):
    """The cache facade with the seed preset's pool fractions of `working_set` tokens."""
    device_tokens = max(int(presets.DEVICE_FRACTION * working_set), 8 * (args.rounds + 1) * args.request_length)
    pool = _pool(device_tokens, args.page_size, args.kv_dim)
    ratio = max(presets.MIN_HOST_RATIO, presets.HOST_FRACTION * working_set / device_tokens)
    config = CacheConfig(page_size=args.page_size, request_rows=16, host_tier=True, host_ratio=ratio,
                         host_layout="page_first",
                         storage_backend=None if storage_dir is None else "file", storage_dir=storage_dir,
                         storage_group_pages=args.storage_page_tokens // args.page_size,
                         storage_extra_config={"capacity_gb": 1000.0}, prefetch_policy="timeout",
                         snapshot_path=snapshot_path)
    model_dir = ""
    if storage_dir is not None:        # names the L3 namespace: any folder will do, no weights are read
        model_dir = os.path.join(storage_dir, "model")
        os.makedirs(model_dir, exist_ok=True)
    return build_kv_cache(config, pool, model_dir, working_set + args.request_length), device_tokens, ratio


def _serve(manager, req: Req) -> dict[str, float]:
    """One request's cache work, as the scheduler does it, timed on this thread's CPU clock per phase."""
    t: dict[str, float] = {}

    def timed(name: str, fn, *a):
        start = time.thread_time()
        out = fn(*a)
        t[name] = t.get(name, 0.0) + time.thread_time() - start
        return out

    timed("begin_step", manager.begin_step)
    timed("prefetch", manager.start_prefetch, req)
    deadline = time.monotonic() + 30
    while not timed("prefetch", manager.prefetch_ready, req) and time.monotonic() < deadline:
        time.sleep(0.0005)
        timed("begin_step", manager.begin_step)
    plan = timed("admit", manager.plan_admit, req, req.fill_len)
    if plan is None or not timed("admit", manager.admit, req, plan):
        raise RuntimeError(f"request {req.rid} was not admitted: the pools are too small for it")
    wait = manager.take_layer_wait()
    if wait is not None:
        wait(0)
    manager.advance(req, req.slot_len)
    timed("release", manager.release, req)
    return t


def run_tree(clients: int, args: argparse.Namespace, storage_dir: Optional[str],
             snapshot_path: Optional[str] = None) -> dict[str, Any]:
    """Serve `clients` conversations; per-step cache CPU time in the last round, and the tree's footprint."""
    rng = random.Random(args.seed)
    longest = args.request_length + (args.rounds - 1) * (1 + args.request_length)
    working_set = clients * longest
    gc.collect()
    tracemalloc.start()
    manager, device_tokens, ratio = make_stack(working_set, args, storage_dir, snapshot_path)
    base_mem = tracemalloc.get_traced_memory()[0]
    histories = [[rng.randrange(10, 30000) for _ in range(args.request_length)] for _ in range(clients)]
    last_round: list[dict[str, float]] = []
    started = time.perf_counter()
    try:
        for rnd in range(args.rounds):
            order = list(range(clients))
            rng.shuffle(order)
            for c in order:
                req = Req(rid=f"c{c}r{rnd}", prompt_ids=list(histories[c]),
                          sampling=SamplingParams(max_new_tokens=1))
                times = _serve(manager, req)
                if rnd == args.rounds - 1:
                    last_round.append(times)
                histories[c] += [rng.randrange(10, 30000) for _ in range(1 + args.request_length)]
        manager.host.wait_idle()
        if manager.storage is not None:
            manager.storage.wait_idle()
        manager.begin_step()
        fill_s = time.perf_counter() - started
        tracemalloc_bytes = tracemalloc.get_traced_memory()[0] - base_mem
        tracemalloc.stop()
        walk = time.perf_counter()
        stats = manager.stats()             # what /server_info asks for: it walks the tree to count nodes
        walk_s = time.perf_counter() - walk
        hicache = stats.get("hicache", {})
        cached_tokens = int(hicache.get("tree_tokens", 0) + hicache.get("host_used_pages", 0) * args.page_size)
        token_bytes = 2 * args.kv_dim * 2
        steps = [sum(t.values()) for t in last_round]
        phases = {k: 1000 * sum(t.get(k, 0.0) for t in last_round) / len(last_round)
                  for k in ("begin_step", "prefetch", "admit", "release")}
        return {
            "clients": clients, "rounds": args.rounds, "request_length": args.request_length,
            "working_set_tokens": working_set, "device_tokens": device_tokens, "host_ratio": round(ratio, 2),
            "device_pool_mb": device_tokens * token_bytes / 2**20,
            "host_pool_mb": hicache.get("host_capacity_pages", 0) * args.page_size * token_bytes / 2**20,
            "tree_nodes": hicache.get("num_nodes"),
            "cached_tokens": cached_tokens,
            "l3_objects": (hicache.get("storage") or {}).get("backed_up_objects"),
            "step_ms_mean": 1000 * sum(steps) / len(steps), "step_ms_p90": 1000 * percentile(steps, 90),
            "phase_ms_mean": phases, "tree_walk_ms": 1000 * walk_s,
            "metadata_bytes_per_cached_token": tracemalloc_bytes / max(1, cached_tokens),
            "fill_s": fill_s,
        }
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        started = time.perf_counter()
        manager.close()                     # with a snapshot path: writes the host tier to it
        close_s = time.perf_counter() - started
        if snapshot_path is not None:
            print(f"snapshot written in {close_s:.1f} s ({os.path.getsize(snapshot_path) / 2**30:.2f} GiB)",
                  flush=True)


def snapshot_restart(clients: int, args: argparse.Namespace, storage_dir: str, path: str) -> dict[str, Any]:
    """Load the host-tier snapshot a run left at `path` into a new stack: the restart's load time."""
    longest = args.request_length + (args.rounds - 1) * (1 + args.request_length)
    size = os.path.getsize(path)
    started = time.perf_counter()
    manager, _, _ = make_stack(clients * longest, args, storage_dir, path)   # loads it while building
    load_s = time.perf_counter() - started
    stats = manager.host_snapshot.last_load
    manager.host_snapshot = None            # no second save
    manager.close()
    return {"snapshot_bytes": size, "stack_build_with_load_s": load_s,
            "snapshot_load_s": stats.seconds if stats else None,
            "restored_tokens": stats.tokens if stats else 0}


def file_l3(objects: int, object_bytes: int = 4096) -> dict[str, float]:
    """A file L3 holding `objects` pages: startup scan, one capacity eviction pass, lookup latency."""
    from kvstrata.storage.file_backend import FileBackend

    with tempfile.TemporaryDirectory(prefix="kvstrata-l3-scale-") as root:
        backend = FileBackend(object_bytes, root, capacity_bytes=10**12)
        buf = torch.zeros(object_bytes, dtype=torch.uint8)
        started = time.perf_counter()
        batch = 256
        for i in range(0, objects, batch):
            keys = [f"k{j:08d}" for j in range(i, min(objects, i + batch))]
            backend.batch_set(keys, [buf] * len(keys))
        write_s = time.perf_counter() - started
        backend.close()
        started = time.perf_counter()
        backend = FileBackend(object_bytes, root, capacity_bytes=10**12)
        startup_s = time.perf_counter() - started
        rng = random.Random(0)
        probes = [f"k{rng.randrange(objects):08d}" for _ in range(2000)]
        started = time.perf_counter()
        for key in probes:
            backend.batch_exists([key])
        lookup_us = 1e6 * (time.perf_counter() - started) / len(probes)
        started = time.perf_counter()
        backend.batch_get(probes[:500], [torch.empty(object_bytes, dtype=torch.uint8) for _ in range(500)])
        get_us = 1e6 * (time.perf_counter() - started) / 500
        # Lower the limit below what is stored: the next write scans and evicts down to the low watermark.
        backend.capacity_bytes = int(0.95 * objects * backend.stored_bytes)
        started = time.perf_counter()
        backend.batch_set(["extra"], [buf])
        evict_s = time.perf_counter() - started
        left = sum(len(files) for _, _, files in os.walk(root))
        backend.close()
    return {"objects": objects, "write_s": write_s, "startup_scan_s": startup_s, "exists_us": lookup_us,
            "get_us": get_us, "capacity_eviction_s": evict_s, "objects_after_eviction": left}


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    results: dict[str, Any] = {}
    for label, clients in (("small", args.small_clients), ("seed", args.clients)):
        with tempfile.TemporaryDirectory(prefix="kvstrata-cache-scale-") as storage_dir:
            snap = os.path.join(storage_dir, "l2.snapshot") if args.snapshot and label == "seed" else None
            results[label] = run_tree(clients, args, None if args.no_l3 else storage_dir, snap)
            if snap is not None and os.path.exists(snap):
                results["snapshot"] = snapshot_restart(clients, args, storage_dir, snap)
                r = results["snapshot"]
                print(f"snapshot restart: {r['snapshot_bytes'] / 2**30:.2f} GiB loaded in "
                      f"{r['snapshot_load_s']:.1f} s ({r['restored_tokens']:,} tokens); the stack took "
                      f"{r['stack_build_with_load_s']:.1f} s to build", flush=True)
        r = results[label]
        print(f"{label}: {r['clients']} conversations x {r['rounds']} rounds x {r['request_length']} tokens; "
              f"{r['tree_nodes']} tree nodes, {r['cached_tokens']:,} tokens in L1+L2 "
              f"(device {r['device_pool_mb']:.0f} MB, host {r['host_pool_mb']:.0f} MB), "
              f"{r['l3_objects']} L3 objects; cache CPU per step mean {r['step_ms_mean']:.3f} ms, "
              f"P90 {r['step_ms_p90']:.3f} ms ({', '.join(f'{k} {v:.3f}' for k, v in r['phase_ms_mean'].items())}); "
              f"tree walk (server_info) {r['tree_walk_ms']:.1f} ms; "
              f"metadata {r['metadata_bytes_per_cached_token']:.2f} B/cached token; fill {r['fill_s']:.0f} s",
              flush=True)
    if args.file_objects:
        results["file_l3"] = file_l3(args.file_objects)
        f = results["file_l3"]
        print(f"file L3, {f['objects']:,} objects: startup scan {f['startup_scan_s']:.2f} s, exists "
              f"{f['exists_us']:.0f} us/key, get {f['get_us']:.0f} us/object, capacity eviction pass "
              f"{f['capacity_eviction_s']:.2f} s ({f['objects_after_eviction']:,} left)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0
