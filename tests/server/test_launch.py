"""Launch and life cycle: API key, no torch in the HTTP process, clean shutdown without orphans, /health 503
when the scheduler dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from kvstrata.net import free_port
from tests.capabilities import requires_no_cuda
from tests.server.conftest import launch_server, pid_alive, stop_server


def test_api_key_is_enforced(server):
    url = server.url
    assert requests.get(url + "/v1/models", timeout=30).status_code == 401
    wrong = requests.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    r = requests.post(url + "/generate", json={"text": "a"}, timeout=30)
    assert r.status_code == 401
    assert requests.get(url + "/health", timeout=30).status_code == 200      # open for probes
    assert server.get("/v1/models").status_code == 200


def test_http_process_has_no_torch_and_serves_resolved_args(server):
    # torch is ~220 MB of RSS: only the scheduler process may load it (tokenizer: LightTokenizer, device: scheduler).
    with open(f"/proc/{server.proc.pid}/maps") as fh:
        maps = fh.read()
    assert "libtorch" not in maps and "libc10" not in maps
    assert server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}).status_code == 200
    info = server.server_info()
    assert info["device"] in ("cpu", "cuda") and info["dtype"] in ("float32", "bfloat16", "float16")
    assert info["chunked_prefill_size"] > 0
    with open(f"/proc/{server.proc.pid}/maps") as fh:
        assert "libtorch" not in fh.read()


@requires_no_cuda
def test_cuda_without_cuda_is_a_flag_error():
    r = subprocess.run([sys.executable, "-m", "kvstrata.launch_server", "--device", "cuda", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2 and "--device cuda requested but CUDA is not available" in r.stderr, r.stderr


def test_invalid_flags_fail_with_a_message():
    r = subprocess.run([sys.executable, "-m", "kvstrata.launch_server", "--page-size", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "page-size" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signal_shuts_down_without_orphans(tmp_path, sig):
    handle = launch_server(tmp_path)
    try:
        assert "ready at " + handle.url in handle.log()
        r = requests.post(handle.url + "/generate", json={"text": "no key needed",
                                                          "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200
        scheduler_pid = requests.get(handle.url + "/server_info", timeout=30).json()["scheduler_pid"]
        assert pid_alive(scheduler_pid)
        os.kill(handle.proc.pid, sig)
        code = handle.proc.wait(30)
        # SIGKILL cannot be handled: the scheduler must still go (it dies with its parent).
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0), handle.log()
        deadline = time.monotonic() + 10
        while pid_alive(scheduler_pid):
            assert time.monotonic() < deadline, "scheduler process left behind"
            time.sleep(0.1)
    finally:
        stop_server(handle)


def test_health_503_and_exit_when_the_scheduler_dies(tmp_path):
    handle = launch_server(tmp_path)
    try:
        scheduler_pid = requests.get(handle.url + "/server_info", timeout=30).json()["scheduler_pid"]
        body = {"text": "a long one", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        stream = requests.post(handle.url + "/generate", json=body, stream=True, timeout=60)
        lines = stream.iter_lines(decode_unicode=True)
        next(line for line in lines if line)          # the request is running
        os.kill(scheduler_pid, signal.SIGKILL)
        tail = [line for line in lines if line]
        assert tail[-1] == "data: [DONE]" and '"error"' in tail[-2]     # the error goes down the stream
        saw_503 = False
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not saw_503:
            try:
                saw_503 = requests.get(handle.url + "/health", timeout=5).status_code == 503
            except requests.ConnectionError:
                break
            time.sleep(0.05)
        assert saw_503, handle.log()
        gen = requests.post(handle.url + "/generate", json={"text": "a"}, timeout=30)
        assert gen.status_code == 503
        assert handle.proc.wait(30) not in (0, None)
    finally:
        stop_server(handle)


def test_file_l3_has_a_default_capacity_and_the_http_process_still_has_no_torch(tmp_path):
    l3 = tmp_path / "l3"
    handle = launch_server(tmp_path, "--enable-hierarchical-cache", "--hicache-ratio", "1.5",
                           "--hicache-storage-backend", "file", "--hicache-storage-dir", str(l3))
    try:
        backend = handle.scheduler_state()["hicache"]["storage"]["backend"]
        assert 0 < backend["capacity_bytes"] < float("inf"), backend
        assert backend["capacity_source"].startswith("default"), backend
        assert handle.get("/load").json()["storage_id"] == f"file:{l3}"
        with open(f"/proc/{handle.proc.pid}/maps") as fh:     # /load names the file L3 without torch
            maps = fh.read()
        assert "libtorch" not in maps and "libc10" not in maps
    finally:
        stop_server(handle)


def test_the_http_port_is_held_but_refuses_connections_until_the_server_is_ready():
    """Bound before the model loads (a busy port fails fast), listening only when the app serves: a probe
    during a long load is refused at once instead of hanging on a connection nobody accepts."""
    import socket

    from kvstrata.server.launch import bind_http_socket

    port = free_port()
    held = bind_http_socket("127.0.0.1", port)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        rival = socket.socket()
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        rival.bind(("127.0.0.1", port))        # SO_REUSEADDR lets a non-listening bind share the port ...
        rival.listen(1)
        with pytest.raises(SystemExit, match=f"cannot listen on 127.0.0.1:{port}"):
            bind_http_socket("127.0.0.1", port)   # ... but a port someone listens on is refused
        rival.close()
    finally:
        held.close()
