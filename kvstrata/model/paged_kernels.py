"""The compiled CPU kernels (every csrc/*.cpp, one library): built once per machine, or absent.

`paged_attention_op()` / `extend_attention_op()` return an op, or None when the library cannot be built
(no C++ compiler, a failed build) or the CPU lacks what the op needs; callers (and `--disable-cpu-kernels`)
then take the plain-torch path, which computes the same attention. The build (~20-60 s) runs on first use and is cached under the kvstrata cache directory,
keyed by the source, the torch version and the CPU's instruction-set flags (the kernel is compiled with
-march=native).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from kvstrata.platform import cache_dir, cpu_flags_line, cpu_has_amx, cpu_has_avx2, cpu_has_avx512_bf16, env

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.cpp"))
HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))   # part of the cache key, not compiled alone
NAME = "kvstrata_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]   # OpenMP: at::parallel_for's threads (torch's own runtime)
_lock = threading.Lock()
_state: dict[str, object] = {}


def _build_dir() -> Path:
    parts = [*(src.read_bytes() for src in SOURCES + HEADERS), torch.__version__.encode(), cpu_flags_line().encode(),
             " ".join(CFLAGS).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()
    return cache_dir() / "kernels" / key[:16]


def _load() -> bool:
    if shutil.which(env("CXX", "c++")) is None:
        logger.warning("no C++ compiler: CPU attention uses the plain-torch path (K/V gather)")
        return False
    final = _build_dir()
    library = final / f"{NAME}.so"
    started = time.perf_counter()
    try:
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            _build(final)
    except Exception as e:  # a broken toolchain must not stop the server: the torch path is complete
        logger.warning("building the CPU kernels failed (%s): using the plain-torch path", e)
        return False
    logger.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - started, final)
    return True


def _build(final: Path) -> None:
    """Compile into a folder of this process's own and load it, then move it into place. Processes that
    start together each build (no lock that a killed build could leave behind); the first rename wins."""
    from torch.utils import cpp_extension

    staging = final.with_name(f"{final.name}-building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cpp_extension.load(name=NAME, sources=[str(src) for src in SOURCES], build_directory=str(staging),
                       extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    try:
        staging.rename(final)
    except OSError:   # another process got there first: its copy is the same build
        shutil.rmtree(staging, ignore_errors=True)


def _loaded() -> bool:
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
        return bool(_state["loaded"])


def paged_attention_op() -> Optional[Callable]:
    """`op(q, k_buf, v_buf, slots, row_seq, lens, scale) -> out`, or None where it is not available."""
    return torch.ops.kvstrata.paged_attention if _loaded() else None


# Head dims the bf16 decode kernel and the extend kernels are instantiated for: with_head_dim in csrc/vec_math.h.
BF16_HEAD_DIMS = (16, 32, 64, 128, 256)


def _bf16_op(name: str) -> Optional[Callable]:
    """An op that only some CPUs' builds register (bf16 kernels), or None (not built, or not registered here)."""
    if not _loaded():
        return None
    try:
        return getattr(torch.ops.kvstrata, name)
    except (AttributeError, RuntimeError):
        return None


def decode_attention_op() -> Optional[Callable]:
    """`paged_attention_op()`'s contract with bf16 dot products (bf16 tensors, AVX-512 BF16 CPUs), or None."""
    return _bf16_op("decode_attention")


def extend_attention_op(dtype: torch.dtype = torch.bfloat16) -> Optional[Callable]:
    """`op(q, k_buf, v_buf, slots, q_start, prefix, extend, scale) -> out` for `dtype` tensors, or None. AVX-512
    BF16 builds serve bf16 (bf16 dot products); AVX2 + FMA builds serve bf16 and float32 (float32 arithmetic)."""
    op = _bf16_op("extend_attention")
    if op is None or dtype == torch.bfloat16:
        return op
    # The AVX-512 BF16 build is the one that registers decode_attention; its extend tile is bf16 only.
    return op if dtype == torch.float32 and decode_attention_op() is None else None


