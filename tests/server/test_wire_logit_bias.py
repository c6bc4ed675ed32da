"""logit_bias (OpenAI semantics: token id -> bias in [-100, 100]) in the native and the OpenAI API."""

from __future__ import annotations

import pytest

PROMPT = "The logit bias test prompt"


def greedy(server, **sampling) -> list[int]:
    r = server.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4,
                                                                            **sampling}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_native_minus_100_removes_the_greedy_token_and_plus_100_forces_one(server):
    first = greedy(server)[0]
    assert greedy(server, logit_bias={str(first): -100})[0] != first
    forced = (first + 7) % 200
    assert greedy(server, logit_bias={str(forced): 100}) == [forced] * 4


def test_openai_completions_and_chat_take_logit_bias(server, openai_client):
    first_id = greedy(server)[0]
    plain = openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                             logprobs=0)
    banned = openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                              logprobs=0, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]
    forced = (first_id + 11) % 200
    chat = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0.7, logit_bias={str(forced): 100},
                                                 logprobs=True)
    assert [t.token for t in chat.choices[0].logprobs.content] == [token_text(server, forced)] * 3


def token_text(server, token_id: int) -> str:
    """The server's text of one token (as it shows next to logprobs)."""
    r = server.post("/generate", json={"input_ids": [token_id, token_id], "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True, "logprob_start_len": 0,
                                       "return_text_in_logprobs": True})
    return r.json()["meta_info"]["input_token_logprobs"][1][2]


@pytest.mark.parametrize("bias,message", [
    ({"5": 101}, "[-100, 100]"), ({"5": "x"}, "[-100, 100]"), ({"five": 1}, "token ids"),
    ({"999999": 1}, "out of vocabulary"), ([1, 2], "object"),
])
def test_bad_logit_bias_is_a_400(server, openai_client, bias, message):
    r = server.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1, "logit_bias": bias}})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    r = server.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "logit_bias": bias})
    assert r.status_code == 400 and message in r.json()["error"]["message"]


def test_unknown_sampling_params_are_rejected_not_ignored(server):
    r = server.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1, "temprature": 0}})
    assert r.status_code == 400 and "temprature" in r.json()["error"]["message"]
    r = server.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1, "stream_interval": 1,
                                                                        "custom_params": {}}})
    assert r.status_code == 200, r.text
