"""HostKVPool: the L2 KV cache, pages in host DRAM with the same per-token shape and dtype as the device pool.

One tensor holds every page, in one of two layouts (P = page_size, H = kv heads, D = head dim, L = layers):

    layer_first  [2 (k/v), L, num_pages*P, H, D]    a layer's pages are contiguous (like the device pool)
    page_first   [num_pages, L, 2 (k/v), P, H, D]   a page's bytes, all layers, K and V, are contiguous
                                                    (what the storage tier wants: one page = one byte range)

An FP8 device pool (--kv-cache-dtype) is mirrored byte for byte: the host buffer holds its bytes as uint8
(torch has no CPU index_copy_ for float8), so a page takes half a bf16 page's bytes, and L3 objects and
checksums are made of those bytes.

Copies are page-granular and vectorized: per layer, one gather (`index_select`) and one scatter
(`index_copy_`) over all the pages of a call, never a Python loop over pages. Page 0 is reserved, as in
the device pool. The pool holds memory and copies; which pages are free is its allocator's business, and
who may read a page when is the cache controller's (a page is read only after its copy is acknowledged).
"""

from __future__ import annotations

import logging
import weakref

import psutil
import torch

from kvstrata.memory.allocator import PageAllocator
from kvstrata.memory.device_pool import DeviceKVPool

logger = logging.getLogger(__name__)

LAYOUTS = ("layer_first", "page_first")
GB = 1e9
# Memory left to the OS and the rest of the process after the host pool is allocated.
HEADROOM_FRACTION = 0.10
HEADROOM_MAX_BYTES = 10 * 2**30


class HostMemoryError(MemoryError):
    """The host has not got the memory the host pool asks for (raised before allocating anything)."""


