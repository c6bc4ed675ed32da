"""Paged attention over the DeviceKVPool with torch SDPA, for a batch mixing extends and decodes.

A batch is the concatenation of sequences; sequence i has `extend_lens[i]` new tokens after
`prefix_lens[i]` tokens already in the pool. New token j of sequence i sits at absolute position
prefix+j and sees tokens 0..prefix+j of its own sequence (causal).

Two paths, both planned once per forward (`AttentionPlan`, cached in `meta.cache`) and reused by every layer:
  * extend (extend_len > 1): one SDPA call per sequence; a fresh prompt (prefix 0) attends its own new
    K/V directly with `is_causal`, an extend after a cached prefix gathers its keys and uses a mask;
  * decode (extend_len == 1): every decode sequence in ONE padded SDPA call. K/V are gathered through a
    `[B, max_len]` index padded with slot 0 (reserved page) and a key-padding mask hides the padding.
    The query heads sharing a KV head are laid out as that head's query rows, so no GQA expansion is needed.
On CPU, a lone sequence whose slots are one ascending range is read in place (no copy), and keys are
otherwise gathered a whole page at a time where the pages allow it (page_size > 1): far fewer, larger
row copies than slot by slot.

With the compiled CPU kernel (`meta.paged_kernel`, see paged_kernels.py) decode rows skip the gather: the
kernel reads every key's pool row in place (in the default mode on AVX-512 BF16 CPUs, a bf16 model gets its
bf16-dot-product variant, decode_attention: same tiles, ~1.3-1.5x faster at 16 streams x 2048 keys). With
`batch_invariant` the float32 kernel attends every row (extends
too), since its rows are invariant by construction (fixed key tiles merged in order); otherwise the
plain-torch invariant path of invariant_attention.py runs. In the default mode, the compiled extend kernel
(`meta.extend_kernel`) takes every extend, cached prefix or not, in one call that reads its keys in place
too: on AVX-512 BF16 CPUs with bf16 dot products (bf16 models; 2.4-2.6x SDPA's CPU flash kernel on a
2048-token prefill or a 256-token extend after 1024), on AVX2 CPUs in float32 arithmetic (bf16 and float32
models; see docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvstrata.model import invariant_attention
from kvstrata.model.forward_meta import ForwardMetadata

_PLAN_KEY = "paged_attention_plan"


@dataclass
class KVIndex:
    """Which pool rows hold the keys: a contiguous slot range, or an index to gather by.

    `index` counts in units of `unit` slots (1 = slots, page_size = pages); None = the slot range
    `start .. start + length - 1`, read in place.
    """

    index: Optional[torch.Tensor]   # flat, long
    unit: int = 1
    start: int = 0
    length: int = 0


@dataclass
class ExtendSpan:
    """One sequence with several new tokens: its rows, and what it attends over."""

    start: int                       # first row of its new tokens in the batch
    end: int
    kv: Optional[KVIndex]            # all its keys 0..prefix+extend-1; None = attend the fresh K/V only
    num_keys: int
    mask: Optional[torch.Tensor]     # [extend, num_keys] additive (0 / -inf); None = is_causal
    prefix: int = 0                  # tokens before the first new one


@dataclass
class DecodeGroup:
    """All sequences with one new token, attended together in one padded call."""

    rows: Optional[torch.Tensor]     # their rows in the batch; None when the batch is exactly these rows
    kv: KVIndex                      # batch * max_len keys, padding points at the reserved page 0
    mask: Optional[torch.Tensor]     # [B, 1, 1, max_len] additive, -inf on padding; None when none is padded
    batch: int
    max_len: int
    lens: list[int]                  # keys per sequence (its position + 1)


@dataclass
class KernelRows:
    """Query rows the compiled paged kernel attends in place (no gather): row r reads keys
    0..lens[r]-1 of sequence seq[r], whose key j is pool row slots[seq[r], j]."""

    rows: Optional[torch.Tensor]     # their rows in the batch; None when they are the whole batch
    slots: torch.Tensor              # [S, max keys] long, padded with the reserved slot 0
    seq: torch.Tensor                # [R] long
    lens: torch.Tensor               # [R] long


@dataclass
class KernelExtends:
    """Extends the compiled extend kernel attends in place: sequence s has extend[s] new tokens at
    batch rows q_start[s].., after prefix[s] cached ones; its key j is pool row slots[s, j]."""

    slots: torch.Tensor              # [S, max keys] long, padded with the reserved slot 0
    q_start: torch.Tensor            # [S] long
    prefix: torch.Tensor             # [S] long
    extend: torch.Tensor             # [S] long


@dataclass
class AttentionPlan:
    """Index and mask tensors for one forward, shared by all layers."""

    extends: list[ExtendSpan]
    decode: Optional[DecodeGroup]
    kernel: Optional[KernelRows] = None
    kernel_extends: Optional[KernelExtends] = None


def attention_plan(meta: ForwardMetadata, q: torch.Tensor, kv_pool) -> AttentionPlan:
    """The plan for `meta`, built on first use and cached in `meta.cache`.

    Masks are additive in the compute dtype (SDPA would otherwise convert a bool mask on every call).
    When the pool stores K/V in the compute dtype, a prefix-0 extend attends the K/V it just computed
    instead of reading them back from the pool (same values, no gather).
    """
    plan = meta.cache.get(_PLAN_KEY)
    if plan is None:
        if meta.paged_kernel is not None and meta.batch_invariant:
            plan = AttentionPlan([], None, _kernel_rows(meta, range(len(meta.extend_lens)), q.device))
        else:
            plan = _build_plan(meta, q.device, q.dtype, kv_pool.page_size, fresh_kv_ok=kv_pool.dtype == q.dtype,
                               masks=not meta.batch_invariant)   # the invariant kernel masks by position
        meta.cache[_PLAN_KEY] = plan
    return plan


def _kernel_rows(meta: ForwardMetadata, seqs, device: torch.device, rows: Optional[torch.Tensor] = None
                 ) -> KernelRows:
    """Every new token of the sequences `seqs` (batch order), for the compiled kernel."""
    seqs = list(seqs)
    totals = [meta.prefix_lens[i] + meta.extend_lens[i] for i in seqs]
    slots = _padded_slots(meta, seqs, device)
    extends = torch.tensor([meta.extend_lens[i] for i in seqs])
    seq = torch.repeat_interleave(torch.arange(len(seqs)), extends)
    lens = torch.cat([torch.arange(meta.prefix_lens[i] + 1, n + 1) for i, n in zip(seqs, totals, strict=True)])
    return KernelRows(rows, slots, seq.to(device), lens.to(device))


def _padded_slots(meta: ForwardMetadata, seqs: list[int], device: torch.device) -> torch.Tensor:
    """`[S, max keys]` long: each sequence's slots of keys 0..prefix+extend-1, padded with the reserved slot 0."""
    rows = [meta.kv_slots[i][:meta.prefix_lens[i] + meta.extend_lens[i]] for i in seqs]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0).to(device).contiguous()


