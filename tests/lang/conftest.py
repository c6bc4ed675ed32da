"""Fixtures for the lang tests: one live server (tiny model, API key) and one in-process engine.

Both are package-scoped: started once for tests/lang and stopped (the server by PID, SIGTERM then
SIGKILL) after its last test, even when a test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

import kvstrata.lang as sgl
from kvstrata.net import free_port

API_KEY = "lang-test-key"
START_TIMEOUT_S = 180.0
REPO_ROOT = Path(__file__).resolve().parents[2]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(20)


@pytest.fixture(scope="package")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a `python -m kvstrata.launch_server` on the tiny model (requires API_KEY)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvstrata.launch_server", "--model-path", "tiny", "--host", "127.0.0.1",
           "--port", str(port), "--max-total-tokens", "8192", "--random-seed", "0", "--log-level", "warning",
           "--api-key", API_KEY, "--enable-deterministic-inference"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    log_path = tmp_path_factory.mktemp("lang-server") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="package")
def http_backend(server_url: str) -> Iterator[sgl.RuntimeEndpoint]:
    """RuntimeEndpoint on the live server."""
    backend = sgl.RuntimeEndpoint(server_url, api_key=API_KEY, timeout=120)
    yield backend
    backend.close()


@pytest.fixture(scope="package")
def engine_backend() -> Iterator[sgl.EngineBackend]:
    """EngineBackend owning an in-process engine with the server's settings."""
    backend = sgl.EngineBackend(model_path="tiny", max_total_tokens=8192, random_seed=0,
                                enable_deterministic_inference=True)
    yield backend
    backend.close()


@pytest.fixture(params=["http", "engine"])
def backend(request: pytest.FixtureRequest) -> sgl.Backend:
    """Each test that takes `backend` runs against the server and against the in-process engine."""
    return request.getfixturevalue(f"{request.param}_backend")
