"""A streaming client for the SGLang-native `/generate` endpoint (or `/v1/completions`), timing TTFT and latency."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp


@dataclass
class GenerateResult:
    """What one streamed request returned."""

    ttft: Optional[float] = None
    latency: Optional[float] = None
    output_ids: list[int] = field(default_factory=list)
    meta_info: dict = field(default_factory=dict)
    error: Optional[str] = None


def generate_payload(input_ids: list[int], max_new_tokens: int) -> dict:
    """Greedy, fixed-length (ignore_eos) streaming request, as SGLang's benchmark sends."""
    return {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "stream": True,
    }


def completion_payload(input_ids: list[int], max_new_tokens: int) -> dict:
    """The same request over `/v1/completions`: a token-id prompt, the output's ids asked back
    (`return_token_ids`) so the next round re-sends exactly what the server generated, usage in the stream."""
    return {"prompt": input_ids, "max_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def _generate_event(out: GenerateResult, event: dict) -> bool:
    """Apply one `/generate` event to `out`; whether it carried output tokens."""
    out.output_ids = list(event.get("output_ids") or out.output_ids)
    out.meta_info = event.get("meta_info") or out.meta_info
    return bool(event.get("output_ids"))


def _completion_event(out: GenerateResult, event: dict) -> bool:
    """Apply one `/v1/completions` chunk to `out` (output id deltas, then the usage chunk)."""
    new_ids = [i for c in event.get("choices") or [] for i in c.get("token_ids") or []]
    out.output_ids.extend(new_ids)
    usage = event.get("usage")
    if usage:
        out.meta_info = {"prompt_tokens": usage.get("prompt_tokens"),
                         "completion_tokens": usage.get("completion_tokens"),
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
    return bool(new_ids)


API_PATHS = {"generate": "/generate", "completions": "/v1/completions"}
_APIS = {"generate": (generate_payload, _generate_event), "completions": (completion_payload, _completion_event)}


async def stream_generate(session: aiohttp.ClientSession, url: str, input_ids: list[int],
                          max_new_tokens: int, timeout_s: float,
                          headers: Optional[dict] = None, api: str = "generate") -> GenerateResult:
    """POST a streaming request (`api`: /generate, or /v1/completions at `url`) and read its server-sent
    events; never raises, errors go in `.error`.

    TTFT is the time to the first event carrying output tokens. A stream that ends without `[DONE]`,
    an error event, a non-200 answer, a timeout or a connection error all count as a failure.
    """
    make_payload, apply_event = _APIS[api]
    out = GenerateResult()
    start = time.perf_counter()
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, json=make_payload(input_ids, max_new_tokens), headers=headers,
                                timeout=timeout) as resp:
            if resp.status != 200:
                body = (await resp.text())[:300]
                out.error = f"HTTP {resp.status}: {body}"
                return out
            done = False
            async for raw in resp.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    out.error = f"error event: {err.get('message', err) if isinstance(err, dict) else err}"
                    return out
                if apply_event(out, event) and out.ttft is None:
                    out.ttft = time.perf_counter() - start
            if not done:
                out.error = "the stream ended without [DONE]"
                return out
    except asyncio.TimeoutError:   # distinct from the builtin TimeoutError before Python 3.11
        out.error = f"timed out after {timeout_s:g} s"
        return out
    except (aiohttp.ClientError, OSError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.latency = time.perf_counter() - start
    if out.ttft is None:
        out.error = "no output token in the stream"
    return out
