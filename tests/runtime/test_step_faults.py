"""A step whose forward raises fails only that batch's requests; the scheduler keeps serving and its
page accounting stays exact (fault injected into one real forward of the tiny model)."""

from __future__ import annotations

import pytest

from kvstrata.args import ServerArgs
from kvstrata.runtime.messages import TokenizedGenerateReq
from kvstrata.runtime.sampling_params import SamplingParams
from kvstrata.runtime.scheduler import Scheduler

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def scheduler():
    s = Scheduler(ServerArgs(model_path="tiny", max_total_tokens=2048, random_seed=0, dtype="float32",
                             enable_deterministic_inference=True, page_size=4,
                             max_running_requests=2).resolve())     # r0, r1 run first; r2 comes later
    yield s
    s.close()


def request(rid: str, ids: list[int]) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=SamplingParams.from_dict(GREEDY))


def run(scheduler: Scheduler, reqs: list[TokenizedGenerateReq]) -> dict:
    """Add `reqs`, step until idle; returns the final output of each rid (with all its tokens)."""
    for r in reqs:
        assert scheduler.add_request(r) is None
    tokens: dict[str, list[int]] = {r.rid: [] for r in reqs}
    finals = {}
    for _ in range(500):
        if not scheduler.has_work():
            break
        for out in scheduler.step():
            tokens[out.rid] += out.new_token_ids
            if out.finished:
                finals[out.rid] = (out, list(tokens[out.rid]))
    assert not scheduler.has_work()
    return finals


class FaultyForward:
    """Wraps runner.forward: raises once, for the first batch that holds `rid`."""

    def __init__(self, forward, rid: str):
        self.forward, self.rid, self.failed_rids = forward, rid, None

    def __call__(self, batch, slot_table):
        if self.failed_rids is None and any(e.req.rid == self.rid for e in batch.entries):
            self.failed_rids = {e.req.rid for e in batch.entries}
            raise RuntimeError("injected fault: CUDA out of memory (simulated)")
        return self.forward(batch, slot_table)


PROMPTS = {f"r{i}": [(11 * i + 7 * k) % 500 + 3 for k in range(9 + 3 * i)] for i in range(4)}


def test_failing_forward_fails_its_batch_and_serving_goes_on(scheduler, caplog):
    clean = run(scheduler, [request(f"clean-{rid}", ids) for rid, ids in PROMPTS.items()])
    scheduler.cache.flush()
    free_before = scheduler.cache.available_pages()

    original = scheduler.runner.forward
    fault = FaultyForward(original, "r2")
    scheduler.runner.forward = fault
    try:
        finals = run(scheduler, [request(rid, ids) for rid, ids in PROMPTS.items()])
    finally:
        scheduler.runner.forward = original
    assert scheduler.runner.forward is original
    failed = {rid for rid, (out, _) in finals.items() if out.error is not None}
    assert failed == fault.failed_rids and "r2" in failed and set(finals) == set(PROMPTS)
    assert {"r0", "r1"} - failed          # some requests ran in other steps
    for rid, (out, tokens) in finals.items():
        if rid in failed:
            assert out.error_status == 500 and "injected fault" in out.error
            assert out.finish_reason["type"] == "abort"
        else:
            assert tokens == clean[f"clean-{rid}"][1]       # requests outside the failed batch are untouched
    assert any("r2" in rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR")
    scheduler.check_integrity()

    again = run(scheduler, [request(f"again-{rid}", ids) for rid, ids in PROMPTS.items()])
    for rid in PROMPTS:
        assert again[f"again-{rid}"][0].error is None
        assert again[f"again-{rid}"][1] == clean[f"clean-{rid}"][1]
    scheduler.check_integrity()
    scheduler.cache.flush()
    assert scheduler.cache.available_pages() == free_before
