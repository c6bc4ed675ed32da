"""The SGLang-native `/generate` endpoint: JSON and server-sent-event responses."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvstrata.server.disagg_fields import attach_bootstrap
from kvstrata.server.scheduler_client import ClientDisconnected, SchedulerClient
from kvstrata.serving import frontend
from kvstrata.serving.errors import ApiError
from kvstrata.serving.frontend import native_output, raise_first_error
from kvstrata.serving.protocol import GenerateRequest, parse_generate, parse_json_body
from kvstrata.serving.seq_state import SeqState
from kvstrata.web.sse import SSE_DONE, SSEResponse, sse_event, watch_disconnect

# Answered (to nobody) when the client left before its response was ready; nginx's code for it.
CLIENT_CLOSED_STATUS = 499


async def handle_generate(request: Request, client: SchedulerClient) -> Response:
    """POST /generate."""
    body = parse_json_body(await request.body())
    req = parse_generate(body)
    attach_bootstrap(body, req)
    return await run_request(request, client, req, native_response, native_stream)


async def run_request(request: Request, client: SchedulerClient, req: GenerateRequest, respond: Any,
                      stream: Any) -> Response:
    """Submit `req`; answer with `respond(client, req, states)` or the SSE stream of `stream(client, req, states)`.

    A client that disconnects before the answer is ready aborts its sequences in the scheduler.
    Errors the scheduler reports before the first output (e.g. an invalid grammar) become HTTP errors,
    for streaming requests too.
    """
    await client.tokenize(req)
    states = client.submit(req)
    disconnected = watch_disconnect(request)
    try:
        if req.stream:
            await client.wait_first(states, disconnected)
            raise_first_error(states)
        else:
            failed: list[SeqState] = []
            async with contextlib.aclosing(client.updates(states, disconnected)) as updates:
                async for changed in updates:
                    failed = [s for s in changed if s.error is not None]
                    if failed:
                        break        # answer the error now; leaving the loop aborts the other sequences
            # Report the failed sequence, not the 499 "aborted" that leaving the loop gave the others.
            raise_first_error(failed or states)
    except ClientDisconnected:
        client.release(states)
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except BaseException:
        client.release(states)
        raise
    finally:
        disconnected.cancel()
    if req.stream:
        return SSEResponse(stream(client, req, states), on_close=lambda: client.release(states))
    return JSONResponse(respond(client, req, states))


def native_response(client: SchedulerClient, req: GenerateRequest, states: list[SeqState]) -> Any:
    """The non-streaming body: one dict, or a list in request order (i*n+j)."""
    return frontend.native_response(req, states, client.token_text)


async def native_stream(client: SchedulerClient, req: GenerateRequest,
                        states: list[SeqState]) -> AsyncIterator[str]:
    """SSE events: cumulative text/output_ids, meta_info every time, output logprobs as deltas."""
    multi = req.is_batch or len(states) > 1
    async with contextlib.aclosing(client.updates(states)) as updates:
        async for changed in updates:
            for s in changed:
                if s.error is not None:
                    yield sse_event(ApiError(s.error, s.error_status).to_dict())
                    yield SSE_DONE
                    return
                event = native_output(req, s, client.token_text, delta_logprobs=True)
                if multi:
                    event["index"] = s.index
                yield sse_event(event)
    yield SSE_DONE
