"""Benchmarks: `kvstrata bench <name>` dispatches to bench/<name>.py's main(argv)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {"engine": "kvstrata.bench.engine_bench", "multiturn": "kvstrata.bench.multiturn",
              "compare": "kvstrata.bench.compare"}
BENCHMARKS["grammar"] = "kvstrata.bench.grammar_bench"
BENCHMARKS["grammar-steps"] = "kvstrata.bench.grammar_overhead"   # the mask fill and apply per step, no server
BENCHMARKS["router"] = "kvstrata.bench.router_bench"
BENCHMARKS["upgrade"] = "kvstrata.bench.upgrade_bench"
BENCHMARKS["pd"] = "kvstrata.bench.pd_bench"
BENCHMARKS["dashboard"] = "kvstrata.bench.dashboard_overhead"
BENCHMARKS["restart"] = "kvstrata.bench.restart_bench"
BENCHMARKS["make-dataset"] = "kvstrata.bench.make_dataset"   # a ShareGPT-format file from local text
BENCHMARKS["cache-scale"] = "kvstrata.bench.cache_scale"     # cache CPU per step: small vs seed-sized tree
BENCHMARKS["quality"] = "kvstrata.bench.quality"   # perplexity and greedy agreement per KV cache dtype
BENCHMARKS["tp-collectives"] = "kvstrata.bench.tp_collectives"   # all-reduce / all-gather: gloo vs shm
BENCHMARKS["gguf-kernels"] = "kvstrata.bench.gguf_kernels"   # the GGUF decode GEMV, every variant per type
BENCHMARKS["expert-distribution"] = "kvstrata.bench.expert_distribution"   # MoE rows per expert, per EP rank


def main(argv: list[str]) -> int:
    """Run the benchmark named by argv[0]."""
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: kvstrata bench {{{','.join(BENCHMARKS)}}} [flags]", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return module.main(argv[1:]) or 0
