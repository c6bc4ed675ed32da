"""`kvstrata bench multiturn`: SGLang's `benchmark/hicache/bench_multiturn.py`, plus what it lacks.

Same flags and semantics as SGLang's script (clients, rounds, request/output/sub-question lengths, max
parallel, Poisson request rate, ready-queue policy, round barrier, seed, JSON-lines log), sending
streaming `/generate` requests with `input_ids` (or, with `--api completions`, `/v1/completions` with token-id
prompts). Added: the workload's ideal hit rate and hit rate / ideal,
a per-round table, per-tier hit metrics read from `/server_info`, a progress bar, failed requests counted
(never stalling a round barrier), barrier pauses excluded from throughput, and `--launch` to start a
server (all flags this command does not know are passed to it) and stop it afterwards.

    kvstrata bench multiturn --port 30000 --num-clients 8 --num-rounds 4 --request-length 256
    kvstrata bench multiturn --launch --model-path bench --max-total-tokens 2048 --num-clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import json
import os
import random
import sys
import tempfile
import time
from typing import Any, Optional

import requests

from kvstrata.bench import accounting, report
from kvstrata.bench.client import API_PATHS
from kvstrata.bench.launcher import ServerProcess
from kvstrata.bench.runner import MultiTurnRunner, RunConfig
from kvstrata.bench.workload import (
    TokenSpace,
    build_conversations,
    make_prompt_source,
    max_prompt_tokens,
    token_space_from_tokenizer,
)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and pacing flags (shared with `kvstrata bench compare`); defaults are SGLang's."""
    p.add_argument("--model-path", default=None,
                   help="Model (tokenizer) of the server; default: the one the server reports.")
    p.add_argument("--dataset-path", default="", help="ShareGPT JSON to take prompts from (else synthetic).")
    p.add_argument("--disable-random-sample", action="store_true",
                   help="As in SGLang: do not sample prompts from the dataset; use random token ids.")
    p.add_argument("--num-clients", type=int, default=256, help="Concurrent conversations.")
    p.add_argument("--num-rounds", type=int, default=5, help="Requests per conversation.")
    p.add_argument("--request-length", type=int, default=512, help="Tokens of each first prompt.")
    p.add_argument("--output-length", type=int, default=64, help="Tokens generated per request.")
    p.add_argument("--sub-question-input-length", type=int, default=0,
                   help="Tokens of each later question (0: --request-length).")
    p.add_argument("--max-parallel", type=int, default=128, help="Most requests in flight at once.")
    p.add_argument("--request-rate", type=float, default=1.0, help="Mean requests per second (inf: none).")
    p.add_argument("--distribution", default="poisson", choices=["poisson", "uniform"],
                   help="Distribution of the gaps between sends.")
    p.add_argument("--ready-queue-policy", default="random", choices=["random", "fifo"],
                   help="Order in which ready requests are sent.")
    p.add_argument("--enable-round-barrier", action="store_true",
                   help="Send round r+1 only after every request of round r is done.")
    p.add_argument("--seed", type=int, default=1, help="Seed of the workload, arrivals and queue order.")
    p.add_argument("--disable-auto-run", action="store_true",
                   help="As in SGLang: run once at --request-rate. kvstrata always does (SGLang without it sweeps "
                        "the rates 16, 14, ..., 1; loop over --request-rate in the shell for that).")
    p.add_argument("--request-timeout", type=float, default=600.0, help="Seconds before a request fails.")


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    p = argparse.ArgumentParser(prog="kvstrata bench multiturn", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="Server port (default 30000; free port with --launch).")
    p.add_argument("--launch", action="store_true",
                   help="Start a server (unknown flags are its flags) and stop it after the run.")
    p.add_argument("--server-log", default=None, help="Log file of a launched server.")
    p.add_argument("--server-start-timeout", type=float, default=600.0)
    p.add_argument("--api-key", default=os.environ.get("KVSTRATA_API_KEY"), help="Bearer token, if required.")
    p.add_argument("--api", default="generate", choices=sorted(API_PATHS),
                   help="Endpoint: streaming /generate with input_ids (as SGLang), or /v1/completions with a "
                        "token-id prompt and return_token_ids (the output's exact ids, not re-tokenized text).")
    add_workload_args(p)
    p.add_argument("--log-file", default=None, help="Append the results as one JSON line to this file.")
    p.add_argument("--tag", default="", help="Tag of this run in the log file.")
    p.add_argument("--no-flush-cache", action="store_true", help="Do not flush the server cache first.")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(known flags, server flags); server flags are only allowed with --launch."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.launch:
        parser.error(f"unrecognized arguments: {' '.join(extra)} (server flags need --launch)")
    return args, extra


# ---------------------------------------------------------------------- talking to the server
def get_json(url: str, path: str, headers: Optional[dict], timeout: float = 30.0) -> Optional[dict]:
    """GET url+path as JSON, or None if that fails (older servers lack some endpoints)."""
    try:
        r = requests.get(url + path, headers=headers, timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def flush_cache(url: str, headers: Optional[dict]) -> str:
    """POST /flush_cache; returns what the server said."""
    try:
        r = requests.post(url + "/flush_cache", headers=headers, timeout=60)
        return f"{r.status_code} {r.text.strip()[:200]}"
    except requests.RequestException as e:
        return f"failed: {e}"


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str) -> Any:
    from kvstrata.model.tokenizer import load_tokenizer

    return load_tokenizer(path)


