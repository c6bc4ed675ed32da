"""POST /prefetch: a router's hint that a request for this prompt is on its way (admin-keyed).

    {"input_ids": [int, ...]} or {"text": "..."}, optionally "cache_namespace": "..."

The scheduler starts loading the prompt's cached prefix closer through the cache's public verb
(KVCacheManager.warm: an L2 -> L1 load-back, an L3 read into L2), so the copy overlaps the request's time
in the router and the queue. The answer (202) only says the hint was queued; it computes nothing.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from kvstrata.server.scheduler_client import SchedulerClient
from kvstrata.serving.errors import ApiError
from kvstrata.serving.protocol import parse_json_body
from kvstrata.web.auth import require_admin

FIELDS = {"input_ids", "text", "cache_namespace"}


def register_prefetch_api(app: FastAPI, client: SchedulerClient) -> None:
    """Add POST /prefetch to the worker's app."""

    @app.post("/prefetch")
    async def prefetch(request: Request) -> JSONResponse:
        require_admin(request, client.args.admin_api_key)
        body = parse_json_body(await request.body())
        ids, namespace = prefetch_tokens(body, client)
        client.send_prefetch(ids, namespace)
        return JSONResponse({"accepted": True, "tokens": len(ids)}, status_code=202)


def prefetch_tokens(body: dict, client: SchedulerClient) -> tuple[list[int], str | None]:
    """The token ids and cache namespace of a /prefetch body; ApiError (400) naming what is wrong."""
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(f"unknown field(s) {unknown}; give 'input_ids' or 'text'", param=unknown[0])
    if ("input_ids" in body) == ("text" in body):
        raise ApiError("give exactly one of 'input_ids' (token ids) or 'text'", param="input_ids")
    namespace = body.get("cache_namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise ApiError("'cache_namespace' must be a string", param="cache_namespace")
    if "text" in body:
        text = body["text"]
        if not isinstance(text, str) or not text:
            raise ApiError("'text' must be a non-empty string", param="text")
        if len(text) > 8 * client.context_length:         # cannot fit the context: not worth tokenizing
            raise ApiError("'text' is longer than the context can hold", param="text")
        ids = client.encode(text)
    else:
        ids = body["input_ids"]
        vocab = client.info.vocab_size
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ApiError(f"'input_ids' must be a non-empty list of token ids in [0, {vocab})", param="input_ids")
    if len(ids) > client.context_length:
        raise ApiError(f"the prompt has {len(ids)} tokens; the context holds {client.context_length}", param="input_ids")
    return ids, namespace
