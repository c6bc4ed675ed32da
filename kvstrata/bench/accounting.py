"""What a multi-turn run measured: per-request records, the ideal hit rate, percentiles, summaries.

Definitions (kept here, in one place, because the report and the tests depend on them):

- cache hit rate = Σ cached_tokens / Σ prompt_tokens over the requests that completed (as SGLang).
- ideal cached tokens of a request = what an infinite prefix cache could have served: the longest prefix
  its prompt shares with the KV of any request that *finished before it was sent* — that request's prompt
  and its output except the last token (the model never runs the last sampled token, so it has no KV) —
  capped at prompt length - 1 (the server computes at least one token to get logits) and rounded down to
  whole pages. For the multi-turn workload this is, for each round, the previous round's prompt and output.
- duration = last finish - first send, minus barrier pauses (with a round barrier: from the last finish of
  round r-1 to the first send of round r, when nothing of the workload is in flight because of the barrier).
  Throughputs divide by it.
- percentiles interpolate linearly between order statistics (numpy's default).
- engine busy = the server's seconds in forward passes (`forward_busy_s`) during the run / wall-clock
  seconds between the /server_info snapshots taken before and after it (NaN if the server lacks the counter).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class RequestRecord:
    """One request of the run: what was sent, what came back, when."""

    client: int
    round: int
    prompt_ids: list[int]
    send_time: float = 0.0                 # seconds since the run started
    finish_time: float = 0.0
    ttft: Optional[float] = None           # to the first chunk carrying output tokens
    latency: Optional[float] = None
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0                 # as reported by the server (meta_info)
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None
    ideal_cached_tokens: int = 0           # filled by ideal_cached_tokens()

    @property
    def ok(self) -> bool:
        """Whether the request completed."""
        return self.error is None


class PrefixIndex:
    """Every prefix of the sequences inserted so far, by a hash chain: answers longest-shared-prefix queries.

    Only prefixes not already present are stored, so memory is the size of the prefix tree, not the sum of
    the sequences. Membership is monotone (a present prefix has all its shorter prefixes present), which
    lets a query binary-search its length.
    """

    def __init__(self) -> None:
        self._prefixes: set[int] = set()

    @staticmethod
    def _chain(ids: Sequence[int]) -> list[int]:
        h, out = 0, []
        for token in ids:
            h = hash((h, token))
            out.append(h)
        return out

    def _longest(self, chain: list[int]) -> int:
        lo, hi = 0, len(chain)                  # invariant: prefix of length lo is present
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in self._prefixes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def longest_prefix(self, ids: Sequence[int]) -> int:
        """Length of the longest prefix of `ids` that is a prefix of an inserted sequence."""
        return self._longest(self._chain(ids))

    def insert(self, ids: Sequence[int]) -> None:
        """Add `ids` and all its prefixes."""
        chain = self._chain(ids)
        self._prefixes.update(chain[self._longest(chain):])


def ideal_cached_tokens(records: Sequence[RequestRecord], page_size: int = 1) -> list[int]:
    """Tokens an infinite cache could have served to each record (see the module docstring); also stored."""
    page_size = max(1, page_size)
    done = sorted((r for r in records if r.ok), key=lambda r: r.finish_time)
    index, j = PrefixIndex(), 0
    for rec in sorted(records, key=lambda r: r.send_time):
        while j < len(done) and done[j].finish_time <= rec.send_time:
            index.insert(done[j].prompt_ids + done[j].output_ids[:-1])
            j += 1
        hit = min(index.longest_prefix(rec.prompt_ids), len(rec.prompt_ids) - 1)
        rec.ideal_cached_tokens = max(0, hit - hit % page_size)
    return [r.ideal_cached_tokens for r in records]


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float]) -> float:
    """Arithmetic mean; NaN for no values."""
    xs = list(values)
    return sum(xs) / len(xs) if xs else math.nan


def barrier_pauses(records: Sequence[RequestRecord]) -> float:
    """Seconds between rounds when round r-1 had finished and round r had not started yet."""
    rounds = sorted({r.round for r in records})
    total = 0.0
    for prev, cur in zip(rounds, rounds[1:]):
        last_finish = max(r.finish_time for r in records if r.round == prev)
        first_send = min(r.send_time for r in records if r.round == cur)
        total += max(0.0, first_send - last_finish)
    return total


def active_duration(records: Sequence[RequestRecord], round_barrier: bool) -> tuple[float, float]:
    """(duration, barrier pause) in seconds: first send to last finish, less the barrier pauses."""
    if not records:
        return 0.0, 0.0
    wall = max(r.finish_time for r in records) - min(r.send_time for r in records)
    pause = barrier_pauses(records) if round_barrier else 0.0
    return max(0.0, wall - pause), pause


def summarize(records: Sequence[RequestRecord], round_barrier: bool, skipped: int = 0) -> dict[str, Any]:
    """Totals, rates, TTFT and latency statistics of a run (ideal_cached_tokens must be filled)."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ideal = sum(r.ideal_cached_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    duration, pause = active_duration(records, round_barrier)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    latencies = [r.latency for r in ok if r.latency is not None]
    hit_rate = cached / prompt if prompt else 0.0
    ideal_rate = ideal / prompt if prompt else 0.0
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "skipped": skipped,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "ideal_cached_tokens": ideal,
        "cache_hit_rate": hit_rate,
        "ideal_hit_rate": ideal_rate,
        "hit_rate_vs_ideal": hit_rate / ideal_rate if ideal_rate else math.nan,
        "mean_ttft": mean(ttfts),
        "p50_ttft": percentile(ttfts, 50),
        "p90_ttft": percentile(ttfts, 90),
        "p99_ttft": percentile(ttfts, 99),
        "mean_latency": mean(latencies),
        "p90_latency": percentile(latencies, 90),
        "duration_s": duration,
        "barrier_pause_s": pause,
        "input_throughput": prompt / duration if duration > 0 else 0.0,
        "output_throughput": output / duration if duration > 0 else 0.0,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
    }


