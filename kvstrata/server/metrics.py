"""Prometheus text exposition of the frontend counters and the scheduler's numeric state."""

from __future__ import annotations

import re
from typing import Any

PREFIX = "kvstrata_"


def render_prometheus(frontend: dict[str, Any], scheduler_state: dict[str, Any], model_name: str) -> str:
    """Counters from the HTTP process, gauges from the scheduler's state dict (nested dicts flattened)."""
    escaped = model_name.replace("\\", "\\\\").replace('"', '\\"')
    label = f'{{model_name="{escaped}"}}'
    lines = []
    for key, value in sorted(frontend.items()):
        name = PREFIX + _metric_name(key)
        lines += [f"# TYPE {name} counter", f"{name}{label} {_number(value)}"]
    for key, value in sorted(_flatten(scheduler_state).items()):
        name = PREFIX + "scheduler_" + _metric_name(key)
        lines += [f"# TYPE {name} gauge", f"{name}{label} {_number(value)}"]
    for name, kind, value in _sglang_aliases(scheduler_state):
        lines += [f"# TYPE {name} {kind}", f"{name}{label} {_number(value)}"]
    return "\n".join(lines) + "\n"


def _sglang_aliases(state: dict[str, Any]) -> list[tuple[str, str, float]]:
    """The scheduler numbers under SGLang's metric names, for dashboards built on them."""
    if not state:
        return []
    cap = state.get("capacity_pages") or 1
    used = (cap - state.get("free_pages", cap)) / cap
    pairs = [("sglang:num_running_reqs", "gauge", state.get("running_requests", 0)),
             ("sglang:num_queue_reqs", "gauge", state.get("waiting_requests", 0)),
             ("sglang:token_usage", "gauge", used),
             ("sglang:cache_hit_rate", "gauge", state.get("cache_hit_rate", 0.0)),
             ("sglang:prompt_tokens_total", "counter", state.get("prompt_tokens", 0)),
             ("sglang:generation_tokens_total", "counter", state.get("generated_tokens", 0)),
             ("sglang:cached_tokens_total", "counter", state.get("cached_tokens", 0)),
             ("kvstrata:engine_utilization", "gauge", state.get("engine_utilization", 0.0))]
    return pairs


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}_"))
        elif isinstance(value, (bool, int, float)):
            out[prefix + key] = float(value)
    return out


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _number(value: Any) -> str:
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)
