"""The compiled decode-step kernels (csrc/decode_ops.cpp, decode_linear_avx2.cpp) against the plain-torch
layers they replace.

Checked: the bf16 GEMV equals a float32 product up to bf16 rounding, its rows do not depend on the row count
or the thread count (on AVX2, whose build serves prefill too, also across its decode and prefill paths); the
fused residual-add + RMSNorm gives transformers' LlamaRMSNorm arithmetic, row by row; a whole model through
both kernels stays within the transformers tolerances and generates its greedy tokens; the ModelRunner takes
them only where they apply (CPU, not --disable-cpu-kernels; in deterministic mode for every row count).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstrata.args import ServerArgs
from kvstrata.model.layers import (
    Linear,
    RMSNorm,
    onednn_weights_apply,
    use_decode_linear,
    use_fused_norms,
    use_onednn_weights,
)
from kvstrata.model.paged_kernels import (
    DECODE_LINEAR_MAX_ROWS,
    decode_linear_op,
    norm_ops,
    paged_attention_op,
)
from kvstrata.runtime.model_runner import ModelRunner
from tests.capabilities import requires_avx2, requires_cpu_kernels, requires_onednn_bf16_reorder
from tests.model.hf_ckpt import CASES
from tests.model.pairs import PROMPT_LENS, TOLERANCE, Pair, random_prompts, relative_error

LINEAR = decode_linear_op(every_row=True)   # as deterministic mode runs it: products of any row count
NORMS = norm_ops()
pytestmark = requires_cpu_kernels
DTYPES = [torch.float32, torch.bfloat16]
# Row counts: decode batches, and prefill-sized products (AVX2: from 65 rows, products are swept in panels of
# 30-96 rows at these K).
ROWS = list(range(1, DECODE_LINEAR_MAX_ROWS + 1)) + [100, 300]


def gemv(x: torch.Tensor, w: torch.Tensor, bias):
    """The compiled GEMV on a row-major weight, packed the way this CPU's build reads it."""
    return LINEAR.run(x, LINEAR.pack(w), bias, w.shape[0])


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: float32 inside, normalized row rounded, then times the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@requires_avx2  # the GEMV: its AVX2 build, or the AVX-512 BF16 one (those CPUs have AVX2 too)
@pytest.mark.parametrize("n", [777, 3], ids=["n777-tail", "n3-one-block"])
@pytest.mark.parametrize("k", [512, 1536, 100, 16], ids=["k512", "k1536", "k100-tail", "k16-tail"])
def test_gemv_matches_float32_product_up_to_rounding(k, n):
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g).bfloat16()
        ref = x.float() @ w.float().T + bias.float()
        for b, expected in ((bias, ref), (None, ref - bias.float())):
            out = gemv(x, w, b)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            # one rounding to bf16 (relative 2^-8) plus float32 summation-order differences
            assert ((out.float() - expected).abs() <= expected.abs() * 2**-8 + 1e-3 * k ** 0.5).all(), rows


