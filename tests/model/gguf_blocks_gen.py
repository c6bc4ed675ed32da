"""Random valid GGUF blocks, packed from the formats' definitions (ggml's block_q8_0 ... block_q6_K layouts):
every quantized value, scale and min drawn at random within its bit width, then packed as ggml packs them."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(rng: np.random.Generator, n: int, scale: float = 0.02) -> np.ndarray:
    """`n` finite float16 scales as bytes `[n, 2]`."""
    return (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)


def _nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (low | (high << 4)).astype(np.uint8)


def _q4(rng, n, with_min):
    q = rng.integers(0, 16, (n, 32), dtype=np.uint8)
    fields = [_f16(rng, n)] + ([_f16(rng, n)] if with_min else [])
    return np.concatenate(fields + [_nibbles(q[:, :16], q[:, 16:])], axis=1)


def _q5(rng, n, with_min):
    q = rng.integers(0, 32, (n, 32), dtype=np.uint8)
    qh = np.packbits(q >> 4, axis=1, bitorder="little")           # bit j: fifth bit of value j
    fields = [_f16(rng, n)] + ([_f16(rng, n)] if with_min else [])
    return np.concatenate(fields + [qh, _nibbles(q[:, :16] & 15, q[:, 16:] & 15)], axis=1)


def _q8_0(rng, n):
    return np.concatenate([_f16(rng, n), rng.integers(-128, 128, (n, 32), dtype=np.int8).view(np.uint8)], axis=1)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> ggml's 12 packed bytes (the inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _qk(rng, n, five_bits):
    q = rng.integers(0, 32 if five_bits else 16, (n, 8, 32), dtype=np.uint8)   # [block, sub-block, value]
    sc = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    mn = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    low = q & 15
    qs = np.concatenate([_nibbles(low[:, 2 * c], low[:, 2 * c + 1]) for c in range(4)], axis=1)
    fields = [_f16(rng, n, 0.001), _f16(rng, n, 0.001), _k_scales(sc, mn)]
    if five_bits:
        qh = np.zeros((n, 32), dtype=np.uint8)
        for s in range(8):
            qh |= ((q[:, s] >> 4) & 1) << s
        fields.append(qh)
    return np.concatenate(fields + [qs], axis=1)


def _q6_k(rng, n):
    q = rng.integers(0, 64, (n, 2, 128), dtype=np.uint8)       # [block, half, value]
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for r in range(128):
        ql[:, :, r % 64] |= (q[:, :, r] & 15) << (4 * (r // 64))
        qh[:, :, r % 32] |= (q[:, :, r] >> 4) << (2 * (r // 32))
    scales = rng.integers(-128, 128, (n, 16), dtype=np.int8).view(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales, _f16(rng, n, 0.001)], axis=1)


GENERATORS = {
    "Q4_0": lambda rng, n: _q4(rng, n, False), "Q4_1": lambda rng, n: _q4(rng, n, True),
    "Q5_0": lambda rng, n: _q5(rng, n, False), "Q5_1": lambda rng, n: _q5(rng, n, True),
    "Q8_0": _q8_0, "Q4_K": lambda rng, n: _qk(rng, n, False), "Q5_K": lambda rng, n: _qk(rng, n, True),
    "Q6_K": _q6_k,
}


def random_rows(name: str, rows: int, values: int, seed: int = 0) -> np.ndarray:
    """`[rows, row_bytes]` uint8: `rows` quantized rows of `values` values in format `name`."""
    block = QK_K if name.endswith("_K") else 32
    rng = np.random.default_rng(seed)
    blocks = GENERATORS[name](rng, rows * values // block)
    return np.ascontiguousarray(blocks.reshape(rows, -1))
