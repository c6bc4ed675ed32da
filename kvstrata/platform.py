"""What this machine offers: the CPU's feature probes (read once from /proc/cpuinfo), the environment
variables kvstrata reads (`env`: the one place they are read), its cache directory, the C allocator's
controls (glibc: large buffers mapped on their own, freed heap memory returned), and anonymous memory (zero
until written; for weights, advised for huge pages).

The CPU probes are the probes the runtime chooses its paths with (the dtype, the compiled kernels' variants, oneDNN's
prepacked weights), and the ones the test suite's capability markers read (tests/capabilities.py), so a test
is skipped exactly where the server would not take the path it checks. No torch here: the HTTP process
imports this module through `args`.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import platform
from collections.abc import Iterator
from pathlib import Path

# oneDNN reorders a bf16 weight into its blocked layout only where it has bf16 conversions: AVX-512 BW/VL/DQ
# or AVX-NE-CONVERT (its error otherwise: "bf16 path needs the cpu support avx_ne_convert or avx512bw, ...").
_ONEDNN_BF16_REORDER_ISAS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})


def env(name: str, default: str = "") -> str:
    """An environment variable's value (`default` when unset): the one place kvstrata reads its settings
    from the environment (KVSTRATA_*, CXX, XDG_CACHE_HOME, ...)."""
    return os.environ.get(name, default)


def cache_dir() -> Path:
    """kvstrata's cache directory: $KVSTRATA_CACHE_DIR, else ~/.cache/kvstrata (built-in models, kernels,
    role-group state)."""
    return Path(env("KVSTRATA_CACHE_DIR") or Path.home() / ".cache" / "kvstrata")


@functools.lru_cache(maxsize=1)
def cpu_flags_line() -> str:
    """The `flags` line of /proc/cpuinfo (the processor name where there is none): part of the kernel cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, as Linux names them (`avx2`, `avx512_bf16`, `amx_tile`, ...)."""
    return frozenset(cpu_flags_line().split(":", 1)[-1].split())


def is_x86_64() -> bool:
    """True on x86-64, the only target of the compiled kernels' ISA variants."""
    return platform.machine() in ("x86_64", "AMD64")


def cpu_has_avx2() -> bool:
    """AVX2 + FMA: the compiled kernels' AVX2 variants (Zen 3 and newer, Haswell and newer)."""
    return {"avx2", "fma"} <= cpu_flags()


def cpu_has_avx512f() -> bool:
    """AVX-512 Foundation: the float32 paged kernel's and the norms' AVX-512 variants."""
    return "avx512f" in cpu_flags()


def cpu_has_avx512_bf16() -> bool:
    """AVX-512 BF16 dot products: the bf16 decode/extend attention, the bf16 GEMV (Zen 4, Xeon)."""
    return "avx512_bf16" in cpu_flags()


def cpu_has_avx512_vnni() -> bool:
    """AVX-512 VNNI int8 dot products: the GGUF GEMV's 8-bit-activation variant (Ice Lake / Zen 4 on)."""
    return {"avx512_vnni", "avx512bw"} <= cpu_flags()


