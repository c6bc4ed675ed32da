"""The FastAPI application: routes of the native and OpenAI APIs, API-key check, error shapes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

import kvstrata
from kvstrata.model.builtin import resolve_model_path
from kvstrata.runtime.sampling_params import SamplingParams
from kvstrata.server import native_api, openai_api
from kvstrata.server.connections import ConnectionGuard
from kvstrata.server.drain import DrainMiddleware
from kvstrata.server.expert_record_api import register_expert_record_api
from kvstrata.server.limits import BodySizeLimitMiddleware
from kvstrata.server.load_api import register_load_api
from kvstrata.server.metrics import CONTENT_TYPE
from kvstrata.server.openapi_schema import install_openapi
from kvstrata.server.prefetch_api import register_prefetch_api
from kvstrata.server.scheduler_client import SchedulerClient
from kvstrata.server.scheduler_watch import SchedulerWatch
from kvstrata.serving.errors import ApiError
from kvstrata.serving.protocol import GenerateRequest, PromptSpec, get_bool, new_rid, parse_json_body
from kvstrata.web.auth import ApiKeyMiddleware, require_admin

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 30.0


def create_app(client: SchedulerClient, scheduler: SchedulerWatch, on_scheduler_death: Callable[[], None],
               connections: Optional[ConnectionGuard] = None) -> FastAPI:
    """Build the app around a SchedulerClient; the scheduler watch calls `on_scheduler_death` once; the
    connection guard (if any) sweeps while the app runs."""
    args = client.args
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        loop = asyncio.get_running_loop()
        watchdog = loop.create_task(scheduler.watch(client, on_scheduler_death))
        sweeper = loop.create_task(connections.run()) if connections is not None else None
        print(f"kvstrata server ready at {args.url} (model {args.served_model_name}; OpenAI API at "
              f"{args.url}/v1)", flush=True)
        try:
            yield
        finally:
            watchdog.cancel()
            if sweeper is not None:
                sweeper.cancel()
            await client.close()

    app = FastAPI(title="kvstrata", version=kvstrata.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json")
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, admin_key_set=bool(args.admin_api_key))
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_bytes)
    app.add_middleware(DrainMiddleware, client=client)     # outermost: a draining server answers 503 to everything
    _add_error_handlers(app)
    install_openapi(app)
    register_load_api(app, client)
    register_prefetch_api(app, client)
    register_expert_record_api(app, client)

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health() -> Response:
        problem = client.dead_reason or scheduler.problem()
        if problem is not None:
            return _error(ApiError(problem, 503))
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        await _one_token_generation(client)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict:
        # The resolved folders (built-in and GGUF models live in the cache): SGLang's scripts load the
        # tokenizer from `model_path`.
        return {"model_path": resolve_model_path(args.model_path),
                "tokenizer_path": resolve_model_path(args.tokenizer_path or args.model_path), "is_generation": True,
                "served_model_name": args.served_model_name, "context_length": client.context_length,
                "preferred_sampling_params": None}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        state = await client.get_state()
        info = client.info
        return {**args.to_dict(), "version": kvstrata.__version__, "scheduler_pid": scheduler.pid,
                "max_total_tokens": info.max_total_tokens, "context_length": info.context_length,
                "vocab_size": info.vocab_size, "eos_token_ids": info.eos_token_ids,
                "frontend_metrics": dict(client.metrics), "internal_states": [state]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if not args.enable_metrics:
            return _error(ApiError("metrics are disabled (--no-enable-metrics)", 404))
        state = await client.get_state() if client.dead_reason is None else {}
        return Response(client.prometheus.render(state), media_type=CONTENT_TYPE)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        out = await client.flush_cache()
        if not out.success:
            return _error(ApiError(out.message or "the cache could not be flushed", 400))
        return PlainTextResponse(out.message or "Cache flushed.", status_code=200)

    # ------------------------------------------------------------------ native generation
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await native_api.handle_generate(request, client)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        require_admin(request, args.admin_api_key)
        body = parse_json_body(await request.body())
        rid = body.get("rid")
        abort_all = get_bool(body, "abort_all")
        if rid is not None and not isinstance(rid, str):
            raise ApiError("'rid' must be a string", param="rid")
        if rid is None and not abort_all:
            raise ApiError("give 'rid' or 'abort_all': true", param="rid")
        return JSONResponse({"success": True, "aborted": client.abort_request(rid, abort_all)})

    @app.post("/concate_and_append_request")
    async def concate_and_append_request(request: Request) -> Response:
        # SGLang's frontend calls this when it concatenates a program's requests; nothing to do here.
        await request.body()
        return JSONResponse({"success": True})

    # ------------------------------------------------------------------ OpenAI
    @app.get("/v1/models")
    async def models() -> dict:
        return openai_api.list_models(client, created)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        return openai_api.retrieve_model(client, created, model_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_api.handle_completion(request, client)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_api.handle_chat(request, client)

    from kvstrata.server.dashboard import register_dashboard
    register_dashboard(app, client)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(ApiError(str(exc.detail), exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error(ApiError(f"invalid request: {exc.errors()}", 400))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error while serving %s %s", request.method, request.url.path)
        return _error(ApiError(f"internal server error: {type(exc).__name__}: {exc}", 500))


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers())


async def _one_token_generation(client: SchedulerClient) -> None:
    """Generate one token end to end; raises ApiError(503) if that fails or takes too long."""
    prompt = PromptSpec(text=None, input_ids=[0], sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
                        rid="health-" + new_rid())
    states = client.submit(GenerateRequest(prompts=[prompt]))

    async def run() -> None:
        async with contextlib.aclosing(client.updates(states)) as updates:
            async for _ in updates:
                pass

    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(f"no token generated within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503) from None
    if states[0].error is not None:
        raise ApiError(f"generation failed: {states[0].error}", 503)