def load_token_source(model_path: Optional[str], info: dict) -> tuple[Any, Optional[TokenSpace]]:
    """(tokenizer or None, token space): from the local tokenizer, else from /server_info's vocabulary."""
    tokenizer = None
    if model_path:
        try:
            tokenizer = _load_tokenizer(model_path)
        except Exception as e:  # any loading problem: fall back to the server's numbers
            print(f"note: tokenizer of {model_path!r} not loaded ({e}); using the server's vocabulary",
                  file=sys.stderr)
    if tokenizer is not None:
        return tokenizer, token_space_from_tokenizer(tokenizer)
    if info.get("vocab_size"):
        return None, TokenSpace(int(info["vocab_size"]), frozenset(int(i) for i in info.get("eos_token_ids") or []))
    return None, None


# ---------------------------------------------------------------------- one run
def run(args: argparse.Namespace, url: str) -> dict:
    """Run the workload of `args` against the server at `url`; returns the result (also printed/logged)."""
    api_key = getattr(args, "api_key", None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    info = get_json(url, "/server_info", headers) or {}
    model_path = args.model_path or info.get("model_path")
    longest = max_prompt_tokens(args.request_length, args.sub_question_input_length, args.output_length,
                                args.num_rounds)
    context = info.get("context_length")
    if context and longest + args.output_length > context:
        raise SystemExit(f"error: the last round's prompt ({longest} tokens) plus --output-length exceeds the "
                         f"server's context length ({context}); use fewer rounds or shorter requests")
    tokenizer, space = load_token_source(model_path, info)
    source, make_prompts = make_prompt_source(args.dataset_path, args.disable_random_sample, tokenizer, space,
                                              random.Random(args.seed))
    convs = build_conversations(args.num_clients, args.num_rounds, args.request_length,
                                args.sub_question_input_length, make_prompts)
    if not getattr(args, "no_flush_cache", False):
        flush_cache(url, headers)
    before = get_json(url, "/server_info", headers)
    snapshot_at = time.monotonic()
    cfg = RunConfig(output_length=args.output_length, max_parallel=args.max_parallel,
                    request_rate=args.request_rate, distribution=args.distribution,
                    ready_queue_policy=args.ready_queue_policy, enable_round_barrier=args.enable_round_barrier,
                    request_timeout_s=args.request_timeout, seed=args.seed,
                    progress=not getattr(args, "no_progress", False), api=getattr(args, "api", "generate"))
    outcome = asyncio.run(MultiTurnRunner(url + API_PATHS[cfg.api], convs, cfg, headers).run())
    after = get_json(url, "/server_info", headers)
    between_snapshots_s = time.monotonic() - snapshot_at
    page_size = int((after or info).get("page_size") or 1)
    accounting.ideal_cached_tokens(outcome.records, page_size)
    summary = accounting.summarize(outcome.records, args.enable_round_barrier, outcome.skipped)
    summary["wall_s"] = outcome.wall_s
    summary["engine_busy"] = accounting.engine_busy(before, after, between_snapshots_s)
    return {
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "tag": getattr(args, "tag", ""),
        "workload": {"source": source, "num_clients": args.num_clients, "num_rounds": args.num_rounds,
                     "request_length": args.request_length, "output_length": args.output_length,
                     "sub_question_input_length": args.sub_question_input_length,
                     "max_parallel": args.max_parallel, "request_rate": args.request_rate,
                     "distribution": args.distribution, "ready_queue_policy": args.ready_queue_policy,
                     "enable_round_barrier": args.enable_round_barrier, "seed": args.seed,
                     "page_size": page_size, "model_path": model_path, "api": cfg.api},
        "summary": summary,
        "rounds": accounting.per_round(outcome.records),
        "tiers": accounting.tier_metrics(before, after),
        "cache": accounting.cache_report(before, after),
        "kv_cache": ((after or {}).get("internal_states") or [{}])[0].get("kv_cache"),   # dtype, tokens per tier
        "errors": sorted({r.error for r in outcome.records if r.error})[:10],
    }


def append_log(path: str, result: dict) -> None:
    """Append `result` as one JSON line."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(result, default=str) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    args, server_flags = parse_args(list(sys.argv[1:] if argv is None else argv))
    server = None
    if args.launch:
        flags = (["--model-path", args.model_path] if args.model_path else []) + server_flags
        if args.api_key:
            flags += ["--api-key", args.api_key]
        log = args.server_log or os.path.join(tempfile.gettempdir(), f"kvstrata-bench-server-{os.getpid()}.log")
        server = ServerProcess(flags, log, host=args.host, port=args.port)
        print(f"launching: {' '.join(server.cmd)} (log: {log})", file=sys.stderr)
        server.start(args.server_start_timeout)
        url = server.url
    else:
        url = f"http://{args.host}:{args.port or 30000}"
    try:
        result = run(args, url)
    finally:
        if server is not None:
            server.stop()
    print(report.format_run(result))
    if args.log_file:
        append_log(args.log_file, result)
    return 1 if result["summary"]["completed"] == 0 else 0
