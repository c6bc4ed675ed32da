"""The CPU kernels built for CPUs this machine may not be: AVX2 only (Zen 3) and AVX-512 without BF16.

On such CPUs the AVX-512 BF16 ops are not registered: the float32 paged kernel takes its AVX2 or AVX-512F
tile, the extend kernel its AVX2 tile, the decode GEMV its AVX2 build, and the norms their portable or
AVX-512F code. CI may run on a machine
with AVX-512 BF16, so each build is compiled here for the older target (in a subprocess: one process can
hold one build of the `kvstrata` op library) and checked against plain torch; where this CPU is the older
target, its own build is the one checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvstrata.platform import cpu_flags
from tests.capabilities import (
    requires_avx2,
    requires_avx512f,
    requires_compiler,
    requires_cpu_kernels,
    requires_x86_64,
)

# x86-64 targets, built with the C++ compiler the kernels use
pytestmark = [requires_x86_64, requires_compiler, requires_cpu_kernels]
FLAGS = cpu_flags()

CHECK = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F
    from kvstrata.model import paged_kernels

    paged_kernels.CFLAGS[:] = ["-O3", sys.argv[1], "-fopenmp"]
    op = paged_kernels.paged_attention_op()
    assert op is not None, "the build failed"
    assert paged_kernels.decode_attention_op() is None   # the bf16 decode kernel needs AVX-512 BF16
    # the extend kernel's AVX2 tile (extend_tile_avx2.h), bf16 and float32, after a prefix over scattered slots
    for dtype, limit in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        extend = paged_kernels.extend_attention_op(dtype)
        assert extend is not None, dtype
        g = torch.Generator().manual_seed(2)
        k, v = (torch.randn(300, 2, 64, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(40, 8, 64, generator=g).to(dtype)
        slots = (torch.randperm(299, generator=g)[:70] + 1)[None]
        out = extend(q, k, v, slots, torch.tensor([0]), torch.tensor([30]), torch.tensor([40]), 0.125).float()
        allowed = torch.arange(70)[None, :] <= torch.arange(30, 70)[:, None]
        ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k[slots[0]].float().transpose(0, 1),
                                             v[slots[0]].float().transpose(0, 1), attn_mask=allowed,
                                             enable_gqa=True).transpose(0, 1)
        assert (out - ref).abs().max() < limit, dtype
    # silu(gate) * up from torch's own silu table: its bits
    x = (torch.randn(5, 2 * 1000, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    assert torch.equal(paged_kernels.silu_and_mul_op()(x), F.silu(x[:, :1000]) * x[:, 1000:])
    g = torch.Generator().manual_seed(0)
    # head dims of the SIMD tiles (AVX2: 32, 64, 128; AVX-512F: 64, 128) and of the portable loop (16, 96);
    # query heads per KV head 4, 3 and 1; tiles cut at 256 keys, lengths not a multiple of 8
    for dtype, dim, heads, kv_heads in ((torch.float32, 64, 8, 2), (torch.bfloat16, 64, 8, 2),
                                        (torch.bfloat16, 32, 6, 2), (torch.float32, 128, 4, 4),
                                        (torch.bfloat16, 128, 12, 2), (torch.bfloat16, 16, 8, 2),
                                        (torch.float32, 96, 2, 1)):
        k, v = (torch.randn(600, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(3, heads, dim, generator=g).to(dtype)
        slots = torch.stack([torch.arange(1, 301), torch.arange(300, 600), torch.randperm(599)[:300] + 1])
        lens = torch.tensor([300, 257, 13])
        out = op(q, k, v, slots, torch.arange(3), lens, dim ** -0.5).float()
        for r in range(3):
            keys, values = (t[slots[r, :lens[r]]].float().transpose(0, 1) for t in (k, v))
            ref = F.scaled_dot_product_attention(q[r].float()[:, None], keys.repeat_interleave(heads // kv_heads, 0),
                                                 values.repeat_interleave(heads // kv_heads, 0))[:, 0]
            assert (out[r] - ref).abs().max() < (1e-5 if dtype == torch.float32 else 1e-2), (dtype, dim, r)
    # an FP8 pool (--kv-cache-dtype), read by the same tiles (widened in registers): every finite value exact
    # through one key, and random rows against float32 SDPA over the widened values
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        every = torch.arange(256, dtype=torch.uint8).view(fp8)
        every = every[torch.isfinite(every.float())].view(torch.uint8).repeat(2)[:256].view(fp8).view(2, 2, 64)
        zeros = torch.zeros(2, 2, 64, dtype=torch.uint8).view(fp8)
        for qdtype in (torch.float32, torch.bfloat16):
            out = op(torch.randn(1, 8, 64).to(qdtype), zeros, every, torch.tensor([[1]]), torch.tensor([0]),
                     torch.tensor([1]), 0.125)
            assert torch.equal(out[0].float(), every[1].float().repeat_interleave(4, 0)), (fp8, qdtype)
            extend = paged_kernels.extend_attention_op(qdtype)
            out = extend(torch.randn(1, 8, 64).to(qdtype), zeros, every, torch.tensor([[1]]), torch.tensor([0]),
                         torch.tensor([0]), torch.tensor([1]), 0.125)
            assert torch.equal(out[0].float(), every[1].float().repeat_interleave(4, 0)), (fp8, qdtype)
        for dim in (32, 64, 128, 96):
            k, v = ((torch.randn(600, 2, dim, generator=g) * 4).clamp(-448, 448).to(fp8) for _ in range(2))
            q = torch.randn(2, 8, dim, generator=g).bfloat16()
            slots = torch.stack([torch.arange(1, 301), torch.randperm(599)[:300] + 1])
            out = op(q, k, v, slots, torch.arange(2), torch.tensor([300, 77]), dim ** -0.5).float()
            for r, n in enumerate((300, 77)):
                keys, values = (t[slots[r, :n]].float().transpose(0, 1).repeat_interleave(4, 0) for t in (k, v))
                ref = F.scaled_dot_product_attention(q[r].float()[:, None], keys, values)[:, 0]
                assert (out[r] - ref).abs().max() < 2e-2 * ref.abs().max(), (fp8, dim, r)
    # the decode GEMV of CPUs without AVX-512 BF16 (decode_linear_avx2.cpp, on a packed weight): float32 sums
    # of bf16 products
    linear = paged_kernels.decode_linear_op()
    assert linear is not None and linear.pack(torch.zeros(17, 8).bfloat16()).shape == (2, 8, 16)
    assert linear.max_rows is None   # it serves prefill too: 200 rows below are swept in panels
    for rows, n, k in ((1, 777, 512), (2, 5, 100), (3, 64, 16), (7, 33, 9), (17, 300, 1536), (64, 128, 8),
                       (200, 40, 512)):
        x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16()
        packed = linear.pack(w)
        ref = x.float() @ w.float().T + bias.float()
        out = linear.run(x, packed, bias, n).float()
        assert ((out - ref).abs() <= ref.abs() * 2**-8 + 1e-3 * k ** 0.5).all(), (rows, n, k)
        assert torch.equal(linear.run(x[-1:], packed, bias, n), linear.run(x, packed, bias, n)[-1:]), (rows, n, k)
    norms = paged_kernels.norm_ops()
    x, w = torch.randn(5, 512, generator=g).bfloat16(), torch.randn(512, generator=g).bfloat16()
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * w
    # float32 sums of squares in another order than torch's: the normalized value may round one ulp off,
    # two ulps of the output after the weight's product (as in test_decode_ops)
    assert ((norms.rms_norm(x, w, 1e-6).float() - ref.float()).abs() <= ref.float().abs() * 2**-6 + 1e-30).all()
    # the rotary embedding (rope.cpp, vectorized by the compiler for this ISA): the torch ops' bits
    from kvstrata.model.rope import RotaryEmbedding, apply_rotary
    rotation = RotaryEmbedding(64, 10000.0, None, 64).rotation(torch.arange(7) * 50, 300, torch.bfloat16)
    qk = torch.randn(7, 12 * 64, generator=g).bfloat16()[:, :640].view(7, 10, 64)
    assert torch.equal(paged_kernels.rope_op()(qk, rotation.cos, rotation.signed_sin), apply_rotary(qk, rotation))
    # the GGUF GEMV (quant_gguf.cpp): every variant of this build, de-quantizing in registers or with 8-bit
    # activations (AVX2 maddubs; AVX-512 VNNI where the target has it), against torch
    from kvstrata.model.quant.gguf_blocks import FORMATS, dequantize_rows, q8_block, quantize_activation_q8
    from tests.model.gguf_blocks_gen import random_rows
    gguf = paged_kernels.gguf_ops()
    assert {1, 2, 4, 5} <= set(paged_kernels.gguf_variants())
    for fmt in (f for f in FORMATS.values() if f.name in ("Q8_0", "Q4_K", "Q6_K")):
        raw = torch.from_numpy(random_rows(fmt.name, 20, 512))
        w = dequantize_rows(raw, fmt, 512).double()
        x = torch.randn(3, 512, generator=g)
        for variant in paged_kernels.gguf_variants(fmt.type_id):
            xr = quantize_activation_q8(x, q8_block(fmt)) if variant in paged_kernels.GGUF_Q8_VARIANTS else x
            err = (gguf.gemv(x, raw, fmt.type_id, variant).double() - xr.double() @ w.T).abs()
            assert (err <= 1e-5 * (xr.double().abs() @ w.abs().T) + 1e-7).all(), (fmt.name, variant)
    print("ok")
""")


@pytest.mark.parametrize("march,lacks", [pytest.param("-march=x86-64-v3", "avx512f", marks=requires_avx2, id="avx2"),
                                          pytest.param("-march=icelake-server", "avx512_bf16", marks=requires_avx512f,
                                                       id="avx512-no-bf16")])
def test_kernels_build_and_match_torch_without_avx512_bf16(march, lacks, tmp_path):
    env = {**os.environ, "KVSTRATA_CACHE_DIR": str(tmp_path)}
    if lacks not in FLAGS:
        # This CPU is that target: its own build (-march=native, already in the kernel cache) takes the same
        # code paths, and is checked here without a second ~80 s compile.
        march, env = "-march=native", dict(os.environ)
    done = subprocess.run([sys.executable, "-c", CHECK, march], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
