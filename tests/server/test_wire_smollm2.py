"""A real model behind the OpenAI API: SmolLM2-135M-Instruct (GGUF, de-quantized, float32).

What a random-weight model cannot show: its chat template answers a question, JSON schemas finish with
`stop` and validate, a forced tool call is valid against its schema, `chat.completions.parse` returns a
pydantic instance. The requests of each test run concurrently (one batch) to keep the suite fast.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel

from tests.server.conftest import launch_server, stop_server

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["colors"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                      "genre": {"enum": ["drama", "comedy", "action"]}},
     "required": ["title", "year", "genre"]},
]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    handle = launch_server(tmp_path_factory.mktemp("smollm2"), "--model-path", "smollm2", "--dtype", "float32",
                           "--max-total-tokens", "8192")
    try:
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture(scope="module")
def client(smollm2):
    import openai

    return openai.OpenAI(base_url=smollm2.url + "/v1", api_key="none", max_retries=0, timeout=600)


def chat(client, content: str, **kw):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def test_chat_template_and_an_answer(client, smollm2):
    r = chat(client, "What is the capital of France?", max_tokens=12)
    assert "Paris" in r.choices[0].message.content
    info = smollm2.get("/get_model_info").json()
    assert info["model_path"].endswith(tuple("0123456789abcdef")) and "gguf-" in info["model_path"]


def test_json_schemas_finish_with_stop_and_validate(client):
    def run(schema):
        return chat(client, "Reply with a short JSON object.", max_tokens=80,
                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(run, SCHEMAS))
    for schema, r in zip(SCHEMAS, results):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_required_tool_call_and_parse_with_pydantic(client):
    with ThreadPoolExecutor(2) as pool:
        tool = pool.submit(chat, client, "What is the weather in Paris, in celsius?", max_tokens=60,
                           tools=[WEATHER_TOOL], tool_choice="required")
        parsed = pool.submit(client.chat.completions.parse, model="smollm2", temperature=0, max_tokens=60,
                             messages=[{"role": "user", "content": "Name a city and its country."}],
                             response_format=City)
    call = tool.result().choices[0]
    assert call.finish_reason == "tool_calls" and call.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(call.message.tool_calls[0].function.arguments),
                        WEATHER_TOOL["function"]["parameters"])
    city = parsed.result().choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country


def test_the_seeds_dsl_program_runs_on_a_real_model(smollm2):
    """The README's frontend program (SGLang's DSL, regex-constrained JSON) against this server."""
    import kvstrata.lang as sgl

    @sgl.function
    def generate_json(s):
        s += sgl.user("Generate an object with a name, an age and a city")
        s += sgl.assistant(sgl.gen("json_output", max_tokens=100, regex=r"\{.*\}"))

    state = generate_json.run(backend=sgl.RuntimeEndpoint(smollm2.url, timeout=600), temperature=0)
    out = state["json_output"]
    assert out.startswith("{")
    if state.get_meta_info("json_output")["finish_reason"]["type"] == "stop":
        assert out.endswith("}")
