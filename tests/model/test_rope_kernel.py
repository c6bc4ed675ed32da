"""The compiled rotary embedding (csrc/rope.cpp) gives the same bits as rope.py's torch ops, alone, on the
strided q|k view of a fused projection, and inside a model forward; inputs it does not serve go to torch."""

from __future__ import annotations

import pytest
import torch

from kvstrata.model.paged_kernels import rope_op
from kvstrata.model.rope import RotaryEmbedding, Rotation, apply_rotary, use_rope_kernel
from tests.capabilities import requires_cpu_kernels
from tests.model.pairs import PROMPT_LENS, Pair, random_prompts

OP = rope_op()
pytestmark = requires_cpu_kernels
DTYPES = [torch.bfloat16, torch.float32]


def _rotation(head_dim: int, positions: torch.Tensor, dtype: torch.dtype, scaling=None) -> Rotation:
    rotary = RotaryEmbedding(head_dim, 10000.0, scaling, 64)
    return rotary.rotation(positions, int(positions.max()), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("head_dim", [64, 128, 6], ids=["d64", "d128", "d6-tail"])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_same_bits_as_torch_on_the_fused_qk_view(dtype, head_dim, tokens):
    g = torch.Generator().manual_seed(tokens * head_dim)
    positions = torch.randint(0, 5000, (tokens,), generator=g)
    rotation = _rotation(head_dim, positions, dtype)
    qkv = (torch.randn(tokens, 12 * head_dim, generator=g) * 3).to(dtype)   # 8 q, 2 k and 2 v heads per token
    qk = qkv[:, :10 * head_dim].view(tokens, 10, head_dim)                   # q|k: tokens 12 heads apart
    assert tokens == 1 or not qk.is_contiguous()
    got = OP(qk, rotation.cos, rotation.signed_sin)
    assert got.is_contiguous()
    assert torch.equal(got, apply_rotary(qk, rotation._replace(kernel=None)))


def test_special_values_and_llama3_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rotation = _rotation(8, torch.tensor([3, 900]), torch.bfloat16, scaling)
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38, 1.5] * 2)
    x = x.view(2, 1, 8).bfloat16()
    want = apply_rotary(x, rotation)
    got = OP(x, rotation.cos, rotation.signed_sin)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_apply_rotary_takes_the_kernel_only_where_it_reads_the_input():
    calls = []

    def kernel(x, cos, sin):
        calls.append(x.shape)
        return OP(x, cos, sin)

    rotation = _rotation(16, torch.arange(4), torch.bfloat16)._replace(kernel=kernel)
    x = torch.randn(4, 3, 16).bfloat16()
    assert torch.equal(apply_rotary(x, rotation), apply_rotary(x, rotation._replace(kernel=None)))
    assert calls == [(4, 3, 16)]
    apply_rotary(x.half(), rotation._replace(cos=rotation.cos.half(), signed_sin=rotation.signed_sin.half()))
    apply_rotary(x.transpose(0, 1).contiguous().transpose(0, 1), rotation)   # heads not contiguous per token
    assert len(calls) == 1


def test_rejects_what_it_does_not_serve():
    rotation = _rotation(8, torch.arange(2), torch.bfloat16)
    with pytest.raises(RuntimeError, match="even head_dim"):
        OP(torch.randn(2, 3, 7).bfloat16(), rotation.cos, rotation.signed_sin)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        OP(torch.randn(2, 8, 3).bfloat16().transpose(1, 2), rotation.cos, rotation.signed_sin)
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        OP(torch.randn(2, 3, 8).half(), rotation.cos.half(), rotation.signed_sin.half())
    with pytest.raises(RuntimeError, match="x's dtype"):
        OP(torch.randn(2, 3, 8), rotation.cos, rotation.signed_sin)
    with pytest.raises(RuntimeError, match="x's dtype"):
        OP(torch.randn(3, 3, 8).bfloat16(), rotation.cos, rotation.signed_sin)   # a table for 2 tokens


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f32"])
@pytest.mark.parametrize("case", ["llama", "qwen3_sharded"])   # q|k rotated together; q and k after their norms
def test_model_forward_unchanged(checkpoint_dir, case, dtype):
    pair = Pair.get(checkpoint_dir, case, dtype)
    prompts = random_prompts(PROMPT_LENS, pair.config.vocab_size)
    logits = []
    try:
        for kernel in (OP, None):
            use_rope_kernel(pair.ours, kernel)
            assert pair.ours.rotary.kernel is kernel
            logits.append(pair.prefill_logits(prompts))
    finally:
        use_rope_kernel(pair.ours, None)   # the Pair is shared with other tests
    assert torch.equal(logits[0], logits[1])
