"""`kvstrata bench compare`: one multi-turn workload against L1 only, L1+L2, L1+L2+L3 — the seed's table.

The server is launched once per configuration, with the same small device pool (well under the workload's
working set, as in the seed) and the same page size:

    l1        radix cache on the device pool only
    l2        + host-memory tier (--enable-hierarchical-cache --hicache-ratio R)
    l3        + file storage tier in a fresh temporary directory
    mooncake  + Mooncake storage tier on a local cluster started for the run (with --mooncake)

Writes compare.md (table, command, date, machine), compare.png and compare.jsonl to --out-dir. Flags this
command does not know are passed to every server. Defaults finish in about 5 minutes on 2 CPU cores with
the `bench` model (under 10 on a busy machine).

`--preset seed` runs the seed article's experiment (150 clients x 10 rounds of 2,048 tokens, rate 16, max
parallel 4, round barrier; all four configurations on the 32k-context `bench-32k` model) with pools in the
seed's proportions (kvstrata/bench/presets.py says how they were derived); `--scale F` shrinks it with the
same shape. Flags given explicitly override the preset's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
from typing import Any, Optional

import requests

from kvstrata.bench import multiturn, presets, report
from kvstrata.bench.launcher import ServerProcess, ServerStartError

CONFIG_NAMES = {"l1": "L1 only (device)", "l2": "L1+L2 (host DRAM)", "l3": "L1+L2+L3 (file)",
                "mooncake": "L1+L2+L3 (Mooncake)"}
REPORTED_KEYS = ("max_total_tokens", "page_size", "enable_hierarchical_cache", "hicache_ratio",
                 "hicache_storage_backend", "hicache_write_policy")


def build_parser() -> argparse.ArgumentParser:
    """Workload flags (compare's own defaults) and the tier settings."""
    p = argparse.ArgumentParser(prog="kvstrata bench compare", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    multiturn.add_workload_args(p)
    p.set_defaults(model_path="bench", num_clients=16, num_rounds=6, request_length=128, output_length=1,
                   max_parallel=4, request_rate=16.0, enable_round_barrier=True)
    p.add_argument("--no-round-barrier", dest="enable_round_barrier", action="store_false")
    p.add_argument("--preset", choices=presets.PRESETS, default=None,
                   help="A named experiment: 'seed' = the seed article's workload, model and four configurations.")
    p.add_argument("--scale", type=float, default=1.0,
                   help="With --preset: clients and request length times this (0 < F <= 1), pools in proportion.")
    p.add_argument("--device-tokens", type=int, default=4096, help="Device pool (L1) size: --max-total-tokens.")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="Host pool (L2) size / device pool size.")
    p.add_argument("--configs", default="l1,l2,l3", help="Comma-separated subset of l1,l2,l3,mooncake.")
    p.add_argument("--mooncake", action="store_true", help="Add the Mooncake L3 configuration.")
    p.add_argument("--mooncake-segment-mb", type=int, default=1024,
                   help="Memory the local Mooncake store offers (the preset sizes it to the working set).")
    p.add_argument("--repeat", type=int, default=1,
                   help="Run the configurations this many times, interleaved, and report medians.")
    p.add_argument("--out-dir", default="out/bench_compare")
    p.add_argument("--server-start-timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")
    return p


def apply_preset(args: argparse.Namespace, argv: list[str]) -> None:
    """Fill in the preset's workload, model, configurations and pool sizes, except flags given in `argv`."""
    if args.preset is None:
        if args.scale != 1.0:
            raise SystemExit("error: --scale needs --preset")
        return
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}

    def put(name: str, value: Any) -> None:
        if "--" + name.replace("_", "-") not in given:
            setattr(args, name, value)

    for name, value in presets.SEED_WORKLOAD.items():
        put(name, value)
    put("model_path", presets.SEED_MODEL)
    put("configs", presets.SEED_CONFIGS)
    try:
        shape = presets.seed_shape(args.scale, args.page_size)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    put("num_clients", shape.num_clients)
    put("request_length", shape.request_length)
    put("device_tokens", shape.device_tokens)
    put("hicache_ratio", shape.hicache_ratio)
    # Mooncake holds every conversation's KV (the L3 of the seed): the working set at the bench model's
    # 4 KiB per token (8 layers x 2 KV heads x 64 x K and V in bf16; half that with an FP8 KV cache,
    # which is what lets the full scale fit a 24 GB machine), with room to spare.
    fp8 = any(a.startswith("--kv-cache-dtype") and "fp8" in a for a in argv) or any(
        a == "--kv-cache-dtype" and i + 1 < len(argv) and "fp8" in argv[i + 1] for i, a in enumerate(argv))
    kv_bytes = 2048 if fp8 else 4096
    put("mooncake_segment_mb", max(256, math.ceil(1.5 * shape.working_set_tokens * kv_bytes / 2**20)))
    args.preset_shape = shape


