"""`kvstrata bench engine`: prefill TTFT and decode speed of the offline engine next to transformers.

Measures, on one model and thread count, in one run (ratios are what to compare on a noisy machine):
TTFT of an N-token prompt, single-stream decode tokens/s at context N, aggregate decode tokens/s with
S concurrent streams (on prompts already in the radix cache, see `decode_time`), and transformers'
forward / generate on the same weights. With
`--enable-deterministic-inference` the engine is measured a second time in that mode, side by side, and
the cost of batch invariance is printed as ratios. `--compare-kv-runs` measures instead what keeping each
request's new KV slots in one run buys (--kv-run-spare-tokens: default against 0), two engines alternating.
`--load-back` measures what a prefix loaded back from the host tier costs (kvstrata/bench/load_back_bench.py).
`--device cuda` runs the engine and transformers on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvstrata.bench.engines import make_engine, prompt_maker


def _timeit(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _tok_s(tokens: int, seconds: float) -> float:
    """Tokens per second of one wall-clock interval."""
    return tokens / seconds


def _decode_seconds(eng, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    """Wall seconds of n tokens of each of `prompts` side by side, and their greedy output ids.

    The prompts are cached: the call's first step computes only each prompt's last token, a step of one
    token per stream like the n - 1 decode steps after it, so the call is n token-per-stream steps. (The
    difference of an n- and a 1-token call would leave the first step out, but can come out non-positive
    on a noisy machine; uncached, two prefills of streams x N tokens could differ by more than the decode.)
    """
    decode = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    start = time.perf_counter()
    outputs = eng.generate(input_ids=prompts, sampling_params=decode)
    seconds = time.perf_counter() - start
    ids = [out["output_ids"] for out in outputs]
    if any(len(out) != n for out in ids):
        raise RuntimeError(f"asked for {n} tokens per stream, got {[len(out) for out in ids]}")
    return seconds, ids


def _alternating_decodes(args, variants: dict[str, dict]) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Seconds per round and greedy outputs of --streams streams decoding --decode-tokens at --context, on one engine
    per variant (its ServerArgs overrides), the engines alternating round by round on the same cached prompts."""
    engines = {name: make_engine(args, radix_cache=True, **overrides) for name, overrides in variants.items()}
    try:
        prompt = prompt_maker(next(iter(engines.values())).scheduler.runner.vocab_size)
        prompts = [prompt(args.context) for _ in range(args.streams)]
        greedy1 = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
        for eng in engines.values():
            eng.generate(input_ids=prompts, sampling_params=greedy1)   # computes the prompts into the cache
        times: dict[str, list[float]] = {name: [] for name in engines}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(max(1, args.repeat)):
            for name, eng in engines.items():
                seconds, outputs[name] = _decode_seconds(eng, prompts, args.decode_tokens)
                times[name].append(seconds)
    finally:
        for eng in engines.values():
            eng.shutdown()
    return times, outputs


def bench_kv_runs(args) -> dict:
    """Decode rates of --streams streams with each request's new slots kept in runs (the default
    --kv-run-spare-tokens) and slot by slot (0), two engines alternating round by round on the same prompts.

    Long decodes show the difference: interleaved keys cost the attention kernels most once the streams'
    K/V no longer fits in the CPU caches (docs/benchmarks.md, issue 19 twelfth round).
    """
    from kvstrata.args import ServerArgs

    spares = {"runs": ServerArgs.kv_run_spare_tokens, "slot_by_slot": 0}
    times, outputs = _alternating_decodes(args, {name: {"kv_run_spare_tokens": s} for name, s in spares.items()})
    rates = {name: _tok_s(args.streams * args.decode_tokens, statistics.median(ts)) for name, ts in times.items()}
    return {"kv_run_spare_tokens": spares, "decode_tok_s": rates,
            "slot_by_slot_over_runs_time": [b / a for a, b in zip(times["runs"], times["slot_by_slot"], strict=True)],
            "same_outputs": outputs["runs"] == outputs["slot_by_slot"]}


