"""The live dashboard of the tiers: `GET /dashboard` (one self-contained page) and `GET /dashboard/data`.

However many pages poll, the scheduler is asked for its state at most once per SAMPLE_INTERVAL_S, and
only while someone polls: every answer is read from a ring of samples that the polls themselves fill. A
sample holds counters and gauges the scheduler keeps anyway (its /server_info state without the parts that
cost it time: `get_state(full=False)` skips the idle page-accounting check and the L1 tree's metrics) and latency
percentiles measured here, in the HTTP process; rates are differences against the sample RATE_WINDOW_S
older.

    GET /dashboard/data?since=T    {"columns": [...], "rows": [[...] newer than T], "totals", "minute", ...}

The page is static (it holds no data), so it is served without the API key; /dashboard/data needs it.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from importlib import resources
from typing import Any, Optional

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse

from kvstrata.server.scheduler_client import SchedulerClient
from kvstrata.serving.errors import ApiError
from kvstrata.serving.seq_state import SeqState

SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 600            # ten minutes at one sample per second
RATE_WINDOW_S = 5.0              # hit rates and throughputs are averaged over this much time
MINUTE_S = 60.0
LATENCY_WINDOW_S = 30.0          # percentiles are over the sequences that ended this recently
MAX_LATENCY_VALUES = 50_000
COLUMNS = ("t", "running", "queued", "hit_overall", "hit_device", "hit_host", "hit_storage",
           "device_running_tokens", "device_evictable_tokens", "device_free_tokens",
           "host_used_pages", "host_free_pages", "load_back_Bps", "host_backup_Bps", "storage_backup_Bps",
           "storage_prefetch_Bps", "prompt_tps", "gen_tps", "ttft_p50", "ttft_p90", "ttft_p99",
           "itl_p50", "itl_p90", "itl_p99", "engine_util", "storage_corrupt_pages", "storage_errors",
           "copy_failed_ops")


def register_dashboard(app: FastAPI, client: SchedulerClient) -> None:
    """Add GET /dashboard and GET /dashboard/data to `app`, and hook the latency recorder into `client`."""
    page = resources.files("kvstrata.web").joinpath("static/dashboard.html").read_text(encoding="utf-8")
    latency = LatencyRecorder()
    client.sequences.release_hooks.append(latency.observe)
    history = DashboardHistory(client, latency)

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/dashboard/data")
    async def dashboard_data(request: Request) -> JSONResponse:
        since = request.query_params.get("since", "0")
        try:
            since_t = float(since)
        except ValueError:
            raise ApiError(f"'since' must be a number of seconds, got {since!r}", param="since") from None
        await history.refresh()
        return JSONResponse(history.payload(since_t))


class LatencyRecorder:
    """TTFT and inter-token gaps of the sequences that ended normally, kept for LATENCY_WINDOW_S."""

    def __init__(self) -> None:
        self.ttft: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCY_VALUES)
        self.itl: deque[tuple[float, float]] = deque(maxlen=MAX_LATENCY_VALUES)

    def observe(self, s: SeqState) -> None:
        """Record one released sequence (a release hook of the SchedulerClient's SequenceRegistry)."""
        if s.error is not None or s.finished_at is None:
            return
        now = time.monotonic()
        first = s.first_token_at if s.first_token_at is not None else s.finished_at
        self.ttft.append((now, first - s.created_at))
        self.itl.extend((now, gap) for gap in s.inter_token_s)

    def percentiles(self, now: float) -> dict[str, Optional[float]]:
        """p50/p90/p99 of TTFT and inter-token latency over the window ending at `now` (monotonic)."""
        out: dict[str, Optional[float]] = {}
        for name, values in (("ttft", self.ttft), ("itl", self.itl)):
            while values and values[0][0] < now - LATENCY_WINDOW_S:
                values.popleft()
            for q, value in zip((50, 90, 99), _quantiles([v for _, v in values])):
                out[f"{name}_p{q}"] = value
        return out


def _quantiles(values: list[float]) -> tuple[Optional[float], ...]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (None,) * 3
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[89], cuts[98]


def read_counters(state: dict) -> dict[str, Any]:
    """The numbers a sample needs from the scheduler's state dict (None where a tier is absent)."""
    tree = state.get("hicache") or state.get("radix_cache") or {}
    storage = tree.get("storage") or {}
    backend = storage.get("backend") or {}
    page = state.get("page_size", 1)
    capacity, free = state["capacity_pages"] * page, state["free_pages"] * page
    evictable = state.get("evictable_tokens", 0)
    has_host, has_storage = "hicache" in state, bool(storage)
    host_cap = tree.get("host_capacity_pages", 0)

    def host(value: Any) -> Any:
        return value if has_host else None

    def l3(value: Any) -> Any:
        return value if has_storage else None

    return {
        "running": state.get("running_requests", 0), "queued": state.get("waiting_requests", 0),
        "prompt_tokens": state.get("prompt_tokens", 0), "cached_tokens": state.get("cached_tokens", 0),
        "generated_tokens": state.get("generated_tokens", 0),
        "device_hit_tokens": state.get("device_hit_tokens", 0),
        # The scheduler counts each hit once, in the tier it came from (L3 pages pass the host, count as L3).
        "host_hit_tokens": state.get("host_hit_tokens", 0), "storage_hit_tokens": state.get("storage_hit_tokens", 0),
        "device_running_tokens": max(0, capacity - free - evictable), "device_evictable_tokens": evictable,
        "device_free_tokens": free,
        "host_used_pages": host(tree.get("host_used_pages")),
        "host_free_pages": host(host_cap - tree.get("host_used_pages", 0)),
        "load_back_bytes": host(tree.get("load_back_bytes", 0)), "host_backup_bytes": host(tree.get("backup_bytes", 0)),
        "storage_backup_bytes": l3(storage.get("backup_bytes", 0)),
        "storage_prefetch_bytes": l3(storage.get("prefetch_bytes", 0)),
        "storage_corrupt_pages": l3(backend.get("corrupt", 0)), "storage_errors": l3(backend.get("errors", 0)),
        "copy_failed_ops": host(tree.get("failed_ops", 0)),
        "engine_util": state.get("engine_utilization"),
        "tiers": ["device"] + (["host"] if has_host else []) + (["storage"] if has_storage else []),
        "kv_cache": state.get("kv_cache"),   # the KV dtype and each tier's capacity in tokens
    }


_GAUGES = ("running", "queued", "device_running_tokens", "device_evictable_tokens", "device_free_tokens",
           "host_used_pages", "host_free_pages", "engine_util", "storage_corrupt_pages", "storage_errors",
           "copy_failed_ops")
_RATES = (("load_back_Bps", "load_back_bytes"), ("host_backup_Bps", "host_backup_bytes"),
          ("storage_backup_Bps", "storage_backup_bytes"), ("storage_prefetch_Bps", "storage_prefetch_bytes"),
          ("prompt_tps", "prompt_tokens"), ("gen_tps", "generated_tokens"))
_HITS = (("hit_device", "device_hit_tokens"), ("hit_host", "host_hit_tokens"),
         ("hit_storage", "storage_hit_tokens"))


class DashboardHistory:
    """The ring of samples behind /dashboard/data, filled at most once per SAMPLE_INTERVAL_S."""

    def __init__(self, client: Optional[SchedulerClient], latency: LatencyRecorder):
        self.client = client
        self.latency = latency
        self.samples: deque[tuple[float, dict, list]] = deque(maxlen=HISTORY_SAMPLES)   # (t, counters, row)
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        """Take a sample from the scheduler unless the newest is younger than the sample interval."""
        async with self._lock:
            if self.samples and time.time() - self.samples[-1][0] < 0.95 * SAMPLE_INTERVAL_S:
                return
            self.add(await self.client.get_state(full=False), time.time())

    def add(self, state: dict, now: float) -> None:
        """Append the sample of `state` taken at `now` (unix seconds)."""
        now = round(now, 3)          # the time the page sees, and sends back as `since`
        counters = read_counters(state)
        older = self._at_or_before(now - RATE_WINDOW_S)
        row = {"t": now, **{k: counters[k] for k in _GAUGES},
               **self.latency.percentiles(time.monotonic())}
        row.update(_rates(older, counters, now))
        self.samples.append((now, counters, [row["t"]] + [_compact(row.get(c)) for c in COLUMNS[1:]]))

    def payload(self, since: float) -> dict:
        """The answer of /dashboard/data: rows newer than `since`, current totals, this minute's sources."""
        if not self.samples:
            return {"columns": list(COLUMNS), "rows": [], "interval_s": SAMPLE_INTERVAL_S}
        now, counters, _ = self.samples[-1]
        model = self.client.args.served_model_name if self.client is not None else ""
        return {"columns": list(COLUMNS), "rows": [row for t, _, row in self.samples if t > since],
                "interval_s": SAMPLE_INTERVAL_S, "model": model, "tiers": counters["tiers"],
                "kv_cache": counters["kv_cache"],
                "totals": {k: counters[k] for k in ("prompt_tokens", "cached_tokens", "device_hit_tokens",
                                                     "host_hit_tokens", "storage_hit_tokens", "generated_tokens")},
                "minute": self._minute(now, counters)}

    def _minute(self, now: float, counters: dict) -> dict:
        """Prompt tokens of the last minute (or since the first sample) by the tier that served them."""
        t0, base, _ = self._at_or_before(now - MINUTE_S)
        out = {tier: counters[f"{tier}_hit_tokens"] - base[f"{tier}_hit_tokens"]
               for tier in ("device", "host", "storage")}
        cached = counters["cached_tokens"] - base["cached_tokens"]
        out["computed"] = counters["prompt_tokens"] - base["prompt_tokens"] - cached
        out["span_s"] = round(now - t0, 1)
        return out

    def _at_or_before(self, t: float) -> Optional[tuple[float, dict, list]]:
        """The newest sample taken at or before `t`, else the oldest one (None when there is none)."""
        found = None
        for sample in self.samples:
            if sample[0] > t:
                break
            found = sample
        return found or (self.samples[0] if self.samples else None)


def _rates(older: Optional[tuple[float, dict, list]], counters: dict, now: float) -> dict[str, Optional[float]]:
    """Hit rates per tier and throughputs between the `older` sample and `counters` (None without data)."""
    out: dict[str, Optional[float]] = {}
    if older is None or now <= older[0]:
        return out
    base, dt = older[1], now - older[0]
    for name, key in _RATES:
        if counters[key] is not None and base[key] is not None:
            out[name] = (counters[key] - base[key]) / dt
    prompt = counters["prompt_tokens"] - base["prompt_tokens"]
    if prompt > 0:
        out.update({name: (counters[key] - base[key]) / prompt for name, key in _HITS})
        out["hit_overall"] = (counters["cached_tokens"] - base["cached_tokens"]) / prompt
    return out


def _compact(value: Any) -> Any:
    """Numbers with four significant digits, so that the JSON stays small."""
    return float(f"{value:.4g}") if isinstance(value, float) else value
