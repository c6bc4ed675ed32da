"""`kvstrata bench upgrade`: upgrade the worker role of a running local group under multi-turn load.

Starts the default role group (or --spec) in this process, drives continuous multi-turn conversations
through its router, and at --upgrade-at seconds upgrades the worker role:

    in-place  one member at a time: router drains it, process replaced on the same port, ready, re-admitted
    naive     every member stopped and started at once, without draining (a Deployment's recreate)

Reports, per --window seconds (by send time): requests ok/failed, hit rate, mean and P99 TTFT; and the
targets: zero failed requests, hit rate in the minute after the upgrade >= 95% of the minute before,
P99 TTFT during the upgrade <= 2x the steady state.

    kvstrata bench upgrade --duration 120 --upgrade-at 40 --num-clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from kvstrata.bench import accounting
from kvstrata.bench.multiturn import get_json, load_token_source
from kvstrata.bench.report import markdown_table, pct, sec
from kvstrata.bench.runner import MultiTurnRunner, RunConfig
from kvstrata.bench.workload import build_conversations, make_prompt_source

MODES = ("in-place", "naive")


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="kvstrata bench upgrade", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default=None, help="role-group spec (default: `kvstrata cluster spec`)")
    p.add_argument("--role", default="worker", help="role to upgrade")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="what the in-place upgrade changes (default for server roles: max-running-requests=128; "
                        "none for others: the same arguments, a new process)")
    p.add_argument("--modes", default="in-place,naive", help="comma-separated: in-place, naive")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load per mode")
    p.add_argument("--upgrade-at", type=float, default=40.0, help="seconds into the load")
    p.add_argument("--window", type=float, default=10.0, help="report window, seconds")
    p.add_argument("--num-clients", type=int, default=16, help="conversations, all in flight together")
    p.add_argument("--request-length", type=int, default=128, help="tokens of each first prompt")
    p.add_argument("--sub-question-input-length", type=int, default=16, help="tokens of each later question")
    p.add_argument("--output-length", type=int, default=8, help="tokens generated per request")
    p.add_argument("--num-rounds", type=int, default=0,
                   help="rounds per conversation (0: enough to last --duration at --request-rate, within the "
                        "model's context)")
    p.add_argument("--request-rate", type=float, default=4.0, help="mean requests/s (Poisson arrivals); a "
                   "failed request is sent again, so a conversation outlives an outage")
    p.add_argument("--router-port", type=int, default=0, help="0: a free port")
    p.add_argument("--run-dir", default=None, help="group state and logs (default: a temp dir)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-file", default=None, help="append the results as one JSON line")
    p.add_argument("--plot", default=None, help="write a PNG chart of hit rate and P99 TTFT per window")
    return p


# ---------------------------------------------------------------------- one mode
def run_mode(args: argparse.Namespace, mode: str) -> dict:
    """Start the group, load it, upgrade (or naively restart) the role mid-run, stop it; returns the result."""
    from kvstrata.bench.launcher import free_port
    from kvstrata.cluster.cli import parse_settings
    from kvstrata.cluster.spec import SERVER_KINDS, load_spec
    from kvstrata.cluster.supervisor import Supervisor

    spec = load_spec(args.spec)
    run_dir = Path(args.run_dir) / mode
    sup = Supervisor(spec, run_dir, args.router_port or free_port())

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {mode}: {msg}", file=sys.stderr, flush=True)

    sup.start(log)
    watcher = threading.Thread(target=sup.run, args=(log,), daemon=True)
    watcher.start()
    try:
        url = sup.router().url
        events: dict[str, float] = {}
        default = ["max-running-requests=128"] if spec.role(args.role).kind in SERVER_KINDS else []
        settings = parse_settings(default if args.set is None else args.set)
        records = asyncio.run(_load_and_upgrade(args, url, mode, events, sup, settings, log))
    finally:
        sup.stopping.set()
        watcher.join(120)
    return summarize(mode, records, events, args.window)


async def _load_and_upgrade(args: argparse.Namespace, url: str, mode: str, events: dict, sup: Any,
                            settings: dict, log: Any) -> list[accounting.RequestRecord]:
    info = get_json(url, "/server_info", None) or {}
    tokenizer, space = load_token_source(info.get("model_path"), info)
    _, make_prompts = make_prompt_source(None, True, tokenizer, space, random.Random(args.seed))
    rounds = args.num_rounds or auto_rounds(args, int(info.get("context_length") or 4096))
    convs = build_conversations(args.num_clients, rounds, args.request_length,
                                args.sub_question_input_length, make_prompts)
    cfg = RunConfig(output_length=args.output_length, max_parallel=args.num_clients, request_rate=args.request_rate,
                    request_timeout_s=300, retry_failed=True, seed=args.seed, progress=False)
    runner = MultiTurnRunner(url + "/generate", convs, cfg)
    role = sup.spec.role(args.role)

    async def upgrade() -> None:
        await asyncio.sleep(args.upgrade_at)
        events["upgrade_start"] = time.perf_counter() - runner.t0
        log(f"{'upgrading' if mode == 'in-place' else 'restarting'} {role.name}")
        if mode == "in-place":
            await asyncio.to_thread(sup.upgrade, role, settings, log)
        else:
            await asyncio.to_thread(sup.restart_all, role, log)
        events["upgrade_end"] = time.perf_counter() - runner.t0
        log(f"{role.name} done after {events['upgrade_end'] - events['upgrade_start']:.1f} s")

    task = asyncio.create_task(upgrade())
    try:
        await asyncio.wait_for(runner.run(), args.duration)
    except asyncio.TimeoutError:
        pass                        # the load runs for --duration
    await task
    # Requests still in flight at the cut-off fail as the client session closes: they are not counted.
    return [r for r in runner.records if 0 < r.finish_time < args.duration - 0.5]


def auto_rounds(args: argparse.Namespace, context_length: int) -> int:
    """Rounds that keep every client busy for the whole run, capped so the last prompt fits the context."""
    wanted = int(args.request_rate * args.duration / args.num_clients) + 2
    per_round = args.output_length + args.sub_question_input_length
    fits = (context_length - args.request_length - args.output_length) // per_round
    return max(1, min(wanted, fits))


# ---------------------------------------------------------------------- report
def window_rows(records: list[accounting.RequestRecord], window_s: float) -> list[dict]:
    """Per window of send time: ok, failed, hit rate, mean and P99 TTFT."""
    if not records:
        return []
    last = max(r.send_time for r in records)
    rows = []
    for w in range(int(last // window_s) + 1):
        recs = [r for r in records if w * window_s <= r.send_time < (w + 1) * window_s]
        rows.append({"start_s": w * window_s, **_stats(recs)})
    return rows


def _stats(recs: list[accounting.RequestRecord]) -> dict:
    ok = [r for r in recs if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return {"ok": len(ok), "failed": len(recs) - len(ok),
            "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan"),
            "mean_ttft": accounting.mean(ttfts), "p99_ttft": accounting.percentile(ttfts, 99)}


def summarize(mode: str, records: list[accounting.RequestRecord], events: dict, window_s: float) -> dict:
    """Windows, and before / during / after the upgrade (a minute each side) with the targets."""
    start, end = events.get("upgrade_start", float("nan")), events.get("upgrade_end", float("nan"))
    before = _stats([r for r in records if start - 60 <= r.send_time < start])
    during = _stats([r for r in records if start <= r.send_time < end])
    after = _stats([r for r in records if end <= r.send_time < end + 60])
    failed = sum(1 for r in records if not r.ok)
    return {"mode": mode, "events": events, "windows": window_rows(records, window_s),
            "before": before, "during": during, "after": after, "failed": failed,
            "errors": sorted({r.error for r in records if r.error})[:5],
            "targets": {"zero_failed": failed == 0,
                        "hit_rate_after_vs_before": after["hit_rate"] / before["hit_rate"] if before["hit_rate"] else None,
                        "p99_during_vs_steady": during["p99_ttft"] / before["p99_ttft"] if before["p99_ttft"] else None}}


def format_result(res: dict) -> str:
    """The console/markdown report of one mode."""
    ev = res["events"]
    rows = [[f"{w['start_s']:.0f}", str(w["ok"]), str(w["failed"]), pct(w["hit_rate"]), sec(w["mean_ttft"]),
             sec(w["p99_ttft"])] for w in res["windows"]]
    t = res["targets"]
    phases = [[name, str(p["ok"]), str(p["failed"]), pct(p["hit_rate"]), sec(p["mean_ttft"]), sec(p["p99_ttft"])]
              for name, p in (("minute before", res["before"]), ("during", res["during"]),
                              ("minute after", res["after"]))]
    ratio = t["hit_rate_after_vs_before"]
    p99 = t["p99_during_vs_steady"]
    return "\n".join([
        f"### {res['mode']}: upgrade from {ev.get('upgrade_start', float('nan')):.1f} s to "
        f"{ev.get('upgrade_end', float('nan')):.1f} s",
        "", markdown_table(["window start (s)", "ok", "failed", "hit rate", "mean TTFT (s)", "P99 TTFT (s)"], rows),
        "", markdown_table(["phase", "ok", "failed", "hit rate", "mean TTFT (s)", "P99 TTFT (s)"], phases), "",
        f"failed requests: {res['failed']}" + (f" ({'; '.join(res['errors'])})" if res["errors"] else ""),
        f"hit rate after / before: {pct(ratio) if ratio is not None else 'n/a'} (target >= 95%); "
        f"P99 TTFT during / steady: {f'{p99:.2f}x' if p99 is not None else 'n/a'} (target <= 2x)",
    ])


def plot(results: list[dict], path: str) -> None:
    """Failed requests, hit rate and P99 TTFT per window, one series per mode, the upgrade shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, res in enumerate(results):
        xs = [w["start_s"] for w in res["windows"]]
        width = res["windows"][1]["start_s"] / (len(results) + 1) if len(xs) > 1 else 1
        axes[0].bar([x + k * width for x in xs], [w["failed"] for w in res["windows"]], width, label=res["mode"])
        axes[1].plot(xs, [100 * w["hit_rate"] for w in res["windows"]], marker="o", label=res["mode"])
        axes[2].plot(xs, [w["p99_ttft"] for w in res["windows"]], marker="o", label=res["mode"])
        ev = res["events"]
        for ax in axes:
            ax.axvspan(ev.get("upgrade_start", 0), ev.get("upgrade_end", 0), alpha=0.1,
                       color="tab:blue" if res["mode"] == "in-place" else "tab:orange")
    axes[0].set_ylabel("failed requests")
    axes[1].set_ylabel("hit rate (%)")
    axes[2].set_ylabel("P99 TTFT (s)")
    for ax in axes:
        ax.set_xlabel("window start (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    args = build_parser().parse_args(argv)
    args.run_dir = args.run_dir or tempfile.mkdtemp(prefix="kvstrata-bench-upgrade-")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"error: unknown mode {bad[0]!r}; modes: {', '.join(MODES)}")
    results = [run_mode(args, mode) for mode in modes]
    for res in results:
        print(format_result(res) + "\n")
    if args.plot:
        plot(results, args.plot)
    if args.log_file:
        with open(args.log_file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
                                 "args": vars(args), "results": results}, default=str) + "\n")
    return 0 if all(r["failed"] == 0 for r in results if r["mode"] == "in-place") else 1
