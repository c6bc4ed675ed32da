"""HostKVPool: layouts, device<->host page copies, page bytes for the storage tier, sizing, memory check."""

from __future__ import annotations

import psutil
import pytest
import torch

from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.host_pool import HostKVPool, HostMemoryError
from tests.capabilities import requires_no_cuda

LAYOUTS = ["layer_first", "page_first"]
PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 8


def make_device_pool(num_pages: int = 16, device: str = "cpu", dtype=torch.float32) -> DeviceKVPool:
    pool = DeviceKVPool(num_pages, PAGE, LAYERS, HEADS, DIM, dtype, device)
    gen = torch.Generator().manual_seed(num_pages)
    for layer in range(LAYERS):
        pool.k_buffer[layer].copy_(torch.randn(pool.k_buffer[layer].shape, generator=gen))
        pool.v_buffer[layer].copy_(torch.randn(pool.v_buffer[layer].shape, generator=gen))
    return pool


def device_page(pool: DeviceKVPool, page: int) -> torch.Tensor:
    """One device page as [layer, k/v, token, head, dim] (page_tensor_copy's byte order), on the CPU."""
    rows = slice(page * PAGE, (page + 1) * PAGE)
    return torch.stack([torch.stack((pool.k_buffer[layer][rows], pool.v_buffer[layer][rows]))
                        for layer in range(pool.num_layers)]).cpu()


def host_page(pool: HostKVPool, page: int) -> torch.Tensor:
    return pool.page_tensor_copy(page).view(pool.dtype).view(LAYERS, 2, PAGE, HEADS, DIM)


def zero_device(pool: DeviceKVPool) -> None:
    for layer in range(pool.num_layers):
        pool.k_buffer[layer].zero_()
        pool.v_buffer[layer].zero_()


@pytest.fixture(params=LAYOUTS)
def pools(request) -> tuple[DeviceKVPool, HostKVPool]:
    device = make_device_pool()
    host = HostKVPool(device, 40, layout=request.param, pin_memory=False)
    host.buffer.zero_()
    return device, host


def test_shapes_and_page_bytes(pools):
    device, host = pools
    assert host.page_bytes == PAGE * LAYERS * 2 * HEADS * DIM * 4
    assert host.whole_buffer().numel() * 4 == 40 * host.page_bytes
    expected = (2, LAYERS, 40 * PAGE, HEADS, DIM) if host.layout == "layer_first" else (40, LAYERS, 2, PAGE, HEADS, DIM)
    assert tuple(host.whole_buffer().shape) == expected
    assert host.allocator.capacity_pages == 39 and 0 not in host.allocator.free_page_ids()


def test_backup_then_load_back_into_other_pages_is_exact(pools):
    device, host = pools
    src, dst_host, dst_dev = [1, 3, 5, 7, 15], [9, 2, 39, 6, 20], [10, 11, 2, 4, 8]
    originals = [device_page(device, p) for p in src]
    host.backup_from_device(torch.tensor(src), torch.tensor(dst_host))
    for h, original in zip(dst_host, originals, strict=True):
        assert torch.equal(host_page(host, h), original)
    assert torch.count_nonzero(host_page(host, 1)) == 0          # an untouched host page stays untouched
    # Where the layout says a page lives: layer 2's V of host page 9.
    buf, v9 = host.whole_buffer(), originals[0][2, 1]
    stored = buf[1, 2, 9 * PAGE:10 * PAGE] if host.layout == "layer_first" else buf[9, 2, 1]
    assert torch.equal(stored, v9)

    zero_device(device)
    host.load_to_device(torch.tensor(dst_host), torch.tensor(dst_dev))
    for d, original in zip(dst_dev, originals, strict=True):
        assert torch.equal(device_page(device, d), original)
    for p in set(range(16)) - set(dst_dev):
        assert torch.count_nonzero(device_page(device, p)) == 0


