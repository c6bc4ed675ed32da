"""`kvstrata bench router --churn`: routing under churn, where approximate trees go stale.

Three workers (small device pools + L2, optionally one file L3 they all share, each publishing KV events),
multi-turn conversations that do not fit the pools, one worker restarted when half the requests are done,
and a second router instance that carries a quarter of the traffic: a quarter of the requests, drawn per
(conversation, round), so one conversation's turns go through both routers (`--churn-split request`), or
a quarter of the conversations (`--churn-split conversation`, the first round's setup). One run per routing
setup; each setup gets fresh prompts of the same shapes (a shared L3 keeps what earlier setups wrote):

    tier_aware+events      tier_aware on the exact index (--kv-events-config on the workers)
    tier_aware+events-pf   the same without prefetch hints (--no-prefetch-hints): what pre-warming gains
    tier_aware-events      tier_aware on its approximate trees (--no-kv-events)
    cache_aware            SGLang's policy, ours
    sglang-router          SGLang's router (cache_aware), when `--sglang-router PYTHON` names a Python that
                           has the sglang-router package

Reported: hit rate; hit/ideal, ideal being an infinite cache's hit (every earlier prompt + answer kept,
accounting.ideal_cached_tokens); hit/reachable, reachable being, per request at the moment it is sent, the
longest prefix any one worker holds in a tier it can read (device, L2, or the shared L3), from the workers'
own KV events in an index of the bench's own (bench/residency.py): what a router with perfect, instant
knowledge could get, capacity misses excluded; the share of requests that got at least that; mean and P90
TTFT; input tokens/s; the mean TTFT of returning turns whose reachable prefix was partly in L2/L3 only; the
main router's decisions by reason and its decisions that chose less cache than another worker held (by its
own view). Then the multi-turn workload straight to one worker with events on and one with events off.
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
from kvstrata.bench.accounting import RequestRecord
from kvstrata.bench.compare import machine_description, warm_up
from kvstrata.bench.launcher import ServerProcess
from kvstrata.bench.residency import Probe, Residency
from kvstrata.bench.runner import MultiTurnRunner, RunConfig
from kvstrata.bench.workload import build_conversations, synthetic_prompts
from kvstrata.net import free_port
from kvstrata.router.kv_subscriber import source_from_config

SETUPS = {"tier_aware+events": ["--policy", "tier_aware"],
          "tier_aware+events-pf": ["--policy", "tier_aware", "--no-prefetch-hints"],
          "tier_aware-events": ["--policy", "tier_aware", "--no-kv-events"],
          "cache_aware": ["--policy", "cache_aware"]}


def add_churn_args(p: argparse.ArgumentParser) -> None:
    """The churn run's flags (on `kvstrata bench router`)."""
    p.add_argument("--churn", action="store_true", help="Run the churn comparison (see router_churn.py).")
    p.add_argument("--churn-clients", type=int, default=48)
    p.add_argument("--churn-rounds", type=int, default=4)
    p.add_argument("--churn-setups", default=",".join(SETUPS), help="Comma-separated, from " + ", ".join(SETUPS))
    p.add_argument("--sglang-router", default=None, help="A Python with the sglang-router package (optional).")
    p.add_argument("--churn-split", choices=["request", "conversation"], default="request",
                   help="What the second router carries a quarter of: requests (a conversation's turns go "
                        "through both routers) or whole conversations.")
    p.add_argument("--churn-skip-onoff", action="store_true", help="Skip the events on/off throughput runs.")
    p.add_argument("--churn-l3", choices=["none", "file", "both"], default="none",
                   help="A file L3 shared by the workers (one --hicache-storage-dir): none, file, or both "
                        "(every setup without, then with it).")


class Cluster:
    """The workers (each with its own event ports) and how to restart one on the same ports."""

    def __init__(self, args: argparse.Namespace, flags: list[str], storage_dir: Optional[str] = None):
        self.args, self.flags = args, flags
        self.storage_dir = storage_dir          # one file L3 that every worker reads and writes
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
        if self.storage_dir:
            cmd += ["--hicache-storage-backend", "file", "--hicache-storage-dir", self.storage_dir]
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

    def residency(self) -> Residency:
        """A bench-side index of what the workers announce (for the reachable-hit probes)."""
        sources = {p.url: source_from_config(e, p.url) for p, e in zip(self.procs, self.events)}
        sid = f"file:{self.storage_dir}" if self.storage_dir else None
        return Residency(sources, {url: sid for url in sources})

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


def second_router_carries(client: int, rnd: int, split: str) -> bool:
    """Whether request (client, rnd) goes through the second router (a quarter of the traffic)."""
    if split == "conversation":
        return client % 4 == 3
    return random.Random(client * 100_003 + rnd).random() < 0.25