def bench_kv_dtype(args) -> dict:
    """Decode rates of --streams streams with the model-dtype KV (auto) and with --compare-kv-dtype's FP8 KV, two
    engines alternating round by round on the same prompts (FP8 reads half the KV bytes per step)."""
    variants = {"auto": {"kv_cache_dtype": "auto"}, args.compare_kv_dtype: {"kv_cache_dtype": args.compare_kv_dtype}}
    times, _ = _alternating_decodes(args, variants)
    rates = {name: _tok_s(args.streams * args.decode_tokens, statistics.median(ts)) for name, ts in times.items()}
    return {"decode_tok_s": rates, "auto_over_fp8_time": [a / b for a, b in zip(times["auto"],
                                                                                times[args.compare_kv_dtype],
                                                                                strict=True)]}


def bench_kvstrata(args, deterministic: bool = False, **overrides) -> dict:
    """TTFT and decode rates through kvstrata.Engine (`overrides`: further ServerArgs fields, e.g. tp_size)."""
    # The radix cache serves decode_time's cached prompts; the TTFT prompts are fresh random ids, never cached.
    eng = make_engine(args, deterministic, radix_cache=True, **overrides)
    prompt = prompt_maker(eng.scheduler.runner.vocab_size)

    greedy1 = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    ttft = _timeit(lambda: eng.generate(input_ids=prompt(args.context), sampling_params=greedy1), args.repeat)
    n = args.decode_tokens

    def decode_time(prompts: list[list[int]]) -> float:
        return _decode_seconds(eng, prompts, n)[0]

    # One stream and S streams alternate round by round, so that the ratio compares neighbours in time.
    groups = [[prompt(args.context)], [prompt(args.context) for _ in range(args.streams)]]
    for prompts in groups:
        eng.generate(input_ids=prompts, sampling_params=greedy1)   # computes the prompts into the cache
    times: list[list[float]] = [[], []]
    for _ in range(max(1, args.repeat)):
        for k, prompts in enumerate(groups):
            times[k].append(decode_time(prompts))
    state = eng.get_server_info()["internal_states"][0]
    hicache = state.get("hicache")
    layers = eng.scheduler.runner.config.num_layers
    eng.shutdown()

    def rate(streams: int, seconds: float) -> float:
        return _tok_s(streams * n, seconds)

    single = rate(1, statistics.median(times[0]))
    multi = rate(args.streams, statistics.median(times[1]))
    ratios = [rate(args.streams, b) / rate(1, a) for a, b in zip(*times, strict=True)]
    out = {"ttft_s": ttft, "decode_tok_s_1": single, "decode_tok_s_multi": multi,
           "multi_over_single_decode": statistics.median(ratios)}
    if hicache is not None:   # what the host tier did meanwhile
        out["host_tier"] = {k: hicache[k] for k in ("backup_pages", "backup_ops", "backup_busy_s")}
    if state.get("tp_size", 1) > 1:   # rank 0's time in collectives (waits for the other ranks included)
        steps = max(1, state["step"])
        out["tp_comm"] = {"seconds": state["tp_comm_s"], "calls": state["tp_comm_calls"], "steps": steps,
                          "ms_per_step": 1000 * state["tp_comm_s"] / steps,
                          "ms_per_layer_step": 1000 * state["tp_comm_s"] / (steps * layers),
                          "share_of_forward": state["tp_comm_s"] / max(state["forward_busy_s"], 1e-9)}
    return out


