"""Batch-invariant paged attention (`--enable-deterministic-inference`).

Every query row is computed by the same sequence of floating-point operations whatever else is in the
batch, however the prompt was chunked and whether its prefix came from the cache:

  * keys are read in fixed tiles of `KEY_TILE` positions, tile t covering positions
    [t * KEY_TILE, (t + 1) * KEY_TILE), zero-padded past the sequence's end;
  * each tile is one float32 matmul of a fixed shape per row: scores `[rows, KEY_TILE]`, then
    probabilities @ values with a reduction over exactly KEY_TILE keys;
  * the softmax is online over the tiles in order (running max m, sum l, accumulator acc):

        m' = max(m, rowmax(S_t));  p = exp(S_t - m');  a = exp(m - m')
        l' = a * l + rowsum(p);    acc' = a * acc + p @ V_t;       out = acc / l

    A tile that is entirely masked for a row (keys after it, or padding) leaves m, l and acc bit-for-bit
    unchanged (p = 0, a = 1), so a row attends identically in a decode step, in a long prefill, or in
    any chunk of one;
  * row counts are padded to a multiple of `ROW_BLOCK`, because a matmul with very few rows takes a
    different kernel (measured: float32 GEMMs of 1-11 rows round differently on x86 CPUs).

K/V are read from the pool (never the fresh projections) and upcast to float32, which is exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_TILE = 256
ROW_BLOCK = 16
# Query tokens attended per matmul block in a long extend: bounds the score tile's memory and lets the
# block skip key tiles that lie wholly after its last query (their effect would be exactly nothing).
QUERY_BLOCK = 512


def attend_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int,
                    scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new queries `q` `[n, H, D]` at positions first_pos.. over
    `keys`/`values` `[L, KVH, D]` (positions 0..L-1, L = first_pos + n). Returns `[n, H, D]` in q's dtype."""
    n = q.shape[0]
    out = torch.empty_like(q)
    for start in range(0, n, QUERY_BLOCK):
        end = min(n, start + QUERY_BLOCK)
        positions = torch.arange(first_pos + start, first_pos + end, device=q.device)
        k, v = keys[None, :first_pos + end], values[None, :first_pos + end]
        out[start:end] = _attend(q[None, start:end], k, v, positions[None, :], scale)[0]
    return out


def attend_decodes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens: list[int],
                   scale: float) -> torch.Tensor:
    """Single-token queries `q` `[B, H, D]`; sequence b attends `keys[b, :lens[b]]` of `keys`/`values`
    `[B, max_len, KVH, D]` (the rest is padding). Returns `[B, H, D]`."""
    positions = torch.tensor(lens, device=q.device)[:, None] - 1
    return _attend(q[:, None], keys, values, positions, scale)[:, 0]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q `[B, n, H, D]` at `positions` `[B, n]`, keys/values `[B, L, KVH, D]` -> `[B, n, H, D]`.

    Query row (b, i) sees keys 0..positions[b, i] of sequence b.
    """
    batch, n, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    rows = n * group
    padded_rows = -(-rows // ROW_BLOCK) * ROW_BLOCK
    # [B, n, H, D] -> [B, KVH, n * group, D]: the query heads sharing a KV head become that head's rows.
    qg = (q.float() * scale).view(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    qg = F.pad(qg.reshape(batch, num_kv_heads, rows, head_dim), (0, 0, 0, padded_rows - rows))
    row_pos = positions.repeat_interleave(group, dim=1)
    row_pos = F.pad(row_pos, (0, padded_rows - rows), value=0)[:, None, :, None]    # [B, 1, R, 1]
    num_tiles = -(-num_keys // KEY_TILE)
    pad = num_tiles * KEY_TILE - num_keys
    k_all = F.pad(keys.float(), (0, 0, 0, 0, 0, pad)).permute(0, 2, 3, 1)            # [B, KVH, D, P]
    v_all = F.pad(values.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2)              # [B, KVH, P, D]
    shape = (batch, num_kv_heads, padded_rows, 1)
    m = torch.full(shape, float("-inf"), device=q.device)
    denom = torch.zeros(shape, device=q.device)
    acc = torch.zeros((batch, num_kv_heads, padded_rows, head_dim), device=q.device)
    key_pos = torch.arange(KEY_TILE, device=q.device)
    for t in range(num_tiles):
        lo = t * KEY_TILE
        scores = torch.matmul(qg, k_all[..., lo:lo + KEY_TILE])                        # [B, KVH, R, TILE]
        scores = scores.masked_fill_(lo + key_pos > row_pos, float("-inf"))            # causal; pads masked
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        p = torch.exp(scores - m_new)
        alpha = torch.exp(m - m_new)
        denom = denom * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v_all[:, :, lo:lo + KEY_TILE])
        m = m_new
    out = (acc / denom)[:, :, :rows].view(batch, num_kv_heads, n, group, head_dim)
    return out.permute(0, 2, 1, 3, 4).reshape(batch, n, num_heads, head_dim).to(q.dtype)
