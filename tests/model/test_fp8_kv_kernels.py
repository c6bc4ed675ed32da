"""The attention kernels reading an FP8 pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) against the plain-torch reference.

Every variant this CPU's build has: the float32 paged kernel (AVX-512 tile for head dims 64 / 128, the
portable loop for others; on AVX2-only CPUs the AVX2 tile), the bf16 decode kernel (AVX-512 BF16), the
extend kernel's tiles (AMX and bf16 dot products, or AVX2), and the plain-torch paths of model/attention.py
(SDPA and the batch-invariant one). Each is checked two ways: every one of the 254 finite FP8 values comes
back exactly (a single key's attention output is its value row), and random attention over scattered slots
matches float32 SDPA over the same FP8 values widened by torch. The AVX2 and AVX-512F builds are checked
by tests/model/test_kernel_builds.py's script, which runs the same comparison on those builds.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.kv_format import FP8_DTYPES, KVFormat
from kvstrata.model import invariant_attention
from kvstrata.model.paged_kernels import (
    decode_attention_op,
    extend_attention_op,
    paged_attention_op,
)
from tests.capabilities import requires_avx2, requires_cpu_kernels
from tests.model.sdpa_reference import causal_sdpa_reference as _reference  # float32 causal SDPA

FP8 = list(FP8_DTYPES.values())
IDS = ["e4m3", "e5m2"]


def every_value(dtype: torch.dtype, rows: int, kv_heads: int, dim: int) -> torch.Tensor:
    """`[rows, kv_heads, dim]` FP8 cycling through every byte but the NaNs (e4m3fn 0x7F/0xFF; e5m2 0x7D-0x7F ...)."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = values[torch.isfinite(values.float())]
    count = rows * kv_heads * dim
    return finite.view(torch.uint8).repeat(-(-count // finite.numel()))[:count].view(dtype).view(rows, kv_heads, dim)


def fp8_pool(dtype: torch.dtype, slots: int, kv_heads: int, dim: int, seed: int = 0):
    """K/V pools of FP8 values quantized from normal samples (scaled up so that many saturate or go subnormal)."""
    g = torch.Generator().manual_seed(seed)
    fmt = KVFormat(dtype, (1.0,), (1.0,))
    return tuple(fmt.store(torch.randn(slots, kv_heads, dim, generator=g) * 4, 1.0) for _ in range(2))


def _ops():
    """(name, op, q dtype, tolerance) for each compiled decode variant of this build."""
    found = []
    if paged_attention_op() is not None:
        found += [("float32-kernel-f32q", paged_attention_op(), torch.float32, 1e-4),
                  ("float32-kernel-bf16q", paged_attention_op(), torch.bfloat16, 2e-2)]
    if decode_attention_op() is not None:
        found.append(("bf16-decode", decode_attention_op(), torch.bfloat16, 3e-2))
    return found


DECODE_OPS = _ops()


@requires_cpu_kernels
@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("variant", range(len(DECODE_OPS)), ids=[o[0] for o in DECODE_OPS])
@pytest.mark.parametrize("kv_heads,dim", [(2, 128), (4, 64), (8, 32), (16, 16)],
                         ids=["d128", "d64", "d32", "d16"])
def test_decode_kernels_read_every_fp8_value_exactly(dtype, variant, kv_heads, dim):
    name, op, qdtype, _ = DECODE_OPS[variant]
    v = every_value(dtype, 3, kv_heads, dim)
    k = torch.zeros_like(v.view(torch.uint8)).view(dtype)
    q = torch.randn(1, kv_heads * 2, dim).to(qdtype)
    out = op(q, k, v, torch.tensor([[2]]), torch.tensor([0]), torch.tensor([1]), dim ** -0.5)
    expected = v[2].float().repeat_interleave(2, dim=0)   # one key: attention returns its value row
    assert torch.equal(out.float()[0], expected), name


@requires_cpu_kernels
@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("variant", range(len(DECODE_OPS)), ids=[o[0] for o in DECODE_OPS])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 128), (6, 2, 32)], ids=["gqa-64", "mha-128", "gqa3-32"])
def test_decode_kernels_match_the_torch_reference(dtype, variant, heads, kv_heads, dim):
    name, op, qdtype, tolerance = DECODE_OPS[variant]
    k, v = fp8_pool(dtype, 2048, kv_heads, dim)
    lens = [1, 17, 257, 600]
    perm = torch.randperm(2047, generator=torch.Generator().manual_seed(1)) + 1
    seq_slots = [perm[i * 300:][:n] for i, n in enumerate(lens)]
    slots = torch.nn.utils.rnn.pad_sequence(seq_slots, batch_first=True, padding_value=0)
    q = torch.randn(len(lens), heads, dim).to(qdtype)
    out = op(q, k, v, slots, torch.arange(len(lens)), torch.tensor(lens), dim ** -0.5)
    for i, n in enumerate(lens):
        ref = _reference(q[i:i + 1], k[seq_slots[i]], v[seq_slots[i]], n - 1)[0]
        scale = ref.abs().max()
        assert (out[i].float() - ref).abs().max() < tolerance * scale, (name, n)


