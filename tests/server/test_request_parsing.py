"""Request parsing and stop-string trimming, without a server."""

from __future__ import annotations

import json

import pytest

from kvstrata.server.openai_protocol import parse_chat, parse_completion
from kvstrata.serving.errors import ApiError
from kvstrata.serving.protocol import parse_generate, parse_json_body
from kvstrata.serving.seq_state import stop_safe_prefix_len, trim_at_stop


def test_stop_safe_prefix_holds_back_possible_stop_starts():
    assert stop_safe_prefix_len("hello wor", ["world"]) == len("hello ")
    assert stop_safe_prefix_len("hello", ["xyz"]) == 5
    assert stop_safe_prefix_len("abc\n", ["\n\n"]) == 3
    assert stop_safe_prefix_len("abSTOPcd", ["STOP"]) == 2
    assert stop_safe_prefix_len("aXY", ["XYZ", "Y!"]) == 1
    assert stop_safe_prefix_len("", ["a"]) == 0


def test_trim_at_stop_cuts_before_the_first_stop_string():
    assert trim_at_stop("one. two. three", [". t"]) == "one"
    assert trim_at_stop("abcSTOPdefEND", ["END", "STOP"]) == "abc"
    assert trim_at_stop("nothing", ["zz"]) == "nothing"


def test_streamed_prefixes_are_prefixes_of_the_final_text():
    final = "The answer is 42. Next question"
    stops = [". Next", "42?"]
    shown = ""
    for end in range(len(final) + 1):
        visible = final[:end][:stop_safe_prefix_len(final[:end], stops)]
        assert visible.startswith(shown)
        assert all(s not in visible for s in stops)
        shown = visible
    assert shown == trim_at_stop(final, stops) == "The answer is 42"


def test_native_single_batch_and_per_prompt_params():
    single = parse_generate({"text": "hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                "top_k": -1}})
    assert not single.is_batch and single.prompts[0].sampling.max_new_tokens == 3
    with pytest.raises(ApiError, match="unknown_field"):      # rejected, never silently ignored
        parse_generate({"text": "hi", "sampling_params": {"unknown_field": 1}})
    batch = parse_generate({"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {"n": 1}],
                            "return_logprob": [True, False], "rid": ["a", "b"]})
    assert batch.is_batch and [p.rid for p in batch.prompts] == ["a", "b"]
    assert [p.sampling.n for p in batch.prompts] == [2, 1]
    assert [p.return_logprob for p in batch.prompts] == [True, False]
    nulls = parse_generate({"text": "x", "sampling_params": {"temperature": None, "max_new_tokens": None}})
    assert nulls.prompts[0].sampling.temperature == 1.0
    assert not nulls.prompts[0].max_new_tokens_explicit


@pytest.mark.parametrize("body", [
    {},
    {"text": "a", "input_ids": [1]},
    {"text": ""},
    {"text": []},
    {"text": 5},
    {"input_ids": []},
    {"input_ids": [1, "2"]},
    {"text": ["a", "b"], "sampling_params": [{}]},
    {"text": "a", "sampling_params": {"temperature": "hot"}},
    {"text": "a", "sampling_params": {"max_new_tokens": -1}},
    {"text": "a", "return_logprob": "yes"},
    {"text": "a", "logprob_start_len": -5},
    {"text": "a", "image_data": "http://x/y.png"},
    {"text": ["a", "b"], "rid": ["same", "same"]},
])
def test_native_rejects(body):
    with pytest.raises(ApiError) as info:
        parse_generate(body)
    assert info.value.status == 400 and info.value.message


def test_json_body_must_be_an_object():
    for raw in (b"", b"{", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(ApiError):
            parse_json_body(raw)
    assert parse_json_body(b'{"a": 1}') == {"a": 1}


def test_openai_chat_mapping():
    chat, req, opts = parse_chat({
        "model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 5, "seed": 7, "stop": "x", "top_k": 3, "logprobs": True, "top_logprobs": 2,
        "stream": True, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"}}},
    }, "default")
    assert [m["role"] for m in chat.messages] == ["system", "user"] and chat.messages[1]["content"] == "hi"
    s = req.prompts[0].sampling
    assert (s.max_new_tokens, s.sampling_seed, s.stop, s.top_k) == (5, 7, ["x"], 3)
    assert json.loads(s.json_schema) == {"type": "integer"}
    assert opts.stream and opts.include_usage and opts.top_logprobs == 2 and opts.model == "m"
    _, req2, _ = parse_chat({"messages": [{"role": "user", "content": "x"}],
                             "response_format": {"type": "json_object"}}, "d")
    assert not req2.prompts[0].max_new_tokens_explicit
    assert json.loads(req2.prompts[0].sampling.json_schema) == {"type": "object"}


def test_openai_completion_mapping():
    req, opts = parse_completion({"prompt": ["a", "b"], "n": 2, "echo": True, "logprobs": 1,
                                  "max_tokens": 0}, "d")
    assert req.is_batch and len(req.prompts) == 2 and opts.echo and opts.logprobs
    assert all(p.logprob_start_len == 0 and p.sampling.max_new_tokens == 0 for p in req.prompts)
    assert parse_completion({"prompt": [1, 2, 3]}, "d")[0].prompts[0].input_ids == [1, 2, 3]


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "temperature": 3},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
    {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
])
def test_openai_chat_rejects(body):
    with pytest.raises(ApiError):
        parse_chat(body, "d")
