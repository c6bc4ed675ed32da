"""SGLang's own clients on the wire: the exact bodies their benchmarks send, neutral fields, clear 400s."""

from __future__ import annotations

import pytest

from tests.server.helpers import sse_events


def bench_multiturn_body(prompt: str, output_len: int) -> dict:
    """The /generate body SGLang's benchmark/hicache/bench_multiturn.py sends (field for field)."""
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "lora_path": "",
        "return_logprob": False,
        "logprob_start_len": -1,
    }


def test_bench_multiturn_body_streams_to_the_end(server):
    prompt = "A multi-turn conversation history, then the next question of this client."
    r = server.post("/generate", json=bench_multiturn_body(prompt, 8), stream=True)
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["text"].startswith(chunks[0]["text"]) for c in chunks)   # cumulative text, as it reads it
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "length" and last["completion_tokens"] == 8


@pytest.mark.parametrize("extra", [
    {"lora_path": None},                                   # bench_serving.py without --lora-name
    {"lora_path": ["", None]},                             # a batch, one entry per prompt
    {"return_hidden_states": False, "return_routed_experts": False, "custom_logit_processor": None},
    {"image_data": None, "session_params": None, "token_ids_logprob": None, "lora_id": ""},
])
def test_neutral_values_of_unsupported_fields_are_accepted(server, extra):
    texts = ["first prompt", "second prompt"] if isinstance(extra.get("lora_path"), list) else "one prompt"
    body = {"text": texts, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **extra}
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("field,value", [
    ("lora_path", "my-adapter"), ("lora_path", ["", "my-adapter"]), ("return_hidden_states", True),
    ("return_routed_experts", True), ("image_data", "data:image/png;base64,AAAA"),
])
def test_values_we_cannot_honour_get_a_400_naming_the_field(server, field, value):
    texts = ["a", "b"] if isinstance(value, list) else "a"
    r = server.post("/generate", json={"text": texts, "sampling_params": {"max_new_tokens": 1}, field: value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    assert server.post("/generate", json={"text": "still serving", "sampling_params": {"max_new_tokens": 1}}
                       ).status_code == 200