def _build_plan(meta: ForwardMetadata, device: torch.device, dtype: torch.dtype, page_size: int,
                fresh_kv_ok: bool, masks: bool = True) -> AttentionPlan:
    extends: list[ExtendSpan] = []
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    kernel_seqs: list[tuple[int, int]] = []   # (sequence, first row) for the extend kernel
    start = 0
    for i, (prefix, extend) in enumerate(zip(meta.prefix_lens, meta.extend_lens, strict=True)):
        if extend == 1:
            decode_rows.append(start)
            decode_seqs.append(i)
        elif extend > 1 and meta.extend_kernel is not None:
            kernel_seqs.append((i, start))
        elif extend > 1:
            extends.append(_extend_span(meta.kv_slots[i].to(device), start, prefix, extend, dtype, page_size,
                                        fresh_kv_ok, masks))
        start += extend
    kernel_extends = _kernel_extends(meta, kernel_seqs, device) if kernel_seqs else None
    decode, kernel = None, None
    if decode_seqs and meta.paged_kernel is not None:
        whole_batch = len(decode_rows) == start
        rows = None if whole_batch else torch.tensor(decode_rows, dtype=torch.long, device=device)
        kernel = _kernel_rows(meta, decode_seqs, device, rows)
    elif decode_seqs:
        decode = _decode_group(meta, decode_seqs, decode_rows, start, device, dtype, page_size, masks)
    return AttentionPlan(extends=extends, decode=decode, kernel=kernel, kernel_extends=kernel_extends)


