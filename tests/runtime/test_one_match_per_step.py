"""The step that admits a request walks the radix tree once for its prompt (issue 45).

Ordering the queue (lpm), the L3 readiness check, the admission plan and the admission itself all ask the
cache what a request's prompt hits; they share one match, memoised on the request's KV handle until the
tree changes. Before, the admitting step walked the tree up to five times per request. The spy counts
every match walk the scheduling part of each step makes (the forward and the commits after it are not
counted), from the requests' arrival to their admission.
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
        admitted: set[str] = set()
        most: dict[str, int] = dict.fromkeys(prompts, 0)   # the most walks of a prompt in one step
        while len(admitted) < len(prompts):
            walks.clear()
            scheduling[0] = True
            scheduler.step()
            for rid, ids in prompts.items():
                if rid not in admitted:
                    own = sum(1 for w in walks if len(w) > len(HISTORY) and list(w) == ids[:len(w)])
                    most[rid] = max(most[rid], own)
            for req in scheduler.running:
                if req.rid in prompts and req.rid not in admitted:
                    assert req.cached_tokens >= len(HISTORY) - 16, f"{req.rid} missed the cached history"
                    admitted.add(req.rid)
        # At most one: none when the match memoised in an earlier step (or on arrival) is still valid.
        assert all(n <= 1 for n in most.values()), f"match walks of a prompt in one step: {most}"
        while scheduler.has_work():
            scheduler.step()
        scheduler.check_integrity()
    finally:
        scheduler.close()
