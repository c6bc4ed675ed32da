"""`kvstrata bench engine --load-back`: what loading a prefix back from the host tier (L2) costs in TTFT.

Each round takes a fresh prefix A of --context tokens and:
1. computes A (the host tier backs it up);
2. computes a fresh filler B of the same length, which evicts A from the device pool (L2 keeps it), and
   waits until the host tier has no copy in flight (B's backup), so that step 3 times the load-back alone;
3. times A + a new --suffix (the "L2" TTFT: A is loaded back layer by layer while the suffix is computed);
4. times A + another suffix (the "L1" TTFT: A is now in the device pool);
5. times a fresh prompt of --context + --suffix tokens (the "cold" TTFT: everything computed).

The load-back's own time is the host tier's busy time for step 3 (its copy worker: gather into staging,
transfer, and on CUDA the wait for the stream). `hidden` = 1 - (L2 - L1) / busy: the share of the copy that
the layer-by-layer overlap with the suffix's compute took off the critical path (0 when nothing overlaps;
noisy when the copy is short next to the TTFTs' own spread).
"""

from __future__ import annotations

import statistics
import time

from kvstrata.bench.engines import make_engine, prompt_maker

GREEDY1 = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
SPARE_TOKENS = 32   # the device pool holds --context + 2 x --suffix + this many tokens


def _hicache(eng) -> dict:
    state = eng.get_server_info()["internal_states"][0]
    return {"host_hit_tokens": state.get("host_hit_tokens", 0), **state["hicache"]}


def _wait_for_copies(eng, timeout: float = 60.0) -> None:
    """Block until the host tier has no backup or load-back in flight."""
    deadline = time.monotonic() + timeout
    while _hicache(eng)["ops_in_flight"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"host tier copies still in flight after {timeout} s")
        time.sleep(0.005)


def _ttft(eng, ids: list[int]) -> float:
    start = time.perf_counter()
    eng.generate(input_ids=ids, sampling_params=GREEDY1)
    return time.perf_counter() - start


def bench_load_back(args) -> dict:
    """Median L1 / L2 / cold TTFTs over --repeat rounds, the load-back's busy time and the hidden share."""
    context, suffix = args.context, args.suffix
    # Room for one prefix with two suffixes and a little more, not for two prefixes: the filler B pushes A out.
    eng = make_engine(args, radix_cache=True, enable_hierarchical_cache=True, hicache_ratio=8.0,
                      max_total_tokens=context + 2 * suffix + SPARE_TOKENS)
    prompt = prompt_maker(eng.scheduler.runner.vocab_size, seed=1)
    rows: list[dict] = []
    try:
        for r in range(max(1, args.repeat) + 1):       # round 0 warms up
            prefix = prompt(context)
            eng.generate(input_ids=prefix, sampling_params=GREEDY1)
            eng.generate(input_ids=prompt(context), sampling_params=GREEDY1)   # evicts the prefix to L2
            _wait_for_copies(eng)
            before = _hicache(eng)
            l2 = _ttft(eng, prefix + prompt(suffix))
            after = _hicache(eng)
            l1 = _ttft(eng, prefix + prompt(suffix))
            cold = _ttft(eng, prompt(context + suffix))
            if r:
                rows.append({"l1_s": l1, "l2_s": l2, "cold_s": cold,
                             "host_hit_tokens": after["host_hit_tokens"] - before["host_hit_tokens"],
                             "load_back_busy_s": after["load_back_busy_s"] - before["load_back_busy_s"],
                             "load_back_bytes": after["load_back_bytes"] - before["load_back_bytes"]})
    finally:
        eng.shutdown()
    median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    penalty = median["l2_s"] - median["l1_s"]
    busy = median["load_back_busy_s"]
    return {"rounds": rows, "median": median, "load_back_penalty_s": penalty,
            "hidden": 1 - penalty / busy if busy > 0 else float("nan"),
            "load_back_gb_per_s": median["load_back_bytes"] / busy / 1e9 if busy > 0 else float("nan")}


def format_load_back(result: dict, args) -> str:
    """One line for the terminal."""
    m = result["median"]
    return (f"kvstrata load-back ({args.context}-token prefix + {args.suffix}-token suffix, {args.device}): TTFT L1 "
            f"{m['l1_s'] * 1000:.1f} ms | L2 {m['l2_s'] * 1000:.1f} ms | cold {m['cold_s'] * 1000:.1f} ms | host hit "
            f"{m['host_hit_tokens']:.0f} tokens | copy busy {m['load_back_busy_s'] * 1000:.1f} ms at {result['load_back_gb_per_s']:.2f} GB/s "
            f"| L2 - L1 {result['load_back_penalty_s'] * 1000:.1f} ms | hidden {result['hidden']:.2f}")