def _kernel_extends(meta: ForwardMetadata, seqs: list[tuple[int, int]], device: torch.device) -> KernelExtends:
    long = dict(dtype=torch.long, device=device)
    return KernelExtends(_padded_slots(meta, [i for i, _ in seqs], device), torch.tensor([row for _, row in seqs], **long),
                         torch.tensor([meta.prefix_lens[i] for i, _ in seqs], **long),
                         torch.tensor([meta.extend_lens[i] for i, _ in seqs], **long))


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _kv_index(slots: torch.Tensor, lens: list[int], page_size: int) -> tuple[KVIndex, int]:
    """(index, keys per row) for padded slot rows `slots` `[B, L]` (row b real up to lens[b]).

    A single row holding one ascending slot range is read in place. Otherwise whole pages are gathered
    when every row's real slots are its pages in order (slot j at page[j // P] * P + j % P, which the
    page allocator guarantees); else slot by slot. Checked on CPU only, where these pay and the checks
    cost no device sync.
    """
    rows, max_len = slots.shape
    if rows == 1 and slots.device.type == "cpu":
        first = int(slots[0, 0])
        if torch.equal(slots[0], torch.arange(first, first + max_len)):
            return KVIndex(None, start=first, length=max_len), max_len
    if page_size > 1 and slots.device.type == "cpu":
        num_pages = -(-max_len // page_size)
        padded = F.pad(slots, (0, num_pages * page_size - max_len))
        pages = padded[:, ::page_size] // page_size
        expected = (pages.unsqueeze(-1) * page_size + torch.arange(page_size)).view(rows, -1)
        real = torch.arange(num_pages * page_size)[None, :] < torch.tensor(lens)[:, None]
        if bool(((expected == padded) | ~real).all()):
            return KVIndex(pages.reshape(-1), page_size), num_pages * page_size
    return KVIndex(slots.reshape(-1), 1), max_len


def _extend_span(slots: torch.Tensor, start: int, prefix: int, extend: int, dtype: torch.dtype,
                 page_size: int, fresh_kv_ok: bool, masks: bool = True) -> ExtendSpan:
    if prefix == 0 and fresh_kv_ok:
        return ExtendSpan(start, start + extend, None, extend, None, prefix)
    total = prefix + extend
    kv, num_keys = _kv_index(slots[None, :total], [total], page_size)
    if not masks:
        return ExtendSpan(start, start + extend, kv, num_keys, None, prefix)
    # Row j (absolute position prefix+j) sees keys 0..prefix+j; keys past `total` are page padding.
    allowed = torch.ones(extend, num_keys, dtype=torch.bool, device=slots.device).tril(diagonal=prefix)
    return ExtendSpan(start, start + extend, kv, num_keys, _additive(allowed, dtype), prefix)


def _decode_group(meta: ForwardMetadata, seqs: list[int], rows: list[int], num_rows: int,
                  device: torch.device, dtype: torch.dtype, page_size: int, masks: bool = True) -> DecodeGroup:
    lens = [meta.prefix_lens[i] + 1 for i in seqs]
    slot_lists = [meta.kv_slots[i].to(device)[:n] for i, n in zip(seqs, lens, strict=True)]
    slots = torch.nn.utils.rnn.pad_sequence(slot_lists, batch_first=True, padding_value=0)
    kv, max_len = _kv_index(slots, lens, page_size)
    mask = None
    if masks and min(lens) != max_len:
        real = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        mask = _additive(real, dtype).view(len(seqs), 1, 1, max_len)
    whole_batch = len(rows) == num_rows  # rows are then 0..n-1 in order
    row_index = None if whole_batch else torch.tensor(rows, dtype=torch.long, device=device)
    return DecodeGroup(rows=row_index, kv=kv, mask=mask, batch=len(seqs), max_len=max_len, lens=lens)


# Every SDPA backend but cuDNN's: cuDNN builds an execution graph for each new sequence length, and a
# server's lengths are new at every step (on an H200, bf16 decode of the bench model ran at 32 tok/s with
# it and at 295 tok/s in float32, which cuDNN does not take).
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA backends a forward on `device` uses, as a context around its layers: on CUDA every one but
    cuDNN's. Entered once per forward rather than per SDPA call: each entry costs ~10 us of Python."""
    return sdpa_kernel(_NO_CUDNN) if device.type == "cuda" else contextlib.nullcontext()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    meta: ForwardMetadata, kv_pool) -> torch.Tensor:
    """Write the new tokens' K/V into the pool, then attend. q `[T, H, D]`, k/v `[T, KVH, D]` -> `[T, H*D]`.

    An FP8 pool's scales are folded in on every path alike: the K scale into the softmax scale, the V scale
    into the output (memory/kv_format.py); the stored values are read as they are.
    """
    if meta.layer_wait is not None:
        meta.layer_wait(layer_id)
    kv_pool.set_kv(layer_id, meta.out_slots, k, v)
    fmt = kv_pool.kv_format
    out = _attend(q, k, v, layer_id, meta, kv_pool, q.shape[-1] ** -0.5 * fmt.k_scale(layer_id))
    v_scale = fmt.v_scale(layer_id)
    return out if v_scale == 1.0 else out.mul_(v_scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, meta: ForwardMetadata, kv_pool,
            scale: float) -> torch.Tensor:
    plan = attention_plan(meta, q, kv_pool)
    num_tokens, num_heads, head_dim = q.shape
    if plan.kernel is not None and plan.kernel.rows is None:
        return _in_place(q, layer_id, plan.kernel, meta, kv_pool, scale).view(num_tokens, num_heads * head_dim)
    if meta.batch_invariant:
        return _invariant(q, k, v, layer_id, plan, kv_pool, scale).view(num_tokens, num_heads * head_dim)
    if plan.decode is not None and plan.decode.rows is None:
        return _decode(q, layer_id, plan.decode, kv_pool, scale).view(num_tokens, num_heads * head_dim)
    if plan.kernel_extends is not None:   # fills the extends' rows (the others are zero)
        out = _extend_in_place(q, layer_id, plan.kernel_extends, meta, kv_pool, scale)
    else:
        out = q.new_empty(num_tokens, num_heads, head_dim)
    for span in plan.extends:
        out[span.start:span.end] = _extend(q, k, v, layer_id, span, kv_pool, scale)
    if plan.decode is not None:
        out[plan.decode.rows] = _decode(q[plan.decode.rows], layer_id, plan.decode, kv_pool, scale)
    if plan.kernel is not None:
        out[plan.kernel.rows] = _in_place(q[plan.kernel.rows], layer_id, plan.kernel, meta, kv_pool, scale)
    return out.view(num_tokens, num_heads * head_dim)


