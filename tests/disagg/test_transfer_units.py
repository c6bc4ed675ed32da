"""Units of the handoff: write plans over slot runs, the loopback backend, bootstrap fields, router PD flags."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvstrata.args import ConfigError
from kvstrata.disagg.transfer import LoopbackTransfer, TransferError, plan_writes, register_pool, slot_runs
from kvstrata.memory.device_pool import DeviceKVPool
from kvstrata.router.args import RouterArgs
from kvstrata.server.disagg_fields import parse_bootstrap
from kvstrata.serving.errors import ApiError


def test_slot_runs_coalesce_only_where_both_sides_are_consecutive():
    assert slot_runs([4, 5, 6, 9, 10], [8, 9, 10, 11, 3]) == [(4, 8, 3), (9, 11, 1), (10, 3, 1)]
    assert slot_runs([], []) == []


def _pool(seed: int) -> DeviceKVPool:
    pool = DeviceKVPool(num_pages=8, page_size=4, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                        device="cpu")
    g = torch.Generator().manual_seed(seed)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=g))
    return pool


def test_plan_writes_moves_exactly_the_mapped_slots_in_every_layer():
    src, dst = _pool(1), _pool(2)
    untouched = [b.clone() for b in (*dst.k_buffer, *dst.v_buffer)]
    transfer = LoopbackTransfer()
    register_pool(transfer, dst)
    src_slots, dst_slots = [4, 5, 6, 7, 12, 13], [20, 21, 22, 23, 8, 9]
    slot_bytes = 2 * 4 * 4
    ptrs = lambda p: ([k.data_ptr() for k in p.k_buffer], [v.data_ptr() for v in p.v_buffer])  # noqa: E731
    plan = plan_writes(src_slots, dst_slots, ptrs(src), ptrs(dst), slot_bytes)
    assert len(plan[0]) == 2 * 3 * 2               # two runs, in each of 3 layers' K and V
    transfer.write("peer", *plan)
    for s_buf, d_buf, before in zip((*src.k_buffer, *src.v_buffer), (*dst.k_buffer, *dst.v_buffer), untouched):
        assert torch.equal(d_buf[dst_slots], s_buf[src_slots])
        others = [i for i in range(d_buf.shape[0]) if i not in dst_slots]
        assert torch.equal(d_buf[others], before[others])


def test_loopback_refuses_unregistered_destinations():
    src = torch.ones(16)
    with pytest.raises(TransferError):
        LoopbackTransfer().write("peer", [src.data_ptr()], [torch.zeros(16).data_ptr()], [64])
    with pytest.raises(ValueError):
        plan_writes([1, 2], [3], ([0], [0]), ([0], [0]), 8)


def test_parse_bootstrap():
    assert parse_bootstrap({"text": "x"}) is None
    info = parse_bootstrap({"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2 ** 62})
    assert info.address == "tcp://10.0.0.1:8998" and info.room == 2 ** 62
    for bad in ({"bootstrap_room": 1}, {"bootstrap_host": "h", "bootstrap_port": 0, "bootstrap_room": 1},
                {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1.5}):
        with pytest.raises(ApiError):
            parse_bootstrap(bad)


def _router_args(argv: str) -> RouterArgs:
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    return RouterArgs.from_cli_args(parser.parse_args(argv.split()))


def test_router_pd_flags_follow_sglang():
    from kvstrata.router.pd import parse_prefill, pd_worker_urls

    a = _router_args("--pd-disaggregation --prefill http://127.0.0.1:1 9000 --prefill http://127.0.0.1:2 "
                     "--decode http://127.0.0.1:3 --prefill-policy random --decode-policy round_robin")
    assert [parse_prefill(e) for e in a.prefill] == [("http://127.0.0.1:1", 9000), ("http://127.0.0.1:2", 8998)]
    assert pd_worker_urls(a) == ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
    for bad in ("--pd-disaggregation --decode http://127.0.0.1:3",
                "--prefill http://127.0.0.1:1 --decode http://127.0.0.1:3",
                "--pd-disaggregation --prefill http://127.0.0.1:1 x --decode http://127.0.0.1:3",
                "--pd-disaggregation --prefill http://127.0.0.1:1 --decode http://127.0.0.1:3 "
                "--worker-urls http://127.0.0.1:4"):
        with pytest.raises(ConfigError):
            _router_args(bad)


def test_mooncake_engine_writes_a_fragmented_plan_in_several_batches(mooncake_env):
    """4096 ranges: more than one batch of this Mooncake build holds; every range lands, nothing else."""
    from kvstrata.disagg.transfer import MAX_BATCH_SLICES, MooncakeTransfer

    local, peer = MooncakeTransfer("127.0.0.1"), MooncakeTransfer("127.0.0.1")
    src = torch.arange(1 << 20, dtype=torch.int32)
    dst = torch.zeros_like(src)
    local.register(src.data_ptr(), src.numel() * 4)
    peer.register(dst.data_ptr(), dst.numel() * 4)
    starts = list(range(0, 1 << 20, 256))[:4096]
    assert len(starts) > 2 * MAX_BATCH_SLICES
    local.write(peer.session_id, [src.data_ptr() + 4 * s for s in starts], [dst.data_ptr() + 4 * s for s in starts],
                [64] * len(starts))
    written = torch.zeros_like(src, dtype=torch.bool)
    for s in starts:
        written[s:s + 16] = True
    assert torch.equal(dst[written], src[written])
    assert not dst[~written].any()
