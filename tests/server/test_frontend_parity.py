"""HTTP and the offline Engine share one frontend: the same edge cases give the same results and errors.

Every case is a POST /generate body, sent with `requests` to a real server and passed (as keyword
arguments, `text` as `prompt`) to `kvstrata.Engine` with the same model, context (64 tokens), seed and
float32 batch-invariant inference. Results must be equal but for `id` and `e2e_latency`; a 400's
message must be the text of the Engine's InvalidRequest. The radix cache is off on both sides:
`cached_tokens` depends on arrival timing, which the two transports do not share (the cache has its own tests).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import requests

from kvstrata.runtime.sampling_params import InvalidRequest
from tests.runtime.helpers import make_engine
from tests.server.conftest import launch_server, stop_server
from tests.server.helpers import sse_events

CONTEXT = 64
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
STOP_PROMPT = "Hello"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    handle = launch_server(tmp_path_factory.mktemp("parity"), "--context-length", str(CONTEXT), "--dtype",
                           "float32", "--disable-radix-cache")
    try:
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture(scope="module")
def engine():
    eng = make_engine(context_length=CONTEXT, disable_radix_cache=True)
    try:
        yield eng
    finally:
        eng.shutdown()


def via_http(server: Any, body: dict) -> Any:
    r = requests.post(server.url + "/generate", json=body, timeout=120)
    if r.status_code == 400:
        return {"error": r.json()["error"]["message"]}
    assert r.status_code == 200, r.text
    return r.json()


def via_engine(engine: Any, body: dict) -> Any:
    kwargs = {("prompt" if key == "text" else key): value for key, value in body.items()}
    try:
        return engine.generate(**kwargs)
    except InvalidRequest as e:
        return {"error": str(e)}


def comparable(result: Any) -> Any:
    """The result without what differs by nature: request ids and latencies."""
    if isinstance(result, list):
        return [comparable(r) for r in result]
    if "meta_info" in result:
        meta = {k: v for k, v in result["meta_info"].items() if k not in ("id", "e2e_latency")}
        return {**result, "meta_info": meta}
    return result


def both(server: Any, engine: Any, body: dict) -> Any:
    """The HTTP result, after asserting that the Engine's equals it."""
    http = via_http(server, body)
    assert comparable(via_engine(engine, body)) == comparable(http), body
    return http


@pytest.fixture(scope="module")
def stop_cases(engine) -> dict:
    """Stop strings taken from a greedy reference output, so that each one really fires."""
    ref = engine.generate(STOP_PROMPT, {**GREEDY, "max_new_tokens": 16})
    ids, text = ref["output_ids"], ref["text"]
    first = engine.tokenizer.decode(ids[:1])
    for k in range(1, len(ids)):
        b = len(engine.tokenizer.decode(ids[:k]))
        span = text[b - 1:b + 1]
        if len(span) == 2 and span.isprintable() and " " not in span and text.find(span) == b - 1:
            return {"text": text, "first": first, "span": span, "span_at": b - 1, "ids": ids}
    raise AssertionError(f"no stop string spans two tokens of {text!r}")