def _in_place(q: torch.Tensor, layer_id: int, rows: KernelRows, meta: ForwardMetadata, kv_pool,
              scale: float) -> torch.Tensor:
    """The compiled kernel over `rows` (queries `q` `[R, H, D]`), reading the pool's K/V rows in place."""
    return meta.paged_kernel(q.contiguous(), kv_pool.k_buffer[layer_id], kv_pool.v_buffer[layer_id], rows.slots,
                             rows.seq, rows.lens, scale)


def _extend_in_place(q: torch.Tensor, layer_id: int, ext: KernelExtends, meta: ForwardMetadata,
                     kv_pool, scale: float) -> torch.Tensor:
    """The compiled extend kernel over every extend of the batch: `[T, H, D]`, other rows zero."""
    return meta.extend_kernel(q.contiguous(), kv_pool.k_buffer[layer_id], kv_pool.v_buffer[layer_id], ext.slots,
                              ext.q_start, ext.prefix, ext.extend, scale)


def _invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, plan: AttentionPlan,
               kv_pool, scale: float) -> torch.Tensor:
    """The batch-invariant path: same plan and gathers, fixed-split attention (see invariant_attention)."""
    out = torch.empty_like(q)
    for span in plan.extends:
        if span.kv is None:
            keys, values = k[span.start:span.end], v[span.start:span.end]
        else:
            keys = _gather(kv_pool.k_buffer[layer_id], span.kv, q.dtype)
            values = _gather(kv_pool.v_buffer[layer_id], span.kv, q.dtype)
        total = span.prefix + span.end - span.start
        out[span.start:span.end] = invariant_attention.attend_sequence(
            q[span.start:span.end], keys[:total], values[:total], span.prefix, scale)
    group = plan.decode
    if group is not None:
        shape = (group.batch, group.max_len, kv_pool.num_kv_heads, q.shape[-1])
        keys = _gather(kv_pool.k_buffer[layer_id], group.kv, q.dtype).view(shape)
        values = _gather(kv_pool.v_buffer[layer_id], group.kv, q.dtype).view(shape)
        rows = slice(None) if group.rows is None else group.rows
        out[rows] = invariant_attention.attend_decodes(q[rows], keys, values, group.lens, scale)
    return out


