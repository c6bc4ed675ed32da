"""Text and markdown tables of benchmark results, and the comparison chart (PNG, matplotlib)."""

from __future__ import annotations

import math
from typing import Any, Optional


def pct(x: Optional[float]) -> str:
    """A fraction as a percentage with one decimal ("n/a" for None or NaN)."""
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def sec(x: Optional[float]) -> str:
    """Seconds with three decimals ("n/a" for None or NaN)."""
    return "n/a" if x is None or math.isnan(x) else f"{x:.3f}"


def _change(value: float, base: Optional[float]) -> str:
    if base is None or not base or math.isnan(base) or value is None or math.isnan(value):
        return ""
    return f" ({100 * (value - base) / base:+.1f}%)"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-style markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def round_table(rounds: list[dict]) -> str:
    """Per-round markdown table: requests, failures, hit rate vs ideal, TTFT."""
    header = ["round", "requests", "failed", "prompt tokens", "hit rate", "ideal", "mean TTFT (s)",
              "P90 TTFT (s)"]
    rows = [[str(r["round"]), str(r["requests"]), str(r["failed"]), str(r["prompt_tokens"]),
             pct(r["cache_hit_rate"]), pct(r["ideal_hit_rate"]), sec(r["mean_ttft"]), sec(r["p90_ttft"])]
            for r in rounds]
    return markdown_table(header, rows)


def format_run(result: dict) -> str:
    """The console report of one `kvstrata bench multiturn` run."""
    s, w = result["summary"], result["workload"]
    lines = [
        f"Workload: {w['num_clients']} clients x {w['num_rounds']} rounds, request {w['request_length']} "
        f"tokens, output {w['output_length']}, max parallel {w['max_parallel']}, rate {w['request_rate']} req/s, "
        f"barrier {'on' if w['enable_round_barrier'] else 'off'}; prompts: {w['source']}",
        f"Requests: {s['completed']} completed, {s['failed']} failed, {s['skipped']} skipped after a failure",
        f"Cache hit rate: {pct(s['cache_hit_rate'])}  (ideal {pct(s['ideal_hit_rate'])}, "
        f"hit rate / ideal {pct(s['hit_rate_vs_ideal'])}; page size {w['page_size']})",
        f"TTFT (s): mean {sec(s['mean_ttft'])}  P50 {sec(s['p50_ttft'])}  P90 {sec(s['p90_ttft'])}  "
        f"P99 {sec(s['p99_ttft'])}",
        f"Latency (s): mean {sec(s['mean_latency'])}  P90 {sec(s['p90_latency'])}",
        f"Throughput: input {s['input_throughput']:.1f} tok/s, output {s['output_throughput']:.1f} tok/s, "
        f"{s['request_throughput']:.2f} req/s over {s['duration_s']:.1f} s "
        f"(barrier pauses excluded: {s['barrier_pause_s']:.1f} s)",
        f"Engine busy (forward seconds / wall seconds): {pct(s.get('engine_busy'))}",
        "",
        round_table(result["rounds"]),
    ]
    tiers = result.get("tiers") or {}
    lines.append("")
    if tiers:
        lines.append("Server cache metrics (counters: change over the run):")
        lines += [f"  {k}: {_fmt_metric(v)}" for k, v in sorted(tiers.items())]
    else:
        lines.append("Server cache metrics: none reported by /server_info")
    if result.get("errors"):
        lines.append("Errors: " + "; ".join(result["errors"]))
    return "\n".join(lines)


def _fmt_metric(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def compare_table(rows: list[dict]) -> str:
    """The seed-shaped comparison: config, hit rate, mean/P90 TTFT, input tok/s, change vs L1 only."""
    base = next((r["summary"] for r in rows if r.get("key") == "l1" and r.get("summary")), None)
    header = ["Config", "KV cache hit rate", "Hit rate / ideal", "Mean TTFT (s)", "P90 TTFT (s)",
              "Input tok/s", "Failed", "Engine busy"]
    out = []
    for row in rows:
        s = row.get("summary")
        if not s:
            out.append([row["name"], f"did not complete: {row.get('error', 'unknown error')}", "", "", "", "", "",
                        ""])
            continue
        b = None if s is base else base
        out.append([row["name"], pct(s["cache_hit_rate"]), pct(s["hit_rate_vs_ideal"]),
                    sec(s["mean_ttft"]) + _change(s["mean_ttft"], b and b["mean_ttft"]),
                    sec(s["p90_ttft"]) + _change(s["p90_ttft"], b and b["p90_ttft"]),
                    f"{s['input_throughput']:,.1f}" + _change(s["input_throughput"], b and b["input_throughput"]),
                    str(s["failed"]), pct(s.get("engine_busy"))])
    return markdown_table(header, out)


def _mb(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.1f}"


def cache_table(rows: list[dict]) -> str:
    """Per configuration, what the seed's table cannot show: where hits came from, bytes moved between
    tiers, what L3 holds, the engine's busy share and the scheduler's CPU time per step."""
    header = ["Config", "Hit / ideal", "Hits L1 / L2 / L3 (tokens)", "Load-back MB (L2->L1)", "L3 read MB",
              "L3 objects / MB written", "Engine busy", "Scheduler CPU ms/step", "Empty steps (CPU s)", "Integrity"]
    out = []
    for row in rows:
        s, c = row.get("summary"), row.get("cache") or {}
        if not s:
            continue
        hits = " / ".join(f"{c[k]:,}" if k in c else "n/a" for k in ("l1_hit_tokens", "l2_hit_tokens",
                                                                        "l3_hit_tokens"))
        objects = f"{c['l3_objects']:,} / {_mb(c.get('l3_bytes'))}" if c.get("l3_objects") is not None else "n/a"
        cpu = c.get("scheduler_cpu_ms_per_step")
        empty = f"{c['empty_steps']:,} ({c.get('empty_step_cpu_s', 0.0):.3f})" if "empty_steps" in c else "n/a"
        ok = c.get("integrity_ok")
        out.append([row["name"], pct(s["hit_rate_vs_ideal"]), hits, _mb(c.get("load_back_bytes")),
                    _mb(c.get("l3_read_bytes")), objects, pct(s.get("engine_busy")),
                    "n/a" if cpu is None else f"{cpu:.2f}", empty, "n/a" if ok is None else ("ok" if ok else "FAILED")])
    return markdown_table(header, out)


def plot_compare(rows: list[dict], path: str, title: str = "") -> None:
    """Bar charts of hit rate (with the ideal), mean/P90 TTFT and input throughput per config, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("summary")]
    names = [r["name"] for r in done]
    xs = range(len(done))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    hit = [100 * r["summary"]["cache_hit_rate"] for r in done]
    axes[0].bar(xs, hit, color="tab:blue")
    if done:
        axes[0].axhline(100 * done[0]["summary"]["ideal_hit_rate"], color="gray", linestyle="--", label="ideal")
        axes[0].legend()
    axes[0].set_ylabel("KV cache hit rate (%)")
    width = 0.38
    axes[1].bar([x - width / 2 for x in xs], [r["summary"]["mean_ttft"] for r in done], width, label="mean")
    axes[1].bar([x + width / 2 for x in xs], [r["summary"]["p90_ttft"] for r in done], width, label="P90")
    axes[1].set_ylabel("TTFT (s)")
    axes[1].legend()
    axes[2].bar(xs, [r["summary"]["input_throughput"] for r in done], color="tab:green")
    axes[2].set_ylabel("input tokens/s")
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=15, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
