"""CacheController: asynchronous backups and load-backs, acknowledgements, per-layer waits, shutdown."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvstrata.cache.cache_controller import CacheController, CopyError, layer_wait_for
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.host_pool import HostKVPool

pytestmark = pytest.mark.timeout(60)
LAYOUTS = ["layer_first", "page_first"]
PAGE, LAYERS, HEADS, DIM = 4, 3, 2, 8
DEVICE_PAGES, HOST_PAGES = 64, 160


class GatedHostPool(HostKVPool):
    """The real host pool, except that copying layer i of a load waits for `gates[i]` (to observe waits)."""

    def __init__(self, *args, fail_at_layer: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.gates = [threading.Event() for _ in range(self.num_layers)]
        self.fail_at_layer = fail_at_layer
        self.entered = threading.Event()                                   # a load has started copying

    def load_to_device(self, host_pages, device_pages, layer_id=None):
        assert layer_id is not None, "the controller loads layer by layer"
        self.entered.set()
        assert self.gates[layer_id].wait(30), "test gate never opened"
        if layer_id == self.fail_at_layer:
            raise RuntimeError("injected copy failure")
        super().load_to_device(host_pages, device_pages, layer_id)


def fill_random(device: DeviceKVPool, host: HostKVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in range(device.num_layers):
        device.k_buffer[layer].copy_(torch.randn(device.k_buffer[layer].shape, generator=gen))
        device.v_buffer[layer].copy_(torch.randn(device.v_buffer[layer].shape, generator=gen))
    host.buffer.copy_(torch.randn(host.buffer.shape, generator=gen))


def device_page(pool: DeviceKVPool, page: int, layer: int | None = None) -> torch.Tensor:
    """One device page as [layer, k/v, token, head, dim] (or one layer of it), on the CPU."""
    rows = slice(page * PAGE, (page + 1) * PAGE)
    layers = range(pool.num_layers) if layer is None else [layer]
    out = torch.stack([torch.stack((pool.k_buffer[i][rows], pool.v_buffer[i][rows])) for i in layers]).cpu()
    return out if layer is None else out[0]


def host_page(pool: HostKVPool, page: int) -> torch.Tensor:
    return pool.page_tensor_copy(page).view(pool.dtype).view(LAYERS, 2, PAGE, HEADS, DIM)


def drain_acks(controller: CacheController, expected: int, timeout: float = 20.0) -> list:
    acks, deadline = [], time.monotonic() + timeout
    while len(acks) < expected and time.monotonic() < deadline:
        acks += controller.poll_acks()
        time.sleep(0.001)
    return acks


def controller_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvstrata-")]


@pytest.fixture
def make_controller():
    """Builds pools and a controller; every controller made is shut down (threads joined) after the test."""
    made: list[CacheController] = []

    def make(layout="layer_first", pool_cls=HostKVPool, num_workers=1, seed=0, **pool_kwargs):
        device = DeviceKVPool(DEVICE_PAGES, PAGE, LAYERS, HEADS, DIM, torch.float32, "cpu")
        host = pool_cls(device, HOST_PAGES, layout=layout, pin_memory=False, **pool_kwargs)
        fill_random(device, host, seed)
        made.append(CacheController(device, host, num_workers=num_workers))
        return made[-1]
    yield make
    for controller in made:
        for gate in getattr(controller.host_pool, "gates", []):
            gate.set()
        controller.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_concurrent_backups_and_load_backs_are_acked_once_with_correct_data(make_controller, layout):
    controller = make_controller(layout, num_workers=2, seed=1)
    device, host = controller.device_pool, controller.host_pool
    rng = random.Random(7)
    # Backups read device pages A into host pages X; load-backs read host pages Y into device pages B.
    device_ids, host_ids = rng.sample(range(1, DEVICE_PAGES), 62), rng.sample(range(1, HOST_PAGES), 120)
    dev_a, dev_b, host_x, host_y = device_ids[:30], device_ids[30:], host_ids[:30], host_ids[30:62]
    want_host = {h: device_page(device, d) for d, h in zip(dev_a, host_x, strict=True)}
    want_device = {d: host_page(host, h) for h, d in zip(host_y, dev_b, strict=True)}

    submitted, handles = {}, []
    backups, loads = chunks(list(zip(dev_a, host_x, strict=True)), rng), chunks(list(zip(host_y, dev_b, strict=True)), rng)
    while backups or loads:                         # interleave the two kinds in random order
        if backups and (not loads or rng.random() < 0.5):
            pairs = backups.pop()
            op_id = controller.submit_backup(torch.tensor([d for d, _ in pairs]), torch.tensor([h for _, h in pairs]))
            submitted[op_id] = ("backup", len(pairs))
        else:
            pairs = loads.pop()
            handle = controller.submit_load_back([h for h, _ in pairs], [d for _, d in pairs], node=("n", len(pairs)))
            handles.append(handle)
            submitted[handle.op_id] = ("load_back", len(pairs))

    acks = drain_acks(controller, len(submitted))
    assert sorted(op.op_id for op in acks) == sorted(submitted)          # every op, exactly once
    assert all(op.error is None and (op.kind, op.num_pages) == submitted[op.op_id] for op in acks)
    assert all(op.node == ("n", op.num_pages) for op in acks if op.kind == "load_back")
    time.sleep(0.05)
    assert controller.poll_acks() == []
    for h, want in want_host.items():
        assert torch.equal(host_page(host, h), want)
    for d, want in want_device.items():
        assert torch.equal(device_page(device, d), want)
    for handle in handles:
        handle.wait_all(timeout=1)                                        # already done: returns at once


def chunks(pairs: list, rng: random.Random) -> list[list]:
    """Split pairs into ops of 1..5 pages."""
    out = []
    while pairs:
        size = rng.randint(1, 5)
        out.append(pairs[:size])
        pairs = pairs[size:]
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wait_layer_returns_once_that_layer_is_copied(make_controller, layout):
    controller = make_controller(layout, pool_cls=GatedHostPool, seed=2)
    device, host = controller.device_pool, controller.host_pool
    want = host_page(host, 9)
    before = device_page(device, 5)
    handle = controller.submit_load_back(torch.tensor([9]), torch.tensor([5]))

    with pytest.raises(TimeoutError):
        handle.wait_layer(0, timeout=0.1)                                 # layer 0 not copied yet
    host.gates[0].set()
    handle.wait_layer(0, timeout=5)
    assert torch.equal(device_page(device, 5, layer=0), want[0])          # visible after wait_layer(0)
    with pytest.raises(TimeoutError):
        handle.wait_layer(1, timeout=0.1)
    assert torch.equal(device_page(device, 5, layer=1), before[1])        # layer 1 still untouched
    assert controller.poll_acks() == []                                   # not acked before every layer

    host.gates[1].set()
    handle.wait_layer(1, timeout=5)
    assert torch.equal(device_page(device, 5, layer=1), want[1])
    host.gates[2].set()
    handle.wait_all(timeout=5)
    assert torch.equal(device_page(device, 5), want)
    assert [op.op_id for op in drain_acks(controller, 1)] == [handle.op_id]


def test_failed_load_back_raises_in_wait_layer_and_is_acked_with_error(make_controller):
    controller = make_controller(pool_cls=GatedHostPool, fail_at_layer=1)
    for gate in controller.host_pool.gates:
        gate.set()
    handle = controller.submit_load_back(torch.tensor([3, 4]), torch.tensor([7, 8]))
    handle.wait_layer(0, timeout=5)
    with pytest.raises(CopyError, match="injected"):
        handle.wait_layer(1, timeout=5)
    with pytest.raises(CopyError):
        handle.wait_layer(2, timeout=5)
    (ack,) = drain_acks(controller, 1)
    assert ack.op_id == handle.op_id and "injected" in ack.error
    stats = controller.stats()
    assert stats["failed_ops"] == 1 and stats["load_back_ops"] == 0 and stats["ops_in_flight"] == 0


def test_load_backs_are_not_queued_behind_backups(make_controller):
    controller = make_controller(pool_cls=GatedHostPool)
    gates = controller.host_pool.gates
    first = controller.submit_load_back([1], [1])                       # holds the load-back worker
    for i in range(5):
        controller.submit_backup([10 + i], [20 + i])
    acks = drain_acks(controller, 5)                                      # backups run while the load waits
    assert sorted(op.kind for op in acks) == ["backup"] * 5
    for gate in gates:
        gate.set()
    first.wait_all(timeout=5)


def test_layer_wait_for_waits_on_every_handle(make_controller):
    controller = make_controller(pool_cls=GatedHostPool)
    host = controller.host_pool
    a = controller.submit_load_back([3], [5])
    b = controller.submit_load_back([4], [6])
    wait = layer_wait_for([a, b])
    assert layer_wait_for([]) is None
    for gate in host.gates:
        gate.set()
    for layer in range(LAYERS):
        wait(layer)
        assert torch.equal(device_page(controller.device_pool, 6, layer), host_page(host, 4)[layer])


def test_wait_idle_and_stats_count_bytes(make_controller):
    controller = make_controller(seed=3)
    page_bytes = controller.host_pool.page_bytes
    sizes = [1, 4, 2, 7]
    next_page = 1
    for size in sizes:
        pages = list(range(next_page, next_page + size))
        controller.submit_backup(pages, pages)
        next_page += size
    controller.submit_load_back([100, 101, 102], [40, 41, 42])
    controller.wait_idle(timeout=10)
    stats = controller.stats()
    assert stats["ops_in_flight"] == 0 and stats["failed_ops"] == 0
    assert stats["backup_ops"] == 4 and stats["backup_bytes"] == sum(sizes) * page_bytes
    assert stats["load_back_ops"] == 1 and stats["load_back_bytes"] == 3 * page_bytes
    assert stats["backup_bytes_per_s"] > 0 and stats["load_back_bytes_per_s"] > 0
    assert len(controller.poll_acks()) == 5                              # wait_idle leaves the acks queued


def test_wait_idle_times_out_while_a_copy_is_stuck(make_controller):
    controller = make_controller(pool_cls=GatedHostPool)
    controller.submit_load_back([3], [5])
    with pytest.raises(TimeoutError):
        controller.wait_idle(timeout=0.1)
    assert controller.stats()["ops_in_flight"] == 1
    for gate in controller.host_pool.gates:
        gate.set()
    controller.wait_idle(timeout=5)


def test_invalid_pages_are_rejected_at_submit(make_controller):
    controller = make_controller()
    with pytest.raises(ValueError):
        controller.submit_backup([0], [1])                                # page 0 is reserved
    with pytest.raises(ValueError):
        controller.submit_backup([1], [HOST_PAGES])
    with pytest.raises(ValueError):
        controller.submit_load_back([1, 2], [3])
    assert controller.stats()["ops_in_flight"] == 0


def test_shutdown_joins_threads_and_cancels_queued_ops(make_controller):
    before = set(controller_threads())
    controller = make_controller(pool_cls=GatedHostPool, num_workers=2)
    mine = set(controller_threads()) - before
    assert len(mine) == 3 and all(t.is_alive() for t in mine)          # one load-back + two backup workers

    running = controller.submit_load_back([3], [5])                      # blocks the load-back worker
    queued = controller.submit_load_back([4], [6])
    assert controller.host_pool.entered.wait(5)
    stopper = threading.Thread(target=controller.shutdown, name="test-stopper")
    stopper.start()
    deadline = time.monotonic() + 5
    while not controller._stopping and time.monotonic() < deadline:      # shutdown has begun
        time.sleep(0.001)
    for gate in controller.host_pool.gates:
        gate.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert not any(t.is_alive() for t in mine)
    assert not mine & set(threading.enumerate())

    running.wait_all(timeout=1)                                          # the op in progress finished
    with pytest.raises(CopyError, match="shut down"):
        queued.wait_layer(0, timeout=1)
    acks = {op.op_id: op for op in controller.poll_acks()}
    assert acks[running.op_id].error is None and "shut down" in acks[queued.op_id].error
    with pytest.raises(RuntimeError, match="shut down"):
        controller.submit_backup([1], [1])
    controller.shutdown()                                                # idempotent


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_copy_streams_and_layer_events(layout):
    device = DeviceKVPool(DEVICE_PAGES, PAGE, LAYERS, HEADS, DIM, torch.bfloat16, "cuda")
    host = HostKVPool(device, HOST_PAGES, layout=layout)
    fill_random(device, host, 4)
    with CacheController(device, host) as controller:
        # A backup waits for what the compute stream wrote before submit.
        for layer in range(LAYERS):
            device.k_buffer[layer][PAGE:2 * PAGE].fill_(float(layer + 1))
        want = device_page(device, 1)
        controller.submit_backup(torch.tensor([1]), torch.tensor([50]))
        controller.wait_idle(timeout=10)
        assert torch.equal(host_page(host, 50), want)

        expected = host_page(host, 60)
        handle = controller.submit_load_back(torch.tensor([60]), torch.tensor([7], device="cuda"))
        for layer in range(LAYERS):
            handle.wait_layer(layer, timeout=10)                         # orders the current stream after it
            seen = device.k_buffer[layer][7 * PAGE:8 * PAGE].float().sum()
            assert torch.allclose(seen.cpu(), expected[layer, 0].float().sum())
        acks = drain_acks(controller, 2)
        assert [op.kind for op in acks] == ["backup", "load_back"]
        assert controller.stats()["load_back_bytes"] == host.page_bytes


# Run in a fresh process: the OS threads of the test process depend on what earlier tests left running.
_THREAD_COUNT = r"""
import os, sys, torch
from kvstrata.cache.cache_controller import CacheController
from kvstrata.cache.storage_io import StorageIO
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.memory.host_pool import HostKVPool
from kvstrata.storage.file_backend import FileBackend

