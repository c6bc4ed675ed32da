"""`kvstrata bench quality`: what a KV cache dtype (--kv-cache-dtype) costs in accuracy, on one model.

For each KV setting (bf16 and float32 KV, i.e. --kv-cache-dtype auto with that --dtype, and each FP8 format
over the bf16 model) one engine computes, with the prefix cache off:
  * perplexity over a fixed text (kvstrata/model/corpus.txt) in windows of --window tokens: every token's
    log-probability given the window before it (input_token_logprobs), so every key and value it attends
    has passed through the KV cache's format;
  * greedy continuations of --prompts prompts (slices of the same text) for --tokens tokens each.
Reported against the bf16 KV run: perplexity and its relative change, and greedy agreement, as the share of
positions whose token equals bf16's and as the mean share before the first difference (free-running: one
differing token changes the rest of the continuation), and teacher-forced: each setting reads the prompt plus
bf16's continuation, and its greedy choice at every position is compared with bf16's token there.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

# (label, --dtype, --kv-cache-dtype); the first is the reference
SETTINGS = {"bf16": ("bfloat16", "auto"), "f32": ("float32", "auto"),
            "fp8_e4m3": ("bfloat16", "fp8_e4m3"), "fp8_e5m2": ("bfloat16", "fp8_e5m2")}
CORPUS = Path(__file__).resolve().parent.parent / "model" / "corpus.txt"


def _windows(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]


def _prompts(ids: list[int], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens spread evenly over the text."""
    step = max(1, (len(ids) - length) // count)
    return [ids[i * step:i * step + length] for i in range(count)]


def measure(args, label: str, reference: list[list[int]] | None = None) -> dict:
    """Perplexity and greedy continuations of one KV setting; with `reference` (the bf16 run's continuations),
    also its greedy choices with those continuations forced."""
    import kvstrata

    dtype, kv = SETTINGS[label]
    engine = kvstrata.Engine(model_path=args.model_path, dtype=dtype, kv_cache_dtype=kv, num_threads=args.threads,
                             disable_radix_cache=True, random_seed=0, max_total_tokens=args.window * 4 + 4096)
    try:
        ids = engine.tokenizer.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False)
        windows = _windows(ids, args.window)[:args.max_windows]
        scored = engine.generate(input_ids=windows, sampling_params={"max_new_tokens": 1, "temperature": 0},
                                 return_logprob=True, logprob_start_len=0)
        logprobs = [lp for out in scored for lp, _, _ in out["meta_info"]["input_token_logprobs"] if lp is not None]
        nll, count = -sum(logprobs), len(logprobs)
        greedy = {"max_new_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
        outputs = engine.generate(input_ids=_prompts(ids, args.prompts, args.prompt_tokens), sampling_params=greedy)

        prompts = _prompts(ids, args.prompts, args.prompt_tokens)
        forced = None
        if reference is not None:
            scored = engine.generate(input_ids=[p + r for p, r in zip(prompts, reference)],
                                     sampling_params={"max_new_tokens": 1, "temperature": 0}, return_logprob=True,
                                     logprob_start_len=args.prompt_tokens - 1, top_logprobs_num=1)
            # entry 0: the prompt's last token (no distribution); entry j: the one that chose continuation token j-1
            forced = [[top[0][1] for top in out["meta_info"]["input_top_logprobs"][1:1 + len(r)]]
                      for out, r in zip(scored, reference)]
        return {"perplexity": math.exp(nll / count), "scored_tokens": count,
                "greedy": [o["output_ids"] for o in outputs], "forced": forced}
    finally:
        engine.shutdown()


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of positions with equal tokens, mean share of tokens before the first difference)."""
    same = sum(x == y for seq_a, seq_b in zip(a, b) for x, y in zip(seq_a, seq_b))
    total = sum(len(s) for s in a)
    prefixes = []
    for seq_a, seq_b in zip(a, b):
        first = next((i for i, (x, y) in enumerate(zip(seq_a, seq_b)) if x != y), len(seq_a))
        prefixes.append(first / len(seq_a))
    return same / total, sum(prefixes) / len(prefixes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstrata bench quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--kv", default=",".join(SETTINGS), help=f"settings to compare, first = reference: {list(SETTINGS)}")
    p.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    labels = args.kv.split(",")
    unknown = [label for label in labels if label not in SETTINGS]
    if unknown:
        p.error(f"unknown --kv setting(s) {unknown}; choose from {list(SETTINGS)}")
    ref = measure(args, labels[0])
    results = {labels[0]: ref, **{label: measure(args, label, ref["greedy"]) for label in labels[1:]}}
    report = {}
    for label, r in results.items():
        same, prefix = agreement(r["greedy"], ref["greedy"])
        forced = agreement(r["forced"], ref["greedy"])[0] if r["forced"] is not None else 1.0
        report[label] = {"perplexity": round(r["perplexity"], 4), "teacher_forced_agreement": round(forced, 4),
                         "perplexity_change": round(r["perplexity"] / ref["perplexity"] - 1, 5),
                         "greedy_agreement": round(same, 4), "greedy_prefix_agreement": round(prefix, 4),
                         "scored_tokens": r["scored_tokens"]}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model {args.model_path}: perplexity over {ref['scored_tokens']} tokens of corpus.txt (windows of "
          f"{args.window}); greedy {args.prompts} prompts x {args.tokens} tokens, against {labels[0]} KV")
    print(f"{'KV':>10} {'perplexity':>11} {'change':>8} {'greedy agree':>13} {'before 1st diff':>16} {'forced':>8}")
    for label, r in report.items():
        print(f"{label:>10} {r['perplexity']:>11.4f} {r['perplexity_change']:>+8.2%} {r['greedy_agreement']:>13.1%} "
              f"{r['greedy_prefix_agreement']:>16.1%} {r['teacher_forced_agreement']:>8.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