@requires_avx2  # the GEMV: its AVX2 build, or the AVX-512 BF16 one (those CPUs have AVX2 too)
@pytest.mark.parametrize("n, k", [(3000, 512), (1001, 100)], ids=["n3000-k512", "n1001-k100-tails"])
def test_gemv_row_bits_do_not_depend_on_row_count_or_threads(n, k):
    """Rows go through register tiles of different shapes by row count: the same sums, bit for bit."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(max(ROWS[-1], DECODE_LINEAR_MAX_ROWS * 2), k, generator=g).bfloat16()
    packed = LINEAR.pack(w)
    full = LINEAR.run(x, packed, bias, n)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for rows in sorted({1, 2, 3, 5, 8, 13, 16, 17, DECODE_LINEAR_MAX_ROWS, 2 * DECODE_LINEAR_MAX_ROWS, *ROWS[-2:]}):
                pick = torch.randperm(x.shape[0], generator=g)[:rows]
                assert torch.equal(LINEAR.run(x[pick], packed, bias, n), full[pick]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@requires_avx2  # the GEMV: its AVX2 build, or the AVX-512 BF16 one (those CPUs have AVX2 too)
def test_gemv_rounds_every_output_as_torch_rounds_a_float():
    """Full 16-row blocks are rounded 8 lanes at a time on AVX2, a ragged block one value at a time (as
    torch's float -> bf16): both give the same bits, NaN and infinity included."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 64, generator=g).bfloat16()
    x = torch.randn(20, 64, generator=g).bfloat16()
    x[0, 0], x[1, 0], x[2] = float("nan"), float("inf"), 1e-38
    one_row_each = torch.cat([gemv(x, w[i:i + 1], None) for i in range(48)], dim=1)   # ragged: N = 1
    assert torch.equal(gemv(x, w, None).view(torch.int16), one_row_each.view(torch.int16))


@requires_avx2  # the GEMV: its AVX2 build, or the AVX-512 BF16 one (those CPUs have AVX2 too)
def test_gemv_takes_zero_rows():
    w = torch.randn(40, 16).bfloat16()
    assert gemv(torch.empty(0, 16).bfloat16(), w, torch.randn(40).bfloat16()).shape == (0, 40)


@requires_avx2  # the GEMV: its AVX2 build, or the AVX-512 BF16 one (those CPUs have AVX2 too)
def test_gemv_rejects_what_it_cannot_read():
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="bf16"):
        gemv(torch.randn(1, 16), w, None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        gemv(torch.randn(1, 8).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemv(torch.randn(1, 16).bfloat16(), torch.randn(16, 8).bfloat16().T, None)
    with pytest.raises(RuntimeError, match="bias"):
        gemv(torch.randn(1, 16).bfloat16(), w, torch.randn(7).bfloat16())


@pytest.mark.parametrize("hidden", [512, 100], ids=["vector", "scalar-tail"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_fused_norm_is_transformers_rms_norm_row_by_row(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(300, hidden, generator=g).to(dtype) for _ in range(2))
    weight = (1 + torch.randn(hidden, generator=g) / 4).to(dtype)
    out, summed = NORMS.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, residual + x)           # the same rounding as the unfused add
    ref = _hf_rms_norm(residual + x, weight, 1e-5)
    # float32 sums of squares in another order: rarely, the normalized value rounds one ulp off, which the
    # weight's product carries into at most two ulps of the output
    ulp = ref.float().abs() * (2**-6 if dtype == torch.bfloat16 else 2**-20) + 1e-30
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 0.01
    assert torch.equal(NORMS.rms_norm(x, weight, 1e-5), NORMS.add_rms_norm(x, torch.zeros_like(x), weight, 1e-5)[0])
    for rows in (1, 2, 17):
        pick = torch.randperm(300, generator=g)[:rows]
        assert torch.equal(NORMS.add_rms_norm(x[pick], residual[pick], weight, 1e-5)[0], out[pick])


def test_fused_norm_module_falls_back_where_it_cannot_read():
    norm = RMSNorm(64, 1e-6)
    use_fused_norms(norm, NORMS)
    x = torch.randn(4, 3, 64)
    assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6))   # 3-D (q/k norms): torch
    with pytest.raises(RuntimeError, match="weight"):
        NORMS.rms_norm(torch.randn(2, 32), norm.weight, 1e-6)


def _kernel_pair(checkpoint_dir, case: str, dtype: torch.dtype) -> Pair:
    """A fresh (uncached) Pair whose kvstrata model runs every compiled kernel the runner would use."""
    pair = Pair(checkpoint_dir(case), dtype)
    use_fused_norms(pair.ours, NORMS)
    use_decode_linear(pair.ours, LINEAR)
    return pair


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_model_through_decode_kernels_matches_hf(checkpoint_dir, case, dtype):
    pair = _kernel_pair(checkpoint_dir, case, dtype)
    prompts = random_prompts(PROMPT_LENS, pair.config.vocab_size)
    seqs = pair.sequences()
    seqs.paged_kernel = paged_attention_op()
    ids, positions, meta = seqs.batch(list(enumerate(prompts)))
    logits = pair.ours(ids, positions, meta, seqs.pool)
    assert relative_error(logits, torch.cat([pair.hf_logits(p) for p in prompts])) < TOLERANCE[dtype]
    next_rows = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    tokens = [p + [int(t)] for p, t in zip(prompts, logits[next_rows].argmax(-1), strict=True)]
    for subset in ((0, 1, 2, 3), (0, 2), (1,), (3,)):   # decode batches within the GEMV's row range
        ids, positions, meta = seqs.batch([(i, tokens[i][-1:]) for i in subset])
        logits = pair.ours(ids, positions, meta, seqs.pool)
        ref = torch.stack([pair.hf_logits(tokens[i])[-1] for i in subset])
        assert relative_error(logits, ref) < TOLERANCE[dtype]
        for row, i in enumerate(subset):
            tokens[i].append(int(logits[row].argmax()))


@requires_avx2  # the GEMV: its AVX2 build, or the AVX-512 BF16 one (those CPUs have AVX2 too)
def test_lm_head_and_layers_take_the_gemv_only_where_it_reads_the_weight():
    layer = Linear(64, 32, bias=True).bfloat16()
    weight = layer.weight.detach().clone()
    column_major = Linear(64, 32).bfloat16()
    column_major.weight.data = column_major.weight.data.T.contiguous().T
    for module in (layer, column_major, Linear(64, 32)):
        use_decode_linear(module, LINEAR)
    assert layer.decode_gemv is LINEAR and column_major.decode_gemv is None and column_major.decode_weight is None
    x = torch.randn(2, 64).bfloat16()
    with torch.inference_mode():
        assert relative_error(layer(x), F.linear(x.float(), weight.float(), layer.bias.float())) < 1e-2
        assert torch.equal(column_major(x), F.linear(x, column_major.weight, column_major.bias))


@requires_onednn_bf16_reorder
def test_prepacked_linears_match_plain_ones_and_release_the_weight():
    """use_onednn_weights: the same products (bias too) at decode and prefill row counts; the row-major
    copy is released, except where another module shares it (a tied lm_head keeps the embedding's)."""
    g = torch.Generator().manual_seed(5)
    plain, biased = Linear(64, 96).bfloat16(), Linear(64, 96, bias=True).bfloat16()
    embedding = torch.nn.Embedding(96, 64).bfloat16()
    tied = Linear(64, 96).bfloat16()
    tied.weight = embedding.weight
    model = torch.nn.ModuleList([plain, biased, embedding, tied])
    refs = {id(m): (m.weight.detach().clone(), m.bias) for m in (plain, biased, tied)}
    use_onednn_weights(model)
    for module in (plain, biased, tied):
        weight, bias = refs[id(module)]
        for rows in (1, 5, 16, 300):
            x = torch.randn(rows, 64, generator=g).bfloat16()
            with torch.inference_mode():
                assert relative_error(module(x), F.linear(x.float(), weight.float(),
                                                          None if bias is None else bias.float())) < 1e-2
    assert plain.weight.numel() == 0 and biased.weight.numel() == 0
    assert tied.weight.shape == (96, 64) and embedding.weight.shape == (96, 64)


@pytest.mark.parametrize("flags, linear, norms", [
    ({}, True, True),
    ({"enable_deterministic_inference": True}, "every-row-count", True),   # batch-invariant: no row limit
    ({"disable_cpu_kernels": True}, False, False),
], ids=["default", "deterministic", "disabled"])
def test_runner_uses_the_kernels_where_they_apply(flags, linear, norms):
    args = ServerArgs(model_path="tiny", dtype="bfloat16", max_total_tokens=256, random_seed=0, **flags).resolve()
    runner = ModelRunner(args)
    layer = runner.model.model.layers[0]
    assert (layer.input_layernorm.ops is not None) == norms
    assert (runner.sampler.argmax_op is not None) == norms   # the greedy argmax: on wherever the norms are
    assert (runner.model.rotary.kernel is not None) == norms   # and the rotary embedding
    # AMX CPUs in the default mode run every product through oneDNN on prepacked weights instead
    onednn_here = onednn_weights_apply(torch.bfloat16, deterministic=False) and linear is True
    assert (layer.mlp.down_proj.onednn_weight is not None) == onednn_here
    assert runner.model.lm_head.onednn_weight is None   # tiny's lm_head is tied: never a second copy
    gemv_here = LINEAR is not None and linear is not False and not onednn_here
    assert (layer.mlp.down_proj.decode_gemv is not None) == gemv_here
    if gemv_here and linear == "every-row-count":
        assert layer.mlp.down_proj.decode_gemv.max_rows is None
    lm_head = runner.model.lm_head
    # The tiny model's lm_head is tied: only a GEMV that reads the row-major weight in place takes it (a packed
    # copy or oneDNN's prepacked one would be the embedding's second copy)
    op = decode_linear_op(every_row=linear == "every-row-count") if linear is not False else None
    probe = torch.zeros(16, 16, dtype=torch.bfloat16)
    lm_head_gemv = op is not None and op.pack(probe).data_ptr() == probe.data_ptr()
    assert (lm_head.decode_gemv is not None) == lm_head_gemv
    if lm_head_gemv:   # the GEMV reads lm_head in bf16: optimize_layout leaves it so
        assert lm_head.weight.dtype == torch.bfloat16 and lm_head.decode_weight is not None