def _gather(buffer: torch.Tensor, kv: KVIndex, dtype: torch.dtype) -> torch.Tensor:
    """Rows of one layer's K or V buffer `[N, KVH, D]` picked by `kv`, as `[keys, KVH, D]`.

    index_select on a 2-D view copies whole rows and is several times faster on CPU than advanced
    indexing of the 3-D buffer.
    """
    if kv.index is None:
        rows = buffer[kv.start:kv.start + kv.length]
    else:   # FP8 rows are picked as bytes (index_select has no float8 kernel on every device)
        raw = buffer.view(torch.uint8) if buffer.element_size() == 1 else buffer
        rows = raw.view(buffer.shape[0] // kv.unit, -1).index_select(0, kv.index)
        rows = rows.view(buffer.dtype).view(-1, *buffer.shape[1:])
    return rows if rows.dtype == dtype else rows.to(dtype)   # an FP8 pool is upcast here: these rows only


def _extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, span: ExtendSpan,
            kv_pool, scale: float) -> torch.Tensor:
    """Attention output `[extend, H, D]` of one sequence's new tokens."""
    q_seq = q[span.start:span.end].transpose(0, 1).unsqueeze(0)
    if span.kv is None:
        k_seq, v_seq = k[span.start:span.end], v[span.start:span.end]
    else:
        k_seq = _gather(kv_pool.k_buffer[layer_id], span.kv, q.dtype)
        v_seq = _gather(kv_pool.v_buffer[layer_id], span.kv, q.dtype)
    if q.is_cuda and span.mask is not None:
        # CUDA's masked kernel (memory-efficient) has no native GQA; expanding K/V keeps it off the
        # O(n^2)-memory math fallback. The CPU flash kernel handles GQA and masks itself.
        group = q.shape[1] // k_seq.shape[1]
        k_seq, v_seq = k_seq.repeat_interleave(group, dim=1), v_seq.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q_seq, k_seq.transpose(0, 1).unsqueeze(0), v_seq.transpose(0, 1).unsqueeze(0),
        attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True, scale=_sdpa_scale(scale, q))
    return out[0].transpose(0, 1)


def _sdpa_scale(scale: float, q: torch.Tensor) -> Optional[float]:
    """SDPA's `scale`: None (its own 1/sqrt(D), the same bits as ever) unless a K scale changed it."""
    return None if scale == q.shape[-1] ** -0.5 else scale


def _decode(q: torch.Tensor, layer_id: int, group: DecodeGroup, kv_pool, scale: float) -> torch.Tensor:
    """Attention output `[B, H, D]` of B single-token queries `[B, H, D]`, one padded SDPA call."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_pool.num_kv_heads
    # Query head h uses KV head h // group_size, so [B, H, D] -> [B, KVH, group_size, D] puts each KV
    # head's queries in its rows; decode needs no causal mask (the new token sees every key).
    q_grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys = _gather(kv_pool.k_buffer[layer_id], group.kv, q.dtype)
    values = _gather(kv_pool.v_buffer[layer_id], group.kv, q.dtype)
    keys = keys.view(batch, group.max_len, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(batch, group.max_len, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=group.mask, scale=_sdpa_scale(scale, q))
    return out.reshape(batch, num_heads, head_dim)
