"""The SGLang-native `/generate` endpoint: JSON and server-sent-event responses."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvstrata.server.disagg_fields import attach_bootstrap
from kvstrata.server.protocol import ApiError, GenerateRequest, parse_generate, parse_json_body
from kvstrata.server.seq_state import SeqState
from kvstrata.server.streaming import SSE_DONE, SSEResponse, sse_event, watch_disconnect
from kvstrata.server.tokenizer_manager import ClientDisconnected, TokenizerManager

# Answered (to nobody) when the client left before its response was ready; nginx's code for it.
CLIENT_CLOSED_STATUS = 499
MIN_LOGPROB = -9999.0


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


def raise_first_error(states: list[SeqState]) -> None:
    """Raise ApiError for the first sequence that failed (pending or applied)."""
    for s in states:
        err = s.pending_error()
        if err is not None:
            raise ApiError(err[0], err[1])


def native_response(tm: TokenizerManager, req: GenerateRequest, states: list[SeqState]) -> Any:
    """The non-streaming body: one dict, or a list in request order (i*n+j)."""
    outs = [native_output(tm, req, s) for s in states]
    if not req.is_batch and len(outs) == 1:
        return outs[0]
    return outs


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
                event = native_output(tm, req, s, delta_logprobs=True)
                if multi:
                    event["index"] = s.index
                yield sse_event(event)
    yield SSE_DONE


def native_output(tm: TokenizerManager, req: GenerateRequest, s: SeqState,
                  delta_logprobs: bool = False) -> dict:
    """{text, output_ids, meta_info} of one sequence."""
    meta: dict[str, Any] = {
        "id": s.rid,
        "finish_reason": s.finish_reason if s.finished else None,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "cached_tokens": s.cached_tokens,
        "e2e_latency": round(s.e2e_latency, 6),
    }
    if s.return_logprob:
        with_text = req.return_text_in_logprobs
        if delta_logprobs:
            out_lp, out_top = s.take_logprob_delta()
        else:
            out_lp, out_top = s.output_token_logprobs, s.output_top_logprobs
        meta["input_token_logprobs"] = format_logprobs(tm, s.input_token_logprobs or [], with_text)
        meta["output_token_logprobs"] = format_logprobs(tm, out_lp, with_text)
        meta["input_top_logprobs"] = [format_top(tm, t, with_text) for t in s.input_top_logprobs or []]
        meta["output_top_logprobs"] = [format_top(tm, t, with_text) for t in out_top]
    return {"text": s.visible_text(), "output_ids": list(s.output_ids), "meta_info": meta}


def format_logprobs(tm: TokenizerManager, entries: list, with_text: bool) -> list[list]:
    """[(logprob, token_id), ...] → [[logprob, token_id, text or None], ...]."""
    return [[finite_logprob(lp), tid, tm.token_text(tid) if with_text else None] for lp, tid in entries]


def finite_logprob(lp: Optional[float]) -> Optional[float]:
    """-inf (a token masked out by top-k/top-p) as -9999.0: JSON has no infinity."""
    if lp is None or math.isfinite(lp):
        return lp
    return MIN_LOGPROB


def format_top(tm: TokenizerManager, entries: Optional[list], with_text: bool) -> Optional[list]:
    """One position's top logprobs in the same triple format (None stays None)."""
    if entries is None:
        return None
    return format_logprobs(tm, entries, with_text)