def tier_flags(key: str, args: argparse.Namespace, storage_dir: str) -> list[str]:
    """Server flags of one configuration."""
    flags = ["--model-path", args.model_path, "--max-total-tokens", str(args.device_tokens),
             "--page-size", str(args.page_size)]
    if key in ("l2", "l3", "mooncake"):
        flags += ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)]
    if key == "l3":
        flags += ["--hicache-storage-backend", "file", "--hicache-storage-dir", storage_dir]
    if key == "mooncake":
        flags += ["--hicache-storage-backend", "mooncake"]
    return flags


def warm_up(url: str) -> None:
    """One short request, so that first-call costs (allocations, kernels) do not land in round 0."""
    ids = [random.Random(0).randrange(100, 200) for _ in range(64)]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}}
    try:
        requests.post(url + "/generate", json=body, timeout=300)
    except requests.RequestException:
        pass                           # the measured run will report what is wrong


def run_config(key: str, args: argparse.Namespace, server_flags: list[str], out_dir: str,
               env: Optional[dict] = None, log_name: str = "") -> dict:
    """Launch the server of one configuration, run the workload, stop it; errors become the row's error."""
    row: dict[str, Any] = {"key": key, "name": CONFIG_NAMES[key]}
    with tempfile.TemporaryDirectory(prefix="kvstrata-l3-") as storage_dir:
        flags = tier_flags(key, args, storage_dir) + server_flags
        row["server_flags"] = flags
        server = ServerProcess(flags, os.path.join(out_dir, log_name or f"server-{key}.log"), env=env)
        print(f"\n=== {row['name']}: {' '.join(flags)}", flush=True)
        try:
            server.start(args.server_start_timeout)
        except ServerStartError as e:
            row["error"] = str(e).splitlines()[0]
            print(f"server did not start: {e}", file=sys.stderr)
            return row
        try:
            warm_up(server.url)
            info = multiturn.get_json(server.url, "/server_info", None) or {}
            row["server_reported"] = {k: info.get(k) for k in REPORTED_KEYS if k in info}
            result = multiturn.run(args, server.url)
            print(report.format_run(result), flush=True)
            row.update(workload=result["workload"], errors=result["errors"], load_avg=_load_avg())
            if server.proc is not None and server.proc.poll() is not None:
                row["error"] = f"the server exited with code {server.proc.returncode} during the run"
            elif result["summary"]["completed"] == 0:
                row["error"] = f"no request completed ({'; '.join(result['errors'][:1])})"
            else:
                row.update(summary=result["summary"], rounds=result["rounds"], tiers=result["tiers"],
                           cache=result["cache"])
        except (Exception, SystemExit) as e:  # one broken configuration must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"run failed: {row['error']}", file=sys.stderr)
        finally:
            code = server.stop()
            row["server_exit_code"] = code
    return row


def merge_runs(runs: list[dict]) -> dict:
    """One row from repeated runs of a configuration: the median of every number over the runs that completed."""
    done = [r for r in runs if r.get("summary")]
    if not done:
        return runs[-1]
    row = dict(done[0], runs=len(done), runs_failed=len(runs) - len(done))
    if len(done) > 1:
        row["summary"] = _median_dict([r["summary"] for r in done])
        row["rounds"] = [_median_dict(list(rounds)) for rounds in zip(*(r["rounds"] for r in done))]
        row["tiers"] = _median_dict([r["tiers"] for r in done])
        row["cache"] = _median_dict([r.get("cache") or {} for r in done])
    return row