def run_setup(args: argparse.Namespace, cluster: Cluster, setup: str, convs: list) -> dict:
    """One churn run: two routers (3/4 and 1/4 of the traffic), a restart at half, the summary."""
    for url in cluster.urls:
        multiturn.flush_cache(url, None)
    routers = [router_proc(args, cluster.urls, setup, n).start() for n in range(2)]
    residency = cluster.residency()
    probes: dict[int, Probe] = {}
    try:
        time.sleep(2.0)                     # subscriptions and first load polls
        cfg = RunConfig(output_length=args.output_length, max_parallel=args.max_parallel,
                        request_rate=float("inf"), seed=args.seed, progress=False, retry_failed=True)
        urls = [r.url + "/generate" for r in routers]

        def url_for(client: int, rnd: int) -> str:
            return urls[1] if second_router_carries(client, rnd, args.churn_split) else urls[0]

        def probe(rec: RequestRecord) -> None:
            probes[id(rec)] = residency.probe(rec.prompt_ids)

        runner = MultiTurnRunner(urls[0], convs, cfg, url_for=url_for, before_send=probe)
        total = sum(c.num_rounds for c in convs)

        async def restart_at_half() -> None:
            while len(runner.records) < total // 2:
                await asyncio.sleep(0.2)
            url = cluster.urls[-1]
            residency.restarting(url)
            await asyncio.to_thread(cluster.restart, len(cluster.procs) - 1)
            await asyncio.to_thread(residency.restarted, url)

        async def both():
            return await asyncio.gather(runner.run(), restart_at_half())

        start = time.perf_counter()
        outcome, _ = asyncio.run(both())
        records = outcome.records
        accounting.ideal_cached_tokens(records)
        summary = accounting.summarize(records, round_barrier=False, skipped=outcome.skipped)
        summary["wall_s"] = time.perf_counter() - start
        summary.update(reachability(records, probes, residency.index.block_size or 1))
        summary["reasons"] = {} if setup == "sglang-router" else decision_reasons(routers[0].url)
        summary["off_best"] = {} if setup == "sglang-router" else off_best(routers[0].url)
        summary["weights"] = printed_weights(routers[0].log_path) if setup.startswith("tier_aware") else []
        return summary
    finally:
        residency.close()
        for r in routers:
            r.stop()


def reachability(records: list[RequestRecord], probes: dict[int, Probe], block: int) -> dict:
    """Hit vs reachable (module docstring), and the TTFT of returning turns whose prefix was in L2/L3 only."""
    ok = [r for r in records if r.ok and id(r) in probes]
    got = sum(r.cached_tokens - r.cached_tokens % block for r in ok)    # whole blocks, as the probes see
    reachable = sum(probes[id(r)].reachable for r in ok)
    warm = [r.ttft for r in ok if r.round > 0 and probes[id(r)].warmable and r.ttft is not None]
    return {"reachable_tokens": reachable, "hit_vs_reachable": got / reachable if reachable else float("nan"),
            "best_share": sum(r.cached_tokens - r.cached_tokens % block >= probes[id(r)].reachable for r in ok)
            / max(1, len(ok)),
            "probes_out_of_sync": sum(not probes[id(r)].in_sync for r in ok),
            "warmable_requests": len(warm), "warmable_mean_ttft": sum(warm) / len(warm) if warm else float("nan")}


def printed_weights(log_path: str) -> list[str]:
    """The last tier_aware weights the router logged per worker (measured from the workers' /load rates)."""
    last: dict[str, str] = {}
    try:
        with open(log_path, errors="replace") as fh:
            for line in fh:
                if "tier_aware weights of " in line:
                    text = line[line.index("tier_aware weights of ") + len("tier_aware weights of "):]
                    worker, _, rest = text.partition(":")
                    last[worker] = rest.split("(")[0].strip() + " (" + rest.split("(")[1].split(" s/token")[0] + " s/token)"
    except (OSError, IndexError):
        pass
    return [f"{w}: {v}" for w, v in sorted(last.items())]


