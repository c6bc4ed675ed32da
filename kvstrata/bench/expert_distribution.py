"""`kvstrata bench expert-distribution`: record how a MoE model's router spreads a workload's rows over the experts,
write it as the JSON --init-expert-location reads, and print how evenly --ep-size N ranks would share them.

The engine runs with --expert-distribution-recorder-mode stat; each prompt (random token ids of --context, from
--seed: use another seed than the run you are placing for) is one prefill, recorded on its own. The printed
balance is the busiest rank's rows over the mean, prompt by prompt (what a prefill waits for), under the
trivial placement and with --ep-num-redundant-experts spare copies placed trivially or from these counts.
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvstrata.bench.engines import prompt_maker
from kvstrata.model.expert_location import ExpertPlacement, balance_of


def record(args) -> list[list[list[int]]]:
    """`logical_count` `[layer][expert]` of each of --prompts prefills of --context tokens."""
    import kvstrata

    eng = kvstrata.Engine(model_path=args.model_path, dtype=args.dtype, num_threads=args.threads,
                          disable_radix_cache=True, chunked_prefill_size=args.context, random_seed=0,
                          expert_distribution_recorder_mode="stat")
    try:
        prompt = prompt_maker(eng.scheduler.runner.vocab_size, args.seed)
        counts = []
        for _ in range(args.prompts):
            eng.start_expert_distribution_record()
            eng.generate(input_ids=prompt(args.context), sampling_params={"max_new_tokens": 1, "temperature": 0})
            eng.stop_expert_distribution_record()
            counts.append(eng.dump_expert_distribution_record()["logical_count"])
    finally:
        eng.shutdown()
    return counts


def balances(counts: list[list[list[int]]], ep_size: int, redundant: int) -> dict[str, float]:
    """Mean per-prompt balance (busiest rank / mean) of each placement over the recorded prompts."""
    layers, experts = len(counts[0]), len(counts[0][0])
    total = [[sum(p[layer][e] for p in counts) for e in range(experts)] for layer in range(layers)]
    placements = {"trivial": ExpertPlacement.trivial(layers, experts, ep_size)}
    if redundant:
        placements[f"trivial + {redundant} copies"] = ExpertPlacement.trivial(layers, experts, ep_size, redundant)
    placements[f"balanced + {redundant} copies"] = ExpertPlacement.balanced(total, ep_size, redundant)
    return {name: statistics.mean(balance_of(placement, p) for p in counts) for name, placement in placements.items()}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="kvstrata bench expert-distribution", description=__doc__)
    p.add_argument("--model-path", default="bench-moe")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--seed", type=int, default=1, help="of the prompts (`kvstrata bench engine` uses 0)")
    p.add_argument("--ep-size", type=int, default=2, help="ranks to report the balance for")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0)
    p.add_argument("--out", help="write the summed counts here (JSON for --init-expert-location)")
    args = p.parse_args(argv)
    counts = record(args)
    layers, experts = len(counts[0]), len(counts[0][0])
    total = [[sum(c[layer][e] for c in counts) for e in range(experts)] for layer in range(layers)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"logical_count": total}, f)
    result = {"prompts": args.prompts, "context": args.context, "seed": args.seed, "ep_size": args.ep_size,
              "busiest_rank_over_mean": balances(counts, args.ep_size, args.ep_num_redundant_experts)}
    print(json.dumps(result, indent=2))
    print(f"\n{args.model_path}: {args.prompts} prefills of {args.context} tokens, the busiest of {args.ep_size} "
          "ranks' MoE rows over the mean, per prefill: " +
          " | ".join(f"{name} {v:.3f}" for name, v in result["busiest_rank_over_mean"].items()))
    return 0
