"""The compiled extend-attention kernel (csrc/extend_attention.cpp) against float32 SDPA and the model.

The kernel has three tiles: AMX on CPUs that have it and bf16 dot products on AVX-512 BF16 CPUs (bf16 only;
where AMX is there, each is checked), float32 arithmetic on AVX2 CPUs (bf16 and float32). Checked, in every
dtype this machine's build serves: every extend row (fresh
prompts and extends after a cached prefix, over scattered slots, several sequences per call, GQA and plain
multi-head, head dims 16 to 256) matches float32 causal SDPA (within bf16 rounding for bf16); a row's bits
do not depend on the chunk, the batch or the thread count; a model forward through it stays within the
transformers tolerance and picks the same next tokens as the plain-torch path; bad indices and dtypes raise.
Skipped where neither tile is built (no AVX2, no C++ compiler): SDPA then serves every extend.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.model.paged_kernels import BF16_HEAD_DIMS, extend_attention_op
from tests.capabilities import requires_avx2, requires_cpu_kernels
from tests.model.hf_ckpt import CASES
from tests.model.pairs import PROMPT_LENS, TOLERANCE, Pair, random_prompts, relative_error
from tests.model.sdpa_reference import causal_sdpa_reference

OP = extend_attention_op()
pytestmark = [requires_cpu_kernels, requires_avx2]   # the AVX2 tile, or the AVX-512 BF16 / AMX ones
BF16 = torch.bfloat16
# The dtypes this build serves; float32 only with the AVX2 tile.
DTYPES = [dtype for dtype in (BF16, torch.float32) if extend_attention_op(dtype) is not None]
MAX_ERROR = {BF16: 2e-2, torch.float32: 1e-4}   # bf16: the output's rounding (and the bf16 tile's products)
def _pool(slots: int, kv_heads: int, dim: int, seed: int = 0, dtype: torch.dtype = BF16
          ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, kv_heads, dim, generator=g).to(dtype),
            torch.randn(slots, kv_heads, dim, generator=g).to(dtype))


def _run(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, seqs: list[tuple[torch.Tensor, int, int]]
         ) -> torch.Tensor:
    """The op over `seqs` = [(slots of keys 0..prefix+extend-1, prefix, extend)], rows in that order."""
    slots = torch.nn.utils.rnn.pad_sequence([s for s, _, _ in seqs], batch_first=True, padding_value=0)
    extends = torch.tensor([e for _, _, e in seqs])
    starts = torch.cumsum(extends, 0) - extends
    return OP(q.contiguous(), k_buf, v_buf, slots, starts, torch.tensor([p for _, p, _ in seqs]), extends,
              q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 128), (12, 4, 64), (4, 2, 16), (2, 1, 256)],
                         ids=["gqa-64", "mha-128", "gqa3-64", "gqa-16", "gqa-256"])
def test_extends_over_scattered_slots_match_sdpa(heads, kv_heads, dim, dtype, tile):
    k_buf, v_buf = _pool(4096, kv_heads, dim, dtype=dtype)
    perm = torch.randperm(4095, generator=torch.Generator().manual_seed(1)) + 1
    # fresh prompts and extends after a prefix; lengths on and off the 32-key blocks and 16-row tasks
    shapes = [(0, 2), (0, 100), (37, 50), (31, 33), (200, 16), (1000, 7)]
    seqs, first = [], 0
    for prefix, extend in shapes:
        seqs.append((perm[first:first + prefix + extend], prefix, extend))
        first += prefix + extend
    q = torch.randn(sum(e for _, _, e in seqs), heads, dim).to(dtype)
    out = _run(q, k_buf, v_buf, seqs)
    assert out.dtype == dtype
    row = 0
    for slots, prefix, extend in seqs:
        ref = causal_sdpa_reference(q[row:row + extend], k_buf[slots], v_buf[slots], prefix)
        err = (out[row:row + extend].float() - ref).abs().max()
        assert err < MAX_ERROR[dtype], f"prefix {prefix} extend {extend}: max error {err}"
        row += extend


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_scores_that_grow_along_the_keys_stay_finite(dtype, tile):
    """Each key scores higher than the one before, by ~2.5 in log2 units, ~500 over the sequence: a tile
    whose running max lags the scores by more than it may (the AMX tile rescales lazily) overflows."""
    kv_heads, dim, n = 2, 64, 200
    direction = torch.ones(dim) / dim ** 0.5
    growth = torch.arange(n, dtype=torch.float32)[:, None, None] * 1.73   # q.k * dim^-0.5 = 1.73 j nats
    k_buf = (growth * direction).expand(n, kv_heads, dim).to(dtype).contiguous()
    v_buf = torch.randn(n, kv_heads, dim).to(dtype)
    q = (8 * direction).expand(n, 8, dim).to(dtype)
    slots = torch.arange(n)
    out = _run(q, k_buf, v_buf, [(slots, 0, n)])
    ref = causal_sdpa_reference(q, k_buf[slots], v_buf[slots], 0)
    assert torch.isfinite(out.float()).all()
    assert (out.float() - ref).abs().max() < MAX_ERROR[dtype] * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_row_bits_do_not_depend_on_chunk_batch_or_threads(dtype, tile):
    k_buf, v_buf = _pool(2048, 2, 64, dtype=dtype)
    slots = torch.randperm(2047, generator=torch.Generator().manual_seed(3))[:600] + 1
    q = torch.randn(600, 8, 64).to(dtype)
    full = _run(q, k_buf, v_buf, [(slots, 0, 600)])
    for cut in (333, 256, 17):   # the same prompt as a cached prefix + an extend
        assert torch.equal(_run(q[cut:], k_buf, v_buf, [(slots, cut, 600 - cut)]), full[cut:]), f"chunk at {cut}"
    other = torch.arange(700, 1150)
    mixed = torch.cat([torch.randn(40, 8, 64).to(dtype), q[300:]])
    out = _run(mixed, k_buf, v_buf, [(other[:90], 50, 40), (slots, 300, 300)])
    assert torch.equal(out[40:], full[300:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _run(q, k_buf, v_buf, [(slots, 0, 600)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, full)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", list(CASES))
def test_model_through_kernel_matches_hf_and_torch_path(checkpoint_dir, case, dtype):
    pair = Pair.get(checkpoint_dir, case, dtype)
    assert pair.config.head_dim in BF16_HEAD_DIMS
    prompts = random_prompts(PROMPT_LENS, pair.config.vocab_size)
    logits = {}
    for name, op in (("kernel", extend_attention_op(dtype)), ("torch", None)):
        seqs = pair.sequences()
        seqs.extend_kernel = op
        ids, positions, meta = seqs.batch(list(enumerate(prompts)))
        logits[name] = pair.ours(ids, positions, meta, seqs.pool)
        assert (meta.cache["paged_attention_plan"].kernel_extends is not None) == (op is not None)
        # an extend after a cached prefix, next to a decode of another sequence
        ids, positions, meta = seqs.batch([(0, prompts[0][:5]), (1, prompts[1][-1:])])
        logits[name + "-extend"] = pair.ours(ids, positions, meta, seqs.pool)
    ref = torch.cat([pair.hf_logits(p) for p in prompts])
    assert relative_error(logits["kernel"], ref) < TOLERANCE[dtype]
    # The same next token as transformers wherever its top two logits are apart by more than the tolerance
    # allows (in bf16 the kernel's float32 arithmetic and SDPA's may break a near-tie differently).
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > TOLERANCE[dtype] * ref.abs().max()
    assert clear.float().mean() > 0.3   # enough positions for the check to bite
    assert torch.equal(logits["kernel"].argmax(-1)[clear], ref.argmax(-1)[clear])
    assert torch.equal(logits["torch"].argmax(-1)[clear], ref.argmax(-1)[clear])
    assert relative_error(logits["kernel-extend"], logits["torch-extend"]) < TOLERANCE[dtype]


def test_bad_plans_raise():
    k_buf, v_buf = _pool(64, 2, 64)
    q = torch.randn(3, 8, 64).to(BF16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        _run(q, k_buf, v_buf, [(torch.tensor([1, 2, 64]), 0, 3)])
    long_row = torch.arange(1, 41) % 63 + 1
    long_row[37] = -5   # a prefix slot past the first vector blocks, of the second sequence
    with pytest.raises(RuntimeError, match="slot -5 is outside the pool"):
        _run(q, k_buf, v_buf, [(torch.tensor([1]), 0, 1), (long_row, 38, 2)])
    with pytest.raises(RuntimeError, match="keys for a slot row"):
        _run(q, k_buf, v_buf, [(torch.tensor([1, 2, 3]), 1, 3)])
    with pytest.raises(RuntimeError, match="rows are outside q"):
        _run(q[:2], k_buf, v_buf, [(torch.tensor([1, 2, 3]), 0, 3)])
    # q in another dtype than the pool, and a dtype no tile serves (messages: "bfloat16 only" on AVX-512 BF16
    # builds, "all bfloat16 or all float32" on AVX2 ones)
    with pytest.raises(RuntimeError, match="bfloat16"):
        _run(q.float(), k_buf, v_buf, [(torch.tensor([1, 2, 3]), 0, 3)])
    with pytest.raises(RuntimeError, match="bfloat16"):
        _run(q.half(), k_buf.half(), v_buf.half(), [(torch.tensor([1, 2, 3]), 0, 3)])
    slots = torch.tensor([[1, 2, 3]])
    one = torch.tensor([0]), torch.tensor([0]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="scale must be positive"):
        OP(q, k_buf, v_buf, slots, *one, -0.125)


def test_contexts_beyond_the_pack_budget_run_in_waves():
    # 10 sequences x 7,000 keys at head dim 256: 70 MB of packed K/V, past the kernel's 64 MB per wave
    k_buf, v_buf = _pool(70_001, 1, 256, seed=4)
    seqs = [(torch.arange(1 + 7000 * i, 1 + 7000 * (i + 1)), 6997, 3) for i in range(10)]
    q = torch.randn(30, 2, 256).to(BF16)
    out = _run(q, k_buf, v_buf, seqs)
    for i, (slots, prefix, _) in enumerate(seqs):
        ref = causal_sdpa_reference(q[3 * i:3 * i + 3], k_buf[slots], v_buf[slots], prefix)
        assert (out[3 * i:3 * i + 3].float() - ref).abs().max() < 2e-2, f"sequence {i}"
