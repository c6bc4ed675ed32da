"""The compiled silu(gate) * up (csrc/activation.cpp) gives the same bits as the two torch ops it replaces,
alone and inside a model forward. Skipped where the CPU has no AVX-512 BF16 (torch ops serve)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.model.layers import use_fused_activation
from kvstrata.model.paged_kernels import silu_and_mul_op
from tests.model.test_llama_vs_hf import PROMPT_LENS, Pair, random_prompts

OP = silu_and_mul_op()
pytestmark = pytest.mark.skipif(OP is None, reason="no AVX-512 BF16 (or no C++ compiler): torch ops serve")


@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 1000), (300, 64), (2, 7)])
def test_same_bits_as_torch(rows, inter):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])   # saturated exp either way, and zeros
    gate, up = x.split(inter, dim=-1)
    assert torch.equal(OP(x), F.silu(gate) * up)


def test_model_forward_unchanged(checkpoint_dir):
    pair = Pair.get(checkpoint_dir, "llama", torch.bfloat16)
    prompts = random_prompts(PROMPT_LENS, pair.config.vocab_size)
    logits = []
    try:
        for op in (OP, None):
            use_fused_activation(pair.ours, op)
            logits.append(pair.prefill_logits(prompts))
    finally:
        use_fused_activation(pair.ours, None)   # the Pair is shared with other tests
    assert torch.equal(logits[0], logits[1])


def test_rejects_what_it_does_not_serve():
    with pytest.raises(RuntimeError, match="contiguous"):
        OP(torch.randn(2, 6))
    with pytest.raises(RuntimeError, match="contiguous"):
        OP(torch.randn(2, 5).to(torch.bfloat16))
