"""`kvstrata bench restart`: what a server restart costs returning conversations, with and without the L2 snapshot.

For each mode the same server (L1 + L2, flags this command does not know are passed on) serves
`--num-clients` conversations one round each, is stopped with SIGTERM and started again, and then every
conversation comes back with its history plus a new question. Modes:

    cold      no snapshot: the restarted server has an empty cache (what a plain restart does)
    snapshot  --hicache-snapshot-path: the stopping server writes its host tier, the new one reloads it

Reported per mode: stop (SIGTERM to exit) and start (to /health) seconds, the snapshot's pages and load
time, and for the returning round: hit rate, TTFT mean/P90/P99, input tokens/s. Compare modes as ratios
of one run (a shared machine is noisy).

    kvstrata bench restart --model-path bench --num-clients 8 --request-length 1024
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from typing import Optional

import aiohttp
import requests

from kvstrata.bench.accounting import mean, percentile
from kvstrata.bench.client import GenerateResult, stream_generate
from kvstrata.bench.launcher import ServerProcess
from kvstrata.bench.report import markdown_table
from kvstrata.bench.workload import TokenSpace, synthetic_prompts

MODES = ("cold", "snapshot")
DEFAULT_SERVER_FLAGS = ["--enable-hierarchical-cache", "--hicache-ratio", "4", "--page-size", "16"]


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (unknown ones go to the server)."""
    p = argparse.ArgumentParser(prog="kvstrata bench restart", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="bench")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: cold, snapshot")
    p.add_argument("--num-clients", type=int, default=8, help="conversations")
    p.add_argument("--request-length", type=int, default=1024, help="tokens of each first prompt")
    p.add_argument("--question-length", type=int, default=32, help="tokens of the returning question")
    p.add_argument("--output-length", type=int, default=8, help="tokens generated per request")
    p.add_argument("--parallel", type=int, default=4, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--run-dir", default=None, help="logs and the snapshot (default: a temp dir)")
    return p


async def _round(url: str, prompts: list[list[int]], output_len: int, parallel: int) -> list[GenerateResult]:
    """Every prompt once, at most `parallel` in flight."""
    gate = asyncio.Semaphore(parallel)
    async with aiohttp.ClientSession() as session:
        async def one(ids: list[int]) -> GenerateResult:
            async with gate:
                return await stream_generate(session, url + "/generate", ids, output_len, timeout_s=600)
        return await asyncio.gather(*(one(p) for p in prompts))


def run_mode(args: argparse.Namespace, mode: str, server_flags: list[str], run_dir: str) -> dict:
    """First round, restart, returning round: the numbers of one mode."""
    os.makedirs(run_dir, exist_ok=True)
    flags = ["--model-path", args.model_path, *DEFAULT_SERVER_FLAGS, *server_flags]
    if mode == "snapshot":
        flags += ["--hicache-snapshot-path", os.path.join(run_dir, "l2.snapshot")]
    server = ServerProcess(flags, os.path.join(run_dir, f"{mode}-1.log")).start()
    try:
        info = requests.get(server.url + "/server_info", timeout=30).json()
        space = TokenSpace(info["vocab_size"], frozenset(info["eos_token_ids"]))
        rng = random.Random(args.seed)
        firsts = synthetic_prompts(args.num_clients, args.request_length, space, rng)
        questions = synthetic_prompts(args.num_clients, args.question_length, space, rng)
        first = asyncio.run(_round(server.url, firsts, args.output_length, args.parallel))
    finally:
        t0 = time.monotonic()
        server.stop()
        stop_s = time.monotonic() - t0
    t0 = time.monotonic()
    server = ServerProcess(flags, os.path.join(run_dir, f"{mode}-2.log"), port=server.port).start()
    start_s = time.monotonic() - t0
    try:
        info = requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]
        loaded = (info.get("hicache", {}).get("snapshot") or {}).get("last_load") or {}
        returning = [f + r.output_ids + q for f, r, q in zip(firsts, first, questions)]
        t0 = time.monotonic()
        results = asyncio.run(_round(server.url, returning, args.output_length, args.parallel))
        wall = time.monotonic() - t0
    finally:
        server.stop()
    failed = [r.error for r in list(first) + list(results) if r.error]
    ok = [r for r in results if not r.error]
    prompt = sum(len(p) for p in returning)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {"mode": mode, "failed": len(failed), "stop_s": stop_s, "start_s": start_s,
            "snapshot_pages": loaded.get("pages", 0), "snapshot_load_s": loaded.get("seconds", 0.0),
            "hit_rate": sum(r.meta_info.get("cached_tokens", 0) for r in ok) / prompt,
            "ttft_mean": mean(ttfts), "ttft_p90": percentile(ttfts, 90), "ttft_p99": percentile(ttfts, 99),
            "input_tok_s": prompt / wall, "errors": failed[:3]}


def format_results(results: list[dict]) -> str:
    """One markdown row per mode, with TTFT and throughput relative to the first mode."""
    base = results[0]
    rows = [[r["mode"], str(r["failed"]), f"{r['stop_s']:.2f}", f"{r['start_s']:.2f}",
             f"{r['snapshot_pages']} ({r['snapshot_load_s']:.2f} s)", f"{r['hit_rate']:.1%}",
             f"{r['ttft_mean'] * 1e3:.0f}", f"{r['ttft_p90'] * 1e3:.0f}", f"{r['ttft_p99'] * 1e3:.0f}",
             f"{r['ttft_mean'] / base['ttft_mean']:.2f}x" if base["ttft_mean"] else "-",
             f"{r['input_tok_s']:.0f}"] for r in results]
    header = ["mode", "failed", "stop s", "start s", "snapshot pages (load)", "hit rate", "TTFT mean ms",
              "P90 ms", "P99 ms", "TTFT vs first", "input tok/s"]
    return markdown_table(header, rows)


def main(argv: Optional[list[str]] = None) -> int:
    """Run each mode and print the table."""
    args, server_flags = build_parser().parse_known_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {MODES}")
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="kvstrata-bench-restart-")
    results = []
    for mode in modes:
        results.append(run_mode(args, mode, server_flags, os.path.join(run_dir, mode)))
    print(format_results(results))
    for r in results:
        if r["errors"]:
            print(f"{r['mode']}: {r['failed']} failed, e.g. {r['errors']}")
    return 1 if any(r["failed"] for r in results) else 0