def extend_amx(enable: bool) -> bool:
    """Whether bf16 extends run on the AMX tile from now on (`enable`, where this CPU's build has the tile and
    Linux grants the tile state); off, the AVX-512 BF16 dot-product tile computes the same attention."""
    op = _bf16_op("extend_amx")
    return bool(op(enable)) if op is not None else False


def silu_and_mul_op() -> Optional[Callable]:
    """`op(gate_up [T, 2I]) -> silu(gate) * up [T, I]` (bf16; torch's bits: AVX-512 BF16 builds without AMX
    compute silu, others look up torch's own silu of every bf16 value), or None."""
    return _bf16_op("silu_and_mul")


# Products of up to this many rows go through the AVX-512 BF16 decode GEMV (decode_ops.cpp): on the bench
# model's shapes it beats oneDNN's bf16 GEMM 2.1-2.2x at 16 rows and 1.2-1.3x at 64, and is about even at 96
# (Zen 4, docs/benchmarks.md). Larger products (prefill) stay with oneDNN there. CPUs with AMX run every
# product through oneDNN on prepacked weights instead (layers.use_onednn_weights), except in batch-invariant mode.
DECODE_LINEAR_MAX_ROWS = 64


class DecodeLinear(NamedTuple):
    """The compiled bf16 GEMV/GEMM: `pack(w [N, K])` once per weight, then `run(x [M, K], packed, bias | None, N)`
    -> `x @ w.T + bias` (bf16), for products of at most `max_rows` rows (None: any). AVX-512 BF16 builds read
    the row-major weight as it is (`pack` returns it) and serve decode-sized products; AVX2 builds read a copy
    in 16-row blocks (decode_linear_avx2.cpp) and serve every product, each row summed in one order whatever
    the batch (so batch-invariant mode can use it)."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int], torch.Tensor]
    max_rows: Optional[int]


def _row_major(weight: torch.Tensor) -> torch.Tensor:
    return weight


def decode_linear_variant(every_row: bool = False) -> Optional[str]:
    """Which bf16 GEMV this CPU's build has, read from the platform probes (the library is built with
    -march=native, so its variants follow the CPU's flags): "amx" (AMX tiles, asked for with `every_row`: every
    row count, on a packed copy of the weight), "row_major" (AVX-512 BF16: reads the weight as it is; decode
    rows, or every row count with `every_row`), "packed" (AVX2 + FMA: every row count, on a packed copy), or
    None. layers.use_decode_linear keeps one copy of each weight whichever it is."""
    if every_row and cpu_has_amx():
        return "amx"
    if cpu_has_avx512_bf16():
        return "row_major"
    return "packed" if cpu_has_avx2() else None


def decode_linear_op(every_row: bool = False) -> Optional[DecodeLinear]:
    """The bf16 GEMV of this CPU's build (decode_linear_variant: AVX-512 BF16: decode rows, or every product
    with `every_row`, as batch-invariant mode needs, on AMX tiles where the CPU has them (linear_amx.cpp);
    AVX2: every product), or None."""
    variant = decode_linear_variant(every_row)
    amx = amx_linear_op() if variant == "amx" else None
    if amx is not None:
        return amx
    row_major = _bf16_op("decode_linear")
    if row_major is not None:
        return DecodeLinear(_row_major, lambda x, weight, bias, n: row_major(x, weight, bias),
                            None if every_row else DECODE_LINEAR_MAX_ROWS)
    pack, packed = _bf16_op("decode_linear_pack"), _bf16_op("decode_linear_packed")
    return DecodeLinear(pack, packed, None) if pack is not None and packed is not None else None


def amx_linear_op() -> Optional[DecodeLinear]:
    """The AMX-tile bf16 linear (linear_amx.cpp) as a DecodeLinear serving every row count, row-invariant, on a
    packed copy of the weight; None where the CPU, its build or Linux's tile permission lacks it."""
    amx_ready = _bf16_op("amx_ready")
    if amx_ready is None or not amx_ready():
        return None
    return DecodeLinear(torch.ops.kvstrata.amx_linear_pack, torch.ops.kvstrata.amx_linear, None)


