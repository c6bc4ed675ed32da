"""The SGLang-native API with `requests`: /generate single, batch, n, stream, logprobs, stops, and info routes."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.server.helpers import parse_sse, printable_stop, sse_events

GREEDY = {"temperature": 0, "max_new_tokens": 8}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def tokenizer():
    from kvstrata.model.builtin import resolve_model_path
    from kvstrata.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path("tiny"))


def generate(server, **body):
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_single_text_and_input_ids_agree(server, tokenizer):
    greedy = {**GREEDY, "ignore_eos": True}   # 8 tokens, so that the text checks below always run
    out = generate(server, text=PROMPTS[0], sampling_params=greedy)
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["prompt_tokens"] == len(tokenizer.encode(PROMPTS[0]))
    assert meta["finish_reason"]["type"] == "length"
    assert meta["e2e_latency"] > 0 and isinstance(meta["cached_tokens"], int) and meta["id"]
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    by_ids = generate(server, input_ids=tokenizer.encode(PROMPTS[0]), sampling_params=greedy, rid="my-rid")
    assert by_ids["output_ids"] == out["output_ids"] and by_ids["text"] == out["text"]
    assert by_ids["meta_info"]["id"] == "my-rid"


def test_batch_keeps_order_and_matches_singles(server):
    singles = [generate(server, text=p, sampling_params=GREEDY)["text"] for p in PROMPTS]
    batch = generate(server, text=PROMPTS, sampling_params=GREEDY)
    assert isinstance(batch, list) and [b["text"] for b in batch] == singles


def test_n_expands_in_i_times_n_plus_j_order(server):
    params = {"temperature": 1.0, "max_new_tokens": 6, "n": 2, "sampling_seed": 11}
    out = generate(server, text=PROMPTS[:2], sampling_params=params)
    assert len(out) == 4
    prompt_tokens = [o["meta_info"]["prompt_tokens"] for o in out]
    assert prompt_tokens[0] == prompt_tokens[1] and prompt_tokens[2] == prompt_tokens[3]
    again = generate(server, text=PROMPTS[:2], sampling_params=params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]   # seeded: reproducible
    alone = generate(server, text=PROMPTS[1], sampling_params=params)
    assert [o["output_ids"] for o in alone] == [o["output_ids"] for o in out[2:]]


def test_stream_is_cumulative_and_ends_with_done(server):
    expected = generate(server, text=PROMPTS[1], sampling_params=GREEDY)
    r = server.post("/generate", json={"text": PROMPTS[1], "sampling_params": GREEDY, "stream": True},
                    stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]" and len(events) >= 2
    data = events[:-1]
    for prev, cur in zip(data, data[1:], strict=False):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
    assert all("meta_info" in e for e in data)
    assert data[-1]["text"] == expected["text"] and data[-1]["output_ids"] == expected["output_ids"]
    assert data[-1]["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
    assert all(e["meta_info"]["finish_reason"] is None for e in data[:-1])


def test_logprobs_cover_the_prompt_suffix(server, tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    start = 2
    out = generate(server, input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=start,
                   top_logprobs_num=3, return_text_in_logprobs=True)
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert len(inp) == meta["prompt_tokens"] - start
    assert inp[0][0] is None and all(isinstance(e[0], float) and e[0] <= 0 for e in inp[1:])
    assert [e[1] for e in inp] == ids[start:]
    assert "".join(e[2] for e in inp) == tokenizer.decode(ids[start:])
    outp = meta["output_token_logprobs"]
    assert [e[1] for e in outp] == out["output_ids"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(outp) and all(len(t) == 3 for t in tops)
    for (lp, tid, _), top in zip(outp, tops, strict=True):
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-4   # greedy picks the top-1 token
    no_text = generate(server, input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    assert all(e[2] is None for e in no_text["meta_info"]["output_token_logprobs"])


def test_streamed_logprobs_are_deltas(server):
    # 64 tokens: a stream of several events, so that cumulative logprobs would repeat entries
    body = {"text": PROMPTS[2], "sampling_params": {**GREEDY, "max_new_tokens": 64, "ignore_eos": True},
            "return_logprob": True, "stream": True}
    events = sse_events(server.post("/generate", json=body, stream=True))[:-1]
    assert len(events) >= 2, events
    streamed = [e for ev in events for e in ev["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in streamed] == events[-1]["output_ids"] and len(streamed) == 64


def test_max_new_tokens_zero_scores_the_prompt(server):
    out = generate(server, text=PROMPTS[0], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                   logprob_start_len=0)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == "" and meta["completion_tokens"] == 0
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["finish_reason"]["type"] == "length"


def test_stop_strings_are_trimmed_including_in_streams(server):
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    base = generate(server, text=PROMPTS[1], sampling_params=params)["text"]
    stop = printable_stop(base)
    assert stop is not None, f"no printable stop candidate in {base!r}"
    expected = base[:base.find(stop)]
    out = generate(server, text=PROMPTS[1], sampling_params={**params, "stop": [stop]})
    assert out["text"] == expected
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = generate(server, text=PROMPTS[1], sampling_params={**params, "stop": stop, "no_stop_trim": True})
    assert kept["text"].startswith(expected + stop)    # untrimmed: up to the end of the stopping token
    events = sse_events(server.post("/generate", json={"text": PROMPTS[1], "stream": True,
                                                       "sampling_params": {**params, "stop": [stop]}}, stream=True))
    texts = [e["text"] for e in events[:-1]]
    assert texts[-1] == expected and all(stop not in t for t in texts)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))


def test_stop_token_ids_end_generation(server):
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    base = generate(server, text=PROMPTS[2], sampling_params=params)
    stop_id = base["output_ids"][4]
    first = base["output_ids"].index(stop_id)
    out = generate(server, text=PROMPTS[2], sampling_params={**params, "stop_token_ids": [stop_id]})
    assert out["output_ids"] == base["output_ids"][:first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_abort_request_ends_a_running_stream(server):
    body = {"text": PROMPTS[0], "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    resp = server.post("/generate", json=body, stream=True)
    lines = resp.iter_lines(decode_unicode=True)
    next(line for line in lines if line)          # generation has started
    aborter = threading.Timer(0.05, lambda: server.post("/abort_request", json={"rid": "abort-me"}))
    aborter.start()
    start = time.monotonic()
    events = parse_sse(lines)
    aborter.join()
    assert time.monotonic() - start < 30
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-2]["meta_info"]["completion_tokens"] < 3000


def test_info_and_control_routes(server):
    info = server.get("/get_model_info").json()
    assert os.path.isdir(info["model_path"]) and info["is_generation"] is True     # the built-in's folder
    assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer.json"))
    assert server.get("/model_info").json() == info
    sinfo = server.server_info()
    assert sinfo["api_key"] == "***" and sinfo["max_total_tokens"] > 0
    assert "free_pages" in sinfo["internal_states"][0]
    assert server.get("/get_server_info").status_code == 200
    server.wait_idle()
    assert server.get("/flush_cache").status_code == 200
    assert server.post("/flush_cache").status_code == 200
    assert server.get("/health_generate").status_code == 200
    assert server.post("/concate_and_append_request", json={}).status_code == 200
    metrics = server.get("/metrics")
    assert metrics.status_code == 200 and "sglang:num_requests_total" in metrics.text
    assert "sglang:cache_hit_rate" in metrics.text and "sglang:num_running_reqs" in metrics.text
