"""Background upkeep: health checks (out after N failures, back after M passes), load polls, tree eviction.

Each loop runs in the router's event loop; a check never blocks another (they run concurrently, each with
its own timeout).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvstrata.router.args import RouterArgs
from kvstrata.router.proxy import Proxy, mark_down
from kvstrata.router.workers import Worker, WorkerLoad, WorkerRegistry

logger = logging.getLogger(__name__)


class WorkerMonitor:
    """Runs the health, load and eviction loops until stopped."""

    def __init__(self, args: RouterArgs, workers: WorkerRegistry, proxy: Proxy):
        self.args = args
        self.workers = workers
        self.proxy = proxy
        self._tasks: list[asyncio.Task] = []
        self._no_load_api: set[str] = set()

    def start(self) -> None:
        """Start the loops (inside the event loop)."""
        self.proxy.on_worker_failure = self.recheck
        a = self.args
        self._tasks = [asyncio.ensure_future(_every(a.health_check_interval_secs, self.check_all)),
                       asyncio.ensure_future(_every(a.worker_load_check_interval, self.poll_loads)),
                       asyncio.ensure_future(_every(a.eviction_interval_secs, self.evict_trees, wait_first=True))]

    async def stop(self) -> None:
        """Cancel the loops and wait for them."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ health
    async def check_all(self) -> None:
        """One health check of every worker."""
        await asyncio.gather(*(self.check(w) for w in self.workers.all()))

    def recheck(self, w: Worker) -> None:
        """Check `w` now (a request to it just failed)."""
        asyncio.ensure_future(self.check(w))

    async def check(self, w: Worker) -> bool:
        """GET /health once and apply the failure/success thresholds; returns whether it passed."""
        try:
            passed = await self._get_ok(w, "/health", self.args.health_check_timeout_secs)
        except aiohttp.ClientConnectorError as e:
            mark_down(w, e)
            return False
        if passed:
            w.success_streak, w.failure_streak = w.success_streak + 1, 0
            if w.stalled and w.url in self._no_load_api:
                w.progress()      # no /load report to wait for: its health check is the only sign of life
            # A new worker is admitted on its first pass; one that was taken out must pass M in a row.
            if not w.healthy and (not w.admitted_before or w.success_streak >= self.args.health_success_threshold):
                logger.info("worker %s is healthy: admitted", w.url)
                w.healthy = w.admitted_before = True
        else:
            w.failure_streak, w.success_streak = w.failure_streak + 1, 0
            if w.healthy and w.failure_streak >= self.args.health_failure_threshold:
                logger.warning("worker %s failed %d health checks: taken out", w.url, w.failure_streak)
                w.healthy = False
        return passed

    async def _get_ok(self, w: Worker, path: str, timeout_s: float) -> bool:
        assert self.proxy.session is not None
        try:
            async with self.proxy.session.get(w.url + path, headers=self.proxy.worker_headers(w),
                                              timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return resp.status == 200
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    # ------------------------------------------------------------------ load
    async def poll_loads(self) -> None:
        """GET /load from every healthy worker that has it (a stalled one too: an answer brings it back)."""
        await asyncio.gather(*(self.poll_load(w) for w in self.workers.all()
                               if w.healthy and w.url not in self._no_load_api))

    async def poll_load(self, w: Worker) -> None:
        """Refresh w.load from its /load report (a worker without /load is not asked again)."""
        assert self.proxy.session is not None
        try:
            async with self.proxy.session.get(w.url + "/load", headers=self.proxy.worker_headers(w),
                                              timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                if resp.status == 404:
                    self._no_load_api.add(w.url)
                    return
                if resp.status == 200:
                    w.load = WorkerLoad.from_json(await resp.json())
                    w.progress()      # its scheduler answered: not stalled
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            logger.debug("load poll of %s failed: %s", w.url, e)

    # ------------------------------------------------------------------ trees
    async def evict_trees(self) -> None:
        """Bound every approximate prefix tree to --max-tree-size (LRU)."""
        for w in self.workers.all():
            for tree in (w.token_tree, w.text_tree):
                tree.evict(self.args.max_tree_size)


async def _every(interval_s: float, fn, wait_first: bool = False) -> None:
    if wait_first:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await fn()
        except Exception:   # a bug in one round must not stop the monitor
            logger.exception("router background task %s failed", getattr(fn, "__name__", fn))
        await asyncio.sleep(interval_s)
