"""A user's SGLang launch line against a real server: the queue limit (503 + Retry-After at once), the stream
interval, the `priority` field, and a Hugging Face id served from a local hub cache (no network)."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import pytest
import requests

from tests.model.fake_hub import MAIN_REV, OLD_REV, make_fake_hub, snapshot_dir
from tests.server.conftest import REPO_ROOT, launch_server, stop_server
from tests.server.helpers import sse_events

LONG = {"temperature": 0, "max_new_tokens": 256, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    handle = launch_server(tmp_path_factory.mktemp("limited"), "--max-queued-requests", "4",
                           "--max-running-requests", "2", "--stream-interval", "4", "--enable-priority-scheduling")
    try:
        yield handle
    finally:
        stop_server(handle)


def test_a_full_queue_answers_503_with_retry_after_at_once_and_the_rest_complete(limited):
    def one(i: int) -> tuple[int, float, requests.Response]:
        start = time.monotonic()
        r = requests.post(limited.url + "/generate", timeout=300,
                          json={"text": f"request {i} about caches and pages", "sampling_params": LONG})
        return r.status_code, time.monotonic() - start, r

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    statuses = [status for status, *_ in results]
    assert set(statuses) <= {200, 503}, statuses
    refused = [(t, r) for status, t, r in results if status == 503]
    served = [(t, r) for status, t, r in results if status == 200]
    assert len(served) >= 4 and len(refused) >= 20 - 2 - 4 - 4, statuses
    for _, r in refused:
        assert r.headers.get("Retry-After") == "1"
        assert r.json()["error"]["message"] == "The request queue is full."
    for _, r in served:
        assert r.json()["meta_info"]["completion_tokens"] == 256
    assert max(t for t, _ in refused) < min(t for t, _ in served)     # refused at once, not after waiting
    assert limited.wait_idle()["waiting_requests"] == 0


def test_stream_interval_sends_a_chunk_every_n_tokens(limited):
    r = requests.post(limited.url + "/generate", stream=True, timeout=120, json={
        "text": "count", "stream": True, "sampling_params": {**LONG, "max_new_tokens": 13}})
    assert r.status_code == 200
    counts = [len(e["output_ids"]) for e in sse_events(r) if isinstance(e, dict) and "output_ids" in e]
    assert counts == [1, 5, 9, 13], counts       # the first token at once, then every 4


def test_priority_is_a_request_field(limited):
    ok = requests.post(limited.url + "/generate", timeout=120,
                       json={"text": "hi", "priority": 7, "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200
    chat = requests.post(limited.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -3})
    assert chat.status_code == 200
    bad = requests.post(limited.url + "/generate", timeout=30, json={"text": "hi", "priority": "high"})
    assert bad.status_code == 400 and "'priority' must be an integer" in bad.json()["error"]["message"]


REPO_ID = "kvstrata-test/tiny"


@pytest.mark.parametrize("revision", [None, OLD_REV])
def test_a_hugging_face_id_is_served_from_the_local_cache(tmp_path, monkeypatch, revision):
    hub = make_fake_hub(tmp_path / "hub", REPO_ID)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    extra = ["--revision", revision] if revision else []
    handle = launch_server(tmp_path, "--model-path", REPO_ID, *extra)
    try:
        info = handle.get("/get_model_info").json()
        assert info["model_path"] == snapshot_dir(hub, REPO_ID, revision or MAIN_REV)
        assert [m["id"] for m in handle.get("/v1/models").json()["data"]] == [REPO_ID]
        r = handle.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    finally:
        stop_server(handle)


def test_an_unknown_id_stops_the_start_with_a_clear_message(tmp_path):
    hub = make_fake_hub(tmp_path / "hub", REPO_ID)
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT),
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "kvstrata.launch_server", "--model-path", "org/missing"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert out.returncode == 2
    assert "'org/missing' not found" in out.stderr and str(hub) in out.stderr
    assert "huggingface-cli download org/missing" in out.stderr