def _median_dict(dicts: list[dict]) -> dict:
    out = dict(dicts[0])
    for key, value in dicts[0].items():
        values = [d.get(key) for d in dicts]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(
                isinstance(v, (int, float)) for v in values):
            out[key] = statistics.median(values)
    return out


def _load_avg() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def machine_description() -> str:
    """CPU model, core count, OS, and the load average (the machine may be shared)."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), model)
    except OSError:
        pass
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return (f"{os.cpu_count()} cores, {model}, {platform.system()} {platform.release()}; OMP_NUM_THREADS={threads}; "
            f"load average {_load_avg()}")


# (mean TTFT at most, input tok/s at least) as ratios of L1 only: the README's own, and the seed's (2.58 s of
# 5.91 s, 15,022.80 of 6,576.85 tok/s); hit/ideal at least 95% for both.
TARGETS = {None: (0.40, 2.0), "seed": (0.44, 2.28)}


def targets(rows: list[dict], preset: Optional[str] = None) -> list[str]:
    """The targets for the deepest tier configuration that ran, against L1 only."""
    max_ttft, min_tput = TARGETS[preset]
    base = next((r["summary"] for r in rows if r["key"] == "l1" and r.get("summary")), None)
    top = next((r for r in reversed(rows) if r["key"] in ("l3", "mooncake") and r.get("summary")), None)
    if base is None or top is None:
        return ["Targets: not evaluated (needs the L1-only and an L3 configuration to complete)."]
    s = top["summary"]

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    ttft_ratio = s["mean_ttft"] / base["mean_ttft"] if base["mean_ttft"] else float("nan")
    tput_ratio = s["input_throughput"] / base["input_throughput"] if base["input_throughput"] else float("nan")
    return [f"Targets ({top['name']} vs L1 only):",
            f"- hit rate / ideal = {100 * s['hit_rate_vs_ideal']:.1f}% (target >= 95%): "
            f"{mark(s['hit_rate_vs_ideal'] >= 0.95)}",
            f"- mean TTFT = {ttft_ratio:.2f}x L1 only (target <= {max_ttft:.2f}x): {mark(ttft_ratio <= max_ttft)}",
            f"- input throughput = {tput_ratio:.2f}x L1 only (target >= {min_tput:.2f}x): "
            f"{mark(tput_ratio >= min_tput)}"]


def noise_note(rows: list[dict]) -> str:
    """Round 0 does the same work in every configuration (nothing to reuse): its TTFT spread is noise."""
    parts = []
    for r in rows:
        first = next((x for x in r.get("rounds") or [] if x["round"] == 0), None)
        if r.get("summary") and first:
            parts.append(f"{r['name']} {first['mean_ttft']:.3f} s")
    if len(parts) < 2:
        return ""
    return ("Round 0 has nothing to reuse and is the same work in every configuration; its mean TTFT "
            f"({', '.join(parts)}) shows how much the machine's speed varied between the runs.")


def render_markdown(rows: list[dict], command: str, started: str, machine: str, args: argparse.Namespace) -> str:
    """The results document: table, workload, command, date, machine, targets, per-tier metrics."""
    w = next((r["workload"] for r in rows if r.get("workload")), {})
    ideal = next((r["summary"]["ideal_hit_rate"] for r in rows if r.get("summary")), float("nan"))
    lines = [report.compare_table(rows), "",
             f"Ideal hit rate of the workload (infinite cache): {100 * ideal:.1f}%. "
             f"Changes in parentheses are against L1 only.", "",
             f"- Date: {started}", f"- Machine: {machine}", f"- Command: `{command}`",
             f"- Model: `{args.model_path}`; device pool {args.device_tokens} tokens, page size {args.page_size}, "
             f"host pool {args.hicache_ratio}x the device pool",
             f"- Workload: {w.get('source', '?')}; {args.num_clients} clients x {args.num_rounds} rounds, "
             f"request {args.request_length} tokens, sub-question {args.sub_question_input_length or args.request_length}, "
             f"output {args.output_length}, max parallel {args.max_parallel}, rate {args.request_rate} req/s, "
             f"round barrier {'on' if args.enable_round_barrier else 'off'}, seed {args.seed}",
             f"- Runs: {'median of ' + str(args.repeat) + ' interleaved runs' if args.repeat > 1 else 'one'} "
             f"per configuration", ""]
    lines += [noise_note(rows), ""]
    shape = getattr(args, "preset_shape", None)
    if shape is not None:
        lines += [f"Preset `{args.preset}` at scale {args.scale}: working set {shape.working_set_tokens:,} tokens "
                  f"({shape.num_clients} conversations x {shape.longest_prompt:,}-token last prompt); device pool "
                  f"{args.device_tokens:,} tokens ({args.device_tokens / shape.working_set_tokens:.2f}x the working "
                  f"set), host pool {args.hicache_ratio}x the device pool; Mooncake segment "
                  f"{args.mooncake_segment_mb:,} MB.", ""]
    lines += ["What the seed's table cannot show:", "", report.cache_table(rows), ""]
    lines += targets(rows, getattr(args, "preset", None)) + ["", "Server cache metrics per configuration (counters: change over the run):"]
    for r in rows:
        reported = r.get("server_reported")
        tiers = r.get("tiers") or {}
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(tiers.items()))
        status = f"did not complete: {r['error']}" if r.get("error") else f"load average after: {r.get('load_avg')}"
        lines.append(f"- {r['name']} ({status}): server args {reported}; {shown or 'no tier metrics reported'}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, server_flags = build_parser().parse_known_args(argv)
    apply_preset(args, argv)
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    if args.mooncake and "mooncake" not in keys:
        keys.append("mooncake")
    unknown = [k for k in keys if k not in CONFIG_NAMES]
    if unknown:
        raise SystemExit(f"error: unknown configuration(s) {unknown}; choose from {list(CONFIG_NAMES)}")
    os.makedirs(args.out_dir, exist_ok=True)
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = machine_description()
    runs: dict[str, list[dict]] = {key: [] for key in keys}
    for rep in range(max(1, args.repeat)):     # interleaved, so that slow spells of a shared machine spread
        for key in keys:
            log_name = f"server-{key}-{rep}.log" if args.repeat > 1 else f"server-{key}.log"
            if key == "mooncake":
                runs[key].append(run_mooncake(args, server_flags, log_name))
            else:
                runs[key].append(run_config(key, args, server_flags, args.out_dir, log_name=log_name))
    rows = [merge_runs(runs[key]) for key in keys]
    command = " ".join(["kvstrata bench compare", shlex.join(argv)]).strip()
    md = render_markdown(rows, command, started, machine, args)
    with open(os.path.join(args.out_dir, "compare.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(args.out_dir, "compare.jsonl"), "a") as fh:
        for r in rows:
            fh.write(json.dumps({"started": started, **r}, default=str) + "\n")
    report.plot_compare(rows, os.path.join(args.out_dir, "compare.png"),
                        title=f"kvstrata multi-turn, {args.model_path}, {machine.split(';')[0]}")
    print("\n" + md)
    print(f"written: {args.out_dir}/compare.md, compare.png, compare.jsonl")
    return 0 if any(r.get("summary") for r in rows) else 1


def run_mooncake(args: argparse.Namespace, server_flags: list[str], log_name: str = "") -> dict:
    """The Mooncake configuration on a local cluster started (and stopped) for it, if Mooncake is here."""
    try:
        from kvstrata.storage.mooncake_services import MooncakeCluster

        cluster = MooncakeCluster(segment_bytes=args.mooncake_segment_mb * 2**20).start()
    except Exception as e:  # package missing, binary missing, ports: report it in the table
        print(f"Mooncake not available: {e}", file=sys.stderr)
        return {"key": "mooncake", "name": CONFIG_NAMES["mooncake"], "error": f"Mooncake not available: {e}"}
    try:
        return run_config("mooncake", args, server_flags, args.out_dir, env=cluster.env(), log_name=log_name)
    finally:
        cluster.stop()
