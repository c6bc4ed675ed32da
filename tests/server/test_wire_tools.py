"""Tool calls on the tiny model: parsing (whole and streamed), forced calls under the call's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvstrata.server.tool_calls import HermesParser, Llama3Parser, ToolCallStreamer

UNIT_SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_temperature", "parameters": UNIT_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the temperature?"}]
HERMES_REPLY = ('Checking.\n<tool_call>\n{"name": "get_temperature", "arguments": {"unit": "celsius"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_hermes_stream_splits_content_and_calls_at_any_chunking(step):
    parser = HermesParser({"get_temperature", "get_time"})
    streamer, content, calls = ToolCallStreamer(parser), "", []
    for i in range(0, len(HERMES_REPLY), step):
        text, found = streamer.feed(HERMES_REPLY[i:i + step])
        assert "<tool" not in text
        content, calls = content + text, calls + found
    text, found = streamer.finish()
    content, calls = content + text, calls + found
    assert content == "Checking.\n"
    assert [(c.name, c.arguments) for c in calls] == [("get_temperature", {"unit": "celsius"}),
                                                     ("get_time", {"zone": "utc"})]
    assert (content, [(c.name, c.arguments) for c in calls]) == \
        (parser.parse(HERMES_REPLY)[0], [(c.name, c.arguments) for c in parser.parse(HERMES_REPLY)[1]])


def test_parsers_leave_what_is_not_a_call_as_content():
    hermes = HermesParser({"get_time"})
    assert hermes.parse('<tool_call>{"name": "other", "arguments": {}}</tool_call>')[1] == []
    assert hermes.parse("a <tool_ b")[0] == "a <tool_ b"
    llama = Llama3Parser({"get_time"})
    content, calls = llama.parse('{"name": "get_time", "parameters": {"zone": "local"}}')
    assert content == "" and calls[0].arguments == {"zone": "local"}
    assert llama.parse('{"answer": 42}') == ('{"answer": 42}', [])
    assert llama.parse('The answer: {"name": "get_time"}')[1] == []


def check_call(call, tools=TOOLS):
    fn = call.function if hasattr(call, "function") else None
    name, args = (fn.name, fn.arguments) if fn else (call["function"]["name"], call["function"]["arguments"])
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    jsonschema.validate(json.loads(args), schema)
    return name


@pytest.mark.parametrize("choice,name", [("required", None),
                                         ({"type": "function", "function": {"name": "get_time"}}, "get_time")])
def test_forced_tool_call_is_parsed_and_valid(openai_client, choice, name):
    r = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                              max_tokens=80, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert len(c.message.tool_calls) == 1 and c.message.content is None
    called = check_call(c.message.tool_calls[0])
    assert name is None or called == name
    assert c.message.tool_calls[0].id.startswith("call_")


def test_forced_tool_call_streams_as_delta_tool_calls(openai_client):
    stream = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                   tool_choice="required", max_tokens=80, temperature=0, stream=True)
    chunks = list(stream)
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])] if chunks else []
    assert len(calls) == 1 and calls[0].index == 0
    check_call(calls[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)


def test_auto_tool_calls_are_parsed_from_the_models_markup(server):
    """The tiny model writes a <tool_call> block when a regex makes it: the parser turns it into tool_calls."""
    block = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    regex = "Sure\\.\\n" + "".join("\\" + ch if ch in "{}.[]()*+?|^$\\" else ch for ch in block)
    for stream in (False, True):
        r = server.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "tools": TOOLS,
                                                      "regex": regex, "max_tokens": 200, "temperature": 0,
                                                      "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            calls = [tc for e in events for tc in e["choices"][0]["delta"].get("tool_calls") or []]
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            message = r.json()["choices"][0]["message"]
            content, calls, finish = message["content"], message["tool_calls"], r.json()["choices"][0]["finish_reason"]
        assert content == "Sure.\n" and finish == "tool_calls"
        assert [check_call(c) for c in calls] == ["get_time"]


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400(server, body, param):
    r = server.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
