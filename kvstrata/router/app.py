"""The router's HTTP app: the worker API proxied, plus worker management and /metrics.

Who may call what is kvstrata/router/access.py; the control routes check it before reading anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvstrata.args import ConfigError
from kvstrata.router.access import CONTROL_PATHS, check_control, reveals_workers
from kvstrata.router.args import RouterArgs, check_worker_url
from kvstrata.router.dashboard import dashboard_routes
from kvstrata.router.kv_index import KVIndex
from kvstrata.router.kv_subscriber import KVFeeds
from kvstrata.router.metrics import CONTENT_TYPE, RouterMetrics
from kvstrata.router.monitor import WorkerMonitor
from kvstrata.router.pd import PDRouter, pd_worker_urls
from kvstrata.router.policies import make_policy
from kvstrata.router.proxy import Proxy, error_response
from kvstrata.router.workers import WorkerRegistry
from kvstrata.serving.errors import ApiError
from kvstrata.web.auth import ApiKeyMiddleware

logger = logging.getLogger(__name__)

ROUTED = ["/generate", "/v1/completions", "/v1/chat/completions"]           # by the policy
PASSED = ["/v1/models", "/v1/models/{model_id:path}", "/get_model_info", "/model_info", "/get_server_info",
          "/server_info", "/health_generate"]                               # to the least loaded worker
BROADCAST = ["/flush_cache", "/abort_request"]                              # to every healthy worker
Handler = Callable[[Request], Awaitable[Response]]


class Router:
    """The router's parts: worker registry, policy, proxy, metrics, monitor."""

    def __init__(self, args: RouterArgs):
        self.args = args
        self.workers = WorkerRegistry()
        self.metrics = RouterMetrics(self.workers)
        # KV events: an exact index of what every worker holds (tier_aware only)
        self.feeds = KVFeeds(KVIndex()) if args.policy == "tier_aware" and args.kv_events else None
        self.proxy = Proxy(args, self.workers, make_policy(args, self.feeds.index if self.feeds else None), self.metrics)
        self.monitor = WorkerMonitor(args, self.workers, self.proxy, self.feeds)
        if self.feeds is not None:
            self.metrics.watch_index(self.feeds)
        self.pd = PDRouter(args, self.workers, self.proxy) if args.pd_disaggregation else None
        # Workers the operator named at start: they get --api-key (also when re-added after a drain).
        self.configured = {check_worker_url(u) for u in (*args.worker_urls, *pd_worker_urls(args))}

    async def start(self) -> None:
        """Open connections, check the configured workers once, start the background loops."""
        await self.proxy.start()
        for url in (*self.args.worker_urls, *pd_worker_urls(self.args)):
            self.workers.add(check_worker_url(url), self.args.api_key)
        await self.monitor.check_all()
        await self.monitor.poll_loads()
        self.monitor.start()
        logger.info("router ready at %s (policy %s; workers %s)", self.args.url, self.args.policy,
                    [w.url for w in self.workers.all()])

    async def stop(self) -> None:
        """Stop the loops and close connections."""
        await self.monitor.stop()
        if self.feeds is not None:
            self.feeds.close()
        await self.proxy.close()

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: Request) -> Response:
        """200 while at least one worker can take requests."""
        if self.workers.routable():
            return Response(status_code=200)
        return error_response("no healthy worker", 503)

    def reveal(self, request: Request) -> bool:
        """Whether this caller may see worker URLs (see access.py)."""
        return reveals_workers(request, self.args.admin_api_key)

    def control(self, handler: Handler) -> Handler:
        """`handler` behind the control-route check, which runs before the request is read."""
        async def guarded(request: Request) -> Response:
            try:
                check_control(request, self.args.admin_api_key)
            except ApiError as e:
                return error_response(e.message, e.status)
            return await handler(request)
        return guarded

    async def add_worker(self, request: Request) -> Response:
        """POST /add_worker?url=... or {"url": ..., "api_key": ...}: register the worker, check it at once.

        The worker receives only the key given here; a worker named at start (--worker-urls, --prefill,
        --decode) gets --api-key when none is given."""
        try:
            url, api_key = await _worker_spec(request)
        except ApiError as e:
            return error_response(e.message, e.status)
        if api_key is None and url in self.configured:
            api_key = self.args.api_key
        worker, is_new = self.workers.add(url, api_key)
        await self.monitor.check(worker)
        return JSONResponse({"success": True, "url": url, "id": worker.id, "added": is_new,
                             "healthy": worker.healthy})

    async def remove_worker(self, request: Request) -> Response:
        """POST /remove_worker?url=...[&drain=true]: with drain, stop sending to it and wait for its requests."""
        url = request.query_params.get("url", "").rstrip("/")
        drain = request.query_params.get("drain", "false").lower() in ("1", "true", "yes")
        worker = self.workers.get(url)
        if worker is None:
            return error_response(f"no worker {url!r} (see /list_workers)", 404)
        if drain:
            worker.draining = True
            logger.info("draining %s (%d in flight)", url, worker.in_flight)
            await worker.idle.wait()
        if self.workers.get(url) is worker and worker.draining == drain:
            self.workers.remove(url)
            if self.feeds is not None:
                self.feeds.stop(url)
        return JSONResponse({"success": True, "url": url, "drained": drain})

    async def list_workers(self, request: Request) -> Response:
        """The workers and their state."""
        workers = self.workers.all()
        return JSONResponse({"urls": [w.url for w in workers], "workers": [w.summary() for w in workers],
                             "active_requests": self.proxy.active})

    async def prometheus(self, request: Request) -> Response:
        """Prometheus text; workers are labelled by URL only for callers who may see URLs."""
        return Response(self.metrics.render(reveal_urls=self.reveal(request)), media_type=CONTENT_TYPE)


