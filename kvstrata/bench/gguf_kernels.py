"""`kvstrata bench gguf-kernels`: the GGUF decode GEMV (csrc/quant_gguf.cpp), every variant of this build side by
side, per block type, weight shape and thread count.

Variants: blocks de-quantized in registers (portable / AVX2 / AVX-512) and activations quantized to 8 bits for
integer dot products (portable / AVX2 / AVX-512 VNNI); `best` is variant 0, the build's choice per type. Each
cell is the fastest of --repeat calls (the least disturbed estimate on a shared machine), in ms, with the
weight's bytes read per second. The weights are random valid blocks (scales set to small finite values), and
each is timed over and over, so a weight smaller than the last-level cache is read from there.

With --model-path FILE.gguf: a decode step's products from memory, against the machine's read bandwidth.
Every quantized weight of the file takes one product of one bf16 row in turn (2 threads unless --threads
names one count), as a decode step does; rounds alternate it with torch's `sum` and `max` over a 700 MB
float32 tensor, since this bandwidth moves by 10-20% within an hour on a shared host. Each round prints both
and their ratio (issue 47's target: products within 1.3x of the read).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvstrata.model.quant.gguf_blocks import FLOAT_TYPES, FORMATS, BlockFormat

# byte offsets of each type's float16 scale fields (d, and dmin / m where the type has one)
_SCALE_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(fmt: BlockFormat, rows: int, values: int, seed: int = 0) -> torch.Tensor:
    """`[rows, row_bytes]` uint8 of random bytes whose float16 scales are small finite numbers."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows * values // fmt.block_size, fmt.type_size), dtype=torch.uint8, generator=g)
    for at in _SCALE_FIELDS[fmt.name]:
        scale = (torch.rand(blocks.shape[0], generator=g) * 0.01 + 1e-3).half()
        blocks[:, at:at + 2] = scale.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1).contiguous()


def _best_ms(fn, args: tuple, repeat: int) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure(types: list[str], shapes: list[tuple[int, int]], threads: list[int], rows: int, repeat: int) -> list[dict]:
    """One row per (type, shape, threads): ms and GB/s of every variant serving the type, and of `best`."""
    from kvstrata.model.paged_kernels import GGUF_VARIANT_NAMES, gguf_best_variant, gguf_ops, gguf_variants

    ops = gguf_ops()
    if ops is None:
        raise SystemExit("the compiled CPU kernels are not available")
    by_name = {f.name: f for f in FORMATS.values() if f.type_id not in FLOAT_TYPES}
    before = torch.get_num_threads()
    out = []
    try:
        for name in types:
            fmt = by_name[name]
            for n, k in shapes:
                blocks = random_blocks(fmt, n, k)
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
                for t in threads:
                    torch.set_num_threads(t)
                    row = {"type": name, "shape": f"{n}x{k}", "threads": t, "mb": blocks.numel() / 1e6,
                           "best": GGUF_VARIANT_NAMES[gguf_best_variant(fmt.type_id, k)]}
                    for variant in gguf_variants(fmt.type_id):
                        ms = _best_ms(ops.gemv, (x, blocks, fmt.type_id, variant), repeat)
                        row[GGUF_VARIANT_NAMES[variant]] = ms
                    out.append(row)
    finally:
        torch.set_num_threads(before)
    return out


def stream_rounds(path: str, threads: int, rounds: int, repeat: int = 3, read_mb: int = 700) -> list[dict]:
    """Per round: the read bandwidth (GB/s over `read_mb` of float32, the faster of `sum` and `max`) and all of
    a decode step's products' (GB/s of blocks, and the step's MB), each the fastest of `repeat`."""
    from kvstrata.model.builtin import resolve_model_path
    from kvstrata.model.config import ModelConfig
    from kvstrata.model.gguf_loader import load_gguf_model
    from kvstrata.model.paged_kernels import gguf_ops
    from kvstrata.model.quant.gguf_weight import GGUFWeight

    ops = gguf_ops()
    if ops is None:
        raise SystemExit("the compiled CPU kernels are not available")
    model = load_gguf_model(path, ModelConfig.from_path(resolve_model_path(path)), torch.bfloat16,
                            torch.device("cpu"))
    # the weights a decode step multiplies: not an input embedding's table, unless the lm_head shares it
    products = {id(m): m for name, m in model.named_modules(remove_duplicate=False)
                if isinstance(m, GGUFWeight) and not name.endswith(".table")}
    weights = list(products.values())
    rows = {w.in_features: torch.randn(1, w.in_features).bfloat16() for w in weights}
    total = sum(w.blocks.numel() for w in weights)
    big = torch.rand(read_mb * 250_000)

    def step() -> None:
        for w in weights:
            ops.gemv(rows[w.in_features], w.blocks, w.fmt.type_id, 0)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = []
    try:
        for _ in range(rounds):
            read = big.numel() * 4 / 1e6 / min(_best_ms(big.sum, (), repeat), _best_ms(big.max, (), repeat))
            products = total / 1e6 / _best_ms(step, (), repeat)
            out.append({"read_gb_s": read, "products_gb_s": products, "step_ms": total / 1e6 / products,
                        "step_mb": total / 1e6, "short": read / products})
    finally:
        torch.set_num_threads(before)
    return out


def table(results: list[dict]) -> str:
    """A markdown table: ms (GB/s of blocks) per variant."""
    from kvstrata.model.paged_kernels import GGUF_VARIANT_NAMES

    names = [v for v in GGUF_VARIANT_NAMES.values() if any(v in r for r in results)]
    lines = ["| type | [N, K] | threads | " + " | ".join(names) + " | best |",
             "|---" * (len(names) + 4) + "|"]
    for r in results:
        cells = [f"{r[v]:.3f} ({r['mb'] / r[v]:.1f})" if v in r else "-" for v in names]
        lines.append(f"| {r['type']} | {r['shape']} | {r['threads']} | " + " | ".join(cells) + f" | {r['best']} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Parse flags, measure, print the table."""
    parser = argparse.ArgumentParser(prog="kvstrata bench gguf-kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="Q8_0,Q4_0,Q4_1,Q5_0,Q4_K,Q5_K,Q6_K", help="comma-separated GGUF types")
    parser.add_argument("--shapes", default="512x2048,2048x8192", help="comma-separated NxK weight shapes")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rows", type=int, default=1, help="input rows per product (decode streams)")
    parser.add_argument("--repeat", type=int, default=20, help="calls per cell; the fastest is reported")
    parser.add_argument("--model-path", default=None,
                        help="a GGUF file: its decode step's products from memory against the read bandwidth")
    parser.add_argument("--rounds", type=int, default=6, help="with --model-path: rounds of read and products")
    args = parser.parse_args(argv)
    if args.model_path:
        threads = int(args.threads.split(",")[-1])
        for i, r in enumerate(stream_rounds(args.model_path, threads, args.rounds)):
            print(f"round {i}: read {r['read_gb_s']:.1f} GB/s; a decode step's products {r['products_gb_s']:.1f} GB/s "
                  f"({r['step_ms']:.1f} ms, {threads} threads): {r['short']:.2f}x short of the read")
        return 0
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    results = measure(args.types.split(","), shapes, [int(t) for t in args.threads.split(",")], args.rows, args.repeat)
    print(f"ms per product, rows={args.rows} (GB/s of blocks read)")
    print(table(results))
    return 0
