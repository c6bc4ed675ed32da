"""SGLang's own clients on the wire: the exact bodies their benchmarks send, neutral fields, clear 400s."""

from __future__ import annotations

import re

import pytest

from tests.server.helpers import bench_multiturn_body, sse_events


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


def test_scoring_request_returns_every_input_logprob(server):
    """SGLang's select(unconditional_likelihood_normalized) sends exactly this and indexes the result."""
    ids = [[5, 6, 7, 8], [9, 10]]
    r = server.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                       "return_logprob": True})
    assert r.status_code == 200, r.text
    for prompt, out in zip(ids, r.json(), strict=True):
        entries = out["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt
        assert entries[0][0] is None and all(e[0] <= 0 for e in entries[1:])


def test_stop_regex_match_is_trimmed_like_a_stop_string(server):
    base = server.post("/generate", json={"text": "Regex trim", "sampling_params": {
        "temperature": 0, "max_new_tokens": 12}}).json()["text"]
    # A pair of plain characters after the start (the built-in model's greedy text is fixed by its seed),
    # matched by a regex that is not the literal text.
    piece = next(base[i:i + 2] for i in range(2, len(base) - 1)
                 if base[i:i + 2].isprintable() and "\ufffd" not in base[i:i + 2])
    pattern = f"{re.escape(piece[0])}[{re.escape(piece[1])}]"
    r = server.post("/generate", json={"text": "Regex trim", "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "stop_regex": [pattern]}}).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": piece}
    assert r["text"] == base[:base.find(piece)]


@pytest.mark.parametrize("field,value", [("audio", {"voice": "alloy", "format": "wav"}),
                                         ("prediction", {"type": "content", "content": "x"}),
                                         ("modalities", ["text", "audio"])])
def test_openai_fields_we_cannot_honour_are_400(server, field, value):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    ok = {**body, field: None if field != "modalities" else ["text"]}
    assert server.post("/v1/chat/completions", json=ok).status_code == 200