async def _worker_spec(request: Request) -> tuple[str, Optional[str]]:
    """(url, api_key) of an /add_worker request: `?url=` or a JSON body {"url", "api_key"}."""
    raw = await request.body()
    spec: dict = {}
    if raw:
        try:
            spec = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            spec = None
        if not isinstance(spec, dict):
            raise ApiError('the body must be a JSON object {"url": ..., "api_key": ...}', 400)
    url = spec.get("url", request.query_params.get("url", ""))
    api_key = spec.get("api_key")
    if not isinstance(url, str) or not (api_key is None or isinstance(api_key, str) and api_key):
        raise ApiError("'url' must be a string and 'api_key' a non-empty string", 400)
    try:
        return check_worker_url(url), api_key
    except ConfigError as e:
        raise ApiError(str(e), 400) from None


def create_app(args: RouterArgs) -> Starlette:
    """The Starlette app of a router with `args`."""
    router = Router(args)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    async def routed(request: Request) -> Response:
        if router.pd is not None:
            return await router.pd.route(request, reveal=router.reveal(request))
        return await router.proxy.route(request, affinity=True, reveal=router.reveal(request))

    async def passed(request: Request) -> Response:
        return await router.proxy.route(request, affinity=False, reveal=router.reveal(request))

    control = router.control
    routes = [Route(p, routed, methods=["POST"]) for p in ROUTED]
    routes += [Route(p, passed, methods=["GET"]) for p in PASSED]
    routes += [Route(p, control(router.proxy.broadcast), methods=["POST"]) for p in BROADCAST]
    routes += [Route("/health", router.health, methods=["GET"]),
               Route("/add_worker", control(router.add_worker), methods=["POST"]),
               Route("/remove_worker", control(router.remove_worker), methods=["POST"]),
               Route("/list_workers", control(router.list_workers), methods=["GET"]),
               Route("/metrics", router.prometheus, methods=["GET"])]
    routes += dashboard_routes(router)
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.router = router
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, admin_key_set=bool(args.admin_api_key),
                           admin_paths=CONTROL_PATHS)
    return app