def moe_combine_op() -> Optional[Callable]:
    """`op(rows [N, H], slots [T, k] int64, weights [T, k] float32) -> [T, H]`: each token's k expert rows
    weighted and summed in rank order (moe.py's torch path, the same bits), bf16 / float32; or None."""
    return torch.ops.kvstrata.moe_combine if _loaded() else None


def argmax_op() -> Optional[Callable]:
    """`op(x [R, C] float32 / bf16, contiguous) -> torch.argmax(x, dim=-1)` (vectorized), or None."""
    return torch.ops.kvstrata.row_argmax if _loaded() else None


class ShmOps(NamedTuple):
    """The shared-memory collectives' compiled round (csrc/shm_collectives.cpp)."""

    publish_wait: Callable   # (piece, sems, line, slots, slot_bytes, rank, size, spin_s, publish) -> first missing peer or -1
    sum_slots_: Callable     # (out, slots, slot_bytes, size): the slots' rank-order sum into out


def shm_ops() -> Optional[ShmOps]:
    """The shared-memory collectives' poll and sum, or None where the library is not built."""
    if not _loaded():
        return None
    return ShmOps(torch.ops.kvstrata.shm_publish_wait, torch.ops.kvstrata.shm_sum_slots_)


def rope_op() -> Optional[Callable]:
    """`op(x [T, H, D], cos, signed_sin [T, 1, D]) -> rope.apply_rotary(x, ...)` in one pass, or None."""
    return torch.ops.kvstrata.rope_rotate if _loaded() else None


def norm_ops():
    """The compiled one-pass RMSNorm and residual-add + RMSNorm (bf16 / float32) as a layers.NormOps, or None."""
    from kvstrata.model.layers import NormOps

    if not _loaded():
        return None
    return NormOps(torch.ops.kvstrata.rms_norm, torch.ops.kvstrata.add_rms_norm)


def gguf_ops():
    """The GGUF block kernels (quant_gguf.cpp) as a quant.gguf_weight.GGUFKernels, or None (torch path)."""
    from kvstrata.model.quant.gguf_weight import GGUFKernels

    if not _loaded():
        return None
    return GGUFKernels(torch.ops.kvstrata.gguf_gemv, torch.ops.kvstrata.gguf_dequantize, gguf_best_variant)


# The GGUF GEMV's variants (quant_gguf.cpp): blocks de-quantized in registers, or activations quantized to 8
# bits for integer dot products; 0 asks for the faster of the two on this build, per type.
GGUF_VARIANT_NAMES = {1: "portable", 2: "avx2", 3: "avx512", 4: "q8-portable", 5: "q8-avx2", 6: "q8-avx512-vnni"}
GGUF_Q8_VARIANTS = frozenset({4, 5, 6})


def gguf_variants(type_id: Optional[int] = None) -> list[int]:
    """The variants of the GGUF GEMV in this build (GGUF_VARIANT_NAMES), those serving ggml type `type_id` if
    given, or []."""
    if not _loaded():
        return []
    ops = torch.ops.kvstrata
    return list(ops.gguf_variants() if type_id is None else ops.gguf_type_variants(type_id))


def gguf_best_variant(type_id: int, in_features: int, int8_activations: bool = True) -> int:
    """The fastest variant for ggml type `type_id` and `in_features` values per row (what variant 0 runs), or
    without `int8_activations` the fastest that multiplies the float activation as given (0 where unbuilt)."""
    return int(torch.ops.kvstrata.gguf_best_variant(type_id, in_features, int8_activations)) if _loaded() else 0


if __name__ == "__main__":   # `python -m kvstrata.model.paged_kernels`: build (or find) the kernel now
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("CPU kernels:", "ready" if _loaded() else "unavailable (torch path)")
