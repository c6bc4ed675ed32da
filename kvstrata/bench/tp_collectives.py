"""The tensor-parallel collectives alone: all-reduce and all-gather of one layer's activations over gloo.

What a row-parallel layer costs in communication, without the forward around it (in the engine, rank 0's
time in collectives also holds its waits for the slower rank). Each rank is a process bound to its cores
as the server binds them (runtime/ranks.py); times are medians over `iters` calls, in microseconds.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

import torch

from kvstrata.model.parallel import TensorParallel
from kvstrata.net import free_port
from kvstrata.runtime.ranks import cpu_sets

ROWS = (1, 16, 256, 2048)


def measure_collectives(size: int, hidden: int, dtype: torch.dtype, iters: int = 50) -> dict:
    """{op: {rows: median microseconds}} for an all-reduce of `[rows, hidden]` and an all-gather of
    `[rows, hidden / size]` per rank, on `size` local processes over gloo."""
    ctx = multiprocessing.get_context("spawn")
    addr = f"127.0.0.1:{free_port()}"
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, size, addr, hidden, dtype, iters, results), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=300)
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
    tp = TensorParallel.init(rank, size, addr, "gloo", 60, deterministic=False)
    out: dict = {"all_reduce_us": {}, "all_gather_us": {}}
    for rows in ROWS:
        full, part = torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden // size).to(dtype)
        for name, op, x in (("all_reduce_us", tp.all_reduce, full), ("all_gather_us", tp.all_gather, part)):
            times = []
            for _ in range(iters + 5):
                start = time.perf_counter()
                op(x)
                times.append(time.perf_counter() - start)
            out[name][rows] = 1e6 * statistics.median(times[5:])
    if rank == 0:
        results.put(out)
    tp.close()