class HostKVPool:
    """K/V pages in host memory (pinned when CUDA is present), mirroring one DeviceKVPool's page shape."""

    def __init__(self, device_pool: DeviceKVPool, num_pages: int, layout: str = "layer_first",
                 pin_memory: bool | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown host pool layout {layout!r}; expected one of {LAYOUTS}")
        if num_pages < 2:
            raise ValueError(f"host pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.device_pool = device_pool
        self.num_pages = num_pages
        self.layout = layout
        self.page_size = device_pool.page_size
        self.num_layers = device_pool.num_layers
        self.num_kv_heads = device_pool.num_kv_heads
        self.head_dim = device_pool.head_dim
        self.dtype = device_pool.dtype
        # What the copies move: the pool's dtype, or its bytes for FP8 (one byte an element either way).
        self._copy_dtype = torch.uint8 if device_pool.kv_format.quantized else self.dtype
        self.page_bytes = self.page_bytes_for(device_pool)
        self.size_bytes = num_pages * self.page_bytes
        check_host_memory(self.size_bytes, what=f"host KV pool ({num_pages} pages x {self.page_bytes} bytes)")

        self._cuda = device_pool.device.type == "cuda"
        self.pinned = self._cuda if pin_memory is None else pin_memory
        L, P, H, D = self.num_layers, self.page_size, self.num_kv_heads, self.head_dim
        shape = (2, L, num_pages * P, H, D) if layout == "layer_first" else (num_pages, L, 2, P, H, D)
        self.buffer = torch.empty(shape, dtype=self._copy_dtype)
        if self.pinned:
            self.pinned = _pin_in_place(self.buffer)
            if self.pinned:
                # Unregister before the buffer's memory can go back to the OS allocator.
                weakref.finalize(self, _unpin, self.buffer.data_ptr())
        self.allocator = PageAllocator(num_pages, self.page_size, reserved_pages=1)

        # Per layer, a view of the host buffer with a page dimension (`_page_dim`) and a k/v dimension
        # (`_kv_dim`): layer_first [2, num_pages, P, H, D]; page_first [num_pages, 2, P, H, D].
        if layout == "layer_first":
            pages = self.buffer.view(2, L, num_pages, P, H, D)
            self._host_layers = [pages[:, layer] for layer in range(L)]
            self._page_dim, self._kv_dim = 1, 0
        else:
            self._host_layers = [self.buffer[:, layer] for layer in range(L)]
            self._page_dim, self._kv_dim = 0, 1
        # The device pool's per-layer slot buffers seen as pages: [device_pages, P, H, D].
        self._device_k = [k.view(self._copy_dtype).view(-1, P, H, D) for k in device_pool.k_buffer]
        self._device_v = [v.view(self._copy_dtype).view(-1, P, H, D) for v in device_pool.v_buffer]

    # ----- sizing -----

    @staticmethod
    def page_bytes_for(device_pool: DeviceKVPool) -> int:
        """Bytes of one page (all layers, K and V) for a device pool's shape."""
        return device_pool.bytes_per_token * device_pool.page_size

    @staticmethod
    def size_pages(device_pool: DeviceKVPool, hicache_ratio: float, hicache_size_gb: int) -> int:
        """Host pages for `--hicache-size` (GB, wins when > 0) or `--hicache-ratio` (x device pages)."""
        page_bytes = HostKVPool.page_bytes_for(device_pool)
        if hicache_size_gb and hicache_size_gb > 0:
            num_pages = int(hicache_size_gb * GB // page_bytes)
            source = f"--hicache-size {hicache_size_gb} GB"
        else:
            if hicache_ratio <= 0:
                raise ValueError(f"--hicache-ratio must be > 0, got {hicache_ratio}")
            num_pages = int(device_pool.num_pages * hicache_ratio)
            source = f"--hicache-ratio {hicache_ratio}"
        if num_pages <= device_pool.num_pages:
            raise ValueError(
                f"{source} gives a host pool of {num_pages} pages ({num_pages * page_bytes / GB:.3f} GB), "
                f"not larger than the device pool's {device_pool.num_pages} pages "
                f"({device_pool.num_pages * page_bytes / GB:.3f} GB); raise --hicache-ratio or --hicache-size")
        return num_pages

    # ----- device <-> host copies (on the current CUDA stream where CUDA is present) -----

    def backup_from_device(self, device_pages: torch.Tensor, host_pages: torch.Tensor,
                           layer_id: int | None = None) -> None:
        """Copy device pages to host pages (pairwise), one layer or all.

        On CUDA the gather runs on the current stream and the transfer is non_blocking into pinned
        staging; the calling thread then waits for that stream before scattering into the host pages,
        so the host pages hold the data when this returns (the controller calls it from its worker).
        The device pages must not be written meanwhile: the caller keeps them locked until acknowledged.
        """
        host_idx, dev_idx = self._indices(host_pages, device_pages)
        if host_idx.numel() == 0:
            return
        layers = self._layers(layer_id)
        if not self._cuda:
            for layer in layers:
                self._host_layers[layer].index_copy_(self._page_dim, host_idx, self._gather_device(layer, dev_idx))
            return
        staging = torch.empty((len(layers), *self._native_shape(host_idx.numel())), dtype=self._copy_dtype,
                              pin_memory=True)
        for i, layer in enumerate(layers):
            staging[i].copy_(self._gather_device(layer, dev_idx), non_blocking=True)
        torch.cuda.current_stream(self.device_pool.device).synchronize()
        for i, layer in enumerate(layers):
            self._host_layers[layer].index_copy_(self._page_dim, host_idx, staging[i])

    def load_to_device(self, host_pages: torch.Tensor, device_pages: torch.Tensor,
                       layer_id: int | None = None) -> None:
        """Copy host pages to device pages (pairwise), one layer or all.

        On CUDA this gathers on the CPU into pinned staging and enqueues a non_blocking transfer plus a
        scatter on the current stream: the data is on the device once that stream reaches this point
        (the controller records one event per layer). The device pages must be reserved by the caller and
        not read until the load is acknowledged.
        """
        host_idx, dev_idx = self._indices(host_pages, device_pages)
        if host_idx.numel() == 0:
            return
        for layer in self._layers(layer_id):
            staging = torch.empty(self._native_shape(host_idx.numel()), dtype=self._copy_dtype, pin_memory=self._cuda)
            self._gather_host(layer, host_idx, staging)
            if self._cuda:
                staging = staging.to(self.device_pool.device, non_blocking=True)
            self._scatter_device(layer, dev_idx, staging)

    # ----- single pages as bytes (for the storage tier) -----

    def page_buffer(self, host_page: int) -> torch.Tensor:
        """A flat uint8 view (zero-copy) of one page's bytes, all layers, K and V; page_first only."""
        if self.layout != "page_first":
            raise ValueError("page_buffer needs --hicache-mem-layout page_first (a layer_first page is not "
                             "one contiguous byte range); use page_tensor_copy / write_page_bytes")
        return self.buffer[self._check_page(host_page)].view(-1).view(torch.uint8)

    def page_tensor_copy(self, host_page: int) -> torch.Tensor:
        """A copy of one page as uint8 bytes in [layer, k/v, token, head, dim] order, whatever the layout."""
        return self.pages_bytes([host_page])

    def pages_bytes(self, host_pages: list[int]) -> torch.Tensor:
        """A copy of several pages as uint8 bytes: page after page, each in page_tensor_copy's order (one
        gather for all of them: the storage tier's objects are groups of pages)."""
        return self._canonical(self._page_index(host_pages)).contiguous().view(-1).view(torch.uint8)

    def write_page_bytes(self, host_page: int, data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Overwrite one page from `page_bytes` bytes in page_tensor_copy's order."""
        self.write_pages_bytes([host_page], data)

    def write_pages_bytes(self, host_pages: list[int], data: torch.Tensor | bytes | bytearray | memoryview) -> None:
        """Overwrite several pages from pages_bytes' byte order (len(host_pages) * page_bytes bytes), in one scatter."""
        if not isinstance(data, torch.Tensor):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        expected = len(host_pages) * self.page_bytes
        if data.numel() * data.element_size() != expected:
            raise ValueError(f"write_pages_bytes: got {data.numel() * data.element_size()} bytes for "
                             f"{len(host_pages)} page(s) of {self.page_bytes}")
        idx = self._page_index(host_pages)
        L, P, H, D = self.num_layers, self.page_size, self.num_kv_heads, self.head_dim
        values = data.contiguous().view(-1).view(torch.uint8).view(self._copy_dtype).view(len(host_pages), L, 2, P, H, D)
        if self.layout == "page_first":
            self.buffer.index_copy_(0, idx, values)
        else:   # [2, L, pages, P, H, D] <- [pages, L, 2, P, H, D]
            self.buffer.view(2, L, self.num_pages, P, H, D).index_copy_(2, idx, values.permute(2, 1, 0, 3, 4, 5))

    def whole_buffer(self) -> torch.Tensor:
        """The single tensor behind every page (for zero-copy registration with a storage backend)."""
        return self.buffer

    # ----- helpers -----

    def _native_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of one layer of `num_pages` pages as the host layout stores it."""
        shape = [2, 2, self.page_size, self.num_kv_heads, self.head_dim]
        shape[self._page_dim] = num_pages
        return tuple(shape)

    def _gather_host(self, layer: int, host_idx: torch.Tensor, out: torch.Tensor) -> None:
        """One layer of host pages into `out` (host-native shape)."""
        pages = self._host_layers[layer]
        if self._page_dim == 0:
            torch.index_select(pages, 0, host_idx, out=out)
            return
        # Per k/v along the leading dim: index_select along dim 1 of this strided layer view first copies
        # the whole layer (measured: 138 ms for 64 pages of a 2 GB pool, 0.2 ms this way).
        for kv in range(2):
            torch.index_select(pages[kv], 0, host_idx, out=out[kv])

    def _gather_device(self, layer: int, dev_idx: torch.Tensor) -> torch.Tensor:
        """One layer of device pages, stacked in the host layout's native shape."""
        k = self._device_k[layer].index_select(0, dev_idx)
        v = self._device_v[layer].index_select(0, dev_idx)
        return torch.stack((k, v), dim=self._kv_dim)

    def _scatter_device(self, layer: int, dev_idx: torch.Tensor, native: torch.Tensor) -> None:
        """Write one layer (host-native shape, already on the device) into device pages."""
        self._device_k[layer].index_copy_(0, dev_idx, native.select(self._kv_dim, 0))
        self._device_v[layer].index_copy_(0, dev_idx, native.select(self._kv_dim, 1))

    def _canonical(self, pages: torch.Tensor) -> torch.Tensor:
        """The pages `pages` (long) gathered as [pages, L, 2, P, H, D] (a permuted view for layer_first)."""
        if self.layout == "page_first":
            return self.buffer.index_select(0, pages)
        L, P, H, D = self.num_layers, self.page_size, self.num_kv_heads, self.head_dim
        return self.buffer.view(2, L, self.num_pages, P, H, D).index_select(2, pages).permute(2, 1, 0, 3, 4, 5)

    def _layers(self, layer_id: int | None) -> list[int]:
        if layer_id is None:
            return list(range(self.num_layers))
        if not 0 <= layer_id < self.num_layers:
            raise IndexError(f"layer {layer_id} out of range (0..{self.num_layers - 1})")
        return [layer_id]

    def _indices(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        host_idx = torch.as_tensor(host_pages, dtype=torch.long).reshape(-1)
        if host_idx.device.type != "cpu":
            host_idx = host_idx.cpu()
        dev_idx = torch.as_tensor(device_pages, dtype=torch.long).reshape(-1).to(self.device_pool.device)
        if host_idx.numel() != dev_idx.numel():
            raise ValueError(f"{host_idx.numel()} host pages vs {dev_idx.numel()} device pages")
        return host_idx, dev_idx

    def _page_index(self, host_pages: list[int]) -> torch.Tensor:
        """`host_pages` as a long tensor, each checked (page 0 is reserved)."""
        idx = torch.as_tensor(host_pages, dtype=torch.long).reshape(-1)
        if idx.numel() and (int(idx.min()) < 1 or int(idx.max()) >= self.num_pages):
            bad = idx[(idx < 1) | (idx >= self.num_pages)]
            self._check_page(int(bad[0]))
        return idx

    def _check_page(self, host_page: int) -> int:
        page = int(host_page)
        if not 0 < page < self.num_pages:
            raise IndexError(f"host page {page} out of range (1..{self.num_pages - 1})")
        return page


def check_host_memory(needed_bytes: int, what: str = "host KV pool") -> None:
    """Raise HostMemoryError, before anything is allocated, if `needed_bytes` do not fit in available RAM."""
    mem = psutil.virtual_memory()
    headroom = min(HEADROOM_MAX_BYTES, int(HEADROOM_FRACTION * mem.total))
    usable = max(0, mem.available - headroom)
    if needed_bytes > usable:
        raise HostMemoryError(
            f"{what} needs {needed_bytes / GB:.2f} GB of host memory but only {usable / GB:.2f} GB is "
            f"available ({mem.available / GB:.2f} GB free minus {headroom / GB:.2f} GB kept for the system); "
            f"lower --hicache-ratio or --hicache-size (GB), or --page-size / the device pool that they scale")


def _pin_in_place(buffer: torch.Tensor) -> bool:
    """Page-lock an allocated CPU tensor; False (and a warning) when the driver refuses.

    cudaHostRegister rather than `pin_memory=True`: the caching host allocator rounds sizes up to a
    power of two, which would turn a 100 GB pool into 128 GB of locked memory.
    """
    nbytes = buffer.numel() * buffer.element_size()
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 1))  # 1 = portable
    except Exception as e:  # no CUDA in this build / driver: pinning is an optimization, not a need
        err, detail = -1, str(e)
    else:
        detail = f"cudaError {err}"
    if err != 0:
        # Still correct: transfers go through pinned staging buffers anyway.
        logger.warning("could not pin the host KV pool (%.2f GB, %s); using pageable memory", nbytes / GB, detail)
    return err == 0


def _unpin(data_ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(data_ptr)
    except Exception:  # interpreter shutdown: CUDA may already be torn down
        pass
