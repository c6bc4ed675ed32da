"""`kvstrata bench router --churn`: routing under churn, where approximate trees go stale.

Three workers (small device pools + L2, each publishing KV events), multi-turn conversations that do not
fit the pools, one worker restarted when half the requests are done, and a second router instance that
carries a quarter of the conversations. One run per routing setup, on the same workload:

    tier_aware+events    tier_aware on the exact index (--kv-events-config on the workers)
    tier_aware-events    tier_aware on its approximate trees (--no-kv-events)
    cache_aware          SGLang's policy, ours
    sglang-router        SGLang's router (cache_aware), when `--sglang-router PYTHON` names a Python that
                         has the sglang-router package

Reported: hit rate, hit/ideal (ideal: an infinite cache), mean and P90 TTFT, input tokens/s. Then the
multi-turn workload straight to one worker with events on and one with events off (throughput ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import time
from typing import Optional

from kvstrata.bench import accounting, multiturn, report
from kvstrata.bench.compare import machine_description, warm_up
from kvstrata.bench.launcher import ServerProcess
from kvstrata.bench.runner import MultiTurnRunner, RunConfig
from kvstrata.bench.workload import build_conversations, synthetic_prompts
from kvstrata.net import free_port

SETUPS = {"tier_aware+events": ["--policy", "tier_aware"],
          "tier_aware-events": ["--policy", "tier_aware", "--no-kv-events"],
          "cache_aware": ["--policy", "cache_aware"]}


def add_churn_args(p: argparse.ArgumentParser) -> None:
    """The churn run's flags (on `kvstrata bench router`)."""
    p.add_argument("--churn", action="store_true", help="Run the churn comparison (see router_churn.py).")
    p.add_argument("--churn-clients", type=int, default=48)
    p.add_argument("--churn-rounds", type=int, default=4)
    p.add_argument("--churn-setups", default=",".join(SETUPS), help="Comma-separated, from " + ", ".join(SETUPS))
    p.add_argument("--sglang-router", default=None, help="A Python with the sglang-router package (optional).")


class Cluster:
    """The workers (each with its own event ports) and how to restart one on the same ports."""

    def __init__(self, args: argparse.Namespace, flags: list[str]):
        self.args, self.flags = args, flags
        self.procs: list[ServerProcess] = []
        self.events: list[str] = []
        for i in range(args.num_workers):
            self.events.append(json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                           "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                           "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}))
            self.procs.append(self._proc(i))

    def _proc(self, i: int, port: Optional[int] = None) -> ServerProcess:
        a = self.args
        cmd = ["--model-path", a.model_path, "--max-total-tokens", str(a.worker_tokens), "--random-seed", "0",
               "--log-level", "warning", "--num-threads", "1", "--enable-hierarchical-cache",
               "--kv-events-config", self.events[i], *self.flags]
        return ServerProcess(cmd, os.path.join(a.out_dir, f"churn-worker{i}-{time.time():.0f}.log"), port=port)

    def start(self) -> None:
        for p in self.procs:
            p.start()
            warm_up(p.url)

    def restart(self, i: int) -> None:
        old = self.procs[i]
        old.stop()
        self.procs[i] = self._proc(i, port=old.port)
        self.procs[i].start()

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def router_proc(args: argparse.Namespace, urls: list[str], setup: str, n: int) -> ServerProcess:
    """Router `n` of a setup (ours, or SGLang's from its own Python)."""
    log = os.path.join(args.out_dir, f"churn-router-{setup}-{n}.log")
    if setup == "sglang-router":
        port = free_port()
        proc = ServerProcess([], log, port=port, module="sglang_router.launch_router")
        proc.cmd = [args.sglang_router, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                    str(port), "--prometheus-port", str(free_port()), "--worker-urls", *urls, "--policy", "cache_aware"]
        return proc
    return ServerProcess(["--worker-urls", *urls, *SETUPS[setup], "--log-level", "info",
                          "--health-check-interval-secs", "1", "--worker-load-check-interval", "0.5"],
                         log, module="kvstrata.router")


def run_setup(args: argparse.Namespace, cluster: Cluster, setup: str, convs: list) -> dict:
    """One churn run: two routers (3/4 and 1/4 of the conversations), a restart at half, the summary."""
    for url in cluster.urls:
        multiturn.flush_cache(url, None)
    routers = [router_proc(args, cluster.urls, setup, n).start() for n in range(2)]
    try:
        time.sleep(2.0)                     # subscriptions and first load polls
        cfg = RunConfig(output_length=args.output_length, max_parallel=args.max_parallel,
                        request_rate=float("inf"), seed=args.seed, progress=False, retry_failed=True)
        main = MultiTurnRunner(routers[0].url + "/generate", [c for c in convs if c.client % 4 != 3], cfg)
        second = MultiTurnRunner(routers[1].url + "/generate", [c for c in convs if c.client % 4 == 3], cfg)
        total = sum(c.num_rounds for c in convs)

        async def restart_at_half() -> None:
            while len(main.records) + len(second.records) < total // 2:
                await asyncio.sleep(0.2)
            await asyncio.to_thread(cluster.restart, len(cluster.procs) - 1)

        async def both():
            return await asyncio.gather(main.run(), second.run(), restart_at_half())

        start = time.perf_counter()
        a, b, _ = asyncio.run(both())
        records = a.records + b.records
        accounting.ideal_cached_tokens(records)
        summary = accounting.summarize(records, round_barrier=False, skipped=a.skipped + b.skipped)
        summary["wall_s"] = time.perf_counter() - start
        summary["reasons"] = {} if setup == "sglang-router" else decision_reasons(routers[0].url)
        return summary
    finally:
        for r in routers:
            r.stop()


