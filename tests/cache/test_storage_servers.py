"""Two server processes on one real Mooncake cluster: a conversation started on A continues on B from L3."""

from __future__ import annotations

import json
import time

import pytest

from tests.server.conftest import launch_server, stop_server

TURN = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def generate(server, input_ids: list[int]) -> dict:
    r = server.post("/generate", json={"input_ids": input_ids, "sampling_params": TURN})
    assert r.status_code == 200, r.text
    return r.json()


def wait_backed_up(server, timeout: float = 30.0) -> None:
    """Poll until every token in the server's tree has its L3 object (one object per token here).

    A finished request's pages reach L3 later (host copy, then the store's put): a second server asks L3
    for them only once they have landed, or it rightly misses."""
    deadline = time.monotonic() + timeout
    while True:
        tree = server.scheduler_state()["hicache"]
        if tree["storage"]["backed_up_objects"] >= tree["tree_tokens"]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"L3 writes still pending after {timeout} s: {tree}")
        time.sleep(0.05)


@pytest.mark.mooncake
def test_conversation_moves_between_servers(own_mooncake_cluster, tmp_path):
    config = json.dumps(own_mooncake_cluster.client_config())
    flags = ["--enable-hierarchical-cache", "--hicache-ratio", "1.5", "--hicache-storage-backend", "mooncake",
             "--hicache-storage-page-tokens", "1",   # histories of ~50 tokens: one object per page
             "--hicache-storage-backend-extra-config", config, "--hicache-storage-prefetch-policy",
             "wait_complete"]
    a = launch_server(tmp_path, *flags)
    try:
        b = launch_server(tmp_path, *flags)
    except BaseException:
        stop_server(a)
        raise
    try:
        histories = [[(7 * c + 3 * i) % 900 + 5 for i in range(40 + 9 * c)] for c in range(3)]
        for c, hist in enumerate(histories):
            out = generate(a, hist)
            histories[c] = hist + out["output_ids"]
        a.wait_idle()
        wait_backed_up(a)
        for hist in histories:
            prompt = hist + [11, 12, 13, 14]
            meta = generate(b, prompt)["meta_info"]
            assert meta["cached_tokens"] >= 0.9 * len(hist), (meta, len(hist))
        state = b.wait_idle()
        assert state["storage_hit_tokens"] > 0
        assert state["hicache"]["storage"]["backend"]["errors"] == 0
    finally:
        stop_server(a)
        stop_server(b)
