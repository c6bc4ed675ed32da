"""GGUF block formats held quantized: the torch de-quantizer against the `gguf` package's, and every compiled
GEMV variant this CPU runs against the torch reference (within a stated tolerance) and against itself at
other row counts (row-invariance)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from kvstrata.model.quant.gguf_blocks import FORMATS, dequantize_rows
from tests.capabilities import requires_cpu_kernels
from tests.model.gguf_blocks_gen import GENERATORS, random_rows

QUANTIZED = sorted(GENERATORS)
BY_NAME = {f.name: f for f in FORMATS.values()}
VALUES = 512          # two K-quant super-blocks, sixteen 32-value blocks per row
OUT_ROWS = 40         # more than one task of the kernel's 16-row grain, not a multiple of it
VARIANT_NAMES = {1: "portable", 2: "avx2", 3: "avx512"}


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
# fused into one FMA (d * q + m): error well below 1e-5 of the sum of |products|.
REL_TOL = 1e-5


@requires_cpu_kernels
@pytest.mark.parametrize("name", QUANTIZED)
def test_every_gemv_variant_matches_the_reference_and_is_row_invariant(name):
    ops, variants = _kernels()
    assert 1 in variants   # the portable variant is always built
    raw = torch.from_numpy(random_rows(name, OUT_ROWS, VALUES, seed=2))
    type_id = BY_NAME[name].type_id
    x = torch.randn(17, VALUES, generator=torch.Generator().manual_seed(3))
    for variant in variants:
        full = ops.gemv(x, raw, type_id, variant)
        for rows in (1, 3, 17):
            out = ops.gemv(x[:rows].contiguous(), raw, type_id, variant)
            expected, bound = _reference(x[:rows], raw, name)
            err = (out.double() - expected).abs()
            assert bool((err <= REL_TOL * bound + 1e-7).all()), \
                f"{name} {VARIANT_NAMES[variant]} rows={rows}: max error {err.max():.3g}"
            assert torch.equal(out, full[:rows]), f"{name} {VARIANT_NAMES[variant]}: rows depend on the row count"
        # a row's result does not depend on its neighbours either
        shuffled = ops.gemv(x.flip(0).contiguous(), raw, type_id, variant)
        assert torch.equal(shuffled.flip(0), full)


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