def engine_busy(before: Optional[dict], after: Optional[dict], wall_s: float) -> float:
    """Share of `wall_s` the server spent in forward passes between two /server_info answers."""
    def busy(info: Optional[dict]) -> Optional[float]:
        value = ((info or {}).get("internal_states") or [{}])[0].get("forward_busy_s")
        return value if isinstance(value, (int, float)) else None

    b0, b1 = busy(before), busy(after)
    if b0 is None or b1 is None or wall_s <= 0:
        return math.nan
    return (b1 - b0) / wall_s


def per_round(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """One row per round: requests, failures, hit rate, ideal hit rate, TTFT mean/P90."""
    rows = []
    for rnd in sorted({r.round for r in records}):
        recs = [r for r in records if r.round == rnd]
        ok = [r for r in recs if r.ok]
        prompt = sum(r.prompt_tokens for r in ok)
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        rows.append({
            "round": rnd,
            "requests": len(recs),
            "failed": len(recs) - len(ok),
            "prompt_tokens": prompt,
            "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
            "ideal_hit_rate": sum(r.ideal_cached_tokens for r in ok) / prompt if prompt else 0.0,
            "mean_ttft": mean(ttfts),
            "p90_ttft": percentile(ttfts, 90),
        })
    return rows


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict with dotted keys."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}{key}."))
    elif prefix:
        out[prefix[:-1]] = obj
    return out


# Leaf names of the scheduler metrics that say which tier served what (SGLang-style and ours).
_TIER_METRIC = re.compile(r"^l[123]_|hit_tokens$|hit_rate$|^tokens_hit$|^prefetched_tokens$|^load_back_pages$"
                          r"|backup_pages$|skipped")


def tier_metrics(before: Optional[dict], after: Optional[dict]) -> dict[str, Any]:
    """Per-tier hit metrics of the scheduler over the run: counters as deltas, rates as read after.

    `before`/`after` are /server_info answers. Only keys that exist are reported (a tier the server lacks
    reports nothing rather than zeros); a metric exported twice under different parents is shown once.
    """
    if not after:
        return {}
    state_after = flatten((after.get("internal_states") or [{}])[0])
    state_before = flatten(((before or {}).get("internal_states") or [{}])[0])
    out: dict[str, Any] = {}
    seen: set[tuple[str, Any]] = set()
    for key in sorted(state_after, key=lambda k: (k.count("."), k)):
        value, leaf = state_after[key], key.rsplit(".", 1)[-1].lower()
        if not _TIER_METRIC.search(leaf) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        old = state_before.get(key)
        if isinstance(value, int) and isinstance(old, int) and "rate" not in leaf:
            value = value - old
        if (leaf, value) not in seen:
            seen.add((leaf, value))
            out[key] = value
    return out


# Where /server_info's scheduler state keeps what `cache_report` reads (dotted paths into internal_states[0]).
_REPORT_COUNTERS = {
    "l1_hit_tokens": "device_hit_tokens", "l2_hit_tokens": "host_hit_tokens", "l3_hit_tokens": "storage_hit_tokens",
    "load_back_bytes": "hicache.load_back_bytes", "l3_read_bytes": "hicache.storage.prefetch_bytes",
    "l3_objects_written": "hicache.storage.backed_up_objects", "l3_bytes_written": "hicache.storage.backup_bytes",
    "scheduler_cpu_s": "scheduler_cpu_s", "steps": "step", "empty_steps": "empty_steps",
    "empty_step_cpu_s": "empty_step_cpu_s",
}


def cache_report(before: Optional[dict], after: Optional[dict]) -> dict[str, Any]:
    """What a run did in each tier, from two /server_info answers (counters as deltas; absent: not reported).

    - l1/l2/l3_hit_tokens: prompt tokens served from the device pool, loaded back from host memory, fetched
      from storage (they add up to the cached tokens);
    - load_back_bytes (L2 -> device), l3_read_bytes (L3 -> host);
    - l3_objects / l3_bytes: objects and bytes written to L3 during the run (each run starts on an empty L3,
      so this is what it holds, less anything its capacity limit evicted);
    - scheduler_cpu_ms_per_step: the scheduler thread's CPU time outside the forward, per step that ran one;
    - empty_steps, empty_step_cpu_s: steps with nothing to run (waiting on a prefetch, a grammar or room) and
      the CPU time they took.
    """
    a = flatten(((after or {}).get("internal_states") or [{}])[0])
    b = flatten(((before or {}).get("internal_states") or [{}])[0])
    out: dict[str, Any] = {}
    for name, key in _REPORT_COUNTERS.items():
        if isinstance(a.get(key), (int, float)) and isinstance(b.get(key), (int, float)):
            out[name] = a[key] - b[key]
    if "l3_objects_written" in out:
        out["l3_objects"] = out.pop("l3_objects_written")
        out["l3_bytes"] = out.pop("l3_bytes_written", 0)
    if "scheduler_cpu_s" in out and out.get("steps"):
        out["scheduler_cpu_ms_per_step"] = 1000 * out.pop("scheduler_cpu_s") / out["steps"]
    out["integrity_ok"] = ((after or {}).get("internal_states") or [{}])[0].get("integrity_ok")
    return out
