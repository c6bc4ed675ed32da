"""The tensor-parallel collectives alone: all-reduce and all-gather of one layer's activations, gloo against
the shared-memory path (model/shm_collectives.py), side by side.

What a row-parallel layer costs in communication, without the forward around it (in the engine, rank 0's
time in collectives also holds its waits for the slower rank). Each rank is a process bound to its cores
as the server binds them (runtime/ranks.py); both paths run in the same processes, alternating per row
count, so a change in the machine's load falls on both. Times are medians over `iters` calls, in
microseconds.

    kvstrata bench tp-collectives [--ranks 2] [--hidden 512] [--dtype bfloat16] [--iters 200]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time

import torch

from kvstrata.model.parallel import TensorParallel
from kvstrata.net import free_port
from kvstrata.runtime.ranks import cpu_sets

ROWS = (1, 16, 256, 2048)
PATHS = ("gloo", "shm")


def measure_collectives(size: int, hidden: int, dtype: torch.dtype, iters: int = 50) -> dict:
    """{path: {op: {rows: median microseconds}}} for an all-reduce of `[rows, hidden]` and an all-gather of
    `[rows, hidden / size]` per rank, on `size` local processes, over gloo and over shared memory."""
    ctx = multiprocessing.get_context("spawn")
    addr = f"127.0.0.1:{free_port()}"
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, size, addr, hidden, dtype, iters, results), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _rank(rank: int, size: int, addr: str, hidden: int, dtype: torch.dtype, iters: int, results) -> None:
    import os

    cores = cpu_sets(size)[rank]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    tp = TensorParallel.init(rank, size, addr, "gloo", 60, deterministic=False, shm=True)
    shm = tp.shm
    if shm is None:
        raise RuntimeError("no shared-memory segment: nothing to compare gloo with")
    out: dict = {path: {"all_reduce_us": {}, "all_gather_us": {}} for path in PATHS}
    for rows in ROWS:
        full, part = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden // size).to(dtype)
        for path in PATHS:
            tp.shm = shm if path == "shm" else None
            for name, op, x in (("all_reduce_us", tp.all_reduce, full), ("all_gather_us", tp.all_gather, part)):
                times = []
                for _ in range(iters + 5):
                    start = time.perf_counter()
                    op(x)
                    times.append(time.perf_counter() - start)
                out[path][name][rows] = 1e6 * statistics.median(times[5:])
    tp.shm = shm
    if rank == 0:
        results.put(out)
    tp.close()


def format_collectives(c: dict) -> str:
    """One line per op: each row count's gloo and shm microseconds and their ratio."""
    lines = []
    for op in ("all_reduce_us", "all_gather_us"):
        cells = [f"{rows}: {c['gloo'][op][rows]:.0f} / {c['shm'][op][rows]:.0f} us "
                 f"({c['gloo'][op][rows] / c['shm'][op][rows]:.1f}x)" for rows in c["gloo"][op]]
        lines.append(f"{op[:-3].replace('_', '-')} (rows: gloo / shm): " + " | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`kvstrata bench tp-collectives`: print the table (and the JSON)."""
    parser = argparse.ArgumentParser(prog="kvstrata bench tp-collectives", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512, help="the bench model's hidden size")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    result = measure_collectives(args.ranks, args.hidden, getattr(torch, args.dtype), args.iters)
    print(json.dumps(result, indent=2))
    print(format_collectives(result))
    return 0
