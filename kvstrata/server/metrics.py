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
    return "\n".join(lines) + "\n"


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
