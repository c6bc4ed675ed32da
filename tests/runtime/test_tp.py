"""Tensor parallelism on CPU (gloo, one process per rank): TP=2 against TP=1, and a rank's death.

Each TP=2 engine or server starts a second process that imports torch and loads its shard (seconds), so
there are few of them: one engine per dtype (each prompt runs cold, then again from the L1 cache) and one
server for the fault.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.runtime.helpers import NUMERIC_DTYPES, PROMPTS, assert_idle_integrity, make_engine
from tests.server.conftest import launch_server, pid_alive, stop_server

GREEDY = {"temperature": 0, "max_new_tokens": 10}
# Cold prompts, then the same prompts again (device-cache hits) and one that extends a cached prompt.
WORKLOAD = [PROMPTS[1], PROMPTS[4], PROMPTS[6], PROMPTS[1], PROMPTS[4] + " And once more.", PROMPTS[6]]


def _run(engine) -> tuple[list[list[int]], list[int]]:
    ids, cached = [], []
    for prompt in WORKLOAD:      # one at a time: the repeats must find their prompt in the cache
        out = engine.generate(prompt, GREEDY)
        ids.append(out["output_ids"])
        cached.append(out["meta_info"]["cached_tokens"])
    return ids, cached


@pytest.mark.parametrize("dtype", NUMERIC_DTYPES)
def test_tp2_greedy_output_is_identical_to_tp1_in_deterministic_mode(dtype):
    with make_engine(dtype=dtype, num_threads=1) as one:
        expected, expected_cached = _run(one)
    with make_engine(dtype=dtype, num_threads=1, tp_size=2) as two:
        got, cached = _run(two)
        state = assert_idle_integrity(two)
    assert got == expected
    assert cached == expected_cached and sum(cached[3:]) > 0, cached    # the repeats hit the device cache
    assert state["tp_size"] == 2 and len(state["tp_rank_pids"]) == 2 and state["tp_comm_calls"] > 0


def _health(url: str) -> int:
    try:
        return requests.get(url + "/health", timeout=2).status_code
    except requests.ConnectionError:
        return 0


def test_sigkill_of_a_rank_stops_the_whole_server_non_zero_within_30s(tmp_path):
    handle = launch_server(tmp_path, "--tp-size", "2")
    state = handle.scheduler_state()
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
