"""The compiled CPU paged-attention kernel against the plain-torch paths it replaces.

Checked: each row equals SDPA over the same keys (decodes over scattered slots, extends after a prefix),
a row's bits do not depend on its batch, on chunking or on the thread count (what deterministic inference
needs), and a whole model forward through it stays within the transformers tolerances.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.model.paged_kernels import paged_attention_op
from tests.capabilities import requires_cpu_kernels
from tests.model.hf_ckpt import CASES
from tests.model.pairs import PROMPT_LENS, TOLERANCE, Pair, random_prompts, relative_error
from tests.model.sdpa_reference import causal_sdpa_reference

OP = paged_attention_op()
pytestmark = requires_cpu_kernels
DTYPES = [torch.float32, torch.bfloat16]
HEADS, KV_HEADS, DIM = 8, 2, 64


def _pool(slots: int, dtype: torch.dtype, seed: int = 0, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(slots, KV_HEADS, dim, generator=g).to(dtype),
            torch.randn(slots, KV_HEADS, dim, generator=g).to(dtype))


def _run(q, k_buf, v_buf, seq_slots: list[torch.Tensor], row_seq: list[int], lens: list[int]) -> torch.Tensor:
    slots = torch.nn.utils.rnn.pad_sequence(seq_slots, batch_first=True, padding_value=0)
    return OP(q.contiguous(), k_buf, v_buf, slots, torch.tensor(row_seq), torch.tensor(lens), q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dim", [64, 128, 32], ids=["vector-64", "vector-128", "scalar-32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_decodes_over_scattered_slots_match_sdpa(dtype, dim):
    # head dims 64 and 128 take the AVX-512 tile where the CPU has it; others the portable one
    k_buf, v_buf = _pool(4096, dtype, dim=dim)
    lens = [1, 255, 256, 257, 1500]            # inside one tile, on tile edges, several tiles
    perm = torch.randperm(4095, generator=torch.Generator().manual_seed(1)) + 1
    seq_slots = [perm[sum(lens[:i]) % 2000:][:n] for i, n in enumerate(lens)]
    q = torch.randn(len(lens), HEADS, dim).to(dtype)
    out = _run(q, k_buf, v_buf, seq_slots, list(range(len(lens))), lens)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for i, n in enumerate(lens):
        ref = causal_sdpa_reference(q[i:i + 1], k_buf[seq_slots[i]], v_buf[seq_slots[i]], n - 1)
        assert (out[i].float() - ref[0]).abs().max() < tolerance, f"sequence of {n} keys"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_extend_after_prefix_matches_causal_sdpa(dtype):
    k_buf, v_buf = _pool(1024, dtype)
    slots = torch.randperm(1023, generator=torch.Generator().manual_seed(2))[:600] + 1
    prefix, n = 333, 267
    q = torch.randn(n, HEADS, DIM).to(dtype)
    out = _run(q, k_buf, v_buf, [slots], [0] * n, list(range(prefix + 1, prefix + n + 1)))
    ref = causal_sdpa_reference(q, k_buf[slots], v_buf[slots], prefix)
    assert (out.float() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dim", [64, 32], ids=["vector", "scalar"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_row_bits_do_not_depend_on_batch_chunking_or_threads(dtype, dim):
    k_buf, v_buf = _pool(2048, dtype, dim=dim)
    slots = torch.arange(1, 601)
    q = torch.randn(600, HEADS, dim).to(dtype)
    full = _run(q, k_buf, v_buf, [slots], [0] * 600, list(range(1, 601)))
    chunk = _run(q[333:], k_buf, v_buf, [slots], [0] * 267, list(range(334, 601)))
    assert torch.equal(chunk, full[333:])
    other = torch.arange(700, 1150)
    for pos in (0, 255, 256, 599):
        queries = torch.cat([torch.randn(1, HEADS, dim).to(dtype), q[pos:pos + 1],
                             torch.randn(2, HEADS, dim).to(dtype)])
        out = _run(queries, k_buf, v_buf, [other, slots], [0, 1, 1, 0], [450, pos + 1, 17, 3])
        assert torch.equal(out[1], full[pos]), f"decode at position {pos}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _run(q, k_buf, v_buf, [slots], [0] * 600, list(range(1, 601)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, full)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_model_through_kernel_matches_hf(checkpoint_dir, case, dtype, invariant):
    pair = Pair.get(checkpoint_dir, case, dtype)
    prompts = random_prompts(PROMPT_LENS, pair.config.vocab_size)
    seqs = pair.sequences()
    seqs.paged_kernel, seqs.batch_invariant = OP, invariant
    ids, positions, meta = seqs.batch(list(enumerate(prompts)))
    logits = pair.ours(ids, positions, meta, seqs.pool)
    assert meta.cache["paged_attention_plan"].kernel is not None
    ref = torch.cat([pair.hf_logits(p) for p in prompts])
    assert relative_error(logits, ref) < TOLERANCE[dtype]
    next_rows = torch.tensor(PROMPT_LENS).cumsum(0) - 1
    tokens = [p + [int(t)] for p, t in zip(prompts, logits[next_rows].argmax(-1), strict=True)]
    for _ in range(2):
        # decodes mixed with an extend after a prefix: the kernel takes the decode rows, SDPA the extend
        chunks = [(i, t[-1:]) for i, t in enumerate(tokens)] + [(9, tokens[1][:6])]
        ids, positions, meta = seqs.batch(chunks)
        logits = pair.ours(ids, positions, meta, seqs.pool)
        ref = torch.stack([pair.hf_logits(t)[-1] for t in tokens])
        assert relative_error(logits[:len(tokens)], ref) < TOLERANCE[dtype]
        tokens = [t + [int(x)] for t, x in zip(tokens, logits[:len(tokens)].argmax(-1), strict=True)]


@pytest.mark.parametrize("bad", [-1, 64, 2**62, -2**63], ids=["negative", "pool-size", "huge", "int64-min"])
@pytest.mark.parametrize("at", [0, 37, 298, 299])
def test_a_bad_slot_anywhere_in_a_long_plan_raises_naming_it(bad, at):
    # the check runs in vector blocks, then searches: a bad slot in any lane, block or tail is found
    k_buf, v_buf = _pool(64, torch.float32)
    slots = torch.arange(300) % 63 + 1
    slots[at] = bad
    long_row, short_row = slots, torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError, match=f"slot {bad} is outside the pool"):
        _run(torch.randn(2, HEADS, DIM), k_buf, v_buf, [short_row, long_row], [0, 0], [3, 3])


def test_indices_outside_the_pool_or_slot_table_raise():
    k_buf, v_buf = _pool(64, torch.float32)
    q = torch.randn(1, HEADS, DIM)
    with pytest.raises(RuntimeError, match="outside the pool"):
        _run(q, k_buf, v_buf, [torch.tensor([1, 2, 64])], [0], [3])
    with pytest.raises(RuntimeError, match="keys of"):
        _run(q, k_buf, v_buf, [torch.tensor([1, 2, 3])], [0], [4])
    with pytest.raises(RuntimeError, match="names sequence"):
        _run(q, k_buf, v_buf, [torch.tensor([1, 2, 3])], [1], [3])