def os_threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
# Pages of 8192 values a layer: 64 pages (or a storage group of 8) are well above torch's grain for a
# parallel copy.
device = DeviceKVPool(72, 16, 2, 8, 64, torch.float32, "cpu")
host = HostKVPool(device, 160, layout="layer_first", pin_memory=False)
device.k_buffer[0].index_copy_(0, torch.arange(1024), torch.randn(1024, 8, 64))   # the main thread's pool
before = os_threads()
pages = list(range(1, 65))
with CacheController(device, host) as controller:
    controller.submit_backup(pages, pages)
    controller.wait_idle(timeout=30)
    controller.submit_load_back(pages, [p + 4 for p in pages]).wait_all(timeout=30)
    controller.wait_idle(timeout=30)
    assert torch.equal(device.k_buffer[1][80:96], host.buffer[0, 1, 16:32]), "page 5 came back wrong"
    storage = StorageIO(FileBackend(8 * host.page_bytes, root=sys.argv[1]), host, group_pages=8)
    storage.submit_backup(["a", "b"], pages[:16])
    storage.wait_idle(timeout=30)
    storage.submit_prefetch(["a", "b"], list(range(100, 116)))
    storage.wait_idle(timeout=30)
    assert torch.equal(host.pages_bytes(pages[:16]), host.pages_bytes(list(range(100, 116)))), "storage round trip"
    print(os_threads() - before)
    storage.shutdown()
"""


def test_copy_workers_start_no_openmp_pool_of_their_own(tmp_path):
    """Tier copies run on their worker alone: a pool of its own would spin on the scheduler's cores."""
    done = subprocess.run([sys.executable, "-c", _THREAD_COUNT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # The load-back worker, the backup worker and the storage prefetch and backup workers, and nothing else.
    assert done.stdout.split()[-1] == "4", "threads beyond the copy workers: " + done.stdout
