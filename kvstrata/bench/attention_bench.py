"""`kvstrata bench engine --attention`: one layer's attention, the compiled extend kernel next to the torch path.

Both go through `paged_attention` exactly as a forward does (K/V written to a real DeviceKVPool, the plan
built once and reused, as by every layer of a forward); the torch path is the same call with the extend
kernel unset (index_select gather of the keys + SDPA). Cases: a fresh prompt of --context tokens, and an
extend of a quarter of that after a cached prefix of half of it, with the model's head shapes. Each number
is the fastest of `--repeat` x 4 alternating calls (the least disturbed estimate on a shared machine).
"""

from __future__ import annotations

import time

import torch

from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.model.attention import paged_attention
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelConfig
from kvstrata.model.forward_meta import ForwardMetadata
from kvstrata.model.paged_kernels import extend_attention_op


def _meta(prefix: int, extend: int, kernel) -> ForwardMetadata:
    slots = torch.arange(1, prefix + extend + 1)     # slot 0 is the reserved page
    return ForwardMetadata(extend_lens=[extend], prefix_lens=[prefix], kv_slots=[slots], out_slots=slots[prefix:],
                           logits_indices=torch.tensor([extend - 1]), extend_kernel=kernel)


def attention_cases(args) -> list[dict]:
    """Per case: ms and GFLOPS of the extend kernel and of the torch path (None where the kernel is absent)."""
    config = ModelConfig.from_path(resolve_model_path(args.model_path))
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    dtype = torch.bfloat16
    op = extend_attention_op()
    pool = DeviceKVPool(args.context + 2, 1, 1, kv_heads, dim, dtype, torch.device("cpu"))
    results = []
    for name, prefix, extend in ((f"prefill {args.context}", 0, args.context),
                                 (f"extend {args.context // 4} after {args.context // 2}", args.context // 2,
                                  args.context // 4)):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(extend, heads, dim, generator=g).to(dtype)
        k = torch.randn(extend, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(extend, kv_heads, dim, generator=g).to(dtype)
        paths = {"torch": _meta(prefix, extend, None)}
        if op is not None:
            paths["kernel"] = _meta(prefix, extend, op)
        best = {p: float("inf") for p in paths}
        for _ in range(args.repeat * 4 + 1):
            for path, meta in paths.items():
                t = time.perf_counter()
                paged_attention(q, k, v, 0, meta, pool)
                best[path] = min(best[path], time.perf_counter() - t)
        flop = 4 * heads * dim * sum(prefix + i + 1 for i in range(extend))   # QK^T and PV over visible keys
        row = {"case": name, "torch_ms": best["torch"] * 1e3, "torch_gflops": flop / best["torch"] / 1e9,
               "kernel_ms": None, "kernel_gflops": None}
        if op is not None:
            row.update(kernel_ms=best["kernel"] * 1e3, kernel_gflops=flop / best["kernel"] / 1e9)
        results.append(row)
    return results


def format_attention(results: list[dict], threads: int) -> str:
    """Markdown table of attention_cases()."""
    lines = ["| case | threads | extend kernel | torch path (gather + SDPA) | speed-up |", "|---|---|---|---|---|"]
    for r in results:
        kernel = "not available" if r["kernel_ms"] is None else f"{r['kernel_ms']:.2f} ms ({r['kernel_gflops']:.0f} GFLOPS)"
        ratio = "–" if r["kernel_ms"] is None else f"{r['torch_ms'] / r['kernel_ms']:.1f}×"
        lines.append(f"| {r['case']} | {threads} | {kernel} | {r['torch_ms']:.2f} ms ({r['torch_gflops']:.0f} GFLOPS) "
                     f"| {ratio} |")
    return "\n".join(lines)
