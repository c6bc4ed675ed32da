"""Malformed requests: each gets a 4xx with an error message, and the server keeps serving."""

from __future__ import annotations

import json

import pytest
import requests

USER = [{"role": "user", "content": "hi"}]
CHAT, COMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"

# (method, path, JSON body or raw bytes, expected status)
CASES = {
    "gen-not-json": ("POST", GEN, b"this is not json", 400),
    "gen-json-array": ("POST", GEN, b"[1, 2]", 400),
    "gen-empty-body": ("POST", GEN, b"", 400),
    "gen-no-prompt": ("POST", GEN, {}, 400),
    "gen-empty-text": ("POST", GEN, {"text": ""}, 400),
    "gen-empty-ids": ("POST", GEN, {"input_ids": []}, 400),
    "gen-text-and-ids": ("POST", GEN, {"text": "a", "input_ids": [1]}, 400),
    "gen-text-number": ("POST", GEN, {"text": 123}, 400),
    "gen-negative-id": ("POST", GEN, {"input_ids": [1, -5]}, 400),
    "gen-id-out-of-vocab": ("POST", GEN, {"input_ids": [10 ** 9]}, 400),
    "gen-negative-temperature": ("POST", GEN, {"text": "a", "sampling_params": {"temperature": -1}}, 400),
    "gen-top-p-zero": ("POST", GEN, {"text": "a", "sampling_params": {"top_p": 0}}, 400),
    "gen-top-k-zero": ("POST", GEN, {"text": "a", "sampling_params": {"top_k": 0}}, 400),
    "gen-max-tokens-string": ("POST", GEN, {"text": "a", "sampling_params": {"max_new_tokens": "ten"}}, 400),
    "gen-over-context": ("POST", GEN, {"text": "a", "sampling_params": {"max_new_tokens": 100000}}, 400),
    "gen-n-zero": ("POST", GEN, {"text": "a", "sampling_params": {"n": 0}}, 400),
    "gen-stop-number": ("POST", GEN, {"text": "a", "sampling_params": {"stop": 5}}, 400),
    "gen-bad-regex": ("POST", GEN, {"text": "a", "sampling_params": {"regex": "(unclosed", "max_new_tokens": 4}},
                      400),
    "gen-two-constraints": ("POST", GEN, {"text": "a", "sampling_params": {"regex": "a+", "ebnf": "root ::= \"a\""}},
                            400),
    "gen-params-string": ("POST", GEN, {"text": "a", "sampling_params": "fast"}, 400),
    "gen-params-count": ("POST", GEN, {"text": ["a", "b"], "sampling_params": [{}]}, 400),
    "gen-logprob-start-too-big": ("POST", GEN, {"text": "a", "return_logprob": True, "logprob_start_len": 1000},
                                  400),
    "gen-negative-top-logprobs": ("POST", GEN, {"text": "a", "return_logprob": True, "top_logprobs_num": -1}, 400),
    "gen-stream-string": ("POST", GEN, {"text": "a", "stream": "yes"}, 400),
    "gen-stop-id-out-of-vocab": ("POST", GEN, {"text": "a", "sampling_params": {"stop_token_ids": [99999]}}, 400),
    "gen-min-over-max": ("POST", GEN, {"text": "a", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
                         400),
    "gen-repetition-zero": ("POST", GEN, {"text": "a", "sampling_params": {"repetition_penalty": 0}}, 400),
    "gen-prompt-too-long": ("POST", GEN, {"input_ids": [5] * 5000}, 400),
    "gen-seed-too-big": ("POST", GEN, {"text": "a", "sampling_params": {"sampling_seed": 10 ** 20}}, 400),
    "gen-infinity": ("POST", GEN, b'{"text": "a", "sampling_params": {"max_new_tokens": Infinity}}', 400),
    "gen-image": ("POST", GEN, {"text": "a", "image_data": "http://example.com/a.png"}, 400),
    "chat-messages-string": ("POST", CHAT, {"model": "tiny", "messages": "hi"}, 400),
    "chat-no-messages": ("POST", CHAT, {"model": "tiny", "messages": []}, 400),
    "chat-bad-role": ("POST", CHAT, {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400),
    "chat-no-content": ("POST", CHAT, {"model": "tiny", "messages": [{"role": "user"}]}, 400),
    "chat-temperature-5": ("POST", CHAT, {"model": "tiny", "messages": USER, "temperature": 5}, 400),
    "chat-max-tokens-zero": ("POST", CHAT, {"model": "tiny", "messages": USER, "max_tokens": 0}, 400),
    "chat-n-string": ("POST", CHAT, {"model": "tiny", "messages": USER, "n": "two"}, 400),
    "chat-schema-missing": ("POST", CHAT, {"model": "tiny", "messages": USER,
                                           "response_format": {"type": "json_schema"}}, 400),
    "chat-logit-bias": ("POST", CHAT, {"model": "tiny", "messages": USER, "logit_bias": {"1": 500}}, 400),
    "chat-top-logprobs-50": ("POST", CHAT, {"model": "tiny", "messages": USER, "logprobs": True,
                                            "top_logprobs": 50}, 400),
    "chat-over-context": ("POST", CHAT, {"model": "tiny", "messages": USER, "max_tokens": 10 ** 6}, 400),
    "chat-not-json": ("POST", CHAT, b"{'single': 'quotes'}", 400),
    "compl-empty-prompt": ("POST", COMPL, {"model": "tiny", "prompt": ""}, 400),
    "compl-empty-token-list": ("POST", COMPL, {"model": "tiny", "prompt": [[]]}, 400),
    "compl-negative-max-tokens": ("POST", COMPL, {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400),
    "compl-logprobs-string": ("POST", COMPL, {"model": "tiny", "prompt": "x", "logprobs": "many"}, 400),
    "compl-mixed-prompts": ("POST", COMPL, {"model": "tiny", "prompt": ["x", [1, 2]]}, 400),
    "abort-without-rid": ("POST", "/abort_request", {}, 400),
    "unknown-model": ("GET", "/v1/models/no-such-model", None, 404),
    "unknown-route": ("GET", "/no/such/route", None, 404),
    "wrong-method": ("GET", GEN, None, 405),
}


def send(server, method: str, path: str, body) -> requests.Response:
    headers = dict(server.headers)
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
        return requests.request(method, server.url + path, data=body, headers=headers, timeout=60)
    return requests.request(method, server.url + path, json=body, headers=headers, timeout=60)


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_gets_4xx_with_message_then_server_still_serves(server, name):
    method, path, body, status = CASES[name]
    r = send(server, method, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and len(error["message"]) > 5, error
    assert error["code"] == status and error["type"]
    ok = server.post("/generate", json={"text": "still alive?", "sampling_params": {"max_new_tokens": 1}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 1


def test_out_of_range_top_k_means_no_top_k(server):
    r = server.post("/generate", json={"text": "a", "sampling_params": {"top_k": 10 ** 12, "max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def test_bad_stream_request_gets_a_status_not_a_broken_stream(server):
    body = {"text": "a", "stream": True, "sampling_params": {"regex": "(unclosed", "max_new_tokens": 4}}
    r = server.post("/generate", json=body)
    assert r.status_code == 400 and "regex" in json.dumps(r.json()).lower()
