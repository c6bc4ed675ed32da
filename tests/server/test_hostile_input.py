"""Input that used to crash a handler with a 500: infinite integers and lone surrogates.

Each gets a 400 naming the field, before any generation starts, streaming or not."""

from __future__ import annotations

import pytest
import requests

CHAT, COMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
INT_FIELDS = ["max_tokens", "max_completion_tokens", "n", "seed", "logprobs", "top_logprobs", "min_tokens",
              "best_of"]
USER = '[{"role": "user", "content": "hi"}]'


def infinite_int_cases() -> dict[str, tuple[str, str, str]]:
    cases = {}
    for name in INT_FIELDS:
        for sign in ("", "-"):
            for stream in ("false", "true"):
                path, base = (CHAT, f'"messages": {USER}') if name != "best_of" and name != "logprobs" \
                    else (COMPL, '"prompt": "Hello there"')
                if name == "max_completion_tokens" or name == "top_logprobs":
                    path, base = CHAT, f'"messages": {USER}'
                body = f'{{"model": "tiny", {base}, "{name}": {sign}1e999, "stream": {stream}}}'
                cases[f"{path}-{name}-{sign or '+'}-stream={stream}"] = (path, body, name)
    cases["compl-max-tokens"] = (COMPL, '{"model":"tiny","prompt":"Hello there","max_tokens":1e999}', "max_tokens")
    cases["gen-max-new-tokens"] = (GEN, '{"text": "a", "sampling_params": {"max_new_tokens": 1e999}}',
                                   "sampling_params")
    cases["gen-logprob-start"] = (GEN, '{"text": "a", "return_logprob": true, "logprob_start_len": -1e999}',
                                  "logprob_start_len")
    return cases


SURROGATE_CASES = {
    "gen-text": (GEN, '{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text"),
    "gen-text-batch": (GEN, '{"text": ["ok", "abc\\udfff def"]}', "text"),
    "gen-rid": (GEN, '{"text": "hello", "rid": "r\\ud800"}', "rid"),
    "gen-rid-stream": (GEN, '{"text": "hello", "rid": "r\\udc00", "stream": true}', "rid"),
    "compl-prompt": (COMPL, '{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    "compl-prompt-list": (COMPL, '{"model": "tiny", "prompt": ["fine", "abc\\udfff def"]}', "prompt"),
    "compl-model": (COMPL, '{"model": "tiny\\ud800", "prompt": "hello", "max_tokens": 2}', "model"),
    "compl-model-stream": (COMPL, '{"model": "\\ud800", "prompt": "hello", "max_tokens": 2, "stream": true}',
                           "model"),
    "chat-content": (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    "chat-text-part": (CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "x\\udfff"}]}]}', "messages"),
    "chat-model": (CHAT, '{"model": "\\ud800", "messages": ' + USER + ', "max_tokens": 2}', "model"),
    "chat-model-stream": (CHAT, '{"model": "\\ud800", "messages": ' + USER + ', "max_tokens": 2, '
                                '"stream": true}', "model"),
    "chat-tool-name": (CHAT, '{"model": "tiny", "messages": ' + USER + ', "tools": [{"type": "function", '
                             '"function": {"name": "f\\ud800"}}]}', "tools"),
    "raw-utf8-surrogate": (GEN, b'{"text": "a\xed\xa0\x80b"}', "text"),
}
CASES = {**infinite_int_cases(), **SURROGATE_CASES}


def prompt_tokens_seen(server) -> int:
    return server.scheduler_state()["prompt_tokens"]


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_value_is_a_400_naming_the_field(server, name):
    path, body, field = CASES[name]
    before = prompt_tokens_seen(server)
    raw = body if isinstance(body, bytes) else body.encode()
    r = requests.post(server.url + path, data=raw, timeout=60,
                      headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == field, error
    assert field in error["message"] or field == "sampling_params", error
    assert prompt_tokens_seen(server) == before          # rejected before anything was scheduled


def test_server_still_serves_after_hostile_input(server):
    r = server.post(GEN, json={"text": "still alive?", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1
