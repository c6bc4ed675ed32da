"""`kvstrata bench router`: N workers behind the router, one run per policy, on the same workloads.

1. multi-turn (bench multiturn's workload and runner): cache hit rate, mean and P90 TTFT, input tok/s;
2. hot prefix: `--hot-share` of the requests start with one long shared system prompt, the rest are
   unique; hit rate and the spread of requests over the workers (max/min);
3. router overhead: median TTFT of a 1-token request through a router (default policy, that one worker
   behind it) minus directly to the worker, and requests/s proxied at `--overhead-concurrency` (1-token
   /generate, and /get_model_info, which no model work slows down).

Workers are started once (each pinned to its own CPU core where there are enough) and shared by every
policy; each policy gets a fresh router and flushed caches. Flags this command does not know go to the
workers. Defaults finish in about 10 minutes on 2 CPU cores with the `bench` model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from typing import Optional

import aiohttp
import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.bench import accounting, multiturn, report
from kvstrata.bench.client import generate_payload
from kvstrata.bench.compare import machine_description, warm_up
from kvstrata.bench.launcher import ServerProcess
from kvstrata.bench.router_churn import add_churn_args
from kvstrata.bench.runner import MultiTurnRunner, RunConfig
from kvstrata.bench.workload import Conversation, synthetic_prompts
from kvstrata.router.args import POLICIES


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (unknown ones go to the workers)."""
    p = argparse.ArgumentParser(prog="kvstrata bench router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="bench")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--policies", default=",".join(POLICIES), help="Comma-separated router policies to run.")
    p.add_argument("--worker-tokens", type=int, default=16384, help="Each worker's --max-total-tokens.")
    p.add_argument("--num-clients", type=int, default=8, help="Multi-turn: conversations.")
    p.add_argument("--num-rounds", type=int, default=4, help="Multi-turn: requests per conversation.")
    p.add_argument("--request-length", type=int, default=256, help="Multi-turn: tokens per first prompt/question.")
    p.add_argument("--output-length", type=int, default=16, help="Tokens generated per request.")
    p.add_argument("--max-parallel", type=int, default=4, help="Requests in flight at once (both workloads).")
    p.add_argument("--hot-requests", type=int, default=40, help="Hot prefix: requests.")
    p.add_argument("--hot-share", type=float, default=0.8, help="Hot prefix: share that starts with it.")
    p.add_argument("--hot-prefix-length", type=int, default=512, help="Hot prefix: shared system prompt tokens.")
    p.add_argument("--suffix-length", type=int, default=32, help="Hot prefix: unique tokens after it.")
    p.add_argument("--overhead-requests", type=int, default=100, help="Overhead: sequential 1-token requests.")
    p.add_argument("--overhead-concurrency", type=int, default=32, help="Overhead: concurrent clients for req/s.")
    p.add_argument("--overhead-seconds", type=float, default=5.0, help="Overhead: length of each req/s run.")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "kvstrata-bench-router"))
    add_churn_args(p)
    return p


# ---------------------------------------------------------------------- processes
def start_workers(args: argparse.Namespace, flags: list[str]) -> list[ServerProcess]:
    """Start the workers (in parallel) and pin each to a core of its own when there are enough."""
    cores = sorted(os.sched_getaffinity(0))
    common = ["--model-path", args.model_path, "--max-total-tokens", str(args.worker_tokens), "--random-seed",
              "0", "--log-level", "warning", "--num-threads", "1", *flags]
    workers = [ServerProcess(common, os.path.join(args.out_dir, f"worker{i}.log")) for i in range(args.num_workers)]
    for w in workers:
        w.start()
        warm_up(w.url)
    if len(cores) >= args.num_workers:
        for w, core in zip(workers, cores):
            proc = psutil.Process(w.proc.pid)
            for p in [proc, *proc.children(recursive=True)]:
                p.cpu_affinity([core])
    return workers


def start_router(args: argparse.Namespace, urls: list[str], policy: str) -> ServerProcess:
    """A fresh router with `policy` in front of `urls`."""
    return ServerProcess(["--worker-urls", *urls, "--policy", policy, "--log-level", "warning"],
                         os.path.join(args.out_dir, f"router-{policy}.log"), module="kvstrata.router").start()


