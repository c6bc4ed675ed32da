"""The CPU kernels built for CPUs this machine may not be: AVX2 only (Zen 3) and AVX-512 without BF16.

On such CPUs the bf16 ops are not registered and the float32 paged kernel and the norms take their
portable or AVX-512F code; CI may run on a machine with AVX-512 BF16 only, so each build is compiled here
for the older target (in a subprocess: one process can hold one build of the `kvstrata` op library) and
checked against plain torch.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from kvstrata.model.paged_kernels import _cpu_flags, paged_attention_op

pytestmark = pytest.mark.skipif(paged_attention_op() is None or shutil.which(os.environ.get("CXX", "c++")) is None
                                or platform.machine() != "x86_64",
                                reason="x86-64 targets, built with the C++ compiler the kernels use")
FLAGS = set(_cpu_flags().split())

CHECK = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F
    from kvstrata.model import paged_kernels

    paged_kernels.CFLAGS[:] = ["-O3", sys.argv[1], "-fopenmp"]
    op = paged_kernels.paged_attention_op()
    assert op is not None, "the build failed"
    absent = [paged_kernels.decode_attention_op(), paged_kernels.extend_attention_op(),
              paged_kernels.decode_linear_op(), paged_kernels.silu_and_mul_op()]
    assert absent == [None] * 4, absent
    g = torch.Generator().manual_seed(0)
    for dtype, dim in ((torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 32)):
        k, v = (torch.randn(600, 2, dim, generator=g).to(dtype) for _ in range(2))
        q = torch.randn(2, 8, dim, generator=g).to(dtype)
        slots = torch.stack([torch.arange(1, 301), torch.arange(300, 600)])
        lens = torch.tensor([300, 257])
        out = op(q, k, v, slots, torch.arange(2), lens, dim ** -0.5).float()
        for r in range(2):
            keys, values = (t[slots[r, :lens[r]]].float().transpose(0, 1) for t in (k, v))
            ref = F.scaled_dot_product_attention(q[r].float()[:, None], keys.repeat_interleave(4, 0),
                                                 values.repeat_interleave(4, 0))[:, 0]
            assert (out[r] - ref).abs().max() < (1e-5 if dtype == torch.float32 else 1e-2), (dtype, dim, r)
    norms = paged_kernels.norm_ops()
    x, w = torch.randn(5, 512, generator=g).bfloat16(), torch.randn(512, generator=g).bfloat16()
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * w
    assert torch.equal(norms.rms_norm(x, w, 1e-6), ref)
    print("ok")
""")


@pytest.mark.parametrize("march,needs", [("-march=x86-64-v3", "avx2"), ("-march=icelake-server", "avx512f")],
                         ids=["avx2", "avx512-no-bf16"])
def test_kernels_build_and_match_torch_without_avx512_bf16(march, needs, tmp_path):
    if needs not in FLAGS:
        pytest.skip(f"this CPU cannot run a {march} build (no {needs})")
    env = {**os.environ, "KVSTRATA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", CHECK, march], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
