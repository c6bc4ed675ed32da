"""Programs against a live server and the in-process engine: chat, few-shot, select, fork, stream, batch."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import jsonschema
import pytest

import kvstrata.lang as sgl
from kvstrata.lang.tracer import trace_prefix
from tests.lang.programs import (
    COLOR_SCHEMA,
    PERSON_SCHEMA,
    SHARED_PREFIX,
    SYSTEM_PROMPT,
    branches,
    constrained,
    few_shot_qa,
    generate_json,
    multi_turn_chat,
    pick_city,
    support_ticket,
)

GREEDY = {"temperature": 0}


def test_multi_turn_chat_follows_the_chat_template(backend):
    s = multi_turn_chat.run("What is a KV cache?", "Why page it?", backend=backend, **GREEDY)
    messages = s.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == s["answer_1"] and messages[4]["content"] == s["answer_2"]
    assert messages[1]["content"] == "What is a KV cache?"
    # The text is exactly what the model's own template renders for these messages.
    assert s.text() == backend.tokenizer.apply_chat_template(messages, tokenize=False)
    first, second = s.get_meta_info("answer_1"), s.get_meta_info("answer_2")
    assert first["completion_tokens"] == 12 and second["completion_tokens"] == 12
    # Turn 2's prompt starts with turn 1's, which the radix cache kept.
    assert second["cached_tokens"] >= first["prompt_tokens"] - 2


def test_few_shot_qa_stops_at_the_stop_string(backend):
    free = few_shot_qa.run("What is a radix tree?", backend=backend, **GREEDY)["answer"]
    stop = next((free[i:i + 2] for i in range(3, len(free) - 1) if free[i:i + 2].isprintable()
                 and free[i:i + 2].strip() == free[i:i + 2]), None)
    assert stop is not None, f"no usable stop string in {free!r}"
    s = few_shot_qa.run("What is a radix tree?", stop=stop, backend=backend, **GREEDY)
    assert s["answer"] == free[:free.index(stop)]
    assert s.get_meta_info("answer")["finish_reason"]["type"] == "stop"
    assert s.text().endswith("A:" + s["answer"])


@pytest.mark.parametrize("method", [sgl.token_length_normalized, sgl.greedy_token_selection,
                                    sgl.unconditional_likelihood_normalized])
def test_select_returns_a_choice_with_scores(backend, method):
    s = pick_city.run(choices_method=method, backend=backend)
    meta = s.get_meta_info("city")
    choices = meta["choices"]
    assert s["city"] in choices
    assert s.messages()[-1] == {"role": "assistant", "content": s["city"]}
    assert len(meta["scores"]) == len(meta["normalized_prompt_logprobs"]) == len(choices)
    per_choice = meta["input_token_logprobs"]
    assert all(len(entries) >= 1 for entries in per_choice)
    if method is sgl.token_length_normalized:
        best = max(range(len(choices)), key=lambda i: meta["normalized_prompt_logprobs"][i])
        assert s["city"] == choices[best]
    if method is sgl.greedy_token_selection:
        firsts = [entries[0][0] for entries in per_choice]
        assert firsts[choices.index(s["city"])] == max(firsts)
    if method is sgl.unconditional_likelihood_normalized:
        assert meta["unconditional_token_logprobs"] is not None
        assert s["city"] == choices[max(range(len(choices)), key=lambda i: meta["scores"][i])]


def test_select_scores_match_full_prompt_logprobs(backend):
    """The select window (logprob_start_len near the end) scores what a full-prompt request scores."""
    s = pick_city.run(backend=backend)
    meta = s.get_meta_info("city")
    prefix = s.text().rsplit(s["city"], 1)[0]      # the text before the select
    for choice, entries, mean in zip(meta["choices"], meta["input_token_logprobs"],
                                     meta["normalized_prompt_logprobs"]):
        ids = backend.encode(prefix + choice)
        full = backend.prompt_logprobs([ids], 0)[0]
        tail = full[len(ids) - len(entries):]
        assert [e[1] for e in tail] == [e[1] for e in entries]
        assert [e[0] for e in tail] == pytest.approx([e[0] for e in entries], abs=1e-3)
        assert mean == pytest.approx(sum(e[0] for e in tail) / len(tail), abs=1e-3)


def test_fork_branches_reuse_the_shared_prefix(backend):
    s = branches.run(3, backend=backend, **GREEDY)
    points = s["point"]
    assert isinstance(points, list) and len(points) == 3
    prefix_tokens = len(backend.encode(SHARED_PREFIX))
    for meta in s.get_meta_info("point"):
        assert meta["cached_tokens"] >= prefix_tokens - 2, meta
    assert s.text() == SHARED_PREFIX          # gather_variable leaves the source's text alone


def test_streamed_fork_branches(backend):
    @sgl.function
    def streamed(s):
        s += SHARED_PREFIX
        forks = s.fork(2)
        forks += "Point:" + sgl.gen("point", max_tokens=6)
        pieces = [list(branch.text_iter()) for branch in forks]     # a branch ends when its queue does
        forks.join()
        s.set_var("pieces", pieces)

    s = streamed.run(backend=backend, stream=True, **GREEDY)
    assert "".join(s.text_iter()) == SHARED_PREFIX
    assert len(s["pieces"]) == len(s["point"]) == 2
    for pieces, point in zip(s["pieces"], s["point"], strict=True):
        assert "".join(pieces) == "Point:" + point      # a branch streams what it adds


def test_fork_concate_and_append(backend):
    s = branches.run(2, mode="concate_and_append", backend=backend, **GREEDY)
    gathered = branches.run(2, backend=backend, **GREEDY)["point"]
    assert s.text() == SHARED_PREFIX + "".join(f"Point {i + 1}:{p}" for i, p in enumerate(gathered))


def test_streaming_with_text_iter(backend):
    s = multi_turn_chat.run("Stream this", "And this", stream=True, backend=backend, **GREEDY)
    chunks = list(s.text_iter())
    assert len(chunks) > 10
    assert "".join(chunks) == s.text()
    reference = multi_turn_chat.run("Stream this", "And this", backend=backend, **GREEDY)
    assert s.text() == reference.text()
    s = multi_turn_chat.run("Stream this", "And this", stream=True, backend=backend, **GREEDY)
    answer_chunks = list(s.text_iter("answer_1"))
    # How many pieces a 12-token answer comes in depends on timing: tokens the reader has not taken yet
    # arrive together (a fast engine sent all 12 at once), so only the pieces' sum is checked.
    assert answer_chunks and "".join(answer_chunks) == reference["answer_1"]
    s.sync()    # the program goes on after answer_1: let it end before the next one starts

    # Without iterating, reading a streamed state waits for the whole program.
    s = multi_turn_chat.run("Stream this", "And this", stream=True, backend=backend, **GREEDY)
    assert s["answer_2"] == reference["answer_2"]
    s = multi_turn_chat.run("Stream this", "And this", stream=True, backend=backend, **GREEDY)
    assert s.text() == reference.text()

    async def collect(state):
        return [piece async for piece in state.text_async_iter()]

    s = multi_turn_chat.run("Stream this", "And this", stream=True, backend=backend, **GREEDY)
    assert "".join(asyncio.run(collect(s))) == reference.text()


def test_regex_and_json_schema_gen(backend):
    s = constrained.run(backend=backend, **GREEDY)
    checks = {"ext": lambda v: re.fullmatch(r"[0-9]{3}-[0-9]{2}", v),
              "number": lambda v: re.fullmatch(r"-?\d+", v),
              "person": lambda v: jsonschema.validate(json.loads(v), PERSON_SCHEMA) is None,
              "color": lambda v: jsonschema.validate(json.loads(v), COLOR_SCHEMA) is None}
    finished = 0
    for name, check in checks.items():
        if s.get_meta_info(name)["finish_reason"]["type"] == "stop":
            assert check(s[name]), (name, s[name])
            finished += 1
    # Short enough to always finish, even with random weights (which pad JSON objects with whitespace).
    assert re.fullmatch(r"[0-9]{3}-[0-9]{2}", s["ext"])
    assert json.loads(s["color"]) in COLOR_SCHEMA["enum"]
    assert finished >= 2      # ext and color always; number and person when the random model stops


def test_seed_example_generate_json(backend):
    s = generate_json.run(backend=backend, **GREEDY)
    out = s["json_output"]
    assert s.text().endswith(out + "<|im_end|>\n")
    if s.get_meta_info("json_output")["finish_reason"]["type"] == "stop":
        assert re.fullmatch(r"\{.*\}", out), out
    else:
        assert out.startswith("{"), out


def test_run_batch_of_16_precaches_the_common_prefix(backend):
    sgl.flush_cache(backend)
    questions = [f"Question number {i}: what is page {i}?" for i in range(16)]
    states = support_ticket.run_batch([{"question": q} for q in questions], backend=backend,
                                      progress_bar=True, **GREEDY)
    assert len(states) == 16
    # run_batch traced the program's constant prefix (the system message) and pre-cached it before
    # starting the programs, so every one of them found it cached.
    prefix = trace_prefix(support_ticket.func, backend, ["question"])
    assert prefix == backend.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}],
                                                           tokenize=False)
    prefix_tokens = len(backend.encode(prefix))
    for q, s in zip(questions, states):
        assert s.messages()[1]["content"] == q
        assert s.get_meta_info("reply")["cached_tokens"] >= prefix_tokens - 1
    alone = support_ticket.run(questions[5], backend=backend, **GREEDY)
    assert alone.text() == states[5].text()


def test_flush_cache_and_server_info(backend):
    sgl.flush_cache(backend)
    first = support_ticket.run("Flushed?", backend=backend, **GREEDY).get_meta_info("reply")
    second = support_ticket.run("Flushed?", backend=backend, **GREEDY).get_meta_info("reply")
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] >= second["prompt_tokens"] - 1
    info = sgl.get_server_info(backend)
    assert info["internal_states"][0]["running_requests"] == 0


def test_default_backend(backend):
    sgl.set_default_backend(backend)
    try:
        assert sgl.get_default_backend() is backend
        s = support_ticket("Default?", **GREEDY)
        assert s["reply"] == support_ticket.run("Default?", backend=backend, **GREEDY)["reply"]
    finally:
        sgl.set_default_backend(None)


def test_no_threads_left_behind(backend):
    branches.run(2, backend=backend, stream=True, **GREEDY).text()
    support_ticket.run_batch([{"question": "a"}, {"question": "b"}], backend=backend, **GREEDY)
    deadline = time.monotonic() + 5
    while any(t.name.startswith("kvstrata-lang") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)