def requests_per_worker(router_url: str) -> dict[str, float]:
    """kvstrata_router_requests_total by worker."""
    text = requests.get(router_url + "/metrics", timeout=10).text
    return {s.labels["worker"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name == "kvstrata_router_requests" for s in fam.samples if s.name.endswith("_total")}


# ---------------------------------------------------------------------- workloads
def run_multiturn(args: argparse.Namespace, url: str) -> dict:
    """The multi-turn workload through `url`; its summary."""
    ns = multiturn.build_parser().parse_args([
        "--disable-random-sample", "--num-clients", str(args.num_clients), "--num-rounds", str(args.num_rounds),
        "--request-length", str(args.request_length), "--output-length", str(args.output_length),
        "--max-parallel", str(args.max_parallel), "--request-rate", "inf", "--seed", str(args.seed),
        "--no-progress"])
    return multiturn.run(ns, url)["summary"]


def hot_prefix_conversations(args: argparse.Namespace, url: str) -> list[Conversation]:
    """One-request conversations: hot prefix + unique suffix, or an equally long unique prompt."""
    _, space = multiturn.load_token_source(args.model_path, multiturn.get_json(url, "/server_info", None) or {})
    rng = random.Random(args.seed)
    hot = synthetic_prompts(1, args.hot_prefix_length, space, rng)[0]
    convs = []
    for i in range(args.hot_requests):
        if rng.random() < args.hot_share:
            prompt = hot + synthetic_prompts(1, args.suffix_length, space, rng)[0]
        else:
            prompt = synthetic_prompts(1, args.hot_prefix_length + args.suffix_length, space, rng)[0]
        convs.append(Conversation(client=i, first_prompt=prompt, questions=[]))
    return convs


def run_hot_prefix(args: argparse.Namespace, url: str) -> dict:
    """The hot-prefix workload through `url`: summary plus requests per worker."""
    convs = hot_prefix_conversations(args, url)
    multiturn.flush_cache(url, None)
    before = requests_per_worker(url)
    cfg = RunConfig(output_length=args.output_length, max_parallel=args.max_parallel,
                    request_rate=float("inf"), seed=args.seed, progress=False)
    outcome = asyncio.run(MultiTurnRunner(url + "/generate", convs, cfg).run())
    accounting.ideal_cached_tokens(outcome.records)
    summary = accounting.summarize(outcome.records, round_barrier=False)
    after = requests_per_worker(url)
    summary["per_worker"] = {u: after.get(u, 0) - before.get(u, 0) for u in after}
    return summary


# ---------------------------------------------------------------------- overhead
def _sequential_ttfts(url: str, ids: list[int], count: int) -> list[float]:
    """Time to the first streamed byte of `count` 1-token requests, one after another (keep-alive).

    With `requests`: the aiohttp client's JSON bodies meet a ~40 ms stall on a direct connection to
    uvicorn that the router's own connections do not have, which would make the router look faster.
    """
    out = []
    body = generate_payload(ids, 1)
    with requests.Session() as session:
        for _ in range(count):
            start = time.perf_counter()
            with session.post(url + "/generate", json=body, stream=True, timeout=60) as resp:
                chunks = resp.iter_content(chunk_size=None)
                next(chunks)
                out.append(time.perf_counter() - start)
                for _ in chunks:
                    pass
    return out


async def _rate(url: str, path: str, body: Optional[dict], concurrency: int, seconds: float) -> float:
    """Completed requests per second with `concurrency` clients looping for `seconds`."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            method = session.post(url + path, json=body) if body is not None else session.get(url + path)
            async with method as resp:
                await resp.read()
                done += resp.status == 200

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def measure_overhead(args: argparse.Namespace, worker_url: str) -> dict:
    """Router minus direct, to the same worker: median 1-token TTFT (interleaved runs), requests/s both ways."""
    with ServerProcess(["--worker-urls", worker_url, "--log-level", "warning"],
                       os.path.join(args.out_dir, "router-overhead.log"), module="kvstrata.router") as router:
        return _overhead(args, router.url, worker_url)


def _overhead(args: argparse.Namespace, router_url: str, worker_url: str) -> dict:
    ids = [random.Random(0).randrange(100, 200) for _ in range(16)]
    direct, routed = [], []
    _sequential_ttfts(router_url, ids, 5)   # warm both paths (and the prefix cache)
    _sequential_ttfts(worker_url, ids, 5)
    for _ in range(5):                     # interleaved, so that load changes hit both sides alike
        direct += _sequential_ttfts(worker_url, ids, args.overhead_requests // 5)
        routed += _sequential_ttfts(router_url, ids, args.overhead_requests // 5)
    one_token = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    c, s = args.overhead_concurrency, args.overhead_seconds
    return {"direct_ttft": statistics.median(direct), "routed_ttft": statistics.median(routed),
            "generate_rps_direct": asyncio.run(_rate(worker_url, "/generate", one_token, c, s)),
            "generate_rps_routed": asyncio.run(_rate(router_url, "/generate", one_token, c, s)),
            "info_rps_direct": asyncio.run(_rate(worker_url, "/get_model_info", None, c, s)),
            "info_rps_routed": asyncio.run(_rate(router_url, "/get_model_info", None, c, s))}


# ---------------------------------------------------------------------- report
def render(rows: list[dict], overhead: Optional[dict], command: str, machine: str, started: str) -> str:
    """Markdown: one table per workload, the overhead lines, date, machine, command."""
    mt = report.markdown_table(
        ["policy", "hit rate", "mean TTFT (s)", "P90 TTFT (s)", "input tok/s", "failed"],
        [[r["policy"], report.pct(r["multiturn"]["cache_hit_rate"]), report.sec(r["multiturn"]["mean_ttft"]),
          report.sec(r["multiturn"]["p90_ttft"]), f"{r['multiturn']['input_throughput']:.0f}",
          str(r["multiturn"]["failed"])] for r in rows])
    hot = report.markdown_table(
        ["policy", "hit rate", "ideal", "mean TTFT (s)", "requests per worker", "max/min", "failed"],
        [[r["policy"], report.pct(r["hot"]["cache_hit_rate"]), report.pct(r["hot"]["ideal_hit_rate"]),
          report.sec(r["hot"]["mean_ttft"]), " / ".join(f"{v:.0f}" for v in r["hot"]["per_worker"].values()),
          _spread(r["hot"]["per_worker"]), str(r["hot"]["failed"])] for r in rows])
    lines = ["Multi-turn:", "", mt, "", "Hot prefix:", "", hot, ""]
    if overhead:
        o = overhead
        lines += [f"Router overhead: median 1-token TTFT {1000 * o['direct_ttft']:.2f} ms direct, "
                  f"{1000 * o['routed_ttft']:.2f} ms routed (+{1000 * (o['routed_ttft'] - o['direct_ttft']):.2f} ms); "
                  f"1-token /generate {o['generate_rps_direct']:.0f} req/s direct vs {o['generate_rps_routed']:.0f} "
                  f"routed; /get_model_info {o['info_rps_direct']:.0f} req/s direct vs {o['info_rps_routed']:.0f} "
                  f"routed.", ""]
    lines += targets(rows, overhead) + [""]
    lines += [f"- Date: {started}", f"- Machine: {machine}", f"- Command: `{command}`"]
    return "\n".join(lines) + "\n"


def targets(rows: list[dict], overhead: Optional[dict]) -> list[str]:
    """The issue's targets, where the runs they compare are there."""
    by = {r["policy"]: r for r in rows}
    out = ["Targets:"]

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    tier, cache, rr = by.get("tier_aware"), by.get("cache_aware"), by.get("round_robin")
    if tier and cache:
        ratio = tier["multiturn"]["cache_hit_rate"] / max(cache["multiturn"]["cache_hit_rate"], 1e-9)
        out.append(f"- tier_aware multi-turn hit rate = {100 * ratio:.1f}% of cache_aware's (>= 98%): {mark(ratio >= 0.98)}")
    if tier and rr:
        ratio = tier["multiturn"]["mean_ttft"] / max(rr["multiturn"]["mean_ttft"], 1e-9)
        out.append(f"- tier_aware mean TTFT = {100 * ratio:.1f}% of round_robin's (<= 70%): {mark(ratio <= 0.7)}")
    if tier:
        spread = _spread(tier["hot"]["per_worker"])
        ok = spread not in ("inf", "n/a") and float(spread) <= 1.3
        out.append(f"- tier_aware hot-prefix max/min requests per worker = {spread} (<= 1.3): {mark(ok)}")
    if overhead:
        added_ms = 1000 * (overhead["routed_ttft"] - overhead["direct_ttft"])
        out.append(f"- added median TTFT = {added_ms:.2f} ms (<= 1 ms): {mark(added_ms <= 1.0)}")
        rps = overhead["info_rps_routed"]
        out.append(f"- proxied /get_model_info = {rps:.0f} req/s (>= 1,000 on one core): {mark(rps >= 1000)}")
    return out


def _spread(per_worker: dict[str, float]) -> str:
    values = list(per_worker.values())
    if not values or min(values) == 0:
        return "inf" if values and max(values) else "n/a"
    return f"{max(values) / min(values):.2f}"


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, worker_flags = build_parser().parse_known_args(argv)
    if args.churn:
        from kvstrata.bench import router_churn

        return router_churn.main(args, worker_flags, argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"error: unknown policies {unknown}; choose from {POLICIES}")
    os.makedirs(args.out_dir, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    machine = machine_description()
    workers = []
    rows: list[dict] = []
    overhead = None
    try:
        workers = start_workers(args, worker_flags)
        urls = [w.url for w in workers]
        for policy in policies:
            with start_router(args, urls, policy) as router:
                print(f"=== {policy}", flush=True)
                rows.append({"policy": policy, "multiturn": run_multiturn(args, router.url),
                             "hot": run_hot_prefix(args, router.url)})
        overhead = measure_overhead(args, urls[0])
    finally:
        for w in workers:
            w.stop()
    md = render(rows, overhead, shlex.join(["kvstrata", "bench", "router", *argv]), machine, started)
    with open(os.path.join(args.out_dir, "router.md"), "w") as fh:
        fh.write(md)
    print("\n" + md)
    return 0 if rows else 1
