"""Expert placement under --ep-size (model/expert_location.py): SGLang's --init-expert-location formats, the
balanced placement with spare copies, the per-batch split of a replicated expert's rows, and FusedExperts
over two in-process ranks against one rank holding every expert."""

from __future__ import annotations

import itertools
import json
import random
import threading

import pytest
import torch

from kvstrata.model.expert_location import (
    MIN_SHARE_ROWS,
    ExpertDispatch,
    ExpertLocationError,
    ExpertPlacement,
    _water_fill,
    balance_of,
)
from kvstrata.model.layers import make_batch_invariant
from kvstrata.model.moe import FusedExperts, route
from tests.runtime.helpers import NUMERIC_DTYPES


def test_trivial_placement_is_contiguous_and_spare_copies_wrap_around():
    placement = ExpertPlacement.trivial(layers=2, experts=4, ep_size=2, redundant=2)
    assert (placement.local_slots, placement.redundant) == (3, 2)
    assert [placement.held(r, 1) for r in (0, 1)] == [(0, 1, 2), (3, 0, 1)]
    assert placement.holders(0)[1] == [(0, 1), (1, 2)]       # expert 1: rank 0 slot 1, rank 1 slot 2
    assert ExpertPlacement.trivial(1, 4, 2).held(1, 0) == (2, 3)


@pytest.mark.parametrize("table, redundant, message", [
    ([[0, 1, 2]], 0, "has 3 slots, expected 4"),
    ([[0, 1, 2, 2]], 0, "does not hold each of the 4 experts"),
    ([[0, 1, 2, 5]], 0, "does not hold each of the 4 experts"),
    ([[0, 0, 1, 2, 3, 1]], 2, "rank 0 would hold an expert twice"),
    ([[0, 1, 2, 3, 0]], 1, "5 physical slots do not divide over --ep-size 2"),
])
def test_a_placement_that_cannot_serve_is_refused_naming_the_problem(table, redundant, message):
    with pytest.raises(ExpertLocationError, match=message):
        ExpertPlacement.checked(table, experts=4, ep_size=2, redundant=redundant)


def test_init_expert_location_reads_sglangs_formats(tmp_path):
    mapping = {"physical_to_logical_map": [[3, 2, 1, 0], [0, 1, 2, 3]]}
    path = tmp_path / "map.json"
    path.write_text(json.dumps(mapping))
    for spec in (str(path), json.dumps(mapping)):
        assert ExpertPlacement.of(spec, layers=2, experts=4, ep_size=2).held(0, 0) == (3, 2)
    # SGLang's dump: logical_count as a tensor, per pass ([passes][layers][experts]: summed over passes)
    pt = tmp_path / "dump.pt"
    torch.save({"logical_count": torch.tensor([[[9, 1, 1, 1]], [[9, 1, 1, 1]]])}, pt)
    placement = ExpertPlacement.of(str(pt), layers=1, experts=4, ep_size=2, redundant=2)
    # two spare copies: the busiest expert's, then (one copy per rank at most) the next busiest's
    assert [len(copies) for copies in placement.holders(0)] == [2, 2, 1, 1]
    assert sorted(placement.held(0, 0) + placement.held(1, 0)) == [0, 0, 1, 1, 2, 3]
    for spec, message in ((str(tmp_path / "missing.json"), "No such file"), ("{not json", "Expecting"),
                          ('{"weights": 1}', "expected 'physical_to_logical_map' or 'logical_count'"),
                          ('{"logical_count": [[1, 2, 3, 4]]}', "has 1 layers, the model 2"),
                          ('{"logical_count": [[1, 2], [3, 4]]}', "4 counts per layer"),
                          ('{"logical_count": [["a", 1, 1, 1], [1, 1, 1, 1]]}', "not a table of numbers"),
                          ("[1, 2]", "expected a JSON object")):
        with pytest.raises(ExpertLocationError, match=message):
            ExpertPlacement.of(spec, layers=2, experts=4, ep_size=2)


def test_balanced_placement_evens_out_the_recorded_rows_better_than_trivial():
    rng = random.Random(0)
    counts = [[rng.randrange(1, 400) + (2000 if e < 4 else 0) for e in range(32)] for _ in range(3)]  # 0-3 busy
    trivial = ExpertPlacement.trivial(3, 32, 2)
    for redundant in (0, 2, 4):
        balanced = ExpertPlacement.balanced(counts, ep_size=2, redundant=redundant)
        assert balanced.local_slots == 16 + redundant // 2
        assert balance_of(balanced, counts) < balance_of(trivial, counts)
    spare = ExpertPlacement.balanced(counts, ep_size=2, redundant=4)
    busiest = {e for layer in range(3) for e, copies in enumerate(spare.holders(layer)) if len(copies) == 2}
    assert busiest <= {0, 1, 2, 3}
    assert balance_of(spare, counts) < 1.01     # the copies' rows fill the lighter rank


