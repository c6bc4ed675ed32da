"""Many parallel streaming clients; clients that disconnect free their KV slots."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import requests

from tests.server.helpers import sse_events

N_CLIENTS = 32
PARAMS = {"temperature": 0, "max_new_tokens": 8}


def test_32_parallel_streaming_clients_get_correct_output(server):
    prompts = [f"Client {i} says: the number {i * 7} is" for i in range(N_CLIENTS)]
    expected = server.post("/generate", json={"text": prompts, "sampling_params": PARAMS}).json()

    def stream_one(i: int) -> dict:
        r = requests.post(server.url + "/generate", headers=server.headers, stream=True, timeout=120,
                          json={"text": prompts[i], "sampling_params": PARAMS, "stream": True})
        assert r.status_code == 200, r.text
        events = sse_events(r)
        assert events[-1] == "[DONE]"
        return events[-2]

    with ThreadPoolExecutor(N_CLIENTS) as pool:
        finals = list(pool.map(stream_one, range(N_CLIENTS)))
    for got, want in zip(finals, expected, strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def _baseline(server) -> dict:
    server.wait_idle()
    assert server.post("/flush_cache").status_code == 200
    state = server.scheduler_state()
    assert state.get("integrity_ok", True)
    return state


def _assert_aborted_and_back_to(server, baseline: dict) -> None:
    server.wait_idle(timeout=20)
    assert server.post("/flush_cache").status_code == 200
    state = server.scheduler_state()
    assert state["aborted_requests"] == baseline["aborted_requests"] + 1, (baseline, state)
    assert state["free_pages"] == baseline["free_pages"], (baseline, state)
    assert state.get("integrity_ok", True), state


def _raw_post(server, body: bytes) -> socket.socket:
    """Send a POST /generate on a raw socket (so that the test controls when the connection closes)."""
    url = urlparse(server.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    head = (f"POST /generate HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(body)}\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


LONG = b'{"text": "Tell me a very long story", "sampling_params": {"max_new_tokens": 3500, "ignore_eos": true}'


def test_disconnect_mid_stream_aborts_and_frees_slots(server):
    baseline = _baseline(server)
    sock = _raw_post(server, LONG + b', "stream": true}')
    received = b""
    while received.count(b"data: ") < 3:          # a few tokens streamed: the request holds KV now
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the stream early: {received!r}"
        received += chunk
    assert server.scheduler_state()["running_requests"] == 1
    sock.close()
    _assert_aborted_and_back_to(server, baseline)


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts(server):
    baseline = _baseline(server)
    sock = _raw_post(server, LONG + b"}")
    deadline = time.monotonic() + 20
    while server.scheduler_state()["running_requests"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    sock.close()
    _assert_aborted_and_back_to(server, baseline)