CASES = {
    "greedy-text": {"text": "The quick brown fox", "sampling_params": GREEDY},
    "input-ids": {"input_ids": [5, 6, 7, 8, 9], "sampling_params": GREEDY},
    "batch": {"text": ["kv", "Once upon a time", "Hello"],
              "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 3}, {**GREEDY, "n": 2}]},
    "batch-input-ids": {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": GREEDY},
    "n-greedy": {"text": "kv", "sampling_params": {**GREEDY, "n": 3}},
    "n-seeded": {"text": "Hello", "sampling_params": {"n": 3, "temperature": 1.0, "sampling_seed": 7,
                                                      "max_new_tokens": 6, "ignore_eos": True}},
    "logprobs": {"text": "Once upon a time", "sampling_params": GREEDY, "return_logprob": True,
                 "top_logprobs_num": 3, "logprob_start_len": 2},
    "logprobs-text": {"text": "Once upon a time", "sampling_params": GREEDY, "return_logprob": True,
                      "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True},
    "logprobs-score-prompt": {"input_ids": [[3, 4, 5, 6], [7, 8]], "return_logprob": True,
                              "sampling_params": {"max_new_tokens": 0}},
    "top-k-whole-vocab": {"text": "kv", "sampling_params": {**GREEDY, "top_k": 5000}},
    "context-edge-default-max-new": {"input_ids": [7] * 60, "sampling_params": {"ignore_eos": True}},
    "context-edge-full-prompt-zero-new": {"input_ids": [7] * CONTEXT, "sampling_params": {"max_new_tokens": 0}},
}

ERRORS = {
    "context-edge-explicit-max-new": {"input_ids": [7] * 60, "sampling_params": {"max_new_tokens": 10}},
    "prompt-fills-context": {"input_ids": [7] * CONTEXT},
    "prompt-over-context": {"input_ids": [7] * (CONTEXT + 1), "sampling_params": {"max_new_tokens": 1}},
    "empty-text": {"text": ""},
    "empty-input-ids": {"input_ids": []},
    "empty-batch": {"text": []},
    "no-prompt": {"sampling_params": GREEDY},
    "text-and-ids": {"text": "a", "input_ids": [1]},
    "ids-outside-vocab": {"input_ids": [10 ** 9]},
    "negative-temperature": {"text": "a", "sampling_params": {"temperature": -1}},
    "top-p-zero": {"text": "a", "sampling_params": {"top_p": 0}},
    "n-zero": {"text": "a", "sampling_params": {"n": 0}},
    "unknown-param": {"text": "a", "sampling_params": {"tempreature": 0.5}},
    "max-new-not-int": {"text": "a", "sampling_params": {"max_new_tokens": "many"}},
    "empty-stop": {"text": "a", "sampling_params": {"stop": [""]}},
    "bad-stop-regex": {"text": "a", "sampling_params": {"stop_regex": ["("]}},
    "stop-id-outside-vocab": {"text": "a", "sampling_params": {"stop_token_ids": [99999]}},
    "logit-bias-outside-vocab": {"text": "a", "sampling_params": {"logit_bias": {"99999": 1}}},
    "logprob-start-past-prompt": {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3},
    "top-logprobs-over-vocab": {"text": "a", "return_logprob": True, "top_logprobs_num": 10 ** 6},
    "params-count-mismatch": {"text": ["a", "b"], "sampling_params": [GREEDY]},
}


@pytest.mark.parametrize("name", CASES)
def test_results_agree(server, engine, name):
    result = both(server, engine, CASES[name])
    assert "error" not in result, result


@pytest.mark.parametrize("name", ERRORS)
def test_errors_agree(server, engine, name):
    result = both(server, engine, ERRORS[name])
    assert "error" in result and result["error"], result


def test_context_edge_is_fitted_not_refused(server, engine):
    out = both(server, engine, CASES["context-edge-default-max-new"])
    assert out["meta_info"]["completion_tokens"] == CONTEXT - 60
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": CONTEXT - 60}


def test_n_is_expanded_in_i_times_n_plus_j_order(server, engine):
    outs = both(server, engine, CASES["batch"])
    assert [len(o["output_ids"]) for o in outs] == [8, 3, 8, 8]
    seeded = both(server, engine, CASES["n-seeded"])
    assert len({tuple(o["output_ids"]) for o in seeded}) > 1, "copy j is seeded with seed + j"


def test_logprob_shapes(server, engine):
    out = both(server, engine, CASES["logprobs"])["meta_info"]
    assert len(out["input_token_logprobs"]) == out["prompt_tokens"] - 2      # from position 2 on
    assert len(out["output_top_logprobs"]) == len(out["output_token_logprobs"]) == out["completion_tokens"] > 0
    assert all(len(top) == 3 for top in out["output_top_logprobs"])
    assert all(entry[2] is None for entry in out["output_token_logprobs"])
    texts = both(server, engine, CASES["logprobs-text"])["meta_info"]
    assert len(texts["output_token_logprobs"]) == texts["completion_tokens"] > 0
    assert all(isinstance(entry[2], str) for entry in texts["output_token_logprobs"])


def test_stop_string_spanning_tokens(server, engine, stop_cases):
    body = {"text": STOP_PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 16, "stop": [stop_cases["span"]]}}
    out = both(server, engine, body)
    assert out["text"] == stop_cases["text"][:stop_cases["span_at"]]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_cases["span"]}
    kept = both(server, engine, {**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}})
    assert kept["text"].startswith(stop_cases["text"][:stop_cases["span_at"]] + stop_cases["span"])


def test_stop_string_in_the_first_token(server, engine, stop_cases):
    body = {"text": STOP_PROMPT, "sampling_params": {**GREEDY, "stop": [stop_cases["first"]]}}
    out = both(server, engine, body)
    assert out["text"] == "" and out["meta_info"]["completion_tokens"] == 1


def test_stop_token_ids(server, engine, stop_cases):
    stop_id = stop_cases["ids"][2]
    body = {"text": STOP_PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 16, "stop_token_ids": [stop_id]}}
    out = both(server, engine, body)
    assert out["output_ids"][-1] == stop_id and out["meta_info"]["finish_reason"]["matched"] == stop_id
    kept = both(server, engine, {**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}})
    assert len(kept["text"]) >= len(out["text"])


def stream_summary(events: list[dict]) -> tuple:
    """What a stream must agree on, whatever its chunking: the last cumulative output, all logprob deltas."""
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
    last = events[-1]
    logprobs = [lp for e in events for lp in e["meta_info"]["output_token_logprobs"]]
    return last["text"], last["output_ids"], last["meta_info"]["finish_reason"], logprobs


def test_streams_and_async_agree(server, engine, stop_cases):
    span = stop_cases["span"]
    body = {"text": STOP_PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 16, "stop": [span]},
            "return_logprob": True, "top_logprobs_num": 2}
    r = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120)
    http_events = [e for e in sse_events(r) if e != "[DONE]"]
    kwargs = {("prompt" if key == "text" else key): value for key, value in body.items()}

    async def engine_events() -> list[dict]:
        chunks = await engine.async_generate(**kwargs, stream=True)
        return [chunk async for chunk in chunks]

    engine_stream = asyncio.run(engine_events())
    assert stream_summary(engine_stream) == stream_summary(http_events)
    assert not any(span in e["text"] for e in http_events + engine_stream), "a stop string was streamed"
    whole = asyncio.run(engine.async_generate(**kwargs))
    assert comparable(whole) == comparable(via_http(server, body))
