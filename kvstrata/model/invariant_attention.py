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
QUERY_BLOCK = 128


def attend_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int,
                    scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new queries `q` `[n, H, D]` at positions first_pos.. over
    `keys`/`values` `[L, KVH, D]` (positions 0..L-1, L = first_pos + n). Returns `[n, H, D]` in q's dtype."""
    n = q.shape[0]
    k_tiles, v_tiles = _key_layout(keys[None], values[None])
    out = torch.empty_like(q)
    for start in range(0, n, QUERY_BLOCK):
        end = min(n, start + QUERY_BLOCK)
        positions = torch.arange(first_pos + start, first_pos + end, device=q.device)[None, :]
        num_tiles = -(-(first_pos + end) // KEY_TILE)
        out[start:end] = _attend(q[None, start:end], k_tiles, v_tiles, num_tiles, positions, scale)[0]
    return out


def attend_decodes(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens: list[int],
                   scale: float) -> torch.Tensor:
    """Single-token queries `q` `[B, H, D]`; sequence b attends `keys[b, :lens[b]]` of `keys`/`values`
    `[B, max_len, KVH, D]` (the rest is padding). Returns `[B, H, D]`."""
    positions = torch.tensor(lens, device=q.device)[:, None] - 1
    k_tiles, v_tiles = _key_layout(keys, values)
    return _attend(q[:, None], k_tiles, v_tiles, -(-max(lens) // KEY_TILE), positions, scale)[:, 0]


def _key_layout(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 keys and values `[B, KVH, P, D]`, zero-padded to whole tiles (P); one copy each."""
    batch, num_keys, num_kv_heads, head_dim = keys.shape
    padded = -(-num_keys // KEY_TILE) * KEY_TILE
    out = []
    for src in (keys, values):
        dst = torch.empty(batch, num_kv_heads, padded, head_dim, device=src.device)
        dst[:, :, :num_keys].copy_(src.transpose(1, 2))
        dst[:, :, num_keys:].zero_()
        out.append(dst)
    return out[0], out[1]


def _attend(q: torch.Tensor, k_tiles: torch.Tensor, v_tiles: torch.Tensor, num_tiles: int,
            positions: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[B, n, H, D]` at `positions` `[B, n]` over the first `num_tiles` key tiles -> `[B, n, H, D]`.

    Query row (b, i) sees keys 0..positions[b, i] of sequence b.
    """
    batch, n, num_heads, head_dim = q.shape
    num_kv_heads = k_tiles.shape[1]
    group = num_heads // num_kv_heads
    rows = n * group
    padded_rows = -(-rows // ROW_BLOCK) * ROW_BLOCK
    # [B, n, H, D] -> [B, KVH, n * group, D]: the query heads sharing a KV head become that head's rows.
    qg = (q.float() * scale).view(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    qg = F.pad(qg.reshape(batch, num_kv_heads, rows, head_dim), (0, 0, 0, padded_rows - rows))
    row_pos = positions.repeat_interleave(group, dim=1)
    row_pos = F.pad(row_pos, (0, padded_rows - rows), value=0)[:, None, :, None]    # [B, 1, R, 1]
    shape = (batch, num_kv_heads, padded_rows, 1)
    m = torch.full(shape, float("-inf"), device=q.device)
    denom = torch.zeros(shape, device=q.device)
    acc = torch.zeros((batch * num_kv_heads, padded_rows, head_dim), device=q.device)
    key_pos = torch.arange(KEY_TILE, device=q.device)
    lowest_row_pos = int(positions.min())
    for t in range(num_tiles):
        lo = t * KEY_TILE
        scores = torch.matmul(qg, k_tiles[:, :, lo:lo + KEY_TILE].transpose(-1, -2))   # [B, KVH, R, TILE]
        if lo + KEY_TILE - 1 > lowest_row_pos:   # some key is after some row (or padding): mask it
            scores.masked_fill_(lo + key_pos > row_pos, float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        p = scores.sub_(m_new).exp_()
        alpha = m.sub_(m_new).exp_()
        denom = denom.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        acc = torch.baddbmm(acc.mul_(alpha.flatten(0, 1)), p.flatten(0, 1),
                            v_tiles[:, :, lo:lo + KEY_TILE].flatten(0, 1))
        m = m_new
    out = (acc.view(batch, num_kv_heads, padded_rows, head_dim) / denom)[:, :, :rows]
    out = out.view(batch, num_kv_heads, n, group, head_dim)
    return out.permute(0, 2, 1, 3, 4).reshape(batch, n, num_heads, head_dim).to(q.dtype)
