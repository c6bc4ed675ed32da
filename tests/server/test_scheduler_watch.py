"""A frozen scheduler is visible: /health follows the scheduler loop's heartbeat, and --watchdog-timeout
kills a scheduler stuck in one iteration so that the server exits non-zero (real servers, SIGSTOP)."""

from __future__ import annotations

import os
import signal
import time

import requests

from tests.server.conftest import launch_server, pid_alive, stop_server


def _scheduler_pid(url: str) -> int:
    return requests.get(url + "/server_info", timeout=30).json()["scheduler_pid"]


def _health(url: str) -> int:
    return requests.get(url + "/health", timeout=5).status_code


def test_health_is_503_within_twice_the_heartbeat_bound_of_a_sigstop(tmp_path):
    bound = 1.0
    handle = launch_server(tmp_path, "--scheduler-heartbeat-timeout", str(bound), "--watchdog-timeout", "0")
    pid = _scheduler_pid(handle.url)
    try:
        time.sleep(2 * bound)                # idle for longer than the bound: the idle loop still beats
        assert _health(handle.url) == 200
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while _health(handle.url) != 503:
            assert time.monotonic() - stopped_at < 2 * bound, "a stopped scheduler still looks healthy"
            time.sleep(0.05)
        r = requests.get(handle.url + "/health", timeout=5)
        assert "no progress" in r.json()["error"]["message"]
        os.kill(pid, signal.SIGCONT)         # it recovers: healthy again
        deadline = time.monotonic() + 10
        while _health(handle.url) != 200:
            assert time.monotonic() < deadline, handle.log()
            time.sleep(0.05)
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
        stop_server(handle)


def test_watchdog_kills_a_stuck_scheduler_and_the_server_exits_non_zero(tmp_path):
    handle = launch_server(tmp_path, "--watchdog-timeout", "1", "--scheduler-heartbeat-timeout", "0.5")
    pid = _scheduler_pid(handle.url)
    try:
        os.kill(pid, signal.SIGSTOP)
        code = handle.proc.wait(30)
        assert code not in (0, None), handle.log()
        assert "--watchdog-timeout" in handle.log() and "killed" in handle.log()
        deadline = time.monotonic() + 10
        while pid_alive(pid):
            assert time.monotonic() < deadline, "scheduler process left behind"
            time.sleep(0.1)
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        stop_server(handle)
