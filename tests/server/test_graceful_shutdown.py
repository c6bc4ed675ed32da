"""SIGTERM while streams run: new requests get 503, running ones finish or end cleanly, exit 0, no child."""

from __future__ import annotations

import signal
import threading
import time

import requests

from tests.server.conftest import launch_server, pid_alive, stop_server
from tests.server.helpers import sse_events

N_STREAMS = 16
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}


def test_sigterm_drains_then_ends_every_stream_with_abort_and_done(tmp_path):
    server = launch_server(tmp_path, "--graceful-shutdown-timeout", "3", "--max-total-tokens", "32768")
    results: dict[str, object] = {}
    try:
        scheduler_pid = server.server_info()["scheduler_pid"]

        def stream(i: int) -> None:
            api = "/v1/chat/completions" if i % 2 else "/generate"
            body = ({"model": "tiny", "messages": [{"role": "user", "content": f"story {i}"}], "stream": True,
                     "max_tokens": LONG["max_new_tokens"], "ignore_eos": True, "temperature": 0}
                    if i % 2 else {"text": f"story {i}", "stream": True, "sampling_params": LONG})
            r = requests.post(server.url + api, json=body, stream=True, timeout=120)
            results[f"s{i}"] = (r.status_code, sse_events(r))

        def quick() -> None:          # running at SIGTERM, done within the drain timeout: answered normally
            r = requests.post(server.url + "/generate", timeout=120, json={
                "text": "quick", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}})
            results["quick"] = (r.status_code, r.json())

        def long_plain() -> None:     # still running at the timeout: a complete JSON error
            r = requests.post(server.url + "/generate", json={"text": "long", "sampling_params": LONG}, timeout=120)
            results["plain"] = (r.status_code, r.json())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(N_STREAMS)]
        threads += [threading.Thread(target=long_plain), threading.Thread(target=quick)]
        for t in threads:
            t.start()
        wait_running(server, N_STREAMS + 1)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = requests.post(server.url + "/generate", json={"text": "new"}, timeout=30)
        health = requests.get(server.url + "/health", timeout=30).status_code
        for t in threads:
            t.join(60)
        assert server.proc.wait(60) == 0
    finally:
        stop_server(server)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert health == 503                      # load balancers stop sending traffic
    status, body = results["quick"]
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "length", body
    for i in range(N_STREAMS):
        status, events = results[f"s{i}"]
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        final = events[-2]
        reason = final["choices"][0]["finish_reason"] if i % 2 else final["meta_info"]["finish_reason"]["type"]
        assert reason == "abort", final
    status, body = results["plain"]
    assert status == 503 and "shutting down" in body["error"]["message"]
    assert not pid_alive(scheduler_pid)


def wait_running(server, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server.scheduler_state()["running_requests"] + server.scheduler_state()["waiting_requests"] < count:
        assert time.monotonic() < deadline, server.scheduler_state()
        time.sleep(0.05)
    time.sleep(0.3)            # every stream has its first events by now
