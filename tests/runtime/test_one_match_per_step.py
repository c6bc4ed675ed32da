"""The step that admits a request walks the radix tree once for its prompt (issue 45).

Ordering the queue (lpm), the L3 readiness check, the admission plan and the admission itself all ask the
cache what a request's prompt hits; they share one match, memoised on the request's KV handle until the
tree changes. Before, the admitting step walked the tree up to five times per request. The spy counts
every match walk the scheduling part of a step makes (the forward and the commits after it are not counted).
"""

from __future__ import annotations

from kvstrata.args import ServerArgs
from kvstrata.cache.radix_tree import RadixTree
from kvstrata.runtime.messages import TokenizedGenerateReq
from kvstrata.runtime.sampling_params import SamplingParams
from kvstrata.runtime.scheduler import Scheduler

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
HISTORY = [(5 * j) % 90 + 20 for j in range(48)]


def _submit(scheduler: Scheduler, rid: str, ids: list[int]) -> None:
    scheduler.add_request(TokenizedGenerateReq(rid=rid, input_ids=ids, stream=False,
                                               sampling_params=SamplingParams.from_dict(GREEDY)))


def test_the_admitting_step_matches_each_prompt_once(tmp_path, monkeypatch):
    scheduler = Scheduler(ServerArgs(
        model_path="tiny", max_total_tokens=4096, random_seed=0, dtype="float32", schedule_policy="lpm",
        enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
        hicache_storage_page_tokens=16).resolve())
    walks: list[tuple[int, ...]] = []
    scheduling = [False]
    match_prefix = RadixTree.match_prefix

    def counting_match(tree, token_ids, namespace=None, record=True):
        if scheduling[0]:
            walks.append(tuple(token_ids))
        return match_prefix(tree, token_ids, namespace, record)

    forward = scheduler.runner.forward

    def forward_after_scheduling(batch, slots):
        scheduling[0] = False
        return forward(batch, slots)

    monkeypatch.setattr(RadixTree, "match_prefix", counting_match)
    scheduler.runner.forward = forward_after_scheduling
    try:
        _submit(scheduler, "history", HISTORY)
        while scheduler.has_work():
            scheduler.step()
        prompts = {f"q{i}": HISTORY + [200 + 10 * i + j for j in range(8)] for i in range(2)}
        for rid, ids in prompts.items():
            _submit(scheduler, rid, ids)
        admitted_in: dict[str, list[tuple[int, ...]]] = {}
        while len(admitted_in) < len(prompts):
            walks.clear()
            scheduling[0] = True
            scheduler.step()
            for req in scheduler.running:
                if req.rid in prompts and req.rid not in admitted_in:
                    assert req.cached_tokens >= len(HISTORY) - 16, f"{req.rid} missed the cached history"
                    admitted_in[req.rid] = list(walks)
        for rid, step_walks in admitted_in.items():
            ids = prompts[rid]
            own = [w for w in step_walks if len(w) > len(HISTORY) and list(w) == ids[:len(w)]]
            assert len(own) == 1, f"{rid}: {len(own)} match walks in the step that admitted it"
        while scheduler.has_work():
            scheduler.step()
        scheduler.check_integrity()
    finally:
        scheduler.close()
