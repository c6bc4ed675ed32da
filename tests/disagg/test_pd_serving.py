"""PD serving end to end: router + prefill + decode against one co-located server, with real HTTP clients."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import requests

from tests.disagg.conftest import generate, greedy, state, wait_idle

SHARED = "You are a careful assistant. Answer briefly and precisely, citing the source when you can. "
PROMPTS = [
    "Hi",
    "The capital of France is",
    "Count: one two three four five six seven",
    "x" * 90,
    SHARED + "What is a radix tree?",
    SHARED + "What is a radix tree?",                 # the whole prompt again: prefill cache hit
    SHARED + "Why does prefill stall decoding?",      # the shared prefix: prefill cache hit
    SHARED + "Explain KV cache paging in one line.",
    "A long one: " + "the quick brown fox jumps over the lazy dog " * 8,
    "0123456789" * 5,
]


def test_greedy_through_pd_matches_colocated(pd):
    before = state(pd.prefill.url)["cached_tokens"]
    for i, prompt in enumerate(PROMPTS):
        body = greedy(prompt, max_new_tokens=8 + i)
        via_pd = generate(pd.router.url, body)
        alone = generate(pd.colocated.url, body)
        assert via_pd.status_code == 200, via_pd.text
        assert via_pd.json()["output_ids"] == alone.json()["output_ids"], prompt
        assert via_pd.json()["text"] == alone.json()["text"]
        assert via_pd.json()["meta_info"]["completion_tokens"] == 8 + i
    assert state(pd.prefill.url)["cached_tokens"] - before >= 2 * len(SHARED) // 2   # the prefill reused its cache
    for url in (pd.prefill.url, pd.decode.url):
        s = wait_idle(url)
        assert s["integrity_ok"], s
        assert s["disaggregation"]["transfers_failed"] == 0


def test_prompt_and_output_logprobs_match_colocated(pd):
    body = greedy(SHARED + "logprobs please", 6, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    via_pd = generate(pd.router.url, body).json()["meta_info"]
    alone = generate(pd.colocated.url, body).json()["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert via_pd[key] == alone[key], key


def test_openai_chat_stream_and_completion_through_pd(pd):
    messages = [{"role": "user", "content": "Tell me about disaggregated serving."}]
    pd_client = openai.OpenAI(base_url=pd.router.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ref_client = openai.OpenAI(base_url=pd.colocated.url + "/v1", api_key="none", max_retries=0, timeout=120)
    chunks = pd_client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                               stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = ref_client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert streamed == ref.choices[0].message.content
    comp = pd_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=7, temperature=0)
    ref = ref_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=7, temperature=0)
    assert comp.choices[0].text == ref.choices[0].text
    assert comp.usage.completion_tokens == 7


def _stream(url: str, i: int) -> list[int]:
    body = greedy(f"stream {i}: " + "abc " * (i % 7), 16 + i % 5, stream=True)
    with requests.post(url + "/generate", json=body, stream=True, timeout=180) as r:
        assert r.status_code == 200, r.text
        events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and events[-1]["meta_info"]["finish_reason"]["type"] == "length", events[-1:]
    return events[-1]["output_ids"]


def test_32_concurrent_streams_complete_without_leaks(pd):
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda i: _stream(pd.router.url, i), range(32)))
    assert [len(o) for o in outs] == [16 + i % 5 for i in range(32)]
    ref = generate(pd.colocated.url, greedy("stream 5: " + "abc " * 5, 16)).json()["output_ids"]
    assert outs[5] == ref
    for url in (pd.prefill.url, pd.decode.url):
        s = wait_idle(url)
        assert s["integrity_ok"], s
        assert s["running_requests"] == s["waiting_requests"] == 0
        d = s["disaggregation"]
        assert d["transfers_failed"] == 0 and d["transfers_ok"] >= 32
        assert d.get("transfers_in_flight", 0) == 0 and d.get("rooms_open", 0) == 0


def test_client_abort_reaches_both_sides(pd):
    aborted_before = state(pd.decode.url)["aborted_requests"]
    body = greedy("abort me " * 4, 1500, stream=True)
    body["sampling_params"]["ignore_eos"] = True
    with requests.post(pd.router.url + "/generate", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines(decode_unicode=True)
        assert next(line for line in lines if line.startswith("data: "))   # the first token arrived
    for url in (pd.prefill.url, pd.decode.url):
        s = wait_idle(url)
        assert s["integrity_ok"], s
    assert state(pd.decode.url)["aborted_requests"] == aborted_before + 1


def test_pd_metrics_in_server_info(pd):
    generate(pd.router.url, greedy("metrics", 4))
    p, d = state(pd.prefill.url)["disaggregation"], state(pd.decode.url)["disaggregation"]
    assert p["mode"] == "prefill" and d["mode"] == "decode"
    last = d["recent_transfers"][-1]
    assert last["bytes"] > 0 and last["transfer_s"] > 0 and last["bootstrap_queue_s"] >= 0
    assert p["transfer_bytes_total"] == d["transfer_bytes_total"] > 0
    assert "bootstrap_queue" in d and "waiting_for_decode" in p
