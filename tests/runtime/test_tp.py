"""Tensor parallelism on CPU (one process per rank; the model's collectives through shared memory, the plans
through gloo): TP=2 against TP=1, and a rank's death.

Each TP=2 engine or server starts a second process that imports torch and loads its shard (seconds), so
there are few of them: one engine per dtype (multi-turn conversations over a small device pool: cold
prefills, device hits and host-tier load-backs) and one server for the fault.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests

from tests.cache.drivers import SMALL_TIERS as CACHE_SMALL_TIERS
from tests.cache.drivers import run_conversations
from tests.model.hf_ckpt import write_servable_moe_checkpoint
from tests.runtime.helpers import NUMERIC_DTYPES, PROMPTS, assert_idle_integrity, make_engine
from tests.server.conftest import launch_server, pid_alive, stop_server

GREEDY = {"temperature": 0, "max_new_tokens": 10}
# Multi-turn conversations overflowing a small device pool: cold prefills, device hits and host (L2) hits.
SMALL_TIERS = {**CACHE_SMALL_TIERS, "num_threads": 1}   # one thread per rank: see README (TP equality)


def _conversations(**kwargs) -> tuple[list[list[int]], list[int], dict]:
    with make_engine(**SMALL_TIERS, **kwargs) as engine:
        outputs, metas = run_conversations(engine)
        return outputs, [m["cached_tokens"] for m in metas], assert_idle_integrity(engine)


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES)
def test_tp2_greedy_output_is_identical_to_tp1_in_deterministic_mode_with_l1_and_l2(dtype):
    expected, expected_cached, one = _conversations(dtype=dtype)
    got, cached, two = _conversations(dtype=dtype, tp_size=2)
    assert got == expected
    assert cached == expected_cached       # the same hits, request by request
    for tier in ("device_hit_tokens", "host_hit_tokens"):
        assert two[tier] == one[tier] and two[tier] > 0, (tier, one, two)
    assert two["tp_size"] == 2 and len(two["tp_rank_pids"]) == 2 and two["tp_comm_calls"] > 0
    assert two["tp_collectives"] == "shm"      # the default for CPU ranks on one machine
    # Every rank executed the same plans and page copies (rank 0's cache decided them all).
    assert two["tp_ranks_agree"] and two["tp_ranks"][1]["copies"] > 0, two["tp_ranks"]


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES)
def test_moe_tp2_greedy_output_is_identical_to_one_rank_in_deterministic_mode(tmp_path, dtype):
    """--tp-size 2 alone splits inside each expert (shared memory), in both dtypes; --ep-size 2 splits whole
    experts: in float32 by id (gloo), in bfloat16 with spare copies of the experts a recorded load names,
    whose rows the ranks share batch by batch (shared memory)."""
    moe = write_servable_moe_checkpoint(str(tmp_path / "tiny-moe"))
    opts = {"model_path": moe, "num_threads": 1, "max_total_tokens": 1024, "dtype": dtype}
    # A 400-token prompt: ~100 rows per expert in its prefill, enough to split a replicated expert's rows.
    long = [3 + (i * 37) % 1000 for i in range(400)]
    with make_engine(**opts) as one:
        expected = [o["output_ids"] for o in one.generate(list(PROMPTS), GREEDY)]     # batched: many experts active
        expected_long = one.generate(input_ids=long, sampling_params=GREEDY)["output_ids"]
    assert len({tuple(o) for o in expected}) > 1
    splits = {"inside experts": {}}
    if dtype == "float32":     # --disable-custom-all-reduce: collectives through gloo (the others: shared memory)
        splits["whole experts"] = {"ep_size": 2, "disable_custom_all_reduce": True}
    else:    # 8 experts + 4 copies: 6 slots per rank; the counts make experts 7, 3, 5, 1 the busiest
        counts = json.dumps({"logical_count": [[1, 5, 1, 6, 1, 5, 1, 9]] * 2})
        splits["whole experts, spare copies"] = {"ep_size": 2, "ep_num_redundant_experts": 4,
                                                 "init_expert_location": counts}
    for split, flags in splits.items():
        with make_engine(**opts, tp_size=2, **flags) as two:
            got = [o["output_ids"] for o in two.generate(list(PROMPTS), GREEDY)]
            lone = two.generate(PROMPTS[0], GREEDY)["output_ids"]                      # the one-row decode path
            got_long = two.generate(input_ids=long, sampling_params=GREEDY)["output_ids"]
            state = two.get_server_info()["internal_states"][0]
        assert got == expected and lone == expected[0] and got_long == expected_long, split
        assert state["tp_collectives"] == ("gloo" if flags.get("disable_custom_all_reduce") else "shm"), split


def _health(url: str) -> int:
    try:
        return requests.get(url + "/health", timeout=2).status_code
    except requests.ConnectionError:
        return 0


def test_sigkill_of_a_rank_stops_the_whole_server_non_zero_within_30s(tmp_path):
    handle = launch_server(tmp_path, "--tp-size", "2")
    state = handle.scheduler_state()
    assert state["tp_collectives"] == "shm"
    pids = [handle.server_info()["scheduler_pid"], *state["tp_rank_pids"][1:]]
    try:
        r = handle.post("/generate", json={"text": "Hello", "sampling_params": GREEDY})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == GREEDY["max_new_tokens"]
        os.kill(pids[1], signal.SIGKILL)
        killed_at, statuses = time.monotonic(), set()
        while handle.proc.poll() is None:
            assert time.monotonic() - killed_at < 30, "the server still runs 30 s after a rank died"
            statuses.add(_health(handle.url))
            time.sleep(0.1)
        assert handle.proc.returncode != 0, handle.log()
        assert 503 in statuses, statuses
        assert "rank 1" in handle.log(), handle.log()
        while any(pid_alive(p) for p in pids):
            assert time.monotonic() - killed_at < 30, f"processes left behind: {[p for p in pids if pid_alive(p)]}"
            time.sleep(0.1)
    finally:
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        stop_server(handle)


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda", "cpu:gloo,cuda:nccl")])
def test_cuda_ranks_send_cpu_tensors_over_gloo_and_cuda_tensors_over_nccl(monkeypatch, device, backend):
    # The plans and the cache's agreements are CPU tensors, which NCCL cannot carry; no GPU here, so the
    # group's backend is checked where it is chosen.
    from types import SimpleNamespace

    from kvstrata.runtime import ranks

    asked = {}
    monkeypatch.setattr(ranks.TensorParallel, "init", staticmethod(lambda *a, **kw: asked.update(backend=a[3], kw=kw)))
    args = SimpleNamespace(device=device, tp_size=2, dist_timeout=None, enable_deterministic_inference=False,
                           ep_size=1, nnodes=1, disable_custom_all_reduce=False, disable_cpu_kernels=False,
                           init_expert_location="trivial", ep_num_redundant_experts=0)
    ranks.join_group(args, 0, "127.0.0.1:1")
    assert asked["backend"] == backend
    assert asked["kw"]["shm"] == (device == "cpu")    # shared memory only between CPU ranks
