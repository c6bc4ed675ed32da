"""A server with --hicache-snapshot-path stopped by SIGTERM comes back with its L2: returning prompts hit."""

from __future__ import annotations

import os

from tests.server.conftest import launch_server, stop_server

FLAGS = ["--enable-hierarchical-cache", "--hicache-ratio", "8", "--max-total-tokens", "96",
         "--chunked-prefill-size", "32"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def generate(server, ids: list[int]) -> dict:
    r = server.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def test_sigterm_saves_l2_and_the_next_start_serves_it(tmp_path):
    path = tmp_path / "l2.snapshot"
    histories = [[(7 * c + 13 * i) % 500 + 3 for i in range(40)] for c in range(3)]
    first = launch_server(tmp_path, *FLAGS, "--hicache-snapshot-path", str(path))
    try:
        answers = [generate(first, h)["output_ids"] for h in histories]
    finally:
        assert stop_server(first) == 0
    assert path.stat().st_size > 0

    second = launch_server(tmp_path, *FLAGS, "--hicache-snapshot-path", str(path))
    try:
        loaded = second.scheduler_state()["hicache"]["snapshot"]["last_load"]
        assert loaded["tokens"] >= 3 * 40 and not loaded["rejected"], loaded
        assert not os.path.exists(path)
        for history, answer in zip(histories, answers):
            again = generate(second, history)
            assert again["output_ids"] == answer
            assert again["meta_info"]["cached_tokens"] >= len(history) - 1, again["meta_info"]
        state = second.wait_idle()
        assert state["host_hit_tokens"] > 0 and state.get("integrity_ok"), state
    finally:
        assert stop_server(second) == 0
    assert path.exists()             # and the second clean stop wrote a new one
