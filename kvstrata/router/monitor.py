"""Background upkeep: health checks (out after N failures, back after M passes), load polls, tree eviction.

Each loop runs in the router's event loop; a check never blocks another (they run concurrently, each with
its own timeout).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import aiohttp

from kvstrata.router.args import RouterArgs
from kvstrata.router.kv_subscriber import KVFeeds, source_from_config
from kvstrata.router.proxy import Proxy, mark_down
from kvstrata.router.workers import Worker, WorkerLoad, WorkerRegistry

logger = logging.getLogger(__name__)


class WorkerMonitor:
    """Runs the health, load and eviction loops until stopped."""

    def __init__(self, args: RouterArgs, workers: WorkerRegistry, proxy: Proxy, feeds: Optional[KVFeeds] = None):
        self.args = args
        self.feeds = feeds          # KV event subscriptions (None: --no-kv-events or not tier_aware)
        self.workers = workers
        self.proxy = proxy
        self._tasks: list[asyncio.Task] = []
        self._no_load_api: set[str] = set()
        self._weights: dict[str, tuple] = {}
        self._resubscribing: set[asyncio.Future] = set()      # KV event resubscriptions in flight

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
                if w.admitted_before and self.feeds is not None and w.url in self.feeds.subscribers:
                    # It may have restarted, and a new process publishes nothing until its cache changes:
                    # its old blocks must not route anything. Forget them now, and resync from a fresh dump.
                    self.feeds.index.reset(w.url, in_sync=False)
                    task = asyncio.ensure_future(asyncio.to_thread(self.feeds.resubscribe, w.url))
                    self._resubscribing.add(task)             # the loop keeps only a weak reference
                    task.add_done_callback(self._resubscribing.discard)
                w.healthy = w.admitted_before = True
            if self.feeds is not None and w.url not in self.feeds.probed:
                await self.discover_events(w)
        else:
            w.failure_streak, w.success_streak = w.failure_streak + 1, 0
            if w.healthy and w.failure_streak >= self.args.health_failure_threshold:
                logger.warning("worker %s failed %d health checks: taken out", w.url, w.failure_streak)
                w.healthy = False
        return passed

    async def discover_events(self, w: Worker) -> None:
        """Read w's /server_info once: if it publishes KV events, subscribe (kv_subscriber.py)."""
        assert self.proxy.session is not None and self.feeds is not None
        try:
            async with self.proxy.session.get(w.url + "/server_info", headers=self.proxy.worker_headers(w),
                                              timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
                if resp.status != 200:
                    return
                info = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            logger.debug("server_info of %s: %s", w.url, e)
            return
        self.feeds.probed.add(w.url)
        source = source_from_config(info.get("kv_events_config") if isinstance(info, dict) else None, w.url)
        if source is not None:
            self.feeds.start(w.url, source)

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
                    self._print_weights(w)
                    if self.feeds is not None:
                        self.feeds.index.set_storage(w.url, w.load.storage_id)
                    w.progress()      # its scheduler answered: not stalled
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            logger.debug("load poll of %s failed: %s", w.url, e)

    def _print_weights(self, w: Worker) -> None:
        """Log a worker's tier_aware weights when they change (measured from its /load rates)."""
        weights = w.tier_weights(self.args.tier_host_weight, self.args.tier_storage_weight)
        old = self._weights.get(w.url)
        if old is None or any(abs(a - b) > 0.25 * max(a, b) for a, b in zip(old, weights)):   # moved by > 25%
            self._weights[w.url] = weights
            logger.info("tier_aware weights of %s: L2 load-back %.3f, L3 read %.3f per token, relative to "
                        "computing one (%.2e s/token measured; a weight not measured yet is the flag's value)",
                        w.id, *weights, w.load.compute_s_per_token)

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
