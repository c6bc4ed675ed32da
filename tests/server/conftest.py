"""Fixtures: real kvstrata servers (`python -m kvstrata.launch_server`) on free 127.0.0.1 ports.

Each server is a subprocess in its own session, stopped by PID at the end (SIGTERM, then SIGKILL),
even when a test fails. The shared server runs with an API key, so every client here sends it.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import requests

from kvstrata.bench.launcher import ServerProcess
from kvstrata.net import free_port

API_KEY = "test-secret-key"
START_TIMEOUT_S = 180.0
REPO_ROOT = Path(__file__).resolve().parents[2]
# Deterministic inference: tests compare outputs across batch shapes, which must hold in bf16 too.
BASE_FLAGS = ["--max-total-tokens", "4096", "--random-seed", "0", "--log-level", "warning",
              "--enable-deterministic-inference"]


class ServerHandle:
    """A running server subprocess and small helpers to talk to it."""

    def __init__(self, process: ServerProcess, api_key: Optional[str]):
        self.process = process
        self.proc: subprocess.Popen = process.proc
        self.url = process.url
        self.api_key = api_key
        self.log_path = process.log_path

    @property
    def headers(self) -> dict[str, str]:
        """Authorization header (empty without an API key)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kw: Any) -> requests.Response:
        """GET with the API key."""
        return requests.get(self.url + path, headers=self.headers, timeout=kw.pop("timeout", 60), **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        """POST with the API key."""
        return requests.post(self.url + path, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def server_info(self) -> dict:
        """GET /server_info as a dict."""
        r = self.get("/server_info")
        r.raise_for_status()
        return r.json()

    def scheduler_state(self) -> dict:
        """The scheduler's internal state (slot accounting: free_pages, running_requests, ...)."""
        return self.server_info()["internal_states"][0]

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll until no request runs or waits in the scheduler; returns that state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.scheduler_state()
            if state["running_requests"] == 0 and state["waiting_requests"] == 0:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"scheduler still busy after {timeout} s: {state}")
            time.sleep(0.05)

    def log(self) -> str:
        """The server's combined stdout/stderr so far."""
        return self.log_path.read_text(errors="replace")


def server_env() -> dict[str, str]:
    """What the test servers run with: one OpenMP thread, quiet tokenizers, this checkout first on the path."""
    return {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def launch_server(log_dir: Path, *extra: str, api_key: Optional[str] = None) -> ServerHandle:
    """Start a server with the tiny model and wait until /health answers 200 (bench.launcher's rule)."""
    port = free_port()
    flags = [*BASE_FLAGS, *extra] + (["--api-key", api_key] if api_key else [])
    process = ServerProcess(flags, str(log_dir / f"server-{port}.log"), port=port, env=server_env())
    process.start(START_TIMEOUT_S)
    return ServerHandle(process, api_key)


def stop_server(handle: ServerHandle, timeout: float = 20.0) -> Optional[int]:
    """SIGTERM the server by PID, SIGKILL it if it does not exit in time; returns its exit code."""
    return handle.process.stop(timeout)


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The shared server (tiny model, API key required)."""
    handle = launch_server(tmp_path_factory.mktemp("server"), api_key=API_KEY)
    try:
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture(scope="session")
def openai_client(server: ServerHandle):
    """An official `openai` client pointed at the shared server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
