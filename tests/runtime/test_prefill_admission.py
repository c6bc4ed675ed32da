"""--prefill-admit-threshold: a step stops taking new prompts once it holds that many prefill tokens, so
simultaneous long prompts are prefilled one per step (each gets its first token sooner) while short ones
still share a step; outputs do not change and the pages all come back."""

from __future__ import annotations

import pytest

from kvstrata.args import ConfigError, ServerArgs
from kvstrata.runtime.messages import TokenizedGenerateReq
from kvstrata.runtime.sampling_params import SamplingParams
from kvstrata.runtime.scheduler import Scheduler

GREEDY = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}


def _scheduler(threshold: int) -> Scheduler:
    return Scheduler(ServerArgs(model_path="tiny", max_total_tokens=4096, random_seed=0, dtype="float32",
                                enable_deterministic_inference=True, disable_radix_cache=True,
                                prefill_admit_threshold=threshold).resolve())


def _run(scheduler: Scheduler, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, int], dict]:
    """Prefill entry sizes per step, the step at which each request got its first token, and its tokens."""
    steps: list[list[int]] = []
    forward = scheduler.runner.forward

    def recording(batch, slots):
        steps.append([e.extend_len for e in batch.entries if e.extend_len > 1])
        return forward(batch, slots)

    scheduler.runner.forward = recording
    for i, ids in enumerate(prompts):
        scheduler.add_request(TokenizedGenerateReq(rid=f"r{i}", input_ids=ids, stream=True,
                                                   sampling_params=SamplingParams.from_dict(GREEDY)))
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    while scheduler.has_work():
        for out in scheduler.step():
            if out.new_token_ids:
                first.setdefault(out.rid, len(steps))
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)
    scheduler.runner.forward = forward
    return steps, first, tokens


def _prompts(count: int, length: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 200 + 20 for j in range(length)] for i in range(count)]


def test_long_prompts_take_a_step_each_short_ones_share():
    long, short = _prompts(3, 300), _prompts(5, 20)
    eager, lazy = _scheduler(0), _scheduler(256)
    try:
        steps, first, tokens = _run(eager, long)
        assert steps[0] == [300, 300, 300] and set(first.values()) == {1}
        steps, first, same_tokens = _run(lazy, long)
        assert [s for s in steps if s] == [[300], [300], [300]]
        assert [first[f"r{i}"] for i in range(3)] == [1, 2, 3]    # the first prompt no longer waits for all
        assert same_tokens == tokens
        steps, _, _ = _run(lazy, short)
        assert steps[0] == [20] * 5                                  # 100 tokens: one step
        for s in (eager, lazy):
            s.cache.check_integrity([])      # raises if a page or slot-table row leaked
    finally:
        eager.close()
        lazy.close()


def test_defaults_and_bad_value():
    assert ServerArgs(model_path="tiny").prefill_admit_threshold is None
    # CPU steps are compute-bound from ~256 tokens; on CUDA a step fills the budget, as SGLang does.
    assert ServerArgs(model_path="tiny", device="cpu").resolve().prefill_admit_threshold == 256
    assert ServerArgs(model_path="tiny", device="cpu", prefill_admit_threshold=0).resolve().prefill_admit_threshold == 0
    with pytest.raises(ConfigError, match="prefill-admit-threshold"):
        ServerArgs(model_path="tiny", prefill_admit_threshold=-1)
