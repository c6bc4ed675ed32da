"""The Mooncake backend against a real mooncake_master, metadata server and store service on 127.0.0.1."""

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from kvstrata.storage.base import StorageError, create_backend
from kvstrata.storage.mooncake_services import MooncakeCluster
from tests.capabilities import requires_outside_ipv4
from tests.net_probe import answers, outside_ipv4

pytestmark = pytest.mark.mooncake

PAGE_BYTES = 16 * 1024
REPO = Path(__file__).resolve().parents[2]


def unique_keys(n: int) -> list[str]:
    prefix = uuid.uuid4().hex[:12]
    return [f"{prefix}-{i}" for i in range(n)]


def random_pages(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def backend(mooncake_cluster):
    backend = create_backend("mooncake", PAGE_BYTES, mooncake_cluster.client_config())
    yield backend
    backend.close()


@requires_outside_ipv4
def test_client_transfer_engine_refuses_other_interfaces(backend):
    """The client binds 127.0.0.1 here: its transfer engine's ports (which Mooncake opens on every interface)
    accept loopback connections only (asked at this machine's own non-loopback address)."""
    outside = outside_ipv4()
    wildcard = [c.laddr.port for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.ip in ("0.0.0.0", "::")]
    assert wildcard, "the Mooncake client's transfer engine should be listening"
    assert [p for p in wildcard if answers(outside, p)] == []
    assert all(answers("127.0.0.1", p) for p in wildcard)


@pytest.fixture(scope="module")
def host_pool(backend):
    """A host-pool-like tensor of 32 pages, registered for zero-copy."""
    pool = torch.zeros(32, PAGE_BYTES, dtype=torch.uint8)
    backend.register_buffer(pool)
    return pool


def test_zero_copy_round_trip(backend, host_pool):
    ks = unique_keys(8)
    host_pool[:8] = random_pages(8, seed=1)
    before = backend.stats()
    assert backend.batch_set(ks, [host_pool[i] for i in range(8)]) == 8
    assert backend.batch_exists(ks) == 8
    host_pool[8:16] = 0
    assert backend.batch_get(ks, [host_pool[8 + i] for i in range(8)]) == 8
    assert torch.equal(host_pool[8:16], host_pool[:8])
    after = backend.stats()
    assert after["bytes_written"] - before["bytes_written"] == 8 * PAGE_BYTES
    assert after["bytes_read"] - before["bytes_read"] == 8 * PAGE_BYTES
    assert after["errors"] == before["errors"] and after["skipped_unavailable"] == 0
    # in place: the pool is registered, so nothing went through the staging copy
    assert after["zero_copy_pages"] - before["zero_copy_pages"] == 16
    assert after["staged_pages"] == before["staged_pages"]


def test_unregistered_buffers_of_any_dtype_go_through_staging(backend, host_pool):
    ks = unique_keys(3)
    data = [torch.randn(PAGE_BYTES // 2).to(torch.bfloat16) for _ in range(3)]
    before = backend.stats()
    assert backend.batch_set(ks, data) == 3
    out = [torch.zeros(PAGE_BYTES // 4, dtype=torch.float32) for _ in range(2)] + [host_pool[20]]
    assert backend.batch_get(ks, out) == 3
    after = backend.stats()
    # 3 staged writes, 2 staged reads; the read into the registered pool went in place
    assert after["staged_pages"] - before["staged_pages"] == 5
    assert after["zero_copy_pages"] - before["zero_copy_pages"] == 1
    assert torch.equal(out[0].view(torch.bfloat16), data[0]) and torch.equal(out[1].view(torch.bfloat16), data[1])
    assert torch.equal(host_pool[20].view(torch.bfloat16), data[2])


def test_leading_exists_and_get_stop_at_first_missing(backend, host_pool):
    ks = unique_keys(5)
    host_pool[:5] = random_pages(5, seed=2)
    assert backend.batch_set([ks[0], ks[1], ks[3], ks[4]], [host_pool[i] for i in (0, 1, 3, 4)]) == 4
    assert backend.batch_exists(ks) == 2
    assert backend.batch_exists(ks[3:]) == 2
    assert backend.batch_get(ks, [host_pool[10 + i] for i in range(5)]) == 2
    assert torch.equal(host_pool[10:12], host_pool[0:2])
    misses_are_not_errors = backend.stats()["errors"]
    assert backend.batch_get(unique_keys(2), [host_pool[10], host_pool[11]]) == 0
    assert backend.stats()["errors"] == misses_are_not_errors


def test_set_existing_key_is_a_noop_success(backend, host_pool):
    ks = unique_keys(1)
    host_pool[0] = 7
    assert backend.batch_set(ks, [host_pool[0]]) == 1
    host_pool[1] = 9
    assert backend.batch_set(ks, [host_pool[1]]) == 1
    assert backend.batch_get(ks, [host_pool[2]]) == 1
    assert int(host_pool[2].min()) == int(host_pool[2].max()) in (7, 9)  # one whole version, never mixed


CHILD = textwrap.dedent("""
    import json, sys, torch
    from kvstrata.storage.base import create_backend
    config, page_bytes, read_keys, write_keys = json.loads(sys.argv[1])
    backend = create_backend("mooncake", page_bytes, config)
    pool = torch.zeros(len(read_keys) + len(write_keys), page_bytes, dtype=torch.uint8)
    backend.register_buffer(pool)
    n = len(read_keys)
    got = backend.batch_get(read_keys, [pool[i] for i in range(n)])
    for i in range(len(write_keys)):
        pool[n + i] = 100 + i
    put = backend.batch_set(write_keys, [pool[n + i] for i in range(len(write_keys))])
    print(json.dumps({"got": got, "sums": [int(pool[i].sum()) for i in range(n)], "put": put}))
    backend.close()
""")


def test_two_processes_share_pages(backend, host_pool, mooncake_cluster):
    import json

    mine, theirs = unique_keys(4), unique_keys(3)
    host_pool[:4] = random_pages(4, seed=3)
    assert backend.batch_set(mine, [host_pool[i] for i in range(4)]) == 4
    arg = json.dumps([mooncake_cluster.client_config(), PAGE_BYTES, mine, theirs])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, arg], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["got"] == 4 and result["put"] == 3
    assert result["sums"] == [int(host_pool[i].sum()) for i in range(4)]
    # The child has exited; its pages live on in the store service.
    assert backend.batch_get(theirs, [host_pool[10 + i] for i in range(3)]) == 3
    assert [int(host_pool[10 + i][0]) for i in range(3)] == [100, 101, 102]


def test_p2p_handshake_cluster_round_trip(mooncake_env, tmp_path):
    with MooncakeCluster(workdir=tmp_path / "p2p", metadata="p2p", segment_bytes=16 << 20) as cluster:
        with create_backend("mooncake", PAGE_BYTES, cluster.client_config()) as b:
            data = [random_pages(1, seed=4)[0]]
            assert b.batch_set(["p2p-key"], data) == 1
            out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8)]
            assert b.batch_get(["p2p-key"], out) == 1 and torch.equal(out[0], data[0])


def quick_retry_backend(cluster):
    """A backend of `cluster` that probes a failed cluster again after 0.2-1 s (tests that kill a service)."""
    return create_backend("mooncake", PAGE_BYTES, {**cluster.client_config(), "retry_backoff_s": 0.2,
                                                   "retry_backoff_max_s": 1.0})


def test_master_killed_then_restarted(own_mooncake_cluster):
    cluster = own_mooncake_cluster
    b = quick_retry_backend(cluster)
    try:
        pool = random_pages(8, seed=5)
        b.register_buffer(pool)
        ks = unique_keys(4)
        assert b.batch_set(ks, [pool[i] for i in range(4)]) == 4

        cluster.kill_master()
        started = time.monotonic()
        for _ in range(5):  # nothing raises, everything misses, fast
            assert b.batch_exists(ks) == 0
            assert b.batch_get(ks, [pool[4 + i] for i in range(4)]) == 0
            assert b.batch_set(unique_keys(2), [pool[0], pool[1]]) == 0
        assert time.monotonic() - started < 5.0
        stats = b.stats()
        assert stats["errors"] >= 1 and stats["skipped_unavailable"] > 0 and not stats["available"]

        cluster.start_master()
        fresh = unique_keys(2)
        deadline = time.monotonic() + 60
        while b.batch_set(fresh, [pool[0], pool[1]]) != 2:  # until the store service has remounted
            assert time.monotonic() < deadline, b.stats()
            time.sleep(0.2)
        assert b.batch_exists(fresh) == 2
        assert b.batch_get(fresh, [pool[6], pool[7]]) == 2 and torch.equal(pool[6:8], pool[0:2])
        assert b.batch_exists(ks) == 0  # a restarted master has forgotten the old pages
        stats = b.stats()
        assert stats["available"] and stats["outages"] == 1
        assert stats["client_recreations"] == 0  # the Mooncake client reconnected by itself
    finally:
        b.close()


def test_recreated_client_keeps_registrations(backend, host_pool):
    before = backend.client_recreations
    backend._recreate_client()
    assert backend.client_recreations == before + 1
    ks = unique_keys(2)
    host_pool[:2] = random_pages(2, seed=6)
    assert backend.batch_set(ks, [host_pool[0], host_pool[1]]) == 2
    assert backend.batch_get(ks, [host_pool[2], host_pool[3]]) == 2
    assert torch.equal(host_pool[2:4], host_pool[0:2])


def test_construction_fails_fast_without_a_master(mooncake_env):
    started = time.monotonic()
    with pytest.raises(StorageError, match="cannot reach the Mooncake master"):
        create_backend("mooncake", PAGE_BYTES, {"master_server_address": "127.0.0.1:1"})
    assert time.monotonic() - started < 5.0


def test_concurrent_threads(backend, host_pool):
    import threading

    keys_by_thread = [unique_keys(4) for _ in range(2)]
    host_pool[24:32] = random_pages(8, seed=7)
    results: list = []

    def work(t: int) -> None:
        ks, base = keys_by_thread[t], 24 + 4 * t
        for _ in range(10):
            results.append(backend.batch_set(ks, [host_pool[base + i] for i in range(4)]))
            results.append(backend.batch_exists(ks))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert results == [4] * 40


def overwrite_object(backend, key: str, data: bytes) -> None:
    """Replace an object in the store with raw bytes, as any other writer of the cluster could."""
    store = backend._store      # the raw Mooncake client of this process
    assert store.remove(key, True) == 0
    assert store.put(key, data) == 0


@pytest.mark.parametrize("damage", ["flip", "zero", "swap", "old_format"])
def test_damaged_page_fails_its_checksum_and_is_removed(backend, host_pool, damage):
    from kvstrata.storage.page_checksum import TRAILER_BYTES

    ks = unique_keys(3)
    host_pool[:3] = random_pages(3, seed=8)
    assert backend.batch_set(ks, [host_pool[i] for i in range(3)]) == 3
    good = [bytes(host_pool[i].numpy()) for i in range(3)]
    tampered = {"flip": bytes(b ^ 0xFF for b in good[1][:16]) + good[1][16:] + bytes(TRAILER_BYTES),
                "zero": bytes(PAGE_BYTES + TRAILER_BYTES),
                "old_format": good[1]}        # a page without a trailer (the previous format)
    if damage == "swap":                      # a valid page of another key, with its own trailer
        assert backend._store.get_size(ks[2]) == PAGE_BYTES + TRAILER_BYTES
        tampered["swap"] = bytes(backend._store.get(ks[2]))
    overwrite_object(backend, ks[1], tampered[damage])
    before = backend.stats()
    assert backend.batch_exists(ks) == 3
    out = [host_pool[10 + i] for i in range(3)]
    assert backend.batch_get(ks, out) == 1
    assert torch.equal(host_pool[10], host_pool[0])
    after = backend.stats()
    assert after["corrupt"] - before["corrupt"] == 1 and after["errors"] == before["errors"]
    assert backend.batch_exists(ks[1:2]) == 0                # removed from the store
    assert backend.batch_set(ks, [host_pool[i] for i in range(3)]) == 3
    assert backend.batch_get(ks, out) == 3 and torch.equal(host_pool[10:13], host_pool[0:3])


def test_staged_pages_carry_checksums_too(backend):
    ks = unique_keys(2)
    data = [random_pages(1, seed=9)[0].clone() for _ in range(2)]
    assert backend.batch_set(ks, data) == 2
    overwrite_object(backend, ks[0], bytes(PAGE_BYTES) + bytes(backend._store.get(ks[0]))[PAGE_BYTES:])
    out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in range(2)]
    assert backend.batch_get(ks, out) == 0
    assert backend.batch_get(ks[1:], out[1:]) == 1 and torch.equal(out[1], data[1])


def test_availability_follows_errors_when_the_store_service_dies(own_mooncake_cluster):
    cluster = own_mooncake_cluster
    b = quick_retry_backend(cluster)
    try:
        pool = random_pages(8, seed=7)
        b.register_buffer(pool)
        ks = unique_keys(4)
        assert b.batch_set(ks, [pool[i] for i in range(4)]) == 4
        assert b.stats()["available"]

        cluster.kill_store()             # the master still answers; every transfer fails
        deadline = time.monotonic() + 30
        while b.stats()["available"]:
            assert time.monotonic() < deadline, f"still 'available' with errors climbing: {b.stats()}"
            b.batch_get(ks, [pool[4 + i] for i in range(4)])
            b.batch_set(unique_keys(1), [pool[0]])
        down = b.stats()
        assert down["errors"] > 0 and down["outages"] == 1
        started = time.monotonic()
        for _ in range(10):              # down: answered at once, errors stop climbing (a probe per backoff)
            assert b.batch_get(ks, [pool[4 + i] for i in range(4)]) == 0
        assert time.monotonic() - started < 5.0
        stats = b.stats()
        assert not stats["available"] and stats["skipped_unavailable"] > down["skipped_unavailable"]
        assert stats["errors"] - down["errors"] <= 3 * 4

        cluster.start_store()            # re-probed after the backoff: back once a page is served
        fresh = unique_keys(2)
        deadline = time.monotonic() + 60
        while b.batch_set(fresh, [pool[0], pool[1]]) != 2:
            assert time.monotonic() < deadline, b.stats()
            time.sleep(0.2)
        assert b.stats()["available"] and b.batch_get(fresh, [pool[6], pool[7]]) == 2
    finally:
        b.close()
