"""Paged attention over the DeviceKVPool with torch SDPA, for a batch mixing extends and decodes.

A batch is the concatenation of sequences; sequence i has `extend_lens[i]` new tokens after
`prefix_lens[i]` tokens already in the pool. New token j of sequence i sits at absolute position
prefix+j and sees tokens 0..prefix+j of its own sequence (causal).

Two paths, both planned once per forward (`AttentionPlan`, cached in `meta.cache`) and reused by every layer:
  * extend (extend_len > 1): one SDPA call per sequence; a fresh prompt (prefix 0) attends its own new
    K/V directly with `is_causal`, an extend after a cached prefix gathers its slots and uses a bool mask;
  * decode (extend_len == 1): every decode sequence in ONE padded SDPA call. K/V are gathered through a
    `[B, max_len]` slot table padded with slot 0 (reserved page) and a key-padding mask hides the padding.
    The query heads sharing a KV head are laid out as that head's query rows, so no GQA expansion is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvstrata.model.forward_meta import ForwardMetadata

_PLAN_KEY = "paged_attention_plan"


@dataclass
class ExtendSpan:
    """One sequence with several new tokens: its rows, and what it attends over."""

    start: int                       # first row of its new tokens in the batch
    end: int
    prefix_len: int
    kv_slots: Optional[torch.Tensor]  # all slots 0..prefix+extend-1; None when it attends fresh K/V only
    mask: Optional[torch.Tensor]     # [extend, prefix+extend] bool, True = may attend; None = is_causal


@dataclass
class DecodeGroup:
    """All sequences with one new token, attended together in one padded call."""

    rows: Optional[torch.Tensor]     # their rows in the batch; None when the batch is exactly these rows
    slots: torch.Tensor              # [B * max_len] slot of every key, padded with slot 0
    mask: Optional[torch.Tensor]     # [B, 1, 1, max_len] True = real key; None when no row is padded
    batch: int
    max_len: int


@dataclass
class AttentionPlan:
    """Index and mask tensors for one forward, shared by all layers."""

    extends: list[ExtendSpan]
    decode: Optional[DecodeGroup]


def attention_plan(meta: ForwardMetadata, device: torch.device, fresh_kv_ok: bool) -> AttentionPlan:
    """The plan for `meta`, built on first use and cached in `meta.cache`.

    `fresh_kv_ok`: the pool stores K/V in the compute dtype, so a prefix-0 extend may attend the K/V it
    just computed instead of reading them back from the pool (same values, no gather).
    """
    plan = meta.cache.get(_PLAN_KEY)
    if plan is None:
        plan = _build_plan(meta, device, fresh_kv_ok)
        meta.cache[_PLAN_KEY] = plan
    return plan


def _build_plan(meta: ForwardMetadata, device: torch.device, fresh_kv_ok: bool) -> AttentionPlan:
    extends: list[ExtendSpan] = []
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    start = 0
    for i, (prefix, extend) in enumerate(zip(meta.prefix_lens, meta.extend_lens, strict=True)):
        if extend == 1:
            decode_rows.append(start)
            decode_seqs.append(i)
        elif extend > 1:
            extends.append(_extend_span(meta, i, start, prefix, extend, device, fresh_kv_ok))
        start += extend
    decode = _decode_group(meta, decode_seqs, decode_rows, start, device) if decode_seqs else None
    return AttentionPlan(extends=extends, decode=decode)


def _extend_span(meta: ForwardMetadata, i: int, start: int, prefix: int, extend: int,
                 device: torch.device, fresh_kv_ok: bool) -> ExtendSpan:
    if prefix == 0 and fresh_kv_ok:
        return ExtendSpan(start, start + extend, 0, None, None)
    total = prefix + extend
    # Row j (absolute position prefix+j) sees keys 0..prefix+j.
    mask = torch.ones(extend, total, dtype=torch.bool, device=device).tril(diagonal=prefix)
    return ExtendSpan(start, start + extend, prefix, meta.kv_slots[i].to(device), mask)


def _decode_group(meta: ForwardMetadata, seqs: list[int], rows: list[int], num_rows: int,
                  device: torch.device) -> DecodeGroup:
    lens = [meta.prefix_lens[i] + 1 for i in seqs]
    max_len = max(lens)
    slot_lists = [meta.kv_slots[i].to(device) for i in seqs]
    slots = torch.nn.utils.rnn.pad_sequence(slot_lists, batch_first=True, padding_value=0)
    mask = None
    if min(lens) != max_len:
        lens_t = torch.tensor(lens, device=device)
        mask = (torch.arange(max_len, device=device)[None, :] < lens_t[:, None]).view(len(seqs), 1, 1, max_len)
    whole_batch = len(rows) == num_rows  # rows are then 0..n-1 in order
    row_index = None if whole_batch else torch.tensor(rows, dtype=torch.long, device=device)
    return DecodeGroup(rows=row_index, slots=slots.reshape(-1), mask=mask, batch=len(seqs), max_len=max_len)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                    meta: ForwardMetadata, kv_pool) -> torch.Tensor:
    """Write the new tokens' K/V into the pool, then attend. q `[T, H, D]`, k/v `[T, KVH, D]` -> `[T, H*D]`."""
    if meta.layer_wait is not None:
        meta.layer_wait(layer_id)
    kv_pool.set_kv(layer_id, meta.out_slots, k, v)
    plan = attention_plan(meta, q.device, fresh_kv_ok=kv_pool.dtype == k.dtype)
    num_tokens, num_heads, head_dim = q.shape
    if plan.decode is not None and plan.decode.rows is None:
        return _decode(q, layer_id, plan.decode, kv_pool).view(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for span in plan.extends:
        out[span.start:span.end] = _extend(q, k, v, layer_id, span, kv_pool)
    if plan.decode is not None:
        out[plan.decode.rows] = _decode(q[plan.decode.rows], layer_id, plan.decode, kv_pool)
    return out.view(num_tokens, num_heads * head_dim)


def _gather(buffer: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `slots` of one layer's K or V buffer `[N, KVH, D]`, as `[len(slots), KVH, D]`.

    index_select on the 2-D view copies whole rows and is several times faster on CPU than
    advanced indexing of the 3-D buffer.
    """
    flat = buffer.view(buffer.shape[0], -1)
    return flat.index_select(0, slots).view(slots.shape[0], *buffer.shape[1:]).to(dtype)


def _extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, span: ExtendSpan,
            kv_pool) -> torch.Tensor:
    """Attention output `[extend, H, D]` of one sequence's new tokens."""
    q_seq = q[span.start:span.end].transpose(0, 1).unsqueeze(0)
    if span.kv_slots is None:
        k_seq, v_seq = k[span.start:span.end], v[span.start:span.end]
    else:
        k_seq = _gather(kv_pool.k_buffer[layer_id], span.kv_slots, q.dtype)
        v_seq = _gather(kv_pool.v_buffer[layer_id], span.kv_slots, q.dtype)
    if q.is_cuda and span.mask is not None:
        # CUDA's masked kernel (memory-efficient) has no native GQA; expanding K/V keeps it off the
        # O(n^2)-memory math fallback. The CPU flash kernel handles GQA and masks itself.
        group = q.shape[1] // k_seq.shape[1]
        k_seq, v_seq = k_seq.repeat_interleave(group, dim=1), v_seq.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q_seq, k_seq.transpose(0, 1).unsqueeze(0), v_seq.transpose(0, 1).unsqueeze(0),
        attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True)
    return out[0].transpose(0, 1)


def _decode(q: torch.Tensor, layer_id: int, group: DecodeGroup, kv_pool) -> torch.Tensor:
    """Attention output `[B, H, D]` of B single-token queries `[B, H, D]`, one padded SDPA call."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_pool.num_kv_heads
    # Query head h uses KV head h // group_size, so [B, H, D] -> [B, KVH, group_size, D] puts each KV
    # head's queries in its rows; decode needs no causal mask (the new token sees every key).
    q_grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys = _gather(kv_pool.k_buffer[layer_id], group.slots, q.dtype)
    values = _gather(kv_pool.v_buffer[layer_id], group.slots, q.dtype)
    keys = keys.view(batch, group.max_len, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(batch, group.max_len, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=group.mask)
    return out.reshape(batch, num_heads, head_dim)
