"""The OpenAI-compatible API through the official `openai` Python client."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.helpers import printable_stop

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


def test_models_list_and_retrieve(openai_client, server):
    models = openai_client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    card = openai_client.models.retrieve("tiny")
    assert card.id == "tiny" and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.models.retrieve("no-such-model")
    assert "no-such-model" in info.value.body["message"]


def test_chat_non_stream(openai_client):
    r = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)


def test_chat_stream_role_first_one_finish_and_usage(openai_client):
    ref = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.choices[0].finish_reason]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens


def test_chat_n2_with_seed_is_reproducible(openai_client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0, n=2, seed=1234)
    a = openai_client.chat.completions.create(**kw)
    b = openai_client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    stream = list(openai_client.chat.completions.create(**kw, stream=True))
    for index in (0, 1):
        parts = [c.choices[0] for c in stream if c.choices and c.choices[0].index == index]
        assert sum(1 for p in parts if p.finish_reason) == 1
        assert "".join(p.delta.content or "" for p in parts) == a.choices[index].message.content


def test_chat_logprobs(openai_client):
    r = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token    # greedy


def test_completions_stream_and_non_stream(openai_client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    ref = openai_client.completions.create(**kw)
    assert ref.object == "text_completion" and ref.choices[0].finish_reason in ("stop", "length")
    chunks = list(openai_client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens


def test_completions_batch_n_echo_and_logprobs(openai_client):
    prompts = ["Hello there", "Goodbye now"]
    r = openai_client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=4, temperature=0,
                                         echo=True, logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        prompt = prompts[c.index // 2]
        assert c.text.startswith(prompt)
        lp = c.logprobs
        assert lp.token_logprobs[0] is None and "".join(lp.tokens).startswith(prompt)
        assert lp.text_offset[0] == 0 and len(lp.top_logprobs) == len(lp.tokens)
        assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert r.usage.completion_tokens == 4 * 4


def test_stop_strings_openai(openai_client):
    kw = dict(model="tiny", prompt="The weather today", max_tokens=32, temperature=0,
              extra_body={"ignore_eos": True})
    base = openai_client.completions.create(**kw).choices[0].text
    stop = printable_stop(base)
    assert stop is not None, base
    r = openai_client.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == base[:base.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = [c.choices[0].text for c in openai_client.completions.create(**kw, stop=stop, stream=True)
                if c.choices]
    assert "".join(streamed) == r.choices[0].text and all(stop not in t for t in streamed)


def test_return_token_ids_gives_the_generated_ids(openai_client, server):
    """A token-id prompt's next turn can re-send exactly what was generated (no re-tokenized text)."""
    prompt = list(range(40, 72))
    kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    native = server.post("/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}).json()
    choice = openai_client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    assert choice.model_extra["token_ids"] == native["output_ids"]
    assert choice.model_extra["prompt_token_ids"] == prompt
    chunks = [c.choices[0] for c in openai_client.completions.create(
        **kw, stream=True, extra_body={"return_token_ids": True}) if c.choices]
    assert [i for c in chunks for i in c.model_extra.get("token_ids") or []] == native["output_ids"]
    assert [c.model_extra.get("prompt_token_ids") for c in chunks if c.model_extra.get("prompt_token_ids")] \
        == [prompt]
    assert "token_ids" not in openai_client.completions.create(**kw).choices[0].model_extra
    chat = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                                 extra_body={"return_token_ids": True}).choices[0]
    assert 0 < len(chat.model_extra["token_ids"]) <= 4
    assert len(chat.model_extra["token_ids"]) == 4 or chat.finish_reason == "stop"
    bad = server.post("/v1/completions", json={**kw, "return_token_ids": "yes"})
    assert bad.status_code == 400 and "return_token_ids" in bad.text


def test_cached_tokens_on_repeat(openai_client, server):
    server.wait_idle()
    server.post("/flush_cache")
    prompt = "Repeat after me: " + "the cache keeps what it has seen. " * 6
    first = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = openai_client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens - server.server_info()["page_size"] - 1


def test_response_format_json_schema(openai_client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content)["ok"], bool)
    else:   # cut at max_tokens: still the start of the one object the schema allows
        assert r.choices[0].finish_reason == "length" and content.lstrip().startswith("{"), content
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                              extra_body={"regex": "(unclosed"})


def test_chat_roles_tools_and_continue_final_message(openai_client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy, 8 C"},
    ]
    plain = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    with_tools = openai_client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=2,
                                                       temperature=0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens      # the tools are in the prompt
    partial = MESSAGES + [{"role": "assistant", "content": "My favourite color is"}]
    cont = openai_client.chat.completions.create(model="tiny", messages=partial, max_tokens=2, temperature=0,
                                                 extra_body={"continue_final_message": True})
    fresh = openai_client.chat.completions.create(model="tiny", messages=partial, max_tokens=2, temperature=0)
    # Continuing leaves the final message open: no end-of-turn and no new assistant header.
    assert cont.usage.prompt_tokens < fresh.usage.prompt_tokens
