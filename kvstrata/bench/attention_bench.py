"""`kvstrata bench engine --attention`: one layer's attention, the compiled kernels next to the torch path.

All go through `paged_attention` exactly as a forward does (K/V written to a real DeviceKVPool, the plan
built once and reused, as by every layer of a forward); the torch path is the same call with the kernels
unset (index_select gather of the keys + SDPA). Cases, with the model's head shapes: a fresh prompt of
--context tokens and an extend of a quarter of that after a cached prefix of half of it (the extend kernel),
and --streams decode rows at context --context each (the decode kernel the runner picks in the default mode,
then the float32 one that deterministic mode uses). Each number is the fastest of `--repeat` x 4 alternating
calls (the least disturbed estimate on a shared machine).
"""

from __future__ import annotations

import time

import torch

from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.model.attention import paged_attention
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelConfig
from kvstrata.model.forward_meta import ForwardMetadata
from kvstrata.model.paged_kernels import decode_attention_op, extend_attention_op, paged_attention_op


def _meta(prefix: int, extend: int, kernel) -> ForwardMetadata:
    slots = torch.arange(1, prefix + extend + 1)     # slot 0 is the reserved page
    return ForwardMetadata(extend_lens=[extend], prefix_lens=[prefix], kv_slots=[slots], out_slots=slots[prefix:],
                           logits_indices=torch.tensor([extend - 1]), extend_kernel=kernel)


def _decode_meta(streams: int, context: int, kernel) -> ForwardMetadata:
    """`streams` decode rows, each the last of `context` tokens held in its own run of slots."""
    seqs = [torch.arange(1 + i * context, 1 + (i + 1) * context) for i in range(streams)]
    return ForwardMetadata(extend_lens=[1] * streams, prefix_lens=[context - 1] * streams, kv_slots=seqs,
                           out_slots=torch.stack([s[-1] for s in seqs]), logits_indices=torch.arange(streams),
                           paged_kernel=kernel)


def _best_ms(q, k, v, paths: dict, pool, repeat: int) -> dict:
    """Fastest of `repeat` x 4 + 1 alternating calls per path, in ms."""
    best = {p: float("inf") for p in paths}
    for _ in range(repeat * 4 + 1):
        for path, meta in paths.items():
            t = time.perf_counter()
            paged_attention(q, k, v, 0, meta, pool)
            best[path] = min(best[path], time.perf_counter() - t)
    return {p: t * 1e3 for p, t in best.items()}


def _row(case: str, flop: float, torch_ms: float, kernel_ms) -> dict:
    row = {"case": case, "torch_ms": torch_ms, "torch_gflops": flop / torch_ms / 1e6, "kernel_ms": kernel_ms,
           "kernel_gflops": None}
    if kernel_ms is not None:
        row["kernel_gflops"] = flop / kernel_ms / 1e6
    return row


def attention_cases(args) -> list[dict]:
    """Per case: ms and GFLOPS of the compiled kernel and of the torch path (None where the kernel is absent)."""
    config = ModelConfig.from_path(resolve_model_path(args.model_path))
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    dtype = torch.bfloat16
    op = extend_attention_op()
    streams = args.streams
    pool = DeviceKVPool(max(args.context, streams * args.context) + 2, 1, 1, kv_heads, dim, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)

    def rand(rows: int, h: int) -> torch.Tensor:
        return torch.randn(rows, h, dim, generator=g).to(dtype)

    results = []
    for name, prefix, extend in ((f"prefill {args.context}", 0, args.context),
                                 (f"extend {args.context // 4} after {args.context // 2}", args.context // 2,
                                  args.context // 4)):
        q, k, v = rand(extend, heads), rand(extend, kv_heads), rand(extend, kv_heads)
        paths = {"torch": _meta(prefix, extend, None)}
        if op is not None:
            paths["kernel"] = _meta(prefix, extend, op)
        ms = _best_ms(q, k, v, paths, pool, args.repeat)
        flop = 4 * heads * dim * sum(prefix + i + 1 for i in range(extend))   # QK^T and PV over visible keys
        results.append(_row(name, flop, ms["torch"], ms.get("kernel")))
    # Decode: fill every stream's context once, then time its last token's row.
    fill = _decode_meta(streams, args.context, None)
    pool.set_kv(0, torch.cat(fill.kv_slots), rand(streams * args.context, kv_heads), rand(streams * args.context, kv_heads))
    q, k, v = rand(streams, heads), rand(streams, kv_heads), rand(streams, kv_heads)
    flop = 4 * heads * dim * args.context * streams
    name = f"decode {streams} x {args.context}"
    for label, kernel in (("", decode_attention_op() or paged_attention_op()), (", float32 kernel", paged_attention_op())):
        paths = {"torch": _decode_meta(streams, args.context, None)}
        if kernel is not None:
            paths["kernel"] = _decode_meta(streams, args.context, kernel)
        ms = _best_ms(q, k, v, paths, pool, args.repeat)
        results.append(_row(name + label, flop, ms["torch"], ms.get("kernel")))
    return results


def format_attention(results: list[dict], threads: int) -> str:
    """Markdown table of attention_cases()."""
    lines = ["| case | threads | compiled kernel | torch path (gather + SDPA) | speed-up |", "|---|---|---|---|---|"]
    for r in results:
        kernel = "not available" if r["kernel_ms"] is None else f"{r['kernel_ms']:.2f} ms ({r['kernel_gflops']:.0f} GFLOPS)"
        ratio = "–" if r["kernel_ms"] is None else f"{r['torch_ms'] / r['kernel_ms']:.1f}×"
        lines.append(f"| {r['case']} | {threads} | {kernel} | {r['torch_ms']:.2f} ms ({r['torch_gflops']:.0f} GFLOPS) "
                     f"| {ratio} |")
    return "\n".join(lines)
