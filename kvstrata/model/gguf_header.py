"""The header of a GGUF file, read with plain reads: its scalar metadata and its tensor table.

    "GGUF", version u32 (2 or 3), tensor count u64, metadata count u64
    metadata   key (string), value type u32, value; string = length u64 + UTF-8 bytes;
               array = item type u32, count u64, items
    tensors    name (string), dimension count u32, dimensions u64 each (fastest-varying first), type u32,
               offset u64 (from the start of the data)
    data       at the end of the tensor table rounded up to `general.alignment` (default 32)

Little-endian only. Arrays (a tokenizer's vocabulary and merges) are skipped, not decoded: gguf's GGUFReader
builds numpy views for every entry (SmolLM2's 49k-token header: ~10 s and ~150 MB of objects, part of which
stays resident), where a loader needs only the tensor table. No torch, no numpy: the HTTP process reads it too.
"""

from __future__ import annotations

import math
import os
import struct
from typing import BinaryIO, NamedTuple, Optional

from kvstrata.model.config import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                  # ggml's GGML_MAX_DIMS
_CHUNK = 1 << 20
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class TensorInfo(NamedTuple):
    """One tensor of the table: `shape` slowest-varying first (numpy's order: `[rows, K]`, `[E, rows, K]`),
    ggml type id, absolute byte offset in the file, and its size (None: a type the gguf package does not know)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    n_bytes: Optional[int]

    @property
    def type_name(self) -> str:
        """ggml's name of the tensor's type (its id when unknown)."""
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"type {self.type_id}"


class GGUFHeader(NamedTuple):
    """The scalar metadata values (arrays left out) and the tensor table of a GGUF file."""

    fields: dict[str, object]
    tensors: list[TensorInfo]


def read_header(path: str) -> GGUFHeader:
    """The header of GGUF file `path`. A malformed header, or a tensor whose bytes run past the end of the
    file, is a ModelLoadError naming the file (and the tensor)."""
    size = os.path.getsize(path)
    with open(path, "rb", buffering=0) as fh:
        cursor = _Cursor(fh, size)
        try:
            if cursor.take(4) != MAGIC:
                raise ValueError("not a GGUF file (no GGUF magic)")
            version = cursor.unpack("<I")
            if version not in VERSIONS:
                raise ValueError(f"GGUF version {version} is not read (versions {VERSIONS}; big-endian files neither)")
            tensor_count, field_count = cursor.unpack("<Q"), cursor.unpack("<Q")
            fields = {}
            for _ in range(cursor.bounded(field_count)):
                key, kind = cursor.string(), cursor.unpack("<I")
                value = cursor.value(kind)
                if value is not None:
                    fields[key] = value
            table = [_tensor_entry(cursor) for _ in range(cursor.bounded(tensor_count))]
            alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment!r} is not a power of two")
            data = -(-cursor.offset // alignment) * alignment
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: corrupt or truncated GGUF file: {e}") from None
    tensors = [TensorInfo(name, shape, kind, data + offset, _tensor_bytes(shape, kind))
               for name, shape, kind, offset in table]
    for t in tensors:
        if t.n_bytes is not None and t.offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: tensor {t.name!r} is truncated: its data ends at byte "
                                 f"{t.offset + t.n_bytes}, the file has {size}")
    return GGUFHeader(fields, tensors)


def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name, dims = cursor.string(), cursor.unpack("<I")
    if not 0 < dims <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {dims} dimensions")
    shape = tuple(reversed([cursor.unpack("<Q") for _ in range(dims)]))
    return name, shape, cursor.unpack("<I"), cursor.unpack("<Q")


def _tensor_bytes(shape: tuple[int, ...], type_id: int) -> Optional[int]:
    """Bytes of a tensor of `shape` in ggml type `type_id` (None: unknown to the gguf package)."""
    import gguf

    try:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return None
    return math.prod(shape) // block * type_size


class _Cursor:
    """Little-endian reads from the start of a file, through a buffer refilled with plain reads."""

    def __init__(self, fh: BinaryIO, size: int):
        self.fh, self.size = fh, size
        self.buf, self.pos, self.base = b"", 0, 0      # buf holds the file's bytes from offset `base`

    @property
    def offset(self) -> int:
        """The file offset of the next byte."""
        return self.base + self.pos

    def take(self, n: int) -> bytes:
        """The next `n` bytes."""
        if self.pos + n > len(self.buf):
            if self.offset + n > self.size:
                raise ValueError(f"the header runs past the end of the file (byte {self.offset + n})")
            self.base, self.buf = self.offset, self.buf[self.pos:] + self.fh.read(max(n, _CHUNK))
            self.pos = 0
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def skip(self, n: int) -> None:
        """Move past `n` bytes."""
        if self.pos + n <= len(self.buf):
            self.pos += n
            return
        if self.offset + n > self.size:
            raise ValueError(f"the header runs past the end of the file (byte {self.offset + n})")
        self.base, self.buf, self.pos = self.offset + n, b"", 0
        self.fh.seek(self.base)

    def unpack(self, fmt: str):
        """One value of struct format `fmt`."""
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def bounded(self, count: int) -> int:
        """`count`, refused when the file could not hold that many entries (a corrupt count)."""
        if count > self.size:
            raise ValueError(f"a count of {count} entries in a file of {self.size} bytes")
        return count

    def string(self) -> str:
        """A length-prefixed UTF-8 string."""
        return self.take(self.bounded(self.unpack("<Q"))).decode("utf-8")

    def value(self, kind: int) -> object:
        """A metadata value of type `kind`; arrays are skipped (None)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = self.unpack("<I"), self.bounded(self.unpack("<Q"))
        if item in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[item]))
        else:
            for _ in range(count):
                if item == _STRING:
                    self.skip(self.bounded(self.unpack("<Q")))
                else:
                    self.value(item)
        return None
