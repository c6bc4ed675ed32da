"""Engine: batching invariance, chunked prefill, pool pressure, bad input."""

from __future__ import annotations

import threading

import pytest

import kvstrata.engine as engine_module
from kvstrata.runtime.sampling_params import InvalidRequest
from tests.runtime.helpers import GREEDY, PROMPTS, assert_idle_integrity, make_engine


@pytest.fixture(scope="module")
def engine():
    eng = make_engine(disable_radix_cache=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def sequential(engine):
    """Reference: each prompt alone."""
    return [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]


def test_batched_equals_sequential(engine, sequential):
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in outs] == sequential
    assert all(o["meta_info"]["completion_tokens"] == len(o["output_ids"]) for o in outs)
    assert_idle_integrity(engine)
    state = assert_idle_integrity(engine)
    assert state["free_pages"] == state["capacity_pages"]


def test_chunked_prefill_equals_unchunked(sequential):
    eng = make_engine(disable_radix_cache=True, chunked_prefill_size=4)
    try:
        assert [eng.generate(p, GREEDY)["output_ids"] for p in PROMPTS] == sequential
        assert [o["output_ids"] for o in eng.generate(PROMPTS, GREEDY)] == sequential
        assert_idle_integrity(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("radix", [False, True])
def test_pool_pressure_retracts_and_recovers(sequential, radix):
    # 8 prompts × (≤ 30 prompt + 12 new) tokens, ×3 copies, in a 96-token pool: queueing and retraction.
    eng = make_engine(disable_radix_cache=not radix, max_total_tokens=96, chunked_prefill_size=32)
    try:
        outs = eng.generate(PROMPTS * 3, GREEDY)
        assert [o["output_ids"] for o in outs] == sequential * 3
        state = assert_idle_integrity(eng)
        if not radix:
            assert state["free_pages"] == state["capacity_pages"]
    finally:
        eng.shutdown()


def test_page_size_16_matches(sequential):
    eng = make_engine(page_size=16, chunked_prefill_size=32)
    try:
        assert [o["output_ids"] for o in eng.generate(PROMPTS, GREEDY)] == sequential
        assert_idle_integrity(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("params, field", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"n": 0}, "n"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"max_new_tokens": "many"}, "max_new_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop_regex": ["("]}, "stop_regex"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_invalid_sampling_params_name_the_field(engine, params, field):
    with pytest.raises(InvalidRequest, match=field):
        engine.generate("hello", params)


def test_prompt_longer_than_context_is_rejected(engine):
    too_long = [5] * (engine.scheduler.context_len + 1)
    with pytest.raises(InvalidRequest, match="context length"):
        engine.generate(input_ids=too_long, sampling_params={"max_new_tokens": 1})
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate(input_ids=[], sampling_params={"max_new_tokens": 1})
    with pytest.raises(InvalidRequest, match="outside"):
        engine.generate(input_ids=[10**9], sampling_params={"max_new_tokens": 1})
    assert engine.generate("still serving", GREEDY)["meta_info"]["completion_tokens"] > 0
    assert_idle_integrity(engine)


@pytest.mark.parametrize("radix", [False, True])
def test_decode_growth_forces_retraction(radix):
    long = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    prompts = PROMPTS[:6]
    ref = make_engine(disable_radix_cache=True)
    try:
        expected = [ref.generate(p, long)["output_ids"] for p in prompts]
    finally:
        ref.shutdown()
    eng = make_engine(disable_radix_cache=not radix, max_total_tokens=128, chunked_prefill_size=32)
    try:
        outs = eng.generate(prompts, long)
        assert [o["output_ids"] for o in outs] == expected
        state = assert_idle_integrity(eng)
        assert state["retractions"] > 0, "the workload was meant to overflow the pool while decoding"
    finally:
        eng.shutdown()


def test_the_scheduler_is_built_on_the_engine_thread(monkeypatch, sequential):
    # torch's OpenMP keeps a pool per thread that runs parallel work: a model built on the caller's thread
    # leaves a second pool, and every parallel region of the scheduler thread then wakes sleeping workers
    built_on = []
    real = engine_module.Scheduler

    def recording(args, **kwargs):
        built_on.append(threading.current_thread())
        return real(args, **kwargs)

    monkeypatch.setattr(engine_module, "Scheduler", recording)
    eng = make_engine(disable_radix_cache=True)
    try:
        assert built_on == [eng._thread] and eng._thread is not threading.current_thread()
        assert eng.generate(PROMPTS[0], GREEDY)["output_ids"] == sequential[0]
        assert_idle_integrity(eng)
    finally:
        eng.shutdown()


def test_a_scheduler_that_cannot_be_built_raises_to_the_caller(monkeypatch):
    def broken(args, **kwargs):
        raise RuntimeError("no weights here")

    monkeypatch.setattr(engine_module, "Scheduler", broken)
    with pytest.raises(RuntimeError, match="no weights here"):
        make_engine()
