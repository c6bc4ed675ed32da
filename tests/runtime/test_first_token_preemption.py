"""A request waiting for its first token may pause a decode whose KV the host tier keeps.

Three requests arrive together; the device pool holds two. With --preempt-for-first-token (the default
with a host tier) the third starts before either of the first two has finished, and every output is still
the one computed without any cache. Without the flag, or without a host tier, it waits for a finish.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.runtime.helpers import NUMERIC_DTYPES, assert_idle_integrity, make_engine

NEW_TOKENS = 64
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
PROMPTS = [[(17 * c + 5 * i) % 200 + 20 for i in range(60)] for c in range(3)]
# Two requests (60 prompt + 64 new tokens, plus the decode headroom reserved for them) fit; three do not.
# 64 new tokens leave the pause a window of many steps: a victim's pages can be freed only once their host
# copies are acknowledged, and with 24 tokens the first two could finish first on a loaded machine.
SMALL_POOL = {"max_total_tokens": 256, "chunked_prefill_size": 64}


async def _stream_events(engine) -> tuple[list[tuple[str, int]], list[list[int]]]:
    """Run the three prompts concurrently; returns (events in arrival order, outputs). An event is
    ("first", i) at request i's first token and ("done", i) at its last."""
    events: list[tuple[str, int]] = []
    outputs: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        stream = await engine.async_generate(input_ids=PROMPTS[i], sampling_params=GREEDY, stream=True)
        async for chunk in stream:
            if chunk["output_ids"] and not outputs[i]:
                events.append(("first", i))
            outputs[i] = chunk["output_ids"]
        events.append(("done", i))

    await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    return events, outputs


def run(engine) -> tuple[list[tuple[str, int]], list[list[int]]]:
    return asyncio.run(_stream_events(engine))


@pytest.fixture(scope="module", params=NUMERIC_DTYPES)
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(dtype) -> list[list[int]]:
    eng = make_engine(disable_radix_cache=True, dtype=dtype)
    try:
        return [eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    finally:
        eng.shutdown()


def _last_first_token_before_any_finish(events: list[tuple[str, int]]) -> bool:
    firsts = [k for k, (kind, _) in enumerate(events) if kind == "first"]
    dones = [k for k, (kind, _) in enumerate(events) if kind == "done"]
    return len(firsts) == len(PROMPTS) and max(firsts) < min(dones)


def test_waiting_request_pauses_a_decode_and_outputs_do_not_change(reference, dtype):
    eng = make_engine(enable_hierarchical_cache=True, hicache_ratio=4, dtype=dtype, **SMALL_POOL)
    try:
        events, outputs = run(eng)
        assert outputs == reference
        assert _last_first_token_before_any_finish(events), events
        state = assert_idle_integrity(eng)
        # One pause for the one request that had to wait; a paused request never pauses another.
        assert state["preemptions"] == 1, state
        assert state["retractions"] == 0, state
        assert state["hicache"]["load_back_pages"] > 0, "the paused request resumes by load-back"
    finally:
        eng.shutdown()


@pytest.mark.parametrize("opts", [{"enable_hierarchical_cache": True, "hicache_ratio": 4,
                                   "preempt_for_first_token": False}, {}],
                         ids=["flag-off", "no-host-tier"])
def test_without_flag_or_host_tier_the_third_request_waits(reference, dtype, opts):
    eng = make_engine(dtype=dtype, **SMALL_POOL, **opts)
    try:
        events, outputs = run(eng)
        assert outputs == reference
        assert not _last_first_token_before_any_finish(events), events
        state = assert_idle_integrity(eng)
        assert state["preemptions"] == 0, state
    finally:
        eng.shutdown()


def test_many_waiting_requests_finish_with_bounded_pauses(dtype):
    prompts = [[(13 * c + 7 * i) % 200 + 20 for i in range(40 + 9 * c)] for c in range(6)]
    ref_engine = make_engine(disable_radix_cache=True, dtype=dtype)
    try:
        reference = [ref_engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    finally:
        ref_engine.shutdown()
    eng = make_engine(enable_hierarchical_cache=True, hicache_ratio=4, dtype=dtype, **SMALL_POOL)
    try:
        outputs = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert outputs == reference
        state = assert_idle_integrity(eng)
        # Only the four requests that found the pool full pause others (one victim each makes room here).
        assert 0 < state["preemptions"] <= len(prompts) - 2, state
    finally:
        eng.shutdown()
