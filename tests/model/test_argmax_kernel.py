"""The compiled row argmax (csrc/greedy.cpp) returns what torch.argmax(x, dim=-1) does: the first maximum, the
first NaN of a row that has one, 0 for a row of -inf. Skipped where the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from kvstrata.model.paged_kernels import argmax_op
from kvstrata.runtime.req import Req
from kvstrata.runtime.sampler import Sampler
from kvstrata.runtime.sampling_params import SamplingParams
from tests.capabilities import requires_cpu_kernels

OP = argmax_op()
pytestmark = requires_cpu_kernels
DTYPES = (torch.float32, torch.bfloat16)
NAN, INF = float("nan"), float("inf")


def assert_same(x: torch.Tensor) -> None:
    assert torch.equal(OP(x), torch.argmax(x, dim=-1)), x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 32000), (1, 32000), (3, 7), (5, 33), (4, 1), (2, 17), (0, 9)])
def test_random_rows(shape, dtype):
    g = torch.Generator().manual_seed(shape[1])
    assert_same(torch.randn(*shape, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_first_maximum_wins(dtype):
    x = torch.zeros(6, 100, dtype=dtype)
    x[0, [3, 9]] = 5          # one 16-lane block
    x[1, [40, 17, 99]] = 5    # across blocks, lanes in another order than the indices
    x[2, [20, 4]] = 5         # one lane, two blocks
    x[3, [96, 98]] = 5        # in the tail past the last full block
    x[4] = -1.0               # all equal
    x[5, 0:2] = torch.tensor([-0.0, 0.0])   # zeros of both signs are equal
    x[5, 2:] = -1.0
    assert_same(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_rows_first_nan_wins(dtype):
    x = torch.randn(6, 50).to(dtype)
    x[0, [10, 30]] = NAN
    x[0, 5] = 100             # the max before the NaNs
    x[1, [10, 30]] = NAN
    x[1, 40] = 100            # and after them
    x[2, 49] = NAN            # only in the tail
    x[3] = NAN
    x[4, 7] = NAN
    x[4, 8] = INF             # NaN outranks +inf
    x[5] = -INF
    x[5, 33] = NAN
    assert_same(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities(dtype):
    x = torch.randn(4, 40).to(dtype)
    x[0] = -INF
    x[1, [12, 35]] = INF
    x[2] = -INF
    x[2, 39] = -1e38
    x[3, :] = INF
    assert_same(x)


def test_rejects_what_it_does_not_serve():
    for bad in (torch.randn(32000), torch.randn(2, 3, 4), torch.randint(0, 9, (2, 5)), torch.randn(5, 2).T,
                torch.randn(2, 5, dtype=torch.float64), torch.randn(3, 0)):
        with pytest.raises(RuntimeError, match="row_argmax"):
            OP(bad)


def test_sampler_same_tokens():
    reqs = [Req(rid=str(i), prompt_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0)) for i in range(8)]
    reqs[2].return_logprob, reqs[2].top_logprobs_num = True, 3
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=g)
    logits[3, [5, 700]] = 50.0   # a tie: the lower id
    plain, fast = Sampler(1000, 0, torch.device("cpu")), Sampler(1000, 0, torch.device("cpu"), argmax=OP)
    for x in (logits, torch.randn(1000, 8, generator=g).T):   # and a non-contiguous view
        a, b = plain.sample(x, reqs), fast.sample(x, reqs)
        assert a.token_ids == b.token_ids == torch.argmax(x, dim=-1).tolist()
        assert a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