@pytest.mark.parametrize("levels, rows", [([0, 0], 5), ([7, 2], 3), ([7, 2], 10), ([1, 9, 4], 7), ([3, 3, 3], 2)])
def test_water_fill_minimizes_the_highest_level(levels, rows):
    given = _water_fill(levels, rows)
    assert sum(given) == rows and min(given) >= 0
    best = min(max(lv + g for lv, g in zip(levels, split, strict=True))
               for split in itertools.product(range(rows + 1), repeat=len(levels)) if sum(split) == rows)
    assert max(lv + g for lv, g in zip(levels, given, strict=True)) == best


@pytest.mark.parametrize("most_rows", [300, 12])     # prefill-sized groups, decode-sized ones
def test_dispatch_gives_every_row_to_exactly_one_rank_and_evens_the_ranks_out(most_rows):
    rng = random.Random(1)
    placement = ExpertPlacement.trivial(1, 8, 2, redundant=4)   # experts 0-3 have two copies
    dispatches = [ExpertDispatch(placement, 0, r) for r in (0, 1)]
    for _ in range(50):
        counts = [rng.randrange(0, most_rows) for _ in range(8)]
        owner = [None] * sum(counts)
        loads, computed = [], []
        for rank, dispatch in enumerate(dispatches):
            spans = dispatch.spans(counts)
            loads.append(sum(end - start for _, start, end in spans))
            computed.append({dispatch.held[slot] for slot, _, _ in spans})
            for slot, start, end in spans:
                expert = dispatch.held[slot]
                first = sum(counts[:expert])
                assert first <= start < end <= first + counts[expert]     # within its expert's rows
                assert end - start >= min(MIN_SHARE_ROWS, counts[expert])  # no share too small to pay its read
                for row in range(start, end):
                    assert owner[row] is None
                    owner[row] = rank
        assert None not in owner
        if most_rows < MIN_SHARE_ROWS:    # decode: each expert's weights read by one rank only
            assert not computed[0] & computed[1]
        if sum(counts[:4]) >= sum(counts[4:8]) + MIN_SHARE_ROWS:   # enough shared rows to even the ranks out
            # decode: whole experts, the last one placed may tip it; prefill: a share too small to split
            assert abs(loads[0] - loads[1]) <= min(most_rows, MIN_SHARE_ROWS), (counts, loads)


class _PairGroup:
    """Two in-process ranks' all-reduce (threads meeting at a barrier), in rank order."""

    def __init__(self):
        self.barrier = threading.Barrier(2)
        self.parts: list = [None, None]

    def rank(self, rank: int, deterministic: bool):
        group = self

        class _Rank:
            size = 2

            def __init__(self):
                self.rank, self.deterministic = rank, deterministic

            def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
                group.parts[rank] = x
                group.barrier.wait()
                total = group.parts[0] + group.parts[1]
                group.barrier.wait()
                return total
        return _Rank()


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 256])
def test_two_ranks_with_spare_copies_compute_what_one_rank_with_every_expert_does(dtype, deterministic, tokens):
    """The same rows and weights; deterministic mode adds each row's outputs in one rank's order (exact),
    the default mode adds the ranks' combined outputs (within rounding)."""
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    experts, hidden, inter = 8, 64, 32
    one = FusedExperts(experts, hidden, inter)
    one.gate_up_proj.data = torch.randn(experts, 2 * inter, hidden, dtype=dtype) * 0.2
    one.down_proj.data = torch.randn(experts, hidden, inter, dtype=dtype) * 0.2
    x = torch.randn(tokens, hidden, dtype=dtype)
    logits = torch.randn(tokens, experts) * 3
    logits[:, [0, 5]] += 2          # the replicated experts are the busy ones
    weights, ids = route(logits, 2, True)
    placement = ExpertPlacement.of('{"physical_to_logical_map": [[5, 0, 1, 2, 3, 4, 5, 6, 7, 0]]}', 1, experts, 2, 2)
    group = _PairGroup()
    ranks = []
    for rank in (0, 1):
        dispatch = ExpertDispatch(placement, 0, rank)
        shard = FusedExperts(len(dispatch.held), hidden, inter, group.rank(rank, deterministic), dispatch)
        shard.gate_up_proj.data = one.gate_up_proj.data[list(dispatch.held)].clone()
        shard.down_proj.data = one.down_proj.data[list(dispatch.held)].clone()
        shard.bind()
        ranks.append(shard)
    one.bind()
    if deterministic:     # as the runner does in deterministic mode: products that do not depend on the rows
        for module in (one, *ranks):
            make_batch_invariant(module)
    expected = one(x, weights, ids)
    results: list = [None, None]
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, ranks[r](x, weights, ids))) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(results[0], results[1])
    counts = torch.bincount(ids.reshape(-1), minlength=experts).tolist()
    both = {ranks[0].held[slot] for slot, _, _ in ranks[0].dispatch.spans(counts)} & \
        {r.held[slot] for r in ranks[1:] for slot, _, _ in r.dispatch.spans(counts)}
    assert bool(both) == (tokens == 256)     # a prefill splits a replicated expert's rows, a decode never
    if deterministic:
        assert torch.equal(results[0], expected)
    else:
        torch.testing.assert_close(results[0], expected, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
