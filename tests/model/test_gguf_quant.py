"""GGUF block formats held quantized: the torch de-quantizer against the `gguf` package's, and every compiled
GEMV variant this CPU runs (blocks de-quantized in registers, or activations quantized to 8 bits for integer
dot products) against the torch reference (within a stated tolerance) and against itself at other row counts
(row-invariance)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from kvstrata.model.quant.gguf_blocks import FORMATS, dequantize_rows, q8_block, quantize_activation_q8
from tests.capabilities import requires_avx2, requires_avx512_vnni, requires_cpu_kernels
from tests.model.gguf_blocks_gen import GENERATORS, random_rows

QUANTIZED = sorted(GENERATORS)
BY_NAME = {f.name: f for f in FORMATS.values()}
VALUES = 512          # two K-quant super-blocks, sixteen 32-value blocks per row
OUT_ROWS = 40         # more than one task of the kernel's 16-row grain, not a multiple of it
# the types the 8-bit GEMV serves (Q5_0 / Q5_1 are de-quantized in registers on every build)
Q8_TYPES = {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize("name", QUANTIZED)
def test_torch_dequantizer_equals_gguf_on_random_valid_blocks(name):
    raw = random_rows(name, 6, VALUES, seed=1)
    expected = gguf_dequantize(raw, gguf.GGMLQuantizationType[name])
    ours = dequantize_rows(torch.from_numpy(raw), BY_NAME[name], VALUES).numpy()
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_read_as_stored(name):
    values = torch.randn(3, 64)
    stored = values.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name])
    raw = stored.view(torch.uint8).reshape(3, -1)
    assert torch.equal(dequantize_rows(raw, BY_NAME[name], 64), stored.float())


def _kernels():
    from kvstrata.model.paged_kernels import gguf_ops, gguf_variants

    ops = gguf_ops()
    if ops is None:
        pytest.skip("no compiled CPU kernels")
    return ops, gguf_variants()


def _reference(x: torch.Tensor, raw: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T in float64, the bound |x| @ |W|.T that float32 rounding error scales with)."""
    w = dequantize_rows(raw, BY_NAME[name], VALUES).double()
    return x.double() @ w.T, x.double().abs() @ w.abs().T


# Tolerance: float32 accumulation of 512 products in a fixed blocked order, de-quantized values possibly
# fused into one FMA (d * q + m): error well below 1e-5 of the sum of |products|. The 8-bit variants compute
# exactly (integers) on the activation as quantize_activation_q8 rounds it, so they meet the same tolerance
# against that activation; against the float activation they differ by the rounding, at most half a step
# (max|x| / 254 of each activation block: 32 values, 256 for the K-quants) per value: _q8_step_bound.
REL_TOL = 1e-5


def _q8_step_bound(x: torch.Tensor, raw: torch.Tensor, name: str) -> torch.Tensor:
    """Sum over k of |W[j, k]| x half the quantization step of x[t, k]: how far the 8-bit activation's product
    may be from the float one."""
    block = q8_block(BY_NAME[name])
    half_step = x.double().abs().reshape(x.shape[0], -1, block).amax(-1, keepdim=True) / 254
    w = dequantize_rows(raw, BY_NAME[name], VALUES).double()
    return half_step.expand(-1, -1, block).reshape(x.shape) @ w.abs().T


def _check(out, x, raw, name, variant):
    from kvstrata.model.paged_kernels import GGUF_Q8_VARIANTS, GGUF_VARIANT_NAMES

    label = f"{name} {GGUF_VARIANT_NAMES[variant]} rows={x.shape[0]}"
    exact, exact_bound = _reference(x, raw, name)
    if variant in GGUF_Q8_VARIANTS:
        expected, bound = _reference(quantize_activation_q8(x, q8_block(BY_NAME[name])), raw, name)
        step_err = (out.double() - exact).abs()
        assert bool((step_err <= _q8_step_bound(x, raw, name) + REL_TOL * exact_bound + 1e-7).all()), \
            f"{label}: off the float product by more than the activation's rounding ({step_err.max():.3g})"
    else:
        expected, bound = exact, exact_bound
    err = (out.double() - expected).abs()
    assert bool((err <= REL_TOL * bound + 1e-7).all()), f"{label}: max error {err.max():.3g}"


@requires_cpu_kernels
@pytest.mark.parametrize("name", QUANTIZED)
def test_every_gemv_variant_matches_the_reference_and_is_row_invariant(name):
    from kvstrata.model.paged_kernels import GGUF_Q8_VARIANTS, GGUF_VARIANT_NAMES, gguf_variants

    ops, variants = _kernels()
    type_id = BY_NAME[name].type_id
    served = gguf_variants(type_id)
    assert 1 in served   # the portable variant is always built
    assert (4 in served) == (name in Q8_TYPES)   # and the portable 8-bit one, for the types it has kernels for
    assert set(served) <= set(variants)
    raw = torch.from_numpy(random_rows(name, OUT_ROWS, VALUES, seed=2))
    x = torch.randn(17, VALUES, generator=torch.Generator().manual_seed(3))
    x[5, 64:96] = 0.0   # a block of zeros: scale 0 in the 8-bit activation
    for variant in served:
        full = ops.gemv(x, raw, type_id, variant)
        for rows in (1, 2, 3, 4, 8, 16, 17):   # the kernels keep 1, 2, 4, 8 and 16 rows in registers
            out = ops.gemv(x[:rows].contiguous(), raw, type_id, variant)
            _check(out, x[:rows], raw, name, variant)
            assert torch.equal(out, full[:rows]), f"{name} {GGUF_VARIANT_NAMES[variant]}: rows depend on the row count"
        # a row's result does not depend on its neighbours either
        shuffled = ops.gemv(x.flip(0).contiguous(), raw, type_id, variant)
        assert torch.equal(shuffled.flip(0), full)
    for variant in set(variants) - set(served):
        assert variant in GGUF_Q8_VARIANTS
        with pytest.raises(RuntimeError, match="no kernel for type"):
            ops.gemv(x, raw, type_id, variant)