def test_layer_wise_copies_touch_only_that_layer(pools):
    device, host = pools
    original = device_page(device, 5)
    host.backup_from_device(torch.tensor([5]), torch.tensor([8]), layer_id=1)
    copied = host_page(host, 8)
    assert torch.equal(copied[1], original[1])
    assert torch.count_nonzero(copied[0]) == 0 and torch.count_nonzero(copied[2]) == 0

    host.backup_from_device(torch.tensor([5]), torch.tensor([8]))
    zero_device(device)
    host.load_to_device(torch.tensor([8]), torch.tensor([12]), layer_id=2)
    loaded = device_page(device, 12)
    assert torch.equal(loaded[2], original[2])
    assert torch.count_nonzero(loaded[:2]) == 0


def test_empty_copy_is_a_no_op_and_mismatched_lengths_raise(pools):
    device, host = pools
    device_before = [buf.clone() for buf in (*device.k_buffer, *device.v_buffer)]
    host.backup_from_device(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError):
        host.backup_from_device(torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(IndexError):
        host.load_to_device(torch.tensor([3]), torch.tensor([1]), layer_id=LAYERS)
    # nothing was copied either way: the host pool is still all zeros, the device pool unchanged
    assert torch.count_nonzero(host.whole_buffer()) == 0
    assert all(torch.equal(a, b) for a, b in zip(device_before, (*device.k_buffer, *device.v_buffer), strict=True))


def test_page_first_page_buffer_is_a_zero_copy_view():
    device = make_device_pool()
    host = HostKVPool(device, 12, layout="page_first", pin_memory=False)
    view = host.page_buffer(3)
    assert view.dtype == torch.uint8 and view.numel() == host.page_bytes
    base = host.whole_buffer().data_ptr()
    assert view.data_ptr() == base + 3 * host.page_bytes

    host.backup_from_device(torch.tensor([4]), torch.tensor([3]))
    assert torch.equal(view, host.page_tensor_copy(3))            # the view sees copies into the pool
    fresh = torch.randint(0, 255, (host.page_bytes,), dtype=torch.uint8)
    view.copy_(fresh)                                              # ...and writing it changes the pool
    assert torch.equal(host.page_tensor_copy(3), fresh)
    host.load_to_device(torch.tensor([3]), torch.tensor([6]))
    assert torch.equal(device_page(device, 6).view(-1).view(torch.uint8), fresh)   # bytes: random bits may be NaN


def test_layer_first_has_no_page_buffer():
    host = HostKVPool(make_device_pool(), 12, layout="layer_first", pin_memory=False)
    with pytest.raises(ValueError, match="page_first"):
        host.page_buffer(1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_bytes_round_trip_in_the_same_order_for_both_layouts(layout):
    device = make_device_pool()
    host = HostKVPool(device, 12, layout=layout, pin_memory=False)
    values = torch.randn(LAYERS, 2, PAGE, HEADS, DIM)
    data = values.view(-1).view(torch.uint8).clone()
    host.write_page_bytes(5, data)
    assert torch.equal(host.page_tensor_copy(5), data)
    host.write_page_bytes(6, bytes(data.numpy()))                  # bytes-like input works too
    assert torch.equal(host.page_tensor_copy(6), data)
    # The byte order is [layer, k/v, token, head, dim] whatever the layout: load it and look.
    host.load_to_device(torch.tensor([5]), torch.tensor([2]))
    assert torch.equal(device_page(device, 2), values)
    with pytest.raises(ValueError):
        host.write_page_bytes(5, data[:-1])
    with pytest.raises(IndexError):
        host.page_tensor_copy(0)                                    # page 0 is reserved
    with pytest.raises(IndexError, match="host page 12 out of range"):
        host.pages_bytes([5, 12, 6])                                # past the pool, among valid pages


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_of_pages_as_bytes_are_their_pages_in_order(layout):
    # The storage tier's objects: one gather / scatter per group, the same bytes as page after page.
    device = make_device_pool()
    host = HostKVPool(device, 12, layout=layout, pin_memory=False)
    host.backup_from_device(torch.arange(1, 12), torch.arange(1, 12))
    group = [7, 2, 9]                                              # host pages of a group need not be in order
    data = host.pages_bytes(group)
    assert torch.equal(data, torch.cat([host.page_tensor_copy(p) for p in group]))
    host.buffer.zero_()
    host.write_pages_bytes([3, 10, 4], data)
    for src, dst in zip(group, [3, 10, 4], strict=True):
        assert torch.equal(host_page(host, dst), device_page(device, src))
    assert torch.count_nonzero(host.page_tensor_copy(5)) == 0
    with pytest.raises(ValueError, match="3 page"):
        host.write_pages_bytes([3, 10, 4], data[:-1])


def test_write_page_bytes_leaves_neighbours_alone():
    host = HostKVPool(make_device_pool(), 12, layout="layer_first", pin_memory=False)
    host.buffer.zero_()
    host.write_page_bytes(5, torch.full((host.page_bytes,), 7, dtype=torch.uint8))
    for page in (4, 6):
        assert torch.count_nonzero(host.page_tensor_copy(page)) == 0


def test_size_pages_ratio_size_override_and_minimum():
    device = make_device_pool(num_pages=16)
    page_bytes = HostKVPool.page_bytes_for(device)
    assert HostKVPool.size_pages(device, 2.0, 0) == 32
    assert HostKVPool.size_pages(device, 2.0, 1) == int(1e9 // page_bytes)    # GB wins over the ratio
    with pytest.raises(ValueError, match="hicache-ratio"):
        HostKVPool.size_pages(device, 1.0, 0)
    big = DeviceKVPool(int(1e9 // page_bytes) + 10, PAGE, LAYERS, HEADS, DIM, torch.float32, "meta")
    with pytest.raises(ValueError, match="hicache-size"):
        HostKVPool.size_pages(big, 2.0, 1)                          # 1 GB is smaller than this device pool
    with pytest.raises(ValueError):
        HostKVPool.size_pages(device, 0.0, 0)


def test_host_memory_error_before_allocating():
    device = make_device_pool()
    num_pages = int(10e12 // HostKVPool.page_bytes_for(device))    # 10 TB
    rss_before = psutil.Process().memory_info().rss
    with pytest.raises(HostMemoryError) as err:
        HostKVPool(device, num_pages, pin_memory=False)
    message = str(err.value)
    assert "GB" in message and "--hicache-size" in message and "--hicache-ratio" in message
    assert psutil.Process().memory_info().rss - rss_before < 100e6


def test_pinned_only_where_cuda_exists():
    host = HostKVPool(make_device_pool(), 8, pin_memory=None)
    assert host.pinned == torch.cuda.is_available()


@requires_no_cuda   # checks the fallback when pinning is impossible
def test_pinning_without_cuda_falls_back_to_pageable_memory(caplog):
    host = HostKVPool(make_device_pool(), 8, pin_memory=True)
    assert not host.pinned and "could not pin" in caplog.text
    host.backup_from_device(torch.tensor([1]), torch.tensor([2]))


def test_bad_layout_or_size_is_rejected():
    with pytest.raises(ValueError, match="layout"):
        HostKVPool(make_device_pool(), 8, layout="token_first")
    with pytest.raises(ValueError):
        HostKVPool(make_device_pool(), 1)


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_round_trip_with_pinned_pool(layout):
    device = make_device_pool(device="cuda", dtype=torch.bfloat16)
    host = HostKVPool(device, 40, layout=layout)
    assert host.pinned and host.whole_buffer().is_pinned()
    originals = [device_page(device, p) for p in (1, 2, 9)]
    host.backup_from_device(torch.tensor([1, 2, 9]), torch.tensor([30, 4, 17]))
    zero_device(device)
    host.load_to_device(torch.tensor([30, 4, 17]), torch.tensor([3, 7, 5], device="cuda"))
    torch.cuda.synchronize()
    for d, original in zip((3, 7, 5), originals, strict=True):
        assert torch.equal(device_page(device, d), original)
    host.load_to_device(torch.tensor([30]), torch.tensor([11]), layer_id=1)
    torch.cuda.synchronize()
    assert torch.equal(device_page(device, 11)[1], originals[0][1])
    assert torch.count_nonzero(device_page(device, 11)[0]) == 0
