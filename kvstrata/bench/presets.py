"""Named workloads of `kvstrata bench compare`: `--preset seed` is the seed article's experiment.

The seed (SGLang + Mooncake on Qwen3-235B) ran SGLang's `bench_multiturn.py` with

    --num-clients 150 --num-rounds 10 --request-length 2048 --output-length 1 --max-parallel 4
    --request-rate 16 --ready-queue-policy random --enable-round-barrier --disable-random-sample

Its conversations grow to 2048 + 9 x (1 + 2048) = 20,489 tokens; the working set (every conversation's last
prompt) is 150 x 20,489 = 3.07M tokens. The article gives no pool sizes, but its hit rates pin them down: with
a round barrier each round re-reads every conversation's previous round, so a tier that holds k rounds of
all 150 conversations serves rounds 1..k and (LRU, cyclic access) almost nothing after. L1 only hit 12.3%:
rounds 1-3 and part of 4, a device pool of ~0.35x the working set. L1+L2 hit 40.6%: rounds 1-6 and part of 7,
~0.7x, a host tier 2x the device pool. L3 hit 78.9% of an ideal 81.8%: it holds everything. Those
proportions, of the working set, are what the preset keeps at any `--scale`.

`--scale F` multiplies the clients and the request length by F (tokens by F^2) and keeps everything else:
10 rounds, output 1, max parallel 4, rate 16, random ready queue, round barrier, and the pools as the same
fractions of the (smaller) working set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SEED_WORKLOAD = {"num_clients": 150, "num_rounds": 10, "request_length": 2048, "output_length": 1,
                 "max_parallel": 4, "request_rate": 16.0, "ready_queue_policy": "random",
                 "enable_round_barrier": True, "disable_random_sample": True}
SEED_MODEL = "bench-32k"                  # the bench model with a 32k context (Llama 3.1 RoPE scaling)
SEED_CONFIGS = "l1,l2,l3,mooncake"
DEVICE_FRACTION = 0.35                    # device pool / working set (the seed's 12.3% L1-only hit rate)
HOST_FRACTION = 0.7                       # host pool / working set (the seed's 40.6% with L2): 2x the device pool
MIN_HOST_RATIO = 1.25                     # the host pool must exceed the device pool it backs up
PRESETS = ("seed",)


@dataclass(frozen=True)
class PresetShape:
    """A preset's workload and pool sizes at one scale."""

    num_clients: int
    request_length: int
    longest_prompt: int          # the last round's prompt
    working_set_tokens: int      # num_clients x longest_prompt
    device_tokens: int
    hicache_ratio: float


def seed_shape(scale: float, page_size: int) -> PresetShape:
    """The seed's workload at `scale` (1.0: the seed's own) and its pools, as fractions of the working set.

    The device pool never drops below what max-parallel requests of the last round hold at once (below that,
    small scales would measure admission stalls instead of caching); the
    host pool stays 0.7x the working set, but at least 1.25x the device pool."""
    if not 0 < scale <= 1:
        raise ValueError(f"--scale must be in (0, 1], got {scale}")
    w = SEED_WORKLOAD
    clients = max(w["max_parallel"] + 1, round(w["num_clients"] * scale))
    length = max(page_size, round(w["request_length"] * scale))
    longest = length + (w["num_rounds"] - 1) * (w["output_length"] + length)
    working_set = clients * longest
    floor = w["max_parallel"] * (longest + w["output_length"]) + page_size
    device = max(math.ceil(DEVICE_FRACTION * working_set), floor)
    device = -(-device // page_size) * page_size
    ratio = max(MIN_HOST_RATIO, round(HOST_FRACTION * working_set / device, 2))
    return PresetShape(num_clients=clients, request_length=length, longest_prompt=longest,
                       working_set_tokens=working_set, device_tokens=device, hicache_ratio=ratio)
