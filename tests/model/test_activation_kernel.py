"""The compiled silu(gate) * up (csrc/activation.cpp) gives the same bits as the two torch ops it replaces,
alone, for every bf16 gate value, and inside a model forward. AVX-512 BF16 builds compute silu with their
own exp; the others look up torch's own silu of every bf16 value. Skipped without a C++ compiler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.model.layers import use_fused_activation
from kvstrata.model.paged_kernels import silu_and_mul_op
from tests.model.test_llama_vs_hf import PROMPT_LENS, Pair, random_prompts

OP = silu_and_mul_op()
pytestmark = pytest.mark.skipif(OP is None, reason="no C++ compiler: torch ops serve")


@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 1000), (300, 64), (2, 7)])
def test_same_bits_as_torch(rows, inter):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])   # saturated exp either way, and zeros
    gate, up = x.split(inter, dim=-1)
    assert torch.equal(OP(x), F.silu(gate) * up)


@pytest.mark.parametrize("inter", [1536, 7], ids=["torch-vector-loop", "torch-scalar-loop"])
def test_every_bf16_gate_value(inter):
    """silu of a bf16 depends on its 16 bits only: all 65,536 of them, where torch's own loop is vectorized
    (rows of 1536) and where it is scalar (rows of 7, another exp), against random up values."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    rows = -(-every.numel() // inter)
    gate = torch.cat([every, every[:rows * inter - every.numel()]]).view(rows, inter)
    up = (torch.randn(rows, inter, generator=torch.Generator().manual_seed(inter)) * 3).to(torch.bfloat16)
    x = torch.cat([gate, up], dim=1)
    want = F.silu(x[:, :inter]) * x[:, inter:]
    got = OP(x)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())   # NaN payloads aside: every bit


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
