"""The router's worker-admin endpoints as the launcher uses them: `/add_worker`, `/remove_worker?drain=true`."""

from __future__ import annotations

import requests

DRAIN_TIMEOUT_S = 600.0


def add_worker(router_url: str, worker_url: str, timeout_s: float = 30.0) -> str:
    """Admit `worker_url`; returns what the router answered (an already-listed worker is no error)."""
    return _call(router_url, "/add_worker", {"url": worker_url}, timeout_s)


def remove_worker(router_url: str, worker_url: str, drain: bool = True, timeout_s: float = DRAIN_TIMEOUT_S) -> str:
    """Stop routing to `worker_url`; with `drain`, returns once its in-flight requests have finished."""
    params = {"url": worker_url, "drain": "true" if drain else "false"}
    return _call(router_url, "/remove_worker", params, timeout_s)


def list_workers(router_url: str, timeout_s: float = 10.0) -> list[str]:
    """The worker URLs the router routes to."""
    r = requests.get(router_url + "/list_workers", timeout=timeout_s)
    r.raise_for_status()
    body = r.json()
    workers = body.get("urls", body.get("workers", [])) if isinstance(body, dict) else body
    return [w if isinstance(w, str) else w.get("url", "") for w in workers]


def _call(router_url: str, path: str, params: dict, timeout_s: float) -> str:
    try:
        r = requests.post(router_url + path, params=params, timeout=timeout_s)
        if r.status_code == 405:
            r = requests.get(router_url + path, params=params, timeout=timeout_s)
    except requests.RequestException as e:
        return f"router unreachable: {type(e).__name__}"
    return f"{r.status_code} {r.text.strip()[:120]}"
