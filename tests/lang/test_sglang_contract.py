"""The server answers the requests SGLang's own frontend client sends, in the shapes it sends them."""

from __future__ import annotations

import json

import requests

from tests.lang.conftest import API_KEY

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PREFIX = "<|im_start|>user\nPick a colour.<|im_end|>\n<|im_start|>assistant\n"


def _post(url: str, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(url + path, json=body, headers=HEADERS, timeout=60, **kw)


def test_model_info_and_server_info(server_url):
    info = requests.get(server_url + "/get_model_info", headers=HEADERS, timeout=10).json()
    assert info["model_path"] and "is_generation" in info
    assert "internal_states" in requests.get(server_url + "/get_server_info", headers=HEADERS, timeout=10).json()


def test_precache_then_generate_with_null_fields(server_url):
    cached = _post(server_url, "/generate", {"text": PREFIX, "sampling_params": {"max_new_tokens": 0}}).json()
    assert cached["meta_info"]["completion_tokens"] == 0
    # SGLang sends every sampling field, unset ones as null, and the logprob fields as null too.
    body = {"text": PREFIX + "Red", "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 4,
        "min_new_tokens": None, "stop": None, "stop_token_ids": None, "temperature": 0, "top_p": None,
        "top_k": None, "min_p": None, "frequency_penalty": None, "presence_penalty": None, "ignore_eos": None,
        "regex": None, "json_schema": None},
        "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None,
        "return_text_in_logprobs": None}
    out = _post(server_url, "/generate", body).json()
    assert out["meta_info"]["completion_tokens"] == 4
    assert out["meta_info"]["cached_tokens"] >= cached["meta_info"]["prompt_tokens"] - 1


def test_select_scoring_batch(server_url):
    prompt_len = _post(server_url, "/generate", {"text": PREFIX, "sampling_params": {"max_new_tokens": 0}}
                       ).json()["meta_info"]["prompt_tokens"]
    start = max(prompt_len - 2, 0)
    choices = ["Red", "Green", "Blue"]
    body = {"text": [PREFIX + c for c in choices], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": start}
    outs = _post(server_url, "/generate", body).json()
    assert len(outs) == len(choices)
    for choice, out in zip(choices, outs):
        entries = out["meta_info"]["input_token_logprobs"]
        assert len(entries) == out["meta_info"]["prompt_tokens"] - start
        assert entries[0][0] is None and all(isinstance(e[0], float) for e in entries[1:])
        assert "".join(e[2] for e in entries).endswith(choice)
    # Unconditional likelihoods: the choice tokens on their own, by input_ids (SGLang leaves
    # logprob_start_len at its default here, which returns no prompt logprobs).
    ids = [[e[1] for e in out["meta_info"]["input_token_logprobs"]] for out in outs]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    uncond = _post(server_url, "/generate", body).json()
    assert [u["meta_info"]["prompt_tokens"] for u in uncond] == [len(x) for x in ids]
    body["logprob_start_len"] = 0
    uncond = _post(server_url, "/generate", body).json()
    assert [len(u["meta_info"]["input_token_logprobs"]) for u in uncond] == [len(x) for x in ids]


def test_stream_concat_flush(server_url):
    body = {"text": PREFIX, "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "stream": True}
    events = []
    with _post(server_url, "/generate", body, stream=True) as resp:
        for line in resp.iter_lines(decode_unicode=True):
            if line.startswith("data:"):
                events.append(line[len("data:"):].strip())
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))     # cumulative
    assert _post(server_url, "/concate_and_append_request", {"src_rids": ["a", "b"], "dst_rid": "c"}).ok
    assert requests.post(server_url + "/flush_cache", headers=HEADERS, timeout=30).ok