@requires_cpu_kernels
@pytest.mark.parametrize("name", QUANTIZED)
def test_best_variant_is_one_of_the_types_variants_and_gives_its_bits(name):
    from kvstrata.model.paged_kernels import GGUF_Q8_VARIANTS, gguf_best_variant, gguf_variants

    ops, _ = _kernels()
    type_id = BY_NAME[name].type_id
    best = gguf_best_variant(type_id, VALUES)
    assert best in gguf_variants(type_id)
    exact = gguf_best_variant(type_id, VALUES, int8_activations=False)
    assert exact in gguf_variants(type_id) and exact not in GGUF_Q8_VARIANTS
    raw = torch.from_numpy(random_rows(name, OUT_ROWS, VALUES, seed=5))
    x = torch.randn(2, VALUES, generator=torch.Generator().manual_seed(6))
    assert torch.equal(ops.gemv(x, raw, type_id, 0), ops.gemv(x, raw, type_id, best))


@requires_cpu_kernels
@requires_avx2
def test_avx2_builds_have_both_avx2_variants():
    _, variants = _kernels()
    assert {2, 5} <= set(variants)


@requires_cpu_kernels
@requires_avx512_vnni
def test_vnni_builds_have_the_vnni_variant():
    _, variants = _kernels()
    assert 6 in variants


@requires_cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_gguf_weight_decode_product_in_the_model_dtype(name, dtype):
    """GGUFWeight's decode product in float32 and bf16 activations, against the float product of the same
    activation: float32 to float32 rounding (float32 models multiply the activation as it is); bf16 within
    bf16's output rounding, plus the 8-bit rounding bound where gguf_weight.INT8_ACTIVATIONS is on."""
    from kvstrata.model.quant.gguf_weight import INT8_ACTIVATIONS, GGUFWeight

    ops, _ = _kernels()
    raw = torch.from_numpy(random_rows(name, OUT_ROWS, VALUES, seed=7))
    weight = GGUFWeight(raw, BY_NAME[name], VALUES)
    weight.kernels = ops
    x = torch.randn(3, VALUES, generator=torch.Generator().manual_seed(8)).to(dtype)
    out = weight(x)
    assert out.dtype == dtype and out.shape == (3, OUT_ROWS)
    exact, bound = _reference(x.float(), raw, name)
    allowed = REL_TOL * bound + 1e-7
    if dtype == torch.bfloat16:
        allowed = allowed + exact.abs() * 2**-8
        if INT8_ACTIVATIONS:
            allowed = allowed + _q8_step_bound(x.float(), raw, name)
    assert bool(((out.double() - exact).abs() <= allowed).all())


@requires_cpu_kernels
@pytest.mark.parametrize("name", QUANTIZED)
def test_compiled_dequantizer_matches_the_reference(name):
    ops, _ = _kernels()
    raw = torch.from_numpy(random_rows(name, 20, VALUES, seed=4))
    expected = dequantize_rows(raw, BY_NAME[name], VALUES)
    # d * q + m may be one FMA in the kernel: an ulp of the result at most
    torch.testing.assert_close(ops.dequantize(raw, BY_NAME[name].type_id, VALUES), expected, rtol=2e-7, atol=1e-9)


@requires_cpu_kernels
def test_gemv_refuses_blocks_that_do_not_fit_the_row():
    ops, _ = _kernels()
    raw = torch.from_numpy(random_rows("Q8_0", 4, VALUES))
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops.gemv(torch.randn(1, VALUES + 32), raw, BY_NAME["Q8_0"].type_id, 0)


@pytest.mark.parametrize("block", [32, 256])
def test_torch_q8_activation_rounds_each_block_to_127_steps(block):
    x = torch.randn(2, 2 * block, generator=torch.Generator().manual_seed(9))
    x[1, block:] = 0.0
    q = quantize_activation_q8(x, block)
    step = x.abs().reshape(2, 2, block).amax(-1, keepdim=True) / 127
    assert torch.equal(q[1, block:], torch.zeros(block))
    levels = (q.reshape(2, 2, block)[:, :1] / step[:, :1])
    assert torch.allclose(levels, levels.round(), atol=1e-4) and levels.abs().max() <= 127
    assert bool(((q - x).abs().reshape(2, 2, block) <= step / 2 * (1 + 1e-5)).all())


def test_k_quants_take_one_activation_scale_per_super_block():
    # llama.cpp's Q8_K: the K-quants' sub-blocks then sum in integers (quant_gguf.cpp's q8_block)
    assert {name: q8_block(BY_NAME[name]) for name in Q8_TYPES} == {
        "Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
