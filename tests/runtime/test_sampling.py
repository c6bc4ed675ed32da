"""Sampling: seeds, top_k=1, stop conditions, n, penalties, logprobs, streaming."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.runtime.helpers import GREEDY, assert_idle_integrity, make_engine

PROMPT = "Tell me a story about a cache"


@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.shutdown()


def test_seeded_sampling_is_reproducible(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "sampling_seed": 1234}
    a = engine.generate(PROMPT, params)["output_ids"]
    b = engine.generate(PROMPT, params)["output_ids"]
    c = engine.generate(PROMPT, {**params, "sampling_seed": 99})["output_ids"]
    assert a == b
    assert a != c


def test_top_k_1_equals_greedy(engine):
    greedy = engine.generate(PROMPT, GREEDY)["output_ids"]
    topk1 = engine.generate(PROMPT, {"temperature": 1.0, "top_k": 1, "max_new_tokens": 12})["output_ids"]
    assert topk1 == greedy


def test_stop_strings_never_returned(engine):
    base = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
    text = base["text"]
    assert len(text) > 6
    stop = text[3:6]
    out = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "stop": [stop], "ignore_eos": True})
    assert stop not in out["text"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert text.startswith(out["text"])
    kept = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "stop": [stop], "no_stop_trim": True,
                                    "ignore_eos": True})
    assert stop in kept["text"]


def test_stop_token_ids_and_lengths(engine):
    base = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True})["output_ids"]
    out = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 10, "stop_token_ids": [base[4]],
                                   "ignore_eos": True})
    assert out["output_ids"] == base[: base.index(base[4]) + 1]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    length = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    forced = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 10, "min_new_tokens": 10,
                                      "stop_token_ids": [base[0]]})
    assert len(forced["output_ids"]) == 10


def test_n_samples(engine):
    outs = engine.generate([PROMPT, "other"], {"temperature": 1.0, "max_new_tokens": 8, "n": 2, "sampling_seed": 7})
    assert len(outs) == 4
    assert outs[0]["output_ids"] != outs[1]["output_ids"]


def test_penalties_change_output(engine):
    plain = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})["output_ids"]
    pen = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True,
                                   "frequency_penalty": 2.0, "repetition_penalty": 1.5})["output_ids"]
    assert pen != plain
    # a strong presence penalty forbids repeats in practice
    assert len(set(pen)) >= len(set(plain))


def test_logprobs(engine):
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = engine.generate(input_ids=prompt_ids, sampling_params={"temperature": 0, "max_new_tokens": 5},
                          return_logprob=True, logprob_start_len=2, top_logprobs_num=3)
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(prompt_ids) - 2
    assert inp[0][0] is None and [t for _, t, _ in inp] == prompt_ids[2:]
    assert all(lp <= 0 for lp, _, _ in inp[1:])
    outp = meta["output_token_logprobs"]
    assert [t for _, t, _ in outp] == out["output_ids"]
    assert len(outp) == len(out["output_ids"]) > 0
    for (lp, tid, _), top in zip(outp, meta["output_top_logprobs"], strict=True):
        assert len(top) == 3
        assert top[0][1] == tid and math.isclose(top[0][0], lp, rel_tol=1e-5, abs_tol=1e-6)  # greedy = top-1


def test_max_new_tokens_zero_scores_prompt(engine):
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=0)
    assert out["output_ids"] == []
    assert len(out["meta_info"]["input_token_logprobs"]) == len(ids)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert_idle_integrity(engine)


def test_async_streaming_matches_generate(engine):
    # 64 tokens: tokens the reader has not taken yet arrive as one chunk, and a fast CPU makes 12 tokens
    # in less than one GIL switch interval (5 ms)
    params = {**GREEDY, "max_new_tokens": 64, "ignore_eos": True}
    expected = engine.generate(PROMPT, params)

    async def collect():
        chunks = []
        async for chunk in await engine.async_generate(PROMPT, params, stream=True):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(collect())
    assert len(chunks) >= 2
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths)
    assert chunks[-1]["output_ids"] == expected["output_ids"]
    assert chunks[-1]["text"] == expected["text"]
    single = asyncio.run(engine.async_generate(PROMPT, params))
    assert single["output_ids"] == expected["output_ids"]


@pytest.mark.parametrize("params", [
    {"temperature": 0.7, "repetition_penalty": 1e-300},      # divides positive logits into +inf
    {"temperature": 1.1e-5},                                   # just above greedy: logits / T overflow
    {"temperature": 0.5, "presence_penalty": -2, "frequency_penalty": -2, "repetition_penalty": 2},
], ids=["tiny-repetition-penalty", "tiny-temperature", "extreme-penalties"])
def test_extreme_but_valid_sampling_params_still_sample(engine, params):
    out = engine.generate("hello there, again and again", {**params, "max_new_tokens": 8, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 8
    assert_idle_integrity(engine)