def bench_tp(args, deterministic: bool, **overrides) -> dict:
    """--tp-size N with --threads / N threads per rank, against TP=1 with --threads (measured just before)."""
    experts = ({"ep_num_redundant_experts": args.ep_num_redundant_experts,
                "init_expert_location": args.init_expert_location} if args.ep_size > 1 else {})
    return bench_kvstrata(args, deterministic, tp_size=args.tp_size, ep_size=args.ep_size,
                          num_threads=max(1, args.threads // args.tp_size), **experts, **overrides)


def tp_ratios(tp: dict, one: dict) -> dict:
    """TP=N over TP=1: TTFT as a time ratio, decode as a rate ratio (above 1: TP is better)."""
    return {"ttft_tp1_over_tp": one["ttft_s"] / tp["ttft_s"],
            "decode_1_tp_over_tp1": tp["decode_tok_s_1"] / one["decode_tok_s_1"],
            "decode_multi_tp_over_tp1": tp["decode_tok_s_multi"] / one["decode_tok_s_multi"]}


def bench_transformers(args) -> dict:
    """Forward time and decode rate of transformers on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    from kvstrata.model.builtin import resolve_model_path

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model_path), dtype=dtype)
    model = model.to(args.device).eval()
    ids = torch.randint(100, model.config.vocab_size - 1, (1, args.context), device=args.device)
    with torch.inference_mode():
        # .cpu(): the time includes the device's work (CUDA runs asynchronously)
        fwd = _timeit(lambda: model(ids, logits_to_keep=1).logits.cpu(), args.repeat)
        n = args.decode_tokens
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False).cpu()
        single = n / (time.perf_counter() - t - fwd)
    return {"forward_s": fwd, "decode_tok_s_1": single}


def profile_main(args) -> int:
    """`--profile`: the per-step breakdown of each scenario (with --enable-deterministic-inference, that
    mode too), printed as JSON and as a markdown table."""
    from kvstrata.bench.engine_profile import format_table, run_profile

    modes = [False, True] if args.enable_deterministic_inference else [False]
    for deterministic in modes:
        results = run_profile(args, lambda d=deterministic: make_engine(args, d, radix_cache=True), prompt_maker)
        print(json.dumps({"deterministic": deterministic, "profile": results}, indent=2))
        print(f"\n{'deterministic' if deterministic else 'default'} mode, ms per step:\n{format_table(results)}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="kvstrata bench engine", description=__doc__)
    p.add_argument("--model-path", default="bench")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=2, help="CPU threads (on CUDA: of the host side)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                   help="dummy: random weights from the model folder's config.json alone (a shape without its "
                        "weights; implies --skip-transformers)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="per-step breakdown (prefill, --suffix tokens after a cached --context prefix, decode with 1 "
                        "and --streams streams) instead of the rates")
    p.add_argument("--attention", action="store_true",
                   help="one layer's attention: the compiled extend and decode kernels next to the torch path "
                        "(gather + SDPA); --streams decode rows at --context")
    p.add_argument("--tp-size", type=int, default=1,
                   help="also measure tensor parallelism: N ranks with --threads / N threads each (cores split "
                        "evenly), next to one process with --threads; prints rank 0's time in collectives")
    p.add_argument("--ep-size", type=int, default=1,
                   help="with --tp-size N on an MoE model (e.g. bench-moe): N splits its experts across the ranks")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0,
                   help="with --ep-size N: spare expert copies per layer, whose rows the ranks share (the server's "
                        "flag)")
    p.add_argument("--init-expert-location", default="trivial",
                   help="with --ep-size N: where the experts live (the server's flag), e.g. the JSON that "
                        "`kvstrata bench expert-distribution` records")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="also measure the batch-invariant mode, side by side")
    p.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="measure the rates with the host tier (L2, --hicache-ratio 2) on: its copy threads run "
                        "next to the decode steps")
    p.add_argument("--load-back", action="store_true",
                   help="instead of the rates: TTFT of a --context prefix + --suffix prompt with the prefix in the "
                        "device pool (L1), only in the host tier (L2, loaded back layer by layer) and uncached")
    p.add_argument("--suffix", type=int, default=256,
                   help="new tokens after the prefix, for --load-back and for --profile's extend step (0: none)")
    p.add_argument("--compare-kv-dtype", default=None, choices=["fp8_e4m3", "fp8_e5m2"],
                   help="instead of the rates: --streams streams decoding with the model-dtype KV and with this FP8 "
                        "KV (--kv-cache-dtype), two engines alternating")
    p.add_argument("--compare-kv-runs", action="store_true",
                   help="instead of the rates: --streams streams decoding with their new KV slots in runs (default "
                        "--kv-run-spare-tokens) and slot by slot (0), two engines alternating; try a long "
                        "--decode-tokens")
    args = p.parse_args(argv)
    args.skip_transformers = args.skip_transformers or args.load_format == "dummy"   # it needs the weights
    if args.enable_hierarchical_cache and (args.profile or args.attention):
        p.error("--enable-hierarchical-cache applies to the rates, not to --profile or --attention")
    if args.compare_kv_runs and (args.profile or args.attention or args.enable_deterministic_inference):
        p.error("--compare-kv-runs is a measurement of its own: not with --profile, --attention or "
                "--enable-deterministic-inference")
    if args.ep_size == 1 and (args.ep_num_redundant_experts or args.init_expert_location != "trivial"):
        p.error("--ep-num-redundant-experts and --init-expert-location need --ep-size N > 1")
    if args.load_back and (args.profile or args.attention or args.compare_kv_runs):
        p.error("--load-back is a measurement of its own: not with --profile, --attention or --compare-kv-runs")
    from kvstrata.bench.load_back_bench import SPARE_TOKENS, bench_load_back, format_load_back

    if args.load_back and args.context <= 2 * args.suffix + SPARE_TOKENS:
        p.error(f"--load-back needs --context > 2 x --suffix + {SPARE_TOKENS}: the pool must hold one prefix, "
                "not two, so that the filler pushes the prefix out to the host tier")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device != "cpu" and (args.profile or args.attention):
        p.error("--profile and --attention time the CPU path (their timers do not wait for a GPU): add --device cpu")
    torch.set_num_threads(args.threads)
    if args.load_back:
        result = bench_load_back(args)
        print(json.dumps(result, indent=2))
        print(format_load_back(result, args))
        return 0
    if args.compare_kv_dtype:
        result = bench_kv_dtype(args)
        print(json.dumps(result, indent=2))
        rates, fp8 = result["decode_tok_s"], args.compare_kv_dtype
        print(f"\nkvstrata: {args.streams} streams x {args.decode_tokens} tokens at context {args.context}: KV auto "
              f"{rates['auto']:.1f} tok/s | {fp8} {rates[fp8]:.1f} tok/s | {fp8} / auto: {rates[fp8] / rates['auto']:.2f}x "
              f"(per round: {' '.join(f'{r:.2f}' for r in result['auto_over_fp8_time'])})")
        return 0
    if args.compare_kv_runs:
        result = bench_kv_runs(args)
        print(json.dumps(result, indent=2))
        rates, ratios = result["decode_tok_s"], result["slot_by_slot_over_runs_time"]
        print(f"\nkvstrata: {args.streams} streams x {args.decode_tokens} tokens at context {args.context}: runs "
              f"{rates['runs']:.1f} tok/s | slot by slot {rates['slot_by_slot']:.1f} tok/s | slot by slot / runs, "
              f"time per round: {' '.join(f'{r:.2f}' for r in ratios)} | same outputs: {result['same_outputs']}")
        return 0
    if args.profile:
        return profile_main(args)
    if args.attention:
        from kvstrata.bench.attention_bench import attention_cases, format_attention

        results = attention_cases(args)
        print(json.dumps(results, indent=2))
        print(format_attention(results, args.threads))
        return 0
    ours = bench_kvstrata(args)
    result = {"config": vars(args), "kvstrata": ours}
    if args.tp_size > 1:
        from kvstrata.bench.tp_collectives import measure_collectives

        result["kvstrata_tp"] = bench_tp(args, deterministic=False)      # collectives through shared memory
        result["tp_over_tp1"] = tp_ratios(result["kvstrata_tp"], ours)
        result["kvstrata_tp_gloo"] = bench_tp(args, deterministic=False, disable_custom_all_reduce=True)
        result["tp_over_tp1_gloo"] = tp_ratios(result["kvstrata_tp_gloo"], ours)
        result["tp_collectives"] = measure_collectives(args.tp_size, 512 if args.model_path == "bench" else 128,
                                                       getattr(torch, args.dtype))
    if args.enable_deterministic_inference:
        det = bench_kvstrata(args, deterministic=True)
        result["kvstrata_deterministic"] = det
        result["deterministic_cost"] = {
            "ttft_ratio": det["ttft_s"] / ours["ttft_s"],
            "decode_1_ratio": det["decode_tok_s_1"] / ours["decode_tok_s_1"],
            "decode_multi_ratio": det["decode_tok_s_multi"] / ours["decode_tok_s_multi"]}
        if args.tp_size > 1:
            result["kvstrata_tp_deterministic"] = bench_tp(args, deterministic=True)
            result["tp_over_tp1_deterministic"] = tp_ratios(result["kvstrata_tp_deterministic"], det)
    if not args.skip_transformers:
        hf = bench_transformers(args)
        result["transformers"] = hf
        result["ttft_vs_transformers_forward"] = ours["ttft_s"] / hf["forward_s"]
    result["multi_over_single_decode"] = ours["multi_over_single_decode"]
    print(json.dumps(result, indent=2))
    print(f"\nkvstrata: TTFT({args.context}) {ours['ttft_s'] * 1000:.0f} ms | decode 1 stream "
          f"{ours['decode_tok_s_1']:.1f} tok/s | {args.streams} streams {ours['decode_tok_s_multi']:.1f} tok/s | "
          f"{args.streams} / 1 {ours['multi_over_single_decode']:.2f}x (median of rounds)"
          + (f" | host tier backed up {ours['host_tier']['backup_pages']} pages" if "host_tier" in ours else ""))
    if "kvstrata_deterministic" in result:
        det, cost = result["kvstrata_deterministic"], result["deterministic_cost"]
        print(f"deterministic: TTFT({args.context}) {det['ttft_s'] * 1000:.0f} ms ({cost['ttft_ratio']:.2f}x) | "
              f"decode 1 stream {det['decode_tok_s_1']:.1f} tok/s ({cost['decode_1_ratio']:.2f}x) | "
              f"{args.streams} streams {det['decode_tok_s_multi']:.1f} tok/s ({cost['decode_multi_ratio']:.2f}x)")
    for key, ratios in (("kvstrata_tp", "tp_over_tp1"), ("kvstrata_tp_gloo", "tp_over_tp1_gloo"),
                        ("kvstrata_tp_deterministic", "tp_over_tp1_deterministic")):
        if key in result:
            tp, r, comm = result[key], result[ratios], result[key]["tp_comm"]
            print(f"{key} ({args.tp_size} ranks x {max(1, args.threads // args.tp_size)} threads): TTFT "
                  f"{tp['ttft_s'] * 1000:.0f} ms (TP=1 / TP {r['ttft_tp1_over_tp']:.2f}x) | decode 1 stream "
                  f"{tp['decode_tok_s_1']:.1f} tok/s ({r['decode_1_tp_over_tp1']:.2f}x) | {args.streams} streams "
                  f"{tp['decode_tok_s_multi']:.1f} tok/s ({r['decode_multi_tp_over_tp1']:.2f}x) | collectives "
                  f"{comm['ms_per_step']:.2f} ms/step, {comm['ms_per_layer_step']:.3f} ms/layer, "
                  f"{100 * comm['share_of_forward']:.0f}% of forward time")
    if "tp_collectives" in result:
        from kvstrata.bench.tp_collectives import format_collectives

        print("one layer's activations, alone:\n" + format_collectives(result["tp_collectives"]))
    if "transformers" in result:
        hf = result["transformers"]
        print(f"transformers: forward({args.context}) {hf['forward_s'] * 1000:.0f} ms | decode 1 stream "
              f"{hf['decode_tok_s_1']:.1f} tok/s | TTFT ratio {result['ttft_vs_transformers_forward']:.2f}")
    return 0