def cpu_has_amx() -> bool:
    """AMX tiles with bf16 (Intel Xeon, Sapphire Rapids on)."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


def cpu_has_fast_bf16() -> bool:
    """Native bf16 products (AVX-512 BF16 or AMX): where `--dtype auto` picks bfloat16 on a CPU."""
    return cpu_has_avx512_bf16() or cpu_has_amx()


def cpu_has_onednn_bf16_reorder() -> bool:
    """The ISA oneDNN needs to prepack a bf16 weight (torch.ops.mkldnn._reorder_linear_weight)."""
    flags = cpu_flags()
    return any(isas <= flags for isas in _ONEDNN_BF16_REORDER_ISAS)


LOAD_MMAP_THRESHOLD_BYTES = 1 << 20
# What glibc's own dynamic threshold reaches once a process has freed a buffer of 32 MiB (its cap on 64-bit),
# with the trim threshold it sets beside it: serving's activations and de-quantized tiles then reuse heap pages.
SERVE_MMAP_THRESHOLD_BYTES = 32 << 20
SERVE_TRIM_THRESHOLD_BYTES = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_load_depth = 0     # open large_buffers_unmapped scopes (one thread loads at a time)


@contextlib.contextmanager
def large_buffers_unmapped() -> Iterator[None]:
    """While a model loads, have glibc map every allocation of 1 MiB or more on its own, so a buffer freed after
    a tensor is read or quantized goes back to the system at once.

    By default glibc raises its threshold to the largest buffer freed so far and serves later ones from the
    heap, whose freed memory stays resident: a load's transients then add to its peak RSS (measured: int8 at
    load kept ~1x its float tensors' size resident). Scoped to the load, because the same 1 MiB threshold while
    serving maps (and page-faults) every large activation afresh: a 1B Q4_K_M model's cold 2048-token prefill
    took 7.4 s with it and 4.1 s without. Afterwards the thresholds are those glibc's dynamic rule settles
    at. Nested scopes (the model runner's whole load around a loader's) end with the outermost.
    Linux/glibc only; elsewhere nothing changes.
    """
    global _load_depth
    if _load_depth == 0:
        _glibc("mallopt", _M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD_BYTES)
    _load_depth += 1
    try:
        yield
    finally:
        _load_depth -= 1
        if _load_depth == 0:
            _glibc("mallopt", _M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD_BYTES)
            _glibc("mallopt", _M_TRIM_THRESHOLD, SERVE_TRIM_THRESHOLD_BYTES)


# Transparent huge pages are 2 MiB on x86-64 and most arm64 kernels.
HUGE_PAGE_BYTES = 2 << 20


def anonymous_buffer(nbytes: int) -> mmap.mmap:
    """`nbytes` of private anonymous memory: page-aligned, and zero pages that cost no resident memory until
    written (private: a shared anonymous mapping is shmem, which gets no huge pages here)."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def huge_page_buffer(nbytes: int) -> mmap.mmap | None:
    """An anonymous_buffer of `nbytes` whose whole 2 MiB pages the kernel may back with transparent huge pages,
    or None where it cannot (not Linux, or under two huge pages: then any buffer will do).

    For quantized weights, which a decode step streams through once from memory: with 4 KiB pages every 4 KiB
    of weight costs a TLB miss. Measured on the 1B-class GGUF models (docs/benchmarks.md, issue 47): all of a
    decode step's products 71 -> 52-56 ms (Q8_0) and 49-54 -> 42-44 ms (Q4_K_M). Only the 2 MiB-aligned pages
    inside the buffer are advised, so the buffer costs no more resident memory than its bytes. Works where
    /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`; elsewhere the advice is ignored.
    """
    if nbytes < 2 * HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = anonymous_buffer(nbytes)
    first = (-_address_of(region)) % HUGE_PAGE_BYTES      # the offset of the first 2 MiB-aligned address
    whole = (nbytes - first) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    try:
        region.madvise(mmap.MADV_HUGEPAGE, first, whole)
    except OSError:     # a kernel without transparent huge pages
        pass
    return region


def _address_of(region: mmap.mmap) -> int:
    """The address of the mapping's first byte."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def return_free_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim): what start-up freed (imports'
    temporaries, the load's small buffers) otherwise stays in the RSS, since glibc returns only the heap's top.
    Both server processes call it once started. Measured on the SmolLM2 GGUF server: scheduler 15-35 MB, HTTP
    process 92 -> 76 MB (the tokenizer's JSON parse). Linux/glibc only; elsewhere nothing happens."""
    _glibc("malloc_trim", 0)


def _glibc(function: str, *args: int) -> None:
    try:
        import ctypes

        getattr(ctypes.CDLL("libc.so.6"), function)(*args)
    except (OSError, AttributeError):
        pass
