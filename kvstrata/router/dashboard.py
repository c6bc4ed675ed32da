"""The router's dashboard: the same page as a worker's `/dashboard`, one row per worker plus routing decisions.

    GET /dashboard        the page (kvstrata/web/static/dashboard.html; it draws router data as rows)
    GET /dashboard/data   {"workers": [{id, url?, healthy, draining, in_flight, data | error}], "decisions": [...]}

Each worker's part is its own /dashboard/data?since=T (asked concurrently, with that worker's key), so
every worker keeps its one-sample-per-second limit however many pages watch the router. Routing decisions
are the router's counters by worker and reason. Workers are named by URL only to callers who may see URLs
(kvstrata/router/access.py); others get ids, and no error text that could name a host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from importlib import resources
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from kvstrata.router.access import worker_name
from kvstrata.router.proxy import error_response

WORKER_TIMEOUT_S = 2.0


def dashboard_routes(router: Any) -> list[Route]:
    """GET /dashboard and GET /dashboard/data of `router` (a kvstrata.router.app.Router)."""
    page = resources.files("kvstrata.web").joinpath("static/dashboard.html").read_text(encoding="utf-8")

    async def dashboard(request: Request) -> Response:
        return HTMLResponse(page)

    async def dashboard_data(request: Request) -> Response:
        since = request.query_params.get("since", "0")
        try:
            float(since)
        except ValueError:
            return error_response(f"'since' must be a number of seconds, got {since!r}", 400)
        workers = router.workers.all()
        reveal = router.reveal(request)
        parts = await asyncio.gather(*(_worker_part(router, w, since, reveal) for w in workers))
        decisions = _decisions(router.metrics, lambda url: worker_name(url, router.workers.id_of(url), reveal))
        return JSONResponse({"router": True, "workers": parts, "decisions": decisions,
                             "policy": router.args.policy})

    return [Route("/dashboard", dashboard, methods=["GET"]),
            Route("/dashboard/data", dashboard_data, methods=["GET"])]


async def _worker_part(router: Any, w: Any, since: str, reveal: bool) -> dict:
    """One worker's row: the router's view of it and the worker's own dashboard data (or why not)."""
    part: dict = {"id": w.id, "healthy": w.healthy, "stalled": w.stalled, "draining": w.draining,
                  "in_flight": w.in_flight}
    if reveal:
        part["url"] = w.url
    try:
        async with router.proxy.session.get(f"{w.url}/dashboard/data", params={"since": since},
                                            headers=router.proxy.worker_headers(w),
                                            timeout=aiohttp.ClientTimeout(total=WORKER_TIMEOUT_S)) as r:
            if r.status != 200:
                part["error"] = f"HTTP {r.status} from the worker's /dashboard/data"
            else:
                part["data"] = await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        part["error"] = f"{type(e).__name__}: {e}" if reveal else f"{type(e).__name__} from the worker"
    return part


def _decisions(metrics: Any, name: Callable[[str], str]) -> list[dict]:
    """The routing-decision counters as [{"worker" (named by `name`), "reason", "count"}]."""
    out = []
    for family in metrics.decisions.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out.append({"worker": name(sample.labels["worker"]), "reason": sample.labels["reason"],
                            "count": int(sample.value)})
    return out