def off_best(router_url: str) -> dict[str, float]:
    """The router's decisions that chose less cache than another worker held, and the tokens forgone."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    out = {"decisions": 0.0, "tokens": 0.0}
    text = requests.get(router_url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvstrata_router_decisions_off_best_cache_total":
                out["decisions"] += s.value
            elif s.name == "kvstrata_router_forgone_cached_tokens_total":
                out["tokens"] += s.value
    return out


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
    import tempfile

    args.num_workers = max(args.num_workers, 3)
    setups = [s.strip() for s in args.churn_setups.split(",") if s.strip()]
    if args.sglang_router:
        setups.append("sglang-router")
    os.makedirs(args.out_dir, exist_ok=True)
    started, machine = time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine_description()
    modes = {"none": [False], "file": [True], "both": [False, True]}[args.churn_l3]
    rows, onoff = [], None
    for l3 in modes:
        with tempfile.TemporaryDirectory(prefix="kvstrata-churn-l3-") as storage_dir:
            cluster = Cluster(args, flags, storage_dir if l3 else None)
            try:
                cluster.start()
                info = multiturn.get_json(cluster.urls[0], "/server_info", None) or {}
                _, space = multiturn.load_token_source(args.model_path, info)
                for n, setup in enumerate(setups):
                    name = setup + (" +L3" if l3 else "")
                    print(f"=== churn: {name} ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f})",
                          flush=True)
                    convs = fresh_conversations(args, space, args.seed * 1000 + n)
                    try:
                        summary = run_setup(args, cluster, setup, convs)
                        summary["load"] = os.getloadavg()[0]
                        rows.append((name, summary))
                    except Exception as e:      # a shared machine may refuse a restart (memory): keep the rest
                        print(f"churn run {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        cluster.restart(len(cluster.procs) - 1)
                if onoff is None and not args.churn_skip_onoff:
                    onoff = events_on_off(args, cluster, flags)
            finally:
                cluster.stop()
    md = render(rows, onoff, shlex.join(["kvstrata", "bench", "router", *argv]), machine, started)
    with open(os.path.join(args.out_dir, "router-churn.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(args.out_dir, "router-churn.json"), "w") as fh:
        json.dump({name: {k: v for k, v in s.items()} for name, s in rows}, fh, indent=1, default=str)
    print("\n" + md)
    return 0


def fresh_conversations(args: argparse.Namespace, space, seed: int) -> list:
    """The churn workload with prompts of its own (a shared L3 keeps what earlier setups wrote)."""
    rng = random.Random(seed)
    return build_conversations(args.churn_clients, args.churn_rounds, args.request_length, 0,
                               lambda count, length: synthetic_prompts(count, length, space, rng))


def render(rows: list, onoff: Optional[dict], command: str, machine: str, started: str) -> str:
    """The markdown of a churn run."""
    table = report.markdown_table(
        ["routing", "hit rate", "ideal", "hit/ideal", "reachable", "hit/reachable", "got the best",
         "mean TTFT (s)", "P90 TTFT (s)", "input tok/s", "TTFT L2/L3-only turns (n)", "failed", "load",
         "decisions (router 1)", "chose less cache (tokens)"],
        [[name, report.pct(s["cache_hit_rate"]), report.pct(s["ideal_hit_rate"]), report.pct(s["hit_rate_vs_ideal"]),
          report.pct(s["reachable_tokens"] / max(1, s["prompt_tokens"])), report.pct(s["hit_vs_reachable"]),
          report.pct(s["best_share"]), report.sec(s["mean_ttft"]), report.sec(s["p90_ttft"]),
          f"{s['input_throughput']:.0f}", f"{report.sec(s['warmable_mean_ttft'])} ({s['warmable_requests']})",
          str(s["failed"]), f"{s.get('load', 0):.1f}",
          ", ".join(f"{k} {v:.0f}" for k, v in sorted(s.get("reasons", {}).items())) or "n/a",
          f"{s['off_best']['decisions']:.0f} ({s['off_best']['tokens']:.0f})" if s.get("off_best") else "n/a"]
         for name, s in rows])
    lines = ["Churn (one worker restarted at half; a second router with a quarter of the traffic):", "",
             table, ""]
    by = dict(rows)
    for suffix in ("", " +L3"):
        ev = by.get("tier_aware+events" + suffix)
        best = [s for n, s in rows if n in ("tier_aware-events" + suffix, "cache_aware" + suffix)]
        if ev and best:
            ratio = ev["hit_rate_vs_ideal"] / max(max(s["hit_rate_vs_ideal"] for s in best), 1e-9)
            lines.append(f"- with events{suffix}: hit/ideal {100 * ev['hit_rate_vs_ideal']:.1f}% (target >= 95%), "
                         f"hit/reachable {100 * ev['hit_vs_reachable']:.1f}%, {ratio:.2f}x the best approximate "
                         "policy's hit/ideal (target >= 1.3x)")
        sgl = by.get("sglang-router" + suffix)
        if ev and sgl:
            lines.append(f"- mean TTFT with events / SGLang router's{suffix} = {ev['mean_ttft'] / sgl['mean_ttft']:.2f} "
                         "(target <= 0.8)")
        nopf = by.get("tier_aware+events-pf" + suffix)
        if ev and nopf:
            lines.append(f"- pre-warming{suffix}: mean TTFT of returning turns with their prefix in L2/L3 only, "
                         f"hints / no hints = {report.sec(ev['warmable_mean_ttft'])} / "
                         f"{report.sec(nopf['warmable_mean_ttft'])} = "
                         f"{ev['warmable_mean_ttft'] / nopf['warmable_mean_ttft']:.2f} (target <= 0.8); all turns "
                         f"{ev['mean_ttft'] / nopf['mean_ttft']:.2f}")
    for name, s in rows:
        if s.get("weights"):
            lines.append(f"- {name}, weights the main router measured and logged last: " + "; ".join(s["weights"]))
    if onoff:
        on, off = sum(onoff["on"]) / len(onoff["on"]), sum(onoff["off"]) / len(onoff["off"])
        lines.append(f"- multi-turn input tok/s straight to a worker, events on / off = {on:.0f} / {off:.0f} = "
                     f"{on / off:.3f} (runs: on {[round(x) for x in onoff['on']]}, off {[round(x) for x in onoff['off']]})")
    lines += ["", f"- Date: {started}", f"- Machine: {machine}", f"- Command: `{command}`"]
    return "\n".join(lines) + "\n"