EXTEND_QDTYPES = [d for d in (torch.bfloat16, torch.float32) if extend_attention_op(d) is not None]
@requires_cpu_kernels
@requires_avx2   # the extend tiles: AVX2, AVX-512 BF16 or AMX
@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("qdtype", EXTEND_QDTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 128), (4, 2, 16)], ids=["gqa-64", "mha-128", "gqa-16"])
def test_extend_kernel_matches_the_torch_reference(dtype, qdtype, heads, kv_heads, dim, tile):
    op = extend_attention_op(qdtype)
    k, v = fp8_pool(dtype, 1024, kv_heads, dim)
    perm = torch.randperm(1023, generator=torch.Generator().manual_seed(3)) + 1
    seqs = [(perm[:300], 0, 70), (perm[300:700], 333, 67)]   # a fresh prompt, an extend after a prefix
    slots = torch.nn.utils.rnn.pad_sequence([s[:p + e] for s, p, e in seqs], batch_first=True, padding_value=0)
    q = torch.randn(137, heads, dim).to(qdtype)
    out = op(q, k, v, slots, torch.tensor([0, 70]), torch.tensor([0, 333]), torch.tensor([70, 67]), dim ** -0.5)
    start = 0
    for s, prefix, extend in seqs:
        keys = s[:prefix + extend]
        ref = _reference(q[start:start + extend], k[keys], v[keys], prefix)
        assert (out[start:start + extend].float() - ref).abs().max() < 3e-2 * ref.abs().max(), (tile, prefix)
        start += extend
    # one key: every finite FP8 value comes back exactly
    one = every_value(dtype, 2, kv_heads, dim)
    zeros = torch.zeros_like(one.view(torch.uint8)).view(dtype)
    out = op(torch.randn(1, heads, dim).to(qdtype), zeros, one, torch.tensor([[1]]), torch.tensor([0]),
             torch.tensor([0]), torch.tensor([1]), dim ** -0.5)
    assert torch.equal(out[0].float(), one[1].float().repeat_interleave(heads // kv_heads, dim=0)), tile


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_batch_invariant_torch_path_matches_the_reference(dtype):
    k, v = fp8_pool(dtype, 600, 2, 64)
    q = torch.randn(40, 8, 64)
    keys, values = k[100:400].to(torch.bfloat16), v[100:400].to(torch.bfloat16)   # model/attention.py's _gather
    out = invariant_attention.attend_sequence(q, keys, values, 260, 64 ** -0.5)
    ref = _reference(q, k[100:400], v[100:400], 260)
    assert (out - ref).abs().max() < 1e-4 * ref.abs().max()


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_pool_writes_scaled_saturated_fp8(dtype):
    fmt = KVFormat(dtype, (2.0, 0.5), (4.0, 1.0))
    pool = DeviceKVPool(4, 2, 2, 1, 4, dtype, "cpu", fmt)
    big = torch.finfo(dtype).max
    k = torch.tensor([[[1.0, -3.0, 1e9, -1e9]]]).bfloat16()
    pool.set_kv(0, torch.tensor([3]), k, k)
    assert pool.k_buffer[0].dtype == dtype and pool.bytes_per_token == 2 * 2 * 4   # one byte an element
    assert pool.k_buffer[0][3].float().tolist() == [[0.5, -1.5, big, -big]]        # value / 2, saturated
    assert pool.v_buffer[0][3].float().tolist() == [[0.25, -0.75, big, -big]]      # value / 4
    assert torch.isfinite(pool.k_buffer[0].float()).all()
