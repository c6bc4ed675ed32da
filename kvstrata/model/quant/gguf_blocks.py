"""GGUF's block formats (ggml's block_q8_0 ... block_q6_K) and their plain-torch de-quantizers: the reference
that the compiled kernels (csrc/quant_gguf.cpp) are tested against, and the path without them.

A quantized row of `K` values is `K / block_size` blocks of `type_size` bytes each, stored back to back; a
`[rows, K]` weight is a `[rows, K / block_size * type_size]` uint8 tensor. Each de-quantizer takes `[n,
type_size]` blocks and returns `[n, block_size]` float32, with the arithmetic of ggml's reference (and of
the `gguf` package's numpy de-quantizer, which the tests compare with bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256   # values per K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF tensor type: ggml's type id, its name, values and bytes per block, the torch de-quantizer."""

    type_id: int
    name: str
    block_size: int
    type_size: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]

    def row_bytes(self, values: int) -> int:
        """Bytes of a row of `values` values (a multiple of block_size)."""
        return values // self.block_size * self.type_size


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 `[n, 1]`."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes `[n, g * group]` -> 4-bit values `[n, g * 2 * group]`: per group of `group` bytes, the low nibbles
    then the high nibbles (ggml's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(n, -1)


def _high_bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Little-endian bit i of the bytes `qh` `[n, count / 8]` for i < count -> `[n, count]` uint8 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], count)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:], 16).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:], 16).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:], 16) | (_high_bits(b[:, 2:6], 32) << 4)
    return _f16(b, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:], 16) | (_high_bits(b[:, 4:8], 32) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs packed in 12 bytes (ggml's get_scale_min_k4) -> two `[n, 8]` float32."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).unsqueeze(-1)
    dm = (_f16(b, 2) * mn).unsqueeze(-1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc).unsqueeze(-1)
    dm = (_f16(b, 2) * mn).unsqueeze(-1)
    low = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    # qh[l] bit j is the high bit of value l of sub-block j
    high = ((b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1)
    q = (low | (high << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = (_f16(b, 208) * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    high = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = ((low | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


def _float_type(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda b: b.contiguous().view(dtype).float()


# ggml's float type ids -> their torch dtype
_FLOAT_DTYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


# ggml's type ids (gguf.GGMLQuantizationType) -> format
FORMATS: dict[int, BlockFormat] = {f.type_id: f for f in (
    BlockFormat(0, "F32", 1, 4, _float_type(_FLOAT_DTYPES[0])),
    BlockFormat(1, "F16", 1, 2, _float_type(_FLOAT_DTYPES[1])),
    BlockFormat(2, "Q4_0", 32, 18, _q4_0),
    BlockFormat(3, "Q4_1", 32, 20, _q4_1),
    BlockFormat(6, "Q5_0", 32, 22, _q5_0),
    BlockFormat(7, "Q5_1", 32, 24, _q5_1),
    BlockFormat(8, "Q8_0", 32, 34, _q8_0),
    BlockFormat(12, "Q4_K", QK_K, 144, _q4_k),
    BlockFormat(13, "Q5_K", QK_K, 176, _q5_k),
    BlockFormat(14, "Q6_K", QK_K, 210, _q6_k),
    BlockFormat(30, "BF16", 1, 2, _float_type(_FLOAT_DTYPES[30])),
)}
FLOAT_TYPES = frozenset(_FLOAT_DTYPES)


def float_values(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The bytes `[..., row_bytes]` (uint8, contiguous) of a float-typed tensor viewed as its dtype
    `[..., values]`: no copy, unlike `fmt.dequantize`, which widens to float32."""
    return raw.view(_FLOAT_DTYPES[fmt.type_id])


def block_format(type_id: int) -> BlockFormat | None:
    """The format of ggml type `type_id`, or None for a type kvstrata does not serve."""
    return FORMATS.get(type_id)


def dequantize_rows(rows: torch.Tensor, fmt: BlockFormat, values: int) -> torch.Tensor:
    """Quantized rows `[R, row_bytes]` (uint8) -> `[R, values]` float32, in plain torch."""
    blocks = rows.reshape(-1, fmt.type_size)
    return fmt.dequantize(blocks).reshape(rows.shape[0], values)


Q8_BLOCK = 32   # values per scale of an activation quantized to 8 bits, for Q8_0 / Q4_0 / Q4_1 weights


def q8_block(fmt: BlockFormat) -> int:
    """Values per activation scale in the 8-bit GEMV with a weight of this format: a K-quant super-block (QK_K,
    llama.cpp's Q8_K, so its sub-blocks sum in integers), else Q8_BLOCK (the compiled kernels' q8_block)."""
    return QK_K if fmt.block_size == QK_K else Q8_BLOCK


def quantize_activation_q8(x: torch.Tensor, block: int = Q8_BLOCK) -> torch.Tensor:
    """The 8-bit GEMV's view of x `[T, K]` float32 (the compiled kernels' QuantizedRows, in plain torch): per
    `block` values, scale d = max|x| / 127 and q = round(x / d) to nearest even, as int8; returns q * d float32."""
    rows = x.shape[0]
    blocks = x.float().reshape(rows, -1, block)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse).to(torch.int8)
    return (q.float() * d).reshape(rows, -1)
