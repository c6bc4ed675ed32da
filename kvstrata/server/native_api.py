"""The SGLang-native `/generate` endpoint: JSON and server-sent-event responses."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvstrata.server import frontend
from kvstrata.server.disagg_fields import attach_bootstrap
from kvstrata.server.frontend import native_output, raise_first_error
from kvstrata.server.protocol import ApiError, GenerateRequest, parse_generate, parse_json_body
from kvstrata.server.seq_state import SeqState
from kvstrata.server.streaming import SSE_DONE, SSEResponse, sse_event, watch_disconnect
from kvstrata.server.tokenizer_manager import ClientDisconnected, TokenizerManager

# Answered (to nobody) when the client left before its response was ready; nginx's code for it.
CLIENT_CLOSED_STATUS = 499


async def handle_generate(request: Request, tm: TokenizerManager) -> Response:
    """POST /generate."""
    body = parse_json_body(await request.body())
    req = parse_generate(body)
    attach_bootstrap(body, req)
    return await run_request(request, tm, req, native_response, native_stream)


async def run_request(request: Request, tm: TokenizerManager, req: GenerateRequest, respond: Any,
                      stream: Any) -> Response:
    """Submit `req`; answer with `respond(tm, req, states)` or the SSE stream of `stream(tm, req, states)`.

    A client that disconnects before the answer is ready aborts its sequences in the scheduler.
    Errors the scheduler reports before the first output (e.g. an invalid grammar) become HTTP errors,
    for streaming requests too.
    """
    await tm.tokenize(req)
    states = tm.submit(req)
    disconnected = watch_disconnect(request)
    try:
        if req.stream:
            await tm.wait_first(states, disconnected)
            raise_first_error(states)
        else:
            failed: list[SeqState] = []
            async with contextlib.aclosing(tm.updates(states, disconnected)) as updates:
                async for changed in updates:
                    failed = [s for s in changed if s.error is not None]
                    if failed:
                        break        # answer the error now; leaving the loop aborts the other sequences
            # Report the failed sequence, not the 499 "aborted" that leaving the loop gave the others.
            raise_first_error(failed or states)
    except ClientDisconnected:
        tm.release(states)
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except BaseException:
        tm.release(states)
        raise
    finally:
        disconnected.cancel()
    if req.stream:
        return SSEResponse(stream(tm, req, states), on_close=lambda: tm.release(states))
    return JSONResponse(respond(tm, req, states))


def native_response(tm: TokenizerManager, req: GenerateRequest, states: list[SeqState]) -> Any:
    """The non-streaming body: one dict, or a list in request order (i*n+j)."""
    return frontend.native_response(req, states, tm.token_text)


async def native_stream(tm: TokenizerManager, req: GenerateRequest,
                        states: list[SeqState]) -> AsyncIterator[str]:
    """SSE events: cumulative text/output_ids, meta_info every time, output logprobs as deltas."""
    multi = req.is_batch or len(states) > 1
    async with contextlib.aclosing(tm.updates(states)) as updates:
        async for changed in updates:
            for s in changed:
                if s.error is not None:
                    yield sse_event(ApiError(s.error, s.error_status).to_dict())
                    yield SSE_DONE
                    return
                event = native_output(req, s, tm.token_text, delta_logprobs=True)
                if multi:
                    event["index"] = s.index
                yield sse_event(event)
    yield SSE_DONE
