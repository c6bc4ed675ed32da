"""Request priority (SGLang's `priority` field): the waiting queue's order under --enable-priority-scheduling,
and the radix tree's `priority` eviction policy, where a finished request's prefix keeps its priority."""

from __future__ import annotations

from typing import Optional

import pytest

from kvstrata.args import ServerArgs
from kvstrata.runtime.messages import TokenizedGenerateReq
from kvstrata.runtime.req import Req
from kvstrata.runtime.sampling_params import SamplingParams
from kvstrata.runtime.scheduler import Scheduler

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


def _scheduler(**kwargs) -> Scheduler:
    opts = dict(model_path="tiny", max_total_tokens=4096, random_seed=0, dtype="float32", kv_run_spare_tokens=0)
    return Scheduler(ServerArgs(**{**opts, **kwargs}).resolve())


def _prompt(i: int, length: int = 40) -> list[int]:
    return [(11 * i + 5 * j) % 700 + 20 for j in range(length)]


def _add(scheduler: Scheduler, rid: str, ids: list[int], priority: Optional[int]):
    return scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=ids, priority=priority,
                                                      sampling_params=SamplingParams.from_dict(GREEDY)))


def _finish_order(scheduler: Scheduler) -> list[str]:
    order = []
    while scheduler.has_work():
        order += [out.rid for out in scheduler.step() if out.finished]
    return order


@pytest.mark.parametrize("flags,expected", [
    ({"enable_priority_scheduling": True}, ["hi0", "hi1", "hi2", "lo0", "lo1", "lo2"]),
    ({"enable_priority_scheduling": True, "schedule_low_priority_values_first": True},
     ["lo0", "lo1", "lo2", "hi0", "hi1", "hi2"]),
    ({}, ["lo0", "lo1", "lo2", "hi0", "hi1", "hi2"]),      # off: first come, first served
])
def test_under_a_saturated_queue_high_priority_requests_finish_first(flags, expected):
    scheduler = _scheduler(max_running_requests=1, disable_radix_cache=True, **flags)
    try:
        for i in range(3):
            assert _add(scheduler, f"lo{i}", _prompt(i), priority=0) is None
        for i in range(3):
            assert _add(scheduler, f"hi{i}", _prompt(10 + i), priority=10) is None
        assert _finish_order(scheduler) == expected
    finally:
        scheduler.close()


def test_a_priority_is_refused_when_asked_and_scheduling_by_it_is_off():
    scheduler = _scheduler(abort_on_priority_when_disabled=True)
    try:
        out = _add(scheduler, "r", _prompt(0), priority=3)
        assert out is not None and out.error_status == 400 and "--enable-priority-scheduling" in out.error
        assert _add(scheduler, "s", _prompt(1), priority=None) is None
    finally:
        scheduler.close()


def test_a_full_queue_refuses_the_next_request_with_503():
    scheduler = _scheduler(max_queued_requests=2)
    try:
        assert _add(scheduler, "a", _prompt(0), None) is None and _add(scheduler, "b", _prompt(1), None) is None
        out = _add(scheduler, "c", _prompt(2), None)
        assert out is not None and out.error_status == 503 and out.error == "The request queue is full."
        assert [r.rid for r in scheduler.waiting] == ["a", "b"]
    finally:
        scheduler.close()


@pytest.mark.parametrize("policy,survives", [("priority", True), ("lru", False)])
def test_a_high_priority_prefix_outlives_low_priority_ones_of_the_same_age(policy, survives):
    """Three prefixes finish in the same step, one of them high-priority; a wave of new low-priority prompts
    then needs most of the pool. With `priority` eviction the high one stays cached, the others go."""
    scheduler = _scheduler(max_total_tokens=400, radix_eviction_policy=policy)
    length = 100
    try:
        _add(scheduler, "high", _prompt(0, length), priority=10)
        for i in (1, 2):
            _add(scheduler, f"low{i}", _prompt(i, length), priority=0)
        _finish_order(scheduler)
        for i in range(3, 6):            # the eviction wave, one at a time
            _add(scheduler, f"wave{i}", _prompt(i, length), priority=0)
            _finish_order(scheduler)

        def cached(i: int) -> int:
            probe = Req(rid="probe", prompt_ids=_prompt(i, length), sampling=SamplingParams.from_dict(GREEDY))
            return scheduler.cache.peek_cached_tokens(probe)

        assert cached(1) < length and cached(2) < length                 # low-priority prefixes were evicted
        assert (cached(0) == length) is survives, [cached(i) for i in range(6)]
        scheduler.check_integrity()
    finally:
        scheduler.close()