def decision_reasons(router_url: str) -> dict[str, float]:
    """The router's routing decisions by reason (exact, approximate, session, ...)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = requests.get(router_url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvstrata_router_routing_decisions_total":
                out[s.labels["reason"]] = out.get(s.labels["reason"], 0) + s.value
    return out


def events_on_off(args: argparse.Namespace, cluster: Cluster, flags: list[str]) -> dict:
    """Multi-turn input tok/s straight to a worker with events on vs a fresh one with them off."""
    off = ServerProcess(["--model-path", args.model_path, "--max-total-tokens", str(args.worker_tokens),
                         "--random-seed", "0", "--log-level", "warning", "--num-threads", "1",
                         "--enable-hierarchical-cache", *flags], os.path.join(args.out_dir, "churn-noevents.log"))
    off.start()
    warm_up(off.url)
    try:
        from kvstrata.bench.router_bench import run_multiturn

        out = {"on": [], "off": []}
        for _ in range(2):                  # interleaved, so that load changes hit both alike
            out["on"].append(run_multiturn(args, cluster.urls[0])["input_throughput"])
            out["off"].append(run_multiturn(args, off.url)["input_throughput"])
        return out
    finally:
        off.stop()


def main(args: argparse.Namespace, flags: list[str], argv: list[str]) -> int:
    """Run the churn comparison and print/write its markdown."""
    args.num_workers = max(args.num_workers, 3)
    setups = [s.strip() for s in args.churn_setups.split(",") if s.strip()]
    if args.sglang_router:
        setups.append("sglang-router")
    os.makedirs(args.out_dir, exist_ok=True)
    started, machine = time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine_description()
    cluster = Cluster(args, flags)
    rows, onoff = [], None
    try:
        cluster.start()
        info = multiturn.get_json(cluster.urls[0], "/server_info", None) or {}
        _, space = multiturn.load_token_source(args.model_path, info)
        rng = random.Random(args.seed)
        convs = build_conversations(args.churn_clients, args.churn_rounds, args.request_length, 0,
                                    lambda count, length: synthetic_prompts(count, length, space, rng))
        for setup in setups:
            print(f"=== churn: {setup}", flush=True)
            try:
                rows.append((setup, run_setup(args, cluster, setup, convs)))
            except Exception as e:      # a shared machine may refuse a restart (memory): keep the other rows
                print(f"churn run {setup} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                cluster.restart(len(cluster.procs) - 1)
        onoff = events_on_off(args, cluster, flags)
    finally:
        cluster.stop()
    md = render(rows, onoff, shlex.join(["kvstrata", "bench", "router", *argv]), machine, started)
    with open(os.path.join(args.out_dir, "router-churn.md"), "w") as fh:
        fh.write(md)
    print("\n" + md)
    return 0


def render(rows: list, onoff: Optional[dict], command: str, machine: str, started: str) -> str:
    """The markdown of a churn run."""
    table = report.markdown_table(
        ["routing", "hit rate", "ideal", "hit/ideal", "mean TTFT (s)", "P90 TTFT (s)", "input tok/s", "failed",
         "decisions (router 1)"],
        [[name, report.pct(s["cache_hit_rate"]), report.pct(s["ideal_hit_rate"]), report.pct(s["hit_rate_vs_ideal"]),
          report.sec(s["mean_ttft"]), report.sec(s["p90_ttft"]), f"{s['input_throughput']:.0f}", str(s["failed"]),
          ", ".join(f"{k} {v:.0f}" for k, v in sorted(s.get("reasons", {}).items())) or "n/a"]
         for name, s in rows])
    lines = ["Churn (one worker restarted at half; a second router with a quarter of the conversations):", "",
             table, ""]
    by = dict(rows)
    ev, best = by.get("tier_aware+events"), [s for n, s in rows if n in ("tier_aware-events", "cache_aware")]
    if ev and best:
        ratio = ev["hit_rate_vs_ideal"] / max(max(s["hit_rate_vs_ideal"] for s in best), 1e-9)
        lines.append(f"- with events: hit/ideal {100 * ev['hit_rate_vs_ideal']:.1f}% (target >= 95%), "
                     f"{ratio:.2f}x the best approximate policy's (target >= 1.3x)")
    if ev and "sglang-router" in by:
        lines.append(f"- mean TTFT with events / SGLang router's = {ev['mean_ttft'] / by['sglang-router']['mean_ttft']:.2f} "
                     "(target <= 0.8)")
    if onoff:
        on, off = sum(onoff["on"]) / len(onoff["on"]), sum(onoff["off"]) / len(onoff["off"])
        lines.append(f"- multi-turn input tok/s straight to a worker, events on / off = {on:.0f} / {off:.0f} = "
                     f"{on / off:.3f} (runs: on {[round(x) for x in onoff['on']]}, off {[round(x) for x in onoff['off']]})")
    lines += ["", f"- Date: {started}", f"- Machine: {machine}", f"- Command: `{command}`"]
    return "\n".join(lines) + "\n"
