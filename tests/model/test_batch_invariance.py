"""The kernels behind --enable-deterministic-inference: each row's result is independent of its batch.

These check the properties the invariant path relies on, on this machine's BLAS, in both dtypes: a Linear
row gives the same bits at any row count and position, and an attention row gives the same bits as a decode
step, inside a long prefill, or in any chunk of one, while staying close to SDPA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.model import invariant_attention as ia
from kvstrata.model import layers
from kvstrata.model.layers import Linear, make_batch_invariant
from tests.device import TEST_DEVICE

DTYPES = [torch.float32, torch.bfloat16]


# (in, out) of the suite's models' projections: the tiny model's k/v (128 -> 64), o, gate_up and down, the
# bench model's k/v (512 -> 128) and gate_up, and a generic shape. Small N and few rows are where a GEMM
# library may split K across threads or switch kernels.
SHAPES = [(256, 384), (128, 64), (128, 128), (128, 768), (384, 128), (512, 128), (512, 3072)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
@pytest.mark.parametrize("native_bf16", [True, False], ids=["native-bf16", "emulated-bf16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_linear_row_does_not_depend_on_row_count_or_position(dtype, native_bf16, shape, threads, monkeypatch):
    # On CPUs without AVX-512 BF16 a bf16 Linear upcasts to a float32 GEMM: exercise that path on any CPU.
    monkeypatch.setattr(layers, "_CPU_NATIVE_LOW_PRECISION", native_bf16 and layers._CPU_NATIVE_LOW_PRECISION)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        layer = Linear(*shape).to(dtype).to(TEST_DEVICE)
        make_batch_invariant(layer)
        x = torch.randn(300, shape[0]).to(dtype).to(TEST_DEVICE)
        with torch.inference_mode():
            ref = layer(x)
            for rows in (1, 2, 3, 5, 7, 11, 13, 16, 31, 64, 129):
                pick = torch.randperm(300)[:rows]
                assert torch.equal(layer(x[pick]), ref[pick]), f"{rows} rows"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 130])
def test_device_blocks_compute_the_same_product(rows):
    # The GPU path of the batch-invariant mode (fixed 64-row GEMMs); its invariance is checked on a GPU by
    # test_linear_row_does_not_depend_on_row_count_or_position with KVSTRATA_TEST_DEVICE=cuda.
    torch.manual_seed(0)
    layer = Linear(128, 96, bias=True)
    x = torch.randn(rows, 128)
    with torch.inference_mode():
        assert torch.allclose(layer._forward_in_blocks(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


def _sequence(n: int, heads: int = 8, kv_heads: int = 2, dim: int = 64, dtype=torch.float32):
    g = torch.Generator().manual_seed(n)
    def make(h):
        return torch.randn(n, h, dim, generator=g).to(dtype).to(TEST_DEVICE)
    return make(heads), make(kv_heads), make(kv_heads)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_attention_row_same_in_decode_prefill_and_chunks(dtype):
    n = 600                       # spans three key tiles and several query blocks
    q, k, v = _sequence(n, dtype=dtype)
    scale = 64 ** -0.5
    full = ia.attend_sequence(q, k, v, 0, scale)
    # chunked: the suffix after a cached prefix of 333 tokens
    chunk = ia.attend_sequence(q[333:], k, v, 333, scale)
    assert torch.equal(chunk, full[333:])
    # decode steps, batched with other sequences of other lengths (zero padding past each length)
    for pos in (0, 255, 256, 599):
        lens = [pos + 1, 17, 450]
        keys = torch.zeros(3, max(lens), 2, 64, dtype=dtype, device=TEST_DEVICE)
        values = torch.zeros_like(keys)
        keys[0, :pos + 1], values[0, :pos + 1] = k[:pos + 1], v[:pos + 1]
        keys[1:, :17].normal_()
        keys[2, :450].normal_()
        queries = torch.randn(3, 8, 64).to(dtype).to(TEST_DEVICE)
        queries[0] = q[pos]
        out = ia.attend_decodes(queries, keys, values, lens, scale)
        assert torch.equal(out[0], full[pos]), f"decode at position {pos}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_invariant_attention_matches_sdpa(dtype):
    q, k, v = _sequence(300, dtype=dtype)
    ours = ia.attend_sequence(q, k, v, 0, 64 ** -0.5).float()
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                         v.float().transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    ref = ref[0].transpose(0, 1)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (ours - ref).abs().max() < tolerance
