"""The compiled bf16 decode-attention kernel (decode_attention in csrc/paged_attention.cpp) against float32 SDPA.

Checked: decode rows over scattered slots match float32 SDPA within bf16 rounding for GQA groups of 1 to 8
heads and head dims 16 to 256, with lengths on and off the 16-key blocks and 256-key tiles; a row's bits do
not depend on its batch or the thread count; a model forward through it stays within the transformers
tolerance and picks the same next tokens as the float32 kernel; the runner gives it to bf16 models in the
default mode only; bad plans raise. Skipped where the CPU has no AVX-512 BF16 (the op is then not built).
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.model.paged_kernels import BF16_HEAD_DIMS, decode_attention_op, paged_attention_op
from tests.capabilities import requires_avx512_bf16, requires_cpu_kernels
from tests.model.hf_ckpt import CASES
from tests.model.pairs import PROMPT_LENS, TOLERANCE, Pair, random_prompts, relative_error
from tests.model.sdpa_reference import causal_sdpa_reference

OP = decode_attention_op()
pytestmark = [requires_cpu_kernels, requires_avx512_bf16]   # elsewhere the op is not built: the float32 kernel serves
BF16 = torch.bfloat16
LENS = [1, 2, 15, 16, 17, 255, 256, 257, 700]   # inside a block, on block and tile edges, several tiles


def _pool(slots: int, kv_heads: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, kv_heads, dim, generator=g).to(BF16),
            torch.randn(slots, kv_heads, dim, generator=g).to(BF16))


def _run(op, q: torch.Tensor, k_buf, v_buf, seq_slots: list[torch.Tensor], row_seq: list[int], lens: list[int]):
    slots = torch.nn.utils.rnn.pad_sequence(seq_slots, batch_first=True, padding_value=0)
    return op(q.contiguous(), k_buf, v_buf, slots, torch.tensor(row_seq), torch.tensor(lens), q.shape[-1] ** -0.5)


def _scattered(n_slots: int, lens: list[int], seed: int = 1) -> list[torch.Tensor]:
    perm = torch.randperm(n_slots - 1, generator=torch.Generator().manual_seed(seed)) + 1
    starts = torch.tensor([0, *lens]).cumsum(0)
    return [perm[int(s):int(s) + n] for s, n in zip(starts, lens)]


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 128), (12, 4, 64), (8, 1, 32), (2, 1, 256),
                                                (16, 2, 64), (4, 2, 16)],
                         ids=["gqa4-64", "mha-128", "gqa3-64", "gqa8-32", "gqa2-256", "gqa8-64", "gqa2-16"])
def test_decodes_over_scattered_slots_match_sdpa(heads, kv_heads, dim):
    k_buf, v_buf = _pool(4096, kv_heads, dim)
    seq_slots = _scattered(4096, LENS)
    q = (2 * torch.randn(len(LENS), heads, dim)).to(BF16)   # sharper softmax than unit queries
    out = _run(OP, q, k_buf, v_buf, seq_slots, list(range(len(LENS))), LENS)
    for i, n in enumerate(LENS):
        ref = causal_sdpa_reference(q[i:i + 1], k_buf[seq_slots[i]], v_buf[seq_slots[i]], n - 1)[0]
        err = (out[i].float() - ref).abs().max()
        assert err < 2e-2, f"{n} keys: max error {err}"


def test_row_bits_do_not_depend_on_batch_or_threads():
    k_buf, v_buf = _pool(4096, 2, 64)
    seq_slots = _scattered(4096, LENS)
    q = torch.randn(len(LENS), 8, 64).to(BF16)
    full = _run(OP, q, k_buf, v_buf, seq_slots, list(range(len(LENS))), LENS)
    for i in (0, 5, 8):   # alone, and among other rows of other sequences
        alone = _run(OP, q[i:i + 1], k_buf, v_buf, [seq_slots[i]], [0], [LENS[i]])
        assert torch.equal(alone[0], full[i])
        mixed = torch.cat([torch.randn(2, 8, 64).to(BF16), q[i:i + 1]])
        out = _run(OP, mixed, k_buf, v_buf, [seq_slots[7], seq_slots[i]], [0, 0, 1], [3, 200, LENS[i]])
        assert torch.equal(out[2], full[i]), f"row {i} in a mixed batch"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _run(OP, q, k_buf, v_buf, seq_slots, list(range(len(LENS))), LENS)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, full)


@pytest.mark.parametrize("case", list(CASES))
def test_model_through_kernel_matches_hf_and_float32_kernel(checkpoint_dir, case):
    pair = Pair.get(checkpoint_dir, case, BF16)
    assert pair.config.head_dim in BF16_HEAD_DIMS
    prompts = random_prompts(PROMPT_LENS, pair.config.vocab_size)
    logits = {}
    for name, op in (("bf16", OP), ("f32", paged_attention_op())):
        seqs = pair.sequences()
        seqs.paged_kernel = op
        ids, positions, meta = seqs.batch(list(enumerate(prompts)))
        first = pair.ours(ids, positions, meta, seqs.pool)
        next_rows = torch.tensor(PROMPT_LENS).cumsum(0) - 1
        tokens = [p + [int(t)] for p, t in zip(prompts, first[next_rows].argmax(-1), strict=True)]
        ids, positions, meta = seqs.batch([(i, t[-1:]) for i, t in enumerate(tokens)])   # one decode row each
        logits[name] = pair.ours(ids, positions, meta, seqs.pool)
        assert meta.cache["paged_attention_plan"].kernel is not None
    ref = torch.stack([pair.hf_logits(t)[-1] for t in tokens])
    assert relative_error(logits["bf16"], ref) < TOLERANCE[BF16]
    assert torch.equal(logits["bf16"].argmax(-1), logits["f32"].argmax(-1))


def test_runner_uses_it_for_bf16_default_mode_only():
    from kvstrata.args import ServerArgs
    from kvstrata.runtime.model_runner import ModelRunner

    def kernel(**kw) -> object:
        return ModelRunner(ServerArgs(model_path="tiny", max_total_tokens=256, **kw).resolve()).paged_kernel

    assert kernel(dtype="bfloat16") is OP
    assert kernel(dtype="bfloat16", enable_deterministic_inference=True) is paged_attention_op()
    assert kernel(dtype="float32") is paged_attention_op()
    assert kernel(dtype="bfloat16", disable_cpu_kernels=True) is None


def test_bad_plans_raise():
    k_buf, v_buf = _pool(64, 2, 64)
    q = torch.randn(1, 8, 64).to(BF16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        _run(OP, q, k_buf, v_buf, [torch.tensor([1, 2, 64])], [0], [3])
    with pytest.raises(RuntimeError, match="keys of"):
        _run(OP, q, k_buf, v_buf, [torch.tensor([1, 2, 3])], [0], [4])
    with pytest.raises(RuntimeError, match="q: bfloat16"):
        _run(OP, q.float(), k_buf.float(), v_buf.float(), [torch.tensor([1, 2, 3])], [0], [3])
    k48, v48 = _pool(64, 2, 48)
    with pytest.raises(RuntimeError, match="head dim"):
        _run(OP, torch.randn(1, 8, 48).to(BF16), k48, v48, [torch.tensor([1, 2, 3])], [0], [3])
